#!/usr/bin/env bash
# Prepare, on this (CPU) machine, everything the GPU runs carry to a GPU host that has no internet:
#   benchmarks/gpu/prepare.sh [BUNDLE_DIR]
# - gpumodel8b/: the Llama-3.1-8B-shaped model directory (make_model8b.py; no weights);
# - .whl/: grpcio for CPython 3.12 (the generated gRPC code needs >= 1.85.1; hosts have 1.84);
# - bundle0/ .. bundleN/: one part each of the vLLM 0.24 + Ray bundle from
#   ../shared/gpu/build-bundle.sh (about 10 minutes; BUNDLE_DIR reuses parts built before).
# All are git-ignored. Each device call carries one bundle folder and copies its part to /tmp/b/
# (`mkdir -p /tmp/b && cp bundleK/part.* /tmp/b/`); benchmarks/gpu/env.sh (sourced by proof.sh,
# x4.sh and tests/gpu/run.sh) unpacks /tmp/b on first use.
# The working tree travels with every call, and with benchmarks/results/ (~110 MB) it is over
# the device's 64 MiB: make the calls from a branch without it, and come back afterwards
# (session 17):
#   git checkout -b gpu-slim && git rm -r -q benchmarks/results && git commit -qm slim
#   ... the device calls ...
#   git checkout main && git branch -D gpu-slim
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
i=0
for part in "$bundle"/part.*; do
  mkdir -p "bundle$i" && cp "$part" "bundle$i/"
  i=$((i + 1))
done
echo "gpumodel8b/, .whl/ and bundle0..bundle$((i - 1))/ ready"
