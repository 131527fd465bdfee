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
