#!/usr/bin/env bash
# Issue 31's grid ("where disaggregation wins") on a GPU host, one device call at a time:
#   benchmarks/gpu/grid.sh MODEL_DIR SLICE...
#   SLICE: WORKLOAD[+WORKLOAD...]:ARM[,ARM...]      e.g. isl8k+isl16k:1P1D
#     WORKLOAD: isl2k (TTFT <= 500 ms), isl8k, isl16k, mooncake (TTFT <= 2 s): pdserve.bench.grid
#     ARM: 1P1D (KV over NCCL), 1P1D-ipc (CUDA IPC), 1P1D-adaptive[-Tms] (`pdserve serve
#          --adaptive`, routing against the first workload's TTFT and TPOT T, default 10 ms),
#          colocated-N, vllm-N (one vLLM is reached directly, two or more behind the round-robin
#          proxy), any xPyD; `,` runs
#          arms one after another, `/` side by side on disjoint GPUs (isl2k:colocated-1/vllm-1)
#   Each arm starts once and sweeps each of the slice's workloads in turn (a bisection on its
#   rate lattice, tightest TPOT target first; benchmarks/gpu/proof.py run). Slices run in order.
# Environment (the only configuration by variables: this wrapper's, for the device tool's calls):
#   OUT             results folder (default /tmp/out): RECORD.json per arm start, raw.tar.xz (bench
#                   results, server logs, consoles), summary.json, attainment.png; the records go
#                   into records.tar when they would make more than the 8 files a device call returns
#   GRID_BUDGET_S   seconds from this script's start by which it is done, packing included
#                   (default 570: the device stops a call at 600)
#   GRID_ARM_START_S  an arm's expected start (default 170: a fresh H200 host took 136-173 s)
#   GRID_RESERVE_S  kept back for the last arm's stop, Ray's, packing, the summary (default 50)
#   GRID_ARGS       more `proof.py run` flags (e.g. "--steps-per-octave 8", "--max-probes 5")
#   GRID_MOCK=1     a CPU test of the whole path: pdserve's mock engine, no bundle, no `ray stop`
#                   (on a shared CPU box that would end other people's Ray); GRID_PYTHON picks the
#                   interpreter (default python3)
#   PROOF_STEP_TRACE=$OUT  pdserve arms' engine step traces, packed with the raw data
# Each group of arms gets an equal share of the time left (all of it when a share would not hold
# GRID_ARM_START_S + 60 s: slices come in priority order); an arm's probes stop inside its share
# (proof.py --budget-s), each workload's inside an equal part of what is left after the start.
# What did not fit is printed at the end: run it in the next call. The last lines are the cells'
# table (proof.py summarize).
set -uo pipefail
t0=$(date +%s)
model=${1:?usage: grid.sh MODEL_DIR SLICE...}; shift
(( $# )) || { echo "usage: grid.sh MODEL_DIR SLICE..."; exit 2; }
out=${OUT:-/tmp/out}; mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
budget=${GRID_BUDGET_S:-570} start_s=${GRID_ARM_START_S:-170} reserve=${GRID_RESERVE_S:-50}
py=${GRID_PYTHON:-python3}
if [[ -z ${GRID_MOCK:-} ]]; then
  source "$here/env.sh" || exit 2  # NCCL settings, the vLLM bundle, grpcio, PYTHONPATH
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
  ngpus=$(nvidia-smi -L | wc -l)
else
  ngpus=2
fi
IFS=, read -r -a visible <<<"${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((ngpus - 1)))}"
visible_csv=$(IFS=,; echo "${visible[*]}")
left() { echo $(( budget - ($(date +%s) - t0) )); }
stop_ray() { [[ -n ${GRID_MOCK:-} ]] || "$py" -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true; }
trap stop_ray EXIT
# Every slice is checked (workloads, arms, GPUs) before anything starts.
plan=$("$py" "$here/proof.py" plan --gpus "$visible_csv" --start-s "$start_s" "$@") || exit 2
mapfile -t groups <<<"$plan"
record_name() {  # ARM -> ARM, or ARM-2, ARM-3 when this call already ran it
  local name=$1 k=2
  while [[ -e $out/$name.json ]]; do name=$1-$k; k=$((k + 1)); done
  echo "$name"
}
# Each group (arms started together) gets an equal share of the time left, or, when a share would
# not hold an arm's start and a probe, the whole of it (the slices come in priority order).
share_of() {  # GROUPS_LEFT -> seconds for this group, 0 when not even the whole is enough
  local whole=$(( $(left) - reserve )) share
  share=$(( whole / $1 )); (( share >= start_s + 60 )) || share=$whole
  (( share >= start_s + 60 )) && echo "$share" || echo 0
}
skipped=() n=${#groups[@]} i=0
for line in "${groups[@]}"; do
  IFS=$'\t' read -r _ workloads arms <<<"$line"
  share=$(share_of $(( n - i ))); i=$((i + 1))
  if (( share == 0 )); then
    skipped+=("${workloads// /+}:${arms}"); echo "== skip ${workloads// /+}: $arms ($(left) s left)"; continue
  fi
  echo "== ${workloads// /+}: $arms $(date -u +%H:%M:%S), $(left) s left, $share s for this group"
  pids=()
  for arm_gpus in $arms; do
    arm=${arm_gpus%%=*} gpus=${arm_gpus#*=} rec=$(record_name "${arm_gpus%%=*}")
    touch "$out/$rec.json"  # claims the name before a side-by-side arm looks
    # shellcheck disable=SC2086 # GRID_ARGS: several flags
    "$py" "$here/proof.py" run --arm "$arm" --record "$rec" --gpus "$gpus" --workloads $workloads \
      --model "$model" --out "$out" --budget-s "$share" ${GRID_MOCK:+--mock} ${GRID_ARGS:-} \
      2>&1 | sed -u "s/^/[$rec] /" | tee "$out/$rec.console.log" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || echo "== an arm of $arms failed ($?)"; done
  stop_ray  # engines of a killed server may linger in Ray; the next arm needs the GPUs free
done
for rec in "$out"/*.json; do [[ -s $rec ]] || rm -f "$rec"; done  # names claimed, arm never started
echo "== packing $(date -u +%H:%M:%S)"
raw=$(cd "$out" && ls -d ./*-raw ./*.console.log ./*-steps 2>/dev/null)
# shellcheck disable=SC2086 # one name per line, none with spaces
[[ -z $raw ]] || { tar -cJf "$out/raw.tar.xz" -C "$out" $raw && (cd "$out" && rm -rf $raw); }
"$py" "$here/proof.py" summarize --results "$out" || echo "== summarize failed ($?)"
if (( $(ls "$out" | wc -l) > 8 )); then  # the device brings 8 files of $OUT back: one for the records
  records=$(cd "$out" && ls ./*.json | grep -v '^./summary.json$')
  # shellcheck disable=SC2086 # arm names: no spaces
  (cd "$out" && tar -cf records.tar $records && rm -f $records) && echo "== records in records.tar (tar -xf it)"
fi
echo "== done in $(( $(date +%s) - t0 )) s$( (( ${#skipped[@]} )) && echo "; not run (no time left): ${skipped[*]}")"
