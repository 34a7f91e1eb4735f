"""What a bf16 call with gradients pays on the ``sdpa-fp32`` row (torch SDPA in fp32 on widened copies), by part.

    OMP_NUM_THREADS=2 python benchmarks/widen_costs.py [--rounds 300] [--L 64]

No mask, B = 1, H = 8, L = S, D = 64 (the row of ``benchmarks/bf16_small.py`` that stays above 1 with gradients).
torch's CPU flash kernels called directly (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward), no autograd, timed in turns (one call of each per round, after a warm-up), medians:

* ``fp32 held``: forward + backward on fp32 q, k, v, dout held across calls (what an fp32 call runs);
* ``bf16 widened``: the same on fp32 copies of bf16 q, k, v, dout made per call, the output and dq, dk, dv rounded
  back to bf16 (the eight casts of the ``sdpa-fp32`` row, without its autograd nodes);
* ``casts alone``: the eight casts of the same sizes, nothing else.

"widened − held − casts" is what the kernels lose on fresh copies. FLOPs of one call: 4·B·H·L·S·D forward,
10·B·H·L·S·D backward (8.4 + 21 MFLOP at L = 64): these calls are bound by fixed costs and memory, not arithmetic.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _interleave import cpu_name, rounds_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--L", type=int, default=64)
    a = ap.parse_args()
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    f, b = torch.float32, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(1, 8, a.L, 64, generator=g) for _ in range(4))
    qb, kb, vb, gb = (x.to(b) for x in (q, k, v, go))

    def held():
        out, lse = fwd(q, k, v, 0.0, False)
        bwd(go, q, k, v, out, lse, 0.0, False)

    def widened():
        qf, kf, vf = qb.to(f), kb.to(f), vb.to(f)
        out, lse = fwd(qf, kf, vf, 0.0, False)
        out.to(b)
        for d in bwd(gb.to(f), qf, kf, vf, out, lse, 0.0, False):
            d.to(b)

    def casts():
        for x in (qb, kb, vb, gb):
            x.to(f)
        for x in (q, k, v, go):
            x.to(b)

    fns = {"fp32 held": held, "bf16 widened": widened, "casts alone": casts}
    runs = rounds_ms(fns, a.rounds)
    med = {n: statistics.median(t) * 1e3 for n, t in runs.items()}
    print(f"{cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads, L = S = {a.L}, "
          f"{a.rounds} rounds, medians")
    print("| part | µs |\n|---|---|")
    for n, t in med.items():
        print(f"| {n} | {t:.0f} |")
    lost = med["bf16 widened"] - med["fp32 held"] - med["casts alone"]
    print(f"| widened − held − casts | {lost:.0f} |")


if __name__ == "__main__":
    main()
