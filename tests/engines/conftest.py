"""Shared helpers of the engine tests: the runtime tests' fleet harness, and measurement reports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "runtime"))  # fleet_harness.py
sys.path.insert(0, str(HERE))  # enginefns.py

# vLLM engines on this shared 2-core machine starve whole fleets: CI saw 4.6 s (master,
# talker and vocoder at once), a busy afternoon a 9.5 s stall of the master alone (its
# stages, not stalled themselves, then took it for lost at 10 s). The production
# default is 2 s of silence; these tests allow 20.
HEARTBEAT = {"intervalSeconds": 0.5, "timeoutSeconds": 20}


def engine_env() -> dict[str, str]:
    """The environment of processes that run vLLM here: a small KV cache, no model downloads."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


def tiny_omni_path(python: str = sys.executable) -> str:
    """The tiny seeded Qwen2.5-Omni checkpoint as python's transformers writes it (built once, cached)."""
    proc = subprocess.run([python, "-m", "omnifleet_runtime.devsetup.tiny_omni", "--print-path"],
                          capture_output=True, text=True, timeout=600, env=engine_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def run_in_group(cmd: list[str], cwd: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A process in a process group of its own (the engine processes it starts would outlive it: `end` kills
    the whole group), its output in log."""
    with open(log, "wb") as logf:
        return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)


def end(proc: subprocess.Popen, timeout: float | None) -> None:
    """Wait up to timeout (None: not at all) for proc, then kill what is left of its group."""
    try:
        if timeout is not None:
            proc.wait(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


@pytest.fixture(scope="module")
def launched(oracle_run, fleet_run):
    """A module's oracle and fleet, both started before either is waited for (the module defines both):
    engine starts dominate, and two side by side share the two cores."""
    return oracle_run, fleet_run


def media() -> tuple[list, dict]:
    """A question with an image and a second of audio: the OpenAI content parts a client sends (PNG, WAV) and
    the same parts as the master decodes them (RGB pixels, float32 samples; raw bytes as base64 in `data`),
    which the oracle and the probe take."""
    import base64
    import io
    import math

    import numpy as np
    import soundfile
    from PIL import Image

    y, x, c = np.mgrid[0:56, 0:56, 0:3]
    pixels = ((x * 4 + y * 2 + c * 60) % 256).astype(np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(png, format="PNG")
    tone = (0.3 * np.sin(2 * math.pi * 440 * np.arange(16000) / 16000) * 32767).astype(np.int16)
    wav = io.BytesIO()
    soundfile.write(wav, tone, 16000, format="WAV", subtype="PCM_16")
    samples, rate = soundfile.read(io.BytesIO(wav.getvalue()), dtype="float32")  # what the master decodes
    b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    sent = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(png.getvalue())}},
        {"type": "input_audio", "input_audio": {"data": b64(wav.getvalue()), "format": "wav"}},
        {"type": "text", "text": "what is this?"}]}]
    decoded = [{"role": "user", "content": [
        {"type": "image", "image": {"dtype": "uint8", "shape": [56, 56, 3], "data": b64(pixels.tobytes())}},
        {"type": "audio", "audio": {"dtype": "float32", "shape": [len(samples)], "data": b64(samples.tobytes())},
         "sample_rate": rate},
        {"type": "text", "text": "what is this?"}]}]
    return sent, decoded


def report(config: pytest.Config, tag: str, msg: str) -> None:
    """Measurements are shown even without -s (capture is suspended for the print)."""
    with config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print(f"\n[{tag}] {msg}", flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test on the shared engine fleet shows the fleet's own log lines (a module fixture's
    teardown output would only show with the module's last test)."""
    outcome = yield
    rep = outcome.get_result()
    fleet = getattr(item, "funcargs", {}).get("fleet")
    if rep.when == "call" and rep.failed and fleet is not None:
        lines = [line for line in fleet.logs().splitlines() if "omnifleet" in line or "Error" in line]
        rep.sections.append(("fleet log lines", "\n".join(lines)[-20000:]))
