"""A decode loop as a KV cache runs it: one key more at every step, against torch SDPA called directly.

    OMP_NUM_THREADS=2 python benchmarks/decode_loop.py [--steps 300] [--start 1000] [--rounds 3]

One query row per step (B = 1, H = 8 query heads over Hkv = 2 kv heads, D = 64) over a preallocated cache of
which step t reads the first ``start + t`` keys (views, as a KV cache hands them over). Every step is a new call
signature (S changed): a replay keyed by the exact shapes learns again at every step. Callables, timed
interleaved (at each step one call of each, in turns), total time of the loop / steps:

* SDPA: ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` (no mask: a single query row of a causal
  decoder sees the whole cache);
* attnkit, ``mask=masks.causal()``; ``masks.sliding_window(256)``;
* attnkit, ``masks.causal()`` + ``score_mods.softcap(30)`` (Gemma 2) and + a soft cap written as a lambda (a
  traced program); SDPA runs neither, so their ratio is to SDPA's plain step (what the step costs with the cap);
* attnkit with causal written as a user's ``mask_mod`` capturing the step's offset (a new mod every step), alone
  and with the soft cap as a lambda;
* the step's own bool mask tensor (the last 256 keys, ``(1, 1, 1, S)``, built each step as a user builds it), on
  SDPA (``attn_mask``) and on attnkit (``mask=``, alone and with the soft cap as a lambda);
* FlexAttention's loop on attnkit (``from attnkit import create_block_mask, flex_attention``): a ``BlockMask`` of
  that mod built for each step's (1, S), then ``flex_attention`` — timed with the ``create_block_mask`` call, and
  ``flex_attention`` alone on BlockMasks built before the loop (a new one every step all the same);
* FlexAttention's loop the gpt-fast way (``from attnkit import create_block_mask, flex_attention``): one
  ``BlockMask`` of causal for the whole preallocated cache (built before the loop), each step's row sliced off it
  (``block_mask[:, :, pos // 128]``, torch's own ``BlockMask.__getitem__``), its ``mask_mod`` offset by the step's
  position, its lengths set to (1, cache), over the whole cache — timed with the slicing, and ``flex_attention``
  alone (each step's slice made untimed); against SDPA over the whole cache with the step's bool mask
  (``kv <= pos``), as gpt-fast's SDPA path runs it;
* attnkit at a fixed S (the first step's, repeated): the same call without a new signature per step;
* a step of a model of ``--layers`` layers (each its own cache): SDPA, ``masks.causal()``, the user's mod and
  FlexAttention's BlockMask built once per step and passed to every layer (how a model passes its mask).

``ratio`` = SDPA's time / attnkit's (> 1: attnkit faster; a model step's row: SDPA's model step / it; a gpt-fast
row: SDPA's step over the static cache / it). Run it with each source tree on ``PYTHONPATH`` for a before / after;
only the ratios of one run count.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _interleave import cpu_name

import attnkit
from attnkit import _calibrate, _fast, masks, score_mods


def _causal_mod(S: int, row: int = 0):
    """Causal for one query row over S keys, as a user writes it in a decode loop: the offset captured per step (a
    new mod, so a new call signature, every step). ``row``: each benchmark row its own code (the same mask), so no
    row replays what another row's call of the same step left for its exact signature."""
    off = S - 1
    return (lambda b, h, q, kv: kv <= q + off, lambda b, h, q, kv: kv <= off + q, lambda b, h, q, kv: q + off >= kv,
            lambda b, h, q, kv: off + q >= kv, lambda b, h, q, kv: kv - off <= q)[row]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--start", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4, help="layers of the model-step rows (0: none)")
    a = ap.parse_args(argv)
    B, H, Hkv, D = 1, 8, 2, 64
    g = torch.Generator().manual_seed(0)
    cache_k = torch.randn(B, Hkv, a.start + a.steps, D, generator=g)
    cache_v = torch.randn(B, Hkv, a.start + a.steps, D, generator=g)
    q = torch.randn(B, H, 1, D, generator=g)
    causal, window, cap = masks.causal(), masks.sliding_window(256), score_mods.softcap(30.0)

    def lam(s, b, h, i, j):
        return 30.0 * torch.tanh(s / 30.0)

    calls = {
        "SDPA (enable_gqa)": lambda k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "attnkit, `masks.causal()`": lambda k, v: attnkit.attention(q, k, v, mask=causal),
        "attnkit, `masks.sliding_window(256)`": lambda k, v: attnkit.attention(q, k, v, mask=window),
        "attnkit, causal + `score_mods.softcap(30)`": lambda k, v: attnkit.attention(q, k, v, mask=causal,
                                                                                     score_mod=cap),
        "attnkit, causal + a soft cap as a lambda": lambda k, v: attnkit.attention(q, k, v, mask=causal,
                                                                                   score_mod=lam),
        "attnkit, causal as a user's `mask_mod` (`kv <= q + S - 1`)": lambda k, v: attnkit.attention(
            q, k, v, mask=_causal_mod(k.shape[2])),
        "attnkit, that `mask_mod` + a soft cap as a lambda": lambda k, v: attnkit.attention(
            q, k, v, mask=_causal_mod(k.shape[2], 4), score_mod=lam),
    }
    keys = torch.arange(a.start + a.steps)

    def window_row(S):  # the step's own bool mask, built as a user builds it: the last 256 keys, (1, 1, 1, S)
        return (keys[:S] >= S - 256).view(1, 1, 1, S)

    calls["SDPA with the step's own bool mask (a window of 256 as a tensor, built each step)"] = (
        lambda k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=window_row(k.shape[2]), enable_gqa=True))
    calls["attnkit, the step's own bool mask (the same tensor, built each step)"] = (
        lambda k, v: attnkit.attention(q, k, v, mask=window_row(k.shape[2])))
    calls["attnkit, that bool mask + a soft cap as a lambda"] = (
        lambda k, v: attnkit.attention(q, k, v, mask=window_row(k.shape[2]), score_mod=lam))

    def flex_step(k, v):
        bm = attnkit.create_block_mask(_causal_mod(k.shape[2]), 1, None, 1, k.shape[2])
        return attnkit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)

    # one BlockMask per step, built before each round's timed loop (new objects every round: nothing a BlockMask
    # keeps from its first use carries into the next round)
    premade: dict = {}

    def build_premade():
        premade.clear()
        premade.update({a.start + t: attnkit.create_block_mask(_causal_mod(a.start + t, 2), 1, None, 1, a.start + t)
                        for t in range(a.steps)})

    calls["FlexAttention on attnkit: `create_block_mask` + `flex_attention` per step"] = flex_step
    calls["FlexAttention on attnkit: `flex_attention` alone (a new BlockMask every step, built untimed)"] = (
        lambda k, v: attnkit.flex_attention(q, k, v, block_mask=premade[k.shape[2]], enable_gqa=True))
    # the gpt-fast way: a static cache of every step's keys, one BlockMask for all of it, a row of it per step
    total = a.start + a.steps
    big = attnkit.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, total, total)
    positions = torch.arange(total)

    def gpt_fast_slice(S, row=0):  # the step's query sits at position S - 1 of the static cache
        pos = S - 1  # (row: each benchmark row its own code, so no row reuses what another's call of the step left)
        m = big[:, :, pos // 128]
        m.mask_mod = (lambda b, h, qi, kv: qi + pos >= kv, lambda b, h, qi, kv: kv <= qi + pos)[row]
        m.seq_lengths = (1, total)
        return m

    sliced: dict = {}

    calls["SDPA over the static cache with the step's bool mask (`kv <= pos`), gpt-fast's SDPA step"] = (
        lambda k, v: F.scaled_dot_product_attention(
            q, cache_k, cache_v, attn_mask=(positions <= k.shape[2] - 1).view(1, -1), enable_gqa=True))
    calls["FlexAttention on attnkit, gpt-fast's loop: slice the BlockMask + `flex_attention` per step"] = (
        lambda k, v: attnkit.flex_attention(q, cache_k, cache_v, block_mask=gpt_fast_slice(k.shape[2]),
                                            enable_gqa=True))
    calls["FlexAttention on attnkit, gpt-fast's loop: `flex_attention` alone (each step's slice made untimed)"] = (
        lambda k, v: attnkit.flex_attention(q, cache_k, cache_v, block_mask=sliced[k.shape[2]], enable_gqa=True))
    fixed_k, fixed_v = cache_k[:, :, :a.start], cache_v[:, :, :a.start]
    fixed = {"attnkit, `masks.causal()`, fixed S (no new signature)":
             lambda k, v: attnkit.attention(q, fixed_k, fixed_v, mask=causal)}
    # a model's step: each layer its own cache (the layer's k / v: the timed step's S keys of it), one mask per step
    layers = [(torch.randn(cache_k.shape, generator=g), torch.randn(cache_v.shape, generator=g))
              for _ in range(a.layers)]

    def model(attend):
        def step(k, v):
            S = k.shape[2]
            m = attend(S)
            for lk, lv in layers:
                m(lk[:, :, :S], lv[:, :, :S])
        return step

    def with_mod(S):
        mod = _causal_mod(S, 3)
        return lambda k, v: attnkit.attention(q, k, v, mask=mod)

    def with_block_mask(S):
        bm = attnkit.create_block_mask(_causal_mod(S, 1), 1, None, 1, S)
        return lambda k, v: attnkit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)

    if a.layers:
        n = a.layers
        fixed[f"{n} layers: SDPA (enable_gqa)"] = model(
            lambda S: lambda k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        fixed[f"{n} layers: attnkit, `masks.causal()`"] = model(
            lambda S: lambda k, v: attnkit.attention(q, k, v, mask=causal))
        fixed[f"{n} layers: attnkit, a user's `mask_mod` built once per step"] = model(with_mod)
        fixed[f"{n} layers: FlexAttention on attnkit, `create_block_mask` once per step"] = model(with_block_mask)
    names = [*calls, *fixed]
    fns = [*calls.values(), *fixed.values()]
    best = [float("inf")] * len(fns)
    for _ in range(a.rounds):
        _fast.clear()  # every round walks the same lengths: forget what the previous round learned
        build_premade()
        sliced.clear()
        sliced.update({a.start + t: gpt_fast_slice(a.start + t, 1) for t in range(a.steps)})
        tot = [0.0] * len(fns)
        for t in range(a.steps):
            S = a.start + t
            k, v = cache_k[:, :, :S], cache_v[:, :, :S]
            for i, f in enumerate(fns):
                t0 = time.perf_counter()
                f(k, v)
                tot[i] += time.perf_counter() - t0
        best = [min(b, x / a.steps) for b, x in zip(best, tot, strict=True)]
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; auto's table: "
          f"{_calibrate.crossovers().source}")
    print(f"B = {B}, H = {H}, Hkv = {Hkv}, D = {D}, L = 1, S = {a.start} .. {a.start + a.steps - 1} (one key more per "
          f"step), {a.rounds} rounds, the best round's mean per step\n")
    print("| call | µs per step | ratio (SDPA / this) |\n|---|---|---|")
    gpt_sdpa = next(i for i, n in enumerate(names) if n.startswith("SDPA over the static cache"))
    sdpa_model = next((t for n, t in zip(names, best, strict=True) if n.endswith("layers: SDPA (enable_gqa)")), None)
    for n, t in zip(names, best, strict=True):
        # a model's step against SDPA's model step, the gpt-fast rows against SDPA's step over the static cache
        base = sdpa_model if "layers:" in n else best[gpt_sdpa] if "gpt-fast" in n else best[0]
        print(f"| {n} | {t * 1e6:.1f} | {base / t:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
