"""The vLLM-Omni wheel as data: downloaded once without its dependencies, its deploy files unpacked.

Nothing here imports vLLM-Omni; the wheel is read as a zip. Used by the tests
(every bundled deploy file through the importer) and to regenerate the
topology data (`python -m omnifleet_operator.vllm_omni.topology $(python -m
omnifleet_operator.vllm_omni.wheel --wheel)`).

    python -m omnifleet_operator.vllm_omni.wheel [--version V] [--wheel]

prints the directory holding the unpacked `vllm_omni/deploy/` (or, with
--wheel, the wheel's path). Cache: ${OMNIFLEET_CACHE:-~/.cache/omnifleet}.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from .importer import DEFAULT_VERSION


def cache_root() -> Path:
    return Path(os.environ.get("OMNIFLEET_CACHE") or Path.home() / ".cache" / "omnifleet")


def ensure_wheel(version: str = DEFAULT_VERSION) -> Path:
    """The wheel file, downloaded with `pip download --no-deps` the first time."""
    folder = cache_root() / "wheels" / f"vllm-omni-{version}"
    name = f"vllm_omni-{version}-py3-none-any.whl"
    wheel = folder / name
    if not wheel.exists():
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               f"vllm-omni=={version}", "-d", str(folder)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not wheel.exists():
            raise RuntimeError(f"cannot download vllm-omni=={version} ({' '.join(cmd)}): "
                               f"{(done.stderr or done.stdout).strip()[-500:]}")
    return wheel


def ensure_unpacked(version: str = DEFAULT_VERSION) -> Path:
    """A directory with the wheel's `vllm_omni/deploy/` files (and nothing else of it)."""
    root = cache_root() / "vllm-omni" / version
    stamp = root / ".unpacked"
    if not stamp.exists():
        with zipfile.ZipFile(ensure_wheel(version)) as zf:
            for member in zf.namelist():
                if member.startswith("vllm_omni/deploy/") and not member.endswith("/"):
                    zf.extract(member, root)
        stamp.touch()
    return root


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnifleet_operator.vllm_omni.wheel")
    p.add_argument("--version", default=DEFAULT_VERSION)
    p.add_argument("--wheel", action="store_true", help="print the wheel's path instead")
    args = p.parse_args(argv)
    print(ensure_wheel(args.version) if args.wheel else ensure_unpacked(args.version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
