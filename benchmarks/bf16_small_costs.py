"""Where bf16's small calls spend what fp32's do not: the pieces behind ``benchmarks/bf16_small.py``'s rows above 1.

    OMP_NUM_THREADS=2 python benchmarks/bf16_small_costs.py [--rounds 40] [--calls 2000]

1. A decode step over 128 keys (GQA 8/2, D = 64) as the kernel's prepared call alone (``_native.decode_step``: no
   dispatch, no autograd), bf16 against fp32, with the bf16 products on (on a CPU with avx512_bf16: the scores by
   VDPBF16PS) and off (the widening order); each round times ``--calls`` calls of each in turn, the ratio is the
   median of the rounds' own.
2. The same step through ``attnkit.attention``, fp32 timed first in each round and then bf16 first (an order effect
   would show as two different ratios).
3. A causal prefill of 64 tokens (B = 2, H = 4) through ``attnkit.attention`` at D = 16 and at D = 32 (bf16 on AMX
   tiles where the CPU has them; at D = 16 the scores' depth zero-padded to 32 — before, D % 32 != 0 widened bf16 per
   tile): bf16 / fp32 at each, and bf16 at D = 32 against fp32 at D = 16.
4. A user's bool mask of L = S = 2048: a BLAKE2 digest of its bytes (``_mods._content``, what a cache keyed by its
   content would take per call) against reading its tile map (``_tilebits.dense_bits``), in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _interleave import cpu_name, paired_ratio

import attnkit
from attnkit import _mods
from attnkit.backends import _native, _tilebits


def _rounds(fns: dict, rounds: int, calls: int) -> dict:
    for f in fns.values():
        for _ in range(100):
            f()
    times: dict = {n: [] for n in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return times


def _qkv(B, H, Hkv, L, S, D, dt):
    return (torch.randn(B, H, L, D).to(dt), torch.randn(B, Hkv, S, D).to(dt), torch.randn(B, Hkv, S, D).to(dt))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    print(f"{cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads; {_native.status()}")
    torch.manual_seed(0)
    f32, b16 = torch.float32, torch.bfloat16
    lo, hi = torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), 128, dtype=torch.int32)
    data = {dt: _qkv(1, 8, 2, 1, 128, 64, dt) for dt in (f32, b16)}

    print("\n1. the prepared decode step alone (L = 1, S = 128, GQA 8/2, D = 64), µs a call")
    for on in (True, False):
        before = _native.set_bf16_dot(on)
        try:
            steps = {dt: _native.decode_step(*data[dt], lo, hi, rounded=True) for dt in (f32, b16)}
            fns = {dt: (lambda st=steps[dt], t=data[dt]: st(*t, 0.125)) for dt in (f32, b16)}
            runs = _rounds(fns, a.rounds, a.calls)
        finally:
            _native.set_bf16_dot(before)
        what = ("VDPBF16PS" if _native.bf16_vdot() else "widened (no avx512_bf16)") if on else "widened"
        print(f"   bf16 products {'on ' if on else 'off'} ({what}): fp32 {statistics.median(runs[f32]):.2f}, bf16 "
              f"{statistics.median(runs[b16]):.2f}, bf16 / fp32 {paired_ratio(runs[b16], runs[f32]):.3f}")

    print("\n2. the same step through attnkit.attention, bf16 / fp32 by which runs first in a round")
    calls = {dt: (lambda t=data[dt]: attnkit.attention(*t, causal=True)) for dt in (f32, b16)}
    for order in ((f32, b16), (b16, f32)):
        runs = _rounds({dt: calls[dt] for dt in order}, a.rounds, a.calls)
        print(f"   {'fp32' if order[0] is f32 else 'bf16'} first: {paired_ratio(runs[b16], runs[f32]):.3f} "
              f"(fp32 {statistics.median(runs[f32]):.2f} µs)")

    print("\n3. a causal prefill of 64 tokens (B = 2, H = 4) through attnkit.attention, µs a call")
    got = {}
    for D in (16, 32):
        t = {dt: _qkv(2, 4, 4, 64, 64, D, dt) for dt in (f32, b16)}
        fns = {(D, dt): (lambda x=t[dt]: attnkit.attention(*x, causal=True)) for dt in (f32, b16)}
        got.update(_rounds(fns, a.rounds, a.calls // 4))
        print(f"   D = {D}: fp32 {statistics.median(got[(D, f32)]):.1f}, bf16 {statistics.median(got[(D, b16)]):.1f}, "
              f"bf16 / fp32 {paired_ratio(got[(D, b16)], got[(D, f32)]):.3f}")
    print(f"   bf16 at D = 32 / fp32 at D = 16 (rounds paired across the two runs): "
          f"{statistics.median(got[(32, b16)]) / statistics.median(got[(16, f32)]):.3f}")

    print("\n4. a bool mask of L = S = 2048 (4 causal documents), ms a call")
    i = torch.arange(2048)
    m4 = ((i[:, None] // 512 == i[None, :] // 512) & (i[None, :] <= i[:, None]))[None, None]
    t = _rounds({"digest": lambda: _mods._content(m4), "map": lambda: _tilebits.dense_bits(m4, 2048, 2048)},
                max(3, a.rounds // 8), 3)
    print(f"   its digest {statistics.median(t['digest']) / 1e3:.2f}; its tile map read afresh "
          f"{statistics.median(t['map']) / 1e3:.2f}")


if __name__ == "__main__":
    main()
