#!/usr/bin/env bash
# The GPU tests (tests/gpu, marked gpu) on a lent GPU host, in one command from the repository root:
#   tests/gpu/run.sh [PYTEST_ARGS...]           e.g. tests/gpu/run.sh -k mixed_tp
# The host has no internet; the call carries what benchmarks/gpu/prepare.sh makes on the CPU machine:
# .whl (grpcio), gpumodel8b (the Llama-3.1-8B-shaped model directory; made here with make_model8b.py
# when missing, which needs pdserve's embedded model) and the vLLM 0.24 + Ray bundle: its parts
# in /tmp/b/ from earlier calls, or carried as bundleK/ folders (benchmarks/gpu/env.sh).
# 2 GPUs run the 1P1D test, 3 the mixed-TP one; a test without its GPUs skips. Writes to $OUT
# (default /tmp/out): gpu-tests.log (the console), gpu-tests.xml (JUnit, with each test's KV pulls
# and request times as properties) and server-logs.tar.xz (every pdserve serve log).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
source benchmarks/gpu/env.sh || exit 2  # NCCL settings, the vLLM bundle, grpcio, PYTHONPATH
export PDSERVE_GPU_MODEL=${PDSERVE_GPU_MODEL:-$PWD/gpumodel8b}
if [[ ! -f $PDSERVE_GPU_MODEL/config.json ]]; then
  python3 benchmarks/gpu/make_model8b.py "$PDSERVE_GPU_MODEL" || {
    echo "run.sh: no model directory at $PDSERVE_GPU_MODEL and none could be made: carry gpumodel8b" \
      "(benchmarks/gpu/prepare.sh)" >&2
    exit 2
  }
fi
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
python3 -c "import torch, vllm, ray; print('torch', torch.__version__, 'vllm', vllm.__version__,
'ray', ray.__version__)" || { echo "run.sh: torch, vLLM or Ray does not import" >&2; exit 2; }
basetemp=/tmp/pdserve-gpu-tests
python3 -m pytest -m gpu tests/gpu -v -rA -p no:cacheprovider --basetemp "$basetemp" \
  --junitxml "$out/gpu-tests.xml" "$@" 2>&1 | tee "$out/gpu-tests.log"
status=${PIPESTATUS[0]}
# Every Ray instance on the host ends with the tests (a failed test may leave engines behind).
python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true
(cd "$basetemp" 2>/dev/null && find . -name '*.log' | tar -cJf "$out/server-logs.tar.xz" -T -) || true
python3 - "$out/gpu-tests.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    sys.exit(f"no JUnit report: {exc}")
print("\n== GPU tests")
for case in root.iter("testcase"):
    verdict = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
    outcome = "passed" if verdict is None else verdict.tag
    detail = "" if verdict is None else verdict.get("message", "")
    props = ", ".join(f"{p.get('name')}={p.get('value')}" for p in case.iter("property"))
    line = f"{outcome:8} {case.get('name')} ({float(case.get('time', 0)):.0f} s)"
    line += f": {detail.splitlines()[0][:200]}" if detail else ""
    print(line + (f"\n         {props}" if props else ""))
PY
echo "== exit $status (logs in $out)"
exit "$status"
