"""The operator's /metrics (prometheus-client): controller-runtime's series names where they fit.

`controller_runtime_reconcile_*` and `workqueue_*` carry the names and labels
a Go operator's dashboards and alerts already use; what only this operator
has (writes by kind, watch restarts, pipelines by phase) is `omnifleet_operator_*`.
Served from its own thread, so a scrape answers even while the event loop is busy.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

prometheus_client.disable_created_metrics()

CONTROLLER = "omnipipeline"  # the `controller` label, as controller-runtime names a controller by its kind
QUEUE = "omnipipeline"  # the `name` label of the work queue
LEASE = "omnifleet-operator"  # the `name` label of leader_election_master_status
PHASES = ("Pending", "Progressing", "Ready", "Degraded", "Invalid")
DEFAULT_PORT = 8081
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REGISTRY = CollectorRegistry(auto_describe=False)
RECONCILE_TOTAL = Counter("controller_runtime_reconcile", "Total number of reconciliations per controller.",
                          ["controller", "result"], registry=REGISTRY)
RECONCILE_ERRORS = Counter("controller_runtime_reconcile_errors", "Total number of reconciliation errors per "
                           "controller.", ["controller"], registry=REGISTRY)
RECONCILE_TIME = Histogram("controller_runtime_reconcile_time_seconds", "Length of time per reconciliation per "
                           "controller.", ["controller"], registry=REGISTRY, buckets=RECONCILE_BUCKETS)
ACTIVE_WORKERS = Gauge("controller_runtime_active_workers", "Number of currently used workers per controller.",
                       ["controller"], registry=REGISTRY)
MAX_WORKERS = Gauge("controller_runtime_max_concurrent_reconciles", "Maximum number of concurrent reconciles per "
                    "controller.", ["controller"], registry=REGISTRY)
QUEUE_ADDS = Counter("workqueue_adds", "Total number of adds handled by workqueue.", ["name"], registry=REGISTRY)
QUEUE_WAIT = Histogram("workqueue_queue_duration_seconds", "How long in seconds an item stays in workqueue before "
                       "being requested.", ["name"], registry=REGISTRY, buckets=RECONCILE_BUCKETS)
WRITES = Counter("omnifleet_operator_writes", "Writes to the API server, by kind and verb (apply, delete, status, "
                 "event).", ["kind", "verb"], registry=REGISTRY)
WRITE_ERRORS = Counter("omnifleet_operator_write_errors", "Writes the API server refused or that failed, by kind "
                       "and verb.", ["kind", "verb"], registry=REGISTRY)
WATCH_RESTARTS = Counter("omnifleet_operator_watch_restarts", "Watch streams restarted (expired resource "
                         "version, an inactive stream), by resource.", ["resource"], registry=REGISTRY)


class _Collect:
    def __init__(self, collect: Callable[[], Iterable[Metric]]):
        self.collect = collect


def register_state(queue_depth: Callable[[], int], phases: Callable[[], Iterable[str]],
                   leading: Callable[[], bool]) -> None:
    """Gauges read at scrape time: the queue's depth, each pipeline's phase, and whether this replica leads."""

    def collect() -> Iterable[Metric]:
        leader = GaugeMetricFamily("leader_election_master_status", "1 while this replica reconciles (holds the "
                                   "Lease, or runs without election).", labels=["name"])
        leader.add_metric([LEASE], int(leading()))
        yield leader
        depth = GaugeMetricFamily("workqueue_depth", "Current depth of workqueue.", labels=["name"])
        depth.add_metric([QUEUE], queue_depth())
        yield depth
        counts = dict.fromkeys(PHASES, 0)
        for phase in phases():
            counts[phase or "Unknown"] = counts.get(phase or "Unknown", 0) + 1
        by_phase = GaugeMetricFamily("omnifleet_operator_pipelines", "Pipelines by the phase of their status.",
                                     labels=["phase"])
        for phase, n in counts.items():
            by_phase.add_metric([phase], n)
        yield by_phase

    REGISTRY.register(_Collect(collect))


def count_write(kind: str, verb: str, ok: bool) -> None:
    (WRITES if ok else WRITE_ERRORS).labels(kind=kind, verb=verb).inc()


class _WatchRestarts(logging.Filter):
    """kopf says when it restarts a watch stream only in debug lines: count them (and keep them out of the
    log unless it is verbose)."""

    PATTERN = re.compile(r"^(?:Restarting the watch-stream for|Watch-stream for) (\S+) ")

    def __init__(self, verbose: bool):
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if m := self.PATTERN.match(record.getMessage()):
            WATCH_RESTARTS.labels(resource=m[1]).inc()
        return self.verbose or record.levelno > logging.DEBUG


def count_watch_restarts(verbose: bool) -> None:
    logger = logging.getLogger("kopf._cogs.clients.watching")
    logger.setLevel(logging.DEBUG)
    logger.addFilter(_WatchRestarts(verbose))


def serve(port: int, host: str = "0.0.0.0") -> Any:
    """/metrics on host:port from a thread of its own; returns the server."""
    server, _ = prometheus_client.start_http_server(port, host, registry=REGISTRY)
    return server
