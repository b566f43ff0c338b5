#!/usr/bin/env bash
# Issue 31's serving tax on a 2-GPU host: what pdserve adds to a request's TTFT over plain vLLM on
# the same arrivals (ISL 2048 / OSL 256 token-id prompts, Poisson, the seeds of every earlier run),
# one step per device call:
#   benchmarks/gpu/tax.sh MODEL_DIR STEP
#   a   plain `vllm serve` (vllm-1) on GPU 0 beside pdserve colocated x1 (colocated-1, the request
#       plane on: engine.request_plane direct) on GPU 1, at the same time, 2-14 req/s
#   b   pdserve 1P1D (KV over NCCL) on GPUs 0,1 at 2-12 req/s: its first token against step a's
#       vllm-1 at the same arrivals
# Each step writes ARM.json (per rate, each request's TTFT and TPOT) and ARM-raw.tar.xz under
# $OUT; step a then prints the request-by-request TTFT differences (tax_summary.py):
# `pdserve_ttft[i] - vllm_ttft[i]` per rate (median over requests both completed) and the median
# over rates.
set -uo pipefail
model=${1:?usage: tax.sh MODEL_DIR STEP}; step=${2:?step a or b}
out=${OUT:-/tmp/out}; mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
source "$here/env.sh" || exit 2  # NCCL settings, the vLLM bundle, grpcio, PYTHONPATH
export PROOF_ARRIVAL_S=${PROOF_ARRIVAL_S:-10} PROOF_MIN_PROMPTS=${PROOF_MIN_PROMPTS:-40} PROOF_KEEP_RAY=1
proof() { "$here/proof.sh" "$model" "$@"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case $step in
  a) CUDA_VISIBLE_DEVICES=0 PROOF_BUDGET_S=${TAX_BUDGET_S:-430} proof arm:vllm-1:2,4,6,8,10,12,14 >"$out/a-vllm.log" 2>&1 &
     CUDA_VISIBLE_DEVICES=1 PROOF_BUDGET_S=${TAX_BUDGET_S:-430} proof arm:colocated-1:2,4,6,8,10,12,14 >"$out/a-pdserve.log" 2>&1 &
     wait; tail -n 12 "$out/a-vllm.log" "$out/a-pdserve.log" ;;
  b) CUDA_VISIBLE_DEVICES=0,1 PROOF_BUDGET_S=${TAX_BUDGET_S:-430} proof arm:1P1D:2,4,6,8,10,12 \
       >"$out/b-1p1d.log" 2>&1; tail -n 12 "$out/b-1p1d.log" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
# The request-by-request table of this call (a): benchmarks/gpu/tax_summary.py, which also joins
# several calls' folders and 1P1D's first token (see the results README for the full command).
if [[ -f $out/vllm-1.json && -f $out/colocated-1.json ]]; then
  python3 "$here/tax_summary.py" --runs "$out" --out "$out/summary.json"
fi
