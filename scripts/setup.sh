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
# pip installs with --no-compile: the installed modules are compiled at the end on every core at
# once (pip compiles them file by file: set-up 249 -> 196 s on a 2-core machine).
pip=(.venv/bin/python -m pip -q --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing ${POSTTRAIN_TORCH:-torch==2.13.0}"
  "${pip[@]}" install --no-compile "${POSTTRAIN_TORCH:-torch==2.13.0}" numpy 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__)")
echo "torch==${torch_version}" > .venv/torch-constraint.txt

echo "[setup] installing posttrain${extras} (torch kept at ${torch_version})"
"${pip[@]}" install --no-compile -c .venv/torch-constraint.txt -e ".${extras}" 2>&1 | { grep -v "^WARNING: Location" || true; }
# Compiled once here, posttrain's own modules too (pip never compiles an editable source tree):
# where PYTHONDONTWRITEBYTECODE is set, as on this project's CI machines, Python writes no .pyc,
# and every process (each Ray worker, each test) compiled what it imported again (~0.8 s for
# posttrain alone). Left out, as no posttrain process imports them: packages' test suites, the
# ~550 model families of transformers but those of posttrain's tests and examples, and packages
# only the dev extras' integrations load (W&B, MLflow and their dependencies): 69 -> 37 s on a
# 2-core machine. A file that does not compile (a package's template) is no error here.
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
skip='/tests?/|/transformers/models/(?!(auto|llama|gpt2|mistral|qwen2|qwen3|mamba)/)'
skip+='|/site-packages/(sklearn|mlflow|wandb|sqlalchemy|pip|graphql|graphene|alembic|flask)/'
.venv/bin/python -m compileall -q -j 0 -x "$skip" "$site" posttrain > /dev/null 2>&1 || true
.venv/bin/python -c "import posttrain, torch; print(f'[setup] posttrain {posttrain.__version__} ready, torch {torch.__version__}')"
