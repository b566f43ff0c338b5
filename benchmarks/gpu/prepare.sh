#!/usr/bin/env bash
# Prepare, on this (CPU) machine, everything the GPU runs carry to a GPU host that has no internet:
#   benchmarks/gpu/prepare.sh [BUNDLE_DIR]
# - gpumodel8b/: the Llama-3.1-8B-shaped model directory (make_model8b.py; no weights);
# - .whl/: grpcio for CPython 3.12 (the generated gRPC code needs >= 1.85.1; hosts have 1.84);
# - bundle0/ .. bundleN/: the vLLM 0.24 + Ray bundle from ../shared/gpu/build-bundle.sh (about
#   10 minutes; BUNDLE_DIR reuses parts built before), cut again into 40 MB parts: a call carries
#   the working tree (~8 MB) with one part, and a 55 MB part put the two over the device's 64 MiB.
# All are git-ignored. Each device call carries one bundle folder and copies its part to /tmp/b/
# (`mkdir -p /tmp/b && cp bundleK/part.* /tmp/b/`), back to back (a machine goes back 30 s after a
# call); benchmarks/gpu/env.sh (sourced by proof.sh, x4.sh and tests/gpu/run.sh) unpacks /tmp/b
# on first use. The GPU tests, for example (2 x H200, 2026-11-29): calls carrying bundle0 ..
# bundle4, then one carrying bundle5, .whl and gpumodel8b that runs `tests/gpu/run.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=${1:-}
[[ -f gpumodel8b/config.json ]] || .venv/bin/python benchmarks/gpu/make_model8b.py gpumodel8b
ls .whl/grpcio-*cp312*.whl >/dev/null 2>&1 || .venv/bin/python -m pip download -q --no-deps \
  --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "grpcio==1.85.*"
if [[ -z $bundle ]]; then
  bundle=$(mktemp -d)
  ../shared/gpu/build-bundle.sh "$bundle"
fi
rm -rf bundle[0-9]*/
cat "$bundle"/part.* | split -b 40M -d - part.
i=0
for part in part.*; do
  mkdir -p "bundle$i" && mv "$part" "bundle$i/"
  i=$((i + 1))
done
echo "gpumodel8b/, .whl/ and bundle0..bundle$((i - 1))/ ready"
