#!/usr/bin/env bash
# Create .venv and install posttrain into it, keeping the CPU build of torch.
#
#   bash scripts/setup.sh          # runtime dependencies
#   bash scripts/setup.sh --dev    # + test/benchmark dependencies (pytest, wandb, mlflow, trl)
#
# torch is installed first, pinned (POSTTRAIN_TORCH, default torch==2.13.0: the CPU wheel where
# pip's configured sources offer it, as on this project's machines; plain PyPI's Linux wheel is
# the CUDA build on any machine), and every later install is constrained to the torch that is
# installed, so no dependency can pull a multi-GB CUDA build over it. Elsewhere, or on a GPU
# machine, install the torch you want into .venv first (CPU: pip install torch==2.13.0
# --index-url https://download.pytorch.org/whl/cpu), or set POSTTRAIN_TORCH; it is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip -q --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing ${POSTTRAIN_TORCH:-torch==2.13.0}"
  "${pip[@]}" install "${POSTTRAIN_TORCH:-torch==2.13.0}" numpy 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__)")
echo "torch==${torch_version}" > .venv/torch-constraint.txt

echo "[setup] installing posttrain${extras} (torch kept at ${torch_version})"
"${pip[@]}" install -c .venv/torch-constraint.txt -e ".${extras}" 2>&1 | { grep -v "^WARNING: Location" || true; }
# posttrain's own modules compiled once: pip compiles what it installs but not an editable
# source tree, and where PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines) every
# process (each Ray worker, each test) would compile them again at import, ~0.8 s each.
.venv/bin/python -m compileall -q posttrain
.venv/bin/python -c "import posttrain, torch; print(f'[setup] posttrain {posttrain.__version__} ready, torch {torch.__version__}')"
