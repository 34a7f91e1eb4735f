"""Grouped-query decoding: attnkit (the g query heads of each K/V head folded into rows, K/V read once
per group) vs torch SDPA with ``enable_gqa=True`` (K/V walked once per query head), and the machine's
read bandwidth over the same bytes.

    python benchmarks/decode_gqa.py [--threads 2] [--repeats 30]

Interleaved timing (one call of each in turn), medians. A decode step is memory-bound: its floor is
the time to read K and V once, ``bytes = 2 · B · Hkv · S · D · 4`` (fp32); "read GB/s" is that over
the call's time, beside ``torch.sum`` over a K/V-sized buffer (the machine's read bandwidth here).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import attnkit


def _bench(fns, repeats):
    for f in fns:
        f()
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            f()
            ts[i].append(time.perf_counter() - t)
    return [statistics.median(x) for x in ts]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"fp32, B = 1, L = 1 (one decode step), D = 128, {a.threads} threads, {a.repeats} interleaved repeats\n")
    print("| H | Hkv | S | SDPA ms | attnkit ms | attnkit / SDPA time | attnkit read GB/s | torch.sum GB/s "
          "| of bandwidth |")
    print("|---|---|---|---|---|---|---|---|---|")
    for H, Hkv, S in ((32, 8, 32768), (32, 8, 2048), (32, 8, 128), (32, 32, 32768), (8, 8, 2048)):
        q = torch.randn(1, H, 1, 128)
        k, v = torch.randn(1, Hkv, S, 128), torch.randn(1, Hkv, S, 128)
        buf = torch.randn(2 * Hkv * S * 128)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hkv)  # noqa: E731
        ours = lambda: attnkit.attention(q, k, v)  # noqa: E731
        read = lambda: buf.sum()  # noqa: E731
        t_sdpa, t_ours, t_read = _bench([sdpa, ours, read], a.repeats)
        nbytes = 2 * Hkv * S * 128 * 4
        bw_ours, bw_read = nbytes / t_ours / 1e9, nbytes / t_read / 1e9
        print(f"| {H} | {Hkv} | {S} | {t_sdpa * 1e3:.3f} | {t_ours * 1e3:.3f} | {t_ours / t_sdpa:.2f} | "
              f"{bw_ours:.1f} | {bw_read:.1f} | {bw_ours / bw_read:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
