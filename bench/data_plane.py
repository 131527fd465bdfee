"""Data-plane benchmark of the omnifleet runtime, against limits measured in the same run.

    .venv/bin/python -m bench.data_plane [--quick] [--out DIR] [--profile | --no-profile]

Three parts, each on real processes on loopback (a master and stage pods, as
`omnifleet master|stage` run them, started through bench.wrapper):

1. Per-hop overhead. Pipelines of 1, 2 and 3 no-op `python` stages; sequential
   requests through the master's HTTP API (a minimal keep-alive HTTP client) and
   through the master's orchestrator without HTTP (bench.wrapper's /bench/orch:
   the request loop runs inside the master; each request is Dispatch -> stages
   -> Output/Done over ZMQ). Limit: a raw ZMQ DEALER->ROUTER->DEALER round trip
   of the same message size, Python on both ends, measured before and after.
   Headline: per-hop = (p50(3 stages) - p50(1 stage)) / 2 vs raw RTT p50 (goal <= 2x).
2. Throughput through the master with a no-op stage at concurrency 1..256
   (bounded in count and time per point): requests/s and the master's CPU per
   request (utime+stime of /proc/PID/stat, and the ns on-CPU time of its threads).
3. Bulk transfer: stage 1 produces N bytes, stage 2 touches every page and returns
   a digest. The boundary time is stamped inside the stages (producer's return to
   consumer done touching); limit: a plain Python TCP stream (sendall/recv_into) of
   the same bytes between two processes. Pods: two pods (the TCP data path), one
   pod with both stages (the shared-memory path), two pods with CurveZMQ data
   ports (the default; the goals are for plain-auth, as the performance issue
   asks), and two pods with the payload split into 4 MiB frames by the producer. Master CPU and the bytes it received
   per request, per payload size.

Writes bench/results/<date>-data-plane.md (+ .json and PNG plots) and merges the
headline ratios into bench/results/latest.json under "data_plane" (quick runs:
"-quick" files and the "data_plane_quick" key, so a smoke run never replaces a
full one). No timing assertions: it prints numbers and ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from . import common as C
from . import goals as G
from .raw import Server, TcpClient, ZmqPushClient, wake_cost, zmq_rtt

KIB, MIB = 1 << 10, 1 << 20
# The goals as bench.goals (and so the README) has them.
GOAL_PER_HOP = G.by_key("data_plane", "per_hop_http_over_raw_zmq_rtt").limit
GOAL_BULK = {kind: G.by_key("data_plane", f"bulk_{kind}_over_raw_tcp_16MiB").limit for kind in ("tcp", "shm")}
GOAL_MASTER_CPU_FLAT = G.by_key("data_plane", "master_cpu_per_req_tcp_256MiB_over_1KiB").limit  # 1.0: flat

FULL = dict(
    lat_sizes=[64, 1024, 4096], lat_n=1000, lat_warmup=20, lat_time_s=30.0, lat_rounds=5,
    lat_fleets=[(1, "noop"), (2, "noop"), (3, "noop"), (1, "anoop"), (3, "anoop")],
    rtt_n=2000, rtt_warmup=50,
    tp_conc=[1, 4, 16, 64, 256], tp_max_requests=2000, tp_time_s=20.0, tp_warmup=50,
    bulk_sizes=[1 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB],
    bulk_budget=2 << 30, bulk_min_reps=6, bulk_max_reps=100, bulk_time_s=40.0, bulk_rounds=2,
    chunk=4 * MIB, prof_n=1000, prof_bulk_size=64 * MIB, wake_reps=20,
)
QUICK = dict(
    lat_sizes=[64], lat_n=150, lat_warmup=10, lat_time_s=10.0, lat_rounds=2,
    lat_fleets=[(1, "noop"), (2, "noop"), (3, "noop")],
    rtt_n=500, rtt_warmup=20,
    tp_conc=[1, 16, 64], tp_max_requests=300, tp_time_s=5.0, tp_warmup=20,
    bulk_sizes=[1 * KIB, 1 * MIB, 16 * MIB, 64 * MIB],
    bulk_budget=256 * MIB, bulk_min_reps=4, bulk_max_reps=20, bulk_time_s=10.0, bulk_rounds=2,
    chunk=4 * MIB, prof_n=200, prof_bulk_size=16 * MIB, wake_reps=5,
)


def chain(n: int, fn: str) -> list[dict[str, Any]]:
    stages = []
    for i in range(1, n + 1):
        s: dict[str, Any] = {"name": f"s{i}", "type": "python", "entrypoint": f"bench.fns:{fn}"}
        if i > 1:
            s["inputs"] = [f"s{i - 1}"]
        if i == n:
            s["finalOutput"] = "text"
        stages.append(s)
    return stages


# The goals are measured with data-port encryption off (plain-auth: the control port is CurveZMQ all the
# same); CurveZMQ data ports, the default, are measured beside them (bulk), and by bench.wire_security.
PLAIN = {"security": {"dataPlane": "plain-auth"}}


def start_chain(n: int, fn: str, profile_dir: Path | None = None) -> C.Fleet:
    fleet = C.Fleet(f"{n}x{fn}", chain(n, fn), profile_dir, spec=PLAIN)
    fleet.start_master()
    for i in range(1, n + 1):
        fleet.start_pod(f"p{i}", f"s{i}")
    fleet.wait_ready()
    return fleet


def summarize(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50": C.pct(xs, 50), "p90": C.pct(xs, 90), "p99": C.pct(xs, 99),
            "mean": sum(xs) / len(xs) if xs else float("nan")}


def us(x: float) -> str:
    return f"{x * 1e6:.0f}"


# ---------------------------------------------------------------- 1. latency


RTT_MODES = ("sync", "async", "reader")


def http_sequential(fleet: C.Fleet, prompt: str, n: int, warmup: int, time_s: float,
                    pids: dict[int, str] | None = None) -> dict[str, Any]:
    """n sequential requests over one keep-alive connection; latencies and CPU seconds of each runtime process."""
    client = C.HttpClient(fleet.api_port)
    req = C.request_bytes("/v1/completions", json.dumps({"model": "bench", "prompt": prompt}).encode(),
                          fleet.api_port)
    status, body = client.send_raw(req)
    text = json.loads(body)["choices"][0]["text"] if status == 200 else body
    if status != 200 or text != prompt:
        raise RuntimeError(f"bad answer from the pipeline: {status} {str(body)[:300]}")
    for _ in range(warmup):
        client.send_raw(req)
    pids = pids or {fleet.master_pid: "master"}
    lat: list[float] = []
    errors = 0
    before = {pid: C.cpu_sample(pid) for pid in pids}
    c0 = os.times()
    deadline = time.monotonic() + time_s
    for _ in range(n):
        if time.monotonic() > deadline:
            break
        t0 = time.perf_counter()
        status, _ = client.send_raw(req)
        lat.append(time.perf_counter() - t0)
        errors += status != 200
    c1 = os.times()
    cpu = {name: C.cpu_delta(before[pid], C.cpu_sample(pid))["cpu_s"] for pid, name in pids.items()}
    cpu["client"] = (c1.user - c0.user) + (c1.system - c0.system)
    client.close()
    return {"lat": lat, "errors": errors, "cpu": cpu}


def orch_run(fleet: C.Fleet, prompt: str, n: int, conc: int, time_s: float,
             pids: dict[int, str] | None = None) -> dict[str, Any]:
    """n requests through /bench/orch (the orchestrator inside the master, no HTTP per request)."""
    client = C.HttpClient(fleet.api_port, timeout=time_s + 60)
    pids = pids or {fleet.master_pid: "master"}
    before = {pid: C.cpu_sample(pid) for pid in pids}
    status, body = client.post("/bench/orch", {"n": n, "concurrency": conc, "time_limit_s": time_s,
                                               "prompt": prompt})
    deltas = {name: C.cpu_delta(before[pid], C.cpu_sample(pid)) for pid, name in pids.items()}
    client.close()
    if status != 200:
        raise RuntimeError(f"/bench/orch answered {status}: {body[:300]!r}")
    res = json.loads(body)
    if res["errors"]:
        raise RuntimeError(f"{res['errors']} errors in /bench/orch: {res['first_error']}")
    res["master_cpu"] = deltas["master"]
    res["cpu"] = {name: d["cpu_s"] for name, d in deltas.items()}
    return res


def anatomy(n: int = 2000) -> dict[str, float]:
    """In-process costs of the pieces a hop is made of, on this machine (p50 seconds)."""
    sys.path.insert(0, str(C.RUNTIME_ROOT / "runtime"))
    from omnifleet_runtime import wire

    out: dict[str, float] = {}
    msg = wire.Data("req-" + "0" * 32, 0, "s1", 0, "x" * 64)
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        wire.decode(wire.encode(msg))
        xs.append(time.perf_counter() - t0)
    out["wire.encode + wire.decode of a 64 B Data message"] = C.pct(xs, 50)
    from omnifleet_runtime import media

    chunk = {"audio": wire.Array("float32", (240,), b"\x00\x00\x80\x3e" * 240), "sample_rate": 24000}
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        media.audio_of(chunk)
        xs.append(time.perf_counter() - t0)
    out["media.audio_of: 10 ms of 24 kHz float32 audio to 16-bit PCM (the master, per streamed speech chunk)"] = \
        C.pct(xs, 50)

    async def loop_costs() -> None:
        def noop() -> None:
            return None

        xs = []
        for _ in range(n // 4):
            t0 = time.perf_counter()
            await asyncio.to_thread(noop)
            xs.append(time.perf_counter() - t0)
        out["asyncio.to_thread(no-op) round trip (how plain stage callables run)"] = C.pct(xs, 50)
        q: asyncio.Queue = asyncio.Queue()

        async def consumer() -> None:
            while (t0 := await q.get()) is not None:
                xs.append(time.perf_counter() - t0)

        xs = []
        task = asyncio.create_task(consumer())
        for _ in range(n):
            q.put_nowait(time.perf_counter())
            await asyncio.sleep(0)
        q.put_nowait(None)
        await task
        out["asyncio.Queue hand-off to another task (put -> get)"] = C.pct(xs, 50)
        xs = []
        for _ in range(n):
            t0 = time.perf_counter()
            await asyncio.sleep(0)
            xs.append(time.perf_counter() - t0)
        out["one asyncio loop iteration (await asyncio.sleep(0))"] = C.pct(xs, 50)

    asyncio.run(loop_costs())
    return out


def run_latency(cfg: dict) -> dict[str, Any]:
    """Every pipeline and the raw echo servers run side by side; rounds interleave them, so the drift of a
    shared machine hits all alike; samples are pooled over the rounds."""
    C.log("== per-hop latency")
    sizes, rounds = cfg["lat_sizes"], cfg["lat_rounds"]
    n_round = max(1, cfg["lat_n"] // rounds)
    keys = [f"{n}x{fn}" for n, fn in cfg["lat_fleets"]]
    rtt: dict[int, dict[str, list[float]]] = {s: {m: [] for m in RTT_MODES} for s in sizes}
    rtt_rounds: dict[int, list[float]] = {s: [] for s in sizes}
    lat = {k: {s: {"http": [], "orch": []} for s in sizes} for k in keys}
    cpu = {k: {s: {"http": {}, "orch": {}, "n_http": 0, "n_orch": 0} for s in sizes} for k in keys}
    fleets: dict[str, C.Fleet] = {}
    servers: dict[str, tuple[int, Server]] = {}
    try:
        for (n, fn), key in zip(cfg["lat_fleets"], keys):
            fleets[key] = start_chain(n, fn)
        pids = {k: f.runtime_pids() for k, f in fleets.items()}
        for mode in RTT_MODES:
            port = C.free_port()
            servers[mode] = (port, Server("zmq-echo", str(port), mode))
        for r in range(rounds):
            for size in sizes:
                for mode, (port, _) in servers.items():
                    xs = zmq_rtt(port, size, max(1, cfg["rtt_n"] // rounds), cfg["rtt_warmup"], 30.0, mode)
                    rtt[size][mode] += xs
                    if mode == "sync":
                        rtt_rounds[size].append(C.pct(xs, 50))
            for key, fleet in fleets.items():
                for size in sizes:
                    prompt = "x" * size
                    h = http_sequential(fleet, prompt, n_round, cfg["lat_warmup"], cfg["lat_time_s"], pids[key])
                    orch_run(fleet, prompt, cfg["lat_warmup"], 1, cfg["lat_time_s"])  # warm-up
                    o = orch_run(fleet, prompt, n_round, 1, cfg["lat_time_s"], pids[key])
                    lat[key][size]["http"] += h["lat"]
                    lat[key][size]["orch"] += o["latencies"]
                    c = cpu[key][size]
                    for path, got, count in (("http", h["cpu"], len(h["lat"])), ("orch", o["cpu"], len(o["latencies"]))):
                        for name, v in got.items():
                            c[path][name] = c[path].get(name, 0.0) + v
                        c[f"n_{path}"] += count
            C.log(f"round {r + 1}/{rounds}: raw RTT p50 " + ", ".join(
                f"{s} B {us(C.pct(rtt[s]['sync'], 50))} us" for s in sizes) + "; " + ", ".join(
                f"{k} {us(C.pct(lat[k][sizes[0]]['http'], 50))}/{us(C.pct(lat[k][sizes[0]]['orch'], 50))} us"
                for k in keys) + " (HTTP/orch p50 so far)")
    finally:
        for _, srv in servers.values():
            srv.close()
        for f in fleets.values():
            f.stop()
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for key in keys:
        runs[key] = {}
        for size in sizes:
            c = cpu[key][size]
            runs[key][size] = {
                "http": summarize(lat[key][size]["http"]), "orch": summarize(lat[key][size]["orch"]),
                "http_cpu_per_req": {k: v / max(1, c["n_http"]) for k, v in c["http"].items()},
                "orch_cpu_per_req": {k: v / max(1, c["n_orch"]) for k, v in c["orch"].items()},
            }
            C.log(f"{key} {size} B: HTTP p50 {us(runs[key][size]['http']['p50'])} us "
                  f"p99 {us(runs[key][size]['http']['p99'])} us; orchestrator p50 "
                  f"{us(runs[key][size]['orch']['p50'])} us p99 {us(runs[key][size]['orch']['p99'])} us; "
                  "CPU/req " + ", ".join(f"{k} {us(v)}" for k, v in runs[key][size]["http_cpu_per_req"].items()))
    rtt_sum = {size: {mode: summarize(rtt[size][mode]) for mode in RTT_MODES} for size in sizes}
    per_hop: dict[str, dict[int, dict[str, float]]] = {}
    for fn in sorted({fn for _, fn in cfg["lat_fleets"]}):
        one, three = runs.get(f"1x{fn}"), runs.get(f"3x{fn}")
        if not one or not three:
            continue
        per_hop[fn] = {}
        for size in sizes:
            raw = rtt_sum[size]["sync"]["p50"]
            row = {"raw_rtt_p50": raw}
            for path in ("http", "orch"):
                hop = (three[size][path]["p50"] - one[size][path]["p50"]) / 2
                row[f"{path}_per_hop"] = hop
                row[f"{path}_ratio"] = hop / raw
                row[f"{path}_cpu_per_hop"] = (sum(v for k, v in three[size][f"{path}_cpu_per_req"].items()
                                                  if k != "client")
                                              - sum(v for k, v in one[size][f"{path}_cpu_per_req"].items()
                                                    if k != "client")) / 2
            per_hop[fn][size] = row
    anat = anatomy()
    for k, v in anat.items():
        C.log(f"anatomy: {k}: {v * 1e6:.1f} us")
    return {"rtt": rtt_sum, "rtt_sync_p50_by_round": rtt_rounds, "runs": runs, "per_hop": per_hop,
            "anatomy": anat}


# ---------------------------------------------------------------- 2. throughput


async def _http_load(port: int, body: bytes, conc: int, n: int, time_s: float) -> dict[str, Any]:
    req = C.request_bytes("/v1/completions", body, port)
    clients = [C.AsyncHttpClient(port) for _ in range(conc)]
    await asyncio.gather(*(c.connect() for c in clients))
    issued = done = errors = 0
    lat: list[float] = []
    deadline = time.monotonic() + time_s

    async def worker(c: C.AsyncHttpClient) -> None:
        nonlocal issued, done, errors
        while issued < n and time.monotonic() < deadline:
            issued += 1
            t0 = time.perf_counter()
            status, _ = await c.send_raw(req)
            lat.append(time.perf_counter() - t0)
            done += 1
            errors += status != 200

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in clients))
    wall = time.perf_counter() - t0
    await asyncio.gather(*(c.close() for c in clients))
    return {"done": done, "errors": errors, "wall_s": wall, "lat": lat}


def run_throughput(cfg: dict) -> dict[str, Any]:
    C.log("== throughput through the master (1 no-op stage)")
    out: dict[str, Any] = {"http": {}, "orch": {}}
    body = json.dumps({"model": "bench", "prompt": "x" * 64}).encode()
    with start_chain(1, "noop") as fleet:
        worker = fleet.worker_pids("p1")[0]
        asyncio.run(_http_load(fleet.api_port, body, 4, cfg["tp_warmup"], 10.0))
        for conc in cfg["tp_conc"]:
            ma, sa, ca = C.cpu_sample(fleet.master_pid), C.cpu_sample(worker), os.times()
            r = asyncio.run(_http_load(fleet.api_port, body, conc, cfg["tp_max_requests"], cfg["tp_time_s"]))
            md, sd, cb = C.cpu_delta(ma, C.cpu_sample(fleet.master_pid)), C.cpu_delta(sa, C.cpu_sample(worker)), os.times()
            n = max(1, r["done"])
            out["http"][conc] = {
                "requests": r["done"], "errors": r["errors"], "wall_s": r["wall_s"], "rps": r["done"] / r["wall_s"],
                "p50": C.pct(r["lat"], 50), "p99": C.pct(r["lat"], 99),
                "master_cpu_per_req": md["cpu_s"] / n, "master_cpu_per_req_stat": md["cpu_s_stat"] / n,
                "master_util": md["cpu_s"] / md["wall_s"], "stage_cpu_per_req": sd["cpu_s"] / n,
                "client_cpu_per_req": ((cb.user - ca.user) + (cb.system - ca.system)) / n,
            }
            p = out["http"][conc]
            C.log(f"HTTP conc {conc}: {p['rps']:.0f} req/s, p50 {us(p['p50'])} us, master "
                  f"{us(p['master_cpu_per_req'])} us CPU/req (stat: {us(p['master_cpu_per_req_stat'])}), "
                  f"stage {us(p['stage_cpu_per_req'])} us, client {us(p['client_cpu_per_req'])} us, "
                  f"errors {p['errors']}")
        orch_run(fleet, "x" * 64, cfg["tp_warmup"], 4, 10.0)
        for conc in cfg["tp_conc"]:
            sa = C.cpu_sample(worker)
            r = orch_run(fleet, "x" * 64, cfg["tp_max_requests"], conc, cfg["tp_time_s"])
            sd = C.cpu_delta(sa, C.cpu_sample(worker))
            n = max(1, len(r["latencies"]))
            out["orch"][conc] = {
                "requests": len(r["latencies"]), "errors": r["errors"], "wall_s": r["wall_s"],
                "rps": len(r["latencies"]) / r["wall_s"], "p50": C.pct(r["latencies"], 50),
                "p99": C.pct(r["latencies"], 99), "master_cpu_per_req": r["master_cpu"]["cpu_s"] / n,
                "master_cpu_per_req_stat": r["master_cpu"]["cpu_s_stat"] / n,
                "master_util": r["master_cpu"]["cpu_s"] / r["master_cpu"]["wall_s"],
                "stage_cpu_per_req": sd["cpu_s"] / n,
            }
            p = out["orch"][conc]
            C.log(f"orchestrator conc {conc}: {p['rps']:.0f} req/s, p50 {us(p['p50'])} us, master "
                  f"{us(p['master_cpu_per_req'])} us CPU/req, stage {us(p['stage_cpu_per_req'])} us, "
                  f"errors {p['errors']}")
    return out


# ---------------------------------------------------------------- 3. bulk


def reps_for(cfg: dict, size: int) -> int:
    return max(cfg["bulk_min_reps"], min(cfg["bulk_max_reps"], cfg["bulk_budget"] // size))


def bulk_fleet(kind: str, profile_dir: Path | None = None, env: dict[str, str] | None = None,
               spec: dict[str, Any] | None = PLAIN) -> C.Fleet:
    producer = {"name": "producer", "type": "python", "entrypoint": "bench.fns:produce"}
    consumer = {"name": "consumer", "type": "python", "entrypoint": "bench.fns:consume",
                "inputs": ["producer"], "finalOutput": "text"}
    if kind == "shm":
        consumer["colocateWith"] = "producer"
    fleet = C.Fleet(f"bulk-{kind}", [producer, consumer], profile_dir, env, spec)
    fleet.start_master()
    if kind == "shm":
        fleet.start_pod("colo", "producer", "consumer")
    else:
        fleet.start_pod("prod", "producer")
        fleet.start_pod("cons", "consumer")
    fleet.wait_ready()
    return fleet


def bulk_requests(fleet: C.Fleet, size: int, chunk: int, reps: int, time_s: float, warmup: bool = True,
                  pids: dict[str, list[int]] | None = None, hold: float = 0.0) -> dict[str, Any]:
    """reps requests of `size` bytes through the producer -> consumer pipeline; times and CPU deltas (sums).
    hold: seconds the producer keeps each request before it returns."""
    client = C.HttpClient(fleet.api_port)
    body = json.dumps({"model": "bench", "prompt": json.dumps({"n": size, "chunk": chunk, "hold": hold})}).encode()
    req = C.request_bytes("/v1/completions", body, fleet.api_port)

    def one() -> tuple[float, dict]:
        t0 = time.perf_counter()
        status, resp = client.send_raw(req)
        t = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"bulk request of {size} B failed: {status} {resp[:300]!r}")
        d = json.loads(json.loads(resp)["choices"][0]["text"])
        if d["n"] != size:
            raise RuntimeError(f"the consumer got {d['n']} bytes, not {size}")
        return t, d

    if warmup:
        one()  # the producer makes its buffer once per size
    pids = pids or {pod: fleet.worker_pids(pod) for pod in fleet.pod_stages}
    m_bytes = fleet.metric("omnifleet_master_output_bytes_total")
    m0 = C.cpu_sample(fleet.master_pid)
    th0 = {pod: [C.thread_times(p) for p in ps] for pod, ps in pids.items()}
    e2e, boundary, transfer, touch = [], [], [], []
    kind = ""
    deadline = time.monotonic() + time_s
    for _ in range(reps):
        if time.monotonic() > deadline and len(e2e) >= 2:
            break
        t, d = one()
        e2e.append(t)
        boundary.append(d["t1"] - d["t0"])
        transfer.append(d["t_in"] - d["t0"])
        touch.append(d["t1"] - d["t_in"])
        kind = d["type"]
    m1 = C.cpu_sample(fleet.master_pid)
    threads = {pod: [C.thread_delta(a, C.thread_times(p)) for a, p in zip(th0[pod], ps)] for pod, ps in pids.items()}
    m_bytes = fleet.metric("omnifleet_master_output_bytes_total") - m_bytes
    client.close()
    return {"reps": len(e2e), "e2e": e2e, "boundary": boundary, "transfer": transfer, "touch": touch,
            "master": C.cpu_delta(m0, m1), "master_bytes": m_bytes, "threads": threads, "type": kind}


def merge_bulk(acc: dict | None, r: dict) -> dict:
    if acc is None:
        return r
    for k in ("e2e", "boundary", "transfer", "touch"):
        acc[k] += r[k]
    acc["reps"] += r["reps"]
    acc["master_bytes"] += r["master_bytes"]
    acc["master"] = {k: acc["master"][k] + v for k, v in r["master"].items()}
    for pod, workers in r["threads"].items():
        for i, threads in enumerate(workers):
            mine = acc["threads"][pod][i]
            for name, d in threads.items():
                slot = mine.setdefault(name, {k: 0 for k in d})
                for k, v in d.items():
                    slot[k] += v
    return acc


def master_idle_rates(fleets: dict[str, C.Fleet], seconds: float = 2.0) -> dict[str, float]:
    """CPU seconds per second each idle master spends (heartbeats), to subtract from per-request CPU."""
    a = {k: C.cpu_sample(f.master_pid) for k, f in fleets.items()}
    time.sleep(seconds)
    out = {}
    for k, f in fleets.items():
        d = C.cpu_delta(a[k], C.cpu_sample(f.master_pid))
        out[k] = d["cpu_s"] / d["wall_s"]
    return out


# (path, fleet, producer splits into 4 MiB frames, label); the goals are for "tcp" and "shm"
BULK_PATHS = (
    ("tcp", "tcp", 0, "two pods (TCP)"),
    ("shm", "shm", 0, "one pod (shm)"),
    ("tcp_curve", "tcp_curve", 0, "two pods, CurveZMQ data ports (the default)"),
    ("tcp_chunked", "tcp", 1, "two pods, 4 MiB frames"),
    ("tcp_malloc", "tcp_malloc", 0, "two pods, malloc keeps freed memory"),
    ("tcp_malloc_chunked", "tcp_malloc", 1, "two pods, 4 MiB frames, malloc keeps freed memory"),
)
# An experiment, not the runtime's setting: glibc malloc never uses mmap and never trims, so a receiver's
# freed frame buffers are reused instead of being unmapped and faulted in again for the next large frame.
# One arena (the receiving ZMQ I/O thread's allocations go to the main heap: a thread arena cannot hold a
# frame above ~64 MiB and falls back to mmap whatever the other settings say), no mmap, no trimming.
MALLOC_KEEP = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def memcpy_rate(size: int, reps: int) -> list[float]:
    """Seconds per copy of `size` bytes into a resident buffer in this process: the limit of a one-copy handoff."""
    src = b"\x5a" * size
    dst = memoryview(bytearray(b"\x01" * size))  # (bytearray[:] = bytes would copy src to a temporary first)
    out = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        dst[:] = src
        out.append(time.perf_counter() - t0)
    return out[1:]


def master_cpu_under_load(fleet: C.Fleet, pids: dict[str, list[int]], n: int, bg_size: int) -> dict[str, Any]:
    """1 KiB requests while other processes stream bg_size-byte messages over raw TCP: the master's CPU per
    request when the machine's caches and memory bus are as busy as during a bulk run, payload or not."""
    import threading

    port = C.free_port()
    stop = threading.Event()
    with Server("tcp-sink", str(port), str(bg_size)):
        client = TcpClient(port)
        buf = b"\x5a" * bg_size
        moved = [0]

        def background() -> None:
            for _ in range(10_000):
                if stop.is_set():
                    break
                client.one_way(buf)
                moved[0] += bg_size

        t = threading.Thread(target=background, daemon=True)
        t.start()
        time.sleep(0.2)
        try:
            r = bulk_requests(fleet, KIB, 0, n, 30.0, warmup=True, pids=pids)
        finally:
            stop.set()
            t.join(timeout=60)
        client.close()
    r["background_bytes"] = moved[0]
    return r


def run_bulk(cfg: dict) -> dict[str, Any]:
    """The raw peers and both fleets run side by side; per size, rounds interleave the raw links and the paths."""
    C.log("== bulk transfer between two stages")
    sizes, rounds = cfg["bulk_sizes"], cfg["bulk_rounds"]
    raw: dict[int, dict[str, list[float]]] = {s: {"tcp": [], "zmq": [], "zmq_chunked": []} for s in sizes}
    acc: dict[str, dict[int, Any]] = {kind: {} for kind, *_ in BULK_PATHS}
    memcpy: dict[int, list[float]] = {}
    fleets: dict[str, C.Fleet] = {}
    servers: list[Server] = []
    try:
        fleets = {"tcp": bulk_fleet("tcp"), "shm": bulk_fleet("shm"), "tcp_curve": bulk_fleet("tcp", spec=None),
                  "tcp_malloc": bulk_fleet("tcp", env=MALLOC_KEEP)}
        pids = {k: {pod: f.worker_pids(pod) for pod in f.pod_stages} for k, f in fleets.items()}
        idle = master_idle_rates(fleets)
        tport, zport, zack = C.free_port(), C.free_port(), C.free_port()
        servers.append(Server("tcp-sink", str(tport), str(max(sizes))))
        servers.append(Server("zmq-sink", str(zport), str(zack)))
        tcp, zmq_client = TcpClient(tport), ZmqPushClient(zport, zack)
        for size in sizes:
            buf = b"\x5a" * size
            per_round = max(1, -(-reps_for(cfg, size) // rounds))
            chunked = size > cfg["chunk"]
            tcp.one_way(buf)
            zmq_client.one_way(buf)
            memcpy[size] = memcpy_rate(size, min(20, reps_for(cfg, size)))
            for r in range(rounds):
                raw[size]["tcp"] += [tcp.one_way(buf) for _ in range(per_round)]
                raw[size]["zmq"] += [zmq_client.one_way(buf) for _ in range(per_round)]
                if chunked:
                    raw[size]["zmq_chunked"] += [zmq_client.one_way(buf, cfg["chunk"]) for _ in range(per_round)]
                for kind, fleet_kind, chunk, _ in BULK_PATHS:
                    if chunk and not chunked:
                        continue
                    res = bulk_requests(fleets[fleet_kind], size, cfg["chunk"] if chunk else 0, per_round,
                                        cfg["bulk_time_s"] / rounds, warmup=r == 0, pids=pids[fleet_kind])
                    acc[kind][size] = merge_bulk(acc[kind].get(size), res)
            del buf
            rt = C.pct(raw[size]["tcp"], 50)
            C.log(f"{C.fmt_size(size)}: raw TCP {size / rt / 1e9:.2f} GB/s, raw ZMQ one frame "
                  f"{size / C.pct(raw[size]['zmq'], 50) / 1e9:.2f} GB/s; boundary " + ", ".join(
                      f"{kind} {size / C.pct(acc[kind][size]['boundary'], 50) / 1e9:.2f} GB/s "
                      f"({rt / C.pct(acc[kind][size]['boundary'], 50):.2f}x)"
                      for kind, *_ in BULK_PATHS if size in acc[kind]))
        tcp.close()
        zmq_client.close()
        bg = max(sizes)
        C.log(f"control: 1 KiB requests while {C.fmt_size(bg)} messages stream over raw TCP elsewhere")
        control = master_cpu_under_load(fleets["tcp"], pids["tcp"], cfg["bulk_max_reps"], bg)
        hold = C.pct(acc["tcp"][bg]["e2e"], 50)
        C.log(f"control: 1 KiB requests the producer holds {hold * 1e3:.0f} ms, as long as a {C.fmt_size(bg)} one")
        held = bulk_requests(fleets["tcp"], KIB, 0, cfg["bulk_max_reps"], cfg["bulk_time_s"] / 2, pids=pids["tcp"],
                             hold=hold)
        wake = wake_cost(hold, cfg["wake_reps"])
    finally:
        for srv in servers:
            srv.close()
        for f in fleets.values():
            f.stop()
    paths: dict[str, dict[int, Any]] = {}
    for ctl in (control, held):
        m = ctl["master"]
        ctl["master_cpu_per_req_idle_corrected"] = (m["cpu_s"] - idle["tcp"] * m["wall_s"]) / ctl["reps"]
        ctl["master_bytes_per_req"] = ctl["master_bytes"] / ctl["reps"]
    held["hold_s"] = hold
    wake["sleep_s"] = hold
    C.log(f"control: a fixed piece of Python work, {us(C.pct(wake['cold'], 50))} us CPU after sleeping "
          f"{hold * 1e3:.0f} ms, {us(C.pct(wake['warm'], 50))} us right after the last")
    C.log(f"control: master {us(control['master_cpu_per_req_idle_corrected'])} us CPU per 1 KiB request "
          f"(idle-corrected) under background traffic, {us(held['master_cpu_per_req_idle_corrected'])} us per "
          f"1 KiB request held {hold * 1e3:.0f} ms")
    for kind, fleet_kind, *_ in BULK_PATHS:
        paths[kind] = {}
        for size, r in acc[kind].items():
            n = r["reps"]
            m = r["master"]
            r["master_cpu_per_req"] = m["cpu_s"] / n
            r["master_cpu_per_req_idle_corrected"] = (m["cpu_s"] - idle[fleet_kind] * m["wall_s"]) / n
            r["master_bytes_per_req"] = r["master_bytes"] / n
            r["threads_per_req"] = {pod: [{name: {k: v / n for k, v in d.items()} for name, d in t.items()}
                                          for t in ts] for pod, ts in r["threads"].items()}
            paths[kind][size] = r
            C.log(f"{kind} {C.fmt_size(size)}: master {us(r['master_cpu_per_req'])} us CPU/req "
                  f"({us(r['master_cpu_per_req_idle_corrected'])} idle-corrected), "
                  f"{r['master_bytes_per_req']:.0f} B/req to the master")
    return {"raw": raw, "memcpy": memcpy, "paths": paths, "master_idle_cpu_per_s": idle,
            "control_1KiB_under_load": {k: v for k, v in control.items() if k not in ("threads",)},
            "control_1KiB_held": {k: v for k, v in held.items() if k not in ("threads",)}, "control_wake": wake,
            "control_background": C.fmt_size(bg)}


# ---------------------------------------------------------------- profiles


def master_profile_counts(path: Path, n: int) -> dict[str, float]:
    """Per request, from a master's profile: CPU under the profiler, Python calls, event-loop iterations, and
    messages handled on the control socket."""
    import pstats

    st = pstats.Stats(str(path))
    count = lambda file, name: sum(v[1] for k, v in st.stats.items() if k[0].endswith(file) and k[2] == name)  # noqa: E731
    return {"cpu_us": st.total_tt / n * 1e6, "calls": sum(v[1] for v in st.stats.values()) / n,
            "loop_iterations": count("base_events.py", "_run_once") / n,
            "messages_handled": count("omnifleet_runtime/master.py", "_handle") / n}


def run_profiles(cfg: dict, which: list[str], out_dir: Path, stem: str) -> dict[str, str]:
    """cProfile (main-thread CPU time) of the master and the stage workers while repeating a scenario."""
    out: dict[str, str] = {}
    for what in which:
        pdir = out_dir / f"{stem}-profiles" / what
        pdir.mkdir(parents=True, exist_ok=True)
        for p in pdir.glob("**/*.prof"):
            p.unlink()
        C.log(f"== profiling: {what}")
        if what == "per-hop":
            with start_chain(3, "noop", pdir) as fleet:
                names = fleet.runtime_pids()
                http_sequential(fleet, "x" * 64, 50, 10, 30.0)
                fleet.reset_profiles()
                n = len(http_sequential(fleet, "x" * 64, cfg["prof_n"], 0, 60.0)["lat"])
                files = fleet.dump_profiles(pdir)
            text = C.profile_summary(files, names, n)
        else:
            # The same fleet at a small and a large payload: what the master does per request at each.
            rows, text = [], ""
            with bulk_fleet("tcp", pdir) as fleet:
                names = fleet.runtime_pids()
                hold = 0.0
                # Last, 1 KiB requests the producer holds as long as a large one took: the same work per
                # request as 1 KiB, done by a master that waited in between.
                for size, label in ((MIB, ""), (cfg["prof_bulk_size"], ""), (KIB, "held")):
                    bulk_requests(fleet, size, 0, 2, 30.0, hold=hold)
                    fleet.reset_profiles()
                    r = bulk_requests(fleet, size, 0, reps_for(cfg, cfg["prof_bulk_size"] if label else size), 60.0,
                                      warmup=False, hold=hold)
                    files = fleet.dump_profiles(pdir)
                    sub = pdir / (C.fmt_size(size).replace(" ", "") + label)
                    sub.mkdir(exist_ok=True)
                    moved = []
                    for f in files:
                        f.replace(sub / f.name)
                        moved.append(sub / f.name)
                    m = master_profile_counts(next(f for f in moved if f.name.startswith("master")), r["reps"])
                    rows.append([C.fmt_size(size) + (f", held {hold * 1e3:.0f} ms" if label else ""), r["reps"],
                                 f"{C.pct(r['e2e'], 50) * 1e3:.1f}", f"{m['messages_handled']:.2f}",
                                 f"{m['loop_iterations']:.1f}", f"{m['calls']:.0f}", f"{m['cpu_us']:.0f}",
                                 f"{m['cpu_us'] / m['calls']:.2f}", f"{r['master']['cpu_s'] / r['reps'] * 1e6:.0f}"])
                    if size == cfg["prof_bulk_size"]:
                        text = C.profile_summary(moved, names, r["reps"])
                        hold = C.pct(r["e2e"], 50)
            text = ("The master, per request, at a small and a large payload, and at 1 KiB held by the producer as "
                    "long as the large one's p50 (same fleet; heartbeats the master handles meanwhile count in):"
                    "\n\n" + C.md_table(
                        ["payload", "requests", "request p50 (ms)", "control messages handled", "event-loop iterations",
                         "Python calls", "main-thread CPU under the profiler (us)", "us per Python call",
                         "CPU, all threads (us)"], rows)
                    + f"\n\nProfiles at {C.fmt_size(cfg['prof_bulk_size'])}:\n\n" + text)
        out[what] = text
        (pdir / "summary.txt").write_text(text + "\n")
        C.log(f"profile of {what}:\n{text}")
    return out


# ---------------------------------------------------------------- report


def headline(lat: dict | None, bulk: dict | None, cfg: dict) -> dict[str, Any]:
    h: dict[str, Any] = {}
    if lat:
        size = min(cfg["lat_sizes"])
        if "noop" in lat["per_hop"]:
            ph = lat["per_hop"]["noop"][size]
            h["per_hop_http_over_raw_zmq_rtt"] = round(ph["http_ratio"], 3)
            h["per_hop_orch_over_raw_zmq_rtt"] = round(ph["orch_ratio"], 3)
            h["per_hop_http_us"] = round(ph["http_per_hop"] * 1e6, 1)
            h["raw_zmq_rtt_p50_us"] = round(ph["raw_rtt_p50"] * 1e6, 1)
        if "anoop" in lat["per_hop"]:
            h["per_hop_async_stage_http_over_raw_zmq_rtt"] = round(lat["per_hop"]["anoop"][size]["http_ratio"], 3)
        raw = lat["rtt"][size]["sync"]["p50"]
        for n in (1, 3):
            r = lat["runs"].get(f"{n}xnoop", {}).get(size)
            if r:
                h[f"e2e_{n}stage_http_p50_over_raw_zmq_rtt"] = round(r["http"]["p50"] / raw, 3)
    if bulk:
        big = [s for s in cfg["bulk_sizes"] if s >= 16 * MIB]
        for kind, *_ in BULK_PATHS:
            ratios = {s: C.pct(bulk["raw"][s]["tcp"], 50) / C.pct(bulk["paths"][kind][s]["boundary"], 50)
                      for s in big if s in bulk["paths"][kind]}
            if ratios:
                h[f"bulk_{kind}_over_raw_tcp_min_ge_16MiB"] = round(min(ratios.values()), 3)
                for s, v in ratios.items():
                    h[f"bulk_{kind}_over_raw_tcp_{C.fmt_size(s).replace(' ', '')}"] = round(v, 3)
        p = bulk["paths"]["tcp"]
        lo, hi = min(p), max(p)
        name = f"{C.fmt_size(hi).replace(' ', '')}_over_{C.fmt_size(lo).replace(' ', '')}"
        h[f"master_cpu_per_req_tcp_{name}"] = round(
            p[hi]["master_cpu_per_req_idle_corrected"] / p[lo]["master_cpu_per_req_idle_corrected"], 3)
        ctl = bulk["control_1KiB_under_load"]["master_cpu_per_req_idle_corrected"]
        h[f"master_cpu_per_req_tcp_{C.fmt_size(hi).replace(' ', '')}_over_1KiB_under_same_memory_traffic"] = round(
            p[hi]["master_cpu_per_req_idle_corrected"] / ctl, 3)
        if "control_1KiB_held" in bulk:  # runs before it had none
            held = bulk["control_1KiB_held"]["master_cpu_per_req_idle_corrected"]
            h[f"master_cpu_per_req_tcp_{C.fmt_size(hi).replace(' ', '')}_over_1KiB_held_as_long"] = round(
                p[hi]["master_cpu_per_req_idle_corrected"] / held, 3)
            h["master_cpu_per_req_tcp_1KiB_held_over_1KiB"] = round(
                held / p[lo]["master_cpu_per_req_idle_corrected"], 3)
        if "control_wake" in bulk:  # runs before it had none
            wake = bulk["control_wake"]
            h["python_work_cpu_after_sleeping_as_long_over_not"] = round(C.pct(wake["cold"], 50) /
                                                                         C.pct(wake["warm"], 50), 3)
        h["master_bytes_per_req_max_any_path"] = round(max(r["master_bytes_per_req"] for kind in bulk["paths"]
                                                           for r in bulk["paths"][kind].values()))
        h["master_bytes_per_req_min_any_path"] = round(min(r["master_bytes_per_req"] for kind in bulk["paths"]
                                                           for r in bulk["paths"][kind].values()))
    return h


def plots(res: dict, out_dir: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    lat, tp, bulk = res.get("latency"), res.get("throughput"), res.get("bulk")
    if lat:
        size = min(lat["rtt"])
        fig, ax = plt.subplots(figsize=(7, 4.2))
        fns = sorted({k.split("x")[1] for k in lat["runs"]})
        color = iter(f"C{i}" for i in range(10))
        for fn in fns:
            keys = sorted((k for k in lat["runs"] if k.endswith("x" + fn)), key=lambda k: int(k.split("x")[0]))
            xs = [int(k.split("x")[0]) for k in keys]
            for path, style in (("http", "-o"), ("orch", "--s")):
                c = next(color)
                ax.plot(xs, [lat["runs"][k][size][path]["p50"] * 1e6 for k in keys], style, color=c,
                        label=f"{'HTTP' if path == 'http' else 'orchestrator, no HTTP'}, {fn} stages: p50")
                ax.plot(xs, [lat["runs"][k][size][path]["p99"] * 1e6 for k in keys], style, color=c, alpha=0.3,
                        label="... p99")
        raw = lat["rtt"][size]["sync"]
        ax.axhline(raw["p50"] * 1e6, color="k", lw=1, label="raw ZMQ RTT p50")
        ax.axhline(raw["p99"] * 1e6, color="k", lw=1, ls=":", label="raw ZMQ RTT p99")
        ax.set_xlabel("stages in the pipeline (no-op python)")
        ax.set_ylabel(f"request latency, {size} B message (us)")
        ax.set_xticks([1, 2, 3])
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, ncol=2)
        ax.set_title("Latency by number of stages")
        fig.tight_layout()
        files.append(f"{stem}-latency.png")
        fig.savefig(out_dir / files[-1], dpi=110)
        plt.close(fig)
    if tp:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        ax2 = ax.twinx()
        for path, style in (("http", "-o"), ("orch", "--s")):
            concs = sorted(tp[path], key=int)
            label = "HTTP" if path == "http" else "orchestrator, no HTTP"
            ax.plot(concs, [tp[path][c]["rps"] for c in concs], style, color="C0", label=f"req/s ({label})")
            ax2.plot(concs, [tp[path][c]["master_cpu_per_req"] * 1e6 for c in concs], style, color="C3",
                     label=f"master CPU/req ({label})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("requests/s", color="C0")
        ax2.set_ylabel("master CPU per request (us)", color="C3")
        ax.set_ylim(bottom=0)
        ax2.set_ylim(bottom=0)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right")
        ax.set_title("Throughput through the master (1 no-op stage)")
        fig.tight_layout()
        files.append(f"{stem}-throughput.png")
        fig.savefig(out_dir / files[-1], dpi=110)
        plt.close(fig)
    if bulk:
        sizes = sorted(bulk["raw"], key=int)
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for key, label in (("tcp", "raw TCP (sendall/recv_into)"), ("zmq", "raw ZMQ PUSH/PULL, one frame"),
                           ("zmq_chunked", "raw ZMQ PUSH/PULL, 4 MiB frames")):
            ss = [s for s in sizes if bulk["raw"][s][key]]
            ax.plot(ss, [s / C.pct(bulk["raw"][s][key], 50) / 1e9 for s in ss], ":o", label=label)
        for kind, _, _, label in BULK_PATHS:
            ss = sorted(bulk["paths"][kind], key=int)
            ax.plot(ss, [s / C.pct(bulk["paths"][kind][s]["boundary"], 50) / 1e9 for s in ss], "-s",
                    label=f"stage boundary, {label}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([C.fmt_size(s) for s in sizes], fontsize=8)
        ax.set_ylabel("GB/s (p50)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6)
        ax.set_title("Bulk transfer between two stages")
        fig.tight_layout()
        files.append(f"{stem}-bulk.png")
        fig.savefig(out_dir / files[-1], dpi=110)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for kind, _, _, label in BULK_PATHS:
            ss = sorted(bulk["paths"][kind], key=int)
            ax.plot(ss, [bulk["paths"][kind][s]["master_cpu_per_req_idle_corrected"] * 1e6 for s in ss], "-o",
                    label=f"master CPU/request, {label}")
        ctl = bulk["control_1KiB_under_load"]["master_cpu_per_req_idle_corrected"] * 1e6
        ax.axhline(ctl, color="k", ls=":", lw=1,
                   label=f"1 KiB requests while {bulk['control_background']} messages stream elsewhere")
        if "control_1KiB_held" in bulk:
            ax.axhline(bulk["control_1KiB_held"]["master_cpu_per_req_idle_corrected"] * 1e6, color="k", ls="--",
                       lw=1, label=f"1 KiB requests held as long as a {bulk['control_background']} one")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([C.fmt_size(s) for s in sizes], fontsize=8)
        ax.set_ylabel("master CPU per request (us, idle-corrected)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        ax.set_title("Master CPU per request by payload size")
        fig.tight_layout()
        files.append(f"{stem}-master-cpu.png")
        fig.savefig(out_dir / files[-1], dpi=110)
        plt.close(fig)
    return files


def verdict(value: float, goal: float, higher_is_better: bool) -> str:
    ok = value >= goal if higher_is_better else value <= goal
    return "meets" if ok else "MISSES"


def report(res: dict, cfg: dict, quick: bool, files: list[str]) -> str:
    lat, tp, bulk, h = res.get("latency"), res.get("throughput"), res.get("bulk"), res["headline"]
    out = [f"# Data plane benchmark ({'quick' if quick else 'full'} run)", "",
           "Real processes on loopback: a master and stage pods as `omnifleet master|stage` run them "
           "(through `bench.wrapper`), a bench client, and raw peers for the limits, all measured in this run. "
           "`python -m bench.data_plane" + (" --quick" if quick else "") + "`. As the goals ask, the stages' "
           "data ports run without encryption (`dataPlane: plain-auth`; the control port is CurveZMQ all the "
           "same), and the default, CurveZMQ data ports, is measured beside them for bulk transfers.", "",
           C.facts_table(res["facts"]), "", "## Headlines", ""]
    rows = []
    if "per_hop_http_over_raw_zmq_rtt" in h:
        size = min(cfg["lat_sizes"])
        for k, label in (("per_hop_http_over_raw_zmq_rtt", "per hop via HTTP, (p50(3)-p50(1))/2"),
                         ("per_hop_orch_over_raw_zmq_rtt", "per hop via the orchestrator (no HTTP)"),
                         ("per_hop_async_stage_http_over_raw_zmq_rtt", "per hop via HTTP, async no-op stages")):
            if k in h:
                rows.append([f"{label}, {size} B, over raw ZMQ RTT p50", f"{h[k]:.2f}x", "<= 2x",
                             verdict(h[k], GOAL_PER_HOP, False)])
        for n in (1, 3):
            k = f"e2e_{n}stage_http_p50_over_raw_zmq_rtt"
            if k in h:
                rows.append([f"end to end, {n} stage(s), HTTP p50 over raw ZMQ RTT p50", f"{h[k]:.2f}x", "-", "-"])
    for kind, _, _, label in BULK_PATHS:
        k = f"bulk_{kind}_over_raw_tcp_min_ge_16MiB"
        if k in h:
            each = ", ".join(f"{kk.rsplit('_', 1)[1]}: {v:.2f}x" for kk, v in h.items()
                             if kk.startswith(f"bulk_{kind}_over_raw_tcp_") and "min" not in kk)
            goal = GOAL_BULK.get(kind)
            shown = label if goal or kind == "tcp_curve" else f"{label} (experiment)"
            rows.append([f"bulk boundary GB/s over raw TCP, {shown}, worst size "
                         f">= 16 MiB ({each})", f"{h[k]:.2f}x", f">= {goal:g}x" if goal else "-",
                         verdict(h[k], goal, True) if goal else "-"])
    for k, v in h.items():
        if k.endswith("_held_as_long"):
            rows.append(["control: master CPU/request, largest payload over 1 KiB requests that the producer holds "
                         "as long as a largest-payload request takes (if ~1x, the rise comes with the request's "
                         "duration, not its bytes)", f"{v:.2f}x", "-", "-"])
        elif k == "master_cpu_per_req_tcp_1KiB_held_over_1KiB":
            rows.append(["the same 1 KiB requests, held over not held: what the duration alone costs the master",
                         f"{v:.2f}x", "-", "-"])
        elif k == "python_work_cpu_after_sleeping_as_long_over_not":
            rows.append(["control: CPU of one fixed piece of Python work (JSON, in a process of its own) after "
                         "sleeping as long as a largest-payload request takes, over right after the last: what "
                         "waking up costs any process on this machine (the profiles' bulk table shows the master's "
                         "own: its Python calls per request, held or not)", f"{v:.2f}x", "-", "-"])
        elif k.startswith("master_cpu_per_req_") and "under" not in k:
            rows.append([f"master CPU/request, largest over smallest payload, two pods ({k.split('_', 5)[5]}), "
                         "idle-corrected", f"{v:.2f}x", f"<= {GOAL_MASTER_CPU_FLAT:g}x (flat: 1x)",
                         verdict(v, GOAL_MASTER_CPU_FLAT, False)])
        elif k.startswith("master_cpu_per_req_"):
            rows.append(["control: master CPU/request, largest payload over 1 KiB requests made while the same bulk "
                         "traffic flows between two other processes (if ~1x, cache and memory pressure explain the "
                         "rise; if not, the master does more per request)", f"{v:.2f}x", "-", "-"])
    if "master_bytes_per_req_max_any_path" in h:
        rows.append(["bytes of messages the master received per request, any payload size and path (min - max)",
                     f"{h['master_bytes_per_req_min_any_path']} - {h['master_bytes_per_req_max_any_path']} B",
                     "independent of payload", "meets" if h["master_bytes_per_req_max_any_path"] < 4096 else "MISSES"])
    out += [C.md_table(["what", "value", "goal", "verdict"], rows), ""]

    if lat:
        out += ["## 1. Per-hop overhead", "",
                "Sequential requests (concurrency 1). *HTTP*: `POST /v1/completions` with a minimal keep-alive "
                "client. *orch*: `POST /bench/orch` runs the requests inside the master "
                "(orchestrator.start -> Dispatch to every stage -> Data stage to stage -> Output and Done to "
                "the master), no HTTP per request. *raw RTT*: DEALER -> ROUTER (echo) -> DEALER, Python on both "
                "ends, blocking pyzmq (the limit); beside it the same with zmq.asyncio on both ends (as the "
                "runtime did before its own socket driver) and through that driver (`zsock`: plain sockets on "
                "asyncio through loop.add_reader, as the runtime does now). All pipelines "
                f"and echo servers ran side by side and were measured in {cfg['lat_rounds']} interleaved rounds "
                "(samples pooled), so the machine's drift hits them alike. `noop` stages are plain functions "
                "(the runtime runs them in a worker thread); `anoop` are coroutines.", ""]
        rows = []
        for size in cfg["lat_sizes"]:
            r = lat["rtt"][size]
            by_round = " / ".join(us(x) for x in lat["rtt_sync_p50_by_round"][size])
            rows.append([f"{size} B", us(r["sync"]["p50"]), us(r["sync"]["p99"]), by_round,
                         us(r["async"]["p50"]), us(r["async"]["p99"]), us(r["reader"]["p50"]), us(r["reader"]["p99"])])
        out += [C.md_table(["message", "raw RTT p50 (us)", "p99", "p50 by round", "zmq.asyncio RTT p50", "p99",
                            "zsock RTT p50", "p99"], rows), ""]
        rows = []
        for key, per_size in lat["runs"].items():
            for size, r in per_size.items():
                raw = lat["rtt"][size]["sync"]["p50"]
                cpu = r["http_cpu_per_req"]
                total = sum(v for k, v in cpu.items() if k != "client")
                rows.append([key.replace("x", " x "), f"{size} B", r["http"]["n"], us(r["http"]["p50"]),
                             us(r["http"]["p99"]), f"{r['http']['p50'] / raw:.1f}x", us(r["orch"]["p50"]),
                             us(r["orch"]["p99"]), f"{r['orch']['p50'] / raw:.1f}x", us(cpu["master"]),
                             " / ".join(us(v) for k, v in cpu.items() if k.startswith("stage")), us(total),
                             us(r["orch_cpu_per_req"]["master"])])
        out += [C.md_table(["stages", "message", "requests", "HTTP p50 (us)", "HTTP p99", "HTTP p50 / raw RTT",
                            "orch p50 (us)", "orch p99", "orch p50 / raw RTT", "master CPU/req, HTTP (us)",
                            "each stage's CPU/req (us)", "all runtime CPU/req (us)", "master CPU/req, orch (us)"],
                           rows), ""]
        rows = []
        for fn, per_size in lat["per_hop"].items():
            for size, r in per_size.items():
                rows.append([fn, f"{size} B", us(r["http_per_hop"]), f"{r['http_ratio']:.1f}x",
                             us(r["orch_per_hop"]), f"{r['orch_ratio']:.1f}x", us(r["raw_rtt_p50"]),
                             us(r["http_cpu_per_hop"])])
        out += ["Per hop = (p50(3 stages) - p50(1 stage)) / 2; CPU per hop = (CPU of all runtime processes per "
                "request with 3 stages - with 1 stage) / 2:", "",
                C.md_table(["stage fn", "message", "per hop HTTP (us)", "/ raw RTT", "per hop orch (us)",
                            "/ raw RTT", "raw RTT p50 (us)", "runtime CPU per hop (us)"], rows), ""]
        out += ["What the pieces of a hop cost on this machine (in-process, p50):", "",
                C.md_table(["piece", "us"], [[k, f"{v * 1e6:.1f}"] for k, v in lat["anatomy"].items()]), ""]
    if tp:
        out += ["## 2. Throughput through the master", "",
                f"One no-op stage; each point stops at {cfg['tp_max_requests']} requests or {cfg['tp_time_s']:g} s. "
                "Master CPU per request from the on-CPU ns of all its threads (/proc/PID/task/*/schedstat); the "
                "utime+stime of /proc/PID/stat (10 ms ticks) is shown beside it. The client (the bench process, "
                "one keep-alive connection per concurrent request) and the stage share the same 2 cores.", ""]
        rows = []
        for path in ("http", "orch"):
            for conc, p in tp[path].items():
                rows.append(["HTTP" if path == "http" else "orchestrator", conc, p["requests"], p["errors"],
                             f"{p['rps']:.0f}", f"{p['p50'] * 1e3:.2f}", f"{p['p99'] * 1e3:.2f}",
                             us(p["master_cpu_per_req"]), us(p["master_cpu_per_req_stat"]),
                             f"{p['master_util']:.2f}", us(p["stage_cpu_per_req"]),
                             us(p["client_cpu_per_req"]) if "client_cpu_per_req" in p else "-"])
        out += [C.md_table(["path", "concurrency", "requests", "errors", "req/s", "p50 (ms)", "p99 (ms)",
                            "master CPU/req (us)", "same from stat (us)", "master CPU util",
                            "stage CPU/req (us)", "client CPU/req (us)"], rows), ""]
    if bulk:
        out += ["## 3. Bulk transfer between stages", "",
                "Stage `producer` returns {t0, N bytes} (one buffer made once per size; or a list of 4 MiB views "
                "of it), stage `consumer` reads one byte of every page and returns a digest. *boundary* = "
                "consumer done touching - producer returned (CLOCK_MONOTONIC, one clock for all processes): "
                "encode, send, receive, decode, shm mapping, the hand-off to the callable, and the touch. "
                "*raw TCP*: plain sockets, sendall of the same bytes, recv_into one reused buffer, same touch, "
                "one way, between two processes. GB/s = 1e9 bytes/s at the p50 time.", ""]
        rows = []
        for size in sorted(bulk["raw"], key=int):
            raw = bulk["raw"][size]
            rt = C.pct(raw["tcp"], 50)
            rows.append([C.fmt_size(size), f"{size / rt / 1e9:.2f}", f"{size / C.pct(raw['zmq'], 50) / 1e9:.2f}",
                         f"{size / C.pct(raw['zmq_chunked'], 50) / 1e9:.2f}" if raw["zmq_chunked"] else "-",
                         f"{size / C.pct(bulk['memcpy'][size], 50) / 1e9:.2f}", len(raw["tcp"])])
        out += ["The limits (raw peers in two processes; memcpy in one):", "",
                C.md_table(["size", "raw TCP GB/s", "raw ZMQ PUSH/PULL, 1 frame GB/s", "same, 4 MiB frames GB/s",
                            "memcpy GB/s", "samples"], rows), ""]
        rows = []
        for size in sorted(bulk["raw"], key=int):
            rt = C.pct(bulk["raw"][size]["tcp"], 50)
            row = [C.fmt_size(size)]
            for kind, *_ in BULK_PATHS:
                r = bulk["paths"][kind].get(size)
                if r is None:
                    row.append("-")
                    continue
                bt = C.pct(r["boundary"], 50)
                row.append(f"{size / bt / 1e9:.2f} ({rt / bt:.2f}x)")
            r = bulk["paths"]["tcp"][size]
            row += [f"{C.pct(r['e2e'], 50) * 1e3:.2f}", r["reps"]]
            rows.append(row)
        out += ["Stage boundary GB/s at p50 (and its ratio to raw TCP of the same size, same run). The runtime as it "
                "is: *two pods (TCP)* (data ports without encryption, `plain-auth`, as the goals ask) and *one pod "
                "(shm)*, and beside them the default, CurveZMQ data ports; the other columns are experiments for the "
                "fixes proposed "
                "below: the producer returning a list of 4 MiB views (so the runtime sends 4 MiB frames), and glibc "
                f"malloc told to keep freed memory (`{' '.join(f'{k}={v}' for k, v in MALLOC_KEEP.items())}` in "
                "the stage processes' environment).", "",
                C.md_table(["size", *[label for *_, label in BULK_PATHS], "request p50, two pods (ms)", "requests"],
                           rows), ""]
        rows = []
        for size in sorted(bulk["raw"], key=int):
            row = [C.fmt_size(size)]
            for kind, *_ in BULK_PATHS[:3]:
                r = bulk["paths"][kind].get(size)
                row += ["-", "-"] if r is None else [us(r["master_cpu_per_req_idle_corrected"]),
                                                     f"{r['master_bytes_per_req']:.0f}"]
            rows.append(row)
        ctl = bulk["control_1KiB_under_load"]
        rows.append([f"1 KiB while {bulk['control_background']} messages stream between two other processes",
                     us(ctl["master_cpu_per_req_idle_corrected"]), f"{ctl['master_bytes_per_req']:.0f}",
                     "", "", "", ""])
        if "control_1KiB_held" in bulk:
            held = bulk["control_1KiB_held"]
            rows.append([f"1 KiB held {held['hold_s'] * 1e3:.0f} ms by the producer (a {bulk['control_background']} "
                         "request's p50)", us(held["master_cpu_per_req_idle_corrected"]),
                         f"{held['master_bytes_per_req']:.0f}", "", "", "", ""])
        idle = ", ".join(f"{k}: {v * 1e3:.2f} ms/s" for k, v in bulk["master_idle_cpu_per_s"].items())
        out += ["Master CPU per request (on-CPU ns of its threads, minus its idle rate measured on the same "
                f"fleet: {idle}) and the bytes of messages it received per request "
                "(`omnifleet_master_output_bytes_total`). The last rows are the controls: small requests while the "
                "same bulk traffic runs between two processes that are not in the pipeline, and small requests "
                "that last as long as the largest (the producer sleeps), with no traffic.", "",
                C.md_table(["size", "two pods: master CPU/req (us)", "bytes to master/req", "one pod (shm): CPU/req",
                            "bytes/req", "CurveZMQ: CPU/req", "bytes/req"], rows), ""]
        rows = []
        for kind, *_ in BULK_PATHS:
            for size, r in sorted(bulk["paths"][kind].items(), key=lambda kv: int(kv[0])):
                if int(size) < 16 * MIB:
                    continue
                for pod, workers in r["threads_per_req"].items():
                    for i, threads in enumerate(workers):
                        role = pod if len(workers) == 1 else ["producer", "consumer"][i] if i < 2 else f"w{i}"
                        for name, d in sorted(threads.items()):
                            if d["user_s"] + d["sys_s"] < 1e-4 and d["minflt"] < 10:
                                continue
                            rows.append([kind, C.fmt_size(int(size)), role, name, f"{d['user_s'] * 1e3:.2f}",
                                         f"{d['sys_s'] * 1e3:.2f}", f"{d['minflt']:.0f}"])
                rows.append([kind, C.fmt_size(int(size)), "(boundary p50)", "",
                             f"transfer {C.pct(r['transfer'], 50) * 1e3:.2f} ms",
                             f"touch {C.pct(r['touch'], 50) * 1e3:.2f} ms", ""])
        out += ["Where the stage processes spend it, per request, 16 MiB and up (utime/stime of each thread, 10 ms "
                "ticks summed over the requests; `ZMQbg/IO/N` is libzmq's I/O thread, `python`/`asyncio_N` the "
                "worker threads that run plain callables; minor page faults per request). *transfer* = producer "
                "returned -> consumer callable entered; *touch* = the consumer reading a byte per page:", "",
                C.md_table(["path", "size", "process", "thread", "user ms/req", "sys ms/req", "minor faults/req"],
                           rows), ""]
    if res.get("profiles"):
        out += ["## Profiles", "", "cProfile of the main thread (the asyncio loop) of each process, top functions by "
                "own time, while repeating the scenario; files under the `-profiles` folder.", ""]
        for what, text in res["profiles"].items():
            if "\n\nProfiles at " in text:
                table, rest = text.split("\n\nProfiles at ", 1)
                head, _, body = rest.partition("\n\n")
                out += [f"### {what}", "", table, "", f"Profiles at {head}", "", "```", body, "```", ""]
            else:
                out += [f"### {what}", "", "```", text, "```", ""]
    if files:
        out += ["## Plots", ""] + [f"![{f}]({f})" for f in files] + [""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.data_plane", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small counts: a smoke run well under 2 minutes")
    p.add_argument("--out", type=Path, default=C.RESULTS, help="results folder (default: %(default)s)")
    p.add_argument("--only", default="latency,throughput,bulk", help="comma-separated parts to run")
    p.add_argument("--runtime", default="worktree", help="the runtime to run: worktree (default) or a git ref "
                   "such as HEAD, exported to a temporary folder (when others are editing runtime/)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--profile", action="store_true", help="always profile (default: only when a goal is missed, "
                   "and never in --quick)")
    g.add_argument("--no-profile", action="store_true", help="never profile")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    parts = set(args.only.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{C.today()}-data-plane" + ("-quick" if args.quick else "")
    t_start = time.monotonic()
    C.use_runtime_ref(args.runtime)
    prov = C.provenance("data_plane", args.runtime)
    res: dict[str, Any] = {"facts": C.machine_facts(), "mode": "quick" if args.quick else "full",
                           "config": {k: v for k, v in cfg.items()}}
    C.log(f"machine: {res['facts']}")
    if "latency" in parts:
        res["latency"] = run_latency(cfg)
    if "throughput" in parts:
        res["throughput"] = run_throughput(cfg)
    if "bulk" in parts:
        res["bulk"] = run_bulk(cfg)
    res["headline"] = h = headline(res.get("latency"), res.get("bulk"), cfg)
    missed = []
    if h.get("per_hop_http_over_raw_zmq_rtt", 0) > GOAL_PER_HOP:
        missed.append("per-hop")
    master_cpu = [v for k, v in h.items() if k.startswith("master_cpu_per_req_tcp_") and k.endswith("_over_1KiB")
                  and "held" not in k]
    if any(h.get(f"bulk_{k}_over_raw_tcp_min_ge_16MiB", goal) < goal for k, goal in GOAL_BULK.items()) or any(
            v > GOAL_MASTER_CPU_FLAT for v in master_cpu):
        missed.append("bulk")  # its profile: what the master does per request, small, large and held
    if args.profile:
        missed = [w for w, part in (("per-hop", "latency"), ("bulk", "bulk")) if part in parts]
    if missed and not args.no_profile and (not args.quick or args.profile):
        res["profiles"] = run_profiles(cfg, missed, args.out, stem)
    res["elapsed_s"] = time.monotonic() - t_start
    files = plots(res, args.out, stem)
    (args.out / f"{stem}.md").write_text(report(res, cfg, args.quick, files))
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    latest = C.merge_latest(args.out, "data_plane_quick" if args.quick else "data_plane",
                            {**h, "report": f"{stem}.md", "machine": C.machine_line(res["facts"])}, prov)
    C.log(f"done in {res['elapsed_s']:.0f} s: {args.out / (stem + '.md')}, {latest}")
    print(json.dumps(h, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
