"""The master process: registration, heartbeats, orchestration and the HTTP API.

One asyncio loop runs a ZMQ ROUTER on the control port (stages connect out
to it, so it is the only socket control traffic needs) and the aiohttp API.
The master never imports torch, vLLM or diffusers: engines live in stages.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message
from aiohttp import web

from . import constants as C
from . import wire
from .api import Api
from .config import config_hash
from .membership import Membership, Replica
from .metrics import MasterMetrics
from .orchestrator import Orchestrator
from .schema import OmniPipeline
from .turns import StallWatch, Turns

DRAIN_POLLS = 1000  # about a second of reading before a closed connection is acted on

log = logging.getLogger("omnifleet.master")


class Master:
    def __init__(
        self,
        doc: OmniPipeline,
        host: str,
        api_port: int,
        control_port: int,
        replica_wait_s: float = C.REPLICA_WAIT_TIMEOUT_S,
        control_timeout_s: float = C.CONTROL_TIMEOUT_S,
    ):
        self.doc = doc
        self.host, self.api_port, self.control_port = host, api_port, control_port
        self.master_id = uuid.uuid4().hex[:12]
        self.config_hashes = {s.name: config_hash(doc, s.name) for s in doc.spec.stages}
        self.stage_names = [s.name for s in doc.spec.stages]
        self.membership = Membership(self.stage_names, C.HEARTBEAT_TIMEOUT_S)
        self.metrics = MasterMetrics()
        self.orch = Orchestrator(doc.spec, self.membership, self.send, self.metrics, replica_wait_s)
        self.api = Api(doc, self.orch, lambda: self.metrics.render(self.membership, self.stage_names),
                       control_timeout_s)
        self.sock: zmq.asyncio.Socket | None = None

    # ------------------------------------------------------------ sending

    def send(self, identity: bytes, msg: wire.Msg) -> None:
        """Queue msg for one replica; a ROUTER never blocks (unknown peers are dropped)."""
        fut = self.sock.send_multipart([identity, *wire.encode(msg)], copy=False)
        fut.add_done_callback(_log_send_error)

    # ------------------------------------------------------------ receiving

    async def _recv_loop(self) -> None:
        turns = Turns()
        while True:
            await turns.take()
            frames = await self.sock.recv_multipart(copy=False)
            try:
                self._handle(frames)
            except Exception:  # a bug handling one message must not take the master down
                log.exception("error handling a message")

    def _handle(self, frames: list) -> None:
        identity = frames[0].bytes
        try:
            msg = wire.decode(frames[1:])
        except wire.WireError as e:
            version = wire.peek_register_version(frames[1]) if len(frames) > 1 else None
            if version is not None and version != C.PROTOCOL_VERSION:
                self._refuse_version(identity, version)
                return
            self._reject(identity, str(e))
            return
        if isinstance(msg, wire.Register):
            self._register(identity, msg)
            return
        rep = self.membership.get(identity)
        if rep is None:
            # Typically a stage that has not noticed that this master restarted.
            self.send(identity, wire.Reset("unknown connection; register again"))
            return
        rep.last_seen = time.monotonic()
        if isinstance(msg, wire.StageHeartbeat):
            rep.inflight, rep.queue_depth = msg.inflight, msg.queue_depth
            rep.bytes.update(tcp=msg.bytes_tcp, shm=msg.bytes_shm, master=msg.bytes_master)
            self.membership.set_draining(rep, msg.draining)
        elif isinstance(msg, wire.Output):
            self.metrics.master_bytes.inc(wire.frames_nbytes(frames[1:]), stage=msg.stage)
            self.orch.on_output(rep, msg)
        elif isinstance(msg, wire.Done):
            self.orch.on_done(rep, msg)
        elif isinstance(msg, wire.ControlReply):
            self.orch.on_control_reply(msg)
        elif isinstance(msg, wire.Deregister):
            log.info("replica %s deregistered: %s", rep, msg.reason)
            self.membership.leave(identity)
            self.orch.on_replica_lost(rep, "deregistered")
        else:
            self._reject(identity, f"unexpected {type(msg).__name__} message from a stage")

    def _reject(self, identity: bytes, reason: str) -> None:
        log.warning("rejected frame from %r: %s", identity[:64], reason)
        self.metrics.rejected_frames.inc(socket="control")

    def _refuse_version(self, identity: bytes, version: int) -> None:
        reason = (f"protocol version mismatch: the stage speaks version {version}, "
                  f"this master speaks version {C.PROTOCOL_VERSION}")
        log.warning("refused registration from %r: %s", identity[:64], reason)
        self.send(identity, wire.RegisterReply(False, self.master_id, C.PROTOCOL_VERSION, reason))

    def _register(self, identity: bytes, msg: wire.Register) -> None:
        if msg.protocol_version != C.PROTOCOL_VERSION:
            self._refuse_version(identity, msg.protocol_version)
            return
        reason = ""
        if msg.stage not in self.stage_names:
            reason = f"this pipeline has no stage {msg.stage!r} (stages: {', '.join(self.stage_names)})"
        elif msg.config_hash != self.config_hashes[msg.stage]:
            reason = (f"config hash mismatch for stage {msg.stage!r}: the stage has {msg.config_hash[:12]}, "
                      f"the master has {self.config_hashes[msg.stage][:12]}; they disagree on its inputs, "
                      "processor, input mode or outputs (one of them runs an older config)")
        if reason:
            log.warning("refused registration of %s/%s: %s", msg.stage, msg.replica, reason)
            self.send(identity, wire.RegisterReply(False, self.master_id, C.PROTOCOL_VERSION, reason))
            return
        if self.membership.get(identity) is None:  # a repeated Register of a live session changes nothing
            rep = Replica(msg.stage, msg.replica, identity, msg.data_addr, time.monotonic(), pid=msg.pid)
            old = self.membership.join(rep)
            log.info("replica %s registered (data %s, pid %d)", rep, msg.data_addr, msg.pid)
            if old is not None:
                self.orch.on_replica_lost(old, "registered again")
        self.send(identity, wire.RegisterReply(True, self.master_id, C.PROTOCOL_VERSION))

    # ------------------------------------------------------------ liveness

    async def _heartbeat_loop(self) -> None:
        beat = wire.MasterHeartbeat(self.master_id)
        watch = StallWatch(C.HEARTBEAT_INTERVAL_S)
        while True:
            now = time.monotonic()
            if stall := watch.stall(now):
                # Whatever froze this process (CPU starvation, a paused VM, a
                # throttled pod) may have frozen the replicas too, and their
                # beats may sit unread in the socket: the stall is not their silence.
                log.warning("the master's event loop stalled for %.1fs", stall)
                self.membership.credit(stall)
            for rep in self.membership.expire(now):
                log.warning("replica %s lost: no heartbeat for %.1fs", rep, C.HEARTBEAT_TIMEOUT_S)
                self.metrics.replica_losses.inc(stage=rep.stage)
                self.orch.on_replica_lost(rep, "was lost")
            for rep in self.membership.all():
                self.send(rep.identity, beat)
            await asyncio.sleep(C.HEARTBEAT_INTERVAL_S)

    async def _disconnect_loop(self, monitor: zmq.asyncio.Socket) -> None:
        """A closed connection is a replica gone now, not after the heartbeat timeout."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            # What the replica sent before it closed (a last Done, its Deregister)
            # is still queued: let the receive loop read it first (bounded: others keep sending).
            for _ in range(DRAIN_POLLS):
                if not self.sock.get(zmq.EVENTS) & zmq.POLLIN:
                    break
                await asyncio.sleep(0.001)
            self._drop_unroutable()

    def _drop_unroutable(self) -> None:
        # The event names a file descriptor, not a replica: probe them all.
        # With ROUTER_MANDATORY a send to an identity whose connection is gone
        # fails with EHOSTUNREACH (only here: elsewhere unknown peers are dropped).
        probe = zmq.Socket.shadow(self.sock.underlying)
        beat = wire.encode(wire.MasterHeartbeat(self.master_id))
        gone = []
        probe.router_mandatory = 1
        try:
            for rep in self.membership.all():
                try:
                    probe.send_multipart([rep.identity, *beat], flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # connected, its queue full
                except zmq.ZMQError as e:
                    if e.errno == zmq.EHOSTUNREACH:
                        gone.append(rep)
        finally:
            probe.router_mandatory = 0
        for rep in gone:
            if self.membership.leave(rep.identity) is not None:
                log.warning("replica %s lost: its connection closed", rep)
                self.metrics.replica_losses.inc(stage=rep.stage)
                self.orch.on_replica_lost(rep, "was lost")

    # ------------------------------------------------------------ run

    async def serve(self, stop: asyncio.Event) -> None:
        ctx = zmq.asyncio.Context()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.bind(f"tcp://{self.host}:{self.control_port}")
        runner = web.AppRunner(self.api.app(), handler_cancellation=True, access_log=None,
                               shutdown_timeout=2.0)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.api_port).start()
        log.info("master %s: API http://%s:%d, control tcp://%s:%d, stages %s",
                 self.master_id, self.host, self.api_port, self.host, self.control_port,
                 ", ".join(self.stage_names))
        tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat_loop()),
                 asyncio.create_task(self._disconnect_loop(monitor))]
        try:
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await runner.cleanup()
            self.sock.disable_monitor()
            monitor.close()
            self.sock.close()
            ctx.term()


def _log_send_error(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("send failed: %s", fut.exception())


def run_master(doc: OmniPipeline, **kwargs) -> int:
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Master(doc, **kwargs).serve(stop)

    asyncio.run(main())
    return 0
