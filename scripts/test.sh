#!/usr/bin/env bash
# The whole test suite (slow tests included), then ruff. Usage: bash scripts/test.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
.venv/bin/ruff check . || exit 1
exec .venv/bin/python -m pytest -q --durations=25 "$@"
