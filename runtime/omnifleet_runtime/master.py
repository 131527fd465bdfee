"""The master process: registration, heartbeats, orchestration and the HTTP API.

One asyncio loop runs a ZMQ ROUTER on the control port (stages connect out
to it, so it is the only socket control traffic needs), the public aiohttp
API (api.py) and, on its own port, the admin API (admin.py).
The master never imports torch, vLLM or diffusers: engines live in stages.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import time
import uuid

import zmq
from aiohttp import web

from . import constants as C
from . import security, wire, zsock
from .admin import Admin
from .api import Api
from .config import config_hash, stage_revisions
from .httputil import GentleSite
from .membership import Membership, Replica
from .metrics import MasterMetrics
from .orchestrator import Orchestrator
from .schema import OmniPipeline
from .turns import StallWatch, Turns

DRAIN_POLLS = 1000  # about a second of reading before a closed connection is acted on
# A closed connection leaves the ROUTER's routing table a few command round trips between libzmq's I/O
# thread and this one after its DISCONNECTED event: probe again until it has (bounded; heartbeats remain).
REPROBE_DELAYS_S = (0.0, 0.002, 0.01, 0.05, 0.2, 1.0)
REVISION_MAX_CHARS = 64  # a stage name or revision hash in a Register's revisions
ANSWER_GRACE_S = 1.0  # for the handlers of requests ended at the drain deadline to write their answers
CLOSE_GRACE_S = 1.0  # for connections taken just before the API port closed to send their request

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
        keys: security.Keys | None = None,
        max_frame_bytes: int = C.MAX_CONTROL_FRAME_BYTES,
        admin_port: int = C.MASTER_ADMIN_PORT,
        api_key: str | None = None,
        admin_token: str | None = None,
        heartbeat_interval_s: float = C.HEARTBEAT_INTERVAL_S,
        heartbeat_timeout_s: float = C.HEARTBEAT_TIMEOUT_S,
    ):
        if keys is None:
            raise ValueError("the master needs the pipeline's keys")
        self.doc = doc
        self.keys, self.max_frame_bytes = keys, max_frame_bytes
        self.auth: security.PipelineAuthenticator | None = None
        self.replicas_bound = replicas_bound(doc)
        self.host, self.api_port, self.control_port = host, api_port, control_port
        self.admin_port = admin_port
        self.master_id = uuid.uuid4().hex[:12]
        self.config_hashes = {s.name: config_hash(doc, s.name) for s in doc.spec.stages}
        self.stage_names = [s.name for s in doc.spec.stages]
        self.heartbeat_interval_s, self.heartbeat_timeout_s = heartbeat_interval_s, heartbeat_timeout_s
        own = (doc.metadata.generation or 0, tuple(sorted(stage_revisions(doc).items())))
        self.membership = Membership(self.stage_names, heartbeat_timeout_s, own)
        self.metrics = MasterMetrics()
        self.orch = Orchestrator(doc.spec, self.membership, self.send, self.metrics, replica_wait_s,
                                 doc.spec.master.limits.max_redispatches)
        self.metrics.demand = self.orch.demand
        self.api = Api(doc, self.orch, lambda: self.metrics.render(self.membership, self.stage_names), api_key)
        self.admin = Admin(doc, self.orch, admin_token, control_timeout_s)
        self.sock: zsock.Socket | None = None

    # ------------------------------------------------------------ sending

    def send(self, identity: bytes, msg: wire.Msg) -> None:
        """Queue msg for one replica; a ROUTER never blocks (unknown peers are dropped)."""
        try:
            self.sock.send_nowait([identity, *wire.encode(msg)])
        except zmq.ZMQError as e:
            log.warning("send failed: %s", e)

    # ------------------------------------------------------------ receiving

    async def _recv_loop(self) -> None:
        turns = Turns()
        while True:
            await turns.take()
            try:
                frames = await self.sock.recv_message(C.MAX_FRAMES)
            except zsock.Oversized as e:
                log.warning("dropped a message on the control port: %s", e)
                self.metrics.dropped_messages.inc(socket="control")
                continue
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
            self._register(identity, msg, _peer_address(frames[1]))
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
            rep.dropped = msg.dropped
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

    def _refuse_version(self, identity: bytes, version: int, stage: str | None = None) -> None:
        reason = (f"protocol version mismatch: the stage speaks version {version}, "
                  f"this master speaks version {C.PROTOCOL_VERSION}")
        log.warning("refused registration from %r: %s", identity[:64], reason)
        if stage is not None:
            self.membership.refused(stage, reason, time.monotonic())
        self.send(identity, wire.RegisterReply(False, self.master_id, C.PROTOCOL_VERSION, reason))

    def _register(self, identity: bytes, msg: wire.Register, peer: str | None = None) -> None:
        if msg.protocol_version != C.PROTOCOL_VERSION:
            self._refuse_version(identity, msg.protocol_version, msg.stage)
            return
        reason = ""
        if msg.stage not in self.stage_names:
            reason = f"this pipeline has no stage {msg.stage!r} (stages: {', '.join(self.stage_names)})"
        elif len(msg.revisions) > len(self.stage_names) or len(msg.revision) > REVISION_MAX_CHARS or any(
                len(k) > REVISION_MAX_CHARS or len(v) > REVISION_MAX_CHARS for k, v in msg.revisions.items()):
            reason = (f"its revisions name {len(msg.revisions)} stages (this pipeline has {len(self.stage_names)}) "
                      f"or exceed {REVISION_MAX_CHARS} characters")
        elif msg.config_hash != self.config_hashes[msg.stage]:
            reason = (f"config hash mismatch for stage {msg.stage!r}: the stage has {msg.config_hash[:12]}, "
                      f"the master has {self.config_hashes[msg.stage][:12]}; they disagree on its inputs, "
                      "processor, input mode or outputs (one of them runs an older config)")
        if reason:
            log.warning("refused registration of %s/%s: %s", msg.stage, msg.replica, reason)
            self.membership.refused(msg.stage, reason, time.monotonic())
            self.send(identity, wire.RegisterReply(False, self.master_id, C.PROTOCOL_VERSION, reason))
            return
        if self.membership.get(identity) is None:  # a repeated Register of a live session changes nothing
            reason = self._identity_problem(identity, msg, peer)
            if reason:
                log.warning("refused registration of %s/%s from %s: %s", msg.stage, msg.replica, peer, reason)
                self.metrics.refused_registrations.inc(stage=msg.stage)
                self.membership.refused(msg.stage, reason, time.monotonic())
                self.send(identity, wire.RegisterReply(False, self.master_id, C.PROTOCOL_VERSION, reason))
                return
            rep = Replica(msg.stage, msg.replica, identity, msg.data_addr, time.monotonic(), msg.bulk_addr,
                          pid=msg.pid,
                          revision=msg.revision, announced=(msg.generation, tuple(sorted(msg.revisions.items()))))
            old = self.membership.join(rep)
            log.info("replica %s registered (data %s, pid %d)", rep, msg.data_addr, msg.pid)
            if old is not None:
                self.orch.on_replica_lost(old, "registered again")
        rep = self.membership.get(identity)
        self.send(identity, wire.RegisterReply(True, self.master_id, C.PROTOCOL_VERSION,
                                               serving=rep is None or self.membership.serving(rep)))

    def _identity_problem(self, identity: bytes, msg: wire.Register, peer: str | None) -> str:
        """Why this connection may not register as msg says (empty: it may).

        The key proves the peer is one of the pipeline's pods; this keeps one
        pod from speaking for another: its data address must be its own, a
        replica id live on another connection is not taken over, and a stage's
        membership is bounded.
        """
        for what, addr in (("data", msg.data_addr), ("bulk", msg.bulk_addr)):
            if what == "bulk" and not addr:
                continue
            host = data_host(addr)
            if host is None:
                return f"{what} address {addr!r} is not tcp://IP:PORT"
            if peer is not None and host != peer and self.doc.spec.security.check_peer_address:
                return f"{what} address {addr} is not on this connection's peer address {peer}"
        old = self.membership.find(msg.stage, msg.replica)
        if old is not None and old.identity != identity and self._reachable(old.identity):
            return (f"replica {msg.stage}/{msg.replica} is already registered from another live connection "
                    "(a replica id is not taken over while its connection lives)")
        if old is None and len(self.membership.replicas(msg.stage)) >= self.replicas_bound:
            return f"stage {msg.stage!r} already has {self.replicas_bound} registered replicas (the bound)"
        return ""

    def _reachable(self, identity: bytes) -> bool:
        """Whether the ROUTER still has a connection for identity: with ROUTER_MANDATORY a send to an
        identity whose connection is gone fails with EHOSTUNREACH (only here: elsewhere unknown peers are
        dropped)."""
        probe = zmq.Socket.shadow(self.sock.underlying)
        probe.router_mandatory = 1
        try:
            probe.send_multipart([identity, *wire.encode(wire.MasterHeartbeat(self.master_id))], flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return True  # connected, its queue full
        except zmq.ZMQError as e:
            return e.errno != zmq.EHOSTUNREACH
        finally:
            probe.router_mandatory = 0
            self.sock.recheck()  # the probe's send may have taken the signal the receive loop waits for

    # ------------------------------------------------------------ liveness

    async def _heartbeat_loop(self) -> None:
        beats = {flag: wire.MasterHeartbeat(self.master_id, serving=flag) for flag in (False, True)}
        watch = StallWatch(self.heartbeat_interval_s)
        while True:
            now = time.monotonic()
            if stall := watch.stall(now):
                # Whatever froze this process (CPU starvation, a paused VM, a
                # throttled pod) may have frozen the replicas too, and their
                # beats may sit unread in the socket: the stall is not their silence.
                log.warning("the master's event loop stalled for %.1fs", stall)
                self.membership.credit(stall)
            for rep in self.membership.expire(now):
                log.warning("replica %s lost: no heartbeat for %.1fs", rep, self.heartbeat_timeout_s)
                self.metrics.replica_losses.inc(stage=rep.stage)
                self.orch.on_replica_lost(rep, "was lost")
            for rep in self.membership.all():
                self.send(rep.identity, beats[self.membership.serving(rep)])
            await asyncio.sleep(self.heartbeat_interval_s)

    async def _disconnect_loop(self, monitor: zsock.Socket) -> None:
        """A closed connection is a replica gone now, not after the heartbeat timeout."""
        while True:
            event = zsock.monitor_event(await monitor.recv_message(zsock.MONITOR_FRAMES))
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            for delay in REPROBE_DELAYS_S:
                await asyncio.sleep(delay)
                self.sock.events()  # runs libzmq's pending commands: the closing pipe's among them
                if gone := self._unroutable():
                    # A closing pipe is unroutable while what the replica sent before it closed (a last
                    # Done, its Deregister) is still queued: let the receive loop read that first
                    # (bounded: others keep sending).
                    for _ in range(DRAIN_POLLS):
                        if not self.sock.events() & zmq.POLLIN:
                            break
                        await asyncio.sleep(0.001)
                    self._drop(gone)
                    break  # one event, one connection

    def _unroutable(self) -> list[Replica]:
        # The event names a file descriptor, not a replica: probe them all.
        return [rep for rep in self.membership.all() if not self._reachable(rep.identity)]

    def _drop(self, gone: list[Replica]) -> None:
        for rep in gone:
            if self.membership.leave(rep.identity) is not None:  # else it deregistered meanwhile
                log.warning("replica %s lost: its connection closed", rep)
                self.metrics.replica_losses.inc(stage=rep.stage)
                self.orch.on_replica_lost(rep, "was lost")

    # ------------------------------------------------------------ run

    async def drain(self, timeout_s: float, linger_s: float = 0.0, quiet_s: float = 0.0) -> None:
        """Stop taking requests (/ready and new ones answer 503), let those in flight finish up to
        timeout_s; the stages keep serving them meanwhile. The API answers (503) for linger_s at least,
        then until no request has come for quiet_s, all within timeout_s."""
        self.api.draining = True
        start = time.monotonic()
        linger_until = start + min(linger_s, timeout_s)
        log.info("SIGTERM: draining %d request(s), up to %.0fs", self.api.inflight, timeout_s)
        deadline = start + timeout_s
        while self.api.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.api.inflight:
            log.warning("drain deadline passed; ending %d request(s)", self.api.inflight)
            # With an answer each (a closed connection tells the client nothing), before the server stops.
            self.orch.fail_all(f"the master shut down (its drain deadline of {timeout_s:g}s passed) before the "
                               "request finished; it was aborted in every stage: retry")
            answered = time.monotonic() + ANSWER_GRACE_S
            while self.api.inflight and time.monotonic() < answered:
                await asyncio.sleep(0.01)
        else:
            log.info("every request finished; exiting")
        # Connections routed here before the endpoint removal reached every proxy get a 503, not a reset.
        await asyncio.sleep(max(0.0, linger_until - time.monotonic()))
        # Requests still arriving mean some proxy still routes here: answer them until they stop.
        before, waited = self.api.drain_arrivals, False
        while (now := time.monotonic()) < deadline and now - self.api.last_arrival < quiet_s:
            waited = True
            await asyncio.sleep(min(deadline, self.api.last_arrival + quiet_s) - now)
        if waited:
            log.info("requests kept coming after the linger: %d more answered (503) until none came for %gs, "
                     "%.1fs after SIGTERM", self.api.drain_arrivals - before, quiet_s, time.monotonic() - start)

    async def serve(self, stop: asyncio.Event, drain_timeout_s: float = 0.0, drain_linger_s: float = 0.0,
                    drain_quiet_s: float = 0.0) -> None:
        ctx = zmq.Context()
        self.auth = security.start_authenticator(ctx, self.keys)  # before the bind: no handshake goes unchecked
        self.metrics.auth_refused = lambda: self.auth.refused
        self.sock = zsock.Socket(ctx, zmq.ROUTER)
        self.sock.linger = 0
        security.secure_server(self.sock, self.keys, security.CURVE, self.max_frame_bytes)
        monitor = zsock.Socket.wrap(self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        self.sock.bind(f"tcp://{self.host}:{self.control_port}")
        runner = web.AppRunner(self.api.app(), handler_cancellation=True, access_log=None,
                               shutdown_timeout=2.0)
        await runner.setup()
        api_site = GentleSite(runner, self.host, self.api_port)
        await api_site.start()
        admin = web.AppRunner(self.admin.app(), handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
        await admin.setup()
        await web.TCPSite(admin, self.host, self.admin_port).start()
        log.info("master %s: API http://%s:%d%s, admin http://%s:%d%s, control tcp://%s:%d, stages %s",
                 self.master_id, self.host, self.api_port, " (API key required)" if self.api.api_key else "",
                 self.host, self.admin_port, "" if self.admin.token else " (off: no admin token)",
                 self.host, self.control_port, ", ".join(self.stage_names))
        tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat_loop()),
                 asyncio.create_task(self._disconnect_loop(monitor))]
        try:
            await stop.wait()
            await self.drain(drain_timeout_s, drain_linger_s, drain_quiet_s)
            await api_site.close(CLOSE_GRACE_S)  # a request that came as the drain ended gets its 503 too
        finally:
            for t in tasks:
                t.cancel()
            await runner.cleanup()
            await admin.cleanup()
            self.sock.disable_monitor()
            monitor.close()
            self.sock.close()
            self.auth.stop()
            ctx.term()


def replicas_bound(doc: OmniPipeline) -> int:
    """Registrations a stage may hold: what its spec can ask for, doubled (rollouts surge), at least a floor."""
    most = 1
    for s in doc.spec.stages:
        host = doc.spec.stage(s.colocate_with) if s.colocate_with else s
        n = host.autoscaling.max_replicas if host.autoscaling else (host.replicas or 1)
        most = max(most, n)
    return max(C.MIN_REPLICAS_BOUND, 2 * most)


def data_host(addr: str) -> str | None:
    """The IP of a tcp://IP:PORT data address (None when it is not one)."""
    if not addr.startswith("tcp://"):
        return None
    host, sep, port = addr[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit():
        return None
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def _peer_address(frame) -> str | None:
    try:
        return str(ipaddress.ip_address(frame.get("Peer-Address")))
    except (zmq.ZMQError, ValueError, AttributeError):
        return None  # not over TCP (ipc, inproc): nothing to compare


def run_master(doc: OmniPipeline, drain_timeout_s: float = C.MASTER_DRAIN_TIMEOUT_S,
               drain_linger_s: float = C.MASTER_DRAIN_LINGER_S, drain_quiet_s: float = C.MASTER_DRAIN_QUIET_S,
               **kwargs) -> int:
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Master(doc, **kwargs).serve(stop, drain_timeout_s, drain_linger_s, drain_quiet_s)

    asyncio.run(main())
    return 0
