"""A torch stage on a GPU reassembles its large inputs (split over several connections) into pinned host
memory, so their copy to the device is a DMA from locked pages, not a staged copy from pageable ones."""

from __future__ import annotations

import asyncio
import warnings

import numpy
import torch

from omnifleet_runtime import stripes, wire
from omnifleet_runtime.engines import make_engine
from omnifleet_runtime.schema import Stage


def test_split_inputs_are_reassembled_into_pinned_memory_and_reach_the_gpu_exactly():
    stage = Stage.model_validate({"name": "check", "type": "torch", "entrypoint": "bench.torch_stages:make_check",
                                  "engineArgs": {"device": "cuda"}})
    engine = make_engine(stage, "p")
    asyncio.run(engine.start())
    asm = stripes.Assembler(1 << 30, 64)
    asm.pool.make = engine.host_buffers()
    x = numpy.arange(4 << 20, dtype=numpy.float32)  # 16 MiB
    for round_ in range(2):  # the second message reuses the first one's pinned buffer
        frames = wire.encode(wire.Data("r", 0, "a", 1, {"x": wire.Array("float32", x.shape, (x + round_).data)}))
        out = None
        for part in stripes.split(frames, 4):
            out = asm.add([bytes(memoryview(f)) for f in part])
        arr = wire.decode(out).payload["x"]
        with warnings.catch_warnings():  # a read-only view: only looked at
            warnings.simplefilter("ignore", UserWarning)
            assert torch.frombuffer(arr.data, dtype=torch.uint8).is_pinned()
        t = engine._to_tensor(arr)
        assert t.is_cuda and torch.equal(t.cpu(), torch.from_numpy(x + round_))
        del out, arr, t
    assert asm.pool.reused == 1
    # The default stays ordinary memory: a torch stage on the CPU has no maker.
    cpu = make_engine(Stage.model_validate({**stage.model_dump(by_alias=True), "engineArgs": {"device": "cpu"}}), "p")
    asyncio.run(cpu.start())
    assert cpu.host_buffers() is None
