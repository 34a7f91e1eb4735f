#!/usr/bin/env bash
# Install torch into a virtualenv without ever pulling the CUDA stack onto a machine without a GPU.
#
#   tools/install-torch.sh VENV_PYTHON          (the Makefile runs it; settings come from the environment)
#
#   TORCH          auto (default) | installed | local | cpu | cuda
#                    auto:  keep a torch==TORCH_VERSION that VENV_PYTHON already imports; else a wheel in
#                           WHEEL_DIR; else the CPU-only index when no NVIDIA GPU is found (nvidia-smi);
#                           else PyPI's default build (with CUDA on Linux)
#                    installed: only check that torch is importable (fail otherwise, nothing installed)
#                    local: WHEEL_DIR only (no index)     cpu: TORCH_INDEX     cuda: PyPI's default build
#   TORCH_VERSION  2.13.0            TORCH_INDEX  https://download.pytorch.org/whl/cpu
#   WHEEL_DIR      /opt/wheels       CONSTRAINTS  constraints.txt
#   TORCH_DRY_RUN  1: print the pip command that would run, run nothing (tests/install/test_install_torch.py)
#
# An index that does not answer within 5 s is reported at once, never waited on.
set -euo pipefail

PY=${1:?usage: tools/install-torch.sh VENV_PYTHON}
MODE=${TORCH:-auto}
VERSION=${TORCH_VERSION:-2.13.0}
INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
WHEELS=${WHEEL_DIR:-/opt/wheels}
CONS=${CONSTRAINTS:-constraints.txt}
# --no-compile: bytecode is written on first import, for the modules that run (torch ships ~60 MB of it otherwise)
PIP=("$PY" -m pip install --disable-pip-version-check --progress-bar on --no-compile -c "$CONS")

say() { echo "==> torch: $*"; }

pip_install() {
  if [ "${TORCH_DRY_RUN:-}" = 1 ]; then
    echo "would run: ${PIP[*]} $*"
    exit 0
  fi
  "${PIP[@]}" "$@"
}

have_torch() {
  "$PY" - "$VERSION" <<'PYEOF' 2>/dev/null
import sys
import torch
want = sys.argv[1]
have = torch.__version__.split("+")[0]
print(f"{torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU only'})")
sys.exit(0 if have == want else 1)
PYEOF
}

local_wheel() {
  compgen -G "$WHEELS/torch-$VERSION*.whl" >/dev/null 2>&1
}

has_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

reachable() {  # reachable URL: answers within 5 s
  "$PY" - "$1" <<'PYEOF' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=5).close()
PYEOF
}

case "$MODE" in
  auto|installed|local|cpu|cuda) ;;
  *) echo "TORCH=$MODE: expected auto, installed, local, cpu or cuda" >&2; exit 2 ;;
esac

if [ "$MODE" = auto ] || [ "$MODE" = installed ]; then
  if have=$(have_torch); then
    say "torch $have is already installed; keeping it"
    exit 0
  fi
  if [ "$MODE" = installed ]; then
    echo "TORCH=installed: $PY cannot import torch==$VERSION (found: ${have:-none})" >&2
    exit 1
  fi
  if local_wheel; then MODE=local
  elif has_gpu; then MODE=cuda
  else MODE=cpu
  fi
fi

case "$MODE" in
  local)
    local_wheel || { echo "TORCH=local: no torch-$VERSION*.whl in WHEEL_DIR=$WHEELS" >&2; exit 1; }
    say "installing torch $VERSION from the local wheel folder $WHEELS"
    pip_install --find-links "$WHEELS" "torch==$VERSION"
    ;;
  cpu)
    say "no NVIDIA GPU found (or TORCH=cpu): installing the CPU-only torch $VERSION from $INDEX"
    if [ "${TORCH_DRY_RUN:-}" != 1 ] && ! reachable "$INDEX/torch/"; then
      echo "torch: $INDEX does not answer (offline?). Put a torch-$VERSION wheel in WHEEL_DIR (now $WHEELS)," \
           "install torch into the venv yourself and rerun (it is kept), or set TORCH_INDEX." >&2
      exit 1
    fi
    pip_install --index-url "$INDEX" "torch==$VERSION"
    ;;
  cuda)
    say "installing torch $VERSION from PyPI (the default build: with CUDA on Linux; a few GB)"
    pip_install "torch==$VERSION"
    ;;
esac
have=$(have_torch) || { echo "torch: installed, but $PY cannot import torch==$VERSION" >&2; exit 1; }
say "torch $have installed"
