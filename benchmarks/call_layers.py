"""Where a replayed call's time goes, layer by layer, on the small shapes a model runs every step: the work around
the compiled kernel (attnkit's own Python and C, torch's reads and allocation) against the kernel itself.

    OMP_NUM_THREADS=2 python benchmarks/call_layers.py [--number 2000] [--repeat 15]

Each row times, in turns (one timing of each per repeat; the fastest of ``--repeat`` timings of ``--number`` calls,
µs a call), without gradients:

- ``SDPA``: torch's ``scaled_dot_product_attention`` called directly on the same inputs;
- ``attnkit``: ``attnkit.attention(...)`` as a user calls it (replayed: ``attnkit._fast``);
- ``stepper``: the prepared call alone, as the replay runs it (``_native.Stepper``, csrc/attn_dispatch.cpp: the
  checks, strides, pointers, outputs and record in C), and ``py stepper``: the same call through its Python
  fallback (the previous hot path);
- ``kernel``: the kernel's entry on a record filled once, its outputs reused (one vectorcall, ``_native._ext.step``):
  what no work around it can go below.

``around``: attnkit − kernel, all the work a call adds to the kernel. ``torch floor``: what reading a call's three
tensors (each tensor's shape, dtype, strides and data pointer: the least a call must read, through torch's Python
bindings) and allocating its output (``torch.empty``) costs here, timed alone — the part of ``around`` that no code of
attnkit's can remove without linking against libtorch (the package's compiled kernel is built without torch's headers:
an install never needs torch's build tree, and a torch upgrade never breaks it).
"""

from __future__ import annotations

import argparse
import timeit

import torch
import torch.nn.functional as F
from _interleave import cpu_name

import attnkit
from attnkit import _fast
from attnkit.backends import _native

CASES = [  # (name, B, H, Hkv, L, S, D, attnkit kwargs, SDPA kwargs)
    ("decode L=1 S=128 GQA 8/2 causal", 1, 8, 2, 1, 128, 64, dict(causal=True), dict(enable_gqa=True)),
    ("prefill L=S=64 causal", 2, 4, 4, 64, 64, 16, dict(causal=True), dict(is_causal=True)),
    ("prefill L=S=200 GQA 4/2 causal", 1, 4, 2, 200, 200, 64, dict(causal=True), dict(is_causal=True,
                                                                                   enable_gqa=True)),
]


def _stepper_of(run):
    """The prepared call (a Stepper) a replay's closure holds."""
    for cell in run.__closure__ or ():
        if type(cell.cell_contents).__name__ == "Stepper":
            return cell.cell_contents
    raise SystemExit("this replay holds no C stepper (a build of the kernel without it: rebuild)")


def _kernel_alone(prepare, q, k, v, scale, oshape):
    """The kernel's entry on a record filled once, its outputs this function's own and reused: ``() -> rc``. The
    record is a Python stepper's (prepared by ``prepare()`` with the extension's ``step`` watched, so its one call's
    arguments are seen), its output pointers replaced by buffers kept here."""
    ext = _native._ext
    seen: dict = {}
    real = ext.step

    def spy(*args):
        seen["args"] = args
        return real(*args)

    ext.step = spy  # (the Python stepper reads the extension's step when it is prepared)
    try:
        step = prepare()
    finally:
        ext.step = real
    step.fallback(q, k, v, scale)
    out, lse = torch.empty(oshape), torch.empty(oshape[:3])
    args = (*seen["args"][:-2], out.data_ptr(), lse.data_ptr())  # (out, lse: the step block's last two slots)
    keep = (step, out, lse)  # the record (the stepper's thread record) and the outputs live as long as the timing

    def kernel():
        return real(*args) + 0 * len(keep)

    return kernel


def _torch_floor(q, k, v, oshape, dtype):
    """One call's least reading of its tensors through torch's bindings and its output's allocation."""
    def f():
        for t in (q, k, v):
            t.shape, t.dtype, t.stride(), t.data_ptr()
        torch.empty(*oshape, dtype=dtype)
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=15)
    a = ap.parse_args(argv)
    if not _native.available() or _native._ext is None or not hasattr(_native._ext, "stepper"):
        print("the compiled kernel with its C stepper is not built here: nothing to time")
        return 1
    torch.manual_seed(0)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| case | SDPA µs | attnkit µs | stepper µs | py stepper µs | kernel µs | around µs | torch floor µs | "
          "attnkit / SDPA |")
    print("|---|---|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for name, B, H, Hkv, L, S, D, kw, skw in CASES:
            q, k, v = torch.randn(B, H, L, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
            attnkit.attention(q, k, v, **kw)
            run = _fast._REPLAY.get(_fast._signature(q, k, v, kw.get("mask"), kw.get("causal", False), None))
            if run is None:
                print(f"| {name} | not replayed on this machine (auto chose a path without a prepared call) |")
                continue
            scale = D ** -0.5

            def prepare():
                _fast.clear()
                attnkit.attention(q, k, v, **kw)  # learned: the replay prepared anew (its Python stepper watched)
                return _stepper_of(_fast._REPLAY[_fast._signature(q, k, v, kw.get("mask"), kw.get("causal", False),
                                                                  None)])

            kernel = _kernel_alone(prepare, q, k, v, scale, (B, H, L, D))
            step = prepare()
            fns = {
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, **skw),
                "attnkit": lambda: attnkit.attention(q, k, v, **kw),
                "stepper": lambda: step(q, k, v, scale),
                "py": lambda: step.fallback(q, k, v, scale),
                "kernel": kernel,
                "floor": _torch_floor(q, k, v, (B, H, L, D), q.dtype),
            }
            best = {n: float("inf") for n in fns}
            for _ in range(a.repeat):
                for n, f in fns.items():
                    best[n] = min(best[n], timeit.timeit(f, number=a.number) / a.number * 1e6)
            print(f"| {name} | {best['sdpa']:.2f} | {best['attnkit']:.2f} | {best['stepper']:.2f} | "
                  f"{best['py']:.2f} | {best['kernel']:.2f} | {best['attnkit'] - best['kernel']:.2f} | "
                  f"{best['floor']:.2f} | {best['sdpa'] / best['attnkit']:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
