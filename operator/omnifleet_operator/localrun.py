"""`omnifleet run -f pipeline.yaml`: the pipeline as local processes, no cluster.

The processes are the ones the operator would create: the renderer's
Deployments give each container's command, args and env, and the rendered
ConfigMap is the config file they read. What a cluster provides is mapped to
loopback: the master Service's DNS name becomes 127.0.0.1, the fixed ports
become free ones (stage data ports are picked by each stage process, so no
two replicas collide), and the downward-API env gets the local pod name.
Logs stream with a prefix per process. Ctrl-C drains and stops everything;
so does one process exiting, which is named.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from omnifleet_runtime import constants as C

from .checks import check_document
from .overrides import OverrideError, apply_overrides
from .render import desired

# `omnifleet ARGS` with the interpreter running this runner (the console script may not be installed).
OMNIFLEET = [sys.executable, "-c", "import sys; from omnifleet_operator.cli import main; sys.exit(main())"]
STOP_TIMEOUT_S = C.DRAIN_TIMEOUT_S + 10


@dataclass
class LocalProcess:
    name: str
    argv: list[str]
    env: dict[str, str]
    popen: subprocess.Popen | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_arg(args: list[str], flag: str, value: str) -> list[str]:
    """args with flag's value replaced (or the flag appended)."""
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def _env(container: dict[str, Any], pod: str, namespace: str, configmap: dict[str, str]) -> dict[str, str]:
    fields = {"metadata.name": pod, "metadata.namespace": namespace, "status.podIP": "127.0.0.1"}
    env = dict(os.environ)
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var.get("valueFrom", {})
        if "fieldRef" in source and source["fieldRef"]["fieldPath"] in fields:
            env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source and source["configMapKeyRef"].get("key") in configmap:
            env[var["name"]] = configmap[source["configMapKeyRef"]["key"]]
        else:
            print(f"omnifleet run: {pod}: env {var['name']} comes from {sorted(source)}, which a local run "
                  f"cannot resolve; leaving it unset", file=sys.stderr)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def plan(doc_dict: dict[str, Any], workdir: Path) -> tuple[list[LocalProcess], int]:
    """The local processes for a pipeline document (master first), and the API port."""
    doc, problems = check_document(doc_dict)
    if doc is None:
        raise SystemExit("omnifleet run: invalid pipeline:\n  " + "\n  ".join(map(str, problems)))
    omni = [s.name for s in doc.spec.stages if s.type == "vllm-omni"]
    if omni:
        raise SystemExit(f"omnifleet run: stage(s) {', '.join(omni)} are vllm-omni stages, and this build has no "
                         f"vllm-omni engine (vLLM-Omni's stage engines are not wired in yet); such a pipeline "
                         f"validates and renders, it cannot run")
    objs = desired(doc)
    namespace = doc.metadata.namespace or "default"
    configmap = next(o for o in objs if o["kind"] == "ConfigMap")["data"]
    config = workdir / C.CONFIG_FILE
    config.write_text(configmap[C.CONFIG_FILE])
    api_port, control_port = free_port(), free_port()
    procs: list[LocalProcess] = []
    for dep in (o for o in objs if o["kind"] == "Deployment"):
        container = dep["spec"]["template"]["spec"]["containers"][0]
        component = dep["spec"]["template"]["metadata"]["labels"][C.LABEL_COMPONENT]
        args = _set_arg(container["args"], "--config", str(config))
        args = _set_arg(args, "--host", "127.0.0.1")
        if component == C.COMPONENT_MASTER:
            args = _set_arg(_set_arg(args, "--api-port", str(api_port)), "--control-port", str(control_port))
            replicas = 1
        else:
            args = _set_arg(args, "--master", f"127.0.0.1:{control_port}")  # the master Service's DNS name
            args = _set_arg(_set_arg(args, "--data-port", "0"), "--advertise-host", "127.0.0.1")
            # An autoscaled stage has no replicas field; run one.
            replicas = max(dep["spec"].get("replicas", 1), 1)
        for i in range(replicas):
            pod = f"{dep['metadata']['name']}-{i}"
            pod_args = args if component == C.COMPONENT_MASTER else _set_arg(args, "--health-port", str(free_port()))
            procs.append(LocalProcess(pod, OMNIFLEET + pod_args, _env(container, pod, namespace, configmap)))
    return procs, api_port


def _pump(proc: LocalProcess, width: int, lock: threading.Lock) -> None:
    for line in proc.popen.stdout:
        with lock:
            sys.stdout.write(f"{proc.name:<{width}} | {line.decode(errors='replace')}")
            sys.stdout.flush()


def _stop(procs: list[LocalProcess]) -> None:
    # Stages first, so they can deregister from a master that is still up.
    for group in (procs[1:], procs[:1]):
        live = [p for p in group if p.popen and p.popen.poll() is None]
        for p in live:
            p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in live:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"omnifleet run: {p.name} did not stop in time; killing it", file=sys.stderr)
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()


def _announce_ready(url: str, procs: list[LocalProcess]) -> None:
    """Say so once every stage has a registered replica (while every process still runs)."""
    while all(p.popen.poll() is None for p in procs):
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
                if resp.status == 200:
                    print(f"omnifleet run: ready at {url}", flush=True)
                    return
        except OSError:
            pass
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="omnifleet run", description="Run a pipeline locally as plain processes.")
    p.add_argument("-f", "--file", required=True, help="the OmniPipeline file")
    p.add_argument("overrides", nargs="*", metavar="PATH=VALUE",
                   help="overrides of the spec, e.g. stages.talker.replicas=2 (omegaconf dotlist values)")
    args = p.parse_args(argv)
    try:
        docs = [d for d in yaml.safe_load_all(Path(args.file).read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        print(f"omnifleet run: cannot read {args.file}: {e}", file=sys.stderr)
        return 2
    if len(docs) != 1:
        print(f"omnifleet run: {args.file} must hold exactly one pipeline (it has {len(docs)} documents)",
              file=sys.stderr)
        return 2

    try:
        doc = apply_overrides(docs[0], args.overrides)
    except OverrideError as e:
        print(f"omnifleet run: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="omnifleet-run-") as workdir:
        procs, api_port = plan(doc, Path(workdir))
        url = f"http://127.0.0.1:{api_port}"
        width = max(len(p.name) for p in procs)
        lock = threading.Lock()
        stopping = threading.Event()
        # Ctrl-C reaches only this runner (children have their own sessions), which stops them in order.
        old = signal.signal(signal.SIGINT, lambda *_: stopping.set())
        signal.signal(signal.SIGTERM, lambda *_: stopping.set())
        code = 0
        try:
            for proc in procs:
                proc.popen = subprocess.Popen(proc.argv, env=proc.env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, start_new_session=True)
                threading.Thread(target=_pump, args=(proc, width, lock), daemon=True).start()
            model = doc["metadata"]["name"]
            with lock:
                print(f"omnifleet run: {len(procs)} processes; API {url}\n"
                      f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
                      f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'",
                      flush=True)
            threading.Thread(target=_announce_ready, args=(url, procs), daemon=True).start()
            while not stopping.is_set():
                failed = next((p for p in procs if p.popen.poll() is not None), None)
                if failed is not None:
                    print(f"omnifleet run: {failed.name} exited with code {failed.popen.returncode}; "
                          f"stopping everything", file=sys.stderr, flush=True)
                    code = 1
                    break
                stopping.wait(0.2)
        finally:
            print("omnifleet run: stopping", file=sys.stderr, flush=True)
            _stop([p for p in procs if p.popen is not None])
            signal.signal(signal.SIGINT, old)
    return code
