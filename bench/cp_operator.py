"""Bench-only entry point of the operator: `python -m bench.cp_operator OUT.prof|- [operator ARGS]`.

Runs exactly `omnifleet operator ARGS` (the same code) under cProfile, in every thread: the
asyncio loop (kopf, the reconcile workers) and the executor threads where kopf runs the
synchronous index and event handlers (each thread gets its own profiler when it starts). The
clock is each thread's CPU time, so waiting does not count.

A profiler may only be switched on and off from its own thread, so the signals never do that:
SIGUSR2 takes a baseline snapshot of every thread's counters (e.g. after start-up), SIGUSR1
writes OUT.prof = what was collected since the baseline, all threads merged. At exit it is
written unless SIGUSR1 already wrote it. OUT `-`: no profiler.

`OMNIFLEET_BENCH_EXPERIMENT=a,b`: try changes to the operator without editing it (bench only):

- `nodiffbase`: kopf's diff-base storage does nothing. For every watch event of every watched
  object kopf deep-copies the body twice (DiffBaseStorage.build, ProgressStorage.clear) to
  detect changes for change handlers; an on.event + index operator has none.
- `rendercache`: parse + render once per pipeline (uid, generation) instead of on every pass
  (a pipeline's spec changes only with its generation).
"""

from __future__ import annotations

import cProfile
import marshal
import os
import signal
import sys
import threading
import time

Stats = dict  # func -> (cc, nc, tt, ct, callers{func: (cc, nc, tt, ct)})


def _snapshot(prof: cProfile.Profile) -> Stats:
    prof.snapshot_stats()  # reads the counters (getstats); does not touch the thread's hook
    return dict(prof.stats)


def _sub(a: tuple, b: tuple | None) -> tuple:
    return a if b is None else tuple(x - y for x, y in zip(a, b))


def _minus(now: Stats, base: Stats) -> Stats:
    out: Stats = {}
    for func, (cc, nc, tt, ct, callers) in now.items():
        b = base.get(func)
        if b is None:
            out[func] = (cc, nc, tt, ct, dict(callers))
            continue
        if nc - b[1] <= 0:
            continue
        bc = b[4]
        new_callers = {}
        for caller, v in callers.items():
            d = _sub(v, bc.get(caller)) if isinstance(v, tuple) else v - bc.get(caller, 0)
            if (d[1] if isinstance(d, tuple) else d) > 0:
                new_callers[caller] = d
        out[func] = (cc - b[0], nc - b[1], tt - b[2], ct - b[3], new_callers)
    return out


def _add(acc: Stats, more: Stats) -> None:
    for func, (cc, nc, tt, ct, callers) in more.items():
        if func not in acc:
            acc[func] = (cc, nc, tt, ct, dict(callers))
            continue
        a = acc[func]
        merged = dict(a[4])
        for caller, v in callers.items():
            if caller in merged:
                w = merged[caller]
                merged[caller] = tuple(x + y for x, y in zip(w, v)) if isinstance(v, tuple) else w + v
            else:
                merged[caller] = v
        acc[func] = (a[0] + cc, a[1] + nc, a[2] + tt, a[3] + ct, merged)


def experiments(names: list[str]) -> None:
    if "nodiffbase" in names:
        import kopf

        class NoDiffBase(kopf.AnnotationsDiffBaseStorage):
            def build(self, *, body, extra_fields=None):  # type: ignore[override]
                return None

            def fetch(self, *, body):  # type: ignore[override]
                return None

        @kopf.on.startup()
        async def _bench_nodiffbase(settings: kopf.OperatorSettings, **_) -> None:
            settings.persistence.diffbase_storage = NoDiffBase()

    if "rendercache" in names:
        from omnifleet_operator import reconcile, render

        parse, desired = reconcile.parse, render.desired
        parsed: dict = {}
        rendered: dict = {}

        def cached_parse(body):
            m = body["metadata"]
            key = (m.get("uid"), m.get("generation"), m.get("namespace"), m["name"])
            if key not in parsed:
                if len(parsed) > 10000:
                    parsed.clear()
                parsed[key] = parse(body)
            return parsed[key]

        def cached_desired(doc, owner_uid=None):
            key = (id(doc), owner_uid)
            hit = rendered.get(key)
            if hit is None or hit[0] is not doc:
                if len(rendered) > 10000:
                    rendered.clear()
                hit = rendered[key] = (doc, desired(doc, owner_uid=owner_uid))
            return hit[1]

        reconcile.parse = cached_parse
        render.desired = cached_desired


def main(argv: list[str]) -> int:
    out, rest = argv[0], argv[1:]
    exp = [e for e in os.environ.get("OMNIFLEET_BENCH_EXPERIMENT", "").split(",") if e]
    if exp:
        print(f"bench.cp_operator: experiments {exp}", file=sys.stderr, flush=True)
        import omnifleet_operator.handlers  # noqa: F401 - registers the operator's handlers first
        experiments(exp)
    if out == "-":
        from omnifleet_operator.cli import main as cli_main

        return cli_main(["operator", *rest])
    profs: list[cProfile.Profile] = []
    base: dict[int, Stats] = {}
    lock = threading.Lock()
    dumped = False

    def new_profile() -> cProfile.Profile:
        p = cProfile.Profile(time.thread_time)
        with lock:
            profs.append(p)
        return p

    def thread_hook(frame, event, arg):  # a new thread's first profile event: give it its own profiler
        sys.setprofile(None)
        new_profile().enable()

    def reset(*_):
        with lock:
            ps = list(profs)
        for p in ps:
            base[id(p)] = _snapshot(p)

    def dump(*_):
        nonlocal dumped
        with lock:
            ps = list(profs)
        total: Stats = {}
        for p in ps:
            _add(total, _minus(_snapshot(p), base.get(id(p), {})))
        with open(out + ".tmp", "wb") as f:
            marshal.dump(total, f)
        os.replace(out + ".tmp", out)
        dumped = True

    signal.signal(signal.SIGUSR1, dump)
    signal.signal(signal.SIGUSR2, reset)
    threading.setprofile(thread_hook)
    new_profile().enable()
    try:
        from omnifleet_operator.cli import main as cli_main

        return cli_main(["operator", *rest])
    finally:
        if not dumped:
            dump()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
