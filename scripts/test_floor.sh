#!/usr/bin/env bash
# The default test suite on the oldest torch that pyproject.toml accepts (its `torch>=` floor),
# with the torchao and transformers that pip resolves beside it: a fresh virtual environment in a
# temporary folder, `pip install torch==<floor>` then `pip install -e ".[dev]"`, then pytest. The
# folder is deleted at the end (KEEP_VENV=1 keeps it and prints where).
#
#   scripts/test_floor.sh                       # the floor read from pyproject.toml, `pytest -q`
#   scripts/test_floor.sh 2.14.1                # another torch version
#   scripts/test_floor.sh 2.12.1 tests/unit/test_optimizers.py -x    # pytest arguments after it
#
# PYTHON picks the interpreter (default python3). torch builds other than the CPU one pull CUDA
# libraries (several GB); the suite runs on the CPU either way. The last line is pytest's summary;
# the exit code is pytest's. Results: docs/versions.md.
set -euo pipefail
cd "$(dirname "$0")/.."

floor=$(sed -n 's/^ *"torch>=\([0-9][0-9.]*\)".*/\1/p' pyproject.toml)
version=${1:-$floor}
[ $# -gt 0 ] && shift
if [ -z "$version" ]; then
  echo "test_floor.sh: no torch>= floor found in pyproject.toml; give a version" >&2
  exit 2
fi

root=$(mktemp -d "${TMPDIR:-/tmp}/minippo-floor.XXXXXX")
if [ "${KEEP_VENV:-0}" = 1 ]; then
  echo "test_floor.sh: keeping $root/venv"
else
  trap 'rm -rf "$root"' EXIT
fi
venv=$root/venv
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/pip" install --quiet "torch==$version"
"$venv/bin/pip" install --quiet -e ".[dev]"
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
import platform
names = ("torch", "torchao", "transformers")
print("test_floor.sh: python", platform.python_version(), *(f"{n} {md.version(n)}" for n in names))
PY
"$venv/bin/pytest" -q -p no:cacheprovider "$@"
