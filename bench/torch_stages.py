"""Torch stages of the GPU benchmark (and the handoff tests): a producer of a tensor on the stage's device
and a consumer that reads all of it. Run inside real stage processes (`bench.torch_stages:make_fill`).

Stamps are time.monotonic() (CLOCK_MONOTONIC: one clock for every process of the machine), so the
producer's stamp can be subtracted from the consumer's.
"""

from __future__ import annotations

import json
import time

import torch


class Fill(torch.nn.Module):
    """An entry stage: the prompt {"n": elements, "v": value} -> n float32 values v on the stage's device,
    stamped (CLOCK_MONOTONIC, one clock for every process) once they exist."""

    def __init__(self):
        super().__init__()
        self.register_buffer("anchor", torch.zeros(1))  # follows the module to the stage's device

    def forward(self, prompt):
        spec = json.loads(prompt)
        x = torch.full((int(spec["n"]),), float(spec["v"]), device=self.anchor.device)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        return {"t0": time.monotonic(), "x": x}


class Check(torch.nn.Module):
    """A consumer of Fill: reads every value (a sum on its device) and says what it got, as JSON text."""

    def __init__(self):
        super().__init__()
        self.register_buffer("anchor", torch.zeros(1))

    def forward(self, t0, x):
        t_in = time.monotonic()
        total = float(x.sum())  # waits for the data: the read is part of the handoff
        return json.dumps({"t0": t0, "t_in": t_in, "t1": time.monotonic(), "sum": total, "n": x.numel(),
                           "device": str(x.device), "dtype": str(x.dtype)})


def make_fill() -> torch.nn.Module:
    return Fill()


def make_check() -> torch.nn.Module:
    return Check()
