"""A FlexAttention ``mask_mod`` planned by range evaluation vs the built-in mask (issue 17).

    OMP_NUM_THREADS=1 python benchmarks/mask_mod_plans.py                    # everything, short
    OMP_NUM_THREADS=1 python benchmarks/mask_mod_plans.py --only plans --lengths 131072,1048576
    OMP_NUM_THREADS=1 python benchmarks/mask_mod_plans.py --only cbm --torch  # also torch's create_block_mask

Sections (each timing is the median of ``--repeats``; the two sides of a ratio are measured in
the same run, interleaved: A, B, A, B, ...):

* ``plans``: ``attnkit.plan(mask, L, block=128)`` for the built-in mask vs the same mask as a
  ``mask_mod`` reading a tensor (document ids) or not; a new mod object every call, so nothing
  is cached. Size: O(tiles) = (L / 128)² tiles; the mod is called once over all of them (per
  chunk of 2²¹ tiles) and its points only on undecided tiles (``point`` = how many; ``partial``
  = the partial tiles of the exact plan: equal means nothing decidable was left undecided).
* ``train``: one training step's attention, forward + backward, B=1, H=8, D=64, fp32, tiled
  backend, with the built-in mask vs the data-reading ``mask_mod`` (planned afresh on every
  call, as attnkit's contract says). FLOPs: forward 4·B·H·D·(visible pairs), backward 2.5×
  the forward; for a window W, visible pairs ≈ L·W; for documents of sizes n_i, Σ n_i².
* ``window``: the opaque sliding-window ``mask_mod`` vs the built-in window at L = 4096
  (W = 512, B=1, H=8, D=64), forward and forward + backward.
* ``cbm``: ``attnkit.create_block_mask`` vs torch's ``create_block_mask`` (CPU, no compile) at
  L = 8192 and 32768 (torch's at 32768 only with ``--torch``: it evaluates all L² points and
  takes long), and attnkit's alone at L = 1 048 576; the BlockMask fields are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import attnkit
from attnkit import masks as M
from attnkit.plans import PARTIAL


def _docs(L: int, seed: int = 0) -> torch.Tensor:
    """Document ids of a packed batch: lengths 1k-20k tokens, seeded."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1000, 20000, (L // 1000 + 1,), generator=g)
    return torch.repeat_interleave(torch.arange(lens.numel()), lens)[:L].clone()


def _pairs(L: int, doc: torch.Tensor, W: int, causal: bool):
    """(built-in mask, equivalent mask_mod factory) for each named mask."""
    return {
        "document": (lambda: M.document(doc), lambda: (lambda b, h, q, kv: doc[q] == doc[kv])),
        "causal & document": (lambda: M.causal() & M.document(doc),
                              lambda: (lambda b, h, q, kv: (kv <= q) & (doc[q] == doc[kv]))),
        "sliding window": (lambda: M.sliding_window(W), lambda: (lambda b, h, q, kv: (kv <= q) & (q - kv < W))),
        "prefix-LM": (lambda: M.prefix_lm(L // 4), lambda: (lambda b, h, q, kv: (kv < L // 4) | (kv <= q))),
        "chunked": (lambda: M.chunked(8192), lambda: (lambda b, h, q, kv: (kv <= q) & (q // 8192 == kv // 8192))),
    }


def _interleaved(fa, fb, repeats: int):
    """Median seconds of fa and fb, run alternately."""
    ta, tb = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fa()
        ta.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fb()
        tb.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def plans(lengths, repeats):
    print("\n## plan of a mask_mod vs the built-in mask (block 128)\n")
    print("| mask | L | built-in | mask_mod | ratio | point-evaluated tiles | partial tiles |")
    print("|---|---|---|---|---|---|---|")
    for L in lengths:
        doc = _docs(L)
        for name, (builtin, mod) in _pairs(L, doc, 4096, True).items():
            attnkit.plan(mod(), L, block=128)  # warm: probes, the min/max table of doc
            a, b = _interleaved(lambda: attnkit.plan(builtin(), L, block=128),
                                lambda: attnkit.plan(mod(), L, block=128), repeats)
            p = attnkit.plan(mod(), L, block=128)
            exact = torch.equal(p.kinds, attnkit.plan(builtin(), L, block=128).kinds)
            partial = int((p.kinds == PARTIAL).sum())
            print(f"| {name} | {L} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {b / a:.2f}× | {p.point_tiles} | "
                  f"{partial}{'' if exact else ' (kinds differ from the built-in!)'} |")
            sys.stdout.flush()


def _step(q, k, v, mask):
    out = attnkit.attention(q, k, v, mask=mask, backend="tiled")
    out.sum().backward()


def train(repeats, L=16384):
    print(f"\n## training-sized call: L={L}, B=1, H=8, D=64, fp32, forward + backward, tiled\n")
    print("| mask | built-in | data-reading mask_mod | ratio |")
    print("|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, L, 64, generator=g).requires_grad_() for _ in range(3))
    doc = _docs(L, seed=2)
    starts = torch.arange(L)  # read by the window mod: it reads data, so it is planned every call
    W = 1024
    cases = {
        "sliding window 1024": (M.sliding_window(W), lambda b, h, qi, kv: (kv <= qi) & (starts[qi] - starts[kv] < W)),
        "document": (M.document(doc), lambda b, h, qi, kv: doc[qi] == doc[kv]),
    }
    for name, (builtin, mod) in cases.items():
        _step(q, k, v, mod)
        a, b = _interleaved(lambda: _step(q, k, v, builtin), lambda: _step(q, k, v, mod), repeats)
        print(f"| {name} | {a:.3f} s | {b:.3f} s | {b / a:.2f}× |")
        sys.stdout.flush()


def window(repeats, L=4096, W=512):
    print(f"\n## opaque sliding-window mask_mod vs the built-in window: L={L}, W={W}, B=1, H=8, D=64\n")
    print("| pass | built-in | opaque mask_mod | ratio |")
    print("|---|---|---|---|")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, L, 64, generator=g).requires_grad_() for _ in range(3))

    def opaque(b, h, qi, kv):
        return (kv <= qi) & (qi - kv < W)

    builtin = M.sliding_window(W)
    fwd = lambda m: attnkit.attention(q, k, v, mask=m, backend="tiled")  # noqa: E731
    for label, f in (("forward", fwd), ("forward + backward", lambda m: _step(q, k, v, m))):
        f(opaque)
        a, b = _interleaved(lambda: f(builtin), lambda: f(opaque), repeats)
        print(f"| {label} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {b / a:.2f}× |")
        sys.stdout.flush()


def cbm(torch_max: int, repeats, lengths=(8192, 32768, 1 << 20)):
    from torch.nn.attention.flex_attention import create_block_mask

    print("\n## create_block_mask on CPU (block 128): attnkit's vs torch's\n")
    print("| mask | L | attnkit | torch | speed-up |")
    print("|---|---|---|---|---|")
    for L in lengths:
        doc = _docs(L)
        for name, (_, mod) in _pairs(L, doc, 4096, True).items():
            f = mod()
            attnkit.create_block_mask(f, None, None, L, L, device="cpu")
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                ours = attnkit.create_block_mask(f, None, None, L, L, device="cpu")
                ts.append(time.perf_counter() - t0)
            a = statistics.median(ts)
            theirs = "not run (--torch)" if L <= 32768 else "not run (L² points)"
            ratio = ""
            if L <= torch_max:
                t0 = time.perf_counter()
                ref = create_block_mask(f, None, None, L, L, device="cpu")
                b = time.perf_counter() - t0
                same = all(torch.equal(getattr(ours, n), getattr(ref, n))
                           for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"))
                theirs, ratio = f"{b:.2f} s{'' if same else ' (DIFFERENT!)'}", f"{b / a:.0f}×"
            print(f"| {name} | {L} | {a * 1e3:.1f} ms | {theirs} | {ratio} |")
            sys.stdout.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["plans", "train", "window", "cbm"], action="append")
    ap.add_argument("--lengths", default="131072", help="plan section: comma-separated L")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch", action="store_true",
                    help="cbm section: also run torch's create_block_mask at 32k (slow: L² points, GiBs of memory); "
                         "without it, torch's runs at 8192 only")
    a = ap.parse_args(argv)
    only = set(a.only or ["plans", "train", "window", "cbm"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    if "plans" in only:
        plans([int(x) for x in a.lengths.split(",")], a.repeats)
    if "window" in only:
        window(a.repeats)
    if "train" in only:
        train(a.repeats)
    if "cbm" in only:
        cbm(32768 if a.torch else 8192, a.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
