"""The GPU path measured: attnkit ``auto`` vs torch SDPA vs FlexAttention (+ ``create_block_mask``).

    python benchmarks/gpu.py [--lengths 1024,4096,16384,32768] [--dims 64,128] [--masks causal,...] [--quick]

Needs a CUDA device (exits with a message otherwise). bf16, B = 4, H = 16; masks dense,
causal, sliding window 1024, document (16 equal documents), prefix-LM (L/4). For each:
forward and forward+backward time (CUDA events, median of ``--repeats`` after warm-up),
interleaved peers, TFLOP/s from

    FLOPs(fwd) = 4·B·H·L·S·D · f     f = fraction of (i, j) the mask keeps (exact, from the mask)
    FLOPs(fwd+bwd) = 3.5 · FLOPs(fwd)

SDPA is given ``is_causal`` where it expresses the mask, a dense bool mask otherwise (built
outside the timing). FlexAttention gets ``create_block_mask`` (timed apart) and attnkit its
own plan. Then plan + BlockMask build time vs ``create_block_mask`` at 16k and 128k (``--block-lengths``), for
attnkit's masks and for a user's ``mask_mod`` reading document ids on the GPU (``attnkit.create_block_mask``,
the drop-in, against torch's on the same function). Compiling torch's kernels for each new shape takes most of
a run's time: ``--masks`` and ``--lengths`` keep it short.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def _masks(L):
    from attnkit import masks
    return {
        "dense": None,
        "causal": masks.causal(),
        "window-1024": masks.sliding_window(1024),
        "document-16": masks.document(torch.arange(L) // max(1, L // 16)),
        "prefix-L/4": masks.prefix_lm(L // 4),
    }


def _time(fn, repeats):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,16384,32768")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--masks", default="dense,causal,window-1024,document-16,prefix-L/4")
    ap.add_argument("--block-lengths", default="16384,131072")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (this benchmark is for a GPU machine)")
        return 0
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import attnkit

    flex = torch.compile(flex_attention)
    dev, dt, B, H = "cuda", torch.bfloat16, 4, 16
    lengths = [int(x) for x in a.lengths.split(",")][: 2 if a.quick else None]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, attnkit {attnkit.__version__}")
    print("| mask | L | attnkit plan + BlockMask ms | create_block_mask ms | speed-up |\n|---|---|---|---|---|")
    for L in (int(x) for x in a.block_lengths.split(",")):
        doc = (torch.arange(L, device=dev) // max(1, L // 16))
        cases = {n: m for n, m in _masks(L).items() if m is not None and n in a.masks.split(",")}
        cases["user mod: doc[q] == doc[kv], ids on the GPU"] = lambda b, h, q, kv: doc[q] == doc[kv]
        for name, mask in cases.items():
            if callable(mask) and not isinstance(mask, attnkit.masks.Mask):
                mod = mask
                ours = _time(lambda: attnkit.create_block_mask(mod, None, None, L, L, device=dev), 3)
            else:
                mod = mask.flex_mask_mod_on(L, L, torch.device(dev))
                ours = _time(lambda: attnkit.plan(mask, L, block=(128, 128)).to_block_mask(dev), 3)
            try:
                theirs = _time(lambda: create_block_mask(mod, None, None, L, L, device=dev), 3)
            except torch.cuda.OutOfMemoryError:
                theirs = float("nan")
            print(f"| {name} | {L} | {ours * 1e3:.2f} | {theirs * 1e3:.2f} | {theirs / ours:.1f}× |", flush=True)
    print()
    print("| mask | L | D | mode | SDPA TFLOP/s | flex TFLOP/s | attnkit TFLOP/s | attnkit/SDPA | attnkit/flex |")
    print("|---|---|---|---|---|---|---|---|---|")
    for L in lengths:
        for D in (int(x) for x in a.dims.split(",")):
            for name, mask in _masks(L).items():
                if name not in a.masks.split(","):
                    continue
                dens = 1.0 if mask is None else attnkit.plan(mask, L, block=(128, 128)).density
                frac = 1.0 if mask is None else float(mask.materialize(1, 1, L, L, device=dev).float().mean())
                flops = 4 * B * H * L * L * D * frac
                q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
                causal = name == "causal"
                if mask is None or causal:
                    dense = None
                else:  # SDPA's dense mask: skipped past 16384 (L² bytes)
                    dense = mask.materialize(1, 1, L, L, device=dev) if L <= 16384 else "skip"
                bm = None if mask is None else create_block_mask(mask.flex_mask_mod_on(L, L, dev), None, None, L, L,
                                                                 device=dev)
                for mode in ("fwd", "fwdbwd"):
                    def step(f):
                        def run():
                            out = f()
                            if mode == "fwdbwd":
                                out.sum().backward()
                        return run
                    peers = {
                        "sdpa": None if isinstance(dense, str) else step(lambda: F.scaled_dot_product_attention(
                            q, k, v, attn_mask=dense, is_causal=causal)),
                        "flex": step(lambda: flex(q, k, v, block_mask=bm)),
                        "attnkit": step(lambda: attnkit.attention(q, k, v, mask=mask)),
                    }
                    t = {n: (_time(f, a.repeats) if f else float("nan")) for n, f in peers.items()}
                    mult = 3.5 if mode == "fwdbwd" else 1.0
                    tf = {n: flops * mult / s / 1e12 for n, s in t.items()}
                    print(f"| {name} | {L} | {D} | {mode} | {tf['sdpa']:.1f} | {tf['flex']:.1f} | "
                          f"{tf['attnkit']:.1f} | {t['sdpa'] / t['attnkit']:.2f} | {t['flex'] / t['attnkit']:.2f} |",
                          flush=True)
                q = k = v = None  # free this shape's inputs before the next one allocates its own
                _ = dens
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
