"""Bench-only entry point of runtime processes: `python -m bench.wrapper master|stage ARGS`.

The same as `python -m omnifleet_runtime master|stage ARGS` (the same code, the
same data path), plus two things the benchmarks need and the runtime does not
have:

- master: `POST /bench/orch {"n", "concurrency", "time_limit_s", "prompt"}` runs
  up to n requests through the master's orchestrator *inside the master
  process* (Dispatch over the control ROUTER, Data between stages, Output and
  Done back), so the latency of the master's ZMQ path is measured without an
  HTTP request per request. It answers each request's latency.
- `OMNIFLEET_BENCH_PROFILE=DIR`: cProfile the main thread (the asyncio loop)
  of the master, and of every stage worker (the pod's spawned children import
  this module as `__mp_main__`, which is where the profiler starts). The clock
  is the thread's CPU time (time.thread_time), so time spent waiting in epoll
  does not count and the profile shows where the CPU goes. SIGUSR2 clears what
  was collected so far (e.g. the start-up); SIGUSR1 writes DIR/<role>-<pid>.prof.
- `OMNIFLEET_BENCH_UVLOOP=1`: run the process's asyncio loops on uvloop (an
  experiment: the runtime itself uses the default loop).
"""

from __future__ import annotations

import atexit
import cProfile
import os
import signal
import sys
import time
import uuid

PROFILE_ENV = "OMNIFLEET_BENCH_PROFILE"


def _start_profiler(role: str) -> None:
    out = os.environ.get(PROFILE_ENV)
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    prof = cProfile.Profile(time.thread_time)
    path = os.path.join(out, f"{role}-{os.getpid()}.prof")

    def dump(*_):
        prof.disable()
        prof.dump_stats(path + ".tmp")
        os.replace(path + ".tmp", path)
        prof.enable()

    signal.signal(signal.SIGUSR1, dump)
    def reset(*_):
        prof.disable()
        prof.clear()
        prof.enable()

    signal.signal(signal.SIGUSR2, reset)
    atexit.register(lambda: (prof.disable(), prof.dump_stats(path)))
    prof.enable()


def _maybe_uvloop() -> None:
    if os.environ.get("OMNIFLEET_BENCH_UVLOOP") == "1":
        import asyncio

        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _patch_master() -> None:
    from aiohttp import web

    from omnifleet_runtime import master as M
    from omnifleet_runtime import wire

    class BenchMaster(M.Master):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            make_app = self.api.app

            def app() -> web.Application:
                a = make_app()
                a.router.add_post("/bench/orch", self._bench_orch)
                return a

            self.api.app = app

        async def _bench_orch(self, request: web.Request) -> web.Response:
            import asyncio

            body = await request.json()
            n, conc = int(body["n"]), max(1, int(body.get("concurrency", 1)))
            deadline = time.monotonic() + float(body.get("time_limit_s", 20.0))
            prompt = body["prompt"]
            sampling = {s.name: dict(s.sampling_params) for s in self.doc.spec.stages}
            latencies: list[float] = []
            errors: list[str] = []
            issued = 0

            async def worker() -> None:
                nonlocal issued
                while issued < n and time.monotonic() < deadline:
                    issued += 1
                    info = wire.RequestInfo(request_id=f"bench-{uuid.uuid4().hex}", kind="completion",
                                            model=self.doc.metadata.name, prompt=prompt)
                    t0 = time.perf_counter()
                    run = self.orch.start(info, sampling)
                    try:
                        while True:
                            ev = await run.events.get()
                            if ev.kind == "output":
                                continue
                            if ev.kind == "error":
                                errors.append(ev.message)
                            break
                    finally:
                        self.orch.abort(run)  # a no-op once it ended, as in the API
                    latencies.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(conc)))
            return web.json_response({"latencies": latencies, "wall_s": time.perf_counter() - t0,
                                      "errors": len(errors), "first_error": errors[0] if errors else None})

    M.Master = BenchMaster  # run_master builds M.Master


def main(argv: list[str]) -> int:
    from omnifleet_runtime.__main__ import main as runtime_main

    _maybe_uvloop()
    if argv and argv[0] == "master":
        import omnifleet_runtime

        print(f"bench.wrapper: runtime from {os.path.dirname(omnifleet_runtime.__file__)}", file=sys.stderr,
              flush=True)
        _patch_master()
        _start_profiler("master")
    return runtime_main(argv)


if __name__ == "__mp_main__":  # a stage worker spawned by the pod process
    _maybe_uvloop()
    _start_profiler("stage")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
