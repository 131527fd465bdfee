"""The Grafana dashboard of a pipeline: a pure builder of its JSON model.

One row of overview (requests, latency, time to first output per final
stage, where a request's time goes), then the stages side by side (a panel
per stage, repeated over the `stage` variable) for load, latency, errors and
replicas, then the engines (ours, and vLLM's own series) and the operator. Series carry the `pipeline`
label that the rendered PodMonitor adds. `manifests/monitoring/` holds the
generic dashboard (any pipeline: pick it in the variables); `omnifleet
dashboard -f PIPELINE` bakes one pipeline's name and stages in.
"""

from __future__ import annotations

import json
from typing import Any

from omnifleet_runtime.schema import OmniPipeline

Obj = dict[str, Any]

SEL = 'namespace="$namespace", pipeline="$pipeline"'
STAGE_SEL = SEL + ', stage=~"$stage"'
RATE = "[$__rate_interval]"
WIDTH = 24


def _q(expr: str, legend: str) -> Obj:
    return {"expr": expr, "legendFormat": legend, "refId": "", "datasource": {"type": "prometheus",
                                                                            "uid": "${datasource}"}}


def _p95(series: str, sel: str, by: str = "") -> str:
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile(0.95, sum by ({group}) (rate({series}_bucket{{{sel}}}{RATE})))"


def _panel(title: str, targets: list[Obj], unit: str, x: int, y: int, w: int, h: int = 8,
           repeat: bool = False) -> Obj:
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    panel: Obj = {
        "type": "timeseries", "title": title, "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": x, "y": y, "w": w, "h": h}, "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
    }
    if repeat:  # one copy per selected stage, side by side
        panel |= {"repeat": "stage", "repeatDirection": "h", "maxPerRow": 6}
    return panel


def _row(title: str, y: int) -> Obj:
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"x": 0, "y": y, "w": WIDTH, "h": 1},
            "panels": []}


def panels() -> list[Obj]:
    out: list[Obj] = [_row("Pipeline", 0)]
    out += [
        _panel("Requests by outcome", [_q(f"sum by (outcome) (rate(omnifleet_requests_total{{{SEL}}}{RATE}))",
                                          "{{outcome}}")], "reqps", 0, 1, 6),
        _panel("Request latency", [
            _q(_p95("omnifleet_request_latency_seconds", SEL), "p95"),
            _q(f"histogram_quantile(0.5, sum by (le) (rate(omnifleet_request_latency_seconds_bucket{{{SEL}}}{RATE})))",
               "p50")], "s", 6, 1, 6),
        _panel("Time to first output (p95), per final stage", [
            _q(_p95("omnifleet_time_to_first_output_seconds", SEL, "stage, output"), "{{stage}} ({{output}})")],
            "s", 12, 1, 6),
        _panel("Where a request's time goes (mean per stage)", [
            _q(f"sum by (stage) (rate(omnifleet_request_stage_seconds_sum{{{SEL}}}{RATE})) / "
               f"sum by (stage) (rate(omnifleet_request_stage_seconds_count{{{SEL}}}{RATE}))", "{{stage}}")],
            "s", 18, 1, 6),
    ]
    y = 9
    per_stage = [
        ("Load", "Load: $stage", [
            _q(f"sum(omnifleet_stage_inflight{{{STAGE_SEL}}})", "in flight (master)"),
            _q(f"sum(omnifleet_stage_demand{{{STAGE_SEL}}})", "demand (in flight or waiting for a replica)"),
            _q(f"sum(omnifleet_worker_queue_depth{{{STAGE_SEL}}})", "queued in replicas"),
            _q(f"sum(rate(omnifleet_worker_requests_total{{{STAGE_SEL}}}{RATE}))", "finished/s")], "short"),
        ("Latency", "Latency: $stage", [
            _q(_p95("omnifleet_worker_request_seconds", STAGE_SEL), "p95 in a replica"),
            _q(_p95("omnifleet_request_stage_seconds", STAGE_SEL), "p95 share of a request"),
            _q(_p95("omnifleet_worker_input_wait_seconds", STAGE_SEL), "p95 waiting for input")], "s"),
        ("Errors", "Errors: $stage", [
            _q(f'sum(rate(omnifleet_worker_requests_total{{{STAGE_SEL}, outcome!="ok"}}{RATE}))', "failed or aborted/s"),
            _q(f"sum(rate(omnifleet_redispatches_total{{{STAGE_SEL}}}{RATE}))", "re-dispatched/s"),
            _q(f"sum(increase(omnifleet_replica_lost_total{{{STAGE_SEL}}}{RATE}))", "replicas lost")], "short"),
        ("Replicas", "Replicas: $stage", [
            _q(f"max(omnifleet_stage_replicas{{{STAGE_SEL}}})", "registered"),
            _q(f"sum(omnifleet_stage_draining{{{STAGE_SEL}}})", "draining"),
            _q(f"count(omnifleet_pod_worker_up{{{STAGE_SEL}}} == 1)", "pods answering")], "short"),
    ]
    for row, title, targets, unit in per_stage:
        out.append(_row(f"Stages side by side: {row.lower()}", y))
        out.append(_panel(title, targets, unit, 0, y + 1, 6, repeat=True))
        y += 9
    out.append(_row("Engines and data", y))
    out += [
        _panel("Images per second (diffusion)", [
            _q(f"sum by (stage) (rate(omnifleet_diffusion_images_total{{{SEL}}}{RATE}))", "{{stage}}")],
            "short", 0, y + 1, 6),
        _panel("Denoising step time (p95)", [_q(_p95("omnifleet_diffusion_step_seconds", SEL, "stage"), "{{stage}}")],
               "s", 6, y + 1, 6),
        _panel("Audio real-time factor (p95; < 1 is faster than real time)", [
            _q(_p95("omnifleet_audio_realtime_factor", SEL, "stage"), "{{stage}}")], "short", 12, y + 1, 6),
        _panel("Bytes sent between stages", [
            _q(f"sum by (stage, route, path) (rate(omnifleet_worker_sent_bytes_total{{{SEL}}}{RATE}))",
               "{{stage}} -> {{route}} ({{path}})")], "Bps", 18, y + 1, 6),
    ]
    y += 9
    out.append(_row("LLM engines (vLLM's own series)", y))
    out += [
        _panel("Tokens per second", [
            _q(f"sum by (stage) (rate(vllm:generation_tokens_total{{{SEL}}}{RATE}))", "{{stage}} generated"),
            _q(f"sum by (stage) (rate(vllm:prompt_tokens_total{{{SEL}}}{RATE}))", "{{stage}} prompt")],
            "short", 0, y + 1, 6),
        _panel("Requests in the engine", [
            _q(f"sum by (stage) (vllm:num_requests_running{{{SEL}}})", "{{stage}} running"),
            _q(f"sum by (stage) (vllm:num_requests_waiting{{{SEL}}})", "{{stage}} waiting")], "short", 6, y + 1, 6),
        _panel("Time to first token (p95)", [_q(_p95("vllm:time_to_first_token_seconds", SEL, "stage"), "{{stage}}")],
               "s", 12, y + 1, 6),
        _panel("KV cache usage", [_q(f"max by (stage) (vllm:kv_cache_usage_perc{{{SEL}}})", "{{stage}}")],
               "percentunit", 18, y + 1, 6),
    ]
    y += 9
    out.append(_row("Operator", y))
    out += [
        _panel("Reconciles by result", [_q(
            'sum by (result) (rate(controller_runtime_reconcile_total{controller="omnipipeline"}' + RATE + "))",
            "{{result}}")], "ops", 0, y + 1, 6),
        _panel("Reconcile time (p95) and queue depth", [
            _q(_p95("controller_runtime_reconcile_time_seconds", 'controller="omnipipeline"'), "p95 reconcile"),
            _q('sum(workqueue_depth{name="omnipipeline"})', "queue depth")], "s", 6, y + 1, 6),
        _panel("API writes by kind", [_q(f"sum by (kind, verb) (rate(omnifleet_operator_writes_total{RATE}))",
                                         "{{verb}} {{kind}}")], "ops", 12, y + 1, 6),
        _panel("Pipelines by phase", [_q("sum by (phase) (omnifleet_operator_pipelines)", "{{phase}}")],
               "short", 18, y + 1, 6),
    ]
    return out


def _variable(name: str, label: str, query: str, multi: bool = False) -> Obj:
    return {"name": name, "label": label, "type": "query", "refresh": 2, "sort": 0, "includeAll": multi,
            "multi": multi, "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "definition": query,
            **({"current": {"text": "All", "value": "$__all"}} if multi else {})}


def dashboard(doc: OmniPipeline | None = None) -> Obj:
    """The dashboard's JSON model; with a pipeline, its name and stages are the defaults."""
    variables = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
        _variable("namespace", "Namespace", "label_values(omnifleet_stage_replicas, namespace)"),
        _variable("pipeline", "Pipeline", 'label_values(omnifleet_stage_replicas{namespace="$namespace"}, pipeline)'),
        _variable("stage", "Stage", f"label_values(omnifleet_stage_replicas{{{SEL}}}, stage)", multi=True),
    ]
    title, uid = "omnifleet pipeline", "omnifleet-pipeline"
    if doc is not None:
        name = doc.metadata.name
        title, uid = f"omnifleet pipeline {name}", f"omnifleet-{name}"[:40]
        variables[2] = variables[2] | {"current": {"text": name, "value": name}}
        if doc.metadata.namespace:
            variables[1] = variables[1] | {"current": {"text": doc.metadata.namespace, "value": doc.metadata.namespace}}
        stages = [s.name for s in doc.spec.stages]  # in spec order: left to right
        variables[3] = {"name": "stage", "label": "Stage", "type": "custom", "multi": True, "includeAll": True,
                        "query": ",".join(stages), "current": {"text": "All", "value": "$__all"},
                        "options": [{"text": s, "value": s, "selected": False} for s in stages]}
    return {
        "title": title, "uid": uid, "editable": True, "schemaVersion": 39, "version": 1,
        "tags": ["omnifleet"], "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": variables}, "annotations": {"list": []}, "panels": panels(),
    }


def dashboard_json(doc: OmniPipeline | None = None) -> str:
    return json.dumps(dashboard(doc), indent=2, sort_keys=False) + "\n"
