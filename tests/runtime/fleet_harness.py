"""A fleet of real runtime processes on loopback: a master and stage pods from a pipeline dict.

Every process is started with `python -m omnifleet_runtime ...` in its own
session (so killing a "pod" kills its stage workers too), logs to a file
that is printed when a test fails, and is killed at teardown. Every wait is
a bounded loop.
"""

from __future__ import annotations

import json
import re
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import yaml
from prometheus_client.parser import text_string_to_metric_families

from omnifleet_operator.curvekeys import pipeline_keys, write_key_files
from omnifleet_operator.ports import spare_port
from omnifleet_runtime.lifetime import parent_death_preexec
from omnifleet_runtime.security import Keys, secure_client

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# The repo's code first; then whatever the caller's PYTHONPATH held (packages installed beside the interpreter).
PYTHONPATH = os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "operator"), str(HERE), str(ROOT),
                              *filter(None, [os.environ.get("PYTHONPATH")])])


free_port = spare_port


def stage(name: str, entrypoint: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "type": "python", "entrypoint": f"stagefns:{entrypoint}", **fields}


def pipeline(*stages: dict[str, Any], name: str = "test") -> dict[str, Any]:
    return {
        "apiVersion": "omnifleet.dev/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": name}, "spec": {"stages": list(stages)},
    }


def wait_until(pred: Callable[[], Any], what: str, timeout: float = 20.0, step: float = 0.02) -> Any:
    for _ in range(int(timeout / step)):
        value = pred()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


class Scrape:
    """One scrape of a /metrics endpoint, parsed by prometheus_client's own parser."""

    def __init__(self, port: int):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain"), resp.headers["Content-Type"]
            self.text = resp.read().decode()
        self.families = {f.name: f for f in text_string_to_metric_families(self.text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of that name whose labels include these; 0 when there are none."""
        return sum(s.value for s in self.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def has(self, name: str, **labels: str) -> bool:
        return any(s.name == name and all(s.labels.get(k) == v for k, v in labels.items()) for s in self.samples)


def exported_series(scrape: Any) -> set[str]:
    """Every series name an exposition declares (a family without samples yet still declares them)."""
    out = set()
    for fam in scrape.families.values():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(fam.type, ("",))
        out |= {fam.name + s for s in suffixes} | {s.name for s in fam.samples}
    return out


PROMQL_WORDS = {"by", "without", "and", "or", "unless", "on", "ignoring", "group_left", "group_right"}


def series_in(expr: str) -> set[str]:
    """The series a PromQL expression selects: identifiers outside label matchers, grouping clauses and
    ranges that are not function calls or keywords."""
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(?:by|without)\s*\([^)]*\)", " ", expr)
    return {m[1] for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\(?)", bare)
            if not m[2] and m[1] not in PROMQL_WORDS}


def dashboard_exprs() -> list[str]:
    """Every query of the checked-in Grafana dashboard."""
    board = json.loads((ROOT / "manifests" / "monitoring" / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in board["panels"] if p["type"] != "row" for t in p["targets"]]


class Proc:
    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path, python: str | None = None,
                 own_session: bool = True):
        """own_session False: a process group of its own in the test's session (and so the test's scheduling
        autogroup: the kernel shares CPU between autogroups first, so a process that spins in one starves
        another's on the same core; within one group, its sched_yield lets the other run)."""
        self.name, self.args, self.log_path = name, args, log_path
        self.killed = False
        self.log = open(log_path, "ab")
        self.popen = subprocess.Popen(
            [python or sys.executable, "-m", "omnifleet_runtime", *args], env=env, cwd=ROOT,
            stdout=self.log, stderr=subprocess.STDOUT,
            **({"start_new_session": True} if own_session else {"process_group": 0}),
            preexec_fn=parent_death_preexec(signal.SIGTERM),  # a killed test run leaves no fleet behind
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        """Signal the process and its children, as a pod's containers all die together."""
        if sig == signal.SIGKILL:
            self.killed = True
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")


class Fleet:
    def __init__(self, tmp: Path, doc: dict[str, Any]):
        self.dir = tmp
        self.config = tmp / "pipeline.yaml"
        self.config.write_text(yaml.safe_dump(doc))
        self.api_port, self.control_port, self.admin_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.api_port}"
        self.master_arg = f"127.0.0.1:{self.control_port}"  # the pods' --master (several masters: a list)
        self.admin_token = secrets.token_urlsafe(24)
        self.procs: dict[str, Proc] = {}
        self.health_ports: dict[str, int] = {}
        self.metrics_ports: dict[str, int] = {}
        self.pod_stages: dict[str, list[str]] = {}
        self.own_sessions = True  # each process a session of its own, as each pod is its own (see Proc)
        # The pipeline's keys, as the operator's Secret gives them to pods: every process here uses CurveZMQ.
        self.keys_dir = write_key_files(tmp / "keys", pipeline_keys())
        self.keys = Keys.load(self.keys_dir)
        self.env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMNIFLEET_TEST_DIR": str(tmp),
                    "PYTHONUNBUFFERED": "1", "OMNIFLEET_KEYS_DIR": str(self.keys_dir)}

    # ---- processes

    def start_master(self, *extra: str, name: str = "master", ports: tuple[int, int, int] | None = None) -> Proc:
        """ports: (api, control, admin) of another master of this fleet (default: the fleet's own)."""
        api, control, admin = ports or (self.api_port, self.control_port, self.admin_port)
        args = ["master", "--config", str(self.config), "--host", "127.0.0.1",
                "--api-port", str(api), "--control-port", str(control), "--admin-port", str(admin), *extra]
        return self._start(name, args, {"OMNIFLEET_ADMIN_TOKEN": self.admin_token, **self.env})

    def start_pod(self, pod: str, *stages: str, extra: tuple[str, ...] = (), python: str | None = None) -> Proc:
        """python: another interpreter for the pod (a stage image of its own, such as vLLM-Omni's)."""
        self.pod_stages[pod] = list(stages)
        self.health_ports[pod] = port = free_port()
        self.metrics_ports[pod] = free_port()
        args = ["stage", "--config", str(self.config), "--master", self.master_arg,
                "--host", "127.0.0.1", "--advertise-host", "127.0.0.1", "--data-port", "0",
                "--health-port", str(port), "--metrics-port", str(self.metrics_ports[pod]), *extra]
        for s in stages:
            args += ["--stage", s]
        return self._start(pod, args, {**self.env, "OMNIFLEET_POD_NAME": pod}, python)

    def _start(self, name: str, args: list[str], env: dict[str, str], python: str | None = None) -> Proc:
        proc = Proc(name, args, env, self.dir / f"{name}.log", python, self.own_sessions)
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.signal_group(signal.SIGKILL)
        for proc in self.procs.values():
            proc.popen.wait(timeout=10)
            proc.log.close()
        for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
            if any(name.startswith(f"omnifleet-{pod}-") for pod in self.procs):
                os.unlink(os.path.join("/dev/shm", name))

    def logs(self) -> str:
        return "\n".join(f"===== {n} =====\n{p.output()}" for n, p in self.procs.items())

    # ---- ZMQ peers (what a test plays: a keyed one is one of the pipeline's pods)

    def control_peer(self, ctx, keyed: bool = True):
        """A DEALER connected to the master's control port, with the pipeline's client key or none."""
        import zmq

        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        if keyed:
            secure_client(sock, self.keys)
        sock.connect(f"tcp://127.0.0.1:{self.control_port}")
        return sock

    def data_peer(self, ctx, addr: str, keyed: bool = True):
        """A PUSH connected to a stage's data port, with the pipeline's client key or none."""
        import zmq

        sock = ctx.socket(zmq.PUSH)
        sock.linger = 0
        if keyed:
            secure_client(sock, self.keys)
        sock.connect(addr)
        return sock

    # ---- HTTP

    def http(self, method: str, path: str, body: Any = None, port: int | None = None,
             headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, Any]:
        url = f"http://127.0.0.1:{port or self.api_port}{path}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw, status, ctype = resp.read(), resp.status, resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            raw, status, ctype = e.read(), e.code, e.headers.get("Content-Type", "")
        return status, json.loads(raw) if "json" in ctype else raw.decode()

    def get(self, path: str, port: int | None = None) -> tuple[int, Any]:
        return self.http("GET", path, port=port)

    def try_get(self, path: str, port: int | None = None) -> tuple[int, Any] | None:
        try:
            return self.get(path, port)
        except OSError:
            return None

    def wait_ready(self, timeout: float = 30.0, ports: tuple[int, int, int] | None = None) -> None:
        """ports: those of another master of this fleet, as start_master took them (default: the fleet's own)."""
        api, _, admin = ports or (self.api_port, self.control_port, self.admin_port)

        def ready():
            for name, proc in self.procs.items():
                assert proc.alive() or proc.killed, f"{name} exited with {proc.popen.returncode}:\n{proc.output()}"
            r = self.try_get("/ready", port=api)
            if r is None or r[0] != 200:
                return False
            registered = {(s, r["replica"]) for s, reps in self.stages(admin).items() for r in reps}
            return all((s, pod) in registered for pod, stages in self.pod_stages.items()
                       if not self.procs[pod].killed for s in stages)
        wait_until(ready, "the pipeline to become ready with every started replica", timeout)

    def admin(self, method: str, path: str, body: Any = None, port: int | None = None) -> tuple[int, Any]:
        """A call to the master's admin port (or another master's), with its token."""
        return self.http(method, path, body, port=port or self.admin_port,
                         headers={"Authorization": f"Bearer {self.admin_token}"})

    def control(self, stage: str, body: dict[str, Any]) -> tuple[int, Any]:
        return self.admin("POST", f"/v1/stages/{stage}/control", body)

    def stages(self, admin_port: int | None = None) -> dict[str, list[dict[str, Any]]]:
        return self.admin("GET", "/v1/stages", port=admin_port)[1]["stages"]

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of a metric whose labels include the given ones."""
        total = 0.0
        for line in self.get("/metrics")[1].splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, **{"timeout": 30, "api_key": "none", **kw})

    def async_openai(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", max_retries=0, **{"timeout": 30, "api_key": "none", **kw})


