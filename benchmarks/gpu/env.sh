# The environment every GPU program runs in on a lent GPU host (no internet), sourced by
# benchmarks/gpu/proof.sh, benchmarks/gpu/x4.sh and tests/gpu/run.sh:
#   source benchmarks/gpu/env.sh || exit 2
# - NVLink multicast off in NCCL, PyTorch and NVSHMEM: on a shared host a program that uses it can
#   put every GPU out of service; vLLM 0.24's FlashInfer sampler off (it needs a JIT the host lacks).
# - The vLLM 0.24 + Ray bundle (../shared/gpu/build-bundle.sh, split by benchmarks/gpu/prepare.sh
#   into bundle0/ .. bundleN/, one part each) unpacked to /tmp/site once: a call carries one bundle
#   folder and copies its part to /tmp/b/ (`mkdir -p /tmp/b && cp bundleK/part.* /tmp/b/`); parts
#   carried in this working tree are copied there too. All parts must be there before the first unpack.
# - grpcio >= 1.85.1 (the generated gRPC code checks it; the hosts have 1.84) from the carried .whl/.
# - PYTHONPATH: that grpcio, the bundle, the repository (pdserve runs from the working tree).
# It returns 2, saying what is missing, when the bundle or the wheel is not there.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
pdserve_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
for carried in "$pdserve_root"/bundle*/part.*; do
  if [[ -f $carried ]]; then mkdir -p /tmp/b && cp -n "$carried" /tmp/b/; fi
done
if [[ ! -d /tmp/site ]]; then
  if ! ls /tmp/b/part.* >/dev/null 2>&1; then
    echo "env.sh: no vLLM bundle: /tmp/site is missing and /tmp/b holds no part.*" \
      "(benchmarks/gpu/prepare.sh)" >&2
    return 2
  fi
  if ! (set -o pipefail; cat /tmp/b/part.* | xz -d -T0 | tar -x -C /tmp); then
    echo "env.sh: the bundle in /tmp/b does not unpack ($(ls /tmp/b | wc -l) parts there): copy every" \
      "bundleK/part.* to /tmp/b first" >&2
    rm -rf /tmp/site
    return 2
  fi
fi
if [[ ! -d /tmp/site2 ]]; then
  if ! ls "$pdserve_root"/.whl/grpcio-*.whl >/dev/null 2>&1; then
    echo "env.sh: no .whl/grpcio-*.whl in the working tree: carry .whl (benchmarks/gpu/prepare.sh)" >&2
    return 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 \
    "$pdserve_root"/.whl/grpcio-*.whl || { rm -rf /tmp/site2; return 2; }
fi
export PYTHONPATH=/tmp/site2:/tmp/site:$pdserve_root
