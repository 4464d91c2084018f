#!/usr/bin/env bash
# The test suite: sets up .venv with the test extras on first use, runs `ruff check`, then pytest (extra args go to
# pytest). A ruff finding fails the command before any test runs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# titan_lite is importable from the checkout even when the python is not the project's .venv.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="$("$root/scripts/setup_env.sh" test)"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$PYTHON" -m ruff check titan_lite scripts tests benchmarks || { echo "ruff check failed: fix the findings above" >&2; exit 1; }
exec "$PYTHON" -m pytest -q tests "$@"
