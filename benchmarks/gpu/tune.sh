#!/usr/bin/env bash
# Issue 31's "`pdserve bench tune` on real engines names pdserve's best configuration": the tuner
# over deployments of one host's GPUs, for one workload of the grid and one TPOT target, with the
# grid's engine settings (pdserve.bench.arms.ENGINE), resumable across device calls:
#   benchmarks/gpu/tune.sh MODEL_DIR WORKLOAD TPOT_MS DEPLOYMENT...
#   e.g. benchmarks/gpu/tune.sh gpumodel8b isl8k 20 colocated:2 1P1D 1P1D-adaptive
#   WORKLOAD: isl2k, isl8k, isl16k, mooncake (pdserve.bench.grid: its requests and TTFT target)
# A candidate takes an engine start (~110-160 s on an H200 host) and its goodput search (up to
# TUNE_MAX_PROBES probes of TUNE_PROMPTS requests from the workload's unit rate up): about one
# device call each. List every deployment wanted in each call and carry the last call's
# tune.json back in: the trials it holds are reused, the others run while the time lasts, and
# the call that evaluates the last one prints the ranking over all of them.
# Environment:
#   OUT            results (default /tmp/out): tune.json, tune.csv, the console, raw.tar.xz (logs)
#   TUNE_RESUME    an earlier call's tune.json (carried in an ignored folder): its trials are reused
#   TUNE_PROMPTS   requests per probe (default 48); TUNE_MAX_PROBES (default 5)
#   TUNE_MOCK=1    a CPU test of the script: pdserve's mock engine, no bundle; TUNE_PYTHON picks
#                  the interpreter (default python3)
set -uo pipefail
model=${1:?usage: tune.sh MODEL_DIR WORKLOAD TPOT_MS DEPLOYMENT...}
workload=${2:?workload}; tpot=${3:?TPOT target in ms}; shift 3
(( $# )) || { echo "usage: tune.sh MODEL_DIR WORKLOAD TPOT_MS DEPLOYMENT..."; exit 2; }
out=${OUT:-/tmp/out}; mkdir -p "$out/tune"
here=$(cd "$(dirname "$0")" && pwd)
py=${TUNE_PYTHON:-python3}
if [[ -z ${TUNE_MOCK:-} ]]; then
  source "$here/env.sh" || exit 2  # NCCL settings, the vLLM bundle, grpcio, PYTHONPATH
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  ngpus=$(nvidia-smi -L | wc -l)
else
  ngpus=2
fi
[[ -z ${TUNE_RESUME:-} ]] || cp "$TUNE_RESUME" "$out/tune/tune.json" || exit 2
# The workload's requests, TTFT target and first rate; the engines' settings as every grid arm's.
mapfile -t flags < <("$py" - "$model" "$workload" "$tpot" "$ngpus" "${TUNE_MOCK:+mock}" <<'EOF'
import shlex, sys
from pdserve.bench.arms import ENGINE, pdserve_args
from pdserve.bench.grid import WORKLOADS
model, name, tpot, ngpus, mock = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] == ["mock"]
w = WORKLOADS[name]
# The tuner sets max_num_seqs and max_num_batched_tokens itself (one candidate each: ENGINE's).
serve = pdserve_args(model, mock, knobs=False)
for flag in [*w.bench_flags(), "--tokenizer", model, "--prompt-format", "token-ids", "--ignore-eos",
             "--goodput", f"ttft:{w.ttft_ms:g}", f"tpot:{tpot:g}",
             "--search-start-rate", f"{w.rate_unit * ngpus:g}", "--serve-args", shlex.join(serve),
             "--num-seqs-list", str(ENGINE["max_num_seqs"]),
             "--num-batched-tokens-list", str(ENGINE["max_num_batched_tokens"])]:
    print(flag)
EOF
) || exit 2
# shellcheck disable=SC2068 # the deployments: one word each
"$py" -m pdserve bench tune "${flags[@]}" --deployments $@ --resume --result-dir "$out/tune" \
  --num-prompts "${TUNE_PROMPTS:-48}" --search-max-probes "${TUNE_MAX_PROBES:-5}" --search-growth 2 \
  --search-tolerance 0.15 --start-timeout 400 --no-plots --disable-tqdm 2>&1 | tee "$out/tune/console.log"
rc=${PIPESTATUS[0]}
cp "$out/tune/tune.json" "$out/tune/tune.csv" "$out/" 2>/dev/null
(cd "$out/tune" && tar -cJf "$out/raw.tar.xz" logs console.log 2>/dev/null)
rm -rf "$out/tune"
exit "$rc"
