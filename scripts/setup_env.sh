#!/usr/bin/env bash
# Create or reuse .venv and install the workbench with its notebook and test extras.
# A torch that the base Python already has (e.g. a CUDA build) is reused through
# --system-site-packages; without one, the CPU build torch==2.13.0 is installed, never a
# multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.installed"
if [ ! -x "$VENV/bin/python" ]; then
    if "$PY" -c "import torch" 2>/dev/null; then
        echo "setup: using the torch already installed for $PY ($("$PY" -c 'import torch; print(torch.__version__)'))"
        "$PY" -m venv --system-site-packages "$VENV"
    else
        "$PY" -m venv "$VENV"
    fi
fi
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && "$VENV/bin/python" -c "import torch, workbench" 2>/dev/null; then
    exit 0
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    # Take torch==2.13.0 from the default indexes only if they offer the CPU build (a local
    # wheel, or a mirror); otherwise from PyTorch's CPU index. PyPI's Linux wheel is CUDA.
    report=$(mktemp)
    "$VENV/bin/python" -m pip install --quiet --dry-run --no-deps --report "$report" "torch==2.13.0" || true
    if grep -Eq 'torch-2\.13\.0(\+|%2B)cpu' "$report"; then
        "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
    else
        "$VENV/bin/python" -m pip install --quiet "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
    fi
    rm -f "$report"
fi
"$VENV/bin/python" -m pip install --quiet -e ".[notebooks,test]"
touch "$stamp"
