"""plan(): what a pass creates, applies, leaves pending, and deletes."""

from omnifleet_operator.reconcile import AppliedCache, Children, plan


def cm(name, data, rv=None, owner="u1"):
    meta = {"name": name, "namespace": "ns", "ownerReferences": [{"uid": owner}]}
    if rv is not None:
        meta["resourceVersion"] = str(rv)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def test_missing_are_created_drifted_applied_and_removed_deleted():
    desired = [cm("a", {"k": "1"}), cm("b", {"k": "2"})]
    live = Children(objects=[cm("b", {"k": "changed"}, rv=5), cm("old", {}, rv=3), cm("foreign", {}, rv=4, owner="u2")])
    p = plan(desired, live, "u1")
    assert [o["metadata"]["name"] for o in p.create] == ["a"]
    assert [o["metadata"]["name"] for o in p.apply] == ["b"]
    assert [o["metadata"]["name"] for o in p.delete] == ["old"]


def test_own_write_not_yet_seen_is_pending_not_applied_again():
    cache = AppliedCache()
    want = cm("a", {"k": "2"})
    cache.record(want, 10)
    # The watch still shows the object from before our write (rv 7), or nothing yet.
    assert plan([want], Children(objects=[cm("a", {"k": "1"}, rv=7)]), "u1", cache).pending == [want]
    assert plan([want], Children(objects=[]), "u1", cache).pending == [want]
    # Once it shows our write or a later one, the normal comparison decides.
    p = plan([want], Children(objects=[cm("a", {"k": "2"}, rv=10)]), "u1", cache)
    assert p.apply == [] and p.pending == []
    p = plan([want], Children(objects=[cm("a", {"k": "hand-edited"}, rv=12)]), "u1", cache)
    assert p.apply == [want]
    # A different desired object is never pending; a deleted one is made again.
    assert plan([cm("a", {"k": "3"})], Children(objects=[]), "u1", cache).create
    cache.forget(("v1", "ConfigMap", "ns", "a"))
    assert plan([want], Children(objects=[]), "u1", cache).create == [want]


# -- a rollout with no room for its surge pod goes on one replica at a time --

def _stage_pod(stage, template_hash, unschedulable=False, n=0):
    conds = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}] if unschedulable else []
    return {"metadata": {"name": f"{stage}-{template_hash}-{n}", "labels": {"omnifleet.dev/stage": stage},
                         "annotations": {"omnifleet.dev/template-hash": template_hash}},
            "status": {"conditions": conds}}


def test_a_rollout_without_room_for_its_surge_pod_trades_one_old_pod_at_a_time_and_never_a_lone_one():
    import copy

    import yaml

    from omnifleet_operator.checks import check_document
    from omnifleet_operator.reconcile import NO_ROOM, rollouts_without_room
    from omnifleet_operator.render import desired

    from ..conftest import REPO

    raw = yaml.safe_load((REPO / "manifests" / "samples" / "speech.yaml").read_text())
    hosts = [s for s in raw["spec"]["stages"] if "colocateWith" not in s]
    for s in hosts:
        s.pop("autoscaling", None)
        s["replicas"] = 2
    hosts[-1]["replicas"] = 1
    doc, problems = check_document(raw)
    assert problems == []

    def deployments():
        return {o["metadata"]["name"]: o for o in desired(doc) if o["kind"] == "Deployment" and "master" not in
                o["metadata"]["name"]}

    wanted = deployments()
    big, lone = (f"speech-{hosts[0]['name']}", hosts[0]["name"]), (f"speech-{hosts[-1]['name']}", hosts[-1]["name"])
    live = {}
    for name in (big[0], lone[0]):
        live[name] = copy.deepcopy(wanted[name])
        live[name]["spec"]["replicas"] = 2 if name == big[0] else 1
    new = wanted[big[0]]["spec"]["template"]["metadata"]["annotations"]["omnifleet.dev/template-hash"]
    lone_new = wanted[lone[0]]["spec"]["template"]["metadata"]["annotations"]["omnifleet.dev/template-hash"]
    pods = [_stage_pod(big[1], "old", n=i) for i in range(2)] + [_stage_pod(big[1], new, unschedulable=True)]
    pods += [_stage_pod(lone[1], "old"), _stage_pod(lone[1], lone_new, unschedulable=True)]
    children = Children(objects=list(live.values()), pods=pods)

    want = list(wanted.values())
    assert rollouts_without_room(want, children) == [big[0]]  # the lone replica's stage waits for room
    assert wanted[big[0]]["spec"]["strategy"]["rollingUpdate"] == NO_ROOM
    assert wanted[lone[0]]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}

    # Applied: the policy holds while the rollout goes on (the new pod found the freed node) ...
    live[big[0]]["spec"]["strategy"]["rollingUpdate"] = dict(NO_ROOM)
    pods[2] = _stage_pod(big[1], new)
    wanted = deployments()
    assert rollouts_without_room(list(wanted.values()), children) == []
    assert wanted[big[0]]["spec"]["strategy"]["rollingUpdate"] == NO_ROOM
    # ... and the spec's is back once every pod runs the new template.
    children.pods = [_stage_pod(big[1], new, n=i) for i in range(2)]
    wanted = deployments()
    rollouts_without_room(list(wanted.values()), children)
    assert wanted[big[0]]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
