"""score_mods on the compiled kernel (traced programs) against causal alone, the path before, and Flex.

    OMP_NUM_THREADS=2 python benchmarks/score_mods.py                 # L = 4096, fwd and fwd + bwd
    OMP_NUM_THREADS=2 python benchmarks/score_mods.py --flex          # + compiled FlexAttention forward

B = 1, H = 8, D = 64, fp32, causal. Peers, interleaved round by round (median of ``--rounds``):

* ``mod``     ``attnkit.attention(q, k, v, causal=True, score_mod=fn)`` (auto; the kernel runs the traced
              program: ``attnkit.dispatch`` names it);
* ``causal``  the same call without the score_mod;
* ``before``  the mod with the compiled kernel switched off (``tiled.NATIVE = False``): torch ops tile by
              tile, or torch's flash kernel per run for an additive table, as attnkit ran score_mods before;
* ``flex``    ``torch.compile(flex_attention)`` with the causal BlockMask and the same score_mod (forward).

Goals: mod / causal <= 1.2 (fwd and fwd + bwd), a learnable table <= 1.5 (fwd + bwd), flex / mod >= 3.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import attnkit
from attnkit.backends import tiled

B, H, D = 1, 8, 64


def mods(L):
    slopes = attnkit.positional.alibi_slopes(H)
    rel = torch.randn(H, 2 * L + 1) * 0.1
    rel_learned = rel.clone().requires_grad_()
    buckets = torch.randn(H, 32) * 0.1

    def t5(score, b, h, q_idx, kv_idx):
        n = (q_idx - kv_idx).abs()
        large = 8 + (torch.log(n.float() / 8 + 1e-6) / math.log(128 / 8) * 8).to(torch.long)
        return score + buckets[h, torch.where(n < 8, n, large.clamp(max=15))]

    return {
        "softcap": (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), ()),
        "relative table": (lambda s, b, h, q, kv: s + rel[h, kv - q + L], ()),
        "alibi lambda": (lambda s, b, h, q, kv: s + slopes[h] * (kv - q), ()),
        "t5 buckets": (t5, ()),
        "learnable table": (lambda s, b, h, q, kv: s + rel_learned[h, kv - q + L], (rel_learned,)),
    }


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flex", action="store_true")
    a = ap.parse_args()
    L = a.length
    torch.manual_seed(0)
    print(f"# score_mods + causal, L = {L}, B = {B}, H = {H}, D = {D}, fp32, {torch.get_num_threads()} threads, "
          f"median of {a.rounds}; ms")
    flex = None
    if a.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention)
        bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, L, L, device="cpu")
    print("| score_mod | mode | worker | mod | causal | before | flex | mod / causal | flex / mod |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (fn, _) in mods(L).items():
        for mode in ("fwd", "fwdbwd"):
            if name == "learnable table" and mode == "fwd":
                continue
            rg = mode != "fwd"
            q, k, v = (torch.randn(B, H, L, D, requires_grad=rg) for _ in range(3))
            worker = attnkit.dispatch(q, k, v, causal=True, score_mod=fn).worker

            def run(sm, native=True, q=q, k=k, v=v, mode=mode):
                saved, tiled.NATIVE = tiled.NATIVE, native
                try:
                    if mode == "fwd":
                        with torch.no_grad():
                            attnkit.attention(q, k, v, causal=True, score_mod=sm)
                    else:
                        attnkit.attention(q, k, v, causal=True, score_mod=sm).sum().backward()
                finally:
                    tiled.NATIVE = saved

            peers = {"mod": lambda fn=fn: run(fn), "causal": lambda: run(None),
                     "before": lambda fn=fn: run(fn, native=False)}
            if flex is not None and mode == "fwd":
                peers["flex"] = lambda fn=fn, q=q, k=k, v=v: flex(q, k, v, score_mod=fn, block_mask=bm)
            for p in peers.values():
                p()
            times = {p: [] for p in peers}
            for _ in range(a.rounds):
                for p, f in peers.items():
                    times[p].append(_timed(f))
            m = {p: statistics.median(t) * 1e3 for p, t in times.items()}
            fl = f"{m['flex']:.1f}" if "flex" in m else "—"
            fr = f"{m['flex'] / m['mod']:.2f}×" if "flex" in m else "—"
            print(f"| {name} | {mode} | {worker} | {m['mod']:.1f} | {m['causal']:.1f} | {m['before']:.1f} | {fl} | "
                  f"{m['mod'] / m['causal']:.2f}× | {fr} |", flush=True)


if __name__ == "__main__":
    main()
