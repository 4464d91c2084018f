#!/usr/bin/env bash
# Finds or prepares a Python with titan_lite's dependencies and prints its path. Used by run_train.sh and run_tests.sh.
# Usage: PYTHON=$(scripts/setup_env.sh [test])
# Order: the project's .venv if it is ready; else the current python3 if it already has everything (e.g. your own
# CUDA torch env); else create .venv (seeing system packages, so an installed torch is kept) and install into it.
# torch is installed only when none can be imported, pinned to 2.13.0 (a local CPU wheel on CPU machines here).
# A python3 that is itself a virtual environment (a GPU image's /opt/torch/.venv/bin/python3) lends .venv that
# environment's packages too (venv's --system-site-packages would show only its base interpreter's), so its torch
# is kept. Air-gapped machines: TITAN_LITE_WHEELS=DIR installs from a folder scripts/wheelhouse.sh filled (no index
# is contacted); the machine's own torch (>= 2.9, e.g. a CUDA build of 2.11) is kept.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extra="${1:-}"
venv="${TITAN_LITE_VENV:-$root/.venv}"
system_python="${PYTHON_BIN:-python3}"
# The wheelhouse as an absolute path: the checks below run from /tmp, and pip's --find-links should name one folder.
if [ -n "${TITAN_LITE_WHEELS:-}" ] && [ -d "$TITAN_LITE_WHEELS" ]; then
  TITAN_LITE_WHEELS="$(cd "$TITAN_LITE_WHEELS" && pwd)"
fi
check_runtime='import torch, torchdata, tomli, tensorboard, sentencepiece, tiktoken, safetensors, torchao, jinja2'
check_test='import pytest, xdist, transformers, tokenizers, peft, lm_eval, wandb, trl'
# The oldest torch titan_lite runs on (titan_lite/__init__.py refuses older ones the same way).
check_torch='import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if v >= (2, 9) else f"error: titan_lite needs torch >= 2.9, found {torch.__version__}")'

has_deps() {
  local py="$1"
  command -v "$py" >/dev/null 2>&1 || return 1
  (cd /tmp && "$py" -c "$check_runtime" >/dev/null 2>&1) || return 1
  [ "$extra" = "test" ] || return 0
  (cd /tmp && "$py" -c "$check_test" >/dev/null 2>&1) || return 1
  (cd /tmp && "$py" -m ruff --version >/dev/null 2>&1) || return 1  # ruff is a binary, not an importable module
}

# The site folders of $system_python's virtual environment, as .pth lines for .venv (nothing for a plain python).
parent_env_pth() {
  (cd /tmp && "$system_python" -I -c 'import site, sys
if sys.prefix != sys.base_prefix:
    print("# the packages of the environment " + sys.prefix + " (scripts/setup_env.sh), after .venv own")
    print("\n".join(f"import site; site.addsitedir({d!r})" for d in site.getsitepackages()))')
}

# The wheelhouse's manifest (scripts/wheelhouse.sh) matches this Python and holds the extra asked for.
check_wheelhouse() {
  [ -d "$TITAN_LITE_WHEELS" ] || { echo "error: TITAN_LITE_WHEELS=$TITAN_LITE_WHEELS is not a folder (fill one with scripts/wheelhouse.sh DIR)"; exit 2; }
  local manifest="$TITAN_LITE_WHEELS/titan_lite_wheelhouse.json"
  [ -f "$manifest" ] || return 0  # filled another way: pip names what is missing
  (cd /tmp && "$venv/bin/python" - "$manifest" "$extra" "$TITAN_LITE_WHEELS" <<'EOF'
import json, sys
manifest, extra, folder = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
here = "%d.%d" % sys.version_info[:2]
rebuild = f"rebuild it with scripts/wheelhouse.sh {folder} --python {here}" + (f" --extras {extra}" if extra else "")
if manifest["python"] != here:
    sys.exit(f"error: the wheelhouse {folder} holds wheels for Python {manifest['python']}, but {sys.executable} is {here}; {rebuild}")
if extra and extra not in manifest["extras"]:
    sys.exit(f"error: the wheelhouse {folder} was built without the '{extra}' extra (extras: {', '.join(manifest['extras']) or 'none'}); {rebuild}")
EOF
  ) || exit 2
}

venv_ready() {
  local marker="$venv/.titan_lite_ready${extra:+_$extra}"
  [ -x "$venv/bin/python" ] || return 1
  # Fast path: the import check costs seconds; skip it while the env is newer than pyproject.toml.
  [ "$marker" -nt "$root/pyproject.toml" ] && return 0
  has_deps "$venv/bin/python" && (cd /tmp && "$venv/bin/python" -c 'import titan_lite' >/dev/null 2>&1) || return 1
  touch "$marker"
}

if venv_ready; then echo "$venv/bin/python"; exit 0; fi
if [ ! -d "$venv" ] && has_deps "$system_python"; then command -v "$system_python"; exit 0; fi
{
  echo "[setup] preparing $venv (first run only)"
  if [ ! -x "$venv/bin/python" ]; then
    "$system_python" -m venv --system-site-packages "$venv"
    pth="$(parent_env_pth)"
    [ -z "$pth" ] || echo "$pth" > "$(cd /tmp && "$venv/bin/python" -I -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_titan_lite_base_env.pth"
  fi
  pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
  torch_wheel="torch==2.13.0"
  if [ -n "${TITAN_LITE_WHEELS:-}" ]; then
    check_wheelhouse
    pip+=(--no-index --find-links "$TITAN_LITE_WHEELS")
    torch_wheel="torch"  # the one the wheelhouse holds
  fi
  if ! (cd /tmp && "$venv/bin/python" -c 'import torch' >/dev/null 2>&1); then
    if [ -n "${TITAN_LITE_WHEELS:-}" ] && ! compgen -G "$TITAN_LITE_WHEELS/torch-*.whl" >/dev/null; then
      echo "error: no torch importable by $venv/bin/python and none in TITAN_LITE_WHEELS=$TITAN_LITE_WHEELS; install this machine's torch (>= 2.9) first, or build the wheelhouse with --with_torch"
      exit 2
    fi
    "${pip[@]}" "$torch_wheel"
  fi
  (cd /tmp && "$venv/bin/python" -c "$check_torch") || exit 2
  if [ "$extra" = "test" ]; then "${pip[@]}" -e "$root[test]"; else "${pip[@]}" -e "$root"; fi
} 1>&2
venv_ready || { echo "[setup] the environment in $venv is still missing packages" >&2; exit 1; }
echo "$venv/bin/python"
