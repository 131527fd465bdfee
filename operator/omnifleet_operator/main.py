"""`make run`: the main job. The operator's own pods serve a real vLLM pipeline.

1. validate the shipped samples (manifests/samples/, including that every
   entrypoint and input processor they name exists) and show what each renders to;
2. `omnifleet dev up`: a local cluster with a real node (containerd, kubelet,
   kube-proxy, CoreDNS, a NetworkPolicy enforcer) and fake GPU nodes, the
   repo's images built and loaded into the node, and the operator running in
   the cluster from its own image as its least-privilege ServiceAccount;
3. the tiny seeded model (built once) on a PersistentVolume, and the
   `tiny-vllm` sample (two real vLLM stages on CPU) applied as an OmniPipeline
   in namespace omnifleet-demo;
4. wait (bounded, with progress lines) until the operator reports it Ready:
   its master and stage pods run on the real node;
5. `kubectl port-forward` to the master Service, answer one request through
   it, and print how to query it with curl and the `openai` client;
6. stay in the foreground until Ctrl-C / SIGTERM, then `omnifleet dev down`,
   so stopping leaves nothing running.

`--exit-when-ready` ends after step 5 (and still tears everything down unless
`--keep-running`). The same pipeline runs without a cluster as local
processes: `omnifleet run -f manifests/samples/local/tiny-vllm.yaml`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from .checks import check_callables, check_document
from .devcluster import commands as dev
from .devcluster.cluster import DevCluster, DevClusterError
from .render import desired

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "manifests" / "samples"
PIPELINE = SAMPLES / "tiny-vllm.yaml"
NAMESPACE = "omnifleet-demo"
READY_TIMEOUT_S = 900.0  # two vLLM engines loading on a 2-core machine, plus a first image pull
PROMPT = "Hello! How are you today?"


class Stop(Exception):
    """SIGTERM (or SIGINT) asked us to stop."""


def _on_signal(signum, _frame) -> None:
    raise Stop(signal.Signals(signum).name)


def validate_samples() -> int:
    failed = 0
    for path in sorted(SAMPLES.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        label = path.relative_to(SAMPLES)
        doc, problems = check_document(yaml.safe_load(path.read_text()))
        unchecked: list[str] = []
        if doc is not None:
            problems, unchecked = check_callables(doc)
        if problems:
            failed += 1
            print(f"{label}: invalid")
            for p in problems:
                print(f"  {p}")
            continue
        objs = desired(doc)
        kinds = ", ".join(f"{k} x{n}" for k, n in _count(o["kind"] for o in objs).items())
        print(f"{label}: pipeline {doc.metadata.name!r}: {len(doc.spec.stages)} stages -> {len(objs)} objects ({kinds})")
        for line in unchecked:
            print(f"  not checked: {line}")
    return failed


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def tiny_model() -> Path:
    """The tiny seeded model's directory (built once, with progress), and vLLM's wheels cached."""
    from . import localdemo

    return Path(localdemo.prepare())


def deploy(cluster: DevCluster, namespace: str, model_dir: Path) -> str:
    """Namespace, the model's volume and claim, the pipeline; returns the pipeline's name."""
    doc = yaml.safe_load(PIPELINE.read_text())
    name, claim = doc["metadata"]["name"], doc["spec"]["modelVolume"]["claimName"]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}))
    for obj in dev.weights_volume(namespace, claim, path=str(model_dir), size="1Gi"):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    print(f"PersistentVolume {namespace}-{claim} (hostPath {model_dir}) bound to claim {namespace}/{claim}", flush=True)
    cluster.kubectl("apply", "-n", namespace, "-f", str(PIPELINE))
    print(f"applied {PIPELINE.relative_to(REPO)} in namespace {namespace}", flush=True)
    return name


def wait_ready(cluster: DevCluster, namespace: str, name: str, timeout: float) -> bool:
    """Poll the pipeline, printing each change of its status and of its pods; True once Ready."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        got = cluster.kubectl("get", "omnipipeline", name, "-n", namespace, "-o", "json", check=False)
        if got.returncode == 0:
            obj = json.loads(got.stdout)
            st = obj.get("status") or {}
            ready = next((c for c in st.get("conditions") or [] if c.get("type") == "Ready"), {})
            current = (st.get("observedGeneration") == obj["metadata"]["generation"] and ready.get("status") == "True")
            pods = cluster.kubectl("get", "pods", "-n", namespace, "--no-headers", "-o",
                                   "custom-columns=N:.metadata.name,S:.status.phase,R:.status.containerStatuses[0].ready",
                                   check=False).stdout.split("\n")
            pod_line = ", ".join(" ".join(p.split()[1:]) + f" {p.split()[0].rsplit('-', 2)[0]}"
                                 for p in pods if p.strip())
            line = (f"{name}: phase={st.get('phase', '-')} ready={st.get('readyStages', '-')}"
                    + (f" ({ready.get('message')})" if ready.get("message") and not current else "")
                    + (f"; pods: {pod_line}" if pod_line else ""))
            if line != last:
                print(f"  [{timeout - (deadline - time.monotonic()):5.1f}s] {line}", flush=True)
                last = line
            if current:
                return True
        time.sleep(2.0)
    return False


def ask(url: str, model: str, timeout: float = 120) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}]}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def print_howto(cluster: DevCluster, namespace: str, name: str, url: str) -> None:
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": PROMPT}]})
    svc = f"svc/{name}-master"
    print(f"""
The {name} pipeline is Ready, served by the operator's pods on the real node. In another terminal:

  export KUBECONFIG={cluster.kubeconfig}
  kubectl get omnip,pods -n {namespace} -o wide
  kubectl describe omnip {name} -n {namespace}
  kubectl logs -n {namespace} deploy/{name}-writer

This job keeps `kubectl port-forward -n {namespace} {svc} PORT:8000` running at {url}:

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'
  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{json.dumps({**json.loads(body), 'stream': True})}'
  python -c 'from openai import OpenAI; c = OpenAI(base_url="{url}/v1", api_key="none"); \\
print(c.chat.completions.create(model="{name}", messages=[{{"role": "user", "content": "{PROMPT}"}}]).choices[0].message.content)'
  curl {url}/ready    curl {url}/metrics

Admin calls (/v1/stages, control RPCs) are on port 8001 of the master pod, not on its Service, and
want the token of spec.master.adminTokenSecret (see the README's Security section).
""", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnifleet_operator.main", description=__doc__.split("\n\n")[0])
    p.add_argument("--exit-when-ready", "--no-wait", action="store_true", dest="exit_when_ready",
                   help="stop after one answered request instead of staying in the foreground")
    p.add_argument("--keep-running", action="store_true",
                   help="with --exit-when-ready: leave the cluster running (stop it with `omnifleet dev down`)")
    p.add_argument("--state-dir", type=Path, default=None, help="the dev cluster's state dir (default: the dev one)")
    p.add_argument("-n", "--namespace", default=NAMESPACE)
    p.add_argument("--timeout", type=float, default=READY_TIMEOUT_S, help="seconds to wait for Ready")
    args = p.parse_args(argv)

    print("== validating the samples", flush=True)
    if validate_samples():
        return 1
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    teardown = not (args.exit_when_ready and args.keep_running)
    code = 1
    forward = None
    try:
        print("== the tiny model and vLLM's CPU wheels", flush=True)
        model_dir = tiny_model()
        print("== omnifleet dev up", flush=True)
        cluster = dev.up(args.state_dir, owned=teardown)  # a killed `make run` leaves nothing running
        print(f"== deploying {PIPELINE.relative_to(REPO)}", flush=True)
        name = deploy(cluster, args.namespace, model_dir)
        print(f"== waiting (up to {args.timeout:.0f}s) for {args.namespace}/{name} to be Ready", flush=True)
        if not wait_ready(cluster, args.namespace, name, args.timeout):
            print(f"{name} not Ready after {args.timeout:.0f}s", file=sys.stderr)
            print(cluster.kubectl("describe", "omnipipeline", name, "-n", args.namespace, check=False).stdout,
                  file=sys.stderr)
            print(cluster.kubectl("get", "pods", "-n", args.namespace, "-o", "wide", check=False).stdout,
                  file=sys.stderr)
            return 1
        forward = dev.PortForward(cluster, args.namespace, f"svc/{name}-master", 8000)
        url = forward.url
        t = time.monotonic()
        answer = ask(url, name)
        print(f"one request through the master Service answered in {time.monotonic() - t:.2f}s: {answer!r}",
              flush=True)
        print_howto(cluster, args.namespace, name, url)
        code = 0
        if args.exit_when_ready:
            return 0
        print("Running. Press Ctrl-C (or send SIGTERM) to stop; that runs `omnifleet dev down`.", flush=True)
        while True:
            time.sleep(5)
            if not forward.alive():
                print("the port-forward ended; starting it again", flush=True)
                forward.stop()
                forward = dev.PortForward(cluster, args.namespace, f"svc/{name}-master", 8000, port=forward.port)
    except Stop as s:
        print(f"\n{s}: stopping", flush=True)
    except (DevClusterError, dev.build.BuildError, dev.images.ImageError, dev.hostdeps.HostDepsError,
            urllib.error.URLError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    finally:
        # A second Ctrl-C must not cut the teardown short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if forward is not None:
            forward.stop()
        if teardown:
            print("== omnifleet dev down", flush=True)
            dev.down(args.state_dir)
    return code


if __name__ == "__main__":
    sys.exit(main())
