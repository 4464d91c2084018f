#!/usr/bin/env bash
# Collects, on a machine with a package index, every wheel scripts/setup_env.sh installs (runtime, the extras you
# name, and all their dependencies) for another machine's Python and platform; carry DIR over and install there with
# no index:  TITAN_LITE_WHEELS=DIR scripts/setup_env.sh [test]
# Usage: scripts/wheelhouse.sh DIR [--python 3.12] [--platform manylinux_2_28_x86_64] [--extras test,eval]
#                                  [--torch_version 2.11.0 | --with_torch]
# torch is not collected unless --with_torch: the target keeps its own (CUDA) build. --help says more.
# Runs scripts/wheelhouse.py with PYTHON_BIN (default: python3), which needs pip and an index; not torch.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON_BIN:-python3}"
command -v "$py" >/dev/null || { echo "error: no $py here to run pip with (set PYTHON_BIN)" >&2; exit 2; }
exec "$py" "$root/scripts/wheelhouse.py" "$@"
