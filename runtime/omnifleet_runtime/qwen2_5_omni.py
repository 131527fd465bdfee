"""Qwen2.5-Omni's talker and code2wav as `torch` stages, with transformers' own modules, after a thinker
that is a stock-vLLM `llm` stage (no vLLM-Omni).

    thinker  (llm: vLLM's Qwen2.5-Omni thinker; engineArgs.worker_extension_cls:
              omnifleet_runtime.engines.hidden.HiddenStatesTap, so its last chunk carries
              extra.hidden, the decoder's final hidden states, [prompt + generated - 1, H])
    talker   (torch: entrypoint omnifleet_runtime.qwen2_5_omni:talker,
              inputProcessor omnifleet_runtime.qwen2_5_omni:thinker_to_talker) -> {"codes"}
    code2wav (torch: entrypoint omnifleet_runtime.qwen2_5_omni:code2wav) -> {"audio", "sample_rate"}

The talker is fed as transformers' `Qwen2_5OmniForConditionalGeneration.generate` feeds it, from the
thinker's prompt and generated ids and its hidden states: its prompt rows are hidden + token embedding,
then the speaker's text token and the first generated token; each decode step adds the next generated
token's row, then the text end and pad embeddings. The talker batches (`forward_batch`, which the torch
engine calls with concurrent requests when the stage's max_concurrency is above 1). Each factory reads only
its own weights (and the talker the thinker's token embeddings) from the checkpoint's safetensors, and the
speakers from its `spk_dict.pt` (read as tensors only, `weights_only`).

A prompt with image, audio or video: the prompt rows at the media's placeholders are the hidden states
alone (their embeddings zeroed), and the talker runs on plain sequence positions, as transformers' generate
runs it (no grids or audio lengths reach the talker there). The talker samples each request from a
generator of its own (so a batch does not change a request's codes) and code2wav draws its noise from torch's
generator: `seed` (a factory argument of either) makes them reproducible. The speaker is the factories' `speaker`, or a
request's voice (matched in any case against `spk_dict.pt`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .engines.base import BadInput, requested_voice
from .processors import collect

SAMPLE_RATE = 24000  # Token2Wav's output rate


def _weights(model: str, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors whose names start with one of prefixes, read from its safetensors files."""
    from safetensors import safe_open

    root = Path(model)
    index = root / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(root / name), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefixes):
                    out[key] = f.get_tensor(key)
    return out


def _module(cls: Any, config: Any, weights: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> Any:
    sub = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    if not sub:
        raise ValueError(f"the checkpoint has no {prefix}* weights")
    module = cls._from_config(config, dtype=dtype)  # transformers picks attention as from_pretrained does
    module.load_state_dict(sub, strict=True)
    return module.eval()


def _speakers(model: str) -> dict[str, dict[str, Any]]:
    return torch.load(Path(model) / "spk_dict.pt", map_location="cpu", weights_only=True)


def _known(speakers: dict[str, Any], speaker: str, model: str) -> None:
    if speaker not in speakers:
        raise ValueError(f"speaker {speaker!r} is not in {model}/spk_dict.pt ({', '.join(speakers)})")


def _speaker(speakers: dict[str, Any], name: str, stage: str) -> str:
    """The speaker's name as spk_dict.pt spells it (a request's voice in any case)."""
    found = {k.lower(): k for k in speakers}.get(str(name).lower())
    if found is None:
        raise BadInput(f"{stage}: unknown voice {str(name)[:64]!r} (this model speaks as {', '.join(speakers)})")
    return found


class Talker(torch.nn.Module):
    def __init__(self, model: str, speaker: str = "Chelsie", dtype: str = "auto", max_new_tokens: int = 4096,
                 do_sample: bool = True, top_k: int = 40, top_p: float = 0.8, temperature: float = 0.9,
                 repetition_penalty: float = 1.05, eos_token_id: tuple[int, ...] = (8292, 8294),
                 seed: int | None = None):
        super().__init__()
        from transformers import Qwen2_5OmniConfig
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniTalkerForConditionalGeneration

        cfg = Qwen2_5OmniConfig.from_pretrained(model)
        weights = _weights(model, ("talker.", "thinker.model.embed_tokens.weight"))
        dt = getattr(cfg.talker_config, "dtype", None) if dtype == "auto" else dtype
        dt = dt if isinstance(dt, torch.dtype) else getattr(torch, str(dt or "float32").removeprefix("torch."))
        self.talker = _module(Qwen2_5OmniTalkerForConditionalGeneration, cfg.talker_config, weights, "talker.", dt)
        self.embed = torch.nn.Embedding.from_pretrained(weights["thinker.model.embed_tokens.weight"].to(dt))
        self.speakers = _speakers(model)
        _known(self.speakers, speaker, model)
        self.speaker = speaker
        tc = cfg.thinker_config
        self.media_ids = {tc.audio_token_index, tc.image_token_index, tc.video_token_index}
        self.generation = dict(max_new_tokens=max_new_tokens, repetition_penalty=repetition_penalty,
                               eos_token_id=list(eos_token_id))
        # Sampled, each request draws from a generator of its own (see _RowSampler); generate itself runs greedy.
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p) if do_sample else None
        self.seed = seed

    def forward(self, prompt_token_ids: list[int], token_ids: list[int], hidden: torch.Tensor,
                speaker: str | None = None) -> dict[str, Any]:
        [out] = self.forward_batch([{"prompt_token_ids": prompt_token_ids, "token_ids": token_ids, "hidden": hidden,
                                     "speaker": speaker}])
        if isinstance(out, Exception):
            raise out
        return out

    def forward_batch(self, items: list[dict[str, Any]]) -> list[Any]:
        """Several requests' inputs (forward's arguments each) in one generate; an input it cannot take is a
        BadInput in its place. Greedy, each request gets the codes it gets alone: prompts are left-padded
        and masked (transformers' talker discounts the pads in its positions), each reply part is padded at
        its end with its own last row (the text pad embedding, which a talker past its reply part keeps
        adding), and the codec ids under the pads are the mask token every row already holds, so the
        repetition penalty sees the same set of ids."""
        out: list[Any] = [None] * len(items)
        rows = []
        for i, item in enumerate(items):
            try:
                rows.append((i, self._rows(**item)))
            except BadInput as e:
                out[i] = e
            except (TypeError, AttributeError, ValueError) as e:  # not the arguments forward takes
                out[i] = BadInput(f"talker: {e}")
        if rows:
            for (i, r), codes in zip(rows, self._generate([r for _, r in rows])):
                out[i] = {"codes": codes, "speaker": r["speaker"]}
        return out

    def _rows(self, prompt_token_ids: list[int], token_ids: list[int], hidden: torch.Tensor,
              speaker: str | None = None) -> dict[str, Any]:
        speaker = _speaker(self.speakers, speaker or self.speaker, "talker")
        p, n = len(prompt_token_ids), len(token_ids)
        if n < 1 or tuple(hidden.shape[:1]) != (p + n - 1,):
            raise BadInput(f"talker: hidden states of {list(hidden.shape)} for {p} prompt and {n} generated tokens "
                           f"(expected [{p + n - 1}, H])")
        dev, tk = hidden.device, self.talker
        ids = torch.tensor(prompt_token_ids + token_ids, dtype=torch.long, device=dev)
        emb = self.embed(ids[:p + n - 1])
        emb[:p][torch.isin(ids[:p], torch.tensor(sorted(self.media_ids), device=dev))] = 0
        rows = hidden.to(emb.dtype) + emb
        bos = int(self.speakers[speaker]["bos_token"])
        one = lambda t: self.embed(torch.tensor([t], device=dev))  # noqa: E731
        # A prompt with media takes nothing more: transformers' generate runs its talker on plain sequence
        # positions (no grids or audio lengths reach it), as vLLM-Omni's pipeline does (its talker gets no media).
        # The reply part's first row ends the prompt: with one generated token (no reply rows) that is the
        # text end's embedding, as in transformers' generate.
        reply = torch.cat([rows[p:], one(tk.text_eos_token), one(tk.text_pad_token)])
        return {"embeds": torch.cat([rows[:p], one(bos), reply[:1]]), "reply": reply[1:],
                "text_ids": torch.cat([ids[:p], ids.new_tensor([bos]), ids[p:p + 1]]), "speaker": speaker}

    def _generate(self, rows: list[dict[str, Any]]) -> list[torch.Tensor]:
        tk, b = self.talker, len(rows)
        first = rows[0]["embeds"]
        width, reply_len = max(len(r["embeds"]) for r in rows), max(len(r["reply"]) for r in rows)
        embeds = first.new_zeros(b, width, first.shape[1])
        reply = first.new_zeros(b, reply_len, rows[0]["reply"].shape[1])
        talker_ids = torch.full((b, width), tk.codec_mask_token, dtype=torch.long, device=first.device)
        talker_ids[:, -2:] = torch.tensor([tk.codec_pad_token, tk.codec_bos_token], device=first.device)
        text_ids = torch.zeros(b, width, dtype=torch.long, device=first.device)
        mask = torch.zeros(b, width, dtype=torch.long, device=first.device)
        for i, r in enumerate(rows):
            k, m = len(r["embeds"]), len(r["reply"])
            embeds[i, width - k:], text_ids[i, width - k:], mask[i, width - k:] = r["embeds"], r["text_ids"], 1
            reply[i, :m], reply[i, m:] = r["reply"], r["reply"][-1]
        if not bool(mask.all()):
            # transformers' generate drops an all-ones mask, and with it the talker's own additions of the codec
            # pad and start embeddings to the prompt's last two rows (which it makes only under a mask): what a
            # request alone gets. A padded batch keeps its mask, so those additions are taken off beforehand.
            codec = tk.get_input_embeddings()(torch.tensor([tk.codec_pad_token, tk.codec_bos_token],
                                                           device=first.device))
            embeds[:, -2:] -= codec.to(embeds.dtype)
        from transformers import LogitsProcessorList

        sampler = LogitsProcessorList([] if self.sampling is None else [_RowSampler(b, self.seed, **self.sampling)])
        out = tk.generate(input_ids=talker_ids, input_text_ids=text_ids, thinker_reply_part=reply,
                          inputs_embeds=embeds, attention_mask=mask, suppress_tokens=[tk.codec_bos_token],
                          pad_token_id=self.generation["eos_token_id"][0], do_sample=False,
                          logits_processor=sampler, **self.generation)
        eos = torch.tensor(self.generation["eos_token_id"], device=out.device)
        codes = []
        for row in out[:, width:]:
            stop = torch.isin(row, eos).nonzero()
            codes.append(row[: int(stop[0]) if len(stop) else len(row)])
        return codes


class _RowSampler:
    """Sampling as transformers' generate samples (temperature, top-k, top-p, then one multinomial draw), but each
    row of the batch from a generator of its own, so that a request's codes are the ones it gets alone; with
    `seed`, every request's generator starts from it (reproducible), else from fresh entropy. It is the last
    logits processor of a greedy generate (after the repetition penalty and the suppressed tokens, as
    transformers orders them): the drawn token is left the only one with a finite score."""

    def __init__(self, rows: int, seed: int | None, temperature: float, top_k: int, top_p: float):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        # The warpers generate would add for these values, in its order.
        self.warpers = LogitsProcessorList(([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else [])
                                           + ([TopKLogitsWarper(top_k=top_k)] if top_k else [])
                                           + ([TopPLogitsWarper(top_p=top_p)] if top_p < 1.0 else []))
        self.rows, self.seed = rows, seed
        self.generators: list[torch.Generator] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.generators:  # on the scores' device, known only now
            for _ in range(self.rows):
                g = torch.Generator(device=scores.device)
                if self.seed is None:
                    g.seed()
                else:
                    g.manual_seed(self.seed)
                self.generators.append(g)
        probs = torch.softmax(self.warpers(input_ids, scores), dim=-1)
        picked = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators)])
        return torch.full_like(scores, -torch.inf).scatter_(1, picked[:, None], 0.0)


class Code2Wav(torch.nn.Module):
    def __init__(self, model: str, speaker: str = "Chelsie", seed: int | None = None, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0):
        super().__init__()
        from transformers import Qwen2_5OmniConfig
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

        cfg = Qwen2_5OmniConfig.from_pretrained(model)
        # float32, as transformers runs it (its DiT fails in bfloat16)
        self.token2wav = _module(Qwen2_5OmniToken2WavModel, cfg.token2wav_config, _weights(model, ("token2wav.",)),
                                 "token2wav.", torch.float32)
        self.speakers = _speakers(model)
        _known(self.speakers, speaker, model)
        self.speaker, self.seed = speaker, seed
        self.options = dict(num_steps=num_steps, guidance_scale=guidance_scale, sway_coefficient=sway_coefficient)

    def forward(self, codes: torch.Tensor, speaker: str | None = None) -> dict[str, Any]:
        spk = self.speakers[_speaker(self.speakers, speaker or self.speaker, "code2wav")]
        dev = next(self.token2wav.parameters()).device
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            if self.seed is not None:
                torch.manual_seed(self.seed)
            wav = self.token2wav(codes.reshape(1, -1).long(), conditioning=spk["cond"].to(dev).float(),
                                 reference_mel=spk["ref_mel"].to(dev).float(), **self.options)
        return {"audio": wav.reshape(-1).float(), "sample_rate": SAMPLE_RATE}


def talker(model: str, **kwargs: Any) -> Talker:
    """Factory of the talker stage: model (default: the stage's), and in `engineArgs.factory_kwargs` optionally
    speaker, dtype (default: the checkpoint's) and the generation settings (default: transformers' talker's)."""
    return Talker(model, **kwargs)


def code2wav(model: str, **kwargs: Any) -> Code2Wav:
    """Factory of the code2wav stage: model (default: the stage's), and in `engineArgs.factory_kwargs`
    optionally speaker, seed, num_steps, guidance_scale, sway_coefficient."""
    return Code2Wav(model, **kwargs)


def thinker_to_talker(upstream_outputs: dict[str, Any], request: Any) -> dict[str, Any]:
    """Input processor of the talker (`whole` input): the thinker's chunks as the talker's arguments, and the
    request's voice (chat's `audio.voice`, speech's `voice`) as its speaker, which it hands on to code2wav."""
    if len(upstream_outputs) != 1:
        raise BadInput(f"talker: one upstream stage expected, got {', '.join(upstream_outputs)}")
    [(name, chunks)] = upstream_outputs.items()
    try:
        got = collect(chunks)
    except ValueError as e:
        raise BadInput(f"talker: stage {name!r}: {e}") from None
    prompt = got["prompt_token_ids"]
    hidden = [h for h in got["extra"].get("hidden", []) if h is not None]  # the tap puts it on the last chunk
    if prompt is None or not hidden:
        raise BadInput(f"talker: stage {name!r} sent no {'prompt_token_ids' if prompt is None else 'hidden states'} "
                       "(its engineArgs need worker_extension_cls: omnifleet_runtime.engines.hidden.HiddenStatesTap)")
    item = {"prompt_token_ids": prompt, "token_ids": got["token_ids"], "hidden": hidden[-1]}
    voice = requested_voice(request)
    if voice:
        item["speaker"] = voice
    return item
