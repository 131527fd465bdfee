"""A torch module factory for the torch engine test (imported only where torch is installed)."""

import torch


class Scale(torch.nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = torch.nn.Parameter(torch.tensor(factor))

    def forward(self, x, offset=0.0):
        return {"y": x * self.factor + offset, "sum": (x * self.factor).sum()}


def make_scale(factor: float = 2.0) -> torch.nn.Module:
    return Scale(factor)

