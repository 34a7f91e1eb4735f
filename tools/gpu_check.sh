#!/usr/bin/env bash
# The GPU checks, never a CI dependency: tests/backends/test_gpu.py (sdpa / flex / tiled on CUDA tensors against the
# float64 golden, attnkit.create_block_mask against torch's on the GPU and under torch's compiled flex_attention, the
# FlexAttention drop-in with a captured CUDA bias, CUDA masks with dead and finfo.min rows on strided views, the nn
# module with its KV cache, a transformers Llama) on a machine with an NVIDIA GPU and a CUDA build of torch.
#
#   bash tools/gpu_check.sh            # from the repository root; PY=python3 by default, OUT=/tmp/attnkit-gpu-check
#
# attnkit is read from src/ (no install, no compiled CPU kernel: ATTNKIT_NATIVE=0; the GPU paths never use it).
# The log and a JUnit file land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/attnkit-gpu-check}
mkdir -p "$OUT"
{ nvidia-smi -L
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0)); print('transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/gpu.log"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 ATTNKIT_NATIVE=${ATTNKIT_NATIVE:-0}
# one worker per 2 CPU cores: most of the time goes to compiling torch's FlexAttention kernels (Triton), on the CPU
N=$(( $(nproc) / 2 > 1 ? $(nproc) / 2 : 1 ))
timeout "${GPU_CHECK_TIMEOUT:-420}" "$PY" -m pytest -q -p no:cacheprovider -n "$N" -rfEs \
  --junitxml "$OUT/gpu.xml" tests/backends/test_gpu.py 2>&1 | tee -a "$OUT/gpu.log"
