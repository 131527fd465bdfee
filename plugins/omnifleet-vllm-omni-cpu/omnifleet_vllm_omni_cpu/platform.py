"""The CPU platform: vLLM's CPU platform with vLLM-Omni's worker classes."""
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "omnifleet_vllm_omni_cpu.workers.CPUARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return "omnifleet_vllm_omni_cpu.workers.CPUGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def get_torch_device(cls, local_rank=None):
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def synchronize(cls) -> None:
        pass

    @classmethod
    def get_free_memory(cls, device=None) -> int:
        import psutil
        return psutil.virtual_memory().available

    @classmethod
    def get_device_memory(cls, device=None):
        import psutil
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @classmethod
    def memory_reserved(cls, device=None) -> int:
        return 0

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False
