"""attnkit's compiled CPU kernel (issue 20) against its goals, its peers and the machine's GEMM roofline.

    OMP_NUM_THREADS=2 python benchmarks/kernel.py                 # the goal table (~2 min on 2 cores)
    OMP_NUM_THREADS=2 python benchmarks/kernel.py --flex          # + compiled FlexAttention forward
    OMP_NUM_THREADS=2 python benchmarks/kernel.py --dtype bf16 --cases dense,causal   # the kernel in bf16
    OMP_NUM_THREADS=2 python benchmarks/kernel.py --json out.json --plot roofline.png
    python benchmarks/kernel.py --replot out.json --plot roofline.png   # the picture from saved results

Shapes: B = 1, H = 8, D = 64, fp32 (the suite behind BENCHMARKS.md). Peers, measured in one run,
interleaved round by round (the median of ``--rounds`` rounds is reported):

* ``sdpa``   torch's ``scaled_dot_product_attention``: no mask (dense), ``is_causal``, or a dense
             bool mask (window, document);
* ``native`` ``attnkit.attention(..., backend="tiled")``: the compiled kernel (``attnkit.dispatch``
             names it; the script stops if another worker runs);
* ``before`` the same call with the compiled kernel switched off (``tiled.NATIVE = False``): torch's
             private flash kernel per run of keys, merged by log-sum-exp: attnkit before this kernel;
* ``flex``   ``torch.compile(flex_attention)`` with a BlockMask (forward, ``--flex``).

FLOPs: forward 4·B·H·D·(visible (query, key) pairs) — the *useful* work, so a kernel that computes
masked-out scores gets no credit for them; forward + backward × 3.5 (the backward is 2.5× the
forward's GEMM work). "of SDPA dense" divides by SDPA's own dense GFLOP/s at L = 4096 in the same run.
The roofline is one ``torch.mm`` of 2048 × 2048 fp32 matrices (2·n³ FLOP) at the same thread count.
``--dtype bf16`` feeds bf16 to every peer; the compiled kernel computes in fp32 and ``auto`` keeps bf16 on
torch's kernel where the CPU multiplies bf16 in hardware, so there the kernel is forced (this measures
that rule).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks as M
from attnkit.backends import _native, tiled
from attnkit.backends import native as native_kernel

B, H, D = 1, 8, 64


def visible_pairs(mask, L: int) -> int:
    if mask is None:
        return L * L
    lo, hi = mask.row_intervals(1, L, L)
    return int((hi.long() - lo.long()).clamp(min=0).sum())


def cases():
    docs = torch.arange(16384) // 1024  # 16 documents
    return [
        ("dense", 4096, None, "none"),
        ("causal", 4096, M.causal(), "causal"),
        ("window 256", 16384, M.sliding_window(256), "dense"),
        ("document x16", 16384, M.document(docs), "dense"),
    ]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def peers_for(name, L, mask, sdpa_mask, mode, flex, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(dtype).requires_grad_(mode == "fwdbwd") for _ in range(3))
    go = torch.randn(B, H, L, D, generator=g).to(dtype)
    dense = None
    if sdpa_mask == "dense":
        dense = mask.materialize(1, 1, L, L)

    def run(f):
        def fwd():
            with torch.no_grad():
                return f()

        return fwd if mode == "fwd" else (lambda: f().backward(go))

    def sdpa():
        if sdpa_mask == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    def native():
        # bf16: the kernel itself, even where auto avoids it
        saved, native_kernel._BF16_HW = native_kernel._BF16_HW, False
        try:
            return attnkit.attention(q, k, v, mask=mask, backend="tiled")
        finally:
            native_kernel._BF16_HW = saved

    def before():
        saved, tiled.NATIVE = tiled.NATIVE, False
        try:
            return attnkit.attention(q, k, v, mask=mask, backend="tiled")
        finally:
            tiled.NATIVE = saved

    saved, native_kernel._BF16_HW = native_kernel._BF16_HW, False
    try:
        d = attnkit.dispatch(q, k, v, mask=mask, backend="tiled")
    finally:
        native_kernel._BF16_HW = saved
    if d.worker != "native":
        raise SystemExit(f"{name}: the compiled kernel does not run here ({d.worker}: {d.worker_reason})")
    out = {"sdpa": run(sdpa), "native": run(native), "before": run(before)}
    if flex and mode == "fwd":
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.reset()
        compiled = torch.compile(flex_attention, dynamic=False)
        bm = None if mask is None else attnkit.create_block_mask(mask.bind(L, L), None, None, L, L, device="cpu")
        out["flex"] = run(lambda: compiled(q, k, v, block_mask=bm))
    return out


def gemm_gflops(rounds: int) -> float:
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    return 2 * n ** 3 / min(_timed(lambda: torch.mm(a, b)) for _ in range(rounds)) / 1e9


def plot(res: dict, path: str) -> None:
    """Useful GFLOP/s of each peer on each case, under the machine's GEMM roofline (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    labels = list(dict.fromkeys(f"{r['case']}\nL={r['L']} {r['mode']}" for r in rows))
    peers = [p for p in ("sdpa", "before", "native", "flex") if any(r["peer"] == p for r in rows)]
    names = {"sdpa": "torch SDPA (dense mask / is_causal)", "before": "attnkit before (torch's kernel per run)",
             "native": "attnkit's compiled kernel", "flex": "compiled FlexAttention (forward)"}
    colors = {"sdpa": "#9e9e9e", "before": "#90caf9", "native": "#1565c0", "flex": "#ffb74d"}
    fig, ax = plt.subplots(figsize=(12, 5.2), dpi=110)
    width = 0.8 / len(peers)
    for n, p in enumerate(peers):
        xs, ys = [], []
        for i, lab in enumerate(labels):
            hit = [r for r in rows if f"{r['case']}\nL={r['L']} {r['mode']}" == lab and r["peer"] == p]
            if hit:
                xs.append(i + (n - (len(peers) - 1) / 2) * width)
                ys.append(hit[0]["gflops"])
        ax.bar(xs, ys, width, label=names[p], color=colors[p])
    roof = res["roofline_gflops"]
    ax.axhline(roof, color="#c62828", linestyle="--", linewidth=1.2)
    ax.text(-0.45, roof * 1.01, f"GEMM roofline: {roof:.0f} GFLOP/s (one 2048³ fp32 torch.mm)", color="#c62828",
            va="bottom", ha="left", fontsize=9)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("useful GFLOP/s (masked-out work not counted)")
    ax.set_title(f"attention on the CPU, fp32, {res['threads']} threads, B=1 H=8 D=64: "
                 "work the mask keeps, per second", fontsize=11)
    ax.set_ylim(0, roof * 1.45)
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--plot", help="also draw the GFLOP/s of every case and peer under the roofline (PNG)")
    ap.add_argument("--replot", metavar="JSON", help="only draw --plot from results saved by --json")
    ap.add_argument("--flex", action="store_true", help="also compiled FlexAttention (forward; compiles per case)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--cases", default="dense,causal,window,document",
                    help="comma list from dense,causal,window,document")
    a = ap.parse_args()
    if a.replot:
        with open(a.replot) as f:
            plot(json.load(f), a.plot or "roofline.png")
        return
    print(f"{_native.status()}; torch {torch.__version__}, {torch.get_num_threads()} threads, {a.dtype}")
    roof = gemm_gflops(a.rounds)
    print(f"machine: one 2048^3 fp32 torch.mm = {roof:.0f} GFLOP/s (the roofline)\n")
    rows = []
    sdpa_dense = {}
    print(f"{'case':<14}{'L':>7} {'mode':<7}{'peer':<8}{'ms':>9}{'GFLOP/s':>9}{'of SDPA dense':>15}{'of GEMM':>9}"
          f"{'vs sdpa':>9}{'vs before':>10}")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    wanted = {c.strip() for c in a.cases.split(",")}
    for name, L, mask, sdpa_mask in cases():
        if name.split()[0] not in wanted:
            continue
        for mode in ("fwd", "fwdbwd"):
            fns = peers_for(name, L, mask, sdpa_mask, mode, a.flex, dtype)
            for f in fns.values():  # warm-up (flex: compiles here)
                f()
            times = {p: [] for p in fns}
            for _ in range(a.rounds):
                for p, f in fns.items():
                    times[p].append(_timed(f))
            flop = 4 * B * H * D * visible_pairs(mask, L) * (3.5 if mode == "fwdbwd" else 1.0)
            med = {p: statistics.median(t) for p, t in times.items()}
            if name == "dense":
                sdpa_dense[mode] = flop / med["sdpa"] / 1e9
            for p, t in med.items():
                gf = flop / t / 1e9
                row = {"case": name, "L": L, "mode": mode, "peer": p, "ms": t * 1e3, "gflops": gf,
                       "of_sdpa_dense": gf / sdpa_dense.get(mode, float("nan")), "of_gemm": gf / roof,
                       "speedup_vs_sdpa": med["sdpa"] / t, "speedup_vs_before": med["before"] / t}
                rows.append(row)
                print(f"{name:<14}{L:>7} {mode:<7}{p:<8}{t * 1e3:>9.1f}{gf:>9.0f}{row['of_sdpa_dense']:>14.0%}"
                      f"{row['of_gemm']:>9.0%}{row['speedup_vs_sdpa']:>8.2f}x{row['speedup_vs_before']:>9.2f}x")
    res = {"roofline_gflops": roof, "threads": torch.get_num_threads(), "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.plot:
        plot(res, a.plot)


if __name__ == "__main__":
    main()
