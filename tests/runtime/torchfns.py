"""A torch module factory for the torch engine test (imported only where torch is installed)."""

import threading

import torch

from omnifleet_runtime.engines.base import BadInput


class Scale(torch.nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = torch.nn.Parameter(torch.tensor(factor))

    def forward(self, x, offset=0.0):
        return {"y": x * self.factor + offset, "sum": (x * self.factor).sum()}


def make_scale(factor: float = 2.0) -> torch.nn.Module:
    return Scale(factor)



class Doubler(torch.nn.Module):
    """A module with forward_batch: the batches it was called with, a gate that holds a call while the test
    queues and aborts requests behind it, and an input (`bad`) it refuses on its own."""

    def __init__(self):
        super().__init__()
        self.batches: list[list[float]] = []
        self.gate = threading.Event()
        self.gate.set()

    def forward(self, x, bad=False):
        return self.forward_batch([{"x": x, "bad": bad}])[0]

    def forward_batch(self, items):
        self.batches.append([float(i["x"][0]) for i in items])
        self.gate.wait(30)
        return [BadInput(f"item {float(i['x'][0])} is bad") if i.get("bad") else {"y": i["x"] * 2} for i in items]


def make_doubler() -> torch.nn.Module:
    return Doubler()
