"""Stage callables, factories and processors the engine tests run inside real stage processes."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from omnifleet_runtime import processors
from omnifleet_runtime.wire import Array

SAMPLE_RATE = 24000
SAMPLES_PER_CODE = 240  # 10 ms per code


def code_wave(code: int) -> list[float]:
    """The vocoder's waveform of one code: a sine whose pitch is the code (phase restarts per code)."""
    freq = 100.0 + 5.0 * (code % 512)
    return [0.5 * math.sin(2 * math.pi * freq * i / SAMPLE_RATE) for i in range(SAMPLES_PER_CODE)]


def sine_vocoder(inputs, sampling_params, context):
    """A toy vocoder (python stage, stream mode): each chunk of codes becomes a chunk of audio."""
    n = len(inputs["codes"].data) // 4
    codes = struct.unpack(f"<{n}i", bytes(inputs["codes"].data))
    samples = [x for c in codes for x in code_wave(c)]
    return {"audio": Array("float32", (len(samples),), struct.pack(f"<{len(samples)}f", *samples)),
            "sample_rate": SAMPLE_RATE}


def recording_llm_text(upstream, request):
    """processors.llm_text, recording what reached it (the upstream's chunks) in $OMNIFLEET_TEST_DIR."""
    (name, chunks), = upstream.items()
    record = {"request_id": request.request_id, "upstream": name,
              "chunks": [{k: v for k, v in c.items() if k != "extra"} | {"extra": sorted(c.get("extra") or {})}
                         for c in chunks]}
    out = processors.llm_text(upstream, request)
    record["prompt"] = out
    path = Path(os.environ["OMNIFLEET_TEST_DIR"]) / "processor.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    return out


def tiny_denoiser(channels: int = 3, dim: int = 32, seed: int = 0, with_encoder: bool = False):
    """A torch denoiser for the diffusion engine's torch path: conv + conditioning bias
    (with_encoder: also a token-embedding text encoder over a 512-token vocabulary)."""
    import torch

    class Denoiser(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.in_channels = channels
            self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
            self.cond = torch.nn.Linear(dim, channels)
            self.time = torch.nn.Linear(1, channels)

        def forward(self, sample, timestep, encoder_hidden_states=None):
            h = self.conv(sample) + self.time(timestep.float().view(-1, 1) / 1000.0)[:, :, None, None]
            if encoder_hidden_states is not None:
                h = h + self.cond(encoder_hidden_states.mean(dim=1))[:, :, None, None]
            return torch.tanh(h)

    torch.manual_seed(seed)
    denoiser = Denoiser()
    if with_encoder:
        return {"denoiser": denoiser, "text_encoder": torch.nn.Embedding(512, dim)}
    return denoiser


def tiny_lora(model_dir: str | Path, out: str | Path, rank: int = 8, seed: int = 0) -> Path:
    """A LoRA adapter (PEFT layout) on q_proj and v_proj of a Qwen2-style model, random and large enough to
    change its greedy tokens: what a trained adapter looks like to vLLM, made in a second."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_out = cfg.get("num_key_value_heads", heads) * (hidden // heads)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for mod, dim_out in (("q_proj", hidden), ("v_proj", kv_out)):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(dim_out, rank, generator=g) * 0.5
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "base_model_name_or_path": str(model_dir)}))
    return out
