#!/usr/bin/env bash
# GPU proof (issue 9) on a 2-GPU host with the vLLM 0.24 + Ray bundle parts already in /tmp/b:
#   benchmarks/gpu/proof.sh MODEL_DIR PART...     PART: transfer | disagg | colocated | vllm
# MODEL_DIR holds a Llama-3.1-8B-shaped config.json + tokenizer (no weights: vLLM's dummy load
# format). Each part writes under $OUT (default /tmp/out): transfer.json and transfer-gil.json
# (KV transport vs torch peer copy, idle and with a busy Python thread), ARM.json (one serving
# arm's sweep) and ARM-raw.tar.xz (the bench results and server logs). Parts can run in separate
# calls; `python benchmarks/gpu/proof.py summarize --results DIR` makes the table from the JSON.
set -euo pipefail
model=${1:?usage: proof.sh MODEL_DIR PART...}; shift
out=${OUT:-/tmp/out}; mkdir -p "$out"
# NVLink multicast stays off on shared hosts; vLLM 0.24's FlashInfer sampler needs a JIT we lack.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
[[ -d /tmp/site ]] || { cat /tmp/b/part.* | xz -d -T0 | tar -x -C /tmp; }
# The generated gRPC code needs grpcio >= 1.85.1; the host has 1.84.
[[ -d /tmp/site2 ]] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/grpcio-*.whl
export PYTHONPATH=/tmp/site2:/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
stop_ray() { python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true; }
for part in "$@"; do
  echo "== $part $(date -u +%H:%M:%S)"
  case $part in
    transfer)
      python3 benchmarks/transfer_bench.py --device cuda --sizes-mib 64,256,1024 --repeats 10 \
        --transports nccl --out "$out/transfer.json"
      python3 benchmarks/transfer_bench.py --device cuda --sizes-mib 64,256,1024 --repeats 10 \
        --transports nccl --gil-load --out "$out/transfer-gil.json" ;;
    disagg|colocated|vllm)
      trap stop_ray EXIT
      python3 benchmarks/gpu/proof.py run --arm "$part" --model "$model" --out "$out" \
        --budget-s "${PROOF_BUDGET_S:-300}" || echo "$part failed: $?"
      stop_ray
      tar -cJf "$out/$part-raw.tar.xz" -C "$out" "$part-raw" $(cd "$out" && ls ./*-server.log proxy.log 2>/dev/null)
      rm -rf "$out/$part-raw" "$out"/*-server.log "$out/proxy.log" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
echo "== done $(date -u +%H:%M:%S)"
