"""A stage pod: one worker process per stage named on the command line.

`--stage A --stage B` runs A (the host) and B (co-located into A's pods) as
two processes sharing the pod's GPUs and /dev/shm. This parent process
serves the pod's probes (`/livez`: every worker is alive, its engine too; `/startedz`: every
engine is loaded; `/readyz`: every worker has its engine loaded, is registered
with at least one master and is not draining, so a ready pod is one a master routes
to; stage.py says why one master is enough) and, on the metrics port, the
workers' series merged (each labelled with its stage), forwards SIGTERM to the
workers (which drain), and ends the pod when a worker dies, so Kubernetes
restarts it whole.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from . import constants as C
from . import metrics, shm
from .lifetime import die_with_parent

log = logging.getLogger("omnifleet.pod")
METRICS_SCRAPE_TIMEOUT_S = 5.0  # per worker, within one scrape of the pod
# glibc malloc in the workers keeps large freed buffers in its heap rather than handing them back to the kernel,
# so the next large frame a worker receives lands in resident pages instead of taking a page fault per page
# (bench/data_plane.py, bulk between pods). One arena: a thread's arena cannot hold a frame over 64 MiB and would
# map it afresh whatever the rest says. The cost: a worker's heap stays at its peak. A pod env that sets
# GLIBC_TUNABLES itself wins.
WORKER_MALLOC = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"
STACK_DUMP_WAIT_S = 1.0  # for a stuck worker's stack dump to reach the log before it is killed


@dataclass(frozen=True)
class WorkerSpec:
    config_path: str
    stage: str
    replica: str
    masters: str  # HOST:PORT[,HOST:PORT...] of the masters' control ports (discovery.py)
    host: str
    data_port: int
    advertise_host: str
    drain_timeout_s: float
    log_level: str
    keys_dir: str
    max_frame_bytes: int
    heartbeat_interval_s: float | None = None  # None: spec.heartbeat, else the default
    heartbeat_timeout_s: float | None = None


def _worker_main(spec: WorkerSpec, ready, metrics_port, registered, engine_died) -> None:
    # The kernel kills this worker when the pod's parent dies, however it dies.
    die_with_parent(signal.SIGKILL, mp.parent_process().pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which sends SIGTERM
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # nothing to drain before the worker's loop runs
    # The parent's stack dump of a stuck shutdown (SIGQUIT, as a JVM's thread dump; SIGUSR1/2 are left to
    # profilers such as bench/wrapper.py's).
    faulthandler.register(signal.SIGQUIT, all_threads=True)
    from . import tracing
    from .commands import setup_logging
    from .config import config_hash, heartbeat, load_config
    from .security import Keys
    from .stage import StageWorker

    setup_logging(spec.log_level, f"{spec.stage}/{spec.replica}")
    tracing.setup("omnifleet-stage", f"{spec.stage}/{spec.replica}")
    doc = load_config(spec.config_path)
    interval, timeout = heartbeat(doc, spec.heartbeat_interval_s, spec.heartbeat_timeout_s)
    worker = StageWorker(
        doc, spec.stage, spec.replica, spec.masters, config_hash(doc, spec.stage), host=spec.host,
        data_port=spec.data_port, advertise_host=spec.advertise_host, drain_timeout_s=spec.drain_timeout_s,
        keys=Keys.load(spec.keys_dir), max_frame_bytes=spec.max_frame_bytes,
        heartbeat_interval_s=interval, heartbeat_timeout_s=timeout,
    )

    def on_metrics(port: int) -> None:
        metrics_port.value = port

    def on_registered(state: int) -> None:
        registered.value = state

    def on_engine_died() -> None:
        engine_died.value = 1

    sys.exit(asyncio.run(worker.main(on_ready=ready.set, on_metrics=on_metrics, on_registered=on_registered,
                                     on_engine_died=on_engine_died)))


class Pod:
    def __init__(self, workers: list[WorkerSpec], health_host: str, health_port: int, metrics_port: int = 0,
                 exit_timeout_s: float = C.STAGE_EXIT_TIMEOUT_S):
        self.specs = workers
        self.exit_timeout_s = exit_timeout_s
        self.health_host, self.health_port, self.metrics_port = health_host, health_port, metrics_port
        ctx = mp.get_context("spawn")  # no fork: a fresh interpreter per engine (CUDA needs it)
        self.ready = [ctx.Event() for _ in workers]
        self.worker_metrics = [ctx.Value("i", 0, lock=False) for _ in workers]  # each worker's loopback port
        # The worker's registration (C.WORKER_*; its worker writes it).
        self.registered = [ctx.Value("b", 0, lock=False) for _ in workers]
        # 1 once the worker's engine died: the pod is not live from then on, while the worker winds down.
        self.engine_died = [ctx.Value("b", 0, lock=False) for _ in workers]
        self.procs = [
            ctx.Process(target=_worker_main, args=(w, ev, port, reg, died), name=f"stage-{w.stage}", daemon=False)
            for w, ev, port, reg, died in zip(workers, self.ready, self.worker_metrics, self.registered,
                                              self.engine_died)
        ]
        self.stopping = False
        self.stop_deadline = 0.0  # monotonic: past it, a worker still running is killed

    def _dead(self) -> list[str]:
        return [p.name for p, died in zip(self.procs, self.engine_died) if died.value or not p.is_alive()]

    async def livez(self, request: web.Request) -> web.Response:
        dead = self._dead()
        if dead:
            return web.json_response({"live": False, "dead": dead}, status=503)
        return web.json_response({"live": True})

    def _loading(self) -> list[str]:
        return [w.stage for w, ev in zip(self.specs, self.ready) if not ev.is_set()]

    async def startedz(self, request: web.Request) -> web.Response:
        """The startup probe: every engine is loaded (a model load may take many minutes)."""
        loading = self._loading()
        if loading:
            return web.json_response({"started": False, "loading": loading}, status=503)
        return web.json_response({"started": True})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready only while the master routes to every stage of this pod: the Deployment's ready
        replicas are then registered replicas, which the pipeline's status counts on."""
        loading = self._loading()
        unregistered = [w.stage for w, ev, reg in zip(self.specs, self.ready, self.registered)
                        if ev.is_set() and reg.value == C.WORKER_UNREGISTERED]
        # Registered, but a rollout's other stages have no replica of this revision yet: the old pods serve.
        waiting = [w.stage for w, reg in zip(self.specs, self.registered) if reg.value == C.WORKER_WAITING]
        dead = self._dead()
        if loading or unregistered or waiting or dead or self.stopping:
            body = {"ready": False, "loading": loading, "unregistered": unregistered, "dead": dead,
                    "draining": self.stopping}
            return web.json_response(body | ({"waitingForRevision": waiting} if waiting else {}), status=503)
        return web.json_response({"ready": True})

    async def metrics(self, request: web.Request) -> web.Response:
        async def scrape(session: aiohttp.ClientSession, port: int) -> str | None:
            if not port:
                return None  # still loading its engine
            try:
                async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    return await resp.text() if resp.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return None

        timeout = aiohttp.ClientTimeout(total=METRICS_SCRAPE_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            texts = await asyncio.gather(*(scrape(session, v.value) for v in self.worker_metrics))
        parts = [({"stage": w.stage}, t) for w, t in zip(self.specs, texts) if t is not None]
        own = metrics.pod_families(shm.usage(shm.pod_prefix(self.specs[0].replica)),
                                   {w.stage: t is not None for w, t in zip(self.specs, texts)})
        body = await asyncio.get_running_loop().run_in_executor(None, metrics.merge, parts, own)
        return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})

    def _stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            self.stop_deadline = time.monotonic() + max(w.drain_timeout_s for w in self.specs) + self.exit_timeout_s
            log.info("stopping: draining the stage workers")
            for p in self.procs:
                if p.is_alive():
                    p.terminate()  # SIGTERM: drain

    async def _kill_stuck(self) -> None:
        stuck = [(w, p) for w, p in zip(self.specs, self.procs) if p.is_alive()]
        log.error("stage(s) %s still running %gs after their drain deadline (--exit-timeout); their threads' "
                  "stacks follow, then they are killed", [w.stage for w, _ in stuck], self.exit_timeout_s)
        for _, p in stuck:
            os.kill(p.pid, signal.SIGQUIT)
        await asyncio.sleep(STACK_DUMP_WAIT_S)
        for _, p in stuck:
            p.kill()
        await asyncio.get_running_loop().run_in_executor(None, lambda: [p.join() for _, p in stuck])

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop)
        shm.sweep(shm.pod_prefix(self.specs[0].replica))  # a restarted container's leftovers
        os.environ.setdefault("GLIBC_TUNABLES", WORKER_MALLOC)  # read by each worker's libc as it starts
        for p in self.procs:
            p.start()
        app = web.Application()
        app.add_routes([web.get("/livez", self.livez), web.get("/startedz", self.startedz),
                        web.get("/readyz", self.readyz)])
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, self.health_host, self.health_port).start()
        metrics_runner = None
        if self.metrics_port:
            app = web.Application()
            app.add_routes([web.get("/metrics", self.metrics)])
            metrics_runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
            await metrics_runner.setup()
            await web.TCPSite(metrics_runner, self.health_host, self.metrics_port).start()
        code = 0
        try:
            while any(p.is_alive() for p in self.procs):
                for w, p in zip(self.specs, self.procs):
                    if not p.is_alive() and not self.stopping:
                        log.error("stage %s exited with code %s; stopping the pod", w.stage, p.exitcode)
                        code = p.exitcode if p.exitcode and p.exitcode > 0 else 1
                        self._stop()
                if self.stopping and time.monotonic() > self.stop_deadline:
                    await self._kill_stuck()
                await asyncio.sleep(0.1)
        finally:
            await runner.cleanup()
            if metrics_runner is not None:
                await metrics_runner.cleanup()
            shm.sweep(shm.pod_prefix(self.specs[0].replica))
        # A worker stopped by SIGTERM before it could install its handler had nothing to drain.
        codes = [0 if c == -signal.SIGTERM and self.stopping else c for c in (p.exitcode for p in self.procs)]
        if code == 0 and any(codes):
            code = next(c for c in codes if c)
            log.error("stage worker exit codes: %s", codes)
        return code if code >= 0 else 1
