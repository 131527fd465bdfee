"""The operator's /metrics against a real API server: a pipeline coming up moves its series."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from .kube import Kube, load_sample, wait_for, with_namespace


def scrape(operator) -> dict[tuple[str, frozenset], float]:
    args = operator.proc.args
    port = int(args[args.index("--metrics-port") + 1])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_pipeline_coming_up_moves_the_operator_series(kube: Kube, operator, ns: str):
    before = scrape(operator)
    kube.apply(with_namespace(load_sample("autoscaled.yaml"), ns))
    kube.wait_ready(ns, "autoscaled")
    after = scrape(operator)

    def moved(series: str, **labels: str) -> float:
        key = (series, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("controller_runtime_reconcile_total", controller="omnipipeline", result="success") >= 1
    assert moved("controller_runtime_reconcile_time_seconds_count", controller="omnipipeline") >= 1
    assert moved("workqueue_adds_total", name="omnipipeline") >= 1
    for kind in ("Secret", "ServiceAccount", "ConfigMap", "NetworkPolicy", "Deployment", "Service",
                 "PodDisruptionBudget", "HorizontalPodAutoscaler"):
        assert moved("omnifleet_operator_writes_total", kind=kind, verb="apply") >= 1, kind
    assert moved("omnifleet_operator_writes_total", kind="OmniPipeline", verb="status") >= 1
    wait_for(lambda: scrape(operator).get(("omnifleet_operator_pipelines", frozenset({("phase", "Ready")})), 0) >= 1,
             30, "the Ready pipeline in the phase gauge")
