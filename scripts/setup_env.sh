#!/usr/bin/env bash
# Creates or reuses the project's virtual env (.venv) and prints its python. Sourced by run_train.sh and run_tests.sh.
# Usage: PYTHON=$(scripts/setup_env.sh [test])
# An already-installed compatible torch (e.g. a CUDA build on a GPU machine) is kept: the env sees system packages,
# and torch is installed only when none can be imported, pinned to 2.13.0 (a CPU wheel where one is provided locally).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extra="${1:-}"
venv="${TITAN_LITE_VENV:-$root/.venv}"
check_runtime='import torch, torchdata, tomli, tensorboard, sentencepiece, tiktoken, safetensors, titan_lite'
check_test='import pytest, transformers, tokenizers'

ready() {
  local py="$1" marker="$venv/.titan_lite_ready${extra:+_$extra}"
  [ -x "$py" ] || return 1
  # Fast path: the imports below cost seconds; skip them while the env is newer than pyproject.toml.
  [ "$marker" -nt "$root/pyproject.toml" ] && return 0
  (cd /tmp && "$py" -c "$check_runtime" >/dev/null 2>&1) || return 1
  if [ "$extra" = "test" ]; then (cd /tmp && "$py" -c "$check_test" >/dev/null 2>&1) || return 1; fi
  touch "$marker"
  return 0
}

if ready "$venv/bin/python"; then echo "$venv/bin/python"; exit 0; fi
{
  echo "[setup] preparing $venv (first run only)"
  [ -x "$venv/bin/python" ] || "${PYTHON_BIN:-python3}" -m venv --system-site-packages "$venv"
  pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
  if ! (cd /tmp && "$venv/bin/python" -c 'import torch' >/dev/null 2>&1); then
    "${pip[@]}" "torch==2.13.0"
  fi
  if [ "$extra" = "test" ]; then "${pip[@]}" -e "$root[test]"; else "${pip[@]}" -e "$root"; fi
} 1>&2
ready "$venv/bin/python" || { echo "[setup] the environment in $venv is still missing packages" >&2; exit 1; }
echo "$venv/bin/python"
