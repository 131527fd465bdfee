"""Prometheus text exposition, small enough to need no client library."""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Iterable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

Labels = tuple[tuple[str, str], ...]


def _fmt_labels(labels: Labels, extra: Iterable[tuple[str, str]] = ()) -> str:
    pairs = list(labels) + list(extra)
    if not pairs:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in pairs) + "}"


class Counter:
    def __init__(self, name: str, help: str):
        self.name, self.help = name, help
        self.values: dict[Labels, float] = defaultdict(float)

    def inc(self, amount: float = 1, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] += amount

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        out += [f"{self.name}{_fmt_labels(k)} {v:g}" for k, v in sorted(self.values.items())]
        return out


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, buckets
        self.series: dict[Labels, list] = {}  # labels -> [bucket counts..., sum, count]

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        s = self.series.setdefault(key, [0] * len(self.buckets) + [0.0, 0])
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            s[i] += 1
        s[-2] += value
        s[-1] += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, s in sorted(self.series.items()):
            cumulative = 0
            for bound, n in zip(self.buckets, s):
                cumulative += n
                out.append(f"{self.name}_bucket{_fmt_labels(key, [('le', f'{bound:g}')])} {cumulative}")
            out.append(f"{self.name}_bucket{_fmt_labels(key, [('le', '+Inf')])} {s[-1]}")
            out.append(f"{self.name}_sum{_fmt_labels(key)} {s[-2]:g}")
            out.append(f"{self.name}_count{_fmt_labels(key)} {s[-1]}")
        return out


def gauge(name: str, help: str, samples: Iterable[tuple[dict[str, str], float]]) -> list[str]:
    out = [f"# HELP {name} {help}", f"# TYPE {name} gauge"]
    out += [f"{name}{_fmt_labels(tuple(labels.items()))} {value:g}" for labels, value in samples]
    return out


class MasterMetrics:
    """What the master counts itself; gauges of membership are read at scrape time."""

    def __init__(self) -> None:
        self.requests = Counter("omnifleet_requests_total", "Client requests by API and outcome.")
        self.request_latency = Histogram(
            "omnifleet_request_latency_seconds", "Client request latency, admission to last byte."
        )
        self.first_output_latency = Histogram(
            "omnifleet_first_output_latency_seconds", "Time from admission to the first final-output chunk."
        )
        self.hop_latency = Histogram(
            "omnifleet_stage_latency_seconds", "Per-hop latency: dispatch to a stage until it is done."
        )
        self.redispatches = Counter(
            "omnifleet_redispatches_total", "Requests re-dispatched after a replica was lost."
        )
        self.replica_losses = Counter("omnifleet_replica_lost_total", "Replicas lost (heartbeat timeout).")
        self.rejected_frames = Counter("omnifleet_rejected_frames_total", "Malformed or unexpected frames.")
        self.master_bytes = Counter(
            "omnifleet_master_output_bytes_total", "Bytes of final-output messages the master received."
        )

    def render(self, membership, stages: list[str]) -> str:
        reps = membership.all()
        lab = lambda r: {"stage": r.stage, "replica": r.replica, "pod": r.replica}  # noqa: E731
        lines: list[str] = []
        lines += gauge(
            "omnifleet_stage_replicas", "Registered replicas per stage.",
            [({"stage": s}, len(membership.replicas(s))) for s in stages],
        )
        lines += gauge(
            "omnifleet_stage_inflight", "Requests the master has in flight on a stage replica (HPA target).",
            [(lab(r), r.outstanding) for r in reps],
        )
        lines += gauge(
            "omnifleet_stage_queue_depth", "Requests waiting inside a stage replica, as it reports.",
            [(lab(r), r.queue_depth) for r in reps],
        )
        lines += gauge(
            "omnifleet_stage_draining", "1 while a replica drains after SIGTERM.",
            [(lab(r), int(r.draining)) for r in reps],
        )
        bytes_lines = [
            "# HELP omnifleet_stage_bytes_total Payload bytes a stage replica sent, by path (tcp, shm, master).",
            "# TYPE omnifleet_stage_bytes_total counter",
        ]
        for r in reps:
            for path, n in sorted(r.bytes.items()):
                bytes_lines.append(
                    f"omnifleet_stage_bytes_total{_fmt_labels(tuple(lab(r).items()), [('path', path)])} {n}"
                )
        lines += bytes_lines
        for family in (
            self.requests, self.request_latency, self.first_output_latency, self.hop_latency,
            self.redispatches, self.replica_losses, self.rejected_frames, self.master_bytes,
        ):
            lines += family.render()
        return "\n".join(lines) + "\n"
