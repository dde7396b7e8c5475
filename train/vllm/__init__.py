"""vLLM from this environment: jobs run by the Python of an environment that has vLLM (:mod:`train.vllm.run`),
in a worker that imports nothing from this package (:mod:`train.vllm.worker`)."""

from train.vllm.run import VllmNotInstalledError, VllmRunError, find_vllm_python, run_vllm_job, vllm_available

__all__ = ["VllmNotInstalledError", "VllmRunError", "find_vllm_python", "run_vllm_job", "vllm_available"]
