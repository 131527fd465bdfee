"""Never adopt: an object with a child's name that the pipeline does not control is left
untouched and named in status; the pipeline's keys Secret is its own, remade when deleted,
and its hash rolls the pods."""

from __future__ import annotations

from .kube import Kube, condition, load_sample, wait_for, with_namespace

KEYS_HASH = "omnifleet.dev/keys-hash"


def templates_hashes(kube: Kube, ns: str) -> set[str]:
    return {d["spec"]["template"]["metadata"].get("annotations", {}).get(KEYS_HASH)
            for d in kube.list("Deployment", ns, "omnifleet.dev/pipeline=chat")}


def test_a_foreign_object_is_left_untouched_and_named_then_keys_are_owned_and_rolled(kube: Kube, operator, ns: str):
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "chat-config", "namespace": ns},
               "data": {"owner": "someone else"}}
    kube.apply(foreign)
    before = kube.get("ConfigMap", ns, "chat-config")
    kube.apply(with_namespace(load_sample("single.yaml"), ns))

    p = kube.wait_condition(ns, "chat", "NameConflict")
    ready = condition(p, "Ready")
    assert ready["status"] == "False" and "ConfigMap/chat-config" in ready["message"], ready
    assert condition(p, "Stalled")["status"] == "True"
    after = kube.get("ConfigMap", ns, "chat-config")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["data"] == {"owner": "someone else"} and not after["metadata"].get("ownerReferences")
    # Nothing else was created either: the pass touched nothing.
    assert kube.get("Deployment", ns, "chat-master") is None and kube.get("Secret", ns, "chat-keys") is None
    uid = p["metadata"]["uid"]
    wait_for(lambda: [e for e in kube.events(ns, uid) if e["reason"] == "NameConflict" and e["type"] == "Warning"],
             30, "a NameConflict warning event")

    # The owner removes its object: the pipeline comes up, with its own keys.
    kube.kubectl("delete", "configmap", "chat-config", "-n", ns)
    kube.wait_ready(ns, "chat", timeout=90)
    secret = kube.get("Secret", ns, "chat-keys")
    refs = secret["metadata"]["ownerReferences"]
    assert [(r["uid"], r["controller"]) for r in refs] == [(uid, True)]
    assert sorted(secret["data"]) == ["client.public", "client.secret", "server.public", "server.secret", "token"]
    config = kube.get("ConfigMap", ns, "chat-config")["data"]["pipeline.yaml"]
    assert all(v not in config for v in secret["data"].values())
    (first,) = templates_hashes(kube, ns)
    assert first

    # Deleting the Secret makes a new one, and the pods roll onto it.
    kube.kubectl("delete", "secret", "chat-keys", "-n", ns)
    renewed = wait_for(lambda: (s := kube.get("Secret", ns, "chat-keys")) and s["data"] != secret["data"] and s,
                       30, "a new keys Secret")
    # The stages roll onto them first; the master follows once their rollouts are complete.
    wait_for(lambda: templates_hashes(kube, ns) not in ({first}, {None}) and len(templates_hashes(kube, ns)) == 1,
             90, lambda: f"every pod template on the new keys (hashes now {templates_hashes(kube, ns)})")
    assert renewed["metadata"]["ownerReferences"][0]["uid"] == uid
    kube.wait_ready(ns, "chat", timeout=90)
