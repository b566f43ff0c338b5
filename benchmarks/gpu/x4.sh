#!/usr/bin/env bash
# The GPU proof's parts on one 4-GPU host, several at once on disjoint GPUs, one step per device
# call (a call may run 10 minutes and return 8 files):
#   benchmarks/gpu/x4.sh MODEL_DIR STEP
#   a   issue 9's two-GPU arms on one host: pdserve 1P1D then colocated x2 on GPUs 0,1, beside
#       two plain vLLM engines behind round robin then the KV transfer benchmark on GPUs 2,3
#   b   issue 7: prefill TP2 -> decode TP1 and its colocated TP1 reference (tp_check.py) on
#       GPUs 0-2 beside the engine profile for the simulator on GPU 3; then 3P1D on all four
#   c   the two-GPU baselines' upper rates: pdserve colocated x2 on GPUs 0,1 beside plain vLLM x2
#       on GPUs 2,3 (10-20 req/s)
#   d   the same at 24-32 req/s, then 3P1D at 28 and 32 req/s on all four
#   e   (next session) 1P1D past its knee, and the bimodal disaggregated TTFT: 1P1D over NCCL
#       at 12-22 req/s on GPUs 0,1 beside 1P1D over gRPC at 8-12 on GPUs 2,3, both with step
#       traces; then the fixed engine profile on GPU 3
#   f   colocated x4 with the one-stream frontend, 12-36 req/s
#   g   2P2D and 1P3D with the one-stream frontend
#   h   the autoscaler ramp with a warm-up phase and longer phases (RAMP_PHASES overrides them)
#   i   colocated x4 at 16-48 req/s, then 3P1D at 16-40 (with g and h: issue 7's four ratios
#       and the ramp on one host in three calls)
#   j   issue 9's two pdserve arms re-measured with the fixed API (3022d06), one per GPU pair:
#       1P1D over NCCL at 8-22 req/s on GPUs 0,1 beside colocated x2 at 8-24 on GPUs 2,3
#   k   mixed TP with warm pulls (p1-d2, p2-d1 on GPUs 0-2) beside the fixed engine profile
#       on GPU 3; then the KV transfer under torch's profiler (both ends' kernel timelines) on
#       GPUs 0,1 beside NCCL's copy-engine P2P option (NCCL_P2P_USE_CUDA_MEMCPY) on GPUs 2,3
#   l   issue 9's transport with direct NCCL calls (nccl_direct) against torch's ProcessGroupNCCL,
#       each in fresh processes on GPUs 0,1, three ring settings, beside the peer copy; then the
#       bench's per-phase pull times (direct) under torch's profiler
#   m   issue 8's step fit with its own context term: the engine profile (its step trace now
#       carries each step's KV) on GPU 3 beside 1P1D over NCCL at 8-20 req/s with step traces on
#       GPUs 0,1 (the same host and hour, for the simulator's held-out comparison)
# Steps for a two-GPU host (issue 9's missing parts, when no 4-GPU kind is lent):
#   2a  1P1D over NCCL past its knee, 12-22 req/s, with step traces; then the transfer sweep
#       (ring settings, torch's NCCL flight recorder off) with both ends' pull phases
#   2b  colocated x2 at 4-18 req/s (this host's baseline at 1P1D's rates), step traces on
#   2c  two plain vLLM engines behind round robin at 4-18 req/s
#   2d  the fixed engine profile on GPU 1 (the simulator's input)
#   2e  the 20 ms knee: colocated x2 at 20-26 req/s, then 1P1D at 20
# Steps for a one-GPU host (the simulator's held-out check on a GPU it has not seen):
#   1a  the engine profile on GPU 0 (with its step trace)
#   1b  colocated x1 at 4-12 req/s with step traces (the two-GPU arms' per-engine rates, the
#       seeds of every earlier run); run it twice for a repeat on the same arrivals
# As run on 2026-11-26 on 2 x H100 (benchmarks/results/gpu/2026-11-26-h100-x2/): 2a, 2b, 2c, 2e.
# As run on 2026-11-27 on 4 x H100 (benchmarks/results/gpu/2026-11-27-h100-x4/): i, g, h, then
# colocated x4 at 44 and 48 req/s (`PROOF_BUDGET_S=215 proof.sh gpumodel8b arm:colocated-4:44,48`).
# As run on 2026-11-27 on 4 x H100, session 8 (benchmarks/results/gpu/2026-11-27-h100-x4-b/): h, j, k
# (prepare the carried folders with benchmarks/gpu/prepare.sh).
# As run on 2026-11-27 on 2 x H100, session 11 (benchmarks/results/gpu/2026-11-27-h100-x2-s11/): 2d,
# the two arms by proof.sh directly, 2d again (its README has the commands).
# As run on 2026-11-26 (benchmarks/results/gpu/2026-11-26-h200-x4/), a to d back to back on one
# warm host. Step a's 260 s budget stopped 1P1D after 12 req/s (it started in 143 s and each
# rate took ~40 s, not the 20 s planned): give an arm ~120 s to start plus ~40 s per rate.
# Each stream's console goes to $OUT/STEP-STREAM.log; everything is packed into $OUT/STEP.tar.
# Rates are total req/s; an arm stops after the first rate where no TPOT target reaches 50%.
set -uo pipefail
model=${1:?usage: x4.sh MODEL_DIR STEP}; step=${2:?step a to m, 2a to 2e or 1a, 1b}
out=${OUT:-/tmp/out}; mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
source "$here/env.sh" || exit 2  # NCCL settings, the vLLM bundle, grpcio, PYTHONPATH
export PROOF_ARRIVAL_S=${PROOF_ARRIVAL_S:-8} PROOF_MIN_PROMPTS=${PROOF_MIN_PROMPTS:-50} PROOF_KEEP_RAY=1
proof() { "$here/proof.sh" "$model" "$@"; }
stream() { local name=$1; shift; ( "$@" ) >"$out/$step-$name.log" 2>&1 & }
case $step in
  a)
    stream x bash -c "$(declare -f proof); here=$here model=$model
      CUDA_VISIBLE_DEVICES=0,1 PROOF_BUDGET_S=260 proof arm:disagg:8,10,12,14,16,18,20,22
      CUDA_VISIBLE_DEVICES=0,1 PROOF_BUDGET_S=250 proof arm:colocated:4,6,8,10,12,14,16,18"
    stream y bash -c "$(declare -f proof); here=$here model=$model
      CUDA_VISIBLE_DEVICES=2,3 PROOF_BUDGET_S=420 proof arm:vllm:4,6,8,10,12,14,16,18
      CUDA_VISIBLE_DEVICES=2,3 proof transfer" ;;
  b)
    stream x bash -c "$(declare -f proof); here=$here model=$model
      CUDA_VISIBLE_DEVICES=0,1,2 TP_ARMS='p2-d1 colocated-tp1' proof tp"
    stream y bash -c "$(declare -f proof); here=$here model=$model; PROFILE_GPU=3 proof profile"
    wait
    python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
    stream z bash -c "$(declare -f proof); here=$here model=$model
      PROOF_BUDGET_S=240 proof arm:3P1D:12,16,20,24,28,32" ;;
  c)
    stream x bash -c "$(declare -f proof); here=$here model=$model
      CUDA_VISIBLE_DEVICES=0,1 PROOF_BUDGET_S=420 proof arm:colocated:10,12,14,16,18,20"
    stream y bash -c "$(declare -f proof); here=$here model=$model
      CUDA_VISIBLE_DEVICES=2,3 PROOF_BUDGET_S=420 proof arm:vllm:10,12,14,16,18,20" ;;
  d)
    stream x bash -c "$(declare -f proof); here=$here model=$model
      CUDA_VISIBLE_DEVICES=0,1 PROOF_BUDGET_S=150 proof arm:colocated:24,28,32"
    stream y bash -c "$(declare -f proof); here=$here model=$model
      CUDA_VISIBLE_DEVICES=2,3 PROOF_BUDGET_S=150 proof arm:vllm:24,28,32"
    wait
    python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
    stream z bash -c "$(declare -f proof); here=$here model=$model
      PROOF_BUDGET_S=160 proof arm:3P1D:28,32" ;;
  e)
    export PROOF_STEP_TRACE=$out
    stream x bash -c "$(declare -f proof); here=$here model=$model
      CUDA_VISIBLE_DEVICES=0,1 PROOF_BUDGET_S=420 proof arm:disagg:12,14,16,18,20,22"
    stream y bash -c "$(declare -f proof); here=$here model=$model
      CUDA_VISIBLE_DEVICES=2,3 PROOF_BUDGET_S=260 proof arm:1P1D-grpc:8,10,12
      PROFILE_GPU=3 proof profile" ;;
  2a)
    export PROOF_STEP_TRACE=$out
    stream x bash -c "$(declare -f proof); here=$here model=$model
      PROOF_BUDGET_S=400 proof arm:disagg:8,10,12,14,16,18
      NCCL_NVLS_ENABLE=0 python3 benchmarks/research/transfer_sweep.py --sizes-mib 64,256,1024 --repeats 10 \
        --configs 64:4,128:2,256:2,32:8 --nccl-env '' --env-configs 64:4,256:2 \
        --nccl-env 'TORCH_NCCL_TRACE_BUFFER_SIZE=0 TORCH_FR_BUFFER_SIZE=0' --out $out/sweep.json" ;;
  2b)
    export PROOF_STEP_TRACE=$out
    stream x bash -c "$(declare -f proof); here=$here model=$model
      PROOF_BUDGET_S=450 proof arm:colocated:4,6,8,10,12,14,16,18" ;;
  2c)
    stream x bash -c "$(declare -f proof); here=$here model=$model
      PROOF_BUDGET_S=450 proof arm:vllm:4,6,8,10,12,14,16,18" ;;
  2e)
    stream x bash -c "$(declare -f proof); here=$here model=$model
      PROOF_BUDGET_S=290 proof arm:colocated:20,22,24,26
      PROOF_BUDGET_S=185 proof arm:disagg:20" ;;
  2d)
    stream x bash -c "$(declare -f proof); here=$here model=$model; PROFILE_GPU=1 proof profile" ;;
  1a)
    stream x bash -c "$(declare -f proof); here=$here model=$model; PROFILE_GPU=0 proof profile" ;;
  1b)
    export PROOF_STEP_TRACE=$out
    stream x bash -c "$(declare -f proof); here=$here model=$model
      PROOF_BUDGET_S=330 proof arm:colocated-1:4,6,8,10,12" ;;
  f)
    stream x bash -c "$(declare -f proof); here=$here model=$model
      PROOF_BUDGET_S=500 proof arm:colocated-4:12,16,20,24,28,32,36" ;;
  g)
    stream x bash -c "$(declare -f proof); here=$here model=$model
      PROOF_BUDGET_S=315 proof arm:2P2D:16,20,24,30,36
      PROOF_BUDGET_S=255 proof arm:1P3D:12,16,20,24" ;;
  h)
    stream x bash -c "$(declare -f proof); here=$here model=$model
      RAMP_PHASES=${RAMP_PHASES:-4:20:warmup,6:45:low,14:45:mid,26:180:high,6:75:after} proof ramp" ;;
  i)
    stream x bash -c "$(declare -f proof); here=$here model=$model
      PROOF_BUDGET_S=290 proof arm:colocated-4:16,24,32,40,48
      PROOF_BUDGET_S=230 proof arm:3P1D:16,24,32,40" ;;
  j)
    stream x bash -c "$(declare -f proof); here=$here model=$model
      CUDA_VISIBLE_DEVICES=0,1 PROOF_BUDGET_S=530 proof arm:disagg:8,10,12,14,16,18,20,22"
    stream y bash -c "$(declare -f proof); here=$here model=$model
      CUDA_VISIBLE_DEVICES=2,3 PROOF_BUDGET_S=530 proof arm:colocated:8,10,12,14,16,18,20,22,24" ;;
  k)
    stream x bash -c "$(declare -f proof); here=$here model=$model
      CUDA_VISIBLE_DEVICES=0,1,2 TP_ARMS='p1-d2 p2-d1' proof tp"
    stream y bash -c "$(declare -f proof); here=$here model=$model; PROFILE_GPU=3 proof profile"
    wait
    python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
    stream t env CUDA_VISIBLE_DEVICES=0,1 python3 benchmarks/transfer_bench.py --device cuda \
      --sizes-mib 256,1024 --repeats 10 --transports nccl --torch-profile "$out/transfer-profile" \
      --out "$out/transfer.json"
    stream u env CUDA_VISIBLE_DEVICES=2,3 python3 benchmarks/research/transfer_sweep.py --sizes-mib 256,1024 \
      --repeats 10 --configs 64:4 --env-configs 64:4 --nccl-env '' --nccl-env 'NCCL_P2P_USE_CUDA_MEMCPY=1' --variant-timeout-s 150 \
      --nccl-log-dir "$out/nccl-logs" --out "$out/sweep-ce.json" ;;
  l)
    stream t bash -c "export CUDA_VISIBLE_DEVICES=0,1
      python3 benchmarks/research/transfer_sweep.py --sizes-mib 256,1024 --repeats 20 --configs 64:4,128:2,32:8 \
        --env-configs 64:4,128:2,32:8 --nccl-env '' --nccl-api auto --nccl-api torch \
        --variant-timeout-s 200 --out $out/sweep-api.json
      python3 benchmarks/transfer_bench.py --device cuda --sizes-mib 256,1024 --repeats 20 \
        --transports nccl --torch-profile $out/transfer-profile --out $out/transfer.json" ;;
  m)
    export PROOF_STEP_TRACE=$out
    stream x bash -c "$(declare -f proof); here=$here model=$model
      CUDA_VISIBLE_DEVICES=0,1 PROOF_BUDGET_S=330 proof arm:disagg:8,12,16,20"
    stream y bash -c "$(declare -f proof); here=$here model=$model; PROFILE_GPU=3 proof profile" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
wait
python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
tail -n 12 "$out/$step"-*.log
(cd "$out" && ls | grep -v "^$step.tar$" | tar -cf "$step.tar" -T - && ls | grep -v "^$step.tar$" | xargs rm -rf)
ls -la "$out"
