#!/usr/bin/env bash
# Downloads, on a machine with a package index, the wheels titan_lite needs on an air-gapped machine that already
# has its own (CUDA) torch; carry DIR over and install there without network:
#   TITAN_LITE_WHEELS=DIR scripts/setup_env.sh [test]
# Usage: scripts/wheelhouse.sh DIR [--python 3.12] [--platform manylinux_2_28_x86_64] [--test] [--all]
#   --python    the target machine's Python (default 3.12)
#   --platform  its wheel platform (default manylinux_2_28_x86_64; aarch64: manylinux_2_28_aarch64)
#   --test      also the test runner (pytest, ruff) for scripts/run_tests.sh and `pytest -m cuda`
#   --all       also the runtime packages such a machine usually has already (tensorboard, sentencepiece,
#               tiktoken, safetensors, with their dependencies)
# torch is never downloaded (the target keeps its own build: titan_lite needs torch >= 2.9; torchao 0.18 loads its
# kernels only on torch >= 2.11). Packages that depend on torch are fetched without their dependencies, so pip
# cannot pull a second torch in; everything else comes with its dependencies.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }
[ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ] && { usage; exit 0; }
[ $# -ge 1 ] && [ "${1#-}" = "$1" ] || { echo "error: give the folder to fill: scripts/wheelhouse.sh DIR (see --help)" >&2; exit 2; }
dir="$1"; shift
python_version="3.12"; platform="manylinux_2_28_x86_64"; test=0; all=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python_version="${2:?--python needs a version such as 3.12}"; shift 2 ;;
    --platform) platform="${2:?--platform needs a wheel platform tag}"; shift 2 ;;
    --test) test=1; shift ;;
    --all) all=1; shift ;;
    *) echo "error: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$python_version" =~ ^3\.[0-9]+$ ]] || { echo "error: --python '$python_version' is not a version such as 3.12" >&2; exit 2; }
py="${PYTHON_BIN:-python3}"
command -v "$py" >/dev/null || { echo "error: no $py here to run pip with (set PYTHON_BIN)" >&2; exit 2; }
mkdir -p "$dir"
abi="cp${python_version/./}"
target=(--only-binary=:all: --python-version "$python_version" --implementation cp --abi "$abi" --abi abi3
        --abi none --platform "$platform" --platform "manylinux2014_${platform#manylinux_*_*_}" --platform any)
# Version bounds as pyproject.toml states them (one place to change them).
spec() { "$py" - "$root/pyproject.toml" "$1" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
match = re.search(r'"(' + re.escape(sys.argv[2]) + r'(?:\[[^\]]*\])?[<>=!~][^"]*)"', text)
print(match.group(1) if match else sys.argv[2])
EOF
}
download() {  # download [--no-deps] packages...
  echo "[wheelhouse] $*" >&2
  "$py" -m pip download --disable-pip-version-check -q -d "$dir" "${target[@]}" "$@"
}
# Depend on torch: without their dependencies (torchdata's own small ones follow below).
download --no-deps "$(spec torchdata)" "$(spec torchao)"
download "$(spec tomli)" "urllib3>=1.25" requests "setuptools>=64"
[ "$all" = 1 ] && download "$(spec tensorboard)" "$(spec sentencepiece)" "$(spec tiktoken)" "$(spec safetensors)"
[ "$test" = 1 ] && download "$(spec pytest)" "$(spec ruff)"
count=$(find "$dir" -maxdepth 1 -name '*.whl' | wc -l)
extra=""; [ "$test" = 1 ] && extra=" test"
echo "wheelhouse ready: $count wheels in $dir for Python $python_version on $platform; install there with:" \
     "TITAN_LITE_WHEELS=$dir scripts/setup_env.sh$extra"
