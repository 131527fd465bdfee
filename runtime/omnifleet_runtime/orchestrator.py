"""Move each request through the stage graph; survive replicas coming and going.

For one request the orchestrator picks a replica per stage (least outstanding
work; a downstream stage prefers the replica in the same pod as its upstream)
and dispatches the request to all of them at once. Each Dispatch names where
that replica sends its output: the downstream replicas' data ports, and the
master for final outputs. So stage-to-stage payloads never pass through the
master; it sees small control messages and the final outputs it streams to
the client.

A request may ask for only some of the final outputs (chat without audio,
images only): then only those final stages and the stages they depend on run.

When a replica is lost, a request that has not streamed anything to its
client is dispatched again as a new attempt (its other stage tasks are
aborted; messages of an old attempt are ignored), at most `max_redispatches`
times, so a request that kills or wedges whatever runs it takes down a
bounded number of replicas; one that has streamed ends with an error event.
A request waits, bounded, for a stage with no replica. Every request has a
deadline: past it, it is aborted in every stage and ends with a 504 event.
The events waiting for the client are bounded too: a client that does not
read its stream ends its request instead of growing the master's memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from . import tracing, wire
from .content import has_media, strip_media
from .membership import Membership, Replica
from .metrics import MasterMetrics
from .schema import PipelineSpec
from .validate import topological_order

log = logging.getLogger("omnifleet.orchestrator")

# Stage types whose engine takes a CUDA tensor by IPC handle from a co-located upstream (wire.CudaIpc).
CUDA_IPC_TYPES = frozenset({"torch"})
EVENTS_MAX = 4096  # final-output chunks queued for one client before the request is failed


class NoReplica(Exception):
    def __init__(self, stages: list[str]):
        self.stages = stages
        super().__init__(f"no replica of stage(s) {', '.join(stages)} is registered")


@dataclass(frozen=True)
class Event:
    kind: str  # "output" | "error" | "end"
    stage: str = ""
    payload: Any = None
    message: str = ""
    status: int = 500
    code: str = ""


@dataclass(eq=False)
class Run:
    """One client request in flight."""

    info: wire.RequestInfo
    sampling: dict[str, dict[str, Any]]
    started: float = field(default_factory=time.monotonic)
    events: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(EVENTS_MAX + 1))  # + the last event
    attempt: int = 0
    plan: dict[str, Replica] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)  # stages of this attempt not done yet
    dispatched_at: float = 0.0
    streamed: bool = False
    closed: bool = False
    stages: list[str] = field(default_factory=list)  # the stages this request runs, in order
    final: frozenset[str] = frozenset()  # the final stages whose outputs the client gets
    timeout_s: float = 0.0
    expiry: asyncio.TimerHandle | None = None
    first_outputs: set[str] = field(default_factory=set)  # final stages that have sent a chunk
    done_at: dict[str, float] = field(default_factory=dict)  # this attempt's finished stages
    tokens: dict[str, tuple[int, int]] = field(default_factory=dict)  # stage -> (prompt, completion) tokens
    light_info: wire.RequestInfo | None = None  # info without decoded media: what stages past the entry get
    span: Any = None  # the request's trace span; one child per stage attempt in `spans`
    spans: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.info.request_id


class Orchestrator:
    def __init__(
        self,
        spec: PipelineSpec,
        membership: Membership,
        send: Callable[[bytes, wire.Msg], None],
        metrics: MasterMetrics,
        replica_wait_s: float,
        max_redispatches: int = 1,
    ):
        self.spec = spec
        self.membership = membership
        self.send = send
        self.metrics = metrics
        self.replica_wait_s = replica_wait_s
        self.max_redispatches = max_redispatches
        self.order = topological_order(spec)
        self.entry = next(s.name for s in spec.stages if not s.inputs)  # the one stage that gets decoded media
        self.final = {s.name for s in spec.stages if s.final_output != "none"}
        self.downstream = {s.name: [t.name for t in spec.stages if s.name in t.inputs] for s in spec.stages}
        self.runs: dict[str, Run] = {}
        self._calls: dict[str, tuple[bytes, asyncio.Future]] = {}  # call id -> (replica identity, answer)
        self._tasks: set[asyncio.Task] = set()
        # Stages whose pods may scale to zero (minReplicas 0 on their host): a request that finds none waits
        # this long for the first replica, instead of a 503 at once.
        self.activation_s: dict[str, float] = {}
        for st in spec.stages:
            a = spec.stage(st.colocate_with or st.name).autoscaling
            if a is not None and a.min_replicas == 0:
                self.activation_s[st.name] = a.activation_timeout

    # ------------------------------------------------------------ requests

    def needed(self, final: set[str] | frozenset[str]) -> list[str]:
        """The stages that produce these final outputs: them and everything upstream, in order."""
        need, todo = set(), list(final)
        while todo:
            name = todo.pop()
            if name not in need:
                need.add(name)
                todo += self.spec.stage(name).inputs
        return [s for s in self.order if s in need]

    def start(self, info: wire.RequestInfo, sampling: dict[str, dict[str, Any]],
              final: set[str] | None = None, timeout_s: float = 600.0) -> Run:
        """Admit and dispatch a request, or raise NoReplica naming the stages without one.

        final: the final stages the client wants (default: all of them).
        timeout_s: the request's deadline, after which it is aborted everywhere.
        """
        final = frozenset(self.final if final is None else final)
        stages = self.needed(final)
        missing = [s for s in self.membership.missing() if s in stages]
        if hard := [s for s in missing if s not in self.activation_s]:
            raise NoReplica(hard)
        run = Run(info, sampling, stages=stages, final=final, timeout_s=timeout_s)
        if info.messages and has_media(info.messages):
            run.light_info = msgspec.structs.replace(info, messages=strip_media(info.messages))
        run.span = tracing.start("request", attributes={"omnifleet.request_id": run.id, "omnifleet.api": info.kind,
                                                        "omnifleet.stages": ",".join(stages)}, server=True)
        self.runs[run.id] = run
        run.expiry = asyncio.get_running_loop().call_later(timeout_s, self._expire, run)
        plan = None if missing else self._plan(run)
        if plan is not None:
            self._dispatch(run, plan)
        else:
            # Scaled to zero: held while the autoscaler, seeing the demand, starts a replica. Or no revision
            # has every stage (a replica of one stage left mid-rollout): held for the replica wait.
            log.info("request %s waits for %s", run.id, f"the first replica of {', '.join(missing)} (scaled to "
                     "zero)" if missing else "a revision of the pipeline with a replica of every stage")
            self._spawn(self._redispatch(run))
        return run

    def demand(self) -> dict[str, int]:
        """Open requests per stage they still need (in flight on it, or waiting for a replica of it)."""
        out = {s.name: 0 for s in self.spec.stages}
        for run in self.runs.values():
            for name in run.stages:
                if name not in run.done_at:
                    out[name] += 1
        return out

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _plan(self, run: Run) -> dict[str, Replica] | None:
        """A replica per stage, all of one revision of the pipeline (None: no revision has them all)."""
        revisions = self.membership.combo(run.stages)
        if revisions is None:
            return None
        plan: dict[str, Replica] = {}
        for name in run.stages:
            candidates = [r for r in self.membership.routable(name) if self.membership.fits(r, revisions)]
            pods = {plan[u].replica for u in self.spec.stage(name).inputs}
            local = [r for r in candidates if r.replica in pods]
            plan[name] = min(local or candidates, key=lambda r: (r.outstanding, r.assigned))
        return plan

    def _dispatch(self, run: Run, plan: dict[str, Replica]) -> None:
        run.plan, run.pending, run.dispatched_at, run.done_at = plan, set(plan), time.monotonic(), {}
        for rep in plan.values():
            rep.outstanding += 1
            rep.assigned += 1
        # The entry stage (first: stages are in topological order) at once: the first output waits on nothing
        # else. Then downstream first, so a replica usually knows a request before its data arrives (else it
        # holds it).
        for name in (run.stages[0], *reversed(run.stages[1:])):
            rep = plan[name]
            span = run.spans[name] = tracing.start(f"stage {name}", run.span, {
                "omnifleet.stage": name, "omnifleet.replica": rep.replica, "omnifleet.attempt": run.attempt})
            routes = [
                wire.Route(d, plan[d].replica, plan[d].data_addr, local=plan[d].replica == rep.replica,
                           cuda_ipc=plan[d].replica == rep.replica and self.spec.stage(d).type in CUDA_IPC_TYPES,
                           bulk=plan[d].bulk_addr)
                for d in self.downstream[name] if d in plan
            ]
            self.send(rep.identity, wire.Dispatch(
                request_id=run.id, attempt=run.attempt, stage=name,
                info=run.info if name == self.entry or run.light_info is None else run.light_info,
                sampling_params=run.sampling.get(name, {}), inputs=list(self.spec.stage(name).inputs),
                routes=routes, final=name in run.final, traceparent=tracing.traceparent(span),
            ))

    async def _redispatch(self, run: Run) -> None:
        # A stage scaled to zero gets its activation timeout: its first replica may need minutes.
        missing = [s for s in self.membership.missing() if s in run.stages]
        wait_s = max([self.activation_s.get(s, self.replica_wait_s) for s in missing] or [self.replica_wait_s])
        deadline = time.monotonic() + wait_s
        while not run.closed:
            plan = self._plan(run)
            if plan is not None:
                self._dispatch(run, plan)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [s for s in self.membership.missing() if s in run.stages]
                zero = [s for s in missing if s in self.activation_s]
                if not missing:
                    why = (f"no revision of the pipeline had a replica of every stage within {wait_s:g}s: "
                           + self.membership.lacking(run.stages))
                elif not zero:
                    why = f"no replica of stage(s) {', '.join(missing)} came back within {wait_s:g}s"
                else:
                    why = (f"no replica of stage(s) {', '.join(missing)} started within {wait_s:g}s (scaled to zero: "
                           "the autoscaler adds one while requests wait; activationTimeoutSeconds bounds the wait)")
                self._fail(run, why, status=503, code="no_replica")
                return
            await self.membership.wait_change(left)

    def _release(self, run: Run, abort: bool, why: str = "released") -> None:
        """Forget this attempt's unfinished stage tasks (telling their replicas to stop)."""
        for name in run.pending:
            rep = run.plan[name]
            rep.outstanding -= 1
            tracing.end(run.spans.pop(name, None), why)
            if abort:
                self.send(rep.identity, wire.Abort(run.id, run.attempt))
        run.pending = set()

    def _close(self, run: Run, event: Event, outcome: str) -> None:
        run.closed = True
        self.runs.pop(run.id, None)
        if run.expiry is not None:
            run.expiry.cancel()
        run.events.put_nowait(event)  # the queue keeps a place for it
        tracing.end(run.span, event.message if event.kind == "error" else None)
        self.metrics.requests.inc(api=run.info.kind, outcome=outcome)
        self.metrics.request_latency.observe(time.monotonic() - run.started)

    def _fail(self, run: Run, message: str, status: int = 500, code: str = "stage_failed") -> None:
        if run.closed:
            return
        log.warning("request %s failed: %s", run.id, message)
        self._release(run, abort=True, why=message)
        self._close(run, Event("error", message=message, status=status, code=code), code)

    def _expire(self, run: Run) -> None:
        if not run.closed:
            self.metrics.deadlines.inc(api=run.info.kind)
            self._fail(run, f"the request did not finish within its deadline of {run.timeout_s:g}s; "
                            "it was aborted in every stage", status=504, code="deadline_exceeded")

    def fail_all(self, message: str, status: int = 503, code: str = "shutting_down") -> int:
        """End every open request with this error (aborted in every stage); how many."""
        runs = [r for r in self.runs.values() if not r.closed]
        for run in runs:
            self._fail(run, message, status=status, code=code)
        return len(runs)

    def abort(self, run: Run) -> None:
        """The client went away: stop the request in every stage."""
        if not run.closed:
            log.info("request %s: the client went away; aborting it in every stage", run.id)
            self._release(run, abort=True, why="aborted by the client")
            self._close(run, Event("error", message="aborted by the client", status=499, code="aborted"),
                        "aborted")

    def _current(self, rep: Replica, request_id: str, attempt: int, stage: str) -> Run | None:
        run = self.runs.get(request_id)
        if run is None or run.attempt != attempt or run.plan.get(stage) is not rep or stage not in run.pending:
            return None  # an old attempt, an aborted request, or a stray message
        return run

    def on_output(self, rep: Replica, msg: wire.Output) -> None:
        run = self._current(rep, msg.request_id, msg.attempt, msg.stage)
        if run is None or msg.stage not in run.final:
            return
        if not run.streamed:
            run.streamed = True
            self.metrics.first_output_latency.observe(time.monotonic() - run.started)
        if run.events.qsize() >= EVENTS_MAX:
            self._fail(run, f"the client did not read its answer: {EVENTS_MAX} chunks were waiting for it",
                       status=503, code="client_too_slow")
            return
        if msg.stage not in run.first_outputs:
            run.first_outputs.add(msg.stage)
            self.metrics.time_to_first_output.observe(time.monotonic() - run.started, stage=msg.stage,
                                                      output=self.spec.stage(msg.stage).final_output)
        run.events.put_nowait(Event("output", stage=msg.stage, payload=msg.payload))

    def on_done(self, rep: Replica, msg: wire.Done) -> None:
        run = self._current(rep, msg.request_id, msg.attempt, msg.stage)
        if run is None:
            return
        run.pending.discard(msg.stage)
        rep.outstanding -= 1
        if msg.prompt_tokens or msg.completion_tokens:
            run.tokens[msg.stage] = (msg.prompt_tokens, msg.completion_tokens)
        now = run.done_at[msg.stage] = time.monotonic()
        self.metrics.hop_latency.observe(now - run.dispatched_at, stage=msg.stage)
        tracing.end(run.spans.pop(msg.stage, None), msg.error)
        if msg.error is not None and msg.bad_input:
            self._fail(run, f"stage {msg.stage!r} refused the request: {msg.error}", status=400,
                       code="invalid_request_error")
        elif msg.error is not None:
            self._fail(run, f"stage {msg.stage!r} (replica {rep.replica}) failed: {msg.error}")
        elif not run.pending:
            self._observe_shares(run)
            self._close(run, Event("end", payload=self._usage(run)), "ok")

    def _usage(self, run: Run) -> dict[str, Any]:
        """OpenAI's usage: the entry stage's prompt, the final stages' completions; and every stage's own."""
        prompt = sum(p for s, (p, _) in run.tokens.items() if not self.spec.stage(s).inputs)
        completion = sum(c for s, (_, c) in run.tokens.items() if s in run.final)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "stages": {s: {"prompt_tokens": p, "completion_tokens": c} for s, (p, c) in run.tokens.items()}}

    def _observe_shares(self, run: Run) -> None:
        """Each stage's share of a finished request: from the last of its inputs finishing until it finished.

        A stage counts as finished no earlier than its inputs (a stream-mode stage's Done may overtake its
        upstream's on another connection), so along a chain the shares add up to dispatch-to-last-Done.
        """
        end: dict[str, float] = {}
        for name in run.stages:  # in topological order
            start = max((end[u] for u in self.spec.stage(name).inputs if u in end), default=run.dispatched_at)
            end[name] = max(run.done_at[name], start)
            self.metrics.request_stage.observe(end[name] - start, stage=name)

    def on_replica_lost(self, rep: Replica, why: str) -> None:
        # Its answers to control calls will not come (a new session is a new identity).
        for call_id, (identity, fut) in self._calls.items():
            if identity == rep.identity and not fut.done():
                fut.set_result(wire.ControlReply(call_id, False, error=f"replica {why} before answering"))
        for run in list(self.runs.values()):
            held = [s for s in run.pending if run.plan[s] is rep]
            if not held:
                continue
            if run.streamed:
                self._fail(run, f"replica {rep.replica} of stage {rep.stage!r} {why} after output was "
                                f"streamed; the request cannot be retried", status=502, code="replica_lost")
                continue
            if run.attempt >= self.max_redispatches:
                self._fail(run, f"replica {rep.replica} of stage {rep.stage!r} {why} while holding the request, "
                                f"which was dispatched {run.attempt + 1} time(s) already "
                                f"(at most {self.max_redispatches} re-dispatch(es))",
                           status=502, code="replica_lost")
                continue
            log.info("request %s: replica %s %s; dispatching again", run.id, rep, why)
            self.metrics.redispatches.inc(stage=rep.stage)
            self._release(run, abort=True, why=f"replica {rep.replica} of stage {rep.stage!r} {why}")
            run.attempt += 1
            self._spawn(self._redispatch(run))

    # ------------------------------------------------------------ control RPCs

    async def control(self, stage: str, method: str, args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Call method on every replica of stage; each replica's answer (or its timeout)."""
        calls: dict[str, asyncio.Future] = {}
        ids = []
        for rep in self.membership.replicas(stage):
            ids.append(uuid.uuid4().hex)
            calls[rep.replica] = fut = asyncio.get_running_loop().create_future()
            self._calls[ids[-1]] = (rep.identity, fut)
            self.send(rep.identity, wire.Control(ids[-1], method, args))
        try:
            if calls:
                await asyncio.wait(calls.values(), timeout=timeout_s)
        finally:
            for call_id in ids:
                del self._calls[call_id]
        answers = {}
        for replica, fut in calls.items():
            if not fut.done():
                fut.cancel()
                answers[replica] = {"ok": False, "error": f"no answer within {timeout_s:g}s"}
            else:
                reply: wire.ControlReply = fut.result()
                answers[replica] = {"ok": True, "result": reply.result} if reply.ok else \
                    {"ok": False, "error": reply.error}
        return answers

    def on_control_reply(self, msg: wire.ControlReply) -> None:
        _, fut = self._calls.get(msg.call_id, (None, None))
        if fut is not None and not fut.done():
            fut.set_result(msg)
