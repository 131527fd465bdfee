"""Qwen2.5-Omni end to end without vLLM-Omni: stock vLLM's thinker, transformers' talker and Token2Wav.

The shipped sample manifests/samples/speech.yaml, with the tiny seeded Qwen2.5-Omni (devsetup.tiny_omni,
built with this environment's transformers) and CPU engine sizes, behind the master: the thinker an `llm`
stage (stock vLLM) whose engine carries omnifleet's hidden-states tap (engines/hidden.py, vLLM's worker
extension), the talker and code2wav `torch` stages (omnifleet_runtime.qwen2_5_omni, transformers' own
modules), code2wav in the talker's pod. The oracle is transformers' one-process
`Qwen2_5OmniForConditionalGeneration.generate` on the same checkpoint and prompt (greedy thinker and
talker; the global generator seeded just before, so Token2Wav's noise is its first draw, as code2wav's
seed makes it in its stage): the thinker's tokens must be equal and the audio equal sample for sample.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from array import array

import pytest

from fleet_harness import Fleet  # noqa: E402

from ..conftest import time_limit  # noqa: E402
from .conftest import HEARTBEAT, engine_env, media, report, tiny_omni_path  # noqa: E402
from .qwen_omni_twin import PROMPT, REPETITION_PENALTY, SPEAKER, TALKER_TOKENS, THINKER_TOKENS, twin  # noqa: E402
from .qwen_omni_twin import oracle as twin_oracle  # noqa: E402

pytestmark = [pytest.mark.vllm]
TEST_TIMEOUT_S = 900

REQUEST_TIMEOUT_S = 300  # a whole answer: thinker, talker and Token2Wav on a loaded 2-core CPU
HIDDEN_TOLERANCE = 1e-4  # float32 on both sides; vLLM's CPU kernels sum in another order than torch's


@pytest.fixture(autouse=True)
def overall_timeout():
    with time_limit(TEST_TIMEOUT_S):
        yield


@pytest.fixture(scope="module")
def tiny_omni() -> str:
    return tiny_omni_path()


@pytest.fixture(scope="module")
def oracle(tiny_omni, tmp_path_factory, request) -> dict:
    t = time.monotonic()
    result = twin_oracle(tiny_omni, tmp_path_factory.mktemp("qwen-omni-hf"), engine_env())
    report(request.config, "qwen-omni-stock", f"oracle (transformers' generate, one process): "
           f"{time.monotonic() - t:.1f}s; thinker tokens {result['token_ids']}, {len(result['codes'])} talker codes")
    return result


@pytest.fixture(scope="module")
def media_oracle(tiny_omni, tmp_path_factory, request) -> dict:
    """transformers' answer to the chat with an image and a second of audio (its processor makes the prompt)."""
    t = time.monotonic()
    result = twin_oracle(tiny_omni, tmp_path_factory.mktemp("qwen-omni-hf-media"), engine_env(), media()[1])
    report(request.config, "qwen-omni-stock", f"oracle with an image and audio: {time.monotonic() - t:.1f}s; prompt "
           f"{len(result['prompt_token_ids'])} tokens, thinker tokens {result['token_ids']}")
    return result


def doc(model: str) -> dict:
    d = twin(model, HEARTBEAT)
    # The talker's codes are a final output too, asked for by the media test only: a chat answer's audio is
    # 16-bit, and this tiny model's audio is below one 16-bit step.
    assert d["spec"]["stages"][1]["name"] == "talker"
    d["spec"]["stages"][1]["finalOutput"] = "action"
    return d


@pytest.fixture(scope="module")
def fleet(tiny_omni, oracle, tmp_path_factory, request):
    f = Fleet(tmp_path_factory.mktemp("qwen-omni-stock"), doc(tiny_omni))
    f.env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    t = time.monotonic()
    try:
        f.start_master()
        f.start_pod("thinker-0", "thinker")
        f.start_pod("talker-0", "talker", "code2wav")  # code2wav is co-located with the talker
        f.wait_ready(timeout=600)
        report(request.config, "qwen-omni-stock", f"fleet of 2 pods (thinker; talker + code2wav) ready in "
               f"{time.monotonic() - t:.1f}s")
        yield f
    except BaseException:
        print(f.logs()[-30000:])
        raise
    finally:
        f.stop()


def test_text_and_audio_equal_transformers_own_generate(fleet, oracle, request):
    """The thinker's tokens are transformers'; its hidden states on the wire make the talker's codes, and the
    codes code2wav's audio: equal to transformers' one-process audio, sample for sample (float32)."""
    t = time.monotonic()
    status, body = fleet.http("POST", "/v1/completions", {
        "model": "speech", "prompt": PROMPT, "return_token_ids": True, "modalities": ["text", "audio"]},
        timeout=REQUEST_TIMEOUT_S)
    took = time.monotonic() - t
    assert status == 200, body
    choice = body["choices"][0]
    assert oracle["token_ids"] and choice["token_ids"] == oracle["token_ids"], (choice["token_ids"], oracle)
    [chunk] = [o["data"] for o in choice.get("omni", []) if o["type"] == "audio"]
    assert chunk["audio"]["dtype"] == "float32" and chunk["sample_rate"] == 24000, chunk
    got = array("f", base64.b64decode(chunk["audio"]["data"]))
    want = oracle["audio"]
    assert oracle["codes"] and len(want) == oracle["audio_samples"] > 0
    assert max(abs(x) for x in want) > 0, "the oracle's audio is all zeros"
    assert len(got) == len(want), (len(got), len(want))
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert got == want, f"audio differs from transformers' by up to {worst}"
    report(request.config, "qwen-omni-stock", f"through omnifleet (3 stages, 2 pods): {took:.2f}s; thinker tokens "
           f"{choice['token_ids']}, {len(got)} float32 samples from {len(oracle['codes'])} talker codes, equal to "
           f"transformers' one-process generate (largest difference {worst:.3g})")


def test_an_image_and_audio_in_speech_out_equal_transformers_own_generate(fleet, media_oracle, request):
    """A chat with an image and a second of audio, audio out: the thinker's tokens are transformers' for the
    prompt its processor makes, and the talker's codes (the media's rows of its input zeroed, as transformers'
    generate does) are transformers' codes, which code2wav turns into transformers' samples (the text test)."""
    t = time.monotonic()
    status, body = fleet.http("POST", "/v1/chat/completions", {
        "model": "speech", "messages": media()[0], "modalities": ["text", "audio", "action"],
        "return_token_ids": True, "audio": {"voice": SPEAKER, "format": "pcm16"}}, timeout=REQUEST_TIMEOUT_S)
    took = time.monotonic() - t
    assert status == 200, body
    choice, want = body["choices"][0], media_oracle
    assert body["usage"]["prompt_tokens"] == len(want["prompt_token_ids"]), (body["usage"], want["prompt_token_ids"])
    assert want["token_ids"] and choice["token_ids"] == want["token_ids"], (choice["token_ids"], want["token_ids"])
    [talker] = [o["data"] for o in choice["message"].get("omni", []) if o["stage"] == "talker"]
    codes = talker["codes"]
    assert codes["dtype"] == "int64", codes
    got = array("q", base64.b64decode(codes["data"])).tolist()
    assert want["codes"] and got == want["codes"], (got, want["codes"])
    # code2wav turns equal codes into transformers' samples (the text test's float32 comparison); here, where
    # the answer is 16-bit, its length
    pcm = base64.b64decode(choice["message"]["audio"]["data"])
    assert len(want["audio"]) == want["audio_samples"] == len(pcm) // 2 > 0, (len(pcm), want["audio_samples"])
    report(request.config, "qwen-omni-stock", f"image + audio in, text and audio out: {took:.2f}s; prompt "
           f"{body['usage']['prompt_tokens']} tokens, thinker tokens {choice['token_ids']} and {len(got)} talker "
           f"codes as transformers' one-process generate's")


def test_the_voice_of_a_chat_request_picks_the_speaker(fleet):
    """chat's `audio.voice` reaches the talker (and code2wav) as its speaker, in any case; a voice the model
    does not have is a 400 naming the ones it has."""
    body = {"model": "speech", "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}
    status, ok = fleet.http("POST", "/v1/chat/completions", {**body, "audio": {"voice": "ethan", "format": "pcm16"}},
                            timeout=REQUEST_TIMEOUT_S)
    assert status == 200, ok
    assert len(base64.b64decode(ok["choices"][0]["message"]["audio"]["data"])) == 2 * 480 * TALKER_TOKENS
    status, refused = fleet.http("POST", "/v1/chat/completions",
                                 {**body, "audio": {"voice": "alloy", "format": "pcm16"}})
    assert status == 400, refused
    assert "unknown voice 'alloy' (this model speaks as Chelsie, Ethan)" in json.dumps(refused), refused


def test_the_talker_batched_gives_each_request_the_codes_it_gets_alone(tiny_omni, request):
    """The talker stage's forward_batch (what the torch engine calls with the requests that arrive together):
    greedy, with the sample's repetition penalty, four requests of different prompt and reply lengths (one
    with a single thinker token, one with an image placeholder in its prompt, one in another voice) get in
    one batch the codes each gets alone; an input the talker cannot take is a BadInput in its place."""
    import torch

    from omnifleet_runtime.engines.base import BadInput
    from omnifleet_runtime.qwen2_5_omni import Talker

    talker = Talker(tiny_omni, dtype="float32", do_sample=False, max_new_tokens=24)
    items = talker_items(talker)
    with torch.inference_mode():
        t = time.monotonic()
        alone = [talker(**x) for x in items]
        t_alone = time.monotonic() - t
        t = time.monotonic()
        together = talker.forward_batch([*items[:2], {**items[0], "hidden": items[0]["hidden"][1:]}, *items[2:]])
        t_together = time.monotonic() - t
    assert isinstance(together[2], BadInput) and "expected [9, H]" in str(together[2]), together[2]
    del together[2]
    for i, (a, b) in enumerate(zip(alone, together)):
        assert a["speaker"] == b["speaker"] == ("Ethan" if i == 1 else SPEAKER)
        assert len(a["codes"]) > 0 and a["codes"].tolist() == b["codes"].tolist(), (i, a["codes"], b["codes"])
    assert len({tuple(a["codes"].tolist()) for a in alone}) == len(alone), "the requests' codes are not distinct"
    report(request.config, "qwen-omni-stock", f"talker: 4 requests alone {t_alone:.2f}s, in one batch "
           f"{t_together:.2f}s, the same codes")


def talker_items(talker) -> list[dict]:
    """Four talker inputs: prompts of 7, 12, 4 and 9 tokens with 3, 9, 1 and 15 thinker tokens, the second in
    another voice, the last with an image placeholder in its prompt."""
    import torch

    width = talker.embed.weight.shape[1]
    g = torch.Generator().manual_seed(7)

    def item(p: int, n: int, **kw) -> dict:
        prompt = torch.randint(100, 1000, (p,), generator=g).tolist()
        return {"prompt_token_ids": prompt, "token_ids": torch.randint(100, 1000, (n,), generator=g).tolist(),
                "hidden": torch.randn(p + n - 1, width, generator=g), **kw}

    items = [item(7, 3), item(12, 9, speaker="ethan"), item(4, 1), item(9, 15)]
    items[3]["prompt_token_ids"][2] = min(talker.media_ids)
    return items


def test_the_talker_sampled_draws_each_request_from_its_own_generator(tiny_omni):
    """Sampled (the talker's default temperature, top-k and top-p, and a seed), each request of a batch gets
    the codes it gets alone, and again on a second run; the codes are not the greedy ones, and another seed
    draws others. (A batch drawing from one generator gives its requests other codes than alone.)"""
    import torch

    from omnifleet_runtime.qwen2_5_omni import Talker

    def codes(outs: list[dict]) -> list[list[int]]:
        return [o["codes"].tolist() for o in outs]

    with torch.inference_mode():
        greedy = Talker(tiny_omni, dtype="float32", do_sample=False, max_new_tokens=24)
        items = talker_items(greedy)
        seeded = Talker(tiny_omni, dtype="float32", seed=11, max_new_tokens=24)
        alone = codes([seeded(**x) for x in items])
        together = codes(seeded.forward_batch(items))
        again = codes(seeded.forward_batch(items[::-1]))[::-1]
        other = codes(Talker(tiny_omni, dtype="float32", seed=12, max_new_tokens=24).forward_batch(items))
        plain = codes([greedy(**x) for x in items])
    assert all(alone) and together == alone and again == alone, (alone, together, again)
    assert alone != plain and other != alone, (alone, plain, other)


def test_the_tap_refuses_an_engine_that_would_skip_its_hooks(tiny_omni):
    """Compiled forwards skip module hooks and cached prefixes are never forwarded: a thinker with the tap
    but without enforce_eager fails at start, before its engine is made, naming both settings."""
    from omnifleet_runtime.engines.base import EngineStartError
    from omnifleet_runtime.engines.vllm import VllmEngine
    from omnifleet_runtime.validate import load_pipeline

    d = doc(tiny_omni)
    d["spec"]["stages"][0]["engineArgs"].pop("enforce_eager")
    d["spec"]["stages"][0]["model"] = tiny_omni  # (a pod's config gives each stage the pipeline's model)
    engine = VllmEngine(load_pipeline(d).spec.stage("thinker"), "thinker-0")
    with pytest.raises(EngineStartError, match="enforce_eager: true and enable_prefix_caching: false"):
        asyncio.run(engine.start())
    assert engine.engine is None


def test_the_tap_gives_each_request_of_a_batch_its_own_rows_and_they_are_transformers(tiny_omni, oracle, monkeypatch,
                                                                                      request):
    """Two prompts of different lengths in one engine at once (vLLM batches them into the same steps): each
    request's hidden states are the ones it gets alone, row for row. The sample's prompt alone gets the hidden
    states transformers' thinker computes for the same tokens (what the oracle's talker was given)."""
    import numpy as np

    from omnifleet_runtime.engines.vllm import VllmEngine
    from omnifleet_runtime.validate import load_pipeline

    d = doc(tiny_omni)
    d["spec"]["stages"] = d["spec"]["stages"][:1]
    d["spec"]["stages"][0].update(model=tiny_omni)
    # Beside the fleet's engine (when the module runs): a share of the memory still free (vLLM's CPU backend
    # reserves gpu_memory_utilization of it), and the fleet's KV cache size.
    d["spec"]["stages"][0]["engineArgs"].update(max_num_seqs=4, gpu_memory_utilization=0.3,
                                                limit_mm_per_prompt={"image": 0, "audio": 0, "video": 0})
    for k, v in engine_env().items():
        monkeypatch.setenv(k, v)
    prompts = [PROMPT, PROMPT[:3] + [9707, 11, 1879, 33, 44] + PROMPT[4:]]
    tokens = [THINKER_TOKENS, 9]
    sampling = {"temperature": 0.0, "repetition_penalty": REPETITION_PENALTY}  # the oracle's tokens

    async def run(engine: VllmEngine, which: list[int]) -> list[tuple[list[int], np.ndarray]]:
        async def one(i: int) -> tuple[list[int], np.ndarray]:
            chunks = [c async for c in engine.generate_one(prompts[i], {**sampling, "max_tokens": tokens[i]}, f"r{i}")]
            h = chunks[-1]["extra"]["hidden"]
            return [t for c in chunks for t in c["token_ids"]], np.frombuffer(h.data, np.float32).reshape(h.shape)
        return await asyncio.gather(*(one(i) for i in which))

    async def main() -> tuple[list, list]:
        engine = VllmEngine(load_pipeline(d).spec.stage("thinker"), "thinker-0")
        await engine.start()
        try:
            return await run(engine, [0, 1]), [(await run(engine, [i]))[0] for i in (0, 1)]
        finally:
            await engine.shutdown()

    together, alone = asyncio.run(main())
    for i, ((ids, rows), (ids_alone, rows_alone)) in enumerate(zip(together, alone)):
        assert len(ids) == tokens[i] and ids == ids_alone
        assert rows.shape == (len(prompts[i]) + tokens[i] - 1, 128), rows.shape
        assert np.array_equal(rows, rows_alone), f"request {i}: rows differ by up to {np.abs(rows - rows_alone).max()}"

    (ids, rows), want = alone[0], np.asarray(oracle["hidden"], np.float32).reshape(oracle["hidden_shape"])
    assert ids == oracle["token_ids"] and rows.shape == want.shape, (ids, oracle["token_ids"], rows.shape, want.shape)
    worst = float(np.abs(rows - want).max())
    assert worst <= HIDDEN_TOLERANCE, f"the tap's hidden states differ from transformers' by up to {worst}"
    report(request.config, "qwen-omni-stock", f"the tap's hidden states {list(rows.shape)} against transformers' "
           f"thinker on the same tokens: largest difference {worst:.3g} (bound {HIDDEN_TOLERANCE:g})")
