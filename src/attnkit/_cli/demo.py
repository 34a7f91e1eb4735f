"""``attnkit demo``: a three-part demo in the terminal — the 3-token example step by step, a real
model's attention, a speed table. (The *tour* is the notebook ``examples/tour.ipynb``.)

What ``make demo`` runs on a fresh machine. Each part stands alone: without the
model extra the second part says how to install it and the others still run. An option
the user gave that cannot be honoured (``--model`` not a model directory, ``--out`` not
writable) is refused before anything runs: exit status 2, one line.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["add_arguments", "run"]

# The 3-token example (also `attnkit explain`'s default).
SEED_Q = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
SEED_K = [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]]
SEED_V = [[10.0, 0.0], [0.0, 10.0], [5.0, 5.0]]


def add_arguments(p):
    p.add_argument("--out", default="attnkit-out", metavar="DIR",
                   help="where the model pictures go (default ./attnkit-out)")
    p.add_argument("--quick", action="store_true",
                   help="a smaller, shorter speed table (L=256, 2 runs) for smoke tests")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a Hugging Face model directory (config.json + weights) for part 2 (default: the bundled "
                        "all-MiniLM-L6-v2)")


def _check_options(args):
    """Refuse an option the user gave that part 2 could not use, before part 1 prints anything."""
    from . import CLIError, check_out_dir

    if args.model is not None:
        from ..integrations.minilm import ModelUnavailable, check_model_dir

        try:
            check_model_dir(args.model)
        except ModelUnavailable as e:
            raise CLIError(f"--model: {e}") from None
    check_out_dir("--out", args.out)


def _step(n, title):
    # Progress on stderr says where a long run is when stdout goes to a file or a pipe; in a terminal the
    # heading on stdout already says it (both streams land on the same screen: it would show twice).
    if not sys.stdout.isatty():
        print(f"[{n}/3] {title}", file=sys.stderr, flush=True)
    print(f"\n━━ {n}. {title} " + "━" * max(0, 70 - len(title)), flush=True)


def _explain_part():
    import numpy as np

    import attnkit

    q, k, v = (np.array(x) for x in (SEED_Q, SEED_K, SEED_V))
    print("Q =", q.tolist(), "  K =", k.tolist(), "  V =", v.tolist(), "  (d_k = 2, scale = 1/√2)\n")
    t = attnkit.explain(q, k, v)  # 2-D in: (L, S) weights, (L, Dv) output
    print(t)
    row, w, s = t.output[0], t.weights[0], t.scores[0]
    print(f"\nFirst output row: [{row[0]:.1f}, {row[1]:.1f}] (weights {', '.join(f'{x:.4f}' for x in w)}).")
    why = (f"q0 scores k0 and k1 equally ({s[0]:g} each), so their weights are equal and the row is exactly "
           f"[{row[0]:.1f}, {row[1]:.1f}]" if s[0] == s[1] else f"the row is [{row[0]:.4f}, {row[1]:.4f}]")
    print(f"A known misprint of this example gives [5.3, 4.2] for this row; that is wrong: {why}.")


def _model_part(out, model_path):
    from ..apps import ShowDependencyError, ShowInputError, show
    from ..integrations.minilm import ModelUnavailable

    try:
        res = show(None, out=out, model_path=model_path)
    except (ModelUnavailable, ShowDependencyError) as e:  # no model extra (or no matplotlib): say how to install
        print(f"skipped: {e}")
        return
    except ShowInputError as e:  # --model or --out given but unusable (past _check_options): a user error
        from . import CLIError

        raise CLIError(f"{'--model' if e.param == 'model_path' else '--' + e.param}: {e.message}") from None
    print(res.table)
    print(f"\nwrote {res.png}\nwrote {res.html}  (offline page: pick layer and head, hover a token)")


def _naive(q, k, v, allowed, scale):
    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, L, S)
    s = s.masked_fill(~allowed, float("-inf"))
    return s.softmax(-1) @ v


def _speed_part(quick):
    import torch
    import torch.nn.functional as F

    import attnkit
    from attnkit import masks

    B, H, L, D = (1, 8, 256, 64) if quick else (1, 8, 1024, 64)
    runs = 2 if quick else 5
    window = L // 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    scale = D ** -0.5
    cases = []
    for name, mask in (("causal", masks.causal()), (f"sliding window {window}", masks.sliding_window(window))):
        dense = mask.materialize(1, 1, L, L)  # (1, 1, L, S) bool, for naive and SDPA
        is_causal = name == "causal"
        def naive(dense=dense):
            return _naive(q, k, v, dense, scale)

        def sdpa(dense=dense, is_causal=is_causal):
            if is_causal:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

        def ours(mask=mask):
            return attnkit.attention(q, k, v, mask=mask)

        impls: dict[str, Callable[[], torch.Tensor]] = {"naive": naive, "torch SDPA": sdpa, "attnkit": ours}
        cases.append((name, mask, impls))
    print(f"B={B}, H={H}, L=S={L}, D={D}, float32, forward only; median of {runs} interleaved runs after a warm-up.")
    print("A quick indicative timing on this machine, not a benchmark (see `attnkit bench` / benchmarks/).\n")
    rows = []
    with torch.no_grad():
        for name, mask, impls in cases:
            ref = impls["naive"]()
            for f in impls.values():  # warm-up, and every implementation must agree
                err = (f() - ref).abs().max().item()
                if not err < 1e-4:  # a speed table of wrong answers would be worse than none
                    raise RuntimeError(f"{name}: implementations disagree by {err:.3g}; please report this")
            times: dict[str, list[float]] = {n: [] for n in impls}
            for _ in range(runs):
                for n, f in impls.items():
                    t0 = time.perf_counter()
                    f()
                    times[n].append(time.perf_counter() - t0)
            med = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
            backend = attnkit.dispatch(q, k, v, mask=mask).backend
            rows.append((name, med, backend))
    w = max(len(r[0]) for r in rows)
    print(f"{'mask':<{w}} │ {'naive':>9} │ {'torch SDPA':>10} │ {'attnkit':>9} │ attnkit ran")
    print("─" * w + "─┼─" + "─" * 9 + "─┼─" + "─" * 10 + "─┼─" + "─" * 9 + "─┼─" + "─" * 12)
    for name, med, backend in rows:
        print(f"{name:<{w}} │ {med['naive']:7.1f}ms │ {med['torch SDPA']:8.1f}ms │ {med['attnkit']:7.1f}ms │ {backend}")


def run(args) -> int:
    _check_options(args)
    t0 = time.perf_counter()
    _step(1, "Attention step by step on the 3-token example (attnkit.explain)")
    _explain_part()
    _step(2, "A real model's attention: all-MiniLM-L6-v2 running on attnkit (attnkit show)")
    _model_part(args.out, args.model)
    _step(3, "Speed: naive vs torch SDPA vs attnkit (quick indicative timing)")
    _speed_part(args.quick)
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0
