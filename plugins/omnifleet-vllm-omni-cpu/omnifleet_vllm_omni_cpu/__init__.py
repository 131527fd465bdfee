"""vLLM-Omni platform plugin: run vLLM-Omni's stage engines on the CPU.

vLLM-Omni detects only accelerator platforms; without this it falls back to a
platform whose worker classes raise NotImplementedError. Registered through the
`vllm_omni.platform_plugins` entry point.
"""


def cpu_omni_platform_plugin() -> str:
    return "omnifleet_vllm_omni_cpu.platform.CpuOmniPlatform"
