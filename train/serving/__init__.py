"""Serving exports in vLLM and generating answers with it: vLLM runs in its own environment
(:mod:`train.vllm.run`); :mod:`train.serving.serve` sets its figures beside this project's."""
