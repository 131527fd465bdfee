"""vLLM-Omni's AR and generation workers on vLLM's CPU worker and runner (as vLLM-Omni builds its XPU ones)."""
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin

logger = init_logger(__name__)


# MRO: omni runner methods first, their super() calls land in CPUModelRunner, then GPUModelRunner.
class _CPUWarmup:
    # CUDA path runs profile_run() inside determine_available_memory(); omni models rely on
    # that dummy forward for lazy state (e.g. Qwen2.5-Omni talker's self.voice_type). The CPU
    # worker skips it under enforce_eager, so always run it once here.
    def warming_up_model(self) -> None:
        logger.info("omnifleet_vllm_omni_cpu: running profile_run() as warmup")
        self.profile_run()


class CPUARModelRunner(_CPUWarmup, GPUARModelRunner, CPUModelRunner):
    pass


class CPUGenerationModelRunner(_CPUWarmup, GPUGenerationModelRunner, CPUModelRunner):
    pass


class _CPUOmniWorkerBase(OmniWorkerMixin, CPUWorker):
    model_runner_cls = None

    def init_device(self):
        super().init_device()
        if self.use_v2_model_runner:
            logger.warning("omnifleet_vllm_omni_cpu: forcing v1 model runner for omni hooks")
            self.use_v2_model_runner = False
        self.model_runner = self.model_runner_cls(self.vllm_config, self.device)

    def compile_or_warm_up_model(self):
        # Always do one dummy forward on CPU (CUDA path gets it from profile_run()).
        self.model_runner.warming_up_model()
        return super().compile_or_warm_up_model()


class CPUARWorker(_CPUOmniWorkerBase):
    model_runner_cls = CPUARModelRunner


class CPUGenerationWorker(_CPUOmniWorkerBase):
    model_runner_cls = CPUGenerationModelRunner
