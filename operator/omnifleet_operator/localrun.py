"""`omnifleet run -f pipeline.yaml`: the pipeline as local processes, no cluster.

The processes are the ones the operator would create: the renderer's
Deployments give each container's command, args and env, and the rendered
ConfigMap is the config file they read. What a cluster provides is mapped to
loopback: the masters' Service name becomes 127.0.0.1 (one master: its ports are fixed), the fixed ports
become free ones (stage data ports are picked by each stage process, so no
two replicas collide), and the downward-API env gets the local pod name.
Secrets are not at hand locally: the admin port gets a fresh token, printed
with its address, and an API key comes from $OMNIFLEET_API_KEY if set.
Logs stream with a prefix per process. Ctrl-C drains and stops everything;
so does one process exiting, which is named. Every process gets a parent-death
signal (SIGTERM: it drains and exits), so a runner killed any other way (kill -9,
an OOM kill, a closed terminal) leaves nothing running either.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
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
from omnifleet_runtime.lifetime import parent_death_preexec

from .overrides import OverrideError, apply_overrides
from .checks import PERMISSIVE, check_document
from .curvekeys import pipeline_keys, write_key_files
from .render import desired
from .ports import spare_port

# `omnifleet ARGS` with the interpreter running this runner (the console script may not be installed).
# Where omnifleet_runtime lives, for a stage run with another environment's python.
RUNTIME_SRC = Path(__file__).resolve().parents[2] / "runtime"
OMNIFLEET = [sys.executable, "-c", "import sys; from omnifleet_operator.cli import main; sys.exit(main())"]
STOP_TIMEOUT_S = C.DRAIN_TIMEOUT_S + 10
PUMP_DRAIN_S = 5.0  # for the output the stopped processes left in their pipes


@dataclass
class LocalProcess:
    name: str
    argv: list[str]
    env: dict[str, str]
    popen: subprocess.Popen | None = None
    metrics_url: str = ""


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


@dataclass
class Ports:
    api: int
    admin: int
    admin_token: str


def plan(doc_dict: dict[str, Any], workdir: Path) -> tuple[list[LocalProcess], Ports]:
    """The local processes for a pipeline document (master first), and where the master listens."""
    doc, problems = check_document(doc_dict, PERMISSIVE)  # nothing is mounted from a node or exposed here
    if doc is None:
        raise SystemExit("omnifleet run: invalid pipeline:\n  " + "\n  ".join(map(str, problems)))
    omni = {s.name for s in doc.spec.stages if s.type == "vllm-omni"}
    omni_python = _vllm_omni_python(sorted(omni)) if omni else None
    objs = desired(doc)
    namespace = doc.metadata.namespace or "default"
    configmap = next(o for o in objs if o["kind"] == "ConfigMap")["data"]
    config = workdir / C.CONFIG_FILE
    config.write_text(configmap[C.CONFIG_FILE])
    api_port, control_port = spare_port(), spare_port()
    # Ephemeral keys for this run: the local processes use CurveZMQ as pods do.
    keys = write_key_files(workdir / "keys", pipeline_keys())
    ports = Ports(api_port, spare_port(), os.environ.get(C.ENV_ADMIN_TOKEN) or secrets.token_urlsafe(24))
    procs: list[LocalProcess] = []
    for dep in (o for o in objs if o["kind"] == "Deployment"):
        container = dep["spec"]["template"]["spec"]["containers"][0]
        component = dep["spec"]["template"]["metadata"]["labels"][C.LABEL_COMPONENT]
        args = _set_arg(container["args"], "--config", str(config))
        args = _set_arg(args, "--host", "127.0.0.1")
        args = _set_arg(args, "--keys-dir", str(keys))
        if component == C.COMPONENT_MASTER:
            args = _set_arg(_set_arg(args, "--api-port", str(api_port)), "--control-port", str(control_port))
            args = _set_arg(args, "--admin-port", str(ports.admin))
            args = _set_arg(args, "--drain-linger", "0")  # no Service routes here: nothing to wait for
            replicas = 1
        else:
            args = _set_arg(args, "--master", f"127.0.0.1:{control_port}")  # the masters' Service name
            args = _set_arg(_set_arg(args, "--data-port", "0"), "--advertise-host", "127.0.0.1")
            # An autoscaled stage has no replicas field; run one.
            replicas = max(dep["spec"].get("replicas", 1), 1)
        for i in range(replicas):
            pod = f"{dep['metadata']['name']}-{i}"
            metrics = ports.api if component == C.COMPONENT_MASTER else spare_port()
            pod_args = args if component == C.COMPONENT_MASTER else _set_arg(
                _set_arg(args, "--health-port", str(spare_port())), "--metrics-port", str(metrics))
            env = _env(container, pod, namespace, configmap)
            if component == C.COMPONENT_MASTER:
                env[C.ENV_ADMIN_TOKEN] = ports.admin_token
            argv = OMNIFLEET + pod_args
            if omni_python and omni & set(_stages_of(pod_args)):  # vLLM-Omni's stages run in its own environment
                argv = [omni_python, "-m", "omnifleet_runtime", *pod_args]
                env["PYTHONPATH"] = os.pathsep.join(p for p in (str(RUNTIME_SRC), env.get("PYTHONPATH")) if p)
            procs.append(LocalProcess(pod, argv, env, metrics_url=f"http://127.0.0.1:{metrics}/metrics"))
    return procs, ports


def _stages_of(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--stage"]


def _vllm_omni_python(stages: list[str]) -> str:
    """vLLM-Omni's environment (its own vLLM), which vllm-omni stages run in; built beforehand."""
    from omnifleet_runtime.devsetup import vllm_omni_env

    if not vllm_omni_env.ready():
        raise SystemExit(f"omnifleet run: stage(s) {', '.join(stages)} are vllm-omni stages, which run with "
                         f"vLLM-Omni's own environment; build it first (once, about 7 GB): "
                         f"python -m omnifleet_runtime.devsetup.vllm_omni_env")
    return str(vllm_omni_env.env_python())


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
        procs, ports = plan(doc, Path(workdir))
        url = f"http://127.0.0.1:{ports.api}"
        width = max(len(p.name) for p in procs)
        lock = threading.Lock()
        stopping = threading.Event()
        pumps: list[threading.Thread] = []
        # Ctrl-C reaches only this runner (each child leads a process group of its own, outside the
        # terminal's foreground group), which stops them in order.
        old = signal.signal(signal.SIGINT, lambda *_: stopping.set())
        signal.signal(signal.SIGTERM, lambda *_: stopping.set())
        signal.signal(signal.SIGHUP, lambda *_: stopping.set())  # the terminal closed
        code = 0
        try:
            for proc in procs:
                # Started from the main thread: the parent-death signal follows the forking thread.
                # A process group, not a session: where the kernel groups CPU time per session
                # (autogroup), a session each gave a stage woken for one streamed chunk only its group's
                # share while another stage's engine kept the cores busy.
                proc.popen = subprocess.Popen(proc.argv, env=proc.env, stdin=subprocess.DEVNULL,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0,
                                              preexec_fn=parent_death_preexec(signal.SIGTERM))
                pumps.append(threading.Thread(target=_pump, args=(proc, width, lock), daemon=True))
                pumps[-1].start()
            model = doc["metadata"]["name"]
            with lock:
                print(f"omnifleet run: {len(procs)} processes; API {url}; admin http://127.0.0.1:{ports.admin} "
                      f"(Authorization: Bearer {ports.admin_token})\n"
                      f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
                      f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'\n"
                      f"  metrics: " + ", ".join(f"{p.name} {p.metrics_url}" for p in procs), flush=True)
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
            # Their last lines (a master's exit, a stage's traceback) are printed before this returns;
            # bounded, since a process's own child may still hold its output open.
            deadline = time.monotonic() + PUMP_DRAIN_S
            for pump in pumps:
                pump.join(timeout=max(0.0, deadline - time.monotonic()))
            signal.signal(signal.SIGINT, old)
    return code
