"""The pipeline's keys Secret and the never-adopt rule of one reconcile pass.

`FakeApi` stands in for the API server's object store: these tests check the
pass's decisions (what it reads, writes and reports), which needs no server.
The same rules run against a real kube-apiserver in tests/e2e/test_conflicts.py.
"""

from __future__ import annotations

import asyncio
import base64
import copy

import zmq

from omnifleet_operator import curvekeys, render
from omnifleet_operator.reconcile import AppliedCache, Children, Exists, reconcile
from omnifleet_runtime import constants as C
from omnifleet_runtime.schema import OmniPipeline

UID = "uid-1"
BODY = {
    "apiVersion": C.API_VERSION, "kind": C.KIND,
    "metadata": {"name": "p", "namespace": "ns", "uid": UID, "generation": 1},
    "spec": {"stages": [{"name": "a", "type": "python", "entrypoint": "m:f", "finalOutput": "text"}]},
}


class FakeApi:
    """An in-memory object store with the calls reconcile makes (a stand-in for the API server)."""

    def __init__(self, objects=()):
        self.store = {(o["kind"], o["metadata"]["name"]): copy.deepcopy(o) for o in objects}
        self.applied: list[tuple[str, str]] = []
        self.refused: list[tuple[str, str]] = []  # create-only applies that found the name taken
        self.status = None

    async def get(self, obj):
        return copy.deepcopy(self.store.get((obj["kind"], obj["metadata"]["name"])))

    async def apply(self, obj, create_only=False):
        if create_only and (obj["kind"], obj["metadata"]["name"]) in self.store:
            self.refused.append((obj["kind"], obj["metadata"]["name"]))
            raise Exists(obj["kind"])
        self.applied.append((obj["kind"], obj["metadata"]["name"]))
        self.store[(obj["kind"], obj["metadata"]["name"])] = copy.deepcopy(obj)
        return len(self.applied)

    async def delete(self, obj):
        self.store.pop((obj["kind"], obj["metadata"]["name"]), None)

    async def write_status(self, namespace, name, status):
        self.status = status


def run(api, children=None):
    return asyncio.run(reconcile(api, BODY, children or Children()))


def ready_condition(status):
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def test_curve_keys_made_without_zmq_are_libzmq_keys():
    for _ in range(10):
        public, secret = curvekeys.curve_keypair()
        assert zmq.curve_public(secret.encode()) == public.encode()
    keys = curvekeys.pipeline_keys()
    assert sorted(keys) == sorted(C.KEY_FILES) and len(keys["token"]) == 64
    assert curvekeys.pipeline_keys()["server.secret"] != keys["server.secret"]


def test_first_pass_makes_the_keys_secret_and_stamps_its_hash_on_every_pod_template():
    api = FakeApi()
    run(api)
    secret = api.store[("Secret", "p-keys")]
    assert api.applied[0] == ("Secret", "p-keys")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == UID
    assert sorted(secret["data"]) == sorted(C.KEY_FILES)
    public = base64.b64decode(secret["data"]["client.public"])
    assert zmq.curve_public(base64.b64decode(secret["data"]["client.secret"])) == public
    digest = render.secret_data_hash(secret["data"])
    deployments = [o for k, o in api.store.items() if k[0] == "Deployment"]
    assert len(deployments) == 2
    for d in deployments:
        tpl = d["spec"]["template"]
        assert tpl["metadata"]["annotations"][C.ANNOTATION_KEYS_HASH] == digest
        assert {"name": "keys", "secret": {"secretName": "p-keys", "defaultMode": 0o440}} in tpl["spec"]["volumes"]
    config = api.store[("ConfigMap", "p-config")]["data"][C.CONFIG_FILE]
    for value in secret["data"].values():
        assert base64.b64decode(value).decode() not in config  # keys never land in the ConfigMap


def keys_hash(api, name):
    return api.store[("Deployment", name)]["spec"]["template"]["metadata"]["annotations"][C.ANNOTATION_KEYS_HASH]


def rolled(api, name):
    """What the Deployment controller reports once every pod runs the current template."""
    dep = api.store[("Deployment", name)]
    dep["metadata"]["generation"] = 2
    dep["status"] = {"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}


def test_changed_or_deleted_keys_roll_the_stages_then_the_master_kept_keys_roll_nothing():
    api = FakeApi()
    run(api)
    first = api.store[("Secret", "p-keys")]
    before = keys_hash(api, "p-master")
    assert keys_hash(api, "p-a") == before
    api.applied.clear()
    run(api, Children(objects=list(api.store.values())))
    assert api.applied == []  # an unchanged Secret: nothing written

    edited = copy.deepcopy(first)
    edited["data"]["token"] = base64.b64encode(b"0" * 64).decode()
    api.store[("Secret", "p-keys")] = edited
    run(api, Children(objects=list(api.store.values())))
    assert ("Secret", "p-keys") not in api.applied  # the edit is kept
    new = keys_hash(api, "p-a")
    assert new != before and keys_hash(api, "p-master") == before  # the stages roll first; the master waits
    api.applied.clear()
    run(api, Children(objects=list(api.store.values())))
    assert api.applied == [] and keys_hash(api, "p-master") == before  # still rolling: still waiting
    rolled(api, "p-a")
    run(api, Children(objects=list(api.store.values())))
    assert api.applied == [("Deployment", "p-master")] and keys_hash(api, "p-master") == new

    del api.store[("Secret", "p-keys")]
    run(api, Children(objects=list(api.store.values())))
    assert ("Secret", "p-keys") in api.applied and keys_hash(api, "p-a") not in (before, new)


def stage_pod(name, started, ready):
    return {"metadata": {"name": name, "labels": {C.LABEL_PIPELINE: "p", C.LABEL_STAGE: "a"}},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": "stage", "started": started, "state": {"running": {}}}]}}


def test_new_keys_move_the_master_once_the_stages_new_pods_have_loaded_their_engines():
    """A pod on new keys cannot register with the master on old ones, so it is never ready (ready means
    registered): the master moves when the surge pod has loaded its engine, not when the rollout ends."""
    api = FakeApi()
    run(api)
    before = keys_hash(api, "p-master")
    del api.store[("Secret", "p-keys")]
    run(api, Children(objects=list(api.store.values())))
    assert keys_hash(api, "p-a") != before and keys_hash(api, "p-master") == before
    dep = api.store[("Deployment", "p-a")]
    dep["metadata"]["generation"] = 2
    # the old pod and the surge pod on the new keys
    dep["status"] = {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 1, "readyReplicas": 1}
    old = stage_pod("p-a-old", started=True, ready=True)

    def pass_with(*pods):
        api.applied.clear()
        run(api, Children(objects=list(api.store.values()), pods=list(pods)))
        return keys_hash(api, "p-master")

    assert pass_with(old) == before  # the surge pod is not in the pod index yet
    assert pass_with(old, stage_pod("p-a-new", started=False, ready=False)) == before  # still loading
    assert api.applied == []
    assert pass_with(old, stage_pod("p-a-new", started=True, ready=False)) == keys_hash(api, "p-a")
    assert api.applied == [("Deployment", "p-master")]


def test_a_foreign_object_with_a_childs_name_is_left_untouched_and_named():
    """Unlabeled, so not in the watch: its name is found taken by the create-only apply, which writes
    nothing; what the pass made before that goes again, and no workload was made at all."""
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "p-config", "namespace": "ns"},
               "data": {"mine": "yes"}}
    api = FakeApi([foreign])
    out = run(api)
    assert out.applied == 0 and api.refused == [("ConfigMap", "p-config")]
    assert ("ConfigMap", "p-config") not in api.applied and ("Secret", "p-keys") in api.applied
    assert not [k for k in api.applied if k[0] == "Deployment"]
    assert api.store == {("ConfigMap", "p-config"): foreign}
    ready = ready_condition(api.status)
    assert (ready["status"], ready["reason"]) == ("False", "NameConflict")
    assert "ConfigMap/p-config" in ready["message"]
    assert out.events and out.events[0].reason == "NameConflict" and out.events[0].type == "Warning"


def test_a_pipeline_in_conflict_reads_the_taken_names_and_makes_nothing_until_they_are_free():
    """Making the keys and undoing them on every pass would be writes, and watch events queuing the
    pipeline again: once a name was found taken, the next pass reads it first."""
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "p-config", "namespace": "ns"},
               "data": {"mine": "yes"}}
    api, cache = FakeApi([foreign]), AppliedCache()
    asyncio.run(reconcile(api, BODY, Children(), cache=cache))
    assert api.refused == [("ConfigMap", "p-config")] and ("Secret", "p-keys") in api.applied
    made = len(api.applied)
    for _ in range(3):
        out = asyncio.run(reconcile(api, BODY, Children(), last_status=api.status, cache=cache))
        assert len(api.applied) == made and api.refused == [("ConfigMap", "p-config")]  # no write at all
        assert api.store == {("ConfigMap", "p-config"): foreign} and not out.steady
        assert "ConfigMap/p-config" in ready_condition(api.status)["message"]
    del api.store[("ConfigMap", "p-config")]  # its owner removes it
    out = asyncio.run(reconcile(api, BODY, Children(), last_status=api.status, cache=cache))
    assert ("ConfigMap", "p-config") in api.applied and ("Deployment", "p-master") in api.applied
    assert UID not in cache.conflicts


def test_an_object_owned_but_not_controlled_by_the_pipeline_is_a_conflict():
    doc = OmniPipeline.model_validate({k: BODY[k] for k in ("apiVersion", "kind", "spec")}
                                      | {"metadata": {"name": "p", "namespace": "ns"}})
    sa = render.build_service_account(doc, UID)
    sa["metadata"]["ownerReferences"][0]["controller"] = False
    secret = render.build_keys_secret(doc, curvekeys.pipeline_keys(), "someone-else")
    api = FakeApi([sa, secret])
    run(api, Children(objects=[sa, secret]))
    assert api.applied == []
    message = ready_condition(api.status)["message"]
    assert "ServiceAccount/p-runtime" in message and "Secret/p-keys" in message


def test_missing_or_bad_keys_are_refused_naming_the_file(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import pytest
    import yaml

    from omnifleet_runtime.security import Keys, KeysError

    with pytest.raises(KeysError, match="no keys directory .*nope"):
        Keys.load(tmp_path / "nope")
    good = curvekeys.write_key_files(tmp_path / "keys", curvekeys.pipeline_keys())
    assert Keys.load(good).client_public == (good / "client.public").read_bytes()
    (good / "server.public").write_text("not a key")
    with pytest.raises(KeysError, match="server.public does not hold a Z85-encoded 32-byte CURVE key"):
        Keys.load(good)
    (good / "server.public").write_text((good / "client.public").read_text())
    with pytest.raises(KeysError, match="server.secret and .*server.public are not one keypair"):
        Keys.load(good)

    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump(BODY))
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "omnifleet_runtime", "master", "--config", str(config),
                          "--keys-dir", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60,
                         cwd=repo, env={"PYTHONPATH": f"{repo}/runtime:{repo}/operator", "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "omnifleet: no keys directory" in out.stderr, out.stderr
