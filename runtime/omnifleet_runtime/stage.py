"""One stage replica: an engine behind a control connection and a data port.

The worker loads its engine once, binds its data port (a PULL socket that
upstream stages push chunks to), connects out to every master and registers
with each (one session per master: its own connection, heartbeats and
reconnect loop; discovery.py finds the masters, again every few seconds).
A job belongs to the master that dispatched it: its outputs, Done and
control replies go to that master only. When a master goes away (its
connection closes, or no heartbeat) or forgets it (Reset), the worker aborts
that master's jobs only, and registers again on a fresh connection; the
other masters' work goes on, and the engine stays loaded.

Per request (a Dispatch), the worker gathers its inputs (the client request
for the entry stage, upstream Data chunks otherwise), runs them through the
stage's input processor and the engine, and sends each output chunk along
the routes the master chose: straight to the downstream replicas' data
ports (bulk bytes through shared memory when they share this pod), and to
the master when the stage produces final output.

On SIGTERM the worker stops taking work (the master stops routing to it),
finishes what is in flight up to a deadline, deregisters and exits 0. A SIGTERM
while its engine is still starting stops the start at once (its processes
killed) and exits 0: a pod deleted mid-load does not finish the load first.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import zmq
from aiohttp import web

from . import constants as C
from . import companions, discovery, seal, security, shm, stripes, tracing, wire, zsock
from .links import Link
from .engines import BadInput, Engine, EngineRequest, EngineStartError, load_callable, make_engine
from .metrics import CONTENT_TYPE, StageMetrics, audio_seconds
from .config import stage_revisions
from .schema import OmniPipeline
from .turns import StallWatch, Turns

log = logging.getLogger("omnifleet.stage")

_EOF = object()
PENDING_MAX = 10_000  # requests whose data arrived before their Dispatch
PENDING_TTL_S = 60.0
PEER_SOCKETS_MAX = 256
DEREGISTER_WAIT_S = 1.0  # for room to send a Deregister (a full queue to a slow master)
# Shared-memory files of this pod older than this are leftovers (a reader that died): swept.
SHM_LEFTOVER_AGE_S = 2 * PENDING_TTL_S
INPUTS_MAX = 4096  # input chunks of one request waiting for the engine; past it the request fails
# After a disconnect event, how many times (DISCONNECT_CHECK_S apart) the control socket is checked for a live
# connection before the event is taken to concern another one (a reconnect attempt that failed its handshake).
DISCONNECT_CHECKS = 5
DISCONNECT_CHECK_S = 0.02


class Refused(Exception):
    pass


@dataclass(eq=False)
class MasterSession:
    """This replica's registration with one master (one address found by discovery)."""

    addr: str  # tcp://IP:PORT
    # Still among the masters found. One no longer found keeps serving while its connection lives (a
    # draining master leaves DNS first, then finishes what it holds) and is not dialled again.
    wanted: bool = True
    sock: zsock.Socket | None = None  # set while registered
    master_id: str = ""
    serving: bool = True  # the master routes new requests to this replica's revision (wire.MasterHeartbeat)
    task: asyncio.Task | None = None


def start_watchdog(stage: str, timeout_s: float) -> threading.Event:
    """An event to set once the engine has started; if it is not set within timeout_s, the process
    kills what it started (the engine's own processes) and exits EXIT_ENGINE_START_TIMEOUT."""
    started = threading.Event()

    def watch() -> None:
        if started.wait(timeout_s):
            return
        log.error("stage %s failed to start: its engine did not start within %gs "
                  "(engineStartTimeoutSeconds); stopping it", stage, timeout_s)
        abandon_start(C.EXIT_ENGINE_START_TIMEOUT)

    threading.Thread(target=watch, name="engine-start-watchdog", daemon=True).start()
    return started


def abandon_start(code: int) -> None:
    """Kill what the engine's start has started (its own processes) and exit with code, at once."""
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    logging.shutdown()
    os._exit(code)


def sigterm_while_starting(signum: int, frame: Any) -> None:
    # Nothing is registered or in flight yet, and a load may take minutes that a pod being deleted would
    # spend (CPU, GPU memory) on an engine nobody will use: stop now, not after the load and the drain.
    log.info("SIGTERM while the engine starts: stopping (nothing to drain)")
    abandon_start(0)


def ipc_nbytes(value: Any) -> int:
    """Bytes of the CUDA tensors a value hands over by IPC handle."""
    n = 0

    def leaf(v: Any) -> None:
        nonlocal n
        if isinstance(v, wire.CudaIpc):
            n += math.prod(v.shape) * wire.DTYPE_SIZES[v.dtype]

    wire.walk(value, leaf)
    return n


def descendants(pid: int) -> list[int]:
    """Every live process below pid, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@dataclass(eq=False)
class Job:
    """This replica's part of one attempt of one request."""

    msg: wire.Dispatch
    waiting: set[str]  # upstream stages not at eof yet
    inputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    whole: dict[str, list[Any]] = field(default_factory=dict)
    # Data is applied in each upstream's seq order: chunks may overtake each other (striped parts of a
    # large one come over several connections).
    next_seq: dict[str, int] = field(default_factory=dict)
    early: dict[tuple[str, int], wire.Data] = field(default_factory=dict)
    task: asyncio.Task | None = None
    started: bool = False
    ended_inputs: bool = False  # the end of the inputs is queued
    # For the metrics: when it was dispatched, got its first input, sent its last chunk; audio made.
    dispatched: float = field(default_factory=time.monotonic)
    first_input: float = 0.0
    last_chunk: float = 0.0
    audio_s: float = 0.0
    prompt_tokens: int = 0  # as the engine's outputs report them (token_ids, prompt_token_ids)
    completion_tokens: int = 0
    span: Any = None  # this attempt's trace span here; one child per route in `transfers`
    transfers: dict[str, list] = field(default_factory=dict)  # route -> [span, bytes, chunks]
    session: MasterSession | None = None  # the master that dispatched it: the only one told about it

    @property
    def key(self) -> tuple[str, int]:
        return self.msg.request_id, self.msg.attempt

    def end_inputs(self) -> None:
        self.inputs.put_nowait(_EOF)
        self.ended_inputs = True

    def inputs_ended(self) -> bool:
        """Whether only the end is left to read (every input is in hand): nothing is ever queued after it."""
        return self.ended_inputs and self.inputs.qsize() == 1

    async def iter_inputs(self) -> AsyncIterator[Any]:
        while (item := await self.inputs.get()) is not _EOF:
            if isinstance(item, BaseException):
                raise item
            if not self.first_input:
                self.first_input = time.monotonic()
            yield item


class StageWorker:
    def __init__(
        self,
        doc: OmniPipeline,
        stage: str,
        replica: str,
        masters: str,
        config_hash: str,
        host: str = "0.0.0.0",
        data_port: int = C.STAGE_DATA_PORT,
        advertise_host: str = "127.0.0.1",
        drain_timeout_s: float = C.DRAIN_TIMEOUT_S,
        keys: security.Keys | None = None,
        max_frame_bytes: int = C.MAX_DATA_FRAME_BYTES,
        heartbeat_interval_s: float = C.HEARTBEAT_INTERVAL_S,
        heartbeat_timeout_s: float = C.HEARTBEAT_TIMEOUT_S,
    ):
        if keys is None:
            raise ValueError("a stage needs the pipeline's keys")
        self.doc = doc
        self.keys, self.max_frame_bytes = keys, max_frame_bytes
        self.data_plane = doc.spec.security.data_plane
        self.streams = doc.spec.security.data_streams or stripes.default_streams(self.data_plane == security.CURVE)
        # Connections to a bulk port (seal.py): unencrypted on the wire, the sealing is done by threads.
        self.bulk_streams = doc.spec.security.data_streams or stripes.default_streams(False)
        self.assembler = stripes.Assembler(stripes.held_bound(max_frame_bytes), C.MAX_FRAMES)
        self.opener = seal.Opener(self.assembler)
        self.bulk: zsock.Socket | None = None
        self.bulk_addr = ""
        self.copy_pool: ThreadPoolExecutor | None = None  # puts split buffers back together, off the loop
        self.copy_tasks: set[asyncio.Task] = set()
        self.dropped = 0
        self.heartbeat_interval_s, self.heartbeat_timeout_s = heartbeat_interval_s, heartbeat_timeout_s
        self.stage = doc.spec.stage(stage)
        self.replica = replica
        self.masters = discovery.parse_masters(masters)  # HOST:PORT[,HOST:PORT...], as --master gives them
        self.sessions: dict[str, MasterSession] = {}  # by address
        self.config_hash = config_hash
        self.revisions = stage_revisions(doc)
        self.host, self.data_port, self.advertise_host = host, data_port, advertise_host
        self.drain_timeout_s = drain_timeout_s
        self.mode = self.stage.effective_input_mode()
        self.processor = None
        self.expand = None  # promptExpand: the CFG companions of each request (companions.py)
        self.engine: Engine | None = None
        self.jobs: dict[tuple[str, int], Job] = {}
        self.pending: OrderedDict[tuple[str, int], list[tuple[float, wire.Data]]] = OrderedDict()
        # Requests that ended here (done, failed, aborted): their late data is dropped at once, not held
        # as early data for PENDING_TTL_S (with its shared-memory regions).
        self.ended: OrderedDict[tuple[str, int], float] = OrderedDict()
        self.peers: OrderedDict[str, Link] = OrderedDict()
        self.shm_prefix = shm.pod_prefix(replica)
        self.bytes = {"tcp": 0, "shm": 0, "cuda_ipc": 0, "master": 0}
        self.queued = 0
        self.slots: asyncio.Semaphore | None = None
        self.stopping = asyncio.Event()
        self.control_tasks: set[asyncio.Task] = set()
        self.draining = False
        self.on_registered = self.on_engine_died = None
        self.exit_code = 0
        self.audio_window: deque[tuple[float, float, float]] = deque()  # (done at, seconds of work, of audio)
        self.metrics = StageMetrics(stage, lambda: {
            "inflight": len(self.jobs), "queue_depth": self.queued, "early_data": len(self.pending),
            "realtime_factor": self._realtime_factor()})

    # ------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Build the engine and the input processor (the one expensive step; done once)."""
        self.engine = make_engine(self.stage, self.replica)
        if self.stage.input_processor:
            self.processor = load_callable(self.stage.input_processor)
        if self.stage.prompt_expand:
            self.expand = load_callable(self.stage.prompt_expand)

    def _set_registered(self, state: int) -> None:
        if self.on_registered is not None:
            self.on_registered(state)

    async def main(self, on_ready=None, on_metrics=None, on_registered=None, on_engine_died=None) -> int:
        """on_metrics(port): called with the loopback port serving this worker's /metrics;
        on_registered(state): called as this worker's registration changes (C.WORKER_SERVING: it takes work);
        on_engine_died(): called once its engine can serve no more."""
        self.on_registered, self.on_engine_died = on_registered, on_engine_died
        loop = asyncio.get_running_loop()
        signal.signal(signal.SIGTERM, sigterm_while_starting)  # the drain's handler once the engine runs
        timeout = self.stage.engine_start_timeout_seconds or C.ENGINE_START_TIMEOUT_S
        started = start_watchdog(self.stage.name, timeout)  # engines load synchronously: a thread keeps time
        try:
            self.load()
            self.engine.metrics = self.metrics
            await self.engine.start()
        except EngineStartError as e:  # a known reason (bad engine arg, missing model): one clear line
            log.error("stage %s failed to start: %s", self.stage.name, e)
            return 1
        finally:
            started.set()
        loop.add_signal_handler(signal.SIGTERM, self.stopping.set)  # from here on, SIGTERM drains
        if (make := self.engine.host_buffers()) is not None:
            self.assembler.pool.make = make
        if self.engine.max_concurrency:
            self.slots = asyncio.Semaphore(int(self.engine.max_concurrency))
        # One I/O thread per data stream: each connection's encryption (and the receiver's decryption of
        # its parts) runs on a core of its own.
        self.ctx = zmq.Context(io_threads=self.streams)
        self.auth = security.start_authenticator(self.ctx, self.keys)  # before the bind: no handshake unchecked
        self.data, self.data_addr = self._listen(self.data_plane, self.data_port)
        if self.data_plane == security.CURVE:  # large messages come sealed, on the bulk port
            self.bulk, self.bulk_addr = self._listen(
                security.PLAIN_AUTH, self.data_port and self.data_port + C.BULK_PORT_OFFSET)
        log.info("stage %s/%s: engine loaded, data port %s (%s, %d stream(s) to each downstream port)%s",
                 self.stage.name, self.replica, self.data_addr, self.data_plane, self.streams,
                 f", bulk port {self.bulk_addr} (AES-GCM, {self.bulk_streams} stream(s))" if self.bulk else "")
        metrics_runner = await self._serve_metrics(on_metrics)
        if on_ready:
            on_ready()
        tasks = [loop.create_task(self._masters_loop()), loop.create_task(self._data_loop()),
                 loop.create_task(self._gc_loop()), loop.create_task(self._engine_watch())]
        if self.bulk is not None:
            tasks.append(loop.create_task(self._bulk_loop()))
        await self.stopping.wait()
        if self.exit_code == 0:
            await self._drain()
        for t in [*tasks, *self.copy_tasks]:
            t.cancel()
        await asyncio.gather(*tasks, *self.copy_tasks, return_exceptions=True)
        if self.copy_pool is not None:
            self.copy_pool.shutdown(wait=False)
        try:
            await self.engine.shutdown()
        except Exception as e:  # a dead engine may fail to shut down; the exit code already says why
            log.warning("engine shutdown failed: %s: %s", type(e).__name__, e)
        await metrics_runner.cleanup()
        for link in self.peers.values():
            link.close()
        self.data.close(linger=0)
        if self.bulk is not None:
            self.bulk.close(linger=0)
        self.auth.stop()
        self.ctx.term()
        return self.exit_code

    async def _serve_metrics(self, on_metrics) -> web.AppRunner:
        """This worker's /metrics on a loopback port; the pod's parent serves them to Prometheus."""
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

        app = web.Application()
        app.add_routes([web.get("/metrics", metrics)])
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        if on_metrics:
            on_metrics(sock.getsockname()[1])
        return runner

    async def _drain(self) -> None:
        self.draining = True
        self._set_registered(C.WORKER_UNREGISTERED)
        log.info("SIGTERM: draining %d request(s), up to %.0fs", len(self.jobs), self.drain_timeout_s)
        await self._broadcast(self._heartbeat())  # the masters stop routing here at once
        deadline = time.monotonic() + self.drain_timeout_s
        while self.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.jobs:
            log.warning("drain deadline passed; aborting %d request(s)", len(self.jobs))
            self._abort_all()
        await self._broadcast(wire.Deregister("shutting down"), DEREGISTER_WAIT_S)
        log.info("drained; exiting")

    async def _engine_watch(self) -> None:
        while True:
            await asyncio.sleep(C.ENGINE_WATCH_INTERVAL_S)
            if reason := self.engine.dead():
                await self._engine_died(reason)
                return

    async def _engine_died(self, reason: str) -> None:
        """The engine can serve no more: leave the master first (so it moves this replica's requests to
        others instead of failing them), drop the requests here, and exit non-zero so the pod restarts."""
        if self.exit_code == C.EXIT_ENGINE_DIED:
            return
        self.exit_code = C.EXIT_ENGINE_DIED
        log.error("stage %s: engine died: %s; deregistering and exiting", self.stage.name, reason)
        self.draining = True  # no new session
        self._set_registered(C.WORKER_UNREGISTERED)
        if self.on_engine_died is not None:
            self.on_engine_died()
        await self._broadcast(wire.Deregister(f"engine died: {reason}"), DEREGISTER_WAIT_S)
        self._abort_all()
        self.stopping.set()

    # ------------------------------------------------------------ master session

    def _heartbeat(self) -> wire.StageHeartbeat:
        return wire.StageHeartbeat(
            inflight=len(self.jobs), queue_depth=self.queued, draining=self.draining,
            bytes_tcp=self.bytes["tcp"], bytes_shm=self.bytes["shm"], bytes_master=self.bytes["master"],
            dropped=self.dropped + self.assembler.dropped + self.opener.dropped,
        )

    async def _send_master(self, msg: wire.Msg, session: MasterSession | None, block: bool = True) -> None:
        await self._send_master_frames(wire.encode(msg), session, block)

    async def _send_master_frames(self, frames: list, session: MasterSession | None, block: bool = True) -> None:
        """Send to one master; block=False drops the message while that master is unreachable."""
        sock = session.sock if session is not None else None
        if sock is None or sock.closed:
            return
        try:
            if block:
                await sock.send(frames)
            else:
                sock.send_nowait(frames)
        except zmq.Again:
            pass  # heartbeats are not queued while the master is unreachable
        except zmq.ZMQError as e:
            log.debug("send to master %s failed: %s", session.addr, e)

    async def _broadcast(self, msg: wire.Msg, wait_s: float = 0.0) -> None:
        """To every master this replica is registered with (what they all must know: draining, leaving).
        With wait_s, a message that finds no room waits that long for it (a Deregister dropped would read
        as a lost replica); else it is dropped, as heartbeats are."""
        frames = wire.encode(msg)

        async def send(session: MasterSession) -> None:
            if not wait_s:
                return await self._send_master_frames(frames, session, block=False)
            try:
                await asyncio.wait_for(self._send_master_frames(frames, session), wait_s)
            except asyncio.TimeoutError:
                log.warning("master %s took no %s in %gs", session.addr, type(msg).__name__, wait_s)

        await asyncio.gather(*(send(s) for s in list(self.sessions.values())))

    def _update_registered(self) -> None:
        # Ready (in the pod's /readyz) while registered with at least one master, not with all: every
        # master keeps its own membership and routes only to replicas registered with it, so a pod
        # registered anywhere is serving; asking for all would make one dead or unreachable master
        # take every stage pod out of its Service and stall every rollout, the opposite of HA.
        # Registered but waiting (no master serves its revision yet: a rollout whose other stages' new
        # replicas are still loading) is not ready either: the Deployment keeps the old pods meanwhile.
        registered = [s for s in self.sessions.values() if s.sock is not None]
        self._set_registered(C.WORKER_SERVING if not self.draining and any(s.serving for s in registered) else
                             C.WORKER_WAITING if not self.draining and registered else C.WORKER_UNREGISTERED)

    async def _masters_loop(self) -> None:
        """Keep one session per master found: find the masters again every few seconds."""
        try:
            while True:
                found = await discovery.resolve(self.masters)
                if found is not None:
                    self._reconcile_sessions(found)
                await asyncio.sleep(discovery.MASTER_RESOLVE_INTERVAL_S)
        finally:
            tasks = [s.task for s in self.sessions.values() if s.task is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _reconcile_sessions(self, found: set[str]) -> None:
        for addr, session in list(self.sessions.items()):
            if session.task.done():  # ended for good: no longer found, draining, or a bug
                if not session.task.cancelled() and (e := session.task.exception()) is not None:
                    log.error("session with master %s failed", addr, exc_info=e)
                del self.sessions[addr]
            elif addr not in found:
                if session.wanted:
                    log.info("master %s is no longer found; %s", addr,
                             "serving it while its connection lives" if session.sock else "no longer dialled")
                session.wanted = False
                if session.sock is None:  # not registered: nothing of its to finish
                    session.task.cancel()
            else:
                session.wanted = True
        if self.draining:  # a draining worker takes no new master
            return
        for addr in sorted(found - self.sessions.keys()):
            session = self.sessions[addr] = MasterSession(addr)
            session.task = asyncio.get_running_loop().create_task(self._session_loop(session))
            log.info("found master %s", addr)

    async def _session_loop(self, session: MasterSession) -> None:
        backoff = 0.0
        # A draining worker with no master has nothing left to finish; one no longer found is not dialled.
        while not self.draining and session.wanted:
            await asyncio.sleep(backoff)
            sock = zsock.Socket(self.ctx, zmq.DEALER)
            monitor: zsock.Socket | None = None
            # Everything after the socket is made is undone in `finally`: a socket or monitor left open, e.g.
            # by a connect() that raised, blocks the context's term() for ever.
            try:
                sock.linger = 0
                sock.immediate = True  # queue nothing for a master that is not connected
                security.secure_client(sock, self.keys, security.CURVE, C.MAX_CONTROL_FRAME_BYTES)  # always CURVE
                sock.routing_id = f"{self.stage.name}/{self.replica}/{uuid.uuid4().hex[:8]}".encode()
                monitor = zsock.Socket.wrap(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
                sock.connect(session.addr)
                reply = await self._register(sock)
                session.master_id, session.serving, session.sock = reply.master_id, reply.serving, sock
                self._update_registered()
                log.info("registered with master %s at %s", session.master_id, session.addr)
                why = await self._serve_master(sock, monitor, session)
                if self.draining:  # it left: the session's end is no news
                    log.info("master session ended (%s)", why)
                else:
                    log.warning("master session ended (%s); registering again at %s", why, session.addr)
                backoff = 0.0
            except Refused as e:
                log.error("registration refused by the master at %s: %s", session.addr, e)
                if "protocol version" in str(e):
                    self.exit_code = C.EXIT_PROTOCOL_MISMATCH
                    self.stopping.set()
                    return
                # An old connection of this replica not yet closed at the master: soon gone.
                backoff = 1.0 if "already registered" in str(e) else 5.0
            finally:
                session.sock = None
                self._update_registered()
                self._abort_session(session)  # whatever that master sent us can no longer be delivered
                if monitor is not None:
                    sock.disable_monitor()
                    monitor.close(linger=0)
                sock.close(linger=500 if self.draining else 0)  # let a Deregister leave

    async def _register(self, sock: zsock.Socket) -> wire.RegisterReply:
        reg = wire.Register(
            stage=self.stage.name, replica=self.replica, protocol_version=C.PROTOCOL_VERSION,
            config_hash=self.config_hash, data_addr=self.data_addr, bulk_addr=self.bulk_addr, pid=os.getpid(),
            engine=self.stage.type,
            revision=self.revisions[self.stage.name], generation=self.doc.metadata.generation or 0,
            revisions=self.revisions,
        )
        wait = 0.05
        while True:
            try:
                sock.send_nowait(wire.encode(reg))
            except zmq.Again:
                pass  # not connected yet
            deadline = time.monotonic() + wait
            wait = min(2 * wait, 1.0)
            while (left := deadline - time.monotonic()) > 0:
                if not await sock.poll(left * 1000):
                    break
                msg = await self._recv_control(sock)
                if isinstance(msg, wire.RegisterReply):
                    if not msg.ok:
                        raise Refused(msg.reason)
                    return msg

    async def _serve_master(self, sock: zsock.Socket, monitor: zsock.Socket,
                            session: MasterSession) -> str:
        """Handle the master's messages until it is lost; returns why the session ended."""
        last_seen = next_beat = time.monotonic()
        interval, timeout = self.heartbeat_interval_s, self.heartbeat_timeout_s
        watch = StallWatch(interval)  # this loop wakes at least once per interval
        checks = 0  # checks of the connection left after a disconnect event
        while True:
            now = time.monotonic()
            if stall := watch.stall(now):
                log.warning("this stage's event loop stalled for %.1fs", stall)
                last_seen += stall
            if now >= next_beat:
                await self._send_master(self._heartbeat(), session, block=False)
                next_beat = now + interval
            # Lost only if nothing is waiting: beats may have queued while this loop was busy.
            if now - last_seen > timeout and not await sock.poll(0):
                return f"no heartbeat from the master for {timeout:g}s"
            wait = max(0.0, min(next_beat, last_seen + timeout) - now)
            ready = await zsock.readable([sock, monitor], (min(wait, DISCONNECT_CHECK_S) if checks else wait) + 0.001)
            if monitor in ready:
                event = zsock.monitor_event(await monitor.recv_message(zsock.MONITOR_FRAMES))
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    checks = DISCONNECT_CHECKS
            if checks:
                # The event names a file descriptor, not this connection: a reconnect attempt that failed
                # its handshake reports one too, while the registered connection lives. Lost only when no
                # connection is left (its pipe goes just after the event: checked a few times).
                if not await self._connected(sock):
                    return "the master's connection closed"
                checks -= 1
                if not checks:
                    log.info("a disconnect event of the control socket to %s left its connection up; "
                             "the session goes on", session.addr)
            if sock not in ready:
                continue
            msg = await self._recv_control(sock)
            if msg is None:
                continue
            last_seen = time.monotonic()
            if isinstance(msg, wire.Reset):
                return f"reset by the master: {msg.reason}"
            try:
                self._on_master_message(msg, session)
            except Exception:  # a bug with one request must not end the session
                log.exception("error handling %s", type(msg).__name__)

    async def _connected(self, sock: zsock.Socket) -> bool:
        """Whether the control socket has a live connection: with `immediate` set, a send succeeds only then."""
        try:
            sock.send_nowait(wire.encode(self._heartbeat()))
            return True
        except zmq.ZMQError:  # EAGAIN: no connection (or its queue is full: a master that reads nothing)
            return False

    async def _recv_control(self, sock: zsock.Socket) -> wire.Msg | None:
        try:
            frames = await sock.recv_message(C.MAX_FRAMES)
        except zsock.Oversized as e:
            log.warning("dropped a message on the control connection: %s", e)
            self.dropped += 1
            return None
        try:
            return wire.decode(frames)
        except wire.WireError as e:
            log.warning("rejected frame on the control connection: %s", e)
            self.metrics.rejected_frames.inc(stage=self.stage.name, socket="control")
            return None

    def _on_master_message(self, msg: wire.Msg, session: MasterSession) -> None:
        if isinstance(msg, wire.Dispatch):
            self._start_job(msg, session)
        elif isinstance(msg, wire.Abort):
            job = self.jobs.get((msg.request_id, msg.attempt))
            if job is not None and job.session is not session:
                log.warning("ignored Abort of %s from a master that did not dispatch it", msg.request_id)
                return
            self._drop_pending(self.pending.pop((msg.request_id, msg.attempt), []))
            if job is None:
                self._ended((msg.request_id, msg.attempt))
            elif job.task is not None:
                job.task.cancel()
        elif isinstance(msg, wire.Control):
            task = asyncio.get_running_loop().create_task(self._control(msg, session))
            self.control_tasks.add(task)
            task.add_done_callback(self.control_tasks.discard)
        elif isinstance(msg, wire.MasterHeartbeat):
            if msg.serving is not None and msg.serving != session.serving:
                session.serving = msg.serving
                log.info("master %s %s this replica's revision", session.master_id,
                         "now serves" if msg.serving else "no longer serves")
                self._update_registered()
        elif not isinstance(msg, wire.RegisterReply):
            log.warning("rejected unexpected %s from the master", type(msg).__name__)

    async def _control(self, msg: wire.Control, session: MasterSession) -> None:
        try:
            result = await self.engine.control(msg.method, msg.args)
            frames = wire.encode(wire.ControlReply(msg.call_id, True, result))
        except Exception as e:  # the engine's failure, or a result the wire cannot carry
            frames = wire.encode(wire.ControlReply(msg.call_id, False, error=f"{type(e).__name__}: {e}"))
        await self._send_master_frames(frames, session)  # the caller's master; no other knows the call

    def _abort_session(self, session: MasterSession) -> None:
        """That master is gone: its jobs go, every other master's go on. Early data (its Dispatch not
        here yet) names no master: the GC sweeps what no Dispatch claims."""
        for job in list(self.jobs.values()):
            if job.session is session and job.task is not None:
                job.task.cancel()

    def _ended(self, key: tuple[str, int]) -> None:
        self.ended[key] = time.monotonic()
        self.ended.move_to_end(key)
        if len(self.ended) > PENDING_MAX:
            self.ended.popitem(last=False)

    def _abort_all(self) -> None:
        for job in list(self.jobs.values()):
            if job.task is not None:
                job.task.cancel()
        for items in self.pending.values():
            self._drop_pending(items)
        self.pending.clear()

    def _discard(self, payload: Any) -> None:
        """A payload nobody will read: its shared-memory files and the CUDA memory it hands over go."""
        shm.discard(payload, self.shm_prefix)
        if self.engine is not None:
            self.engine.release(payload)

    def _drop_pending(self, items: list[tuple[float, wire.Data]]) -> None:
        """Early data dropped unread: its shared-memory files go with it."""
        for _, data in items:
            self._discard(data.payload)

    # ------------------------------------------------------------ requests

    def _start_job(self, msg: wire.Dispatch, session: MasterSession) -> None:
        key = (msg.request_id, msg.attempt)
        if key in self.jobs or msg.stage != self.stage.name:
            log.warning("ignored Dispatch %s for stage %s", key, msg.stage)
            return
        job = Job(msg, waiting=set(msg.inputs), whole={u: [] for u in msg.inputs}, session=session)
        job.span = tracing.start(f"process {msg.stage}", tracing.extract(msg.traceparent), {
            "omnifleet.stage": msg.stage, "omnifleet.replica": self.replica, "omnifleet.attempt": msg.attempt,
            "omnifleet.request_id": msg.request_id})
        self.jobs[key] = job
        if not msg.inputs:  # the entry stage: its input is the client request
            try:
                job.inputs.put_nowait(self._entry_input(msg.info))
            except Exception as e:
                job.inputs.put_nowait(RuntimeError(f"input processor failed: {type(e).__name__}: {e}"))
            job.end_inputs()
        job.task = asyncio.get_running_loop().create_task(self._run_job(job))
        for _, data in self.pending.pop(key, []):
            self._feed(job, data)

    def _entry_input(self, info: wire.RequestInfo) -> Any:
        if self.processor is not None:
            return self._process({}, info)
        return info.messages if info.messages is not None else info.prompt

    def _process(self, upstream: dict[str, Any], info: wire.RequestInfo) -> Any:
        """The input processor (default: a single-input stage gets the value, a stage with several
        inputs, or companion outputs (`upstream:role`) beside its input, the dict `{upstream: value}`,
        in stream mode too, so it can tell its inputs apart)."""
        if self.processor is None:
            single = len(self.stage.inputs) <= 1 and len(upstream) <= 1 and not any(":" in k for k in upstream)
            return next(iter(upstream.values())) if single else upstream
        out = self.processor(upstream, info)
        if inspect.isawaitable(out):
            raise TypeError("input processors must be plain functions")
        return out

    def _feed(self, job: Job, data: wire.Data) -> None:
        if data.src not in job.waiting:
            log.warning("request %s: ignored data from %r (not an open input)", data.request_id, data.src)
            self._discard(data.payload)
            return
        expected = job.next_seq.get(data.src, 0)
        if data.seq != expected:
            if data.seq < expected or (data.src, data.seq) in job.early:
                log.warning("request %s: ignored chunk %d of %r (came twice)", data.request_id, data.seq, data.src)
                self._discard(data.payload)
            elif len(job.early) >= INPUTS_MAX:
                self._discard(data.payload)
                self._fail_inputs(job, OverflowError(f"more than {INPUTS_MAX} chunks came before an earlier one"))
            else:
                job.early[(data.src, data.seq)] = data
            return
        job.next_seq[data.src] = expected + 1
        self._apply(job, data)
        while (later := job.early.pop((data.src, job.next_seq[data.src]), None)) is not None:
            job.next_seq[data.src] += 1
            self._apply(job, later)

    def _fail_inputs(self, job: Job, e: BaseException) -> None:
        job.waiting.clear()  # the rest of this request's data is ignored (and discarded) as it comes
        for held in job.early.values():
            self._discard(held.payload)
        job.early.clear()
        job.inputs.put_nowait(e)

    def _apply(self, job: Job, data: wire.Data) -> None:
        if data.src not in job.waiting:  # an input processor failed on an earlier chunk
            self._discard(data.payload)
            return
        try:
            if not data.eof:
                payload = shm.load(data.payload, self.shm_prefix)
                src = f"{data.src}:{data.role}" if data.role else data.src  # a companion's output: an input of its own
                if self.mode == "stream":
                    self._put(job, self._process({src: payload}, job.msg.info))
                else:
                    job.whole.setdefault(src, []).append(payload)
            if data.eof or data.last:
                job.waiting.discard(data.src)
                if not job.waiting:
                    if self.mode == "whole":
                        self._put(job, self._process(job.whole, job.msg.info))
                    job.end_inputs()
        except Exception as e:
            self._discard(data.payload)
            self._fail_inputs(job, RuntimeError(f"input processor failed: {type(e).__name__}: {e}"))

    @staticmethod
    def _put(job: Job, item: Any) -> None:
        if item is None:
            return
        if job.inputs.qsize() >= INPUTS_MAX:  # upstream outruns the engine: fail the request, not the pod
            raise OverflowError(f"more than {INPUTS_MAX} input chunks are waiting for the engine")
        job.inputs.put_nowait(item)

    async def _run_job(self, job: Job) -> None:
        msg = job.msg
        outcome, error = "aborted", None
        try:
            seq, error, bad_input = 0, None, False
            try:
                await self._acquire_slot()
                try:
                    request = EngineRequest(msg.request_id, job.iter_inputs(), msg.sampling_params, msg.info,
                                            job.inputs_ended)
                    turns, last = Turns(), False
                    if self.expand is None:
                        async for out in self.engine.generate(request):
                            if last:
                                raise RuntimeError(f"the {self.stage.type} engine yielded a chunk after its last")
                            last = request.last
                            await self._emit(job, seq, out, last=last)
                            seq += 1
                            await turns.take()
                    else:
                        async for role, out in companions.run(self.engine, self.expand, request):
                            await self._emit(job, seq, out, role)
                            seq += 1
                            await turns.take()
                    if not last:  # else the last chunk said so
                        eof = wire.encode(wire.Data(msg.request_id, msg.attempt, self.stage.name, seq, eof=True))
                        for route in msg.routes:
                            await self._send_peer(route, eof)
                finally:
                    if self.slots is not None:
                        self.slots.release()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if reason := self.engine.dead():  # not this request's fault: it moves to another replica
                    await self._engine_died(reason)
                    return
                error, bad_input = f"{type(e).__name__}: {e}", isinstance(e, BadInput)
                log.warning("request %s failed: %s", msg.request_id, error)
            outcome = "ok" if error is None else "error"
            await self._send_master(wire.Done(msg.request_id, msg.attempt, self.stage.name, seq, error, bad_input,
                                              job.prompt_tokens, job.completion_tokens), job.session)
        except asyncio.CancelledError:  # aborted by the master, or it is gone: no Done expected
            if self.engine.dead() is None:  # a dead engine holds nothing to free
                await self.engine.abort(msg.request_id)
        finally:
            self.jobs.pop(job.key, None)
            self._ended(job.key)
            for held in job.early.values():  # chunks whose predecessors never came
                self._discard(held.payload)
            self._observe(job, outcome)
            for route, (span, nbytes, chunks) in job.transfers.items():
                span.set_attribute("omnifleet.bytes", nbytes)
                span.set_attribute("omnifleet.chunks", chunks)
                tracing.end(span, None if outcome == "ok" else outcome)
            tracing.end(job.span, None if outcome == "ok" else (error if outcome == "error" else "aborted"))

    def _observe(self, job: Job, outcome: str) -> None:
        m, stage, now = self.metrics, self.stage.name, time.monotonic()
        m.requests.inc(stage=stage, outcome=outcome)
        m.request_seconds.observe(now - job.dispatched, stage=stage)
        if outcome == "ok" and job.audio_s > 0 and job.first_input:
            m.audio_rtf.observe((job.last_chunk - job.first_input) / job.audio_s, stage=stage)
            self.audio_window.append((now, job.last_chunk - job.first_input, job.audio_s))

    def _realtime_factor(self) -> float:
        """Seconds of work per second of audio over the requests that ended in the last RTF_WINDOW_S (0: none):
        what an autoscaler of an audio stage holds at its target. A window, not a running mean, so that
        an idle stage reads 0 and scales back down."""
        cutoff = time.monotonic() - C.RTF_WINDOW_S
        while self.audio_window and self.audio_window[0][0] < cutoff:
            self.audio_window.popleft()
        audio = sum(a for _, _, a in self.audio_window)
        return sum(w for _, w, _ in self.audio_window) / audio if audio else 0.0

    async def _acquire_slot(self) -> None:
        if self.slots is None:
            return
        self.queued += 1
        try:
            await self.slots.acquire()
        finally:
            self.queued -= 1

    async def _emit(self, job: Job, seq: int, out: Any, role: str = "", last: bool = False) -> None:
        """Send one output chunk along the job's routes (and to the master when final); a CFG companion's
        (role set) goes to the routes only, and counts in no usage. last: the job's last chunk (no eof follows)."""
        msg, m, stage = job.msg, self.metrics, self.stage.name
        now = time.monotonic()
        if seq == 0:
            m.first_output.observe(now - (job.first_input or job.dispatched), stage=stage)
        else:
            m.chunk_seconds.observe(now - job.last_chunk, stage=stage)
        job.last_chunk = now
        m.chunks.inc(stage=stage)
        if isinstance(out, dict) and not role:
            if isinstance(ids := out.get("token_ids"), (list, tuple)):
                job.completion_tokens += len(ids)
            if isinstance(ids := out.get("prompt_token_ids"), (list, tuple)):
                job.prompt_tokens = max(job.prompt_tokens, len(ids))
        if self.stage.final_output == "audio" and not role:
            seconds = audio_seconds(out)
            job.audio_s += seconds
            m.audio_seconds.inc(seconds, stage=stage)
        # Device memory (CUDA tensors) leaves as IPC handles on routes that take them, as host copies on
        # the others; each form is made once per chunk.
        final = msg.final and not role
        host = await self.engine.export(out, cuda_ipc=False) if final or not all(
            r.cuda_ipc for r in msg.routes) else None
        ipc = await self.engine.export(out, cuda_ipc=True) if any(r.cuda_ipc for r in msg.routes) else None
        remote = None  # one encoding serves every route over the network
        for route in msg.routes:
            value = ipc if route.cuda_ipc else host
            if route.local:
                payload, moved = shm.offload(value, self.shm_prefix)
                self.bytes["shm"] += moved
                m.bytes_out.inc(moved, stage=stage, route=route.stage, path="shm")
                handed = ipc_nbytes(payload) if route.cuda_ipc else 0
                if handed:
                    self.bytes["cuda_ipc"] += handed
                    m.bytes_out.inc(handed, stage=stage, route=route.stage, path="cuda_ipc")
                frames = wire.encode(wire.Data(msg.request_id, msg.attempt, self.stage.name, seq, payload, last=last,
                                               role=role))
                m.bytes_out.inc(wire.frames_nbytes(frames), stage=stage, route=route.stage, path="tcp")
                self._transfer(job, route.stage, "cuda_ipc" if handed else "shm",
                               handed + moved + wire.frames_nbytes(frames))
                try:
                    await self._send_peer(route, frames)
                except BaseException:  # not sent (failed, or the job was aborted meanwhile): nobody will read it
                    self._discard(payload)
                    raise
                continue
            frames = remote = remote or wire.encode(
                wire.Data(msg.request_id, msg.attempt, self.stage.name, seq, host, last=last, role=role))
            m.bytes_out.inc(wire.frames_nbytes(frames), stage=stage, route=route.stage, path="tcp")
            self._transfer(job, route.stage, "tcp", wire.frames_nbytes(frames))
            await self._send_peer(route, frames)
        if final and (shown := self.engine.for_master(host)) is not None:
            frames = wire.encode(wire.Output(msg.request_id, msg.attempt, self.stage.name, seq, shown))
            self.bytes["master"] += wire.frames_nbytes(frames)
            m.bytes_out.inc(wire.frames_nbytes(frames), stage=stage, route="master", path="tcp")
            self._transfer(job, "master", "tcp", wire.frames_nbytes(frames))
            sock = job.session.sock if job.session is not None else None
            if sock is None:
                raise ConnectionError("the master is gone")
            await sock.send(frames)

    def _transfer(self, job: Job, route: str, transport: str, nbytes: int) -> None:
        """Count a chunk into the request's transfer span for this route (started at its first chunk)."""
        t = job.transfers.get(route)
        if t is None:
            span = tracing.start(f"transfer {self.stage.name}->{route}", job.span, {
                "omnifleet.route": route, "omnifleet.transport": transport})
            t = job.transfers[route] = [span, 0, 0]
        elif transport != "tcp":  # a chunk too small for shared memory does not change the route's transport
            t[0].set_attribute("omnifleet.transport", transport)
        t[1] += nbytes
        t[2] += 1

    async def _send_peer(self, route: wire.Route, frames: list) -> None:
        link = self.peers.get(route.addr)
        if link is None:
            link = self.peers[route.addr] = self._link(route)
            if len(self.peers) > PEER_SOCKETS_MAX:
                self.peers.popitem(last=False)[1].close()
        self.peers.move_to_end(route.addr)
        nbytes = wire.frames_nbytes(frames)
        self.bytes["tcp"] += nbytes
        await link.send(frames, nbytes)

    def _link(self, route: wire.Route) -> Link:
        def secure(mode: str) -> Callable[[zmq.Socket], None]:
            return lambda sock: security.secure_client(sock, self.keys, mode, self.max_frame_bytes)

        curve = self.data_plane == security.CURVE
        if curve and route.bulk:  # large messages go sealed over the bulk port: one CurveZMQ connection is enough
            bulk = Link(self.ctx, route.bulk, self.bulk_streams, secure(security.PLAIN_AUTH), encrypted=False)
            return Link(self.ctx, route.addr, 1, secure(security.CURVE), bulk=bulk)
        return Link(self.ctx, route.addr, self.streams, secure(self.data_plane), encrypted=curve)

    # ------------------------------------------------------------ data port

    async def _receive(self, sock: zsock.Socket, port: str) -> AsyncIterator[list]:
        """A port's messages, taking turns with the loop's other work; one over the bounds is dropped, counted."""
        turns = Turns()
        while True:
            await turns.take()
            try:
                yield await sock.recv_message(C.MAX_FRAMES)
            except zsock.Oversized as e:
                log.warning("dropped a message on the %s port: %s", port, e)
                self.dropped += 1

    def _off_loop(self, coro: Any) -> None:
        """Run a copy or an opening as its own task (cancelled at shutdown)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.copy_tasks.add(task)
        task.add_done_callback(self.copy_tasks.discard)

    def _listen(self, plane: str, port: int) -> tuple[zsock.Socket, str]:
        """A PULL socket bound to the port (0: any free one, for local runs and tests) and its advertised
        address."""
        sock = zsock.Socket(self.ctx, zmq.PULL)
        sock.linger = 0
        security.secure_server(sock, self.keys, plane, self.max_frame_bytes)
        if port:
            sock.bind(f"tcp://{self.host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{self.host}")
        return sock, f"tcp://{self.advertise_host}:{port}"

    async def _data_loop(self) -> None:
        async for frames in self._receive(self.data, "data"):
            if seal.is_announce(frames[0]):
                try:
                    ready = self.opener.announce(frames)
                except wire.WireError as e:
                    self._rejected(e)
                    continue
                for opened in ready:
                    self._off_loop(self._open(*opened))
                continue
            if not stripes.is_part(frames[0]):
                self._on_data(frames)
                continue
            try:
                key, copies = self.assembler.take(frames)
            except wire.WireError as e:
                self._rejected(e)
                continue
            if copies:  # off the loop, parts in parallel; the loop goes on receiving the other parts
                self._off_loop(self._assemble(key, copies))
            else:
                self._assembled(key)

    async def _bulk_loop(self) -> None:
        """Sealed parts of large messages (seal.py), opened off the loop as their Announces allow."""
        async for frames in self._receive(self.bulk, "bulk"):
            try:
                opened = self.opener.bulk(frames)
            except wire.WireError as e:
                self._rejected(e)
                continue
            if opened is not None:
                self._off_loop(self._open(*opened))

    async def _open(self, key: bytes, aead: Any, part: int, copies: list) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(seal.pool(), seal.unseal, aead, part, copies)
        except Exception as e:  # forged or altered (WireError), or a bug: the message is given up, not left open
            self.assembler.forget(key)
            if not isinstance(e, wire.WireError):
                log.error("opening a sealed part failed", exc_info=e)
            self._rejected(e)
            return
        self.metrics.sealed_parts.inc(stage=self.stage.name)
        self._assembled(key)

    async def _assemble(self, key: bytes, copies: list) -> None:
        if self.copy_pool is None:
            self.copy_pool = ThreadPoolExecutor(self.streams, thread_name_prefix="stripes")
        await asyncio.get_running_loop().run_in_executor(self.copy_pool, stripes.copy, copies)
        self._assembled(key)

    def _assembled(self, key: bytes) -> None:
        try:
            frames = self.assembler.done(key)
        except wire.WireError as e:
            self._rejected(e)
            return
        if frames is not None:
            self.metrics.striped_in.inc(stage=self.stage.name)
            self._on_data(frames)

    def _rejected(self, e: Exception) -> None:
        log.warning("rejected frame on the data port: %s", e)
        self.metrics.rejected_frames.inc(stage=self.stage.name, socket="data")

    def _on_data(self, frames: list) -> None:
        try:
            msg = wire.decode(frames)
            if not isinstance(msg, wire.Data):
                raise wire.WireError(f"unexpected {type(msg).__name__} on the data port")
        except wire.WireError as e:
            self._rejected(e)
            return
        self.metrics.bytes_in.inc(wire.frames_nbytes(frames), stage=self.stage.name, src=msg.src)
        job = self.jobs.get((msg.request_id, msg.attempt))
        if job is not None:
            self._feed(job, msg)
        elif (msg.request_id, msg.attempt) in self.ended:  # in flight when the request ended here
            self._discard(msg.payload)
        else:  # its Dispatch has not arrived yet (it travels another way)
            self.pending.setdefault((msg.request_id, msg.attempt), []).append((time.monotonic(), msg))
            if len(self.pending) > PENDING_MAX:
                self._drop_pending(self.pending.popitem(last=False)[1])

    async def _gc_loop(self) -> None:
        """Drop early data whose Dispatch never came (the request was aborted meanwhile), and old
        shared-memory leftovers of this pod."""
        while True:
            await asyncio.sleep(5.0)
            cutoff = time.monotonic() - PENDING_TTL_S
            for key in [k for k, v in self.pending.items() if v[0][0] < cutoff]:
                self._drop_pending(self.pending.pop(key))
            while self.ended and next(iter(self.ended.values())) < cutoff:
                self.ended.popitem(last=False)
            if n := self.assembler.expire():
                log.warning("dropped %d data message(s) whose striped parts stopped coming", n)
            if n := self.opener.expire():
                log.warning("dropped %d sealed part(s) whose message was never announced", n)
            if n := shm.sweep(self.shm_prefix, older_than_s=SHM_LEFTOVER_AGE_S):
                log.warning("swept %d shared-memory leftover(s) older than %.0fs", n, SHM_LEFTOVER_AGE_S)
