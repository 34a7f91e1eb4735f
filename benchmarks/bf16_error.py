"""bf16 accuracy of sdpa, tiled and auto against float64 on the same bf16-rounded inputs.

    python benchmarks/bf16_error.py [L]

Rounding the inputs once and using them for the float64 attention too isolates the
kernels' own error from the (shared) input rounding. Shape: B=1, H=8, L=S, D=64, dense.
"""

import sys

import torch

import attnkit


def main(L: int = 2048) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, L, 64).bfloat16() for _ in range(3))
    ref = attnkit.attention(q.double(), k.double(), v.double(), backend="eager")
    for backend in ("sdpa", "tiled", "auto"):
        err = (attnkit.attention(q, k, v, backend=backend).double() - ref).abs()
        print(f"{backend:6s} max error {err.max():.3e}   mean error {err.mean():.3e}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2048)
