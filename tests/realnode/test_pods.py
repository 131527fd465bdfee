"""The operator's pods, for real: the tiny two-stage vLLM pipeline as an OmniPipeline on the real node.

Pods run the images built from the repo's Dockerfiles, in a namespace that
enforces Pod Security `restricted`, reached through the master Service
(`kubectl port-forward`), wired by the rendered Services, DNS names, ports,
probes, `/dev/shm` and NetworkPolicy. The tests run in file order on one
pipeline (loading two vLLM engines takes a minute on 2 cores).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import secrets
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from omnifleet_operator import render
from omnifleet_operator.devcluster import commands as dev
from omnifleet_operator.devcluster import node
from omnifleet_runtime import constants as C

from ..e2e.kube import Kube, condition, wait_for
from .conftest import PSA_RESTRICTED, REPO, describe_failure, make_namespace, model_claim, pod_logs, wait_ready

SAMPLE = REPO / "manifests" / "samples" / "tiny-vllm.yaml"
NAME = "tiny-vllm"
CHAT = [{"role": "user", "content": "Hello! How are you today?"}]
PLANNER = {"temperature": 1.0, "seed": 0, "max_tokens": 16}
WRITER = {"temperature": 1.0, "seed": 0, "max_tokens": 32}
LOAD_REQUESTS = 24  # bounded load: this many requests, at most LOAD_CONCURRENCY at once
LOAD_CONCURRENCY = 3


ADMIN_SECRET, ADMIN_TOKEN = f"{NAME}-admin", secrets.token_hex(16)


class Pipeline:
    def __init__(self, cluster, kube: Kube, namespace: str):
        self.cluster, self.kube, self.ns = cluster, kube, namespace
        self.forwards: dict[str, dev.PortForward] = {}

    def _forward(self, target: str, port: int) -> str:
        fwd = self.forwards.get(target)
        if fwd is None or not fwd.alive():
            if fwd is not None:
                fwd.stop()
            fwd = self.forwards[target] = dev.PortForward(self.cluster, self.ns, target, port)
        return fwd.url

    @property
    def url(self) -> str:
        return self._forward(f"svc/{NAME}-master", C.MASTER_API_PORT)

    @property
    def admin_url(self) -> str:
        # The admin port is not on the Service: through the pod, with the token.
        return self._forward(f"deploy/{NAME}-master", C.MASTER_ADMIN_PORT)

    def post(self, path: str, body: dict, timeout: float = 120, admin: bool = False) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if admin:
            headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        req = urllib.request.Request(f"{self.admin_url if admin else self.url}{path}", data=json.dumps(body).encode(),
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, {"raw": raw.decode(errors="replace")}

    def chat(self) -> tuple[int, dict]:
        return self.post("/v1/chat/completions", {"model": NAME, "messages": CHAT, "return_token_ids": True})

    def control(self, stage: str, method: str, args: dict) -> list:
        answers = self.answers(stage, method, args)
        assert answers and all(a["ok"] for a in answers), answers
        return [a["result"] for a in answers]

    def answers(self, stage: str, method: str, args: dict) -> list:
        status, body = self.post(f"/v1/stages/{stage}/control", {"method": method, "args": args, "timeout": 120},
                                 admin=True)
        assert status == 200, body
        return list(body["replicas"].values())

    def expected(self) -> tuple[str, list[int]]:
        """The writer's text and tokens from the two engines called directly (each replica: all must agree)."""
        planned = self.control("planner", "generate", {"prompts": [CHAT], "sampling_params": PLANNER})
        texts = {r["outputs"][0]["text"] for r in planned}
        assert len(texts) == 1, planned
        written = self.control("writer", "generate", {"prompts": [texts.pop()], "sampling_params": WRITER})
        outs = {(r["outputs"][0]["text"], tuple(r["outputs"][0]["token_ids"])) for r in written}
        assert len(outs) == 1, written
        text, ids = outs.pop()
        return text, list(ids)

    def pods(self, selector: str = "") -> list[dict]:
        sel = f"omnifleet.dev/pipeline={NAME}" + (f",{selector}" if selector else "")
        return [p for p in self.kube.list("Pod", self.ns, sel) if not p["metadata"].get("deletionTimestamp")]

    def close(self) -> None:
        for fwd in self.forwards.values():
            fwd.stop()


@contextlib.contextmanager
def deployed(cluster, kube: Kube, model_dir: Path, slug: str = "tiny-vllm",
             master_env: dict[str, str] | None = None) -> Iterator[Pipeline]:
    """The tiny pipeline, Ready, in a new namespace enforcing `restricted`; the namespace is deleted
    afterwards, so the next module's pipeline does not share the cores with this one's engines.
    master_env: spec.master.env, added to the sample's."""
    ns = make_namespace(cluster, slug, PSA_RESTRICTED)
    model_claim(cluster, ns, model_dir)
    cluster.kubectl("create", "secret", "generic", ADMIN_SECRET, "-n", ns, f"--from-literal=token={ADMIN_TOKEN}")
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["spec"].setdefault("master", {})["adminTokenSecret"] = {"name": ADMIN_SECRET, "key": "token"}
    doc["spec"]["master"].setdefault("env", []).extend({"name": k, "value": v} for k, v in (master_env or {}).items())
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    p = Pipeline(cluster, kube, ns)
    try:
        wait_ready(kube, cluster, ns, NAME)
        yield p
    finally:
        p.close()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def pipe(cluster, kube, model_dir: Path):
    with deployed(cluster, kube, model_dir) as p:
        yield p


def load(p: Pipeline, n: int = LOAD_REQUESTS, during=None) -> list[tuple[int, dict]]:
    """n chats, LOAD_CONCURRENCY at a time; `during()` runs once the first answer came back."""
    out: list[tuple[int, dict]] = []
    with cf.ThreadPoolExecutor(LOAD_CONCURRENCY) as pool:
        futures = [pool.submit(p.chat) for _ in range(n)]
        if during is not None:
            next(cf.as_completed(futures))
            during()
        for f in futures:
            out.append(f.result(timeout=300))
    return out


def check_outcomes(results: list[tuple[int, dict]], text: str, ids: list[int]) -> dict[str, int]:
    """Every answer is exact or a clear error; returns the counts."""
    counts: dict[str, int] = {}
    for status, body in results:
        if status == 200:
            choice = body["choices"][0]
            assert choice["message"]["content"] == text and choice["token_ids"] == ids, body
            counts["ok"] = counts.get("ok", 0) + 1
        else:
            msg = json.dumps(body)
            assert status in (502, 503, 504) and ("replica" in msg or "stage" in msg), (status, body)
            counts[str(status)] = counts.get(str(status), 0) + 1
    return counts


# ---------------------------------------------------------------------------------------------


def test_pods_run_on_the_real_node_under_restricted_pod_security(pipe: Pipeline, cluster):
    pods = pipe.pods()
    assert {p["metadata"]["labels"].get("omnifleet.dev/stage") or "master" for p in pods} == \
        {"master", "planner", "writer"}
    for p in pods:
        assert p["spec"]["nodeName"] == node.NODE_NAME
        assert p["status"]["phase"] == "Running"
        (c,) = p["spec"]["containers"]
        assert c["image"] == C.DEFAULT_IMAGE and c["securityContext"]["readOnlyRootFilesystem"] is True
        assert p["spec"]["securityContext"]["runAsNonRoot"] is True
        assert all(s["ready"] for s in p["status"]["containerStatuses"])
    # Enforcement is on: a pod that breaks `restricted` is refused in the same namespace.
    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "privileged", "namespace": pipe.ns},
           "spec": {"containers": [{"name": "c", "image": C.DEFAULT_IMAGE,
                                    "securityContext": {"privileged": True}}]}}
    r = cluster.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert r.returncode != 0 and "violates PodSecurity" in r.stderr, r.stderr


def test_tokens_through_the_master_service_equal_the_engines_own(pipe: Pipeline):
    text, ids = pipe.expected()
    assert len(ids) == WRITER["max_tokens"]
    for _ in range(2):  # seeded: the same answer every time
        status, body = pipe.chat()
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == text
        assert body["choices"][0]["token_ids"] == ids


def test_admin_calls_need_the_token_and_are_not_on_the_master_service(pipe: Pipeline):
    status, _ = pipe.post("/v1/stages/planner/control", {"method": "ping", "args": {}})  # the Service's port
    assert status == 404
    req = urllib.request.Request(f"{pipe.admin_url}/v1/stages")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 401
    assert pipe.control("planner", "ping", {}) and pipe.control("writer", "ping", {})
    assert pipe.post("/v1/stages/planner/control", {"method": "__class__", "args": {}}, admin=True)[0] == 400


def test_network_policy_keeps_zmq_ports_to_the_pipelines_own_pods(pipe: Pipeline, cluster, kube):
    """A pod outside the pipeline reaches the API port, not the control or data ports (kube-router enforces)."""
    outsider = make_namespace(cluster, "outsider")
    master = f"{NAME}-master.{pipe.ns}.svc.cluster.local"
    planner_ip = pipe.pods("omnifleet.dev/stage=planner")[0]["status"]["podIP"]
    script = (
        "import json, socket\n"
        "def probe(host, port):\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=4).close(); return 'open'\n"
        "    except OSError as e:\n"
        "        return type(e).__name__\n"
        f"print(json.dumps({{'api': probe({master!r}, {C.MASTER_API_PORT}), "
        f"'control': probe({master!r}, {C.MASTER_CONTROL_PORT}), "
        f"'data': probe({planner_ip!r}, {C.STAGE_DATA_PORT})}}))\n")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe", "namespace": outsider},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "probe", "image": C.DEFAULT_IMAGE, "command": ["python3", "-c", script],
               "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "runAsUser": 1000,
                                   "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}}]}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    done = wait_for(lambda: (p := kube.get("Pod", outsider, "probe")) and p["status"].get("phase") in
                    ("Succeeded", "Failed") and p, 90, "the probe pod to finish")
    logs = cluster.kubectl("logs", "-n", outsider, "probe").stdout
    assert done["status"]["phase"] == "Succeeded", logs
    seen = json.loads(logs.strip().splitlines()[-1])
    assert seen["api"] == "open", seen  # the API port is open to the cluster, as rendered
    assert seen["control"] != "open" and seen["data"] != "open", seen
    # The same ports from inside the pipeline work (its stages use them): the answer still comes back.
    assert pipe.chat()[0] == 200


def test_a_killed_stage_pod_under_load_retries_or_errors_and_its_replacement_serves(pipe: Pipeline, cluster, kube):
    text, ids = pipe.expected()
    cluster.kubectl("scale", "-n", pipe.ns, f"deploy/{NAME}-writer", "--replicas=2")  # as a user would: hand edit
    cluster.kubectl("patch", "-n", pipe.ns, f"omnip/{NAME}", "--type=json", "-p",
                    json.dumps([{"op": "add", "path": "/spec/stages/1/replicas", "value": 2}]))
    wait_for(lambda: len([p for p in pipe.pods("omnifleet.dev/stage=writer")
                          if all(s.get("ready") for s in p["status"].get("containerStatuses") or [{}])]) == 2,
             420, lambda: "two ready writers\n" + describe_failure(cluster, pipe.ns))
    wait_ready(kube, cluster, pipe.ns, NAME)
    victim = pipe.pods("omnifleet.dev/stage=writer")[0]["metadata"]["name"]

    def kill():
        # grace 0: the container is killed, as by a crash or an OOM kill (a graceful delete drains instead).
        cluster.kubectl("delete", "pod", "-n", pipe.ns, victim, "--grace-period=0", "--force", "--wait=false")

    results = load(pipe, during=kill)
    counts = check_outcomes(results, text, ids)
    assert sum(counts.values()) == LOAD_REQUESTS and counts.get("ok", 0) >= LOAD_REQUESTS // 2, counts
    print(f"killed writer pod {victim} under load: {counts}")
    # The replacement comes up and registers; answers are exact again, from both replicas.
    wait_for(lambda: len(pipe.pods("omnifleet.dev/stage=writer")) == 2
             and victim not in {p["metadata"]["name"] for p in pipe.pods("omnifleet.dev/stage=writer")}, 120,
             "the replacement writer pod")
    wait_ready(kube, cluster, pipe.ns, NAME)
    # Every registered writer answers, and there are two: a pod the ReplicaSet made and removed at once when
    # the hand scale was put back may still have registered while it went, and is lost meanwhile.
    wait_for(lambda: (a := pipe.answers("writer", "ping", {})) and len(a) == 2 and all(x["ok"] for x in a), 300,
             lambda: f"two writers registered with the master: {pipe.answers('writer', 'ping', {})}")
    assert pipe.expected() == (text, ids)
    assert check_outcomes([pipe.chat() for _ in range(4)], text, ids) == {"ok": 4}


def test_a_new_master_gets_the_stages_back_without_reloading_engines(pipe: Pipeline, cluster, kube):
    text, ids = pipe.expected()
    stages_before = {p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"]
                     for p in pipe.pods("omnifleet.dev/component=stage")}
    (master,) = pipe.pods("omnifleet.dev/component=master")
    cluster.kubectl("delete", "pod", "-n", pipe.ns, master["metadata"]["name"], "--wait=false")
    wait_for(lambda: [p for p in pipe.pods("omnifleet.dev/component=master")
                      if p["metadata"]["name"] != master["metadata"]["name"]
                      and all(s["ready"] for s in p["status"].get("containerStatuses") or [{"ready": False}])],
             180, "a new ready master pod")
    pipe.close()  # the port-forward followed the old pod; the next request opens a new one
    wait_for(lambda: _ready(pipe), 120, "the new master to have every stage registered")
    assert pipe.chat()[1]["choices"][0]["token_ids"] == ids
    stages_after = {p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"]
                    for p in pipe.pods("omnifleet.dev/component=stage")}
    assert stages_after == stages_before  # same pods, restartCount unchanged
    logs = pod_logs(cluster, pipe.ns, "omnifleet.dev/component=stage")
    for pod_name in stages_after:
        loads = [line for line in logs.splitlines() if pod_name in line and "engine loaded" in line]
        assert len(loads) == 1, (pod_name, loads)


def test_status_counts_registered_replicas_and_the_operator_reads_the_masters_ready(pipe: Pipeline, cluster, kube):
    """A stage pod is ready only while registered with the master, so the counts the status shows are
    registered replicas; the master's /ready answers through the API server's service proxy, as the
    operator reads it (with the operator's own permissions)."""
    got = kube.wait_condition(pipe.ns, NAME, "AllStagesReady", timeout=300)
    for stage in got["status"]["stages"]:
        assert stage["registeredReplicas"] == stage["desiredReplicas"] >= 1, stage

    def master_ready() -> dict:
        r = cluster.kubectl("get", "--raw", f"/api/v1/namespaces/{pipe.ns}/services/{NAME}-master:http/proxy/ready",
                            f"--as={dev.OPERATOR_USER}")
        return json.loads(r.stdout)

    # Replicas re-register with a master that was just replaced (the test before): the master's count
    # catches up with the status' (a pod's readiness lags its registration by a probe period).
    want = {s["name"]: s["registeredReplicas"] for s in got["status"]["stages"]}
    body = wait_for(lambda: (b := master_ready())["ready"] is True
                    and {k: v["registered"] for k, v in b["stages"].items()} == want and b, 120,
                    lambda: f"the master's /ready to count {want}: {master_ready()}")
    assert body["ready"] is True


def _ready(p: Pipeline) -> bool:
    try:
        with urllib.request.urlopen(f"{p.url}/ready", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_changing_one_stages_engine_args_rolls_only_that_stage_and_requests_complete(pipe: Pipeline, cluster, kube):
    text, ids = pipe.expected()
    before = {k: set(v) for k, v in kube.pods_by_component(pipe.ns, NAME).items()}
    doc = kube.pipeline(pipe.ns, NAME)
    writer = next(i for i, s in enumerate(doc["spec"]["stages"]) if s["name"] == "writer")
    args = {**doc["spec"]["stages"][writer]["engineArgs"], "max_num_seqs": 8}

    def roll():
        cluster.kubectl("patch", "-n", pipe.ns, f"omnip/{NAME}", "--type=json", "-p", json.dumps(
            [{"op": "replace", "path": f"/spec/stages/{writer}/engineArgs", "value": args}]))

    results = load(pipe, during=roll)
    counts = check_outcomes(results, text, ids)  # drained on SIGTERM: complete, or a clear error
    print(f"requests during the writer's rollout: {counts}")
    generation = kube.pipeline(pipe.ns, NAME)["metadata"]["generation"]
    wait_ready(kube, cluster, pipe.ns, NAME)
    kube.wait_ready(pipe.ns, NAME, timeout=420, generation=generation)
    after = {k: set(v) for k, v in kube.pods_by_component(pipe.ns, NAME).items()}
    assert after["planner"] == before["planner"] and after["master"] == before["master"]
    assert not (after["writer"] & before["writer"])  # every writer pod replaced
    wait_for(lambda: _ready(pipe), 120, "the master to see the new writers")
    assert check_outcomes([pipe.chat() for _ in range(3)], text, ids) == {"ok": 3}


def test_a_rollout_whose_other_stage_cannot_load_keeps_the_old_revision_whole_and_undoes_cleanly(
        pipe: Pipeline, cluster, kube):
    """Both stages change; the writer's new pods cannot load (a max_model_len past the model's). The
    planner's new pod loads and registers, and must wait, unready, for a writer of its revision: the old
    pods of both stages keep serving every request, none is removed. Undoing the change removes the new
    pods and leaves the very pods that served before."""
    text, ids = pipe.expected()
    before = kube.pods_by_component(pipe.ns, NAME)
    doc = kube.pipeline(pipe.ns, NAME)
    index = {s["name"]: i for i, s in enumerate(doc["spec"]["stages"])}
    old_args = {s["name"]: s["engineArgs"] for s in doc["spec"]["stages"]}

    def patch(args: dict[str, dict]) -> None:
        cluster.kubectl("patch", "-n", pipe.ns, f"omnip/{NAME}", "--type=json", "-p", json.dumps(
            [{"op": "replace", "path": f"/spec/stages/{index[s]}/engineArgs", "value": a} for s, a in args.items()]))

    def new_planner() -> dict | None:
        pods = [p for p in pipe.pods("omnifleet.dev/stage=planner") if p["metadata"]["name"] not in before["planner"]]
        return pods[0] if pods and all(c.get("started") for c in pods[0]["status"].get("containerStatuses")
                                       or [{"started": False}]) else None

    def planner_revisions() -> list[dict] | None:
        status = kube.pipeline(pipe.ns, NAME).get("status") or {}
        return next((s.get("revisions") for s in status.get("stages") or [] if s["name"] == "planner"), None)

    def master_ready() -> dict:
        with urllib.request.urlopen(f"{pipe.url}/ready", timeout=10) as r:
            return json.loads(r.read())

    patch({"planner": {**old_args["planner"], "max_num_seqs": 6},
           "writer": {**old_args["writer"], "max_model_len": 1_000_000}})
    try:
        name = wait_for(new_planner, 300, "the planner's new pod to load its engine")["metadata"]["name"]
        # Loaded and registered, and kept out of service while its revision has no writer, as long as we look.
        assert check_outcomes(load(pipe, n=9), text, ids) == {"ok": 9}
        planner = next(p for p in pipe.pods("omnifleet.dev/stage=planner") if p["metadata"]["name"] == name)
        assert not any(c["type"] == "Ready" and c["status"] == "True" for c in planner["status"]["conditions"]), planner
        now = kube.pods_by_component(pipe.ns, NAME)
        assert set(before["planner"]) <= set(now["planner"]) and set(before["writer"]) <= set(now["writer"]), now
        # The status lists the planner's pods per revision: the old one ready, the new (current) one not.
        n = len(before["planner"])
        wait_for(lambda: [(r["pods"], r["readyPods"], r["current"]) for r in planner_revisions() or []]
                 == [(n, n, False), (1, 0, True)],
                 60, lambda: f"the status to list the planner's revisions: {planner_revisions()}")
        # The master holds both planners, of two revisions, and still answers ready (the old one is whole).
        wait_for(lambda: len(master_ready()["stages"]["planner"].get("revisions", {})) == 2, 60,
                 lambda: f"the master to hold the planners of both revisions: {master_ready()}")
    finally:
        patch(old_args)  # undo, also after a failed check: the module's next tests need the pipeline whole
    generation = kube.pipeline(pipe.ns, NAME)["metadata"]["generation"]
    kube.wait_ready(pipe.ns, NAME, timeout=420, generation=generation)
    wait_for(lambda: kube.pods_by_component(pipe.ns, NAME) == before, 180, "the new pods to go")
    assert check_outcomes([pipe.chat() for _ in range(3)], text, ids) == {"ok": 3}


def test_deleting_the_keys_secret_rolls_every_pod_onto_new_keys_stages_first(pipe: Pipeline, cluster, kube):
    text, ids = pipe.expected()
    secret = f"{NAME}-keys"

    def keys() -> dict | None:
        r = cluster.kubectl("get", "secret", secret, "-n", pipe.ns, "-o", "json", check=False)
        return json.loads(r.stdout)["data"] if r.returncode == 0 else None

    old = keys()
    assert old and sorted(old) == sorted(C.KEY_FILES)
    before = {k: set(v) for k, v in kube.pods_by_component(pipe.ns, NAME).items()}
    results = load(pipe, during=lambda: cluster.kubectl("delete", "secret", secret, "-n", pipe.ns))
    print(f"requests while the keys were replaced: {check_outcomes(results, text, ids)}")
    new = wait_for(lambda: (k := keys()) and k != old and k, 60, "the operator to make new keys")
    want = render.secret_data_hash(new)

    def rolled() -> bool:
        pods = pipe.pods()
        return len(pods) == sum(len(v) for v in before.values()) and all(
            p["metadata"]["annotations"].get(C.ANNOTATION_KEYS_HASH) == want
            and all(s["ready"] for s in p["status"].get("containerStatuses") or [{"ready": False}]) for p in pods)

    wait_for(rolled, 600, lambda: "every pod on the new keys\n" + describe_failure(cluster, pipe.ns))
    after = {k: set(v) for k, v in kube.pods_by_component(pipe.ns, NAME).items()}
    assert all(not (after[k] & before[k]) for k in before), (before, after)  # every pod replaced
    pipe.close()  # the master pod is new: so are the port-forwards
    wait_for(lambda: _ready(pipe), 180, "the new master to have every stage registered")
    assert check_outcomes([pipe.chat() for _ in range(3)], text, ids) == {"ok": 3}


def test_a_stage_with_a_bad_model_path_says_why_in_its_pod_and_the_pipeline(cluster, kube, model_dir: Path):
    ns = make_namespace(cluster, "bad-model", PSA_RESTRICTED)
    model_claim(cluster, ns, model_dir)
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["name"] = "bad"
    doc["spec"]["stages"] = [{**doc["spec"]["stages"][0], "finalOutput": "text", "model": "/models/no-such-model"}]
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))

    def terminated():
        for p in kube.list("Pod", ns, "omnifleet.dev/stage=planner"):
            for cs in p["status"].get("containerStatuses") or []:
                t = (cs.get("lastState") or {}).get("terminated") or (cs.get("state") or {}).get("terminated")
                if t and t.get("message"):
                    return t
        return None

    t = wait_for(terminated, 300, lambda: "the stage container to exit\n" + describe_failure(cluster, ns))
    assert t["exitCode"] == 1
    assert "stage planner failed to start" in t["message"] and "/models/no-such-model" in t["message"], t
    got = kube.wait_condition(ns, "bad", "ContainerFailing", timeout=180)
    msg = condition(got, "Ready")["message"]
    assert "stage planner" in msg and "failed to start" in msg and "/models/no-such-model" in msg, msg


def test_the_operator_runs_in_the_cluster_from_its_image_with_one_leader(pipe: Pipeline, cluster, kube):
    ns = dev.OPERATOR_NAMESPACE
    pods = [p for p in kube.list("Pod", ns, "app.kubernetes.io/component=operator")
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == 2, pods
    for p in pods:
        assert p["spec"]["serviceAccountName"] == dev.OPERATOR_SA and p["spec"]["nodeName"] == node.NODE_NAME
        assert p["spec"]["containers"][0]["image"] == C.OPERATOR_IMAGE
    # Least privilege: what it may and may not do, as the API server judges it.
    sa = f"--as={dev.OPERATOR_USER}"
    can = lambda *a: cluster.kubectl("auth", "can-i", *a, sa, check=False).stdout.strip()  # noqa: E731
    assert can("create", "deployments", "-n", "default") == "yes"
    # Secrets: only through the keys Secrets it makes (its watch selects them by label; RBAC cannot say that).
    assert can("update", "secrets", "-n", "default") == "no"
    assert can("get", "nodes") == "no"
    assert can("create", "rolebindings", "-n", "default") == "no"
    assert can("create", "pods", "-n", "default") == "no"
    assert can("get", "services", "--subresource=proxy", "-n", "default") == "yes"  # the master's /ready, nothing more
    assert can("create", "services", "--subresource=proxy", "-n", "default") == "no"
    assert can("get", "pods", "--subresource=proxy", "-n", "default") == "no"
    assert can("update", "leases/omnifleet-operator", "-n", ns) == "yes"
    assert can("update", "leases/kube-scheduler", "-n", "kube-system") == "no"

    def holder() -> str | None:
        r = cluster.kubectl("get", "lease", "omnifleet-operator", "-n", ns, "-o", "json", check=False)
        return json.loads(r.stdout)["spec"].get("holderIdentity") if r.returncode == 0 else None

    leader = wait_for(holder, 60, "a replica to hold the lease")
    assert leader in {p["metadata"]["name"] for p in pods}
    # The leader goes away: the other replica takes over and reconciles (puts back a deleted child).
    cluster.kubectl("delete", "pod", "-n", ns, leader, "--wait=false")
    new = wait_for(lambda: (h := holder()) not in (None, leader) and h, 60, "another replica to take the lease")
    assert new in {p["metadata"]["name"] for p in pods} or new.startswith("omnifleet-operator-")
    cluster.kubectl("delete", "service", "-n", pipe.ns, f"{NAME}-master")
    wait_for(lambda: kube.get("Service", pipe.ns, f"{NAME}-master"), 90, "the new leader to put the Service back")
