"""Reading a user's bool mask tensor into the compiled kernel's tile map, in C against torch's ops.

    OMP_NUM_THREADS=2 python benchmarks/mask_read.py [--lengths 64,2048,8192] [--rounds 5]

For each mask (a band of ±128 keys, 4 causal documents, a random mask with half its points set), at L = S = each
length: the median milliseconds of ``attnkit.backends._tilebits.dense_bits`` (kinds, the partial tiles' order and
bits) with the kernel's C pass (``ak_dense_tiles``) and with torch's reductions (the path of a build without it),
then of ``_tilebits._row_intervals`` (every row one stretch of keys? its ``(lo, hi)``) on that map, in C
(``ak_tile_rows``) and by torch's byte tables. Interleaved: the two ways are timed in turns, one call each per
round. The ratio is torch's time over C's (> 1: C faster). Both ways give the same map
(tests/backends/test_native_bool_mask.py). At L = 64 most of either is ``dense_bits``' Python and allocations; the
last column is what a replayed call does: the C pass alone into buffers it keeps (timeit, the fastest of
``--rounds``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch
from _interleave import cpu_name

from attnkit.backends import _native, _tilebits


def _masks(n: int) -> dict[str, torch.Tensor]:
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    g = torch.Generator().manual_seed(n)
    return {"band ±128": (i - j).abs() <= 128, "4 causal documents": (i // (n // 4) == j // (n // 4)) & (j <= i),
            "random 50 %": torch.rand(n, n, generator=g) < 0.5}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,2048,8192")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    dense_c, rows_c = _native.dense_tiles_fn, _native.tile_rows_fn
    if dense_c() is None or rows_c() is None:
        print("the compiled kernel (with its C passes) is not built here: nothing to compare")
        return 1
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| mask | L = S | tile map: C ms | torch ms | torch / C | row intervals: C ms | torch ms | torch / C | "
          "C into kept buffers ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in a.lengths.split(",")):
        for name, m in _masks(n).items():
            m4 = m.view(1, 1, n, n)

            def read(torch_way: bool, m4=m4, n=n) -> tuple[float, float]:
                if torch_way:
                    _native.dense_tiles_fn = _native.tile_rows_fn = lambda: None
                try:
                    t0 = time.perf_counter()
                    tb = _tilebits.dense_bits(m4, n, n)
                    t1 = time.perf_counter()
                    _tilebits._row_intervals(tb, n, n)
                    t2 = time.perf_counter()
                finally:
                    _native.dense_tiles_fn, _native.tile_rows_fn = dense_c, rows_c
                return t1 - t0, t2 - t1

            read(False)
            read(True)  # warm-up
            got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for r in range(a.rounds):
                for way in ((False, True) if r % 2 == 0 else (True, False)):
                    got[way].append(read(way))
            c_map, c_rows = (statistics.median(x[i] for x in got[False]) * 1e3 for i in (0, 1))
            t_map, t_rows = (statistics.median(x[i] for x in got[True]) * 1e3 for i in (0, 1))
            # what a replayed call does: the C pass alone, into buffers it keeps from call to call
            nt = -(-n // _tilebits.TILE)
            kinds, index = torch.empty(1, 1, nt, nt, dtype=torch.int8), torch.empty(1, 1, nt, nt, dtype=torch.int32)
            bits = torch.empty(nt * nt, 2, _tilebits.TILE, dtype=torch.int32)
            fill = dense_c()
            assert fill is not None
            number = max(1, 2000 // nt ** 2)
            kept = min(timeit.repeat(lambda: fill(m4, n, n, kinds, index, bits), number=number,
                                     repeat=a.rounds)) / number * 1e3
            print(f"| {name} | {n} | {c_map:.3f} | {t_map:.3f} | {t_map / c_map:.1f}× | {c_rows:.3f} | {t_rows:.3f} | "
                  f"{t_rows / c_rows:.1f}× | {kept:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
