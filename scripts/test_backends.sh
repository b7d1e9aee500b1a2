#!/usr/bin/env bash
# The patched backends' own upstream CPU tests (verl's *_on_cpu.py) against the pristine baseline.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m dsv3_rl.backend_tests verl "$@"
