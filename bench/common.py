"""What the benchmarks share: machine facts, a fleet of real runtime processes, a small
HTTP/1.1 keep-alive client, per-process CPU readings from /proc, and result files.

The fleet is the pattern of tests/runtime/fleet_harness.py (a master and stage pods
as real processes on loopback ports, each in a process group of its own, killed at the end),
started through `bench.wrapper` so the benchmarks can drive the orchestrator
without HTTP and switch cProfile on.
"""

from __future__ import annotations

import asyncio
import atexit
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# Where the runtime the fleets run comes from: this checkout, or a git snapshot (use_runtime_ref).
RUNTIME_ROOT = ROOT
RUNTIME_DESC = "working tree"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- small helpers


_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port, never the same one twice in one run (two picks before either is bound would collide)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def pct(xs: list[float], q: float) -> float:
    """q-th percentile (linear interpolation); nan for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def wait_until(pred: Callable[[], Any], what: str, timeout: float = 30.0, step: float = 0.05) -> Any:
    for _ in range(max(1, int(timeout / step))):
        value = pred()
        if value:
            return value
        time.sleep(step)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


def fmt_size(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- machine facts


def machine_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
        facts["cpu"] = m.group(1).strip() if m else platform.processor()
    except OSError:
        facts["cpu"] = platform.processor()
    facts["cores"] = os.cpu_count()
    try:
        facts["cores_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        mem = Path("/proc/meminfo").read_text()
        facts["memory_gib"] = round(int(re.search(r"MemTotal:\s+(\d+)", mem).group(1)) / (1 << 20), 1)
    except (OSError, AttributeError):
        pass
    facts["kernel"] = platform.release()
    facts["python"] = platform.python_version()
    for mod in ("zmq", "msgspec", "aiohttp", "numpy", "torch"):
        try:
            m = __import__(mod)
            facts[mod] = m.__version__
            if mod == "zmq":
                facts["libzmq"] = m.zmq_version()
        except Exception:
            pass
    facts["date"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        facts["commit"] = rev
        dirty = runtime_dirty()
        facts["runtime measured"] = RUNTIME_DESC + (f" (uncommitted: {dirty})" if dirty and RUNTIME_DESC ==
                                                    "working tree" else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return facts


def use_runtime_ref(ref: str) -> str:
    """Run the fleets on runtime/ and operator/ as committed at git ref (not the working tree), e.g. while
    others edit the runtime; returns a description for the report."""
    global RUNTIME_ROOT, RUNTIME_DESC
    if ref in ("", "worktree"):
        return RUNTIME_DESC
    rev = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=30).stdout.strip()
    dest = Path(tempfile.mkdtemp(prefix=f"omnifleet-bench-runtime-{rev}-"))
    atexit.register(shutil.rmtree, dest, True)
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "runtime", "operator"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, timeout=60)
    RUNTIME_ROOT, RUNTIME_DESC = dest, f"git {rev} ({ref})"
    return RUNTIME_DESC


def runtime_dirty() -> str:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "runtime"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.split("\n")
        return ", ".join(line[3:] for line in out if line.strip())
    except (OSError, subprocess.SubprocessError):
        return ""


def facts_table(facts: dict[str, Any]) -> str:
    rows = ["| fact | value |", "| --- | --- |"]
    rows += [f"| {k} | {v} |" for k, v in facts.items()]
    return "\n".join(rows)


# ---------------------------------------------------------------- /proc readings


@dataclass
class CpuSample:
    ticks: int  # utime + stime of the whole process (clock ticks), as /proc/PID/stat says
    ns: int  # on-CPU time of all its threads in ns (/proc/PID/task/*/schedstat): finer
    minflt: int
    at: float


def proc_stat_fields(path: str) -> list[str]:
    raw = Path(path).read_text()
    return raw[raw.rindex(")") + 2:].split()  # fields from 3 (state) on


def cpu_sample(pid: int) -> CpuSample:
    f = proc_stat_fields(f"/proc/{pid}/stat")
    ticks = int(f[11]) + int(f[12])  # utime, stime (fields 14, 15)
    ns = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            ns += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return CpuSample(ticks, ns, int(f[7]), time.monotonic())


def cpu_delta(a: CpuSample, b: CpuSample) -> dict[str, float]:
    return {"cpu_s": (b.ns - a.ns) / 1e9, "cpu_s_stat": (b.ticks - a.ticks) / CLK_TCK,
            "minflt": b.minflt - a.minflt, "wall_s": b.at - a.at}


def thread_times(pid: int) -> dict[str, dict[str, float]]:
    """Per thread name (threads of one name summed): user and system seconds, minor faults."""
    out: dict[str, dict[str, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            f = proc_stat_fields(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
        name = "main" if tid == str(pid) else re.sub(r"\d+$", "N", comm)
        d = out.setdefault(name, {"user_s": 0.0, "sys_s": 0.0, "minflt": 0})
        d["user_s"] += int(f[11]) / CLK_TCK
        d["sys_s"] += int(f[12]) / CLK_TCK
        d["minflt"] += int(f[7])
    return out


def thread_delta(a: dict, b: dict) -> dict[str, dict[str, float]]:
    return {name: {k: v - a.get(name, {}).get(k, 0) for k, v in d.items()} for name, d in b.items()}


def children(pid: int) -> list[int]:
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if int(proc_stat_fields(f"/proc/{name}/stat")[1]) == pid:
                    kids.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return sorted(kids)


# ---------------------------------------------------------------- HTTP/1.1 keep-alive client


def _parse_head(head: bytes) -> tuple[int, int]:
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = -1
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v.strip())
    if length < 0:
        raise ValueError(f"response without Content-Length: {head[:200]!r}")
    return status, length


def request_bytes(path: str, body: bytes, port: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class HttpClient:
    """A blocking keep-alive client that does as little as a client can (the latency limit of HTTP)."""

    def __init__(self, port: int, timeout: float = 120.0):
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def post(self, path: str, body: Any) -> tuple[int, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.send_raw(request_bytes(path, data, self.port))

    def send_raw(self, req: bytes) -> tuple[int, bytes]:
        self.sock.sendall(req)
        while b"\r\n\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.buf += chunk
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        status, length = _parse_head(head)
        while len(rest) < length:
            chunk = self.sock.recv(max(65536, length - len(rest)))
            if not chunk:
                raise ConnectionError("server closed the connection")
            rest += chunk
        self.buf = rest[length:]
        return status, rest[:length]

    def close(self) -> None:
        self.sock.close()


class AsyncHttpClient:
    """The same on asyncio streams, one connection per concurrent worker."""

    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def send_raw(self, req: bytes) -> tuple[int, bytes]:
        self.writer.write(req)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status, length = _parse_head(head[:-4])
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass


# ---------------------------------------------------------------- a fleet of runtime processes


def pipeline_doc(stages: list[dict[str, Any]], name: str = "bench") -> dict[str, Any]:
    return {"apiVersion": "omnifleet.dev/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": name}, "spec": {"stages": stages}}


class Proc:
    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path):
        self.name, self.log_path = name, log_path
        self.log = open(log_path, "ab")
        # A process group of its own (Fleet.stop kills it whole) in the benchmark's session: a session each
        # would put each pod in a scheduling group of its own (the kernel's autogroup), and a pod that wakes
        # after idling (a stage sent one chunk) then waited 40-60 ms behind another pod's busy processes on a
        # two-core machine (measured on the speech pipeline): a cost of the way processes were started here,
        # not of the pipeline. In Kubernetes a pod's CPU comes from its cgroup's requests and limits.
        self.popen = subprocess.Popen([sys.executable, "-m", "bench.wrapper", *args], env=env, cwd=ROOT,
                                      stdout=self.log, stderr=subprocess.STDOUT, process_group=0)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


class Fleet:
    """A master and stage pods (real processes) on loopback ports; `with Fleet(...) as f:` stops them."""

    def __init__(self, name: str, stages: list[dict[str, Any]], profile_dir: Path | None = None,
                 env: dict[str, str] | None = None, spec: dict[str, Any] | None = None):
        import yaml

        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"omnifleet-bench-{name}-"))
        self.config = self.dir / "pipeline.yaml"
        doc = pipeline_doc(stages)
        doc["spec"].update(spec or {})  # e.g. {"security": {"dataPlane": "plain-auth"}}
        self.config.write_text(yaml.safe_dump(doc))
        self.api_port, self.control_port, self.admin_port = free_port(), free_port(), free_port()
        self.admin_token = uuid.uuid4().hex
        self.procs: dict[str, Proc] = {}
        self.pod_stages: dict[str, list[str]] = {}
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join([str(RUNTIME_ROOT / "runtime"), str(RUNTIME_ROOT / "operator"),
                                                   str(ROOT)])}
        for k in ("OMNIFLEET_BENCH_PROFILE", "OMNIFLEET_BENCH_UVLOOP"):
            self.env.pop(k, None)
        if profile_dir is not None:
            self.env["OMNIFLEET_BENCH_PROFILE"] = str(profile_dir)
        from omnifleet_operator.curvekeys import pipeline_keys, write_key_files

        # The pipeline's keys, as the operator's Secret gives them to pods.
        self.env["OMNIFLEET_KEYS_DIR"] = str(write_key_files(self.dir / "keys", pipeline_keys()))
        self.env.update(env or {})

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def master_pid(self) -> int:
        return self.procs["master"].pid

    def start_master(self) -> None:
        args = ["master", "--config", str(self.config), "--host", "127.0.0.1", "--api-port", str(self.api_port),
                "--control-port", str(self.control_port), "--admin-port", str(self.admin_port), "--log-level", "warning"]
        self.procs["master"] = Proc("master", args, {**self.env, "OMNIFLEET_ADMIN_TOKEN": self.admin_token},
                                    self.dir / "master.log")

    def start_pod(self, pod: str, *stages: str) -> None:
        self.pod_stages[pod] = list(stages)
        args = ["stage", "--config", str(self.config), "--master", f"127.0.0.1:{self.control_port}",
                "--host", "127.0.0.1", "--advertise-host", "127.0.0.1", "--data-port", "0",
                "--health-port", str(free_port()), "--metrics-port", str(free_port()), "--log-level", "warning"]
        for s in stages:
            args += ["--stage", s]
        self.procs[pod] = Proc(pod, args, {**self.env, "OMNIFLEET_POD_NAME": pod}, self.dir / f"{pod}.log")

    def get(self, path: str) -> tuple[int, Any]:
        return self.request("GET", path, None, timeout=10)

    def post(self, path: str, body: Any, timeout: float = 300.0) -> tuple[int, Any]:
        return self.request("POST", path, body, timeout)

    def request(self, method: str, path: str, body: Any, timeout: float) -> tuple[int, Any]:
        """One HTTP call; the admin endpoints (/v1/stages...) go to the admin port with the admin token."""
        import urllib.error
        import urllib.request

        admin = path.startswith("/v1/stages")
        headers = {"Authorization": f"Bearer {self.admin_token}"} if admin else {}
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
        req = urllib.request.Request(f"http://127.0.0.1:{self.admin_port if admin else self.api_port}{path}",
                                     data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw, status = r.read(), r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready() -> bool:
            for name, p in self.procs.items():
                if not p.alive():
                    raise RuntimeError(f"{name} exited with {p.popen.returncode}:\n{p.tail()}")
            try:
                status, body = self.get("/v1/stages")
            except OSError:
                return False
            if status != 200:
                return False
            registered = {(s, r["replica"]) for s, reps in body["stages"].items() for r in reps}
            return all((s, pod) in registered for pod, stages in self.pod_stages.items() for s in stages)

        try:
            wait_until(ready, f"fleet {self.name} to register every stage", timeout)
        except BaseException:
            self.stop()  # nothing of a fleet that did not come up is left running
            raise

    def worker_pids(self, pod: str) -> list[int]:
        """The stage worker processes of a pod (spawned children of the pod process), in start order."""
        return [pid for pid in children(self.procs[pod].pid)
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                head, _, value = line.rpartition(" ")
                if all(f'{k}="{v}"' in head for k, v in labels.items()):
                    total += float(value)
        return total

    def runtime_pids(self) -> dict[int, str]:
        """pid -> name of the master and every stage worker."""
        out = {self.master_pid: "master"}
        for pod, stages in self.pod_stages.items():
            for pid, stage in zip(self.worker_pids(pod), stages):
                out[pid] = f"stage {stage} (pod {pod})"
        return out

    def reset_profiles(self) -> None:
        """SIGUSR2: every profiled process forgets what it collected so far (the start-up, a warm-up)."""
        for pid in self.runtime_pids():
            os.kill(pid, signal.SIGUSR2)
        time.sleep(0.2)

    def dump_profiles(self, profile_dir: Path, timeout: float = 20.0) -> list[Path]:
        """SIGUSR1 to the master and every stage worker; the .prof files they wrote."""
        pids = list(self.runtime_pids())
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        want = {f"{'master' if pid == self.master_pid else 'stage'}-{pid}.prof" for pid in pids}
        wait_until(lambda: want <= {p.name for p in profile_dir.glob("*.prof")}, "profiles to be written", timeout)
        time.sleep(0.3)
        return [profile_dir / n for n in sorted(want)]

    def stop(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs.values():
            try:
                p.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            p.log.close()
        shm = "/dev/shm"
        if os.path.isdir(shm):
            for n in os.listdir(shm):
                if any(n.startswith(f"omnifleet-{pod}-") for pod in self.pod_stages):
                    try:
                        os.unlink(os.path.join(shm, n))
                    except FileNotFoundError:
                        pass
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------- results


def today() -> str:
    return dt.date.today().isoformat()


def git(*args: str, strip: bool = True) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30).stdout
    return out.strip() if strip else out  # porcelain lines start with a status column that may be a space


def provenance(section: str, ref: str | None = None) -> dict[str, Any]:
    """What a results section measured: the commit (full hash), the code it measures (bench.goals MEASURES)
    that had uncommitted changes, and the date. Taken before the run starts. `ref`: the runtime ran from
    that commit (use_runtime_ref), not from the working tree."""
    from .goals import MEASURES

    paths = list(MEASURES[section])
    dirty = [line[3:] for line in git("status", "--porcelain", "--", *paths, strip=False).splitlines() if line.strip()]
    if ref not in (None, "", "worktree"):
        dirty = [p for p in dirty if not p.startswith(("runtime/", "operator/"))]  # those ran from the ref
    return {"commit": git("rev-parse", ref if ref not in (None, "", "worktree") else "HEAD"), "dirty": dirty,
            "measures": paths, "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def provenance_of_results(section: str, facts: dict[str, Any], source: str) -> dict[str, Any]:
    """The provenance of a section rebuilt from an earlier run's results JSON: the commit its facts name
    (None when they name none: the section then reads as stale), uncommitted changes unknown (None)
    unless the facts say the code measured was a clean git export."""
    from .goals import MEASURES

    commit = None
    if facts.get("commit"):
        try:
            commit = git("rev-parse", "--verify", f"{facts['commit']}^{{commit}}")
        except subprocess.CalledProcessError:
            commit = None
    measured = str(facts.get("runtime measured") or facts.get("operator code") or "")
    dirty: list[str] | None = None
    if measured.startswith("git "):
        dirty = []
    elif measured.startswith("working tree"):
        dirty = re.findall(r"[\w./-]+\.py", measured) if "uncommitted" in measured else []
    return {"commit": commit, "dirty": dirty, "measures": list(MEASURES[section]), "date": facts.get("date"),
            "rebuilt_from": source}


def machine_line(facts: dict[str, Any]) -> str:
    return f"{facts.get('cpu')} x{facts.get('cores_usable', facts.get('cores'))}, {facts.get('memory_gib')} GiB"


def merge_latest(out_dir: Path, key: str, values: dict[str, Any], prov: dict[str, Any]) -> Path:
    """Set latest.json[key] = values + {"provenance": prov}, keeping every other section. The only writer
    of latest.json: every benchmark goes through here."""
    path = out_dir / "latest.json"
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[key] = {**values, "provenance": prov}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


CATEGORIES = (  # (label, test on the function's file or name), first match wins
    ("waiting in epoll (should be ~0: the clock is CPU time)", lambda f, n: "epoll" in n or "select" in n and f == "~"),
    ("pyzmq (sugar, and zmq.asyncio where used)", lambda f, n: "/zmq/" in f),
    ("enum flag arithmetic (called by pyzmq)", lambda f, n: f.endswith("enum.py")),
    ("ZMQ send/recv calls (C)", lambda f, n: f == "~" and ("zmq" in n or "Socket" in n or "Frame" in n)),
    ("msgspec encode/decode (C)", lambda f, n: f == "~" and "msgspec" in n),
    ("omnifleet runtime code", lambda f, n: "omnifleet_runtime" in f),
    ("aiohttp (HTTP server)", lambda f, n: "/aiohttp/" in f or "/multidict/" in f or "/yarl/" in f),
    ("worker threads hand-off (to_thread, futures)", lambda f, n: "/concurrent/" in f or f.endswith("threading.py")
     or "to_thread" in n or f.endswith("asyncio/threads.py")),
    ("asyncio event loop, tasks, futures, queues", lambda f, n: "/asyncio/" in f or f == "~" and (
        "_asyncio" in n or "Task" in n or "Future" in n or "run_once" in n)),
    ("logging, json, other", lambda f, n: True),
)


def profile_categories(path: Path) -> tuple[float, list[tuple[str, float]]]:
    """Own time of a .prof file grouped by CATEGORIES: (total, [(label, seconds)])."""
    import pstats

    st = pstats.Stats(str(path))
    sums = {label: 0.0 for label, _ in CATEGORIES}
    for (file, _line, name), (_cc, _nc, tt, _ct, _callers) in st.stats.items():
        for label, test in CATEGORIES:
            if test(file, name):
                sums[label] += tt
                break
    total = sum(sums.values())
    return total, sorted(((k, v) for k, v in sums.items() if v > 0), key=lambda kv: -kv[1])


def profile_summary(paths: list[Path], names: dict[int, str], per: int, top: int = 12) -> str:
    """For each .prof file: CPU per request by category, then the top functions by own time."""
    import io
    import pstats

    parts = []
    for p in paths:
        pid = int(p.stem.rsplit("-", 1)[1])
        total, cats = profile_categories(p)
        head = (f"--- {names.get(pid, p.stem)} [{p.name}]: {total * 1e6 / per:.0f} us of main-thread CPU per "
                f"request under the profiler ({per} requests)")
        cat_lines = [f"  {v / total * 100:5.1f}%  {v * 1e6 / per:7.0f} us/req  {k}" for k, v in cats]
        s = io.StringIO()
        pstats.Stats(str(p), stream=s).sort_stats("tottime").print_stats(top)
        lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
        start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
        parts.append("\n".join([head, *cat_lines, "  top functions by own CPU time:", *lines[start:]]))
    return "\n\n".join(parts)
