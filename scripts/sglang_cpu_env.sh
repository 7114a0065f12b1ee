#!/usr/bin/env bash
# Build a virtual environment in which the real SGLang engine runs on a CPU, with this checkout.
#
#   bash scripts/sglang_cpu_env.sh VENV_DIR
#   VENV_DIR/bin/minippo run async_ppo --config tiny_sglang_cpu
#   VENV_DIR/bin/python -m pytest -m sglang_cpu
#
# What it installs (docs/sglang_backend.md, "The real engine on a CPU"):
#   1. scripts/sglang_cpu_requirements.txt with --no-deps: the exact versions with which
#      sglang 0.5.23 imports and serves on a CPU (torch 2.14.1, SGLang's pin: the registry's build
#      is the CUDA one, ~6 GB with its nvidia-* wheels, and it runs on a machine without a GPU);
#   2. sglang==0.5.23 with --no-deps (its declared dependencies include GPU-only packages);
#   3. this checkout, editable, with the [dev] extra;
#   4. a package `sgl_kernel` that re-exports minippo.engine._sgl_kernel_cpu: SGLang's CPU path
#      imports that module name, and the sglang-kernel wheel on PyPI is a CUDA build.
# Nothing else is needed by hand: SGLangEngine(device="cpu") sets SGLang's CPU switches itself.
#
# Idempotent: a second run reinstalls nothing that is already at the pinned versions (the pinned
# set is skipped while its stamp matches). PYTHON picks the interpreter (default python3; 3.11+).
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: bash scripts/sglang_cpu_env.sh VENV_DIR" >&2
  exit 2
fi
venv=$1
root=$(cd "$(dirname "$0")/.." && pwd)
lock="$root/scripts/sglang_cpu_requirements.txt"
python=${PYTHON:-python3}
sglang_version=0.5.23

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "sglang_cpu_env.sh: sglang $sglang_version needs Python >= 3.11; $python is $("$python" -V 2>&1). Set PYTHON=python3.11 (or newer)" >&2
  exit 2
fi

step() { printf '[sglang_cpu_env] %s\n' "$*"; }
start=$(date +%s)

if [ ! -x "$venv/bin/python" ]; then
  step "creating $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

stamp="$venv/.minippo-sglang-cpu"
want="$(sha256sum "$lock" | cut -c1-16) sglang==$sglang_version"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  step "installing the pinned set (scripts/sglang_cpu_requirements.txt; torch 2.14.1 is ~6 GB)"
  "${pip[@]}" install --quiet --no-deps -r "$lock"
  step "installing sglang==$sglang_version (--no-deps)"
  "${pip[@]}" install --quiet --no-deps "sglang==$sglang_version"
  echo "$want" > "$stamp"
else
  step "the pinned set and sglang==$sglang_version are installed already"
fi

step "installing this checkout: pip install -e \"$root[dev]\""
"${pip[@]}" install --quiet -e "$root[dev]"

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/sgl_kernel"
cat > "$site/sgl_kernel/__init__.py" <<'EOF'
# Written by minippo's scripts/sglang_cpu_env.sh: SGLang's CPU path imports `sgl_kernel`; the
# pure-torch functions it needs come from minippo (see minippo/engine/_sgl_kernel_cpu.py).
from minippo.engine._sgl_kernel_cpu import *  # noqa: F403
from minippo.engine._sgl_kernel_cpu import __all__  # noqa: F401
EOF

step "checking that SGLang's engine imports on this CPU"
SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" - <<'EOF'
import sglang
from sglang.srt.entrypoints.engine import Engine  # noqa: F401  (imports the scheduler's modules)
import sgl_kernel
assert sgl_kernel.__name__ == "sgl_kernel" and hasattr(sgl_kernel, "assign_req_to_token_pool_cpu")
print(f"[sglang_cpu_env] sglang {sglang.__version__} imports (torch {__import__('torch').__version__})")
EOF
step "ready in $(( $(date +%s) - start )) s: $venv/bin/minippo run async_ppo --config tiny_sglang_cpu; $venv/bin/python -m pytest -m sglang_cpu"
