"""Prometheus series of the master, the stage workers and the stage pods (prometheus-client).

Each process keeps its own registry. The master reads membership gauges at
scrape time. A stage worker serves its registry, plus the process-wide one
where vLLM publishes its own `vllm:*` series, on a loopback port; the pod's
parent process scrapes its workers, labels every sample with its stage and
serves the merged text on the pod's declared `metrics` port.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from . import constants as C

# `_created` series double every counter and histogram and nothing here reads them.
prometheus_client.disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
CHUNK_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
RTF_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 5, 10)
# The text format every Prometheus version reads (the series names here need no 1.0.0 escaping).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Labelled:
    """A family whose children are looked up once per label set (`labels()` costs more than the update:
    a stage updates several per output chunk)."""

    def __init__(self, metric: Any):
        self.metric = metric
        self._children: dict[tuple, Any] = {}

    def _child(self, labels: dict[str, str]) -> Any:
        key = tuple(labels.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.metric.labels(**labels) if labels else self.metric
        return child


class Counter(_Labelled):
    """A labelled counter: `inc(amount, **labels)`."""

    def __init__(self, name: str, help: str, labels: Iterable[str], registry: CollectorRegistry):
        super().__init__(prometheus_client.Counter(name.removesuffix("_total"), help, list(labels), registry=registry))

    def inc(self, amount: float = 1, **labels: str) -> None:
        self._child(labels).inc(amount)


class Histogram(_Labelled):
    """A labelled histogram: `observe(value, **labels)`."""

    def __init__(self, name: str, help: str, labels: Iterable[str], registry: CollectorRegistry,
                 buckets: tuple[float, ...] = LATENCY_BUCKETS):
        super().__init__(prometheus_client.Histogram(name, help, list(labels), registry=registry, buckets=buckets))

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)


class _Collect:
    """A collector whose families are computed at scrape time."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]):
        self.collect = collect


# ---------------------------------------------------------------- master

class MasterMetrics:
    """What the master counts itself; gauges of membership are read at scrape time."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("omnifleet_requests_total", "Client requests by API and outcome.",
                                ("api", "outcome"), r)
        self.request_latency = Histogram(
            "omnifleet_request_latency_seconds", "Client request latency, admission to last byte.", (), r)
        self.first_output_latency = Histogram(
            "omnifleet_first_output_latency_seconds", "Time from admission to the first final-output chunk.", (), r)
        self.time_to_first_output = Histogram(
            "omnifleet_time_to_first_output_seconds",
            "Time from admission to a final stage's first chunk (time to first audio, image, text).",
            ("stage", "output"), r)
        self.hop_latency = Histogram(
            "omnifleet_stage_latency_seconds", "Per-hop latency: dispatch to a stage until it is done.", ("stage",), r)
        self.request_stage = Histogram(
            "omnifleet_request_stage_seconds",
            "Time a request spent at a stage: from its last input stage finishing (or dispatch) until it finished.",
            ("stage",), r)
        self.redispatches = Counter(
            "omnifleet_redispatches_total", "Requests re-dispatched after a replica was lost.", ("stage",), r)
        self.replica_losses = Counter("omnifleet_replica_lost_total", "Replicas lost (heartbeat timeout).",
                                      ("stage",), r)
        self.rejected_frames = Counter("omnifleet_rejected_frames_total", "Malformed or unexpected frames.",
                                       ("socket",), r)
        self.master_bytes = Counter(
            "omnifleet_master_output_bytes_total", "Bytes of final-output messages the master received.", ("stage",), r)
        self.dropped_messages = Counter(
            "omnifleet_dropped_messages_total", "Messages over the frame-count or size bounds, dropped unread.",
            ("socket",), r)
        self.refused_registrations = Counter(
            "omnifleet_refused_registrations_total",
            "Registrations refused for identity (address, replica id, bound).", ("stage",), r)
        self.auth_refused = lambda: 0  # ZMQ handshakes the ZAP handler refused (set by the master)
        self.demand: Callable[[], dict[str, int]] = dict  # open requests per stage (set by the master)
        self.deadlines = Counter("omnifleet_request_deadline_exceeded_total", "Requests aborted at their deadline.",
                                 ("api",), r)
        self.refused = Counter("omnifleet_requests_refused_total",
                               "Requests refused before admission, by reason (unauthorized, full, invalid).",
                               ("reason",), r)
        self._membership: Any = None
        self._stages: list[str] = []
        r.register(_Collect(self._collect_membership))

    def _collect_membership(self) -> Iterable[Metric]:
        if self._membership is None:
            return
        reps = self._membership.all()
        names = ["stage", "replica", "pod"]
        lab = lambda r: [r.stage, r.replica, r.replica]  # noqa: E731
        g = GaugeMetricFamily("omnifleet_stage_replicas", "Registered replicas per stage.", labels=["stage"])
        for s in self._stages:
            g.add_metric([s], len(self._membership.replicas(s)))
        yield g
        g = GaugeMetricFamily(C.STAGE_DEMAND_METRIC, "Open requests that still need a stage: in flight on it or "
                              "waiting for a replica of it (what a stage that scales to zero scales on).",
                              labels=["stage"])
        for s, n in sorted(self.demand().items()):
            g.add_metric([s], n)
        yield g
        for name, help, value in (
            ("omnifleet_stage_inflight", "Requests the master has in flight on a stage replica (HPA target).",
             lambda r: r.outstanding),
            ("omnifleet_stage_queue_depth", "Requests waiting inside a stage replica, as it reports.",
             lambda r: r.queue_depth),
            ("omnifleet_stage_draining", "1 while a replica drains after SIGTERM.", lambda r: int(r.draining)),
        ):
            g = GaugeMetricFamily(name, help, labels=names)
            for r in reps:
                g.add_metric(lab(r), value(r))
            yield g
        c = CounterMetricFamily("omnifleet_stage_bytes",
                                "Payload bytes a stage replica sent, by path (tcp, shm, master).",
                                labels=names + ["path"])
        for r in reps:
            for path, n in sorted(r.bytes.items()):
                c.add_metric(lab(r) + [path], n)
        yield c
        c = CounterMetricFamily("omnifleet_auth_refused", "ZMQ handshakes refused: not a key of this pipeline.")
        c.add_metric([], self.auth_refused())
        yield c
        c = CounterMetricFamily("omnifleet_stage_dropped_messages",
                                "Messages a stage replica dropped over the bounds.", labels=names)
        for r in reps:
            c.add_metric(lab(r), r.dropped)
        yield c

    def render(self, membership, stages: list[str]) -> str:
        self._membership, self._stages = membership, stages
        return generate_latest(self.registry).decode()


# ---------------------------------------------------------------- stage worker

class StageMetrics:
    """One stage worker's series (label `stage` on each), and its engine's."""

    def __init__(self, stage: str, state: Callable[[], dict[str, float]]):
        self.stage = stage
        r = self.registry = CollectorRegistry(auto_describe=False)
        s = ("stage",)
        self.requests = Counter("omnifleet_worker_requests_total",
                                "Requests this replica finished, by outcome (ok, error, aborted).", s + ("outcome",), r)
        self.request_seconds = Histogram("omnifleet_worker_request_seconds",
                                         "Time per request in this replica: dispatch to done.", s, r)
        self.input_wait = Histogram("omnifleet_worker_input_wait_seconds",
                                    "Time from dispatch to the first input (waiting for the upstream stages).", s, r)
        self.first_output = Histogram("omnifleet_worker_first_output_seconds",
                                      "Time from the first input to the first output chunk.", s, r)
        self.chunk_seconds = Histogram("omnifleet_worker_chunk_seconds",
                                       "Time between consecutive output chunks of a request.", s, r, CHUNK_BUCKETS)
        self.chunks = Counter("omnifleet_worker_output_chunks_total", "Output chunks produced.", s, r)
        self.bytes_out = Counter(
            "omnifleet_worker_sent_bytes_total",
            "Payload bytes sent, by route (a downstream stage, or master) and path (tcp, shm, cuda_ipc).",
            s + ("route", "path"), r)
        self.bytes_in = Counter("omnifleet_worker_received_bytes_total",
                                "Bytes that arrived on the data port, by upstream stage.", s + ("src",), r)
        self.striped_in = Counter("omnifleet_worker_striped_messages_total",
                                  "Data messages that came split over several connections and were put back "
                                  "together.", s, r)
        self.sealed_parts = Counter("omnifleet_worker_sealed_parts_total",
                                    "Parts of large data messages that came AES-GCM sealed on the bulk port and "
                                    "opened (a `curve` pipeline).", s, r)
        self.rejected_frames = Counter("omnifleet_worker_rejected_frames_total",
                                       "Malformed or unexpected frames, by socket.", s + ("socket",), r)
        # Engine series: diffusion and audio stages (vLLM publishes its own `vllm:*`).
        self.diffusion_step = Histogram("omnifleet_diffusion_step_seconds", "Time per denoising step.", s, r,
                                        CHUNK_BUCKETS + (10, 30))
        self.images = Counter("omnifleet_diffusion_images_total", "Images generated (rate: images/s).", s, r)
        self.audio_seconds = Counter("omnifleet_audio_output_seconds_total",
                                     "Seconds of audio produced (rate: audio seconds per second).", s, r)
        self.audio_rtf = Histogram(
            "omnifleet_audio_realtime_factor",
            "Per request: processing time (first input to last chunk) / seconds of audio produced; < 1 is faster "
            "than real time.", s, r, RTF_BUCKETS)

        def gauges() -> Iterable[Metric]:
            now = state()
            for name, help in (
                ("omnifleet_worker_inflight", "Requests in this replica (started, not done)."),
                ("omnifleet_worker_queue_depth", "Requests waiting for an engine slot."),
                ("omnifleet_worker_early_data", "Requests whose data arrived before their dispatch."),
                ("omnifleet_worker_realtime_factor", "Audio stages: seconds of work per second of audio produced, "
                 "over the requests that ended in the last minute (0: none); an autoscaling target."),
            ):
                g = GaugeMetricFamily(name, help, labels=["stage"])
                g.add_metric([stage], now[name.removeprefix("omnifleet_worker_")])
                yield g

        r.register(_Collect(gauges))

    def render(self) -> bytes:
        """This worker's series and the process-wide registry (vLLM's own, the process collector)."""
        return generate_latest(self.registry) + generate_latest(prometheus_client.REGISTRY)


def audio_seconds(out: Any) -> float:
    """Seconds of audio in a final-output chunk `{"audio": [samples(, channels)], "sample_rate": hz}`; else 0."""
    if not isinstance(out, dict) or "audio" not in out:
        return 0.0
    shape = getattr(out["audio"], "shape", None)
    rate = out.get("sample_rate", out.get("sr", 24000))
    if not shape or not isinstance(rate, int) or rate <= 0:
        return 0.0
    return int(shape[0]) / rate


# ---------------------------------------------------------------- stage pod

def merge(parts: list[tuple[dict[str, str], str]], own: Iterable[Metric] = ()) -> bytes:
    """One exposition from several (each sample gets its part's labels, unless it has them)."""
    families: dict[str, Metric] = {}
    for fam in own:
        families[fam.name] = fam
    for extra, text in parts:
        for fam in text_string_to_metric_families(text):
            m = families.get(fam.name)
            if m is None:
                m = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            m.samples.extend(Sample(s.name, {**extra, **s.labels}, s.value, s.timestamp, s.exemplar)
                             for s in fam.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collect(lambda: list(families.values())))
    return generate_latest(registry)


def pod_families(shm_bytes: int, up: dict[str, bool]) -> list[Metric]:
    shm = GaugeMetricFamily("omnifleet_pod_shm_bytes", "Bytes this pod holds in /dev/shm (pooled shared-memory regions, transfers in flight).")
    shm.add_metric([], shm_bytes)
    g = GaugeMetricFamily("omnifleet_pod_worker_up", "1 when a stage worker answered this scrape.", labels=["stage"])
    for stage, ok in up.items():
        g.add_metric([stage], int(ok))
    return [shm, g]
