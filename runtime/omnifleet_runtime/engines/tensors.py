"""Tensors <-> wire.Array, for engines that run torch (imported only in stage processes).

`to_wire(value)` turns torch tensors and numpy arrays anywhere in a value
(dicts, lists) into `wire.Array`s (raw bytes, no copy beyond making the data
contiguous on the host); `to_tensor(array)` turns one back into a tensor.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..wire import Array, walk


def is_tensor_like(v: Any) -> bool:
    mod = type(v).__module__
    return (mod.startswith("torch") and hasattr(v, "detach")) or (mod == "numpy" and hasattr(v, "dtype")
                                                                    and hasattr(v, "shape"))


def array_of(v: Any) -> Array:
    """A wire.Array of one torch tensor or numpy array."""
    if type(v).__module__.startswith("torch"):
        import torch

        t = v.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()  # a view of the tensor's memory
        return Array(str(t.dtype).removeprefix("torch."), tuple(t.shape), memoryview(raw))
    import numpy as np

    a = np.ascontiguousarray(v)
    return Array(str(a.dtype), tuple(a.shape), memoryview(a.reshape(-1).view(np.uint8)))


def to_wire(value: Any) -> Any:
    return walk(value, lambda v: array_of(v) if is_tensor_like(v) else v)


def to_tensor(a: Array, device: str = "cpu") -> Any:
    """A tensor (a copy, writable) of a wire.Array."""
    import torch

    with warnings.catch_warnings():  # frames are read-only; we copy before anyone writes
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(a.data, dtype=torch.uint8) if len(a.data) else torch.empty(0, dtype=torch.uint8)
    t = flat.view(getattr(torch, a.dtype)).reshape(a.shape)
    return t.to(device) if device != "cpu" else t.clone()
