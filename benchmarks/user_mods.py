"""Small calls with the user's own code: a ``mask_mod``, a ``score_mod``, FlexAttention's ``BlockMask``, against
SDPA and attnkit's built-in mask on the same call.

    python benchmarks/user_mods.py [--repeats 500] [--compile] [--train]

Each row is one way to write the same call; a model makes it at every layer of every step, building its mask or
mod anew each time as models do (``from_mod(lambda ...)`` inside the loop), so what a call costs around the kernel
counts. Timed interleaved (one call of each, in turns, no gradients), medians; the ratio is SDPA's time over the
row's (> 1: faster than SDPA). The mask rows compute causal attention, which SDPA runs as ``is_causal=True``; the
score_mod rows add a soft cap (Gemma 2's ``20 · tanh(s / 20)``), which SDPA cannot run: its column is still SDPA's
plain causal call, the floor a score_mod could reach. FLOPs are not the point here (at L = 64 a call is ~0.5 MFLOP).

A second table: one decode step (L = 1 over S = 2048 cached keys, GQA 8 / 2) with a mask written as a
``mask_mod`` (a window; a window per head; holes read from a tensor of valid keys), against attnkit's built-in
window and against SDPA given the same mask as a dense bool tensor built once, outside the timing (what a user who
had the tensor already would call).

``--train`` adds a table of forward + backward steps (``out.sum().backward()``, inputs that require grad) at
(2, 4, 64, 16): the same rows, SDPA's autograd as the peer.

``--compile`` adds the same calls inside a ``torch.compile``-d function (inductor, ``fullgraph=True``; attnkit
runs as its torch op there, see ``attnkit._op``), SDPA compiled too; their ratios are against eager SDPA as well.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import attnkit
from attnkit import _calibrate, masks, score_mods

SHAPES = [(2, 4, 64, 16), (1, 8, 256, 64)]  # (B, H, L, D), self-attention L = S


def _rows(q, k, v):
    L = q.shape[2]
    bm = attnkit.create_block_mask(lambda b, h, qi, kv: kv <= qi, None, None, L, L)
    return {
        "SDPA is_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "attnkit causal=True": lambda: attnkit.attention(q, k, v, causal=True),
        "mask=from_mod(kv <= q), built each call":
            lambda: attnkit.attention(q, k, v, mask=masks.from_mod(lambda b, h, qi, kv: kv <= qi)),
        "mask=lambda (a bare mask_mod)": lambda: attnkit.attention(q, k, v, mask=lambda b, h, qi, kv: kv <= qi),
        "flex_attention(block_mask=create_block_mask(...))":
            lambda: attnkit.flex_attention(q, k, v, block_mask=bm),
        "causal + score_mod=lambda softcap":
            lambda: attnkit.attention(q, k, v, causal=True, score_mod=lambda s, b, h, qi, kv: 20 * torch.tanh(s / 20)),
        "causal + score_mods.softcap(20)":
            lambda: attnkit.attention(q, k, v, causal=True, score_mod=score_mods.softcap(20.0)),
    }


def _compiled(q, k, v):
    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def causal(q, k, v):
        return attnkit.attention(q, k, v, causal=True)

    def mask_mod(q, k, v):
        return attnkit.attention(q, k, v, mask=_causal_mod)

    def score_mod(q, k, v):
        return attnkit.attention(q, k, v, causal=True, score_mod=_softcap)

    fns = {"compiled: SDPA is_causal": sdpa, "compiled: attnkit causal=True": causal,
           "compiled: mask=mask_mod": mask_mod, "compiled: causal + score_mod softcap": score_mod}
    out = {}
    for n, f in fns.items():
        cf = torch.compile(f, fullgraph=True)
        out[n] = (lambda cf: lambda: cf(q, k, v))(cf)
    return out


def _causal_mod(b, h, qi, kv):
    return kv <= qi


def _softcap(s, b, h, qi, kv):
    return 20.0 * torch.tanh(s / 20.0)


def _decode_rows(S: int = 2048):
    q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 2, S, 64), torch.randn(1, 2, S, 64)
    valid = torch.rand(S) > 0.3
    mods = {"a window of 64 as a mask_mod": lambda b, h, qi, kv: (qi + S - 1 - kv >= 0) & (qi + S - 1 - kv < 64),
            "a window of 64 · (h + 1) (per head)":
                lambda b, h, qi, kv: (qi + S - 1 - kv >= 0) & (qi + S - 1 - kv < 64 * (h + 1)),
            "holes: valid[kv] (a tensor the mod reads)": lambda b, h, qi, kv: valid[kv]}
    rows = {"attnkit sliding_window(64), built in": lambda: attnkit.attention(q, k, v, mask=masks.sliding_window(64))}
    for n, m in mods.items():
        dense = masks.from_mod(m).materialize(1, 8, 1, S)
        rows["SDPA, dense mask of " + n] = (lambda d: lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=d, enable_gqa=True))(dense)
        rows["attnkit, " + n] = (lambda m: lambda: attnkit.attention(q, k, v, mask=m))(m)
    return rows


def _train_rows():
    q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))

    def step(f):
        return lambda: f().sum().backward()

    return {
        "SDPA is_causal": step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "attnkit causal=True": step(lambda: attnkit.attention(q, k, v, causal=True)),
        "mask=lambda (a bare mask_mod)": step(lambda: attnkit.attention(q, k, v, mask=_causal_mod)),
        "causal + score_mod=lambda softcap": step(lambda: attnkit.attention(q, k, v, causal=True, score_mod=_softcap)),
        "causal + score_mods.softcap(20)":
            step(lambda: attnkit.attention(q, k, v, causal=True, score_mod=score_mods.softcap(20.0))),
    }


def _table(rows, repeats: int, title: str, base, grad: bool = False) -> None:
    """Time ``rows`` interleaved; ``base(name)``: the row each row's ratio divides (its peer's time / its own)."""
    ts: dict[str, list[float]] = {n: [] for n in rows}
    with torch.set_grad_enabled(grad):
        for f in rows.values():  # warm: each signature learned once (and compiled)
            for _ in range(3):
                f()
        for _ in range(repeats):
            for n, f in rows.items():
                t0 = time.perf_counter()
                f()
                ts[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(x) for n, x in ts.items()}
    print(f"{title}, {repeats} interleaved calls each\n")
    print("| call | µs | peer | peer / this |")
    print("|---|---|---|---|")
    for n, m in med.items():
        print(f"| {n} | {m * 1e6:.1f} | {base(n)} | {med[base(n)] / m:.2f} |")
    print()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=500)
    ap.add_argument("--compile", action="store_true", help="also the calls inside torch.compile (inductor)")
    ap.add_argument("--train", action="store_true", help="also forward + backward steps at L = 64")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    print(f"auto's table: {_calibrate.crossovers().source}; {torch.get_num_threads()} threads\n")
    for B, H, L, D in SHAPES:
        q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
        rows = _rows(q, k, v)
        if a.compile:
            rows.update(_compiled(q, k, v))
        _table(rows, a.repeats, f"(B, H, L, D) = ({B}, {H}, {L}, {D}), causal", lambda n: "SDPA is_causal")
    if a.train:
        _table(_train_rows(), a.repeats, "forward + backward, (B, H, L, D) = (2, 4, 64, 16), causal",
               lambda n: "SDPA is_causal", grad=True)
    rows = _decode_rows()
    _table(rows, a.repeats, "decode: L = 1 over S = 2048 keys, GQA 8 / 2, D = 64",
           lambda n: "SDPA, dense mask of " + (n.split(", ", 1)[1] if n.startswith("attnkit, ") else
                                               n.split(" of ", 1)[1] if n.startswith("SDPA") else
                                               "a window of 64 as a mask_mod"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
