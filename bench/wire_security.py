"""What CurveZMQ costs on the data plane: `dataPlane: curve` against `plain-auth`, in one run.

    .venv/bin/python -m bench.wire_security [--quick] [--out DIR]

Both modes run side by side on real processes on loopback (a master and stage
pods, as `omnifleet master|stage` run them), in interleaved rounds so the drift
of a shared machine hits both alike. `plain-auth` is the data plane without
encryption (ZMQ PLAIN with the pipeline's token): the opt-out, and the limit
here. The control port uses CurveZMQ in both.

1. Bulk: a producer stage returns N bytes, a consumer stage in another pod
   touches every page (bench.fns:produce/consume); the boundary time is stamped
   inside the stages. One buffer, and the same bytes in 4 MiB frames. Both
   modes with `dataStreams` left out (the default, from the machine's cores:
   stripes.default_streams; a message of 8 MiB or more is split over that many
   connections, each on its own I/O thread), with 8, 4 and 1.
   Ratio = throughput(curve) / throughput(plain-auth), both as the default
   sets them, goal >= 0.5; also curve over plain-auth on one connection.
2. Per-hop latency: chains of 1 and 3 no-op stages; per hop =
   (p50(3 stages) - p50(1 stage)) / 2 over HTTP. Ratio = curve / plain-auth.

3. The ceiling: raw pyzmq PUSH -> PULL (no runtime), one process each side's
   thread, 4 MiB messages spread over K connections (K = 1, 2, 4, 8; a ZMQ
   context of K I/O threads on each side, connection i pinned to I/O thread i
   and connected after the previous handshake, as the runtime's links do),
   CURVE and plain: what parallel connections can give at most.
   `--ceiling-only` runs this part alone (written as <date>-curve-ceiling).

Writes bench/results/<date>-wire-security[-quick].md and .json, and merges the
headline ratios into bench/results/latest.json under "wire_security" (quick:
"wire_security_quick"). No timing assertions: it prints numbers and ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from . import common as C
from .data_plane import bulk_requests, chain, http_sequential, summarize

MIB = 1 << 20
MODES = ("curve", "plain-auth")
CEILING_K = (1, 2, 4, 8)
FULL = dict(sizes=[16 * MIB, 64 * MIB, 256 * MIB], chunk=4 * MIB, reps=6, rounds=3, time_s=30.0,
            lat_n=600, lat_warmup=20, lat_rounds=3, lat_time_s=20.0)
QUICK = dict(sizes=[16 * MIB, 64 * MIB], chunk=4 * MIB, reps=4, rounds=2, time_s=10.0,
             lat_n=150, lat_warmup=10, lat_rounds=2, lat_time_s=10.0)


DEFAULT = None  # spec.security.dataStreams left out: the stage picks from its cores


def spec(mode: str, streams: int | None = DEFAULT) -> dict[str, Any]:
    return {"security": {"dataPlane": mode, **({} if streams is None else {"dataStreams": streams})}}


def variant(mode: str, streams: int | None) -> str:
    return mode if streams is None else f"{mode}_{streams}"


def streams_text(k: int | None) -> str:
    if k is not None:
        return f"{k} stream(s)"
    from omnifleet_runtime.stripes import default_streams

    return f"default ({default_streams(True)} / {default_streams(False)})"


COUNTS = (DEFAULT, 8, 4, 1)  # the default first
VARIANTS = [(m, s) for s in COUNTS for m in MODES]


def bulk_fleet(mode: str, streams: int) -> C.Fleet:
    producer = {"name": "producer", "type": "python", "entrypoint": "bench.fns:produce"}
    consumer = {"name": "consumer", "type": "python", "entrypoint": "bench.fns:consume",
                "inputs": ["producer"], "finalOutput": "text"}
    fleet = C.Fleet(f"bulk-{variant(mode, streams)}", [producer, consumer], spec=spec(mode, streams))
    fleet.start_master()
    fleet.start_pod("prod", "producer")
    fleet.start_pod("cons", "consumer")
    fleet.wait_ready()
    return fleet


def chain_fleet(mode: str, n: int) -> C.Fleet:
    fleet = C.Fleet(f"{n}x-{mode}", chain(n, "anoop"), spec=spec(mode))
    fleet.start_master()
    for i in range(1, n + 1):
        fleet.start_pod(f"p{i}", f"s{i}")
    fleet.wait_ready()
    return fleet


def run_bulk(cfg: dict) -> dict[str, Any]:
    C.log(f"== bulk, two pods, curve vs plain-auth, streams {COUNTS}")
    names = [variant(m, s) for m, s in VARIANTS]
    samples = {v: {(s, c): [] for s in cfg["sizes"] for c in (0, cfg["chunk"])} for v in names}
    fleets = {}
    try:
        for m, s in VARIANTS:
            fleets[variant(m, s)] = bulk_fleet(m, s)
        for r in range(cfg["rounds"]):
            for size in cfg["sizes"]:
                for chunk in (0, cfg["chunk"]):
                    for v in names:
                        got = bulk_requests(fleets[v], size, chunk, cfg["reps"], cfg["time_s"])
                        samples[v][(size, chunk)] += got["boundary"]
            C.log(f"round {r + 1}/{cfg['rounds']} done")
    finally:
        for f in fleets.values():
            f.stop()
    rows = []
    for size in cfg["sizes"]:
        for chunk in (0, cfg["chunk"]):
            t = {v: C.pct(samples[v][(size, chunk)], 50) for v in names}
            rows.append({"size": size, "chunk": chunk, "reps": len(samples["curve"][(size, chunk)]),
                         **{f"{v}_p50_s": t[v] for v in names},
                         **{f"{v}_gib_s": size / t[v] / (1 << 30) for v in names},
                         "ratio": t["plain-auth"] / t["curve"],
                         **{f"ratio_{k}": t[variant("plain-auth", k)] / t[variant("curve", k)] for k in COUNTS
                            if k is not None},
                         "ratio_one_plain": t["plain-auth_1"] / t["curve"]})
            C.log(f"{C.fmt_size(size)} {'frames ' + C.fmt_size(chunk) if chunk else 'one buffer'}: "
                  + ", ".join(f"{v} {rows[-1][v + '_gib_s']:.2f}" for v in names)
                  + f" GiB/s; ratio {rows[-1]['ratio']:.2f}")
    return {"rows": rows}


def run_latency(cfg: dict) -> dict[str, Any]:
    C.log("== per-hop latency, curve vs plain-auth")
    lat = {(m, n): [] for m in MODES for n in (1, 3)}
    fleets = {}
    per_round = max(1, cfg["lat_n"] // cfg["lat_rounds"])
    try:
        for m in MODES:
            for n in (1, 3):
                fleets[(m, n)] = chain_fleet(m, n)
        for r in range(cfg["lat_rounds"]):
            for key, fleet in fleets.items():
                lat[key] += http_sequential(fleet, "x" * 64, per_round, cfg["lat_warmup"], cfg["lat_time_s"])["lat"]
            C.log(f"round {r + 1}/{cfg['lat_rounds']} done")
    finally:
        for f in fleets.values():
            f.stop()
    out = {f"{m}_{n}": summarize(lat[(m, n)]) for m in MODES for n in (1, 3)}
    hop = {m: (out[f"{m}_3"]["p50"] - out[f"{m}_1"]["p50"]) / 2 for m in MODES}
    out["per_hop_s"] = hop
    out["ratio"] = hop["curve"] / hop["plain-auth"]
    C.log(f"per hop: curve {hop['curve'] * 1e6:.0f} us, plain-auth {hop['plain-auth'] * 1e6:.0f} us, "
          f"ratio {out['ratio']:.2f}")
    return out


def raw_stream(mode: str, k: int, chunk: int, total: int) -> float:
    """GiB/s of `total` bytes as `chunk`-byte messages over k PUSH connections into one PULL (raw pyzmq)."""
    import threading

    import zmq

    keys = [zmq.curve_keypair(), zmq.curve_keypair()]  # server, client
    rctx, sctx = zmq.Context(io_threads=k), zmq.Context(io_threads=k)
    pull = rctx.socket(zmq.PULL)
    if mode == "curve":
        pull.curve_publickey, pull.curve_secretkey = keys[0]
        pull.curve_server = True
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    pushes = []
    for i in range(k):
        push = sctx.socket(zmq.PUSH)
        push.setsockopt(zmq.AFFINITY, 1 << i)
        if mode == "curve":
            push.curve_publickey, push.curve_secretkey = keys[1]
            push.curve_serverkey = keys[0][0]
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"x")  # up (handshake done) before the next connects: the receiver spreads them
        pull.recv()
        pushes.append(push)
    buf = memoryview(bytearray(b"\x5a" * chunk))

    def send() -> None:
        for j in range(total // chunk):
            pushes[j % k].send(buf, copy=False)

    sender = threading.Thread(target=send)
    t0 = time.perf_counter()
    sender.start()
    got = 0
    while got < total // chunk * chunk:
        got += len(pull.recv(copy=False))
    dt = time.perf_counter() - t0
    sender.join()
    for sock in (pull, *pushes):
        sock.close(linger=0)
    rctx.term()
    sctx.term()
    return total / dt / (1 << 30)


def run_ceiling(rounds: int = 3, chunk: int = 4 * MIB, total: int = 512 * MIB) -> dict[str, Any]:
    C.log("== raw CurveZMQ ceiling: K connections, K I/O threads")
    rates: dict[str, list[float]] = {f"{m}_k{k}": [] for m in ("curve", "plain") for k in CEILING_K}
    for r in range(rounds):
        for k in CEILING_K:
            for m in ("curve", "plain"):
                rates[f"{m}_k{k}"].append(raw_stream(m, k, chunk, total))
        C.log(f"round {r + 1}/{rounds}: " + ", ".join(f"{key} {v[-1]:.2f}" for key, v in rates.items()))
    med = {key: C.pct(v, 50) for key, v in rates.items()}
    return {"rounds": rates, "p50_gib_s": med, "chunk": chunk, "total": total,
            "best_curve_over_plain_k1": max(med[f"curve_k{k}"] for k in CEILING_K) / med["plain_k1"]}


def ceiling_table(ceil: dict[str, Any]) -> list[str]:
    med = ceil["p50_gib_s"]
    return ["## Ceiling: raw pyzmq, K connections (median of rounds)", "",
            f"{C.fmt_size(ceil['chunk'])} messages, {C.fmt_size(ceil['total'])} per measurement, K PUSH sockets "
            "round-robin into one PULL, a context of K I/O threads each side.", "",
            C.md_table(["K", "curve GiB/s", "plain GiB/s", "curve / plain (same K)", "curve / plain (K=1)"],
                       [[k, f"{med[f'curve_k{k}']:.2f}", f"{med[f'plain_k{k}']:.2f}",
                         f"{med[f'curve_k{k}'] / med[f'plain_k{k}']:.2f}",
                         f"{med[f'curve_k{k}'] / med['plain_k1']:.2f}"] for k in CEILING_K]),
            "", f"Best CurveZMQ over one plain connection: {ceil['best_curve_over_plain_k1']:.2f}x.", ""]


def report(res: dict, quick: bool) -> str:
    lines = [f"# Wire security benchmark{' (quick)' if quick else ''}, {C.today()}", "",
             "CurveZMQ (`dataPlane: curve`) against the data plane without encryption (`plain-auth`), same run, "
             "interleaved rounds. Two pods on loopback; control port CurveZMQ in both.", "",
             C.facts_table(C.machine_facts()), "", "## Bulk (boundary time, p50)", ""]
    lines.append("GiB/s as curve / plain-auth, and their ratio, per `dataStreams` (default: left out, the streams "
                 "the stages pick from this machine's cores, curve / plain-auth; the goal, >= 0.5, is for the "
                 "default); last: curve with the default over plain-auth on one connection.")
    lines.append("")
    lines.append(C.md_table(
        ["size", "framing", *[h for k in COUNTS for h in (streams_text(k), f"ratio, {k or 'default'}")],
         "curve default / plain-auth 1", "reps"],
        [[C.fmt_size(r["size"]), f"{C.fmt_size(r['chunk'])} frames" if r["chunk"] else "one buffer",
          *[c for k in COUNTS for c in (
              f"{r[variant('curve', k) + '_gib_s']:.2f} / {r[variant('plain-auth', k) + '_gib_s']:.2f}",
              f"{r['ratio' if k is None else f'ratio_{k}']:.2f}")],
          f"{r['ratio_one_plain']:.2f}", r["reps"]]
         for r in res["bulk"]["rows"]]))
    lat = res["latency"]
    lines += ["", "## Per-hop latency (HTTP, p50)", "", C.md_table(
        ["", "curve", "plain-auth"],
        [["1 stage", f"{lat['curve_1']['p50'] * 1e6:.0f} us", f"{lat['plain-auth_1']['p50'] * 1e6:.0f} us"],
         ["3 stages", f"{lat['curve_3']['p50'] * 1e6:.0f} us", f"{lat['plain-auth_3']['p50'] * 1e6:.0f} us"],
         ["per hop", f"{lat['per_hop_s']['curve'] * 1e6:.0f} us", f"{lat['per_hop_s']['plain-auth'] * 1e6:.0f} us"],
         ["ratio curve / plain-auth", f"{lat['ratio']:.2f}", ""]])]
    if res.get("ceiling"):
        lines += ["", *ceiling_table(res["ceiling"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wire_security", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small counts: a smoke run of a few minutes")
    p.add_argument("--out", type=Path, default=C.RESULTS, help="results folder (default: %(default)s)")
    p.add_argument("--ceiling-only", action="store_true",
                   help="only the raw pyzmq ceiling (K connections), written as <date>-curve-ceiling")
    args = p.parse_args(argv)
    if args.ceiling_only:
        facts, ceil = C.machine_facts(), run_ceiling()
        stem = f"{C.today()}-curve-ceiling"
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{stem}.json").write_text(json.dumps({"ceiling": ceil, "facts": facts}, indent=2) + "\n")
        text = "\n".join([f"# CurveZMQ ceiling, {C.today()}", "", "`python -m bench.wire_security --ceiling-only`",
                          "", C.facts_table(facts), "", *ceiling_table(ceil)])
        (args.out / f"{stem}.md").write_text(text)
        print(text)
        return 0
    cfg = QUICK if args.quick else FULL
    prov = C.provenance("wire_security")
    res = {"bulk": run_bulk(cfg), "latency": run_latency(cfg), "ceiling": run_ceiling(rounds=cfg["rounds"]),
           "config": cfg, "facts": C.machine_facts()}
    stem = f"{C.today()}-wire-security{'-quick' if args.quick else ''}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(report(res, args.quick))
    # Flat keys, one per size and framing, as bench/goals.py names them.
    by_size = {f"bulk_curve_over_plain{'_frames' if r['chunk'] else ''}_{r['size'] >> 20}MiB": round(r["ratio"], 3)
               for r in res["bulk"]["rows"]}
    C.merge_latest(args.out, "wire_security_quick" if args.quick else "wire_security",
                   {**by_size, "per_hop_curve_over_plain": round(res["latency"]["ratio"], 3),
                    "ceiling_best_curve_over_plain": round(res["ceiling"]["best_curve_over_plain_k1"], 3),
                    "report": f"{stem}.md"}, prov)
    print(report(res, args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
