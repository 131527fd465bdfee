"""Least privilege of the operator's ServiceAccount, and Pod Security `restricted` for
what the operator renders (and for the operator's own pod)."""

from __future__ import annotations

import json
import re

import yaml

from .kube import OPERATOR_USER, REPO, Kube, render, wait_for, load_sample


def test_operator_role_is_least_privilege(kube: Kube):
    out = kube.kubectl("auth", "can-i", "--list", f"--as={OPERATOR_USER}").stdout
    rows = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()[1:] if line.strip()]
    resource_rows = [r for r in rows if not r[0].startswith("[")]
    url_rows = [r for r in rows if r[0].startswith("[")]
    assert resource_rows, out
    for r in resource_rows:
        resource, verbs = r[0], r[-1]
        assert "*" not in resource and "*" not in verbs, f"wildcard in: {r}"
    # Non-resource URLs are Kubernetes' own discovery defaults: read-only.
    assert all(r[-1] == "[get]" for r in url_rows), url_rows
    can = {r[0]: r[-1] for r in resource_rows}
    assert can["deployments.apps"] == "[get list watch create patch delete]"
    assert can["omnipipelines.omnifleet.dev"] == "[get list watch]"  # the spec is the user's
    assert can["omnipipelines.omnifleet.dev/status"] == "[get patch]"
    assert can["pods"] == "[get list watch]"
    # Each pipeline's keys Secret is the operator's to make, watch (a deleted one is remade) and roll on.
    assert can["secrets"] == "[get list watch create patch delete]"

    for args in (("update", "secrets"), ("update", "omnipipelines"), ("create", "clusterroles"), ("create", "pods"),
                 ("delete", "nodes")):
        r = kube.kubectl("auth", "can-i", *args, f"--as={OPERATOR_USER}", check=False)
        assert r.stdout.strip() == "no" and r.returncode == 1, (args, r.stdout, r.stderr)


def test_rendered_pods_pass_pod_security_restricted(kube: Kube, ns: str):
    kube.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted",
                 "pod-security.kubernetes.io/enforce-version=latest")
    objs = render(load_sample("speech.yaml"), ns)  # no owner: applied by hand, not by the operator
    kube.apply(objs)
    deployments = [o for o in objs if o["kind"] == "Deployment"]
    want = sum(d["spec"]["replicas"] for d in deployments)

    def pods():
        return kube.list("Pod", ns, "omnifleet.dev/pipeline=speech")

    wait_for(lambda: len(pods()) == want, 60,
             lambda: f"{want} pods created in a restricted namespace (have {len(pods())}; events: "
                     f"{[e['message'] for e in kube.list('Event', ns) if e['reason'] == 'FailedCreate'][:3]})")
    for d in deployments:
        rs = kube.list("ReplicaSet", ns, ",".join(f"{k}={v}" for k, v in d["spec"]["selector"]["matchLabels"].items()))
        assert all(not any(c["type"] == "ReplicaFailure" for c in r.get("status", {}).get("conditions") or [])
                   for r in rs), rs

    # Enforcement is on: a privileged pod is refused there.
    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "privileged", "namespace": ns},
           "spec": {"containers": [{"name": "c", "image": "busybox", "securityContext": {"privileged": True}}]}}
    r = kube.kubectl("create", "-f", "-", input=json.dumps(bad), check=False)
    assert r.returncode != 0 and 'violates PodSecurity "restricted:latest"' in r.stderr, r.stderr
    assert "privileged" in r.stderr


def test_operator_pod_passes_pod_security_restricted(kube: Kube):
    """The shipped operator Deployment's pod, in its own (restricted) namespace: a server-side dry run."""
    nsobj = kube.get("Namespace", None, "omnifleet-system")
    assert nsobj["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    dep = next(d for d in yaml.safe_load_all((REPO / "manifests" / "operator.yaml").read_text())
               if d and d["kind"] == "Deployment")
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "operator-dry-run", "namespace": "omnifleet-system",
                        "labels": dep["spec"]["template"]["metadata"]["labels"]},
           "spec": dep["spec"]["template"]["spec"]}
    r = kube.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
    assert r.returncode == 0, r.stderr
    assert "PodSecurity" not in r.stderr, r.stderr
