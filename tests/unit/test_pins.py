"""The runtime image and the dev setup pin the same versions: the image's tests run what the local tests ran."""

from __future__ import annotations

import re
from pathlib import Path

from omnifleet_runtime.devsetup import vllm_cpu

DOCKERFILE = Path(__file__).resolve().parents[2] / "runtime" / "Dockerfile"


def arg_default(name: str) -> str:
    found = re.findall(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert len(set(found)) == 1, f"runtime/Dockerfile: ARG {name} defaults {found}"
    return found[0]


def test_the_runtime_image_pins_the_dev_setups_vllm_and_torchvision():
    assert arg_default("BASE").endswith(f":v{vllm_cpu.VLLM}"), (arg_default("BASE"), vllm_cpu.VLLM)
    assert arg_default("TORCHVISION") == vllm_cpu.TORCHVISION
