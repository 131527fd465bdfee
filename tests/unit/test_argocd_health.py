"""The Argo CD health script, run by a real Lua 5.1 interpreter (lupa) like Argo CD's gopher-lua.

Its inputs are statuses computed by the operator's own status function.
"""

from __future__ import annotations

import lupa.lua51 as lupa  # a test dependency: missing, this module fails, it does not skip

from omnifleet_runtime.validate import Problem

from ..conftest import REPO
from .test_status import Observed, all_ready, dep, pod, status

SCRIPT = (REPO / "manifests" / "gitops" / "health.lua").read_text()


def health(obj: dict) -> tuple[str, str]:
    lua = lupa.LuaRuntime(unpack_returned_tuples=True, register_eval=False)
    # Argo CD gives the script no standard library: hide what lupa opened.
    for lib in ("string", "table", "math", "os", "io", "debug"):
        lua.execute(f"{lib} = nil")
    lua.globals().obj = _to_lua(lua, obj)
    hs = lua.execute(SCRIPT)
    return hs["status"], hs["message"]


def _to_lua(lua, value):
    if isinstance(value, dict):
        return lua.table_from({k: _to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([_to_lua(lua, v) for v in value])
    return value


def cr(st: dict | None, generation: int = 1, deleting: bool = False) -> dict:
    meta = {"name": "speech", "generation": generation}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-30T00:00:00Z"
    return {"metadata": meta, **({"status": st} if st is not None else {})}


def test_ready_is_healthy():
    assert health(cr(status(Observed(all_ready()))))[0] == "Healthy"


def test_no_status_is_progressing():
    assert health(cr(None)) == ("Progressing", "Waiting for the operator")


def test_generation_mismatch_is_progressing():
    assert health(cr(status(Observed(all_ready())), generation=2))[0] == "Progressing"


def test_rollout_is_progressing_with_reason():
    st = status(Observed(all_ready(**{"speech-talker": dep("speech-talker", 2, updated=1, replicas=3)[1]})))
    state, message = health(cr(st))
    assert state == "Progressing" and message.startswith("RollingOut: ")


def test_capacity_pending_is_progressing():
    st = status(Observed(all_ready(), pods=[pod("talker", unschedulable=True)]))
    assert health(cr(st))[0] == "Progressing"


def test_invalid_spec_is_degraded_and_names_the_field():
    st = status(Observed(), doc=None, problems=[Problem("spec.stages[0].gpus", "must be >= 0")])
    state, message = health(cr(st))
    assert state == "Degraded" and "spec.stages[0].gpus" in message


def test_lost_stage_is_degraded():
    ready = status(Observed(all_ready()))
    st = status(Observed(all_ready(**{"speech-talker": dep("speech-talker", 2, ready=0)[1]})), prior=ready)
    assert health(cr(st))[0] == "Degraded"


def test_deleting():
    assert health(cr(status(Observed(all_ready())), deleting=True)) == ("Progressing", "Pending deletion")
