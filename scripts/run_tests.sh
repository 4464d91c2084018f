#!/usr/bin/env bash
# The test suite: sets up .venv with the test extras on first use, runs `ruff check`, then pytest (extra args go to
# pytest). A ruff finding fails the command before any test runs.
#   ./scripts/run_tests.sh            the whole suite (CI runs exactly this via .ci/run)
#   ./scripts/run_tests.sh --quick    the tests not marked slow: the unit tests, for iteration
#   ./scripts/run_tests.sh tests/test_x.py [-k name]   only the paths given (a file, folder or file::test)
# Tests run on one pytest worker per core (pytest-xdist; each worker starts with a contiguous share of the tests, so
# most of a file's tests share its fixtures, and an idle worker takes over part of a busy one's queue): most tests use
# one thread (OMP_NUM_THREADS=1). TITAN_LITE_TEST_WORKERS=N sets the number of workers; 0 or 1 runs them in this
# process.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# titan_lite is importable from the checkout even when the python is not the project's .venv.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="$("$root/scripts/setup_env.sh" test)"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
args=()
paths=()
for arg in "$@"; do
  if [ "$arg" = "--quick" ]; then args+=(-m "not slow")
  elif [[ "$arg" != -* && -e "${arg%%::*}" ]]; then paths+=("$arg")  # a test path: run it, not the whole suite
  else args+=("$arg"); fi
done
[ "${#paths[@]}" -gt 0 ] || paths=(tests)
# (getconf, not nproc: GNU nproc answers OMP_NUM_THREADS, set to 1 above)
workers="${TITAN_LITE_TEST_WORKERS:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)}"
if ! [[ "$workers" =~ ^[0-9]+$ ]]; then
  echo "error: TITAN_LITE_TEST_WORKERS=$workers is not a number of pytest workers (0 or 1: none)" >&2
  exit 2
fi
if [ "$workers" -gt 1 ]; then
  args=(-n "$workers" --dist worksteal "${args[@]+"${args[@]}"}")
fi
"$PYTHON" -m ruff check titan_lite scripts tests benchmarks || { echo "ruff check failed: fix the findings above" >&2; exit 1; }
exec "$PYTHON" -m pytest -q "${paths[@]}" "${args[@]+"${args[@]}"}"
