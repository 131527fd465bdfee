"""`omnifleet run -f FILE`: the rendered pods as local processes."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import yaml

from fleet_harness import PYTHONPATH, ROOT, Scrape, pipeline, stage, wait_until

RUNNER = "import sys; from omnifleet_operator.localrun import main; sys.exit(main(sys.argv[1:]))"


class Runner:
    def __init__(self, tmp_path, doc, *overrides: str):
        path = tmp_path / "pipeline.yaml"
        path.write_text(yaml.safe_dump(doc))
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": PYTHONPATH, "OMNIFLEET_TEST_DIR": str(tmp_path)}
        # A job of its own, as a shell starts one: Ctrl-C goes to its process group.
        self.popen = subprocess.Popen([sys.executable, "-c", RUNNER, "-f", str(path), *overrides], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      process_group=0)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=lambda: [self.lines.put(l) for l in self.popen.stdout], daemon=True)
        self.reader.start()

    def expect(self, pattern: str, timeout: float = 30) -> re.Match:
        for _ in range(10_000):
            line = self.lines.get(timeout=timeout)
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no line matched {pattern!r}")

    def output(self) -> str:
        if self.popen.poll() is not None:
            self.reader.join(timeout=30)  # every line it wrote, to its end
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "".join(self.seen)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def test_run_starts_every_rendered_pod_and_stops_on_ctrl_c(tmp_path):
    import openai

    # The file asks for one replica of a; the command line's override makes it two.
    runner = Runner(tmp_path, pipeline(
        stage("a", "upper", replicas=1, gpus=0),
        stage("b", "exclaim", inputs=["a"], colocateWith="a"),
        stage("c", "halves", inputs=["b"], finalOutput="text", gpus=0),
        name="demo",
    ), "stages.a.replicas=2")
    try:
        m = runner.expect(r"API (http://127\.0\.0\.1:\d+); admin (http://127\.0\.0\.1:\d+) \(Authorization: Bearer (\S+)\)")
        url, admin, token = m.groups()
        runner.expect(r"curl http://127\.0\.0\.1:\d+/v1/chat/completions")
        metrics_port = int(runner.expect(r"metrics: .*demo-c-0 http://127\.0\.0\.1:(\d+)/metrics").group(1))
        runner.expect(r"ready at")
        stages = urllib.request.Request(f"{admin}/v1/stages", headers={"Authorization": f"Bearer {token}"})
        counts = lambda: {s: len(r) for s, r in json.load(urllib.request.urlopen(stages))["stages"].items()}  # noqa: E731
        wait_until(lambda: counts() == {"a": 2, "b": 2, "c": 1}, "every replica to register")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
        out = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "local"}])
        assert out.choices[0].message.content == "LOCAL!"
        # The final stage's pod serves its series on the port the runner printed.
        assert Scrape(metrics_port).value("omnifleet_worker_requests_total", stage="c", outcome="ok") == 1
        # Every process it started stays in its session (one CPU group where the kernel groups by session)
        # and leads a process group of its own (out of reach of the terminal's Ctrl-C).
        started = _children().get(runner.popen.pid, [])
        assert len(started) == 4, started  # the master and three pods
        for pid in started:
            assert (os.getsid(pid), os.getpgid(pid)) == (os.getsid(runner.popen.pid), pid), pid
        os.killpg(runner.popen.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground group
        assert runner.popen.wait(timeout=60) == 0
    finally:
        runner.kill()
    log = runner.output()
    # two replicas of the a+b pod (one process per stage each) and one c pod, each line prefixed
    for pod in ("demo-a-0", "demo-a-1", "demo-c-0"):
        assert re.search(rf"^{pod}\s+\| .*registered with master", log, re.M), log
    assert log.count("drained; exiting") == 5, log
    assert "did not stop in time" not in log, log  # each exited by itself once drained, none was killed
    assert re.search(r"^demo-master-0\s+\| .*every request finished; exiting", log, re.M), log  # the master too
    for replica in ("a/demo-a-0", "b/demo-a-0", "a/demo-a-1", "b/demo-a-1", "c/demo-c-0"):
        assert re.search(rf"^demo-master-0\s+\| .*replica {replica} deregistered", log, re.M), log
    assert " lost" not in log, log


def test_run_stops_everything_when_a_process_fails(tmp_path):
    doc = pipeline(stage("a", "upper", gpus=0), stage("b", "echo", inputs=["a"], finalOutput="text", gpus=0))
    doc["spec"]["stages"][1]["entrypoint"] = "no_such_module:fn"
    runner = Runner(tmp_path, doc)
    try:
        runner.expect(r"test-b-0 exited with code 1; stopping everything", timeout=60)
        assert runner.popen.wait(timeout=60) == 1
    finally:
        runner.kill()
    assert "No module named 'no_such_module'" in runner.output()


def test_run_refuses_vllm_omni_stages_without_vllm_omnis_environment(tmp_path):
    omni = {"name": "thinker", "type": "vllm-omni", "finalOutput": "text",
            "vllmOmni": {"pipeline": "qwen2_5_omni", "stageId": 0, "modelStage": "thinker", "workerType": "ar"}}
    path = tmp_path / "omni.yaml"
    path.write_text(yaml.safe_dump(pipeline(omni)))
    done = subprocess.run([sys.executable, "-c", RUNNER, "-f", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": PYTHONPATH,
                                                      "OMNIFLEET_VLLM_OMNI_ENV": str(tmp_path / "no-env")})
    assert done.returncode == 1
    assert "thinker are vllm-omni stages, which run with vLLM-Omni's own environment; build it first" \
        in done.stderr
    assert "python -m omnifleet_runtime.devsetup.vllm_omni_env" in done.stderr


def test_run_names_a_bad_override(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(pipeline(stage("a", "upper", gpus=0, finalOutput="text"))))
    done = subprocess.run([sys.executable, "-c", RUNNER, "-f", str(path), "stages.b.replicas=2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": PYTHONPATH})
    assert done.returncode == 2
    assert "override 'stages.b.replicas=2': no stage named 'b' (stages: a)" in done.stderr


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            out.setdefault(ppid, []).append(int(entry))
    return out


def _descendants(pid: int) -> set[int]:
    tree, out, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps it)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_a_killed_runner_leaves_no_process_behind(tmp_path):
    """kill -9 of `omnifleet run`: every process it started dies with it (parent-death signal)."""
    runner = Runner(tmp_path, pipeline(
        stage("a", "upper", replicas=2, gpus=0),
        stage("b", "exclaim", inputs=["a"], colocateWith="a"),
        stage("c", "halves", inputs=["b"], finalOutput="text", gpus=0),
        name="demo",
    ))
    try:
        url = runner.expect(r"API (http://127\.0\.0\.1:\d+)").group(1)
        runner.expect(r"ready at")
        # the master; three pods (a-0, a-1: a and b co-located; c-0), each a parent, a stage
        # worker per stage and multiprocessing's resource tracker
        started = _descendants(runner.popen.pid)
        assert len(started) == 1 + 3 + 5 + 3, started
        assert urllib.request.urlopen(f"{url}/ready", timeout=5).status == 200
        runner.popen.kill()  # no handler runs: only the kernel can stop the children now
        runner.popen.wait()
        wait_until(lambda: not any(_running(p) for p in started), "every process to die with the runner",
                   timeout=45)
    finally:
        runner.kill()
        for pid in started if "started" in locals() else ():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    try:
        urllib.request.urlopen(f"{url}/health", timeout=2)
        raise AssertionError("the master's API still answers")
    except OSError:
        pass
