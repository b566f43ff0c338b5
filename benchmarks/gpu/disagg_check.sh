#!/usr/bin/env bash
# On a 2-GPU host with the vLLM 0.24 + Ray bundle parts already in /tmp/b (see README.md):
#   benchmarks/gpu/disagg_check.sh MODEL_DIR
# MODEL_DIR holds a config.json + tokenizer (no weights: vLLM's dummy load format).
set -euo pipefail
export NCCL_NVLS_ENABLE=0 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
[[ -d /tmp/site ]] || { cat /tmp/b/part.* | xz -d | tar -x -C /tmp; }
# The generated gRPC code needs grpcio >= 1.85.1; the host has 1.84.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/grpcio-*.whl
export PYTHONPATH=/tmp/site2:/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import vllm, ray; print('vllm', vllm.__version__, 'ray', ray.__version__)"
python3 benchmarks/gpu/disagg_check.py --model "$1" --out "${OUT:-/tmp/out}"
