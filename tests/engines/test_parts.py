"""The pieces of the real-engine path that need no vLLM engine running: PNG and WAV encoding
(master side), stock input processors, the vLLM engine's argument and output handling, and the
diffusion engine in-process (diffusers pipeline and torch-module paths)."""

from __future__ import annotations

import asyncio
import io
import random
import struct
import wave
from types import SimpleNamespace

import pytest

from omnifleet_runtime import media, processors
from omnifleet_runtime.engines import EngineRequest, EngineStartError, make_engine
from omnifleet_runtime.schema import Stage
from omnifleet_runtime.wire import Array, RequestInfo



# ---------------------------------------------------------------- media (the master's encoders)


def test_png_round_trips_through_pillow_and_zlib():
    w, h = 5, 3
    pixels = bytes((x * 40 + y * 7 + c * 90) % 256 for y in range(h) for x in range(w) for c in range(3))
    data = media.png(pixels, w, h, 3)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and media.png_size(data) == (5, 3)
    import PIL.Image as pil  # installed with vLLM; a missing one fails this test
    img = pil.open(io.BytesIO(data))
    assert img.size == (5, 3) and img.mode == "RGB" and img.tobytes() == pixels
    (out,) = media.images_of({"images": Array("uint8", (1, h, w, 3), pixels)})
    assert out == data
    grey = media.images_of(Array("uint8", (2, 2), b"\x00\x10\x20\x30"))[0]
    assert pil.open(io.BytesIO(grey)).mode == "L"
    with pytest.raises(media.MediaError, match="uint8"):
        media.images_of(Array("float32", (1, 1, 1), b"\0\0\0\0"))


def test_wav_of_float_and_int16_chunks():
    floats = [0.0, 0.5, -0.5, 1.5]
    chunk = {"audio": Array("float32", (4,), struct.pack("<4f", *floats)), "sample_rate": 16000}
    a = media.audio_of(chunk)
    assert a.sample_rate == 16000 and a.channels == 1
    assert struct.unpack("<4h", a.pcm) == (0, 16383, -16383, 32767)
    b = media.audio_of(Array("int16", (2, 2), struct.pack("<4h", 1, 2, 3, 4)))  # bare: 24 kHz, stereo
    assert (b.sample_rate, b.channels, b.pcm) == (24000, 2, struct.pack("<4h", 1, 2, 3, 4))
    # Clipped to [-1, 1] and truncated toward zero, as int(max(-1, min(1, x)) * 32767) per sample; NaN is silence.
    edge = [float("nan"), float("inf"), -float("inf"), -1.5, 1 / 32767, -1 / 32767, 0.99999, -0.0]
    got = media.audio_of(Array("float64", (8,), struct.pack("<8d", *edge))).pcm
    assert struct.unpack("<8h", got) == (0, 32767, -32767, -32767, 1, -1, 32766, 0)
    # Past one conversion block and not a multiple of it, so that the last, short block is checked too.
    n = 2 * media.AUDIO_BLOCK + 4098
    rng = random.Random(7)
    many = [rng.uniform(-1.2, 1.2) for _ in range(n)]
    want = [int(max(-1.0, min(1.0, x)) * 32767.0) for x in struct.unpack(f"<{n}f", struct.pack(f"<{n}f", *many))]
    got = media.audio_of(Array("float32", (n // 2, 2), struct.pack(f"<{n}f", *many)))
    assert list(struct.unpack(f"<{n}h", got.pcm)) == want and got.channels == 2
    data = media.wav(media.join_audio([a, media.audio_of(chunk)]))
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 16000, 8)
    with pytest.raises(media.MediaError, match="disagree"):
        media.join_audio([a, b])


# ---------------------------------------------------------------- stock processors


def chunk(text, ids, **kw):
    return {"text": text, "token_ids": ids, **kw}


def test_processors_read_llm_chunks():
    info = RequestInfo("r", "chat", "m")
    whole = {"a": [chunk("Hel", [1], prompt_token_ids=[7, 8]), chunk("lo", [2, 3], finish_reason="length")]}
    assert processors.llm_text(whole, info) == "Hello"
    assert processors.llm_tokens(whole, info) == {"prompt_token_ids": [1, 2, 3]}
    assert processors.thinker_to_talker(whole, info) == {"prompt_token_ids": [7, 8, 1, 2, 3]}
    assert processors.llm_text_as_chat(whole, info) == [{"role": "user", "content": "Hello"}]
    assert processors.ar_to_diffusion(whole, info) == {"prompt": "Hello", "prompt_token_ids": [1, 2, 3]}
    emb = Array("float32", (1, 2), b"\0" * 8)
    with_hidden = {"a": [chunk("x", [1], extra={"hidden_states": emb})]}
    assert processors.ar_to_diffusion(with_hidden, info) == {"prompt_embeds": emb}
    codes = processors.talker_to_code2wav({"a": chunk("x", [5, 6])}, info)["codes"]
    assert codes.dtype == "int32" and struct.unpack("<2i", codes.data) == (5, 6)
    assert processors.talker_to_code2wav({"a": chunk("", [])}, info) is None
    assert processors.llm_text({"a": ["plain ", "strings"]}, info) == "plain strings"
    with pytest.raises(ValueError, match="one upstream"):
        processors.llm_text({"a": [], "b": []}, info)


# ---------------------------------------------------------------- the vLLM engine, without an engine


def test_llm_stage_names_a_missing_model_or_variable_before_loading_anything(monkeypatch):
    from omnifleet_runtime.engines.vllm import expand_model

    with pytest.raises(EngineStartError, match="stage 's': model path /no/such/model does not exist"):
        asyncio.run(make_engine(Stage(name="s", type="llm", model="/no/such/model"), "p").start())
    monkeypatch.delenv("OMNIFLEET_NOPE", raising=False)
    with pytest.raises(EngineStartError, match=r"names \$OMNIFLEET_NOPE, which is not set"):
        expand_model(Stage(name="s", type="llm", model="${OMNIFLEET_NOPE}/m"))
    monkeypatch.setenv("OMNIFLEET_M", "org")
    assert expand_model(Stage(name="s", type="llm", model="${OMNIFLEET_M}/model-7b")) == "org/model-7b"
    with pytest.raises(EngineStartError, match="no model"):
        expand_model(Stage(name="s", type="llm"))


def test_an_llm_stage_names_a_lora_folder_without_an_adapter_before_loading_anything(tmp_path):
    from omnifleet_runtime.devsetup.tiny_model import ensure_tiny_model

    stage = Stage(name="s", type="llm", model=str(ensure_tiny_model()),
                  loras=[{"name": "terse", "path": str(tmp_path)}])
    with pytest.raises(EngineStartError, match=r"stage 's': loras\[0\] \(terse\): no adapter_config.json in "):
        asyncio.run(make_engine(stage, "p").start())


def test_unknown_engine_args_are_named_with_suggestions():
    from omnifleet_runtime.engines.vllm import check_engine_args

    stage = Stage(name="s", type="llm", engine_args={"max_model_length": 1, "max_num_seqs": 2, "zzz": 3})
    with pytest.raises(EngineStartError) as e:
        check_engine_args(stage, {"max_model_len", "max_num_seqs"}, "vllm.AsyncEngineArgs", "0.0")
    msg = str(e.value)
    assert "stage 's': unknown vLLM engine args 'max_model_length' (did you mean 'max_model_len'?), 'zzz'" in msg
    assert "not a field of vllm.AsyncEngineArgs" in msg


def test_vllm_outputs_carry_extra_tensors_as_wire_arrays():
    import numpy as np
    import torch

    from omnifleet_runtime.engines.vllm import VllmEngine

    comp = SimpleNamespace(index=0, text="hi", token_ids=[1, 2], cumulative_logprob=None, logprobs=None,
                           finish_reason="stop", stop_reason=None, routed_experts=np.arange(6, dtype=np.int32))
    out = SimpleNamespace(request_id="r", prompt=None, prompt_token_ids=[9], outputs=[comp], finished=True,
                          multimodal_output={"audio": torch.ones(3, dtype=torch.bfloat16)}, metrics=None)
    engine = VllmEngine(Stage(name="s", type="llm", model="m"), "p")
    (c,) = engine._chunks(out, SimpleNamespace(n=1), first=True)
    assert c["text"] == "hi" and c["token_ids"] == [1, 2] and c["prompt_token_ids"] == [9]
    assert c["finish_reason"] == "stop"
    experts, audio = c["extra"]["routed_experts"], c["extra"]["multimodal_output"]["audio"]
    assert (experts.dtype, experts.shape, bytes(experts.data)) == ("int32", (6,), np.arange(6, dtype=np.int32).tobytes())
    assert (audio.dtype, audio.shape, len(audio.data)) == ("bfloat16", (3,), 6)


# ---------------------------------------------------------------- the diffusion engine, in-process


async def paint(engine, item, params) -> dict:
    async def inputs():
        yield item

    (out,) = [c async for c in engine.generate(EngineRequest("r", inputs(), params, RequestInfo("r", "image", "m")))]
    return out


def test_diffusion_engine_torch_module_path():
    stage = Stage(name="d", type="diffusion", entrypoint="enginefns:tiny_denoiser",
                  engine_args={"num_inference_steps": 3, "device": "cpu"})

    async def main():
        engine = make_engine(stage, "p")
        await engine.start()
        emb = lambda v: Array("float32", (2, 32), struct.pack("<64f", *([v] * 64)))  # noqa: E731
        a = await paint(engine, {"prompt_embeds": emb(1.0)}, {"height": 8, "width": 12, "n": 2})
        b = await paint(engine, {"prompt_embeds": emb(1.0)}, {"height": 8, "width": 12, "n": 2})
        c = await paint(engine, {"prompt_embeds": emb(-1.0)}, {"height": 8, "width": 12, "n": 2})
        u = await paint(engine, {}, {"height": 8, "width": 12, "seed": 3})
        return a, b, c, u

    a, b, c, u = asyncio.run(main())
    img = a["images"]
    assert (img.dtype, img.shape) == ("uint8", (2, 8, 12, 3))
    assert bytes(img.data) == bytes(b["images"].data), "seeded: the same request gives the same images"
    assert bytes(img.data) != bytes(c["images"].data), "the conditioning changes the image"
    assert u["images"].shape == (1, 8, 12, 3) and u["seed"] == 3


def test_diffusion_engine_diffusers_path_with_text_or_token_conditioning():
    from omnifleet_runtime.devsetup.tiny_model import ensure_tiny_model

    stage = Stage(name="d", type="diffusion", model=str(ensure_tiny_model("tiny-diffusion")),
                  engine_args={"num_inference_steps": 3})

    async def main():
        engine = make_engine(stage, "p")
        await engine.start()
        assert (await engine.control("ping", {}))["source"].startswith("diffusers")
        by_text = await paint(engine, "The quick brown fox", {"width": 16, "height": 24, "guidance_scale": 3.0})
        ids = engine.parts["tokenizer"]("The quick brown fox")["input_ids"]
        by_ids = await paint(engine, {"prompt_token_ids": ids}, {"width": 16, "height": 24, "guidance_scale": 3.0})
        other = await paint(engine, {"prompt_token_ids": ids[:2]}, {"width": 16, "height": 24, "guidance_scale": 3.0})
        with pytest.raises(ValueError, match="unknown sampling parameter"):
            await paint(engine, "x", {"strength": 0.5})
        return by_text, by_ids, other

    by_text, by_ids, other = asyncio.run(main())
    assert by_text["images"].shape == (1, 24, 16, 3)
    assert bytes(by_text["images"].data) == bytes(by_ids["images"].data)
    assert bytes(by_ids["images"].data) != bytes(other["images"].data)


def test_diffusion_engine_refuses_unknown_engine_args():
    stage = Stage(name="d", type="diffusion", entrypoint="enginefns:tiny_denoiser", engine_args={"stepz": 3})
    with pytest.raises(EngineStartError, match="stage 'd': unknown diffusion engine arg\\(s\\) 'stepz'"):
        asyncio.run(make_engine(stage, "p").start())
