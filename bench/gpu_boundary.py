"""A GPU tensor crossing a stage boundary, against the slowest link of its path, measured in the same run.

    python -m bench.gpu_boundary [--out DIR] [--sizes 1MiB,16MiB,256MiB,1GiB] [--frame 4MiB]
                                 [--max-iters N] [--time-budget S] [--dry-run-cpu]

Needs torch and the runtime's own packages (it runs master and stage
processes for the runtime's path; the raw limits need only torch, pyzmq,
numpy and msgspec). The raw part does not start the master or stage processes: the
boundary is two processes (this one, the producer, and a spawned consumer)
speaking the runtime's wire format, `wire.Data` messages whose payload holds a
`wire.Array` (its bytes a separate zero-copy frame), over a ZMQ PUSH -> PULL pair
on loopback, which is what a stage's data port is. Per message:

  producer: GPU tensor -> pinned host buffer (D2H) -> wire.encode -> send (copy=False)
  consumer: recv (copy=False) -> wire.decode -> copy into a pinned buffer -> GPU (H2D) -> synchronize

Modes, each timed one way (CLOCK_MONOTONIC: one clock for both processes) from
the producer starting its D2H to the consumer's H2D being complete:

- boundary, whole: the runtime as it is, one Array in one frame per message;
- boundary, pipelined: the tensor sent as `--frame`-sized chunks, one Data
  message each (the runtime's stream mode), D2H of later chunks overlapping the
  send of earlier ones and H2D of each chunk as it lands.

Links measured in the same run: pinned D2H and pinned H2D (in this process),
pageable H2D, and the wire alone (host bytes, producer -> consumer, whole and
chunked). Ratios: boundary GB/s over its slowest link's GB/s.

Co-located stages: a CUDA IPC handoff between two processes on the same GPU
(torch.multiprocessing passes the handle of a fresh tensor; the consumer
touches it: one element read back, and separately a full read `sum()`); ratio
"wire boundary time / IPC handoff time".

--dry-run-cpu runs all of it with CPU tensors and small sizes (no pinned memory,
IPC through shared memory) so the script's logic can be checked on a machine
without a GPU; its numbers mean nothing.

Through the runtime: a master and two torch stages (bench.torch_stages) as
real processes, co-located (the tensor goes by CUDA IPC handle) and in two
pods (host copy, the wire, H2D), data ports authenticated but not encrypted
(`dataPlane: plain-auth`); boundary = producer's tensor ready ->
consumer has read all of it. Ratios: over the raw IPC handoff with a full
read, and over the slowest link of the whole-frame path.

Writes <date>-gpu-boundary.md and .json into --out and merges the headline
ratios into latest.json there under "gpu_boundary" ("gpu_boundary_dry_run_cpu"
for dry runs).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))  # omnifleet_runtime.wire, without installing the package

from . import common as C  # noqa: E402  (standard library only at import time)

# consumer -> producer, per message: t_done - t0, a checksum, then first chunk decoded, last chunk decoded,
# and (whole mode) staging copy done, each - t0; and the seconds spent in staging copies.
ACK = struct.Struct("<dddddd")
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def parse_size(text: str) -> int:
    text = text.strip()
    for unit, k in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB), ("B", 1)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * k)
    return int(text)


def gbps(size: int, seconds: float) -> float:
    return size / seconds / 1e9 if seconds > 0 else float("nan")


# ---------------------------------------------------------------- the consumer process (wire path)


def _consumer_main(data_port: int, ack_port: int, device: str, max_size: int, ready) -> None:
    """PULL Data messages, decode them with the runtime's wire module, land them on the device; ack each."""
    import torch
    import zmq

    from omnifleet_runtime import wire

    warnings.filterwarnings("ignore", message=".*not writable.*")
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    # No intra-op thread pool: its spinning workers would compete with the ZMQ I/O thread for the cores.
    torch.set_num_threads(1)
    pinned = torch.empty(max_size, dtype=torch.uint8, pin_memory=cuda)
    pinned_mv = memoryview(pinned.numpy())
    dst = torch.empty(max_size, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream() if cuda else None
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.bind(f"tcp://127.0.0.1:{data_port}")
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.bind(f"tcp://127.0.0.1:{ack_port}")
    ready.set()
    first = staged_at = staging = 0.0
    while True:
        msg = wire.decode(pull.recv_multipart(copy=False))
        now = time.monotonic()
        p = msg.payload
        if p.get("stop"):
            break
        if p["offset"] == 0:
            first, staging = now, 0.0
        view = p["arr"].data
        off, n = p["offset"], len(view)
        if p["mode"] == "boundary":
            if p["h2d"] == "staged":  # the frame into pinned memory (one memcpy), then a pinned H2D
                t = time.monotonic()
                pinned_mv[off:off + n] = view
                staged_at = time.monotonic()
                staging += staged_at - t
                src = pinned[off:off + n]
            else:
                src = torch.frombuffer(view, dtype=torch.uint8)
            if cuda:
                with torch.cuda.stream(stream):
                    dst[off:off + n].copy_(src, non_blocking=True)
            else:
                dst[off:off + n].copy_(src)
        if p["last"]:
            if cuda:
                stream.synchronize()
            t0 = p["t0"]
            check = float(dst[p["total"] - 1].item()) if p["mode"] == "boundary" else float(view[-1])
            push.send(ACK.pack(time.monotonic() - t0, check, first - t0, now - t0,
                               (staged_at - t0) if staging else 0.0, staging))
    pull.close()
    push.close()
    ctx.term()


class WirePeer:
    """This process's end of the wire path: the producer."""

    def __init__(self, device: str, max_size: int, timeout_s: float = 120.0):
        import torch
        import torch.multiprocessing as mp
        import zmq

        from omnifleet_runtime import wire

        self.torch, self.wire, self.zmq = torch, wire, zmq
        self.device, self.cuda = device, device.startswith("cuda")
        data_port, ack_port = C.free_port(), C.free_port()
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        self.proc = ctx.Process(target=_consumer_main, args=(data_port, ack_port, device, max_size, ready),
                                daemon=True)
        self.proc.start()
        if not ready.wait(timeout_s):
            self.proc.kill()
            raise RuntimeError("the consumer process did not start")
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.linger = 0
        self.push.connect(f"tcp://127.0.0.1:{data_port}")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.linger = 0
        self.pull.rcvtimeo = int(timeout_s * 1000)
        self.pull.connect(f"tcp://127.0.0.1:{ack_port}")
        self.pinned = torch.empty(max_size, dtype=torch.uint8, pin_memory=self.cuda)
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.seq = 0

    def _send(self, mode: str, view: memoryview, offset: int, total: int, last: bool, t0: float,
              h2d: str = "staged") -> None:
        w = self.wire
        payload = {"mode": mode, "h2d": h2d, "t0": t0, "offset": offset, "total": total, "last": last,
                   "arr": w.Array("uint8", (len(view),), view)}
        self.seq += 1
        self.push.send_multipart(w.encode(w.Data("bench", 0, "producer", self.seq, payload)), copy=False)

    def _ack(self) -> tuple[float, ...]:
        return ACK.unpack(self.pull.recv())

    def wire_only(self, size: int, frame: int) -> float:
        """Host bytes (already in pinned memory) through wire + ZMQ to the consumer; one way, seconds."""
        view = memoryview(self.pinned.numpy())[:size]
        t0 = time.monotonic()
        step = frame or size
        for off in range(0, size, step):
            self._send("wire", view[off:off + step], off, size, off + step >= size, t0)
        return self._ack()[0]

    def boundary(self, x, frame: int, h2d: str = "staged") -> dict[str, float]:
        """x (on the device) to the consumer's device: pinned D2H, the wire, then (h2d) a copy into pinned memory
        and a pinned H2D ("staged") or an H2D straight from the received frame ("pageable"). One way, seconds,
        with the time each step ended (from the start)."""
        torch = self.torch
        size = x.numel()
        src = x.view(-1)
        host = self.pinned[:size]
        view = memoryview(self.pinned.numpy())[:size]
        t0 = time.monotonic()
        if not frame or frame >= size:
            host.copy_(src, non_blocking=self.cuda)
            if self.cuda:
                torch.cuda.current_stream().synchronize()
            d2h = time.monotonic()
            self._send("boundary", view, 0, size, True, t0, h2d)
        else:
            events = []
            if self.cuda:
                self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream) if self.cuda else _null():
                for off in range(0, size, frame):
                    host[off:off + frame].copy_(src[off:off + frame], non_blocking=self.cuda)
                    if self.cuda:
                        ev = torch.cuda.Event()
                        ev.record(self.stream)
                        events.append(ev)
            for i, off in enumerate(range(0, size, frame)):
                if self.cuda:
                    events[i].synchronize()
                self._send("boundary", view[off:off + frame], off, size, off + frame >= size, t0, h2d)
            d2h = time.monotonic()  # (pipelined: the last chunk's D2H done and all sends queued)
        sent = time.monotonic()
        total, check, first, last, staged, staging = self._ack()
        return {"total": total, "check": check, "d2h": d2h - t0, "sent": sent - t0, "first_recv": first,
                "last_recv": last, "staged": staged, "staging_s": staging}

    def close(self) -> None:
        w = self.wire
        try:
            self.push.send_multipart(w.encode(w.Data("bench", 0, "producer", 0, {"stop": True})))
        except self.zmq.ZMQError:
            pass
        self.proc.join(timeout=20)
        if self.proc.is_alive():
            self.proc.kill()
        self.push.close()
        self.pull.close()
        self.ctx.term()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------- CUDA IPC handoff


def _ipc_consumer(q, acks, device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    while True:
        item = q.get()
        if item is None:
            break
        x, t0, full = item
        if full:
            value = float(x.view(torch.int32).sum().item()) if x.numel() % 4 == 0 else float(x.sum().item())
        else:
            value = float(x[-1].item())
        acks.put((time.monotonic() - t0, value))
        del x


class IpcPeer:
    """A second process on the same device that receives tensors through torch.multiprocessing (CUDA IPC)."""

    def __init__(self, device: str):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.device = device
        self.q, self.acks = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_ipc_consumer, args=(self.q, self.acks, device), daemon=True)
        self.proc.start()

    def handoffs(self, size: int, iters: int, full: bool, timeout_s: float = 180.0) -> list[float]:
        """One-way seconds of handing a fresh device tensor over (handle passed; the consumer reads one element,
        or everything when full). The producer keeps each tensor until the consumer is done with it."""
        import torch

        out = []
        for i in range(iters):
            x = torch.full((size,), i % 200 + 1, dtype=torch.uint8, device=self.device)
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            self.q.put((x, time.monotonic(), full))
            dt, value = self.acks.get(timeout=timeout_s)
            out.append(dt)
            del x
        return out

    def close(self) -> None:
        self.q.put(None)
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


# ---------------------------------------------------------------- in-process links


def copy_rate(torch, src, dst, iters: int, cuda: bool) -> list[float]:
    out = []
    for _ in range(iters + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out[1:]


# ---------------------------------------------------------------- main


def iters_for(size: int, budget_bytes: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, budget_bytes // size))


def run(args) -> dict[str, Any]:
    import torch

    cpu = args.dry_run_cpu
    device = "cpu" if cpu else args.device
    cuda = not cpu
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; use --dry-run-cpu to check the script on a CPU")
    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    frame = parse_size(args.frame)
    deadline = time.monotonic() + args.time_budget
    from omnifleet_runtime import constants, wire

    facts = C.machine_facts()
    facts["wire"] = f"{os.path.relpath(wire.__file__, ROOT)} (protocol version {constants.PROTOCOL_VERSION})"
    res: dict[str, Any] = {"facts": facts, "device": device, "frame": frame, "sizes": {}, "skipped": []}
    if cuda:
        res["facts"]["gpu"] = torch.cuda.get_device_name(device)
        res["facts"]["cuda"] = torch.version.cuda
    C.log(f"machine: {res['facts']}")
    max_size = max(sizes)
    peer = WirePeer(device, max_size)
    ipc = IpcPeer(device)
    fleets = RuntimeFleets(device if cuda else "cpu")
    first_ipc = True
    try:
        for size in sizes:
            if time.monotonic() > deadline:
                res["skipped"].append(size)
                C.log(f"{C.fmt_size(size)}: skipped (time budget of {args.time_budget:g}s spent)")
                continue
            it = iters_for(size, parse_size(args.budget_bytes), args.min_iters, args.max_iters)
            r: dict[str, Any] = {"iters": it}
            x = torch.full((size,), 7, dtype=torch.uint8, device=device)
            host = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
            pageable = torch.empty(size, dtype=torch.uint8)
            dev2 = torch.empty(size, dtype=torch.uint8, device=device)
            r["d2h_pinned"] = copy_rate(torch, x, host, it, cuda)
            r["h2d_pinned"] = copy_rate(torch, host, dev2, it, cuda)
            r["h2d_pageable"] = copy_rate(torch, pageable, dev2, it, cuda)
            del pageable, dev2, host
            peer.wire_only(size, 0)  # warm-up (sockets, buffers)
            r["wire_whole"] = [peer.wire_only(size, 0) for _ in range(it)]
            r["wire_chunked"] = [peer.wire_only(size, frame) for _ in range(it)] if size > frame else r["wire_whole"]
            for h2d in ("staged", "pageable"):
                peer.boundary(x, 0, h2d)  # warm-up
                whole = [peer.boundary(x, 0, h2d) for _ in range(it)]
                piped = [peer.boundary(x, frame, h2d) for _ in range(it)] if size > frame else whole
                if any(b["check"] != 7.0 for b in whole + piped):
                    raise RuntimeError(f"the consumer's tensor does not hold the producer's bytes: {whole[:1]}")
                suffix = "" if h2d == "staged" else "_pageable"
                r["boundary_whole" + suffix] = [b["total"] for b in whole]
                r["boundary_pipelined" + suffix] = [b["total"] for b in piped]
                r["steps_whole" + suffix] = {k: C.pct([b[k] for b in whole], 50) for k in whole[0] if k != "check"}
                r["steps_pipelined" + suffix] = {k: C.pct([b[k] for b in piped], 50) for k in piped[0]
                                                 if k != "check"}
            del x
            ipc_iters = max(3, min(it, 20))
            touch = ipc.handoffs(size, ipc_iters + 1, full=False)
            r["ipc_first"] = touch[0]  # the run's first handoff also starts CUDA in the consumer
            r["ipc_first_is_process_first"] = first_ipc
            first_ipc = False
            r["ipc_touch"] = touch[1:]
            r["ipc_full_read"] = ipc.handoffs(size, ipc_iters + 1, full=True)[1:]
            r["runtime_colocated"], r["runtime_colocated_arrival"] = fleets.boundaries("colocated", size, ipc_iters)
            r["runtime_two_pods"], r["runtime_two_pods_arrival"] = fleets.boundaries("two_pods", size, min(it, 10))
            if cuda:
                torch.cuda.empty_cache()
            res["sizes"][size] = r
            p50 = {k: C.pct(v, 50) for k, v in r.items() if isinstance(v, list)}
            C.log(f"{C.fmt_size(size)} x{it}: D2H {gbps(size, p50['d2h_pinned']):.1f} GB/s, H2D "
                  f"{gbps(size, p50['h2d_pinned']):.1f}, wire {gbps(size, p50['wire_whole']):.2f} "
                  f"(chunked {gbps(size, p50['wire_chunked']):.2f}); boundary whole "
                  f"{gbps(size, p50['boundary_whole']):.2f} GB/s, pipelined {gbps(size, p50['boundary_pipelined']):.2f}; "
                  f"with pageable H2D: whole {gbps(size, p50['boundary_whole_pageable']):.2f}, pipelined "
                  f"{gbps(size, p50['boundary_pipelined_pageable']):.2f}; "
                  f"IPC {p50['ipc_touch'] * 1e3:.2f} ms (full read {p50['ipc_full_read'] * 1e3:.2f} ms, "
                  f"first of this size {r['ipc_first'] * 1e3:.1f} ms); through the runtime: co-located "
                  f"{p50['runtime_colocated'] * 1e3:.2f} ms, two pods {gbps(size, p50['runtime_two_pods']):.2f} GB/s")
    finally:
        peer.close()
        ipc.close()
        fleets.close()
    return res


class RuntimeFleets:
    """The runtime's own path: a master and torch stages (bench.torch_stages) as real processes, the
    producer and consumer co-located in one pod (CUDA IPC) and in two pods (host copy and the wire)."""

    def __init__(self, device: str):
        self.fleets: dict[str, C.Fleet] = {}
        for kind in ("colocated", "two_pods"):
            fill = {"name": "fill", "type": "torch", "entrypoint": "bench.torch_stages:make_fill",
                    "engineArgs": {"device": device}}
            check = {"name": "check", "type": "torch", "entrypoint": "bench.torch_stages:make_check",
                     "engineArgs": {"device": device}, "inputs": ["fill"], "finalOutput": "text"}
            if kind == "colocated":
                check["colocateWith"] = "fill"
            # Data ports authenticated, not encrypted (the opt-out for networks that encrypt already): the
            # data-plane goals are measured so; CurveZMQ's own cost is bench.wire_security's figure.
            fleet = self.fleets[kind] = C.Fleet(f"gpu-{kind}", [fill, check],
                                                spec={"security": {"dataPlane": "plain-auth"}})
            fleet.start_master()
            if kind == "colocated":
                fleet.start_pod("colo", "fill", "check")
            else:
                fleet.start_pod("prod", "fill")
                fleet.start_pod("cons", "check")
        for fleet in self.fleets.values():
            fleet.wait_ready(timeout=180)  # torch and CUDA start in every stage process

    def boundaries(self, kind: str, size: int, n: int) -> tuple[list[float], list[float]]:
        """n requests handing a float32 tensor of `size` bytes from producer to consumer (after one warm-up);
        each one's boundary (producer's tensor ready -> consumer has read all of it, its sum) and arrival
        (producer's tensor ready -> the consumer's forward called with it)."""
        fleet = self.fleets[kind]
        client = C.HttpClient(fleet.api_port)
        out, arrived = [], []
        try:
            for i in range(n + 1):
                v = float(i % 7 + 1)
                status, body = client.post("/v1/completions", {"model": "bench",
                                                               "prompt": json.dumps({"n": size // 4, "v": v})})
                if status != 200:
                    raise RuntimeError(f"{kind}: request of {size} B failed: {status} {body[:300]!r}")
                try:
                    d = json.loads(json.loads(body)["choices"][0]["text"])
                except (ValueError, KeyError, IndexError):
                    logs = "\n".join(f"--- {name}:\n{p.tail(15)}" for name, p in fleet.procs.items())
                    raise RuntimeError(f"{kind}: not the consumer's answer: {body[:500]!r}\n{logs}") from None
                if d["n"] != size // 4 or d["sum"] != v * (size // 4):
                    raise RuntimeError(f"{kind}: the consumer read {d}, not {size // 4} values of {v}")
                if i:
                    out.append(d["t1"] - d["t0"])
                    arrived.append(d["t_in"] - d["t0"])
        finally:
            client.close()
        return out, arrived

    def close(self) -> None:
        for fleet in self.fleets.values():
            fleet.stop()


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    rows, head = [], {}
    for size, r in res["sizes"].items():
        p50 = {k: C.pct(v, 50) for k, v in r.items() if isinstance(v, list)}
        rate = {k: gbps(size, v) for k, v in p50.items()}
        slow_whole = min(rate["d2h_pinned"], rate["wire_whole"], rate["h2d_pinned"])
        slow_piped = min(rate["d2h_pinned"], rate["wire_chunked"], rate["h2d_pinned"])
        # the pageable variants' H2D link is the pageable H2D
        slow_whole_pg = min(rate["d2h_pinned"], rate["wire_whole"], rate["h2d_pageable"])
        slow_piped_pg = min(rate["d2h_pinned"], rate["wire_chunked"], rate["h2d_pageable"])
        row = {
            "size": size, **{f"{k}_gbps": v for k, v in rate.items()
                             if not k.startswith("ipc") and not k.endswith("arrival")},
            "boundary_whole_over_slowest_link": rate["boundary_whole"] / slow_whole,
            "boundary_pipelined_over_slowest_link": rate["boundary_pipelined"] / slow_piped,
            "boundary_whole_pageable_over_slowest_link": rate["boundary_whole_pageable"] / slow_whole_pg,
            "boundary_pipelined_pageable_over_slowest_link": rate["boundary_pipelined_pageable"] / slow_piped_pg,
            "best_boundary_over_wire_one_frame": max(rate["boundary_whole"], rate["boundary_pipelined"],
                                                     rate["boundary_whole_pageable"],
                                                     rate["boundary_pipelined_pageable"]) / rate["wire_whole"],
            "ipc_touch_ms": p50["ipc_touch"] * 1e3, "ipc_full_read_ms": p50["ipc_full_read"] * 1e3,
            "ipc_first_ms": r["ipc_first"] * 1e3, "boundary_whole_ms": p50["boundary_whole"] * 1e3,
            "wire_over_ipc": p50["boundary_whole"] / p50["ipc_touch"],
            "wire_pipelined_over_ipc": p50["boundary_pipelined"] / p50["ipc_touch"],
            "runtime_colocated_ms": p50["runtime_colocated"] * 1e3,
            "runtime_colocated_arrival_ms": p50["runtime_colocated_arrival"] * 1e3,
            "runtime_two_pods_arrival_ms": p50["runtime_two_pods_arrival"] * 1e3,
            "runtime_colocated_over_ipc_full_read": p50["runtime_colocated"] / p50["ipc_full_read"],
            "runtime_two_pods_over_slowest_link": rate["runtime_two_pods"] / slow_whole,
        }
        rows.append(row)
        tag = C.fmt_size(size).replace(" ", "")
        head[f"boundary_whole_over_slowest_link_{tag}"] = round(row["boundary_whole_over_slowest_link"], 3)
        head[f"boundary_pipelined_over_slowest_link_{tag}"] = round(row["boundary_pipelined_over_slowest_link"], 3)
        head[f"boundary_whole_pageable_over_slowest_link_{tag}"] = round(
            row["boundary_whole_pageable_over_slowest_link"], 3)
        head[f"boundary_pipelined_pageable_over_slowest_link_{tag}"] = round(
            row["boundary_pipelined_pageable_over_slowest_link"], 3)
        head[f"wire_boundary_time_over_cuda_ipc_{tag}"] = round(row["wire_over_ipc"], 1)
        head[f"runtime_colocated_over_cuda_ipc_{tag}"] = round(row["runtime_colocated_over_ipc_full_read"], 2)
        head[f"runtime_two_pods_over_slowest_link_{tag}"] = round(row["runtime_two_pods_over_slowest_link"], 3)
    return {"rows": rows, "headline": head}


def report(res: dict[str, Any], summ: dict[str, Any], dry: bool) -> str:
    def f(v: float, d: int = 2) -> str:
        return f"{v:.{d}f}"

    out = [f"# GPU stage boundary benchmark{' (DRY RUN on CPU tensors: the numbers mean nothing)' if dry else ''}",
           "", "`python -m bench.gpu_boundary" + (" --dry-run-cpu" if dry else "") + "`: two processes speaking "
           "the runtime's wire format (`omnifleet_runtime.wire.Data` with a `wire.Array` payload, the array a "
           "zero-copy frame) over ZMQ PUSH -> PULL on loopback; the master and stage processes are not started "
           "(so the only needs are torch, pyzmq, numpy and msgspec). Boundary = producer's pinned D2H -> encode "
           "-> send -> recv -> decode -> copy into pinned -> H2D, one way; *whole* is the runtime as it is (one "
           f"frame per tensor), *pipelined* sends {C.fmt_size(res['frame'])} chunks as separate Data messages, "
           "overlapping D2H, wire and H2D. Slowest link = the lowest GB/s of pinned D2H, the wire alone (same "
           "framing) and pinned H2D, measured in the same run. GB/s = 1e9 bytes/s at p50.", "",
           C.facts_table(res["facts"]), ""]
    out += ["## Stage boundary vs its slowest link", "",
            C.md_table(["size", "pinned D2H GB/s", "pinned H2D GB/s", "pageable H2D GB/s", "wire, 1 frame GB/s",
                        f"wire, {C.fmt_size(res['frame'])} frames GB/s", "boundary whole GB/s",
                        "whole / slowest link", "boundary pipelined GB/s", "pipelined / slowest link", "iters"],
                       [[C.fmt_size(r["size"]), f(r["d2h_pinned_gbps"], 1), f(r["h2d_pinned_gbps"], 1),
                         f(r["h2d_pageable_gbps"], 1), f(r["wire_whole_gbps"]), f(r["wire_chunked_gbps"]),
                         f(r["boundary_whole_gbps"]), f(r["boundary_whole_over_slowest_link"]) + "x",
                         f(r["boundary_pipelined_gbps"]), f(r["boundary_pipelined_over_slowest_link"]) + "x",
                         res["sizes"][r["size"]]["iters"]] for r in summ["rows"]]), ""]
    out += ["The same with the consumer's H2D straight from the received frame (pageable memory, no staging "
            "copy); its slowest link uses the pageable H2D:", "",
            C.md_table(["size", "boundary whole GB/s", "whole / slowest link", "boundary pipelined GB/s",
                        "pipelined / slowest link", "best boundary / wire (1 frame)"],
                       [[C.fmt_size(r["size"]), f(r["boundary_whole_pageable_gbps"]),
                         f(r["boundary_whole_pageable_over_slowest_link"]) + "x",
                         f(r["boundary_pipelined_pageable_gbps"]),
                         f(r["boundary_pipelined_pageable_over_slowest_link"]) + "x",
                         f(r["best_boundary_over_wire_one_frame"]) + "x"] for r in summ["rows"]]), ""]
    rows = []
    for size, r in res["sizes"].items():
        for mode in ("whole", "pipelined", "whole_pageable", "pipelined_pageable"):
            st = r.get(f"steps_{mode}")
            if not st:
                continue
            rows.append([C.fmt_size(size), mode.replace("_", ", "), f(st["d2h"] * 1e3, 2), f(st["sent"] * 1e3, 2),
                         f(st["first_recv"] * 1e3, 2), f(st["last_recv"] * 1e3, 2),
                         f(st["staging_s"] * 1e3, 2) if st["staging_s"] else "-", f(st["total"] * 1e3, 2)])
    out += ["Where a boundary's time goes (p50 of each step's end, ms from the producer starting its D2H; "
            "*sent* = the producer's send calls returned, *first/last decoded* = the consumer decoded the first/"
            "last chunk, *staging* = time in copies into pinned memory, *done* = H2D synchronized):", "",
            C.md_table(["size", "mode", "D2H done", "sent", "first decoded", "last decoded", "staging (sum)",
                        "done"], rows), ""]
    out += ["## Co-located stages: CUDA IPC handoff vs the wire", "",
            "A fresh device tensor handed to a second process on the same device through torch.multiprocessing "
            "(the CUDA IPC handle travels, not the bytes); *touch* = the consumer reads one element back, *full "
            "read* = it runs a sum over the whole tensor; *first* = the first handoff of that size (a new "
            "allocation to open; the first of the run also initializes CUDA in the consumer). Ratio = boundary "
            "whole time / IPC touch time (p50).", "",
            C.md_table(["size", "wire boundary whole (ms)", "IPC touch (ms)", "IPC full read (ms)", "IPC first (ms)",
                        "wire / IPC", "wire pipelined / IPC"],
                       [[C.fmt_size(r["size"]), f(r["boundary_whole_ms"]), f(r["ipc_touch_ms"], 3),
                         f(r["ipc_full_read_ms"], 3), f(r["ipc_first_ms"], 1), f(r["wire_over_ipc"], 0) + "x",
                         f(r["wire_pipelined_over_ipc"], 0) + "x"] for r in summ["rows"]]), ""]
    out += ["## Through the runtime", "",
            "The runtime's own path: `omnifleet master` and `omnifleet stage` processes with two torch stages "
            "(`bench.torch_stages`): `fill` makes a float32 tensor of the size on the GPU and stamps it, `check` "
            "sums all of it and stamps again; boundary = the producer's tensor ready -> the consumer has read "
            "every value (p50). *Co-located*: one pod, the tensor goes by CUDA IPC handle "
            "(`wire.CudaIpc`); ratio over the raw IPC handoff with a full read, above. *Two pods*: host copy in "
            "the producer, the wire (`dataPlane: plain-auth`: authenticated, not encrypted), H2D in the consumer; ratio over the slowest link of the whole-frame path "
            "(pinned D2H, wire in one frame, pinned H2D). *Arrival*: the producer's tensor ready -> the consumer's "
            "forward called with it (p50); the rest of the boundary is the consumer's read.", "",
            C.md_table(["size", "co-located (ms)", "co-located arrival (ms)", "raw IPC full read (ms)",
                        "co-located / raw IPC", "two pods GB/s", "two pods arrival (ms)", "two pods / slowest link"],
                       [[C.fmt_size(r["size"]), f(r["runtime_colocated_ms"], 3),
                         f(r["runtime_colocated_arrival_ms"], 3),
                         f(r["ipc_full_read_ms"], 3), f(r["runtime_colocated_over_ipc_full_read"]) + "x",
                         f(r["runtime_two_pods_gbps"]), f(r["runtime_two_pods_arrival_ms"], 3),
                         f(r["runtime_two_pods_over_slowest_link"]) + "x"] for r in summ["rows"]]), ""]
    if res["skipped"]:
        out += [f"Skipped for the time budget: {', '.join(C.fmt_size(s) for s in res['skipped'])}.", ""]
    out += [f"Elapsed: {res['elapsed_s']:.0f} s.", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_boundary", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=C.RESULTS, help="results folder (default: %(default)s)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--sizes", default="1MiB,16MiB,64MiB,256MiB,1GiB", help="comma-separated payload sizes")
    p.add_argument("--frame", default="4MiB", help="chunk size of the pipelined mode and the chunked wire")
    p.add_argument("--budget-bytes", default="4GiB", help="bytes per mode and size; sets the iterations")
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=30)
    p.add_argument("--time-budget", type=float, default=300.0,
                   help="seconds; sizes not started by then are skipped (default: %(default)s)")
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="CPU tensors and small sizes: check the script where there is no GPU")
    args = p.parse_args(argv)
    if args.dry_run_cpu and args.sizes == p.get_default("sizes"):
        args.sizes, args.max_iters, args.budget_bytes = "1MiB,8MiB,32MiB", 5, "64MiB"
    t0 = time.monotonic()
    prov = C.provenance("gpu_boundary")
    res = run(args)
    res["elapsed_s"] = time.monotonic() - t0
    summ = summarize(res)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{C.today()}-gpu-boundary" + ("-dry-run-cpu" if args.dry_run_cpu else "")
    (args.out / f"{stem}.md").write_text(report(res, summ, args.dry_run_cpu))
    (args.out / f"{stem}.json").write_text(json.dumps({**res, "summary": summ}, indent=1, default=str) + "\n")
    C.merge_latest(args.out, "gpu_boundary_dry_run_cpu" if args.dry_run_cpu else "gpu_boundary",
                   {**summ["headline"], "report": f"{stem}.md",
                    "machine": f"{res['facts'].get('gpu', 'no GPU')}, {C.machine_line(res['facts'])}"}, prov)
    C.log(f"done in {res['elapsed_s']:.0f} s: {args.out / (stem + '.md')}")
    print(json.dumps(summ["headline"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
