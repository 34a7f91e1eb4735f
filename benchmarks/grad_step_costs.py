"""What a small call with gradients costs in its parts: the compiled kernel's forward and backward as one-shot calls
(each builds its call record and checks its arguments: what ``_NativeAttention`` runs) against the same calls
prepared once per signature (``decode_step`` / ``forward_step`` with the bf16 copy of out beside the fp32 one, and
``backward_step``: what a replayed call runs, ``_NativeStep``), and torch's CPU flash kernel's forward and backward
ops called directly (no autograd), in fp32 and bf16.

    OMP_NUM_THREADS=2 python benchmarks/grad_step_costs.py [--number 2000] [--repeat 7]

Shapes: a decode step (one query over 128 keys, GQA 8/2, D = 64: torch's flash op gets the 4 query heads of a kv
head folded into rows, as auto calls it) and L = S = 64 without a mask (8 heads, D = 64). The kernel's calls see
every key (the decode: causal over the cache is every key). Each cell: the fastest of ``--repeat`` timings of
``--number`` calls (timeit), µs a call, the columns of a row interleaved (one timing of each in turn). dO is
``out.sum()``'s (an expanded tensor of ones, read in place by both).
"""

from __future__ import annotations

import argparse
import timeit

import torch
from _interleave import cpu_name

from attnkit.backends import _native

SHAPES = (  # name, B, H, Hkv, L, S, D
    ("decode: L = 1, S = 128, GQA 8/2, D = 64", 1, 8, 2, 1, 128, 64),
    ("L = S = 64, H = 8, D = 64, no mask", 1, 8, 8, 64, 64, 64),
)


def _cells(B, H, Hkv, L, S, D, dt):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, n, D, generator=g).to(dt) for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    lo = torch.zeros(1, L, dtype=torch.int32)
    hi = torch.full((1, L), S, dtype=torch.int32)
    scale = D ** -0.5
    half = dt is not torch.float32
    decode = L <= 16
    if decode:
        fwd = _native.decode_step(q, k, v, lo, hi, with_lse=True, beside=half)

        def one_fwd():
            o = _native.decode(q, k, v, lo, hi, scale, need_lse=True)[0]
            return o.to(dt) if half else o
    else:
        fwd = _native.forward_step(q, k, v, lo, hi, with_lse=True, beside=half)

        def one_fwd():
            return _native.forward(q, k, v, lo, hi, scale, rounded=True)
    bwd = _native.backward_step(q, k, v, lo, hi, rounded=True)
    out, lse = fwd(q, k, v, scale)[:2]
    dout = torch.ones((), dtype=dt).expand(B, H, L, v.shape[-1])
    # torch's flash ops: the decode's query heads folded into rows of their kv head (auto's call)
    tq = q.reshape(B, Hkv, H // Hkv * L, D) if decode else q
    ops = torch.ops.aten
    t_out, t_lse = ops._scaled_dot_product_flash_attention_for_cpu(tq, k, v, scale=scale)[:2]
    t_do = torch.ones_like(t_out)
    return {
        "kernel fwd, one-shot": one_fwd,
        "kernel fwd, prepared": lambda: fwd(q, k, v, scale),
        "kernel bwd, one-shot": lambda: _native.backward(q, k, v, lo, hi, scale, out, lse, dout, rounded=True),
        "kernel bwd, prepared": lambda: bwd(q, k, v, out, lse, dout, scale),
        "torch flash fwd": lambda: ops._scaled_dot_product_flash_attention_for_cpu(tq, k, v, scale=scale),
        "torch flash bwd": lambda: ops._scaled_dot_product_flash_attention_for_cpu_backward(
            t_do, tq, k, v, t_out, t_lse, 0.0, False, scale=scale),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args(argv)
    if not _native.available():
        print(f"the compiled kernel is not loaded: {_native.unavailable_reason()}")
        return 1
    print(f"{cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads; µs a call")
    names = None
    for shape in SHAPES:
        for dt in (torch.float32, torch.bfloat16):
            cells = _cells(*shape[1:], dt)
            if names is None:
                names = list(cells)
                print("| shape | dtype | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
            best = {n: float("inf") for n in cells}
            for _ in range(a.repeat):
                for n, f in cells.items():
                    f()
                    best[n] = min(best[n], timeit.timeit(f, number=a.number) / a.number * 1e6)
            print(f"| {shape[0]} | {str(dt)[6:]} | " + " | ".join(f"{best[n]:.1f}" for n in names) + " |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
