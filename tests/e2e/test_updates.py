"""Cases 3-5: spec changes roll only what they touch; replicas and autoscaling;
removing and re-adding a stage."""

from __future__ import annotations

from .kube import (
    Kube, Watch, condition, idle_period, key_of, load_sample, operator_writes, pipeline_doc,
    wait_for, weights, with_namespace, describe_writes,
)


def _state(obj: dict) -> tuple:
    st = obj.get("status") or {}
    ready = condition(obj, "Ready") or {}
    progressing = condition(obj, "Progressing") or {}
    return (st.get("observedGeneration"), ready.get("status"), ready.get("reason"), progressing.get("status"),
            st.get("phase"))


def test_engine_args_change_rolls_only_that_stage(kube: Kube, operator, ns: str):
    weights(kube, ns)
    kube.apply(with_namespace(load_sample("speech.yaml"), ns))
    p = kube.wait_ready(ns, "speech")
    uid, gen = p["metadata"]["uid"], p["metadata"]["generation"]
    before = kube.pods_by_component(ns, "speech")
    assert set(before) == {"master", "thinker", "talker"} and len(before["thinker"]) == 2
    events_before = {e["metadata"]["name"] for e in kube.events(ns, uid)}

    watch = Watch(kube, "omnipipeline", ns, "speech")
    try:
        wait_for(lambda: watch.objects, 30, "the watch's first object")
        kube.patch_json("omnipipeline", ns, "speech",
                        [{"op": "replace", "path": "/spec/stages/0/engineArgs/max_num_seqs", "value": 32}])
        new = kube.wait_ready(ns, "speech", generation=gen + 1)

        def rolled():
            now = kube.pods_by_component(ns, "speech")
            thinker = now.get("thinker", {})
            return now if len(thinker) == 2 and not set(thinker) & set(before["thinker"]) else None

        after = wait_for(rolled, 60, "the thinker pods replaced")
        new = kube.wait_ready(ns, "speech", generation=gen + 1)
    finally:
        seen = watch.stop()

    # Only the thinker rolled: the talker (with co-located code2wav) and the master kept their pods.
    assert after["talker"] == before["talker"]
    assert after["master"] == before["master"]
    assert set(after["thinker"]).isdisjoint(before["thinker"])

    # Status went Progressing, then Ready, at the new generation (order, not timing).
    states = [_state(o) for o in seen]
    new_gen = new["metadata"]["generation"]
    at_new = [s for s in states if s[0] == new_gen]
    assert at_new, states
    first = at_new[0]
    assert first[1] == "False" and first[3] == "True" and first[4] == "Progressing", states
    assert first[2] in ("RollingOut", "WaitingForReady"), states
    i_first = states.index(first)
    assert any(s[0] == new_gen and s[1] == "True" and s[4] == "Ready" for s in states[i_first + 1:]), states
    assert states[-1][1] == "True", states

    # ... and said so in Events: RollingOut (Normal) then Ready.
    new_events = [e for e in kube.events(ns, uid) if e["metadata"]["name"] not in events_before]
    reasons = [e["reason"] for e in new_events]
    assert "RollingOut" in reasons and "Ready" in reasons, reasons
    assert all(e["type"] == "Normal" for e in new_events if e["reason"] in ("RollingOut", "Ready")), new_events


def test_replicas_change_scales_without_rolling(kube: Kube, operator, ns: str):
    weights(kube, ns)
    kube.apply(with_namespace(load_sample("image.yaml"), ns))
    p = kube.wait_ready(ns, "image")
    before = kube.pods_by_component(ns, "image")
    assert len(before["dit"]) == 2
    kube.patch_json("omnipipeline", ns, "image", [{"op": "replace", "path": "/spec/stages/1/replicas", "value": 3}])
    p = kube.wait_ready(ns, "image", generation=p["metadata"]["generation"] + 1)
    dep = kube.get("Deployment", ns, "image-dit")
    assert dep["spec"]["replicas"] == 3
    assert dep["status"]["readyReplicas"] == 3
    dit = next(s for s in p["status"]["stages"] if s["name"] == "dit")
    # A stage pod is ready only while registered with the master: ready replicas are registered ones.
    assert (dit["desiredReplicas"], dit["readyReplicas"], dit["registeredReplicas"]) == (3, 3, 3)
    after = kube.pods_by_component(ns, "image")
    # Scale-only: the two existing pods stay, one is added; nothing else moved.
    assert set(before["dit"]).issubset(after["dit"]) and len(after["dit"]) == 3
    assert after["ar"] == before["ar"] and after["master"] == before["master"]


def test_autoscaled_stage_replicas_belong_to_the_hpa(kube: Kube, operator, cluster, ns: str):
    kube.apply(with_namespace(load_sample("autoscaled.yaml"), ns))
    kube.wait_ready(ns, "autoscaled")
    hpa = kube.get("HorizontalPodAutoscaler", ns, "autoscaled-llm")
    assert hpa is not None
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "autoscaled-llm"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 8)
    assert kube.get("HorizontalPodAutoscaler", ns, "autoscaled-prep") is None

    # The operator's field manager does not own the autoscaled Deployment's replicas ...
    dep = kube.get("Deployment", ns, "autoscaled-llm")
    ours = [m for m in dep["metadata"]["managedFields"] if m["manager"] == "omnifleet"]
    assert ours and all("f:replicas" not in m["fieldsV1"].get("f:spec", {}) for m in ours), ours
    # ... but does own the non-autoscaled one's.
    prep = kube.get("Deployment", ns, "autoscaled-prep")
    assert any("f:replicas" in m["fieldsV1"].get("f:spec", {}) for m in prep["metadata"]["managedFields"]
               if m["manager"] == "omnifleet")

    # Scale through the scale subresource, as an HPA does; the operator must not revert it.
    kube.kubectl("scale", "deployment", "autoscaled-llm", "-n", ns, "--replicas=3")
    wait_for(lambda: (kube.get("Deployment", ns, "autoscaled-llm")["status"].get("readyReplicas") == 3), 60,
             "autoscaled-llm scaled to 3 ready")
    p = kube.wait_ready(ns, "autoscaled")
    mark = cluster.audit_lines()
    idle_period(3, "an operator that owned replicas would scale the Deployment back to 1")
    dep = kube.get("Deployment", ns, "autoscaled-llm")
    assert dep["spec"]["replicas"] == 3 and dep["status"]["readyReplicas"] == 3
    touched = [w for w in operator_writes(cluster, mark, ns)
               if w["objectRef"].get("resource") == "deployments"]
    assert not touched, describe_writes(touched)
    p = kube.wait_ready(ns, "autoscaled")
    llm = next(s for s in p["status"]["stages"] if s["name"] == "llm")
    assert (llm["desiredReplicas"], llm["readyReplicas"]) == (3, 3)


def _grow_doc() -> dict:
    return pipeline_doc("grow", [
        {"name": "front", "type": "llm", "gpus": 1, "replicas": 1, "finalOutput": "text"},
        {"name": "back", "type": "python", "entrypoint": "omnifleet_runtime.stock:passthrough", "gpus": 0,
         "inputs": ["front"], "finalOutput": "text", "autoscaling": {"minReplicas": 1, "maxReplicas": 3}},
    ])


def test_remove_and_readd_stage(kube: Kube, operator, ns: str):
    doc = _grow_doc()
    kube.apply(with_namespace(doc, ns))
    p = kube.wait_ready(ns, "grow")
    gen = p["metadata"]["generation"]
    back_kinds = {("Deployment", "grow-back"), ("Service", "grow-back"), ("PodDisruptionBudget", "grow-back"),
                  ("HorizontalPodAutoscaler", "grow-back")}
    live = {key_of(o): o["metadata"]["uid"] for o in kube.children(ns, "grow")}
    assert back_kinds <= set(live)
    kept = {k: v for k, v in live.items() if k not in back_kinds and k[0] != "ConfigMap"}

    back = doc["spec"]["stages"][1]
    kube.patch_json("omnipipeline", ns, "grow", [{"op": "remove", "path": "/spec/stages/1"}])

    def back_gone():
        now = {key_of(o) for o in kube.children(ns, "grow")}
        return not (now & back_kinds)

    wait_for(back_gone, 60, "grow-back Deployment, Service, PDB and HPA deleted")
    kube.wait_ready(ns, "grow", generation=gen + 1)
    wait_for(lambda: "back" not in kube.pods_by_component(ns, "grow"), 60, "grow-back pods gone")
    now = {key_of(o): o["metadata"]["uid"] for o in kube.children(ns, "grow")}
    for k, uid in kept.items():  # the rest stayed (same objects)
        assert now.get(k) == uid, k

    kube.patch_json("omnipipeline", ns, "grow", [{"op": "add", "path": "/spec/stages/-", "value": back}])
    wait_for(lambda: back_kinds <= {key_of(o) for o in kube.children(ns, "grow")}, 60, "grow-back objects recreated")
    p = kube.wait_ready(ns, "grow", generation=gen + 2)
    again = {key_of(o): o["metadata"]["uid"] for o in kube.children(ns, "grow")}
    for k in back_kinds:
        assert again[k] != live[k], k  # new objects
    assert p["status"]["readyStages"] == "2/2"
