"""Engines run in-process: every callable kind of the python engine, and the torch engine."""

from __future__ import annotations

import struct
import sys

import pytest

from omnifleet_runtime.engines import EngineRequest, EngineStartError, make_engine
from omnifleet_runtime.schema import Stage
from omnifleet_runtime.wire import Array, RequestInfo


async def run(stage: Stage, items: list, params: dict | None = None) -> list:
    engine = make_engine(stage, "pod-x")
    await engine.start()

    async def inputs():
        for item in items:
            yield item

    req = EngineRequest("r1", inputs(), params or {}, RequestInfo("r1", "completion", "m", prompt="p"))
    out = [chunk async for chunk in engine.generate(req)]
    await engine.shutdown()
    return out


def py_stage(fn: str, **kw) -> Stage:
    return Stage(name="s", type="python", entrypoint=f"stagefns:{fn}", **kw)


@pytest.mark.parametrize(
    ("fn", "items", "expected"),
    [
        ("kind_plain", ["a", "skip", "b"], ["plain:a:0", "plain:b:2"]),
        ("kind_gen", ["a", "b"], ["gen:a", "seen:1", "gen:b", "seen:2"]),  # state lives across chunks
        ("kind_async", ["a"], [{"async": "a", "params": {"k": 1}}]),
        ("kind_agen", ["ab", "c"], ["a", "b", "c"]),
    ],
)
async def test_python_engine_callable_kinds(fn, items, expected):
    assert await run(py_stage(fn), items, {"k": 1}) == expected


async def test_python_engine_control():
    engine = make_engine(py_stage("kind_plain"), "pod-x")
    await engine.start()
    assert (await engine.control("ping", {}))["pong"] is True
    assert (await engine.control("whoami", {"a": 1}))["args"] == {"a": 1}
    with pytest.raises(ValueError, match="unsupported control method 'nosuch'"):
        await engine.control("nosuch", {})


async def test_llm_engine_loads_lazily_and_names_a_missing_model():
    # Making the engine imports no vLLM; start() checks the model path before it would.
    engine = make_engine(Stage(name="s", type="llm", model="/no/such/model"), "pod-x")
    with pytest.raises(EngineStartError, match="stage 's': model path /no/such/model does not exist"):
        await engine.start()


async def test_torch_engine_runs_a_module_on_wire_arrays():
    stage = Stage(name="s", type="torch", entrypoint="torchfns:make_scale",
                  engine_args={"device": "cpu", "factory_kwargs": {"factor": 3.0}})
    x = Array("float32", (2,), struct.pack("<2f", 1.0, 2.0))
    (out,) = await run(stage, [{"x": x, "offset": 1.0}])
    assert out["y"].dtype == "float32" and out["y"].shape == (2,)
    assert struct.unpack("<2f", bytes(out["y"].data)) == (4.0, 7.0)
    assert struct.unpack("<f", bytes(out["sum"].data)) == (9.0,)


def scalar(v: float) -> Array:
    return Array("float32", (1,), struct.pack("<f", v))


async def test_torch_engine_batches_the_items_of_concurrent_requests_through_forward_batch():
    """A module with forward_batch, max_concurrency 4: the items queued while a call runs go together into the
    next one, in order; a request aborted while queued is left out; an item the module refuses fails its
    own request only (BadInput, a 400), and a request with two items gets both outputs in order."""
    import asyncio

    from omnifleet_runtime.engines import BadInput

    stage = Stage(name="s", type="torch", entrypoint="torchfns:make_doubler",
                  engine_args={"device": "cpu", "max_concurrency": 4})
    engine = make_engine(stage, "pod-x")
    await engine.start()
    module = engine.module

    async def request(rid: str, *items: dict) -> list[float]:
        async def inputs():
            for item in items:
                yield item
        req = EngineRequest(rid, inputs(), {}, RequestInfo(rid, "completion", "m", prompt="p"))
        return [struct.unpack("<f", bytes(out["y"].data))[0] async for out in engine.generate(req)]

    async def until(check) -> None:
        for _ in range(500):
            if check():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    try:
        module.gate.clear()  # the first call holds while the others queue behind it
        first = asyncio.create_task(request("a", {"x": scalar(1)}))
        await until(lambda: module.batches == [[1.0]])
        aborted = asyncio.create_task(request("b", {"x": scalar(2)}))
        two = asyncio.create_task(request("c", {"x": scalar(3)}, {"x": scalar(4)}))
        bad = asyncio.create_task(request("d", {"x": scalar(5), "bad": True}))
        await until(lambda: len(engine.queue) == 3)
        aborted.cancel()
        module.gate.set()
        assert await first == [2.0]
        assert await two == [6.0, 8.0]
        with pytest.raises(BadInput, match="item 5.0 is bad"):
            await bad
        assert aborted.cancelled()
        # the aborted request's item never reached the module; c's second item came after its first's output
        assert module.batches == [[1.0], [3.0, 5.0], [4.0]]
    finally:
        module.gate.set()
        await engine.shutdown()


async def test_torch_engine_without_concurrency_calls_forward_one_item_at_a_time():
    stage = Stage(name="s", type="torch", entrypoint="torchfns:make_doubler", engine_args={"device": "cpu"})
    engine = make_engine(stage, "pod-x")
    await engine.start()
    assert engine.batcher is None  # max_concurrency 1: forward, even for a module with forward_batch
    await engine.shutdown()
    out = await run(stage, [{"x": scalar(7)}, {"x": scalar(8)}])
    assert [struct.unpack("<f", bytes(o["y"].data)) for o in out] == [(14.0,), (16.0,)]


def test_vllm_omni_stage_fails_at_start_naming_what_is_missing(make_fleet):
    """A vllm-omni stage run with a python that has no vLLM-Omni (here: the test's own) exits 1 with one
    line saying so and how to get one."""
    from fleet_harness import pipeline, wait_until

    omni = {"name": "thinker", "type": "vllm-omni", "finalOutput": "text",
            "vllmOmni": {"pipeline": "qwen2_5_omni", "stageId": 0, "modelStage": "thinker", "workerType": "ar"}}
    fleet = make_fleet(pipeline(omni))
    fleet.start_master()
    pod = fleet.start_pod("pod-omni", "thinker")
    wait_until(lambda: not pod.alive(), "the vllm-omni stage pod to exit", timeout=60)
    assert pod.popen.returncode == 1
    out = pod.output()
    assert "stage thinker failed to start: stage 'thinker' is a vllm-omni stage, and this stage's python " \
           f"({sys.executable}) cannot import vLLM-Omni (ModuleNotFoundError: No module named 'vllm_omni')" in out
    assert "python -m omnifleet_runtime.devsetup.vllm_omni_env --print-python" in out


@pytest.mark.parametrize("omni, engine_args", [({"asyncChunk": True}, {}), ({}, {"async_chunk": True})])
async def test_vllm_omni_async_chunk_diffusion_stages_are_refused_at_start(omni, engine_args):
    # Async-chunk mode runs AR and generation stages; a diffusion one is refused before vLLM-Omni is imported.
    stage = Stage.model_validate({
        "name": "talker", "type": "vllm-omni", "inputs": ["thinker"], "engineArgs": engine_args,
        "vllmOmni": {"pipeline": "bagel", "stageId": 1, "modelStage": "dit", "workerType": "diffusion", **omni}})
    with pytest.raises(EngineStartError, match="stage 'talker': ") as err:
        await make_engine(stage, "pod-x").start()
    assert "async-chunk mode runs AR and generation stages here, not diffusion ones" in str(err.value)
