#!/usr/bin/env bash
# Issue 32's scaling run with real engines: streamed tokens/s and TTFT at 1, 2 and 4 ingress
# replicas over the same two vLLM engines (one per GPU, colocated, the Llama-8B shape with dummy
# weights), on a Ray head started here:
#   benchmarks/gpu/scaleout.sh MODEL_DIR [REPLICAS...]        (default 1 2 4)
# The engines start once: after each phase the pdserve process is SIGKILLed (the deployment keeps
# serving: its actors are detached) and the next `pdserve serve --ingress-replicas N` attaches
# to it, adding replicas; no engine restarts. Each phase: a low-load TTFT (one stream at a time,
# 128-token prompts, 16 tokens) and a load phase (`--concurrency` streams of 128 -> 512 tokens
# from 8 client processes, benchmarks/stream_load.py). At the end a last `pdserve serve`
# attaches and SIGINT takes the deployment down. Results: $OUT/scaleout.json (one row per
# phase), a table on stdout. Keep NCCL_NVLS_ENABLE=0 (env.sh).
set -uo pipefail
model=${1:?usage: scaleout.sh MODEL_DIR [REPLICAS...]}; shift
replicas=("${@:-1}"); [[ $# -gt 0 ]] || replicas=(1 2 4)
out=${OUT:-/tmp/out}; mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
source "$here/env.sh" || exit 2
cd "$here/../.."
concurrency=${SCALEOUT_CONCURRENCY:-512}
port=8000
export RAY_AUTH_MODE=token
python3 -m ray.scripts.scripts get-auth-token --generate >/dev/null 2>&1  # a fresh host has none
python3 -m ray.scripts.scripts start --head --port=6390 --num-gpus="$(nvidia-smi -L | wc -l)" \
  --include-dashboard=false --disable-usage-stats >"$out/ray-start.log" 2>&1 || { tail "$out/ray-start.log"; exit 3; }
trap 'python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1' EXIT
serve() {  # N LOG: start pdserve with N ingress replicas, wait for its ready line
  python3 -m pdserve serve --ray-address 127.0.0.1:6390 --mode colocated --replicas 2 \
    --ingress-replicas "$1" --host 127.0.0.1 --port $port --model "$model" --served-model-name m \
    --load-format dummy --max-model-len 4096 --max-num-seqs 256 \
    --set engine.max_num_batched_tokens=8192 --set engine.gpu_memory_utilization=0.9 \
    --set engine.enable_prefix_caching=false --set engine.seed=0 >"$2" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    grep -q "pdserve ready" "$2" && return 0
    kill -0 $pid 2>/dev/null || { tail -30 "$2"; return 1; }
    sleep 1
  done
  tail -30 "$2"; return 1
}
scrape() {  # REPLICAS: the engines' and the frontends' TTFT sums and counts over every replica
  python3 benchmarks/replica_metrics.py --url http://127.0.0.1:$port --replicas "$1" \
    pdserve_engine_time_to_first_output_seconds_sum pdserve_engine_time_to_first_output_seconds_count \
    pdserve_time_to_first_token_seconds_sum pdserve_time_to_first_token_seconds_count
}
ingress_cpu() { ps -eo comm,times | awk '/^ray::Ingress/ {s += $2} END {print s + 0}'; }
load() {  # CONCURRENCY PROCESSES OUTPUT SECONDS
  python3 benchmarks/stream_load.py --url http://127.0.0.1:$port --model m --concurrency "$1" \
    --processes "$2" --prompt-tokens 128 --output-tokens "$3" --warmup-s 8 --seconds "$4"
}
echo "[" >"$out/scaleout.json"; first=1
for n in "${replicas[@]}"; do
  t0=$(date +%s)
  serve "$n" "$out/serve-$n.log" || exit 4
  echo "replicas $n ready after $(( $(date +%s) - t0 )) s"
  before=$(scrape "$n") || exit 6
  low=$(load 1 1 16 15) || exit 5
  sleep 2; after=$(scrape "$n") || exit 6
  cpu0=$(ingress_cpu)
  high=$(load "$concurrency" 8 512 30) || exit 5
  cpu1=$(ingress_cpu)
  [[ $first == 1 ]] || echo "," >>"$out/scaleout.json"; first=0
  # The replicas' CPU seconds over the load phase (8 s warm-up + 30 s window).
  echo "{\"replicas\": $n, \"low\": $low, \"low_metrics\": [$before, $after], \"load\": $high, \"ingress_cpu_s\": $((cpu1 - cpu0)), \"load_s\": 38}" >>"$out/scaleout.json"
  kill -9 $pid; wait $pid 2>/dev/null
done
echo "]" >>"$out/scaleout.json"
serve "${replicas[-1]}" "$out/serve-stop.log" && kill -INT $pid && wait $pid
echo "stop exit $?; left: $(pgrep -fc 'ray::(Ingress|Controller|EngineActor)')"
python3 - "$out/scaleout.json" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))
print("| replicas | tokens/s | TTFT p50 ms at load | TTFT p50 ms at 1 stream | engine's first output ms (mean) | overhead ms | ingress CPU ms / 1k tokens | errors | per replica |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    load, low = r["load"], r["low"]
    a, b = r["low_metrics"]
    key = "pdserve_engine_time_to_first_output_seconds"
    count = b[key + "_count"] - a[key + "_count"]
    engine_ms = 1000 * (b[key + "_sum"] - a[key + "_sum"]) / count if count else float("nan")
    r["engine_first_output_ms_mean"] = engine_ms
    r["ttft_overhead_ms_p50"] = low["ttft_ms_p50"] - engine_ms
    per_k = 1000 * r["ingress_cpu_s"] / (load["tokens_per_s"] * r["load_s"] / 1000)
    print(f"| {r['replicas']} | {load['tokens_per_s']:.0f} | {load['ttft_ms_p50']:.1f} | "
          f"{low['ttft_ms_p50']:.1f} | {engine_ms:.1f} | {r['ttft_overhead_ms_p50']:.1f} | "
          f"{per_k:.1f} | {load['errors']} | {load['ingress']} |")
json.dump(rows, open(sys.argv[1], "w"), indent=1)
EOF
