"""What one crossing into the compiled kernel costs from Python: its extension module's vectorcalls against the
ctypes entries they replaced, on the zero-row check (one element per row of a decode step's output; under a mask,
up to 16 query rows, every element: a NaN a value at a hidden key may have written) and a replayed decode step (one
query over 128 keys, GQA 8/2, D = 64: the kernel's own work a few µs). The check of a whole 64-row output is timed
too: why a prefill's is not read whole.

    OMP_NUM_THREADS=2 python benchmarks/call_costs.py [--number 20000] [--repeat 7]

Each row: the fastest of ``--repeat`` timings of ``--number`` calls (timeit), µs a call, the two ways interleaved
(one timing of each in turn). The last row's two columns: a decode step's one interval passed as two ints (written
into the step's own rows) / as the (1, L) int32 tensors a call built before (both through the vectorcall).
"""

from __future__ import annotations

import argparse
import timeit

import torch
from _interleave import cpu_name

from attnkit.backends import _native
from attnkit.backends.native import _one_row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args(argv)
    if not _native.available():
        print(f"the compiled kernel is not built here: {_native.unavailable_reason()}")
        return 1
    ext = _native._ext
    if ext is None:
        print("this build of the kernel has no vectorcalls (older sources): nothing to compare")
        return 1
    g = torch.Generator().manual_seed(0)
    out = torch.randn(1, 8, 1, 64, generator=g) + 10
    q = torch.randn(1, 8, 1, 64, generator=g)
    k, v = torch.randn(1, 2, 128, 64, generator=g), torch.randn(1, 2, 128, 64, generator=g)
    lo, hi = torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), 128, dtype=torch.int32)
    fast_zero = _native.suspect_rows_fn()
    fast_step = _native.decode_step(q, k, v, lo, hi)
    _native._ext, _native._suspect_rows = None, None  # the ctypes entries, as a build without the vectorcalls
    try:
        slow_zero = _native.suspect_rows_fn()
        slow_step = _native.decode_step(q, k, v, lo, hi)
    finally:
        _native._ext, _native._suspect_rows = ext, fast_zero
    out16, out64 = torch.randn(1, 8, 16, 64, generator=g) + 10, torch.randn(1, 8, 64, 64, generator=g) + 10
    pairs = {
        "zero-row check of a (1, 8, 1, 64) output": (lambda: fast_zero(out), lambda: slow_zero(out)),
        "the same, every element (a decode step under a mask)": (lambda: fast_zero(out, True),
                                                                 lambda: slow_zero(out, True)),
        "every element of a (1, 8, 16, 64) output": (lambda: fast_zero(out16, True), lambda: slow_zero(out16, True)),
        "every element of a (1, 8, 64, 64) output (not done: a prefill)": (lambda: fast_zero(out64, True),
                                                                           lambda: slow_zero(out64, True)),
        "replayed decode step, 128 keys (kernel included)": (lambda: fast_step(q, k, v, 0.125),
                                                             lambda: slow_step(q, k, v, 0.125)),
        "a decode step's interval as two ints / as (1, L) tensors built for the call": (
            lambda: fast_step(q, k, v, 0.125, 0, 128), lambda: fast_step(q, k, v, 0.125, *_one_row((0, 128), 1))),
    }
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| call | vectorcall µs | ctypes µs | saved µs |\n|---|---|---|---|")
    for name, (fast, slow) in pairs.items():
        best = [float("inf"), float("inf")]
        for _ in range(a.repeat):
            for i, f in enumerate((fast, slow)):
                best[i] = min(best[i], timeit.timeit(f, number=a.number) / a.number * 1e6)
        print(f"| {name} | {best[0]:.2f} | {best[1]:.2f} | {best[1] - best[0]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
