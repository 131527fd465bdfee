"""Properties of the renderer that matter beyond the golden files."""

from __future__ import annotations

import copy

import yaml

from omnifleet_operator.checks import check_document
from omnifleet_operator.render import desired
from omnifleet_runtime import constants as C
from omnifleet_runtime.schema import MAX_STAGES

from ..conftest import REPO


def sample(name: str) -> dict:
    return yaml.safe_load((REPO / "manifests" / "samples" / f"{name}.yaml").read_text())


def render(doc: dict, uid: str | None = "u1") -> dict[tuple[str, str], dict]:
    parsed, problems = check_document(doc)
    assert problems == []
    return {(o["kind"], o["metadata"]["name"]): o for o in desired(parsed, owner_uid=uid)}


def template_hash(objs, name):
    return objs[("Deployment", name)]["spec"]["template"]["metadata"]["annotations"][C.ANNOTATION_TEMPLATE_HASH]


def test_rendering_is_deterministic():
    assert render(sample("speech")) == render(sample("speech"))


def test_every_child_has_owner_and_labels():
    for obj in render(sample("speech")).values():
        meta = obj["metadata"]
        assert meta["ownerReferences"] == [{
            "apiVersion": C.API_VERSION, "kind": C.KIND, "name": "speech", "uid": "u1",
            "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"][C.LABEL_PIPELINE] == "speech"
        assert meta["labels"][C.LABEL_INSTANCE] == "speech"


def test_colocated_stage_runs_in_its_host_pods():
    objs = render(sample("speech"))
    assert ("Deployment", "speech-code2wav") not in objs
    c = objs[("Deployment", "speech-talker")]["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--stage") + 1] == "talker"
    assert c["args"].count("--stage") == 2 and "code2wav" in c["args"]
    assert c["resources"]["limits"][ "nvidia.com/gpu"] == "1"
    # cpu 4 + 2 and memory 32Gi + 8Gi: one container serves both processes
    assert c["resources"]["requests"] == {"cpu": "6", "memory": "40Gi"}
    bulk = C.STAGE_DATA_PORT + C.BULK_PORT_OFFSET  # a `curve` data plane (the default): a bulk port per stage
    assert [p["containerPort"] for p in c["ports"]] == [C.STAGE_DATA_PORT, C.STAGE_DATA_PORT + 1, bulk, bulk + 1,
                                                        C.STAGE_HEALTH_PORT, C.STAGE_METRICS_PORT]
    assert c["ports"][-1]["name"] == "metrics"


def test_changing_one_stage_rolls_only_that_stage():
    before = render(sample("speech"))
    doc = sample("speech")
    doc["spec"]["stages"][0]["engineArgs"]["max_num_seqs"] = 128  # thinker
    after = render(doc)
    assert template_hash(before, "speech-thinker") != template_hash(after, "speech-thinker")
    assert template_hash(before, "speech-talker") == template_hash(after, "speech-talker")
    assert template_hash(before, "speech-master") == template_hash(after, "speech-master")


def test_scaling_never_changes_a_template():
    before = render(sample("speech"))
    doc = sample("speech")
    doc["spec"]["stages"][1]["replicas"] = 5
    after = render(doc)
    assert after[("Deployment", "speech-talker")]["spec"]["replicas"] == 5
    assert template_hash(before, "speech-talker") == template_hash(after, "speech-talker")


def test_scaling_the_masters_rolls_nothing_and_adds_a_pdb():
    one = render(sample("speech"))
    assert one[("Deployment", "speech-master")]["spec"]["replicas"] == 1  # the schema's default
    assert ("PodDisruptionBudget", "speech-master") not in one  # one master has no spare to keep
    doc = sample("speech")
    doc["spec"]["master"] = {"replicas": 3}
    three = render(doc)
    dep = three[("Deployment", "speech-master")]["spec"]
    assert dep["replicas"] == 3
    assert dep["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert three[("PodDisruptionBudget", "speech-master")]["spec"] == {
        "maxUnavailable": 1, "selector": {"matchLabels": dep["selector"]["matchLabels"]}}
    for name in ("speech-master", "speech-thinker", "speech-talker"):
        assert template_hash(one, name) == template_hash(three, name), name


def test_stages_find_every_master_through_a_headless_service():
    objs = render(sample("speech"))
    svc = objs[("Service", "speech-masters")]["spec"]
    master = objs[("Deployment", "speech-master")]["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    assert svc["selector"] == master["selector"]["matchLabels"]
    assert [p["port"] for p in svc["ports"]] == [C.MASTER_CONTROL_PORT]
    args = objs[("Deployment", "speech-thinker")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--master") + 1] == f"speech-masters.default.svc:{C.MASTER_CONTROL_PORT}"


def test_sampling_defaults_roll_the_master_not_the_stages():
    before = render(sample("speech"))
    doc = sample("speech")
    doc["spec"]["stages"][0]["samplingParams"]["temperature"] = 0.1
    after = render(doc)
    assert template_hash(before, "speech-master") != template_hash(after, "speech-master")
    assert after[("ConfigMap", "speech-config")] != before[("ConfigMap", "speech-config")]


def test_heartbeat_settings_roll_the_master_and_every_stage():
    before = render(sample("speech"))
    doc = sample("speech")
    doc["spec"]["heartbeat"] = {"intervalSeconds": 1, "timeoutSeconds": 5}
    after = render(doc)
    for name in ("speech-master", "speech-thinker", "speech-talker"):
        assert template_hash(before, name) != template_hash(after, name), name
    assert "timeoutSeconds: 5" in after[("ConfigMap", "speech-config")]["data"][C.CONFIG_FILE]


def test_a_pod_monitor_only_when_asked_for():
    assert not any(kind == "PodMonitor" for kind, _ in render(sample("speech")))
    doc = sample("speech")
    doc["spec"]["monitoring"] = {"podMonitor": True, "interval": "15s", "labels": {"release": "prom"}}
    objs = render(doc)
    pm = objs[("PodMonitor", "speech")]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["labels"]["release"] == "prom"
    assert pm["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert pm["spec"]["selector"] == {"matchLabels": {C.LABEL_PIPELINE: "speech"}}
    master, stages = pm["spec"]["podMetricsEndpoints"]
    # The master serves /metrics on its API port; its per-replica series keep their own `pod` label.
    assert (master["port"], master["path"], master["interval"], master["honorLabels"]) == ("http", "/metrics", "15s", True)
    assert (stages["port"], stages["path"], stages.get("honorLabels")) == ("metrics", "/metrics", None)
    assert stages["relabelings"] == [{"sourceLabels": ["__meta_kubernetes_pod_label_omnifleet_dev_pipeline"],
                                      "targetLabel": "pipeline"}]
    # Each named port exists on the pods it scrapes.
    master_ports = {p["name"] for p in objs[("Deployment", "speech-master")]["spec"]["template"]["spec"]
                    ["containers"][0]["ports"]}
    stage_ports = {p["name"] for p in objs[("Deployment", "speech-thinker")]["spec"]["template"]["spec"]
                   ["containers"][0]["ports"]}
    assert "http" in master_ports and "http" not in stage_ports and "metrics" in stage_ports
    doc["spec"]["monitoring"]["podMonitor"] = False
    assert ("PodMonitor", "speech") not in render(doc)


def test_autoscaled_stage_leaves_replicas_to_its_hpa():
    objs = render(sample("autoscaled"))
    dep = objs[("Deployment", "autoscaled-llm")]
    assert "replicas" not in dep["spec"]
    hpa = objs[("HorizontalPodAutoscaler", "autoscaled-llm")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "autoscaled-llm"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 8)
    assert objs[("Deployment", "autoscaled-prep")]["spec"]["replicas"] == 1
    assert ("HorizontalPodAutoscaler", "autoscaled-prep") not in objs


def test_cpu_stage_has_no_gpu_limit_or_toleration():
    objs = render(sample("autoscaled"))
    pod = objs[("Deployment", "autoscaled-prep")]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"].get("limits", {})
    assert "tolerations" not in pod


def test_pods_meet_restricted_pod_security():
    for obj in render(sample("speech")).values():
        if obj["kind"] != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert all("hostPath" not in v for v in pod["volumes"])


def test_config_map_holds_what_the_runtime_parses():
    from omnifleet_runtime.validate import load_pipeline

    cm = render(sample("speech"))[("ConfigMap", "speech-config")]
    doc = load_pipeline(yaml.safe_load(cm["data"][C.CONFIG_FILE]))
    talker = doc.spec.stage("talker")
    assert talker.replicas == 2 and talker.gpus == 1 and talker.model == "/models/Qwen2.5-Omni-7B"
    assert doc.spec.stage("code2wav").effective_input_mode() == "stream"


def test_namespace_flows_into_master_address():
    doc = sample("single")
    doc["metadata"]["namespace"] = "ml"
    objs = render(doc)
    args = objs[("Deployment", "chat-llm")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-1] == "chat-masters.ml.svc:5570"  # the headless Service: every master
    assert all(o["metadata"]["namespace"] == "ml" for o in objs.values())


def test_network_policy_admits_zmq_only_from_the_pipeline():
    np = render(sample("speech"))[("NetworkPolicy", "speech")]
    internal, public = np["spec"]["ingress"]
    assert internal["from"] == [{"podSelector": {"matchLabels": {C.LABEL_PIPELINE: "speech"}}}]
    assert {p["port"] for p in internal["ports"]} == {"zmq-control", "zmq-data", "zmq-data-1", "zmq-bulk",
                                                      "zmq-bulk-1"}
    assert "from" not in public and {p["port"] for p in public["ports"]} == {"http", "health", "metrics"}


def test_bulk_ports_only_with_the_curve_data_plane():
    doc = sample("speech")
    doc["spec"].setdefault("security", {})["dataPlane"] = "plain-auth"  # nothing sealed: no bulk port
    objs = render(doc)
    c = objs[("Deployment", "speech-talker")]["spec"]["template"]["spec"]["containers"][0]
    assert not [p for p in c["ports"] if p["name"].startswith("zmq-bulk")]
    assert {p["name"] for p in objs[("Service", "speech-talker")]["spec"]["ports"]} == {"zmq-data", "zmq-data-1"}
    internal = objs[("NetworkPolicy", "speech")]["spec"]["ingress"][0]
    assert {p["port"] for p in internal["ports"]} == {"zmq-control", "zmq-data", "zmq-data-1"}


def test_a_pod_of_the_most_stages_a_pipeline_may_have_has_no_port_twice():
    """Co-located stage i listens on data port + i and bulk port + i: a pipeline's stage bound keeps the two
    ranges apart (and off the master's ports)."""
    doc = sample("speech")
    doc["spec"]["stages"] = [{"name": "s0", "type": "python", "entrypoint": "m:f", "finalOutput": "text"}] + [
        {"name": f"s{i}", "type": "python", "entrypoint": "m:f", "inputs": [f"s{i - 1}"], "colocateWith": "s0"}
        for i in range(1, MAX_STAGES)]
    objs = render(doc)
    c = objs[("Deployment", "speech-s0")]["spec"]["template"]["spec"]["containers"][0]
    ports = [p["containerPort"] for p in c["ports"]]
    assert len([p for p in c["ports"] if p["name"].startswith("zmq-")]) == 2 * MAX_STAGES
    assert len(ports) == len(set(ports))
    assert not {C.MASTER_CONTROL_PORT, C.MASTER_ADMIN_PORT} & set(ports)


def test_admin_port_is_declared_but_not_served_to_clients_and_keys_come_from_secrets():
    objs = render(sample("speech"))
    master = objs[("Deployment", "speech-master")]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "admin", "containerPort": C.MASTER_ADMIN_PORT, "protocol": "TCP"} in master["ports"]
    assert "admin" not in {p["name"] for p in objs[("Service", "speech-master")]["spec"]["ports"]}
    assert not any(e["name"] in (C.ENV_API_KEY, C.ENV_ADMIN_TOKEN) for e in master["env"])
    ingress = objs[("NetworkPolicy", "speech")]["spec"]["ingress"]
    assert not any(p["port"] == "admin" for rule in ingress for p in rule["ports"])

    doc = sample("speech")
    operators = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "omnifleet-system"}}}
    doc["spec"]["master"] = {"apiKeySecret": {"name": "speech-keys", "key": "api-key"},
                             "adminTokenSecret": {"name": "speech-admin", "key": "token"},
                             "adminSources": [operators]}
    objs = render(doc)
    master = objs[("Deployment", "speech-master")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in master["env"]}
    assert env[C.ENV_API_KEY]["valueFrom"] == {"secretKeyRef": {"name": "speech-keys", "key": "api-key"}}
    assert env[C.ENV_ADMIN_TOKEN]["valueFrom"] == {"secretKeyRef": {"name": "speech-admin", "key": "token"}}
    *_, admin = objs[("NetworkPolicy", "speech")]["spec"]["ingress"]
    assert admin == {"from": [operators], "ports": [{"protocol": "TCP", "port": "admin"}]}


def test_no_owner_reference_without_uid():
    objs = render(copy.deepcopy(sample("single")), uid=None)
    assert all("ownerReferences" not in o["metadata"] for o in objs.values())


def test_registration_hashes_agree_with_what_rolls():
    """A stage is admitted by the master when both hold the same routing view of it.

    Whatever a spec change does, every stage whose routing hash changed must
    have its pods rolled, and so must the master: else one side keeps an
    older view and registration is refused for good.
    """
    from omnifleet_runtime.config import config_hash

    def parsed(doc):
        return check_document(doc)[0]

    base_doc = sample("speech")
    changes = {
        "engine-args": lambda d: d["spec"]["stages"][0]["engineArgs"].update(max_num_seqs=1),
        "processor": lambda d: d["spec"]["stages"][1].update(inputProcessor="pkg:other"),
        "input-mode": lambda d: d["spec"]["stages"][2].update(inputMode="whole"),
        "replicas": lambda d: d["spec"]["stages"][1].update(replicas=7),
    }
    for label, change in changes.items():
        doc = sample("speech")
        change(doc)
        before, after = render(base_doc), render(doc)
        for s in parsed(doc).spec.stages:
            if config_hash(parsed(base_doc), s.name) != config_hash(parsed(doc), s.name):
                host = s.colocate_with or s.name
                assert template_hash(before, f"speech-{host}") != template_hash(after, f"speech-{host}"), label
                assert template_hash(before, "speech-master") != template_hash(after, "speech-master"), label


def test_pod_annotations_reach_the_pod_templates_and_the_operators_own_keys_are_refused():
    doc = {"apiVersion": "omnifleet.dev/v1alpha1", "kind": "OmniPipeline", "metadata": {"name": "p"},
           "spec": {"model": "/models/m", "master": {"podAnnotations": {"a": "1"}}, "stages": [
               {"name": "llm", "type": "llm", "gpus": 1, "podAnnotations": {"karpenter.sh/do-not-disrupt": "true"}},
               {"name": "tts", "type": "python", "entrypoint": "omnifleet_runtime.stock:passthrough",
                "colocateWith": "llm", "inputs": ["llm"], "finalOutput": "text",
                "podAnnotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}}]}}
    parsed, problems = check_document(doc)
    assert problems == []
    deps = {o["metadata"]["name"]: o for o in desired(parsed) if o["kind"] == "Deployment"}
    stage_ann = deps["p-llm"]["spec"]["template"]["metadata"]["annotations"]
    assert stage_ann["karpenter.sh/do-not-disrupt"] == "true"
    assert stage_ann["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"  # the co-located stage's too
    assert deps["p-master"]["spec"]["template"]["metadata"]["annotations"]["a"] == "1"
    doc["spec"]["stages"][0]["podAnnotations"] = {"omnifleet.dev/config-hash": "x"}
    _, problems = check_document(doc)
    assert [(p.path, p.message) for p in problems] == [
        ("spec.stages[0].podAnnotations", "'omnifleet.dev/config-hash': omnifleet.dev/ annotations are the operator's")]


def autoscaled_pipeline(**host_autoscaling) -> dict:
    return {"apiVersion": "omnifleet.dev/v1alpha1", "kind": "OmniPipeline", "metadata": {"name": "auto"},
            "spec": {"stages": [
                {"name": "llm", "type": "python", "entrypoint": "omnifleet_runtime.stock:passthrough",
                 "autoscaling": {"maxReplicas": 4, "targetInflight": 6}, "finalOutput": "text"},
                {"name": "talker", "type": "python", "entrypoint": "omnifleet_runtime.stock:passthrough",
                 "inputs": ["llm"], "autoscaling": {"maxReplicas": 8, **host_autoscaling}},
                {"name": "vocoder", "type": "python", "entrypoint": "omnifleet_runtime.stock:passthrough",
                 "inputs": ["talker"], "colocateWith": "talker", "finalOutput": "audio"},
            ]}}


def hpa_metric(objs, name: str) -> dict:
    (metric,) = objs[("HorizontalPodAutoscaler", name)]["spec"]["metrics"]
    assert metric["type"] == "Pods"
    return metric["pods"]


def test_an_hpa_holds_the_metric_its_stages_mean():
    from omnifleet_runtime.schema import AUTOSCALING_METRICS

    objs = render(autoscaled_pipeline())
    # An LLM-like stage: requests in flight per replica, its own series.
    assert hpa_metric(objs, "auto-llm") == {
        "metric": {"name": "omnifleet_worker_inflight", "selector": {"matchLabels": {"stage": "llm"}}},
        "target": {"type": "AverageValue", "averageValue": "6"}}
    # A pod that makes audio: the real-time factor of its audio stage (co-located with the host), 0.5.
    assert hpa_metric(objs, "auto-talker") == {
        "metric": {"name": "omnifleet_worker_realtime_factor", "selector": {"matchLabels": {"stage": "vocoder"}}},
        "target": {"type": "AverageValue", "averageValue": "500m"}}
    # Chosen: queue depth with a target of its own.
    pods = hpa_metric(render(autoscaled_pipeline(metric="queueDepth", target=3)), "auto-talker")
    assert pods["metric"]["name"] == "omnifleet_worker_queue_depth" and pods["target"]["averageValue"] == "3"
    assert pods["metric"]["selector"] == {"matchLabels": {"stage": "talker"}}
    # Every series an HPA can name is one the adapter rules we ship serve.
    rules = yaml.safe_load((REPO / "manifests" / "monitoring" / "prometheus-adapter-rules.yaml").read_text())
    served = {r["name"]["as"] for r in rules["rules"]}
    assert set(AUTOSCALING_METRICS.values()) == served
    # ... and so does the operator's own custom.metrics.k8s.io server.
    from omnifleet_operator.metricsapi import POD_METRICS
    assert POD_METRICS == served


def test_a_stage_that_scales_to_zero_scales_on_the_masters_demand():
    from omnifleet_operator.render import master_view

    doc = autoscaled_pipeline(metric="inflight", minReplicas=0)
    objs = render(doc)
    spec = objs[("HorizontalPodAutoscaler", "auto-talker")]["spec"]
    assert spec["minReplicas"] == 0
    assert spec["metrics"] == [{"type": "Object", "object": {
        "describedObject": {"apiVersion": "v1", "kind": "Service", "name": "auto-master"},
        "metric": {"name": "omnifleet_stage_demand", "selector": {"matchLabels": {"stage": "talker"}}},
        "target": {"type": "AverageValue", "averageValue": "4"}}}]
    # The masters learn which stages may be at zero; scaling edits (maxReplicas) do not roll them.
    checked, problems = check_document(doc)
    assert not problems
    view = {s["name"]: s.get("autoscaling") for s in master_view(checked)["stages"]}
    assert view == {"llm": None, "talker": {"minReplicas": 0, "maxReplicas": 1, "metric": "inflight"},
                    "vocoder": None}
    doc["spec"]["stages"][1]["autoscaling"]["maxReplicas"] = 3
    assert master_view(check_document(doc)[0]) == master_view(checked)


def test_scale_down_stabilization_is_the_hpas_unless_set():
    objs = render(autoscaled_pipeline())
    assert "behavior" not in objs[("HorizontalPodAutoscaler", "auto-talker")]["spec"]  # the HPA's own 300 s
    objs = render(autoscaled_pipeline(scaleDownStabilizationSeconds=30))
    assert objs[("HorizontalPodAutoscaler", "auto-talker")]["spec"]["behavior"] == {
        "scaleDown": {"stabilizationWindowSeconds": 30}}
    _, problems = check_document(autoscaled_pipeline(scaleDownStabilizationSeconds=-1))
    assert [p.path for p in problems] == ["spec.stages[1].autoscaling.scaleDownStabilizationSeconds"], problems


def test_real_time_factor_needs_an_audio_stage_in_the_pod():
    doc = autoscaled_pipeline()
    doc["spec"]["stages"][0]["autoscaling"]["metric"] = "realTimeFactor"
    _, problems = check_document(doc)
    assert [str(p) for p in problems] == [
        "spec.stages[0].autoscaling.metric: realTimeFactor needs a stage in this stage's pods (itself or one "
        "co-located with it) whose finalOutput is audio"]


def test_the_rollout_policy_sets_every_stages_strategy_and_refuses_no_room_at_all():
    doc = sample("speech")
    default = render(doc)
    assert default[("Deployment", "speech-thinker")]["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 1, "maxUnavailable": 0}
    doc["spec"]["rollout"] = {"maxSurge": 0, "maxUnavailable": 1}  # no room for a surge pod
    objs = render(doc)
    for host in ("thinker", "talker"):
        dep = objs[("Deployment", f"speech-{host}")]
        assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
        # The policy is not in the pod template: changing it rolls no pod.
        assert template_hash(objs, f"speech-{host}") == template_hash(default, f"speech-{host}")
    doc["spec"]["rollout"] = {"maxSurge": 0}
    _, problems = check_document(doc)
    assert [(p.path, p.message) for p in problems] == [
        ("spec.rollout", "maxSurge and maxUnavailable cannot both be 0: the rollout could never start")]


def test_stage_revisions_change_with_what_a_stage_computes_not_with_scale():
    from omnifleet_runtime.config import stage_revisions
    from omnifleet_runtime.validate import load_pipeline

    doc = sample("speech")
    base = stage_revisions(load_pipeline(doc))
    scaled = copy.deepcopy(doc)
    for s in scaled["spec"]["stages"]:
        if "colocateWith" not in s:
            s["replicas"] = 5
        s["podAnnotations"] = {"team": "audio"}
    assert stage_revisions(load_pipeline(scaled)) == base
    changed = copy.deepcopy(doc)
    talker = next(s for s in changed["spec"]["stages"] if s["name"] == "talker")
    talker["engineArgs"] = {**talker.get("engineArgs", {}), "max_num_seqs": 3}
    after = stage_revisions(load_pipeline(changed))
    assert {s for s in base if after[s] != base[s]} == {"talker"}
    image = copy.deepcopy(doc)
    image["spec"]["image"] = "example.org/omnifleet:other"
    assert all(v != base[s] for s, v in stage_revisions(load_pipeline(image)).items())


def test_the_mounted_config_carries_the_pipelines_generation():
    from omnifleet_operator.reconcile import parse
    from omnifleet_runtime.validate import load_pipeline

    body = sample("speech")
    body["metadata"]["generation"] = 7
    parsed, problems = parse(body)
    assert problems == []
    text = next(o for o in desired(parsed) if o["kind"] == "ConfigMap")["data"][C.CONFIG_FILE]
    assert load_pipeline(yaml.safe_load(text)).metadata.generation == 7
