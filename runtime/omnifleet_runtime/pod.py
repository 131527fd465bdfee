"""A stage pod: one worker process per stage named on the command line.

`--stage A --stage B` runs A (the host) and B (co-located into A's pods) as
two processes sharing the pod's GPUs and /dev/shm. This parent process
serves the pod's probes (`/livez`: every worker is alive; `/readyz`: every
engine is loaded and the pod is not draining), forwards SIGTERM to the
workers (which drain), and ends the pod when a worker dies, so Kubernetes
restarts it whole.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing as mp
import signal
import sys
from dataclasses import dataclass

from aiohttp import web

from . import shm

log = logging.getLogger("omnifleet.pod")


@dataclass(frozen=True)
class WorkerSpec:
    config_path: str
    stage: str
    replica: str
    master_addr: str
    host: str
    data_port: int
    advertise_host: str
    drain_timeout_s: float
    log_level: str


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the pod's parent dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(spec: WorkerSpec, ready) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which sends SIGTERM
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # nothing to drain before the worker's loop runs
    from .commands import setup_logging
    from .config import config_hash, load_config
    from .stage import StageWorker

    setup_logging(spec.log_level, f"{spec.stage}/{spec.replica}")
    doc = load_config(spec.config_path)
    worker = StageWorker(
        doc, spec.stage, spec.replica, spec.master_addr, config_hash(doc, spec.stage), host=spec.host,
        data_port=spec.data_port, advertise_host=spec.advertise_host, drain_timeout_s=spec.drain_timeout_s,
    )
    sys.exit(asyncio.run(worker.main(on_ready=ready.set)))


class Pod:
    def __init__(self, workers: list[WorkerSpec], health_host: str, health_port: int):
        self.specs = workers
        self.health_host, self.health_port = health_host, health_port
        ctx = mp.get_context("spawn")  # no fork: a fresh interpreter per engine (CUDA needs it)
        self.ready = [ctx.Event() for _ in workers]
        self.procs = [
            ctx.Process(target=_worker_main, args=(w, ev), name=f"stage-{w.stage}", daemon=False)
            for w, ev in zip(workers, self.ready)
        ]
        self.stopping = False

    async def livez(self, request: web.Request) -> web.Response:
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead:
            return web.json_response({"live": False, "dead": dead}, status=503)
        return web.json_response({"live": True})

    async def readyz(self, request: web.Request) -> web.Response:
        loading = [w.stage for w, ev in zip(self.specs, self.ready) if not ev.is_set()]
        if loading or self.stopping:
            return web.json_response({"ready": False, "loading": loading, "draining": self.stopping}, status=503)
        return web.json_response({"ready": True})

    def _stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            log.info("stopping: draining the stage workers")
            for p in self.procs:
                if p.is_alive():
                    p.terminate()  # SIGTERM: drain

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop)
        for p in self.procs:
            p.start()
        app = web.Application()
        app.add_routes([web.get("/livez", self.livez), web.get("/readyz", self.readyz)])
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, self.health_host, self.health_port).start()
        code = 0
        try:
            while any(p.is_alive() for p in self.procs):
                for w, p in zip(self.specs, self.procs):
                    if not p.is_alive() and not self.stopping:
                        log.error("stage %s exited with code %s; stopping the pod", w.stage, p.exitcode)
                        code = p.exitcode if p.exitcode and p.exitcode > 0 else 1
                        self._stop()
                await asyncio.sleep(0.1)
        finally:
            await runner.cleanup()
            shm.sweep(shm.pod_prefix(self.specs[0].replica))
        # A worker stopped by SIGTERM before it could install its handler had nothing to drain.
        codes = [0 if c == -signal.SIGTERM and self.stopping else c for c in (p.exitcode for p in self.procs)]
        if code == 0 and any(codes):
            code = next(c for c in codes if c)
            log.error("stage worker exit codes: %s", codes)
        return code if code >= 0 else 1
