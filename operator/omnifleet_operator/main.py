"""`make run`: the main job.

1. validate the shipped samples (manifests/samples/*.yaml) and show what each renders to;
2. `omnifleet dev up`: a local control plane with fake GPU nodes, the operator
   installed with `kubectl apply -k manifests/` and running as its ServiceAccount;
3. create what the speech sample needs (its `omni-weights` PersistentVolumeClaim,
   bound to a static hostPath PersistentVolume) and apply the speech pipeline
   in namespace omnifleet-demo;
4. wait (bounded, with progress lines) until it is Ready and print the kubectl
   commands to watch it;
5. the data plane, for real (the cluster's pods are kwok fakes that run
   nothing): a tiny two-stage vLLM pipeline started as local processes by
   `omnifleet run` (localdemo.py; the first run installs vLLM's CPU build and
   makes the tiny model, with progress), and how to query it with curl and the
   `openai` client;
6. stay in the foreground until Ctrl-C / SIGTERM, then stop the local pipeline
   and `omnifleet dev down`, so stopping leaves nothing running.

`--exit-when-ready` ends after step 5 with one real request answered (and still
tears everything down unless `--keep-running`); `--skip-local` leaves out step 5.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import yaml

from .checks import check_document
from .devcluster import commands as dev
from .devcluster.cluster import DevCluster, DevClusterError
from .render import desired

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "manifests" / "samples"
SPEECH = SAMPLES / "speech.yaml"
NAMESPACE = "omnifleet-demo"
READY_TIMEOUT_S = 180.0


class Stop(Exception):
    """SIGTERM (or SIGINT) asked us to stop."""


def _on_signal(signum, _frame) -> None:
    raise Stop(signal.Signals(signum).name)


def validate_samples() -> int:
    failed = 0
    for path in sorted(SAMPLES.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        doc, problems = check_document(yaml.safe_load(path.read_text()))
        if problems:
            failed += 1
            print(f"{path.name}: invalid")
            for p in problems:
                print(f"  {p}")
            continue
        objs = desired(doc)
        kinds = ", ".join(f"{k} x{n}" for k, n in _count(o["kind"] for o in objs).items())
        print(f"{path.name}: pipeline {doc.metadata.name!r}: {len(doc.spec.stages)} stages -> {len(objs)} objects ({kinds})")
    return failed


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def deploy_speech(cluster: DevCluster, namespace: str) -> str:
    """Namespace, the weights volume, the pipeline; returns the pipeline's name."""
    name = yaml.safe_load(SPEECH.read_text())["metadata"]["name"]
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(ns))
    claim = yaml.safe_load(SPEECH.read_text())["spec"]["modelVolume"]["claimName"]
    for obj in dev.weights_volume(namespace, claim):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    print(f"created PersistentVolume {namespace}-{claim} and PersistentVolumeClaim {namespace}/{claim}", flush=True)
    cluster.kubectl("apply", "-n", namespace, "-f", str(SPEECH))
    print(f"applied {SPEECH.relative_to(REPO)} in namespace {namespace}", flush=True)
    return name


def wait_ready(cluster: DevCluster, namespace: str, name: str, timeout: float) -> bool:
    """Poll the pipeline, printing each change of its status; True once Ready."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        got = cluster.kubectl("get", "omnipipeline", name, "-n", namespace, "-o", "json", check=False)
        if got.returncode == 0:
            obj = json.loads(got.stdout)
            st = obj.get("status") or {}
            ready = next((c for c in st.get("conditions") or [] if c.get("type") == "Ready"), {})
            current = (st.get("observedGeneration") == obj["metadata"]["generation"] and ready.get("status") == "True")
            line = (f"{name}: phase={st.get('phase', '-')} ready={st.get('readyStages', '-')}"
                    + (f" ({st['message']})" if st.get("message") else ""))
            if line != last:
                print(f"  [{timeout - (deadline - time.monotonic()):5.1f}s] {line}", flush=True)
                last = line
            if current:
                return True
        time.sleep(1.0)
    return False


def print_howto(cluster: DevCluster, namespace: str, name: str) -> None:
    print(f"""
The {name} pipeline is Ready. In another terminal:

  export KUBECONFIG={cluster.kubeconfig}
  kubectl get omnip -n {namespace} -w
  kubectl describe omnip {name} -n {namespace}
  kubectl wait --for=condition=Ready omnip/{name} -n {namespace} --timeout=60s
  kubectl get deploy,svc,pdb,pods -n {namespace} -l omnifleet.dev/pipeline={name}
""", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnifleet_operator.main", description=__doc__.split("\n\n")[0])
    p.add_argument("--exit-when-ready", "--no-wait", action="store_true", dest="exit_when_ready",
                   help="stop once the pipeline is Ready instead of staying in the foreground")
    p.add_argument("--keep-running", action="store_true",
                   help="with --exit-when-ready: leave the cluster and operator running (stop them with "
                        "`omnifleet dev down`)")
    p.add_argument("--state-dir", type=Path, default=None, help="the dev cluster's state dir (default: the dev one)")
    p.add_argument("-n", "--namespace", default=NAMESPACE)
    p.add_argument("--timeout", type=float, default=READY_TIMEOUT_S, help="seconds to wait for Ready")
    p.add_argument("--skip-local", action="store_true",
                   help="skip the local data plane (a tiny two-stage vLLM pipeline run as plain processes)")
    args = p.parse_args(argv)

    print("== validating the samples", flush=True)
    if validate_samples():
        return 1
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    teardown = not (args.exit_when_ready and args.keep_running)
    code = 1
    try:
        print("== omnifleet dev up", flush=True)
        cluster = dev.up(args.state_dir)
        print(f"== deploying {SPEECH.name}", flush=True)
        name = deploy_speech(cluster, args.namespace)
        print(f"== waiting (up to {args.timeout:.0f}s) for {args.namespace}/{name} to be Ready", flush=True)
        if not wait_ready(cluster, args.namespace, name, args.timeout):
            print(f"{name} not Ready after {args.timeout:.0f}s; operator log "
                  f"{dev.OperatorProcess(cluster.state_dir).log}", file=sys.stderr)
            print(cluster.kubectl("describe", "omnipipeline", name, "-n", args.namespace, check=False).stdout,
                  file=sys.stderr)
            return 1
        print_howto(cluster, args.namespace, name)
        code = 0
        if not args.skip_local:
            # The cluster's pods are kwok fakes that run nothing; the data plane runs here, for real.
            print("== the data plane, locally: a tiny two-stage vLLM pipeline (`omnifleet run`)", flush=True)
            from . import localdemo

            code = localdemo.main(["--exit-when-ready"] if args.exit_when_ready else [])
            return code
        if args.exit_when_ready:
            return 0
        print("Running. Press Ctrl-C (or send SIGTERM) to stop; that runs `omnifleet dev down`.", flush=True)
        op = dev.OperatorProcess(cluster.state_dir)
        warned = False
        while True:
            time.sleep(5)
            if op.pid() is None and not warned:
                print(f"warning: the operator exited; log {op.log} (`omnifleet dev up` restarts it)", flush=True)
                warned = True
    except Stop as s:
        print(f"\n{s}: stopping", flush=True)
    except (DevClusterError, dev.build.BuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    finally:
        # A second Ctrl-C must not cut the teardown short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if teardown:
            print("== omnifleet dev down", flush=True)
            dev.down(args.state_dir)
    return code


if __name__ == "__main__":
    sys.exit(main())
