#!/usr/bin/env bash
# GPU proof (issues 9 and 7) on a 2- or 4-GPU host with the vLLM 0.24 + Ray bundle parts in /tmp/b
# (issue 31's grid of workloads and arms: benchmarks/gpu/grid.sh):
#   benchmarks/gpu/proof.sh MODEL_DIR PART...
#   PART: transfer | disagg | colocated | vllm          issue 9's two-GPU parts
#         arm:NAME:R1,R2,...                          any arm of proof.py (2P2D, 2P2D-grpc,
#                                                     1P1D-ipc, colocated-4, vllm-4) at these total rates
#                                                     (req/s); PROOF_STEP_TRACE=$OUT keeps the
#                                                     engines' step traces in ARM-raw.tar.xz
#         profile                                     one engine on the last GPU, measured by
#                                                     `pdserve sim profile --step-trace` (the
#                                                     simulator's input, with the engine's step fit)
#         ramp                                        the autoscaler from 1P1D under a rising load
#                                                     on every visible GPU (--max-gpus)
#         tp                                          prefill TP1 -> decode TP2 (benchmarks/gpu/tp_check.py)
# MODEL_DIR holds a Llama-3.1-8B-shaped config.json + tokenizer (no weights: vLLM's dummy load
# format). Each part writes under $OUT (default /tmp/out): transfer.json and transfer-gil.json
# (KV transport vs torch peer copy, idle and with a busy Python thread), ARM.json (one serving
# arm's sweep) and ARM-raw.tar.xz (the bench results and server logs), profile.json, ramp.json +
# ramp.png, tp.json. Parts can run in separate calls;
# `python benchmarks/gpu/proof.py summarize --results DIR` makes the goodput table from the JSON.
set -euo pipefail
model=${1:?usage: proof.sh MODEL_DIR PART...}; shift
out=${OUT:-/tmp/out}; mkdir -p "$out"
source "$(dirname "$0")/env.sh" || exit 2  # NCCL settings, the vLLM bundle, grpcio, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
# `ray stop` ends every Ray instance on the host: parts running side by side on other GPUs
# (benchmarks/gpu/x4.sh) set PROOF_KEEP_RAY=1 and stop Ray once they are all done.
stop_ray() { [[ -n ${PROOF_KEEP_RAY:-} ]] || python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true; }
for part in "$@"; do
  echo "== $part $(date -u +%H:%M:%S)"
  case $part in
    transfer)
      python3 benchmarks/transfer_bench.py --device cuda --sizes-mib 64,256,1024 --repeats 10 \
        --transports nccl --out "$out/transfer.json"
      python3 benchmarks/transfer_bench.py --device cuda --sizes-mib 64,256,1024 --repeats 10 \
        --transports nccl --gil-load --out "$out/transfer-gil.json" ;;
    disagg|colocated|vllm|arm:*)
      [[ $part == *vllm* ]] || trap stop_ray EXIT
      name=$part rates=()
      if [[ $part == arm:* ]]; then IFS=: read -r _ name r <<<"$part"; IFS=, read -r -a rates <<<"$r"; fi
      python3 benchmarks/gpu/proof.py run --arm "$name" --model "$model" --out "$out" \
        --budget-s "${PROOF_BUDGET_S:-300}" --arrival-s "${PROOF_ARRIVAL_S:-12}" \
        --min-prompts "${PROOF_MIN_PROMPTS:-80}" ${rates[@]:+--rates "${rates[@]}"} ${PROOF_MOCK:+--mock} || echo "$name failed: $?"
      [[ $name == vllm* ]] || stop_ray  # plain vLLM runs no Ray (another part's Ray may be up)
      # The arm's logs are in $name-raw/ with the bench results; PROOF_STEP_TRACE=$out: the engines'
      # step traces in $name-steps/.
      steps=$(cd "$out" && ls -d "$name-steps" 2>/dev/null; true)
      tar -cJf "$out/$name-raw.tar.xz" -C "$out" "$name-raw" $steps
      (cd "$out" && rm -rf "$name-raw" $steps) ;;
    profile)
      # One engine on PROFILE_GPU (default: the last, so it can run beside `transfer` on the first two).
      gpu=${PROFILE_GPU:-$(( $(nvidia-smi -L | wc -l) - 1 ))} port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])')
      t0=$(date +%s)
      CUDA_VISIBLE_DEVICES=$gpu python3 -m pdserve serve --port "$port" --model "$model" --served-model-name m \
        --load-format dummy --max-model-len 4096 --max-num-seqs 256 --set engine.max_num_batched_tokens=8192 \
        --set engine.gpu_memory_utilization=0.9 --set engine.enforce_eager=false --mode colocated \
        --set engine.step_trace_dir="$out/steps" --replicas 1 >"$out/profile-server.log" 2>&1 &
      pid=$!
      until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 2; kill -0 $pid || break; done
      startup=$(( $(date +%s) - t0 ))
      tokens=$(grep -oP 'GPU KV cache size: \K[\d,]+' "$out/profile-server.log" | head -1 | tr -d ,)
      python3 -m pdserve sim profile --base-url "http://127.0.0.1:$port" --model-dir "$model" \
        --num-kv-blocks $(( ${tokens:-0} / 16 )) --block-size 16 --max-num-seqs 256 \
        --max-num-batched-tokens 8192 --startup-s "$startup" --prompt-lens 256 1024 2048 3072 \
        --batches 1 8 32 64 128 --prefill-batch 16 --prefill-len 2048 --vocab-size 30000 \
        --step-trace "$out/steps" --mixed-requests 64 --mixed-rate 8 --context-len 2048 --note "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), vLLM 0.24 dummy Llama-8B shape" \
        --out "$out/profile.json" || echo "profile failed: $?"
      kill $pid; wait $pid 2>/dev/null || true; stop_ray  # a killed server exits non-zero (set -e)
      xz -f "$out/profile-server.log"; tar -cJf "$out/profile-steps.tar.xz" -C "$out" steps && rm -rf "$out/steps" ;;
    ramp)
      trap stop_ray EXIT
      n=$(nvidia-smi -L | wc -l)
      # The router's seed model: this host's engine if `profile` ran, else the H200 calibration
      # (either way refitted online from the first requests).
      seed=$out/profile.json; [[ -s $seed ]] || seed=benchmarks/profiles/h200-vllm0.24-llama8b.json
      python3 benchmarks/autoscale_burst.py --engine vllm --model "$model" --out "$out/ramp" \
        --ttft-ms 500 --tpot-ms 20 --prompt-tokens 2048 --output-tokens 256 --vocab-size 30000 \
        --phases "${RAMP_PHASES:-6:40:low,14:40:mid,26:100:high,6:60:after}" \
        --serve-arg=--load-format --serve-arg=dummy --serve-arg=--max-model-len --serve-arg=4096 \
        --serve-arg=--max-num-seqs --serve-arg=256 --serve-arg=--transport --serve-arg=nccl \
        --serve-arg=--max-prefill --serve-arg=$((n - 1)) --serve-arg=--max-decode --serve-arg=$((n - 1)) \
        --serve-arg=--max-gpus --serve-arg="$n" --serve-arg=--profile --serve-arg="$seed" \
        --serve-arg=--set --serve-arg=engine.max_num_batched_tokens=8192 \
        --serve-arg=--set --serve-arg=engine.gpu_memory_utilization=0.9 \
        --serve-arg=--set --serve-arg=autoscale.interval_s=2 \
        --serve-arg=--set --serve-arg=autoscale.upscale_cooldown_s=10 \
        --serve-arg=--set --serve-arg=autoscale.downscale_cooldown_s=20 \
        --serve-arg=--set --serve-arg=autoscale.downscale_intervals=5 \
        --serve-arg=--set --serve-arg=scheduler.window_s=10 || echo "ramp failed: $?"
      stop_ray
      for f in run.json summary.json burst.png; do cp "$out/ramp/$f" "$out/ramp-$f" 2>/dev/null; done
      xz -c "$out/ramp/pdserve.log" >"$out/ramp-pdserve.log.xz"; rm -rf "$out/ramp" ;;
    tp)
      trap stop_ray EXIT
      python3 benchmarks/gpu/tp_check.py --model "$model" --out "$out/tp.json" --arms ${TP_ARMS:-colocated-tp2 p1-d2 p2-d1} || echo "tp failed: $?"
      stop_ray ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
echo "== done $(date -u +%H:%M:%S)"
