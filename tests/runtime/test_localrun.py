"""`omnifleet run -f FILE`: the rendered pods as local processes."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import yaml

from fleet_harness import PYTHONPATH, ROOT, pipeline, stage, wait_until

RUNNER = "import sys; from omnifleet_operator.localrun import main; sys.exit(main(sys.argv[1:]))"


class Runner:
    def __init__(self, tmp_path, doc, *overrides: str):
        path = tmp_path / "pipeline.yaml"
        path.write_text(yaml.safe_dump(doc))
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": PYTHONPATH, "OMNIFLEET_TEST_DIR": str(tmp_path)}
        self.popen = subprocess.Popen([sys.executable, "-c", RUNNER, "-f", str(path), *overrides], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(l) for l in self.popen.stdout], daemon=True).start()

    def expect(self, pattern: str, timeout: float = 30) -> re.Match:
        for _ in range(10_000):
            line = self.lines.get(timeout=timeout)
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no line matched {pattern!r}")

    def output(self) -> str:
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
        url = runner.expect(r"API (http://127\.0\.0\.1:\d+)").group(1)
        runner.expect(r"curl http://127\.0\.0\.1:\d+/v1/chat/completions")
        runner.expect(r"ready at")
        counts = lambda: {s: len(r) for s, r in json.load(urllib.request.urlopen(f"{url}/v1/stages"))["stages"].items()}  # noqa: E731
        wait_until(lambda: counts() == {"a": 2, "b": 2, "c": 1}, "every replica to register")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
        out = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "local"}])
        assert out.choices[0].message.content == "LOCAL!"
        runner.popen.send_signal(signal.SIGINT)
        assert runner.popen.wait(timeout=60) == 0
    finally:
        runner.kill()
    log = runner.output()
    # two replicas of the a+b pod (one process per stage each) and one c pod, each line prefixed
    for pod in ("demo-a-0", "demo-a-1", "demo-c-0"):
        assert re.search(rf"^{pod}\s+\| .*registered with master", log, re.M), pod
    assert log.count("drained; exiting") == 5
    assert re.search(r"^demo-master-0\s+\| .*replica a/demo-a-1 deregistered", log, re.M)


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


def test_run_refuses_vllm_omni_stages_up_front(tmp_path):
    omni = {"name": "thinker", "type": "vllm-omni", "finalOutput": "text",
            "vllmOmni": {"pipeline": "qwen2_5_omni", "stageId": 0, "modelStage": "thinker", "workerType": "ar"}}
    path = tmp_path / "omni.yaml"
    path.write_text(yaml.safe_dump(pipeline(omni)))
    done = subprocess.run([sys.executable, "-c", RUNNER, "-f", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": PYTHONPATH})
    assert done.returncode == 1
    assert "thinker are vllm-omni stages, and this build has no vllm-omni engine" in done.stderr


def test_run_names_a_bad_override(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(pipeline(stage("a", "upper", gpus=0, finalOutput="text"))))
    done = subprocess.run([sys.executable, "-c", RUNNER, "-f", str(path), "stages.b.replicas=2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": PYTHONPATH})
    assert done.returncode == 2
    assert "override 'stages.b.replicas=2': no stage named 'b' (stages: a)" in done.stderr
