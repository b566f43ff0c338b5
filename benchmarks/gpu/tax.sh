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
# $OUT, then prints the request-by-request TTFT differences against vllm-1.json when $OUT has it:
# `pdserve_ttft[i] - vllm_ttft[i]` per rate (median, p10, p90 over requests both completed) and
# the median over rates.
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
python3 - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
ref = out / "vllm-1.json"
if not ref.exists():
    sys.exit(0)
vllm = {r["rate"]: r["requests"]["ttft_ms"] for r in json.loads(ref.read_text())["rates"]}
print("| arm | rate | requests | TTFT - vLLM's, median ms | p10 | p90 | vLLM TTFT p50 ms |")
print("|---|---|---|---|---|---|---|")
for path in sorted(out.glob("*.json")):
    if path.name == "vllm-1.json" or not path.name[0].isalnum():
        continue
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, OSError):
        continue
    if not isinstance(record, dict) or "rates" not in record:
        continue
    medians = []
    for row in record["rates"]:
        theirs = vllm.get(row["rate"])
        if theirs is None:
            continue
        diffs = sorted(a - b for a, b in zip(row["requests"]["ttft_ms"], theirs)
                       if a is not None and b is not None)
        if not diffs:
            continue
        medians.append(statistics.median(diffs))
        ok = [b for b in theirs if b is not None]
        print(f"| {path.stem} | {row['rate']:g} | {len(diffs)} | {medians[-1]:+.2f} | "
              f"{diffs[len(diffs) // 10]:+.2f} | {diffs[len(diffs) * 9 // 10]:+.2f} | "
              f"{statistics.median(ok):.1f} |")
    if medians:
        print(f"| {path.stem} | all | | **{statistics.median(medians):+.2f}** (median over rates) | | | |")
EOF
