"""Decoding speed: ``attnkit.nn.MultiHeadAttention`` one-token steps vs a plain-torch layer doing the
same work, and ``attnkit.attention`` decode calls vs torch SDPA given the equivalent mask.

    python benchmarks/decode.py [--threads 1] [--repeats 300]

The plain-torch layer: q/k/v/out projections (nn.Linear), RoPE from a precomputed
cos/sin table, the new key/value written into a preallocated cache, SDPA with
``enable_gqa``. Interleaved timing (one call of each in turn), medians; ratio =
plain / attnkit (≥ 1/1.15 is the goal for the layer, ≥ 0.95 for decode calls at S ≥ 2k). The layer is timed two
ways: a step repeated at one cache length (the cache's length reset before each), and a loop whose cache grows
one token per step, as generation runs (a new cache length, so a new call signature, at every step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks
from attnkit.nn import MultiHeadAttention


class PlainLayer(torch.nn.Module):
    """What a hand-written GQA + RoPE decoding layer does, in plain torch."""

    def __init__(self, ours: MultiHeadAttention, max_len: int):
        super().__init__()
        self.m, self.H, self.Hkv, self.D = ours, ours.num_heads, ours.num_kv_heads, ours.head_dim
        pos = torch.arange(max_len, dtype=torch.float64)
        inv = 10000.0 ** (-torch.arange(0, self.D, 2, dtype=torch.float64) / self.D)
        ang = pos[:, None] * inv
        self.cos, self.sin = ang.cos().float(), ang.sin().float()
        self.k = torch.zeros(1, self.Hkv, max_len, self.D)
        self.v = torch.zeros(1, self.Hkv, max_len, self.D)
        self.n = 0

    def rope(self, x, off):
        c, s = self.cos[off:off + x.shape[2]], self.sin[off:off + x.shape[2]]
        a, b = x[..., : self.D // 2], x[..., self.D // 2:]
        return torch.cat((a * c - b * s, a * s + b * c), -1)

    def forward(self, x):
        B, L, E = x.shape
        m = self.m
        q = m.q_proj(x).view(B, L, self.H, self.D).transpose(1, 2)
        k = m.k_proj(x).view(B, L, self.Hkv, self.D).transpose(1, 2)
        v = m.v_proj(x).view(B, L, self.Hkv, self.D).transpose(1, 2)
        q, k = self.rope(q, self.n), self.rope(k, self.n)
        self.k[:, :, self.n:self.n + L] = k
        self.v[:, :, self.n:self.n + L] = v
        self.n += L
        o = F.scaled_dot_product_attention(q, self.k[:, :, :self.n], self.v[:, :, :self.n], enable_gqa=True)
        return m.out_proj(o.transpose(1, 2).reshape(B, L, E))


def interleaved(fns: dict, repeats: int, warmup: int = 20) -> dict:
    """Median µs of each callable, timed in turns (one call each), after ``warmup`` calls each."""
    ts = {n: [] for n in fns}
    for f in fns.values():
        for _ in range(warmup):
            f()
    for _ in range(repeats):
        for n, f in fns.items():
            t0 = time.perf_counter()
            f()
            ts[n].append(time.perf_counter() - t0)
    return {n: statistics.median(x) * 1e6 for n, x in ts.items()}


def mha_step(cached: int, repeats: int) -> dict:
    """Median µs of one decoding step with ``cached`` tokens in the cache: ``{"plain", "attnkit"}``."""
    torch.manual_seed(0)
    m = MultiHeadAttention(512, 8, num_kv_heads=2, positional="rope").eval()
    plain = PlainLayer(m, cached + 64)
    cache = m.new_cache(1, cached + 64)
    x, tok = torch.randn(1, cached, 512), torch.randn(1, 1, 512)
    with torch.no_grad():
        m(x, kv_cache=cache)
        plain(x)

        def ours():
            cache.length = cached
            m(tok, kv_cache=cache)

        def theirs():
            plain.n = cached
            plain(tok)

        return interleaved({"plain": theirs, "attnkit": ours}, repeats)


def mha_loop(cached: int, steps: int) -> dict:
    """Median µs of a decoding step of a loop that grows the cache one token per step (``steps`` steps from
    ``cached``), as generation does: every step a new cache length. ``{"plain", "attnkit"}``, interleaved."""
    torch.manual_seed(0)
    m = MultiHeadAttention(512, 8, num_kv_heads=2, positional="rope").eval()
    plain = PlainLayer(m, cached + steps + 1)
    cache = m.new_cache(1, cached + steps + 1)
    x, tok = torch.randn(1, cached, 512), torch.randn(1, 1, 512)
    ts: dict[str, list[float]] = {"plain": [], "attnkit": []}
    with torch.no_grad():
        m(x, kv_cache=cache)
        plain(x)
        for _ in range(steps):
            t0 = time.perf_counter()
            plain(tok)
            t1 = time.perf_counter()
            m(tok, kv_cache=cache)
            ts["plain"].append(t1 - t0)
            ts["attnkit"].append(time.perf_counter() - t1)
    return {n: statistics.median(x) * 1e6 for n, x in ts.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=300)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(f"torch threads {a.threads}\n")
    print("| MultiHeadAttention decode step (E=512, H=8, Hkv=2, RoPE) | plain torch µs | attnkit µs "
          "| attnkit / plain |")
    print("|---|---|---|---|")
    for cached in (256, 2048):
        t = mha_step(cached, a.repeats)
        print(f"| cache {cached} | {t['plain']:.0f} | {t['attnkit']:.0f} | {t['attnkit'] / t['plain']:.2f}× |")
        t = mha_loop(cached, a.repeats)
        print(f"| cache {cached}, growing one token per step ({a.repeats} steps) | {t['plain']:.0f} | "
              f"{t['attnkit']:.0f} | {t['attnkit'] / t['plain']:.2f}× |")
    print("\n| decode call (H=8, Hkv=2, D=64) | SDPA + its mask µs | attnkit auto µs | SDPA / attnkit |")
    print("|---|---|---|---|")
    for L in (1, 4, 16):
        for S in (128, 2048, 32768):
            for name, mask in (("causal", masks.causal()), ("padding", masks.padding([S - 7])),
                               ("window 4096", masks.sliding_window(4096))):
                q, k, v = torch.randn(1, 8, L, 64), torch.randn(1, 2, S, 64), torch.randn(1, 2, S, 64)
                dense = mask.materialize(1, 1, L, S)  # SDPA's equivalent mask, built outside the timing
                with torch.no_grad():
                    t = interleaved({
                        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True),
                        "attnkit": lambda: attnkit.attention(q, k, v, mask=mask),
                    }, max(20, a.repeats // (1 + S // 4096)))
                print(f"| L={L} S={S} {name} | {t['sdpa']:.0f} | {t['attnkit']:.0f} "
                      f"| {t['sdpa'] / t['attnkit']:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
