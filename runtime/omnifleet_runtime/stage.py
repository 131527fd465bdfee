"""One stage replica: an engine behind a control connection and a data port.

The worker loads its engine once, binds its data port (a PULL socket that
upstream stages push chunks to), connects out to the master and registers.
When the master goes away (its connection closes, or no heartbeat) or
forgets it (Reset), the worker
aborts what it was doing for that master and registers again on a fresh
connection (so a moved master is resolved anew); the engine stays loaded.

Per request (a Dispatch), the worker gathers its inputs (the client request
for the entry stage, upstream Data chunks otherwise), runs them through the
stage's input processor and the engine, and sends each output chunk along
the routes the master chose: straight to the downstream replicas' data
ports (bulk bytes through shared memory when they share this pod), and to
the master when the stage produces final output.

On SIGTERM the worker stops taking work (the master stops routing to it),
finishes what is in flight up to a deadline, deregisters and exits 0.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from . import constants as C
from . import shm, wire
from .engines import Engine, EngineRequest, EngineStartError, load_callable, make_engine
from .schema import OmniPipeline
from .turns import StallWatch, Turns

log = logging.getLogger("omnifleet.stage")

_EOF = object()
PENDING_MAX = 10_000  # requests whose data arrived before their Dispatch
PENDING_TTL_S = 60.0
PEER_SOCKETS_MAX = 256


class Refused(Exception):
    pass


def start_watchdog(stage: str, timeout_s: float) -> threading.Event:
    """An event to set once the engine has started; if it is not set within timeout_s, the process
    kills what it started (the engine's own processes) and exits EXIT_ENGINE_START_TIMEOUT."""
    started = threading.Event()

    def watch() -> None:
        if started.wait(timeout_s):
            return
        log.error("stage %s failed to start: its engine did not start within %gs "
                  "(engineStartTimeoutSeconds); stopping it", stage, timeout_s)
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        logging.shutdown()
        os._exit(C.EXIT_ENGINE_START_TIMEOUT)

    threading.Thread(target=watch, name="engine-start-watchdog", daemon=True).start()
    return started


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
    task: asyncio.Task | None = None
    started: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return self.msg.request_id, self.msg.attempt

    async def iter_inputs(self) -> AsyncIterator[Any]:
        while (item := await self.inputs.get()) is not _EOF:
            if isinstance(item, BaseException):
                raise item
            yield item


class StageWorker:
    def __init__(
        self,
        doc: OmniPipeline,
        stage: str,
        replica: str,
        master_addr: str,
        config_hash: str,
        host: str = "0.0.0.0",
        data_port: int = C.STAGE_DATA_PORT,
        advertise_host: str = "127.0.0.1",
        drain_timeout_s: float = C.DRAIN_TIMEOUT_S,
    ):
        self.doc = doc
        self.stage = doc.spec.stage(stage)
        self.replica = replica
        self.master_addr = master_addr
        self.config_hash = config_hash
        self.host, self.data_port, self.advertise_host = host, data_port, advertise_host
        self.drain_timeout_s = drain_timeout_s
        self.mode = self.stage.effective_input_mode()
        self.processor = None
        self.engine: Engine | None = None
        self.jobs: dict[tuple[str, int], Job] = {}
        self.pending: OrderedDict[tuple[str, int], list[tuple[float, wire.Data]]] = OrderedDict()
        self.peers: OrderedDict[str, zmq.asyncio.Socket] = OrderedDict()
        self.shm_prefix = shm.pod_prefix(replica)
        self.bytes = {"tcp": 0, "shm": 0, "master": 0}
        self.queued = 0
        self.slots: asyncio.Semaphore | None = None
        self.master: zmq.asyncio.Socket | None = None
        self.stopping = asyncio.Event()
        self.control_tasks: set[asyncio.Task] = set()
        self.draining = False
        self.exit_code = 0

    # ------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Build the engine and the input processor (the one expensive step; done once)."""
        self.engine = make_engine(self.stage, self.replica)
        if self.stage.input_processor:
            self.processor = load_callable(self.stage.input_processor)

    async def main(self, on_ready=None) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stopping.set)
        timeout = self.stage.engine_start_timeout_seconds or C.ENGINE_START_TIMEOUT_S
        started = start_watchdog(self.stage.name, timeout)  # engines load synchronously: a thread keeps time
        try:
            self.load()
            await self.engine.start()
        except EngineStartError as e:  # a known reason (bad engine arg, missing model): one clear line
            log.error("stage %s failed to start: %s", self.stage.name, e)
            return 1
        finally:
            started.set()
        if self.engine.max_concurrency:
            self.slots = asyncio.Semaphore(int(self.engine.max_concurrency))
        self.ctx = zmq.asyncio.Context()
        self.data = self.ctx.socket(zmq.PULL)
        self.data.linger = 0
        if self.data_port:
            self.data.bind(f"tcp://{self.host}:{self.data_port}")
            port = self.data_port
        else:  # 0: any free port (local runs and tests)
            port = self.data.bind_to_random_port(f"tcp://{self.host}")
        self.data_addr = f"tcp://{self.advertise_host}:{port}"
        log.info("stage %s/%s: engine loaded, data port %s", self.stage.name, self.replica, self.data_addr)
        if on_ready:
            on_ready()
        tasks = [loop.create_task(self._session_loop()), loop.create_task(self._data_loop()),
                 loop.create_task(self._gc_loop()), loop.create_task(self._engine_watch())]
        await self.stopping.wait()
        if self.exit_code == 0:
            await self._drain()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self.engine.shutdown()
        except Exception as e:  # a dead engine may fail to shut down; the exit code already says why
            log.warning("engine shutdown failed: %s: %s", type(e).__name__, e)
        for sock in [self.data, self.master, *self.peers.values()]:
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()
        return self.exit_code

    async def _drain(self) -> None:
        self.draining = True
        log.info("SIGTERM: draining %d request(s), up to %.0fs", len(self.jobs), self.drain_timeout_s)
        await self._send_master(self._heartbeat(), block=False)  # the master stops routing here at once
        deadline = time.monotonic() + self.drain_timeout_s
        while self.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.jobs:
            log.warning("drain deadline passed; aborting %d request(s)", len(self.jobs))
            self._abort_all()
        await self._send_master(wire.Deregister("shutting down"), block=False)
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
        await self._send_master(wire.Deregister(f"engine died: {reason}"), block=False)
        self._abort_all()
        self.stopping.set()

    # ------------------------------------------------------------ master session

    def _heartbeat(self) -> wire.StageHeartbeat:
        return wire.StageHeartbeat(
            inflight=len(self.jobs), queue_depth=self.queued, draining=self.draining,
            bytes_tcp=self.bytes["tcp"], bytes_shm=self.bytes["shm"], bytes_master=self.bytes["master"],
        )

    async def _send_master(self, msg: wire.Msg, block: bool = True) -> None:
        await self._send_master_frames(wire.encode(msg), block)

    async def _send_master_frames(self, frames: list, block: bool = True) -> None:
        """Send to the master; block=False drops the message while the master is unreachable."""
        sock = self.master
        if sock is None or sock.closed:
            return
        try:
            await sock.send_multipart(frames, copy=False, flags=0 if block else zmq.NOBLOCK)
        except zmq.Again:
            pass  # heartbeats are not queued while the master is unreachable
        except zmq.ZMQError as e:
            log.debug("send to master failed: %s", e)

    async def _session_loop(self) -> None:
        backoff = 0.0
        while not self.draining:  # a draining worker with no master has nothing left to finish
            await asyncio.sleep(backoff)
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.immediate = True  # queue nothing for a master that is not connected
            sock.routing_id = f"{self.stage.name}/{self.replica}/{uuid.uuid4().hex[:8]}".encode()
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(self.master_addr)
            try:
                master_id = await self._register(sock)
                self.master = sock
                log.info("registered with master %s at %s", master_id, self.master_addr)
                why = await self._serve_master(sock, monitor)
                log.warning("master session ended (%s); registering again", why)
                backoff = 0.0
            except Refused as e:
                log.error("registration refused: %s", e)
                if "protocol version" in str(e):
                    self.exit_code = C.EXIT_PROTOCOL_MISMATCH
                    self.stopping.set()
                    return
                backoff = 5.0
            finally:
                self.master = None
                self._abort_all()  # whatever the old master sent us can no longer be delivered
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=500 if self.draining else 0)  # let a Deregister leave

    async def _register(self, sock: zmq.asyncio.Socket) -> str:
        reg = wire.Register(
            stage=self.stage.name, replica=self.replica, protocol_version=C.PROTOCOL_VERSION,
            config_hash=self.config_hash, data_addr=self.data_addr, pid=os.getpid(), engine=self.stage.type,
        )
        wait = 0.05
        while True:
            try:
                await sock.send_multipart(wire.encode(reg), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # not connected yet
            deadline = time.monotonic() + wait
            wait = min(2 * wait, 1.0)
            while (left := deadline - time.monotonic()) > 0:
                if not await sock.poll(left * 1000):
                    break
                msg = self._decode_control(await sock.recv_multipart(copy=False))
                if isinstance(msg, wire.RegisterReply):
                    if not msg.ok:
                        raise Refused(msg.reason)
                    return msg.master_id

    async def _serve_master(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> str:
        """Handle the master's messages until it is lost; returns why the session ended."""
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        last_seen = next_beat = time.monotonic()
        watch = StallWatch(C.HEARTBEAT_INTERVAL_S)  # this loop wakes at least once per interval
        while True:
            now = time.monotonic()
            if stall := watch.stall(now):
                log.warning("this stage's event loop stalled for %.1fs", stall)
                last_seen += stall
            if now >= next_beat:
                await self._send_master(self._heartbeat(), block=False)
                next_beat = now + C.HEARTBEAT_INTERVAL_S
            # Lost only if nothing is waiting: beats may have queued while this loop was busy.
            if now - last_seen > C.HEARTBEAT_TIMEOUT_S and not await sock.poll(0):
                return f"no heartbeat from the master for {C.HEARTBEAT_TIMEOUT_S:g}s"
            ready = dict(await poller.poll(max(0.0, min(next_beat, last_seen + C.HEARTBEAT_TIMEOUT_S) - now)
                                           * 1000 + 1))
            if monitor in ready:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    return "the master's connection closed"
            if sock not in ready:
                continue
            msg = self._decode_control(await sock.recv_multipart(copy=False))
            if msg is None:
                continue
            last_seen = time.monotonic()
            if isinstance(msg, wire.Reset):
                return f"reset by the master: {msg.reason}"
            try:
                self._on_master_message(msg)
            except Exception:  # a bug with one request must not end the session
                log.exception("error handling %s", type(msg).__name__)

    def _decode_control(self, frames: list) -> wire.Msg | None:
        try:
            return wire.decode(frames)
        except wire.WireError as e:
            log.warning("rejected frame on the control connection: %s", e)
            return None

    def _on_master_message(self, msg: wire.Msg) -> None:
        if isinstance(msg, wire.Dispatch):
            self._start_job(msg)
        elif isinstance(msg, wire.Abort):
            job = self.jobs.get((msg.request_id, msg.attempt))
            self.pending.pop((msg.request_id, msg.attempt), None)
            if job is not None and job.task is not None:
                job.task.cancel()
        elif isinstance(msg, wire.Control):
            task = asyncio.get_running_loop().create_task(self._control(msg))
            self.control_tasks.add(task)
            task.add_done_callback(self.control_tasks.discard)
        elif not isinstance(msg, (wire.MasterHeartbeat, wire.RegisterReply)):
            log.warning("rejected unexpected %s from the master", type(msg).__name__)

    async def _control(self, msg: wire.Control) -> None:
        try:
            result = await self.engine.control(msg.method, msg.args)
            frames = wire.encode(wire.ControlReply(msg.call_id, True, result))
        except Exception as e:  # the engine's failure, or a result the wire cannot carry
            frames = wire.encode(wire.ControlReply(msg.call_id, False, error=f"{type(e).__name__}: {e}"))
        await self._send_master_frames(frames)

    def _abort_all(self) -> None:
        for job in list(self.jobs.values()):
            if job.task is not None:
                job.task.cancel()
        self.pending.clear()

    # ------------------------------------------------------------ requests

    def _start_job(self, msg: wire.Dispatch) -> None:
        key = (msg.request_id, msg.attempt)
        if key in self.jobs or msg.stage != self.stage.name:
            log.warning("ignored Dispatch %s for stage %s", key, msg.stage)
            return
        job = Job(msg, waiting=set(msg.inputs), whole={u: [] for u in msg.inputs})
        self.jobs[key] = job
        if not msg.inputs:  # the entry stage: its input is the client request
            try:
                job.inputs.put_nowait(self._entry_input(msg.info))
            except Exception as e:
                job.inputs.put_nowait(RuntimeError(f"input processor failed: {type(e).__name__}: {e}"))
            job.inputs.put_nowait(_EOF)
        job.task = asyncio.get_running_loop().create_task(self._run_job(job))
        for _, data in self.pending.pop(key, []):
            self._feed(job, data)

    def _entry_input(self, info: wire.RequestInfo) -> Any:
        if self.processor is not None:
            return self._process({}, info)
        return info.messages if info.kind == "chat" else info.prompt

    def _process(self, upstream: dict[str, Any], info: wire.RequestInfo) -> Any:
        """The input processor (default: a single-input stage gets the value, a stage with several
        inputs the dict `{upstream: value}`, in stream mode too, so it can tell its inputs apart)."""
        if self.processor is None:
            return next(iter(upstream.values())) if len(self.stage.inputs) <= 1 else upstream
        out = self.processor(upstream, info)
        if inspect.isawaitable(out):
            raise TypeError("input processors must be plain functions")
        return out

    def _feed(self, job: Job, data: wire.Data) -> None:
        if data.src not in job.waiting:
            log.warning("request %s: ignored data from %r (not an open input)", data.request_id, data.src)
            return
        try:
            if data.eof:
                job.waiting.discard(data.src)
                if not job.waiting:
                    if self.mode == "whole":
                        self._put(job, self._process(job.whole, job.msg.info))
                    job.inputs.put_nowait(_EOF)
                return
            payload = shm.load(data.payload)
            if self.mode == "stream":
                self._put(job, self._process({data.src: payload}, job.msg.info))
            else:
                job.whole[data.src].append(payload)
        except Exception as e:
            job.waiting.clear()
            job.inputs.put_nowait(RuntimeError(f"input processor failed: {type(e).__name__}: {e}"))

    @staticmethod
    def _put(job: Job, item: Any) -> None:
        if item is not None:
            job.inputs.put_nowait(item)

    async def _run_job(self, job: Job) -> None:
        msg = job.msg
        try:
            seq, error = 0, None
            try:
                await self._acquire_slot()
                try:
                    request = EngineRequest(msg.request_id, job.iter_inputs(), msg.sampling_params, msg.info)
                    turns = Turns()
                    async for out in self.engine.generate(request):
                        await self._emit(job, seq, out)
                        seq += 1
                        await turns.take()
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
                error = f"{type(e).__name__}: {e}"
                log.warning("request %s failed: %s", msg.request_id, error)
            await self._send_master(wire.Done(msg.request_id, msg.attempt, self.stage.name, seq, error))
        except asyncio.CancelledError:  # aborted by the master, or it is gone: no Done expected
            if self.engine.dead() is None:  # a dead engine holds nothing to free
                await self.engine.abort(msg.request_id)
        finally:
            self.jobs.pop(job.key, None)

    async def _acquire_slot(self) -> None:
        if self.slots is None:
            return
        self.queued += 1
        try:
            await self.slots.acquire()
        finally:
            self.queued -= 1

    async def _emit(self, job: Job, seq: int, out: Any) -> None:
        msg = job.msg
        remote = None  # one encoding serves every route over the network
        for route in msg.routes:
            if route.local:
                payload, moved = shm.offload(out, self.shm_prefix)
                self.bytes["shm"] += moved
                frames = wire.encode(wire.Data(msg.request_id, msg.attempt, self.stage.name, seq, payload))
            else:
                frames = remote = remote or wire.encode(
                    wire.Data(msg.request_id, msg.attempt, self.stage.name, seq, out))
            await self._send_peer(route, frames)
        if msg.final:
            frames = wire.encode(wire.Output(msg.request_id, msg.attempt, self.stage.name, seq, out))
            self.bytes["master"] += wire.frames_nbytes(frames)
            sock = self.master
            if sock is None:
                raise ConnectionError("the master is gone")
            await sock.send_multipart(frames, copy=False)

    async def _send_peer(self, route: wire.Route, frames: list) -> None:
        sock = self.peers.get(route.addr)
        if sock is None:
            sock = self.peers[route.addr] = self.ctx.socket(zmq.PUSH)
            sock.linger = 0
            sock.connect(route.addr)
            if len(self.peers) > PEER_SOCKETS_MAX:
                self.peers.popitem(last=False)[1].close(linger=0)
        self.peers.move_to_end(route.addr)
        self.bytes["tcp"] += wire.frames_nbytes(frames)
        await sock.send_multipart(frames, copy=False)

    # ------------------------------------------------------------ data port

    async def _data_loop(self) -> None:
        turns = Turns()
        while True:
            await turns.take()
            frames = await self.data.recv_multipart(copy=False)
            try:
                msg = wire.decode(frames)
                if not isinstance(msg, wire.Data):
                    raise wire.WireError(f"unexpected {type(msg).__name__} on the data port")
            except wire.WireError as e:
                log.warning("rejected frame on the data port: %s", e)
                continue
            job = self.jobs.get((msg.request_id, msg.attempt))
            if job is not None:
                self._feed(job, msg)
            else:  # its Dispatch has not arrived yet (it travels another way)
                self.pending.setdefault((msg.request_id, msg.attempt), []).append((time.monotonic(), msg))
                if len(self.pending) > PENDING_MAX:
                    self.pending.popitem(last=False)

    async def _gc_loop(self) -> None:
        """Drop early data whose Dispatch never came (the request was aborted meanwhile)."""
        while True:
            await asyncio.sleep(5.0)
            cutoff = time.monotonic() - PENDING_TTL_S
            for key in [k for k, v in self.pending.items() if v[0][0] < cutoff]:
                del self.pending[key]
