"""What ``attnkit.attention`` adds over calling torch SDPA directly, on the small shapes models
run at every step, with the cost broken down (validation, dispatch, backend).

    python benchmarks/overhead.py [--repeats 2000]

``auto`` reads this machine's calibration where there is one (``attnkit calibrate``; the first line printed says
which table decided): at these sizes it decides between torch's kernel and attnkit's compiled kernel.

Each row: which path answered (``fast``: ``attnkit._fast``, whose contract covers the call;
``full``: validation, dispatch, backend), median µs of torch SDPA called directly with the
equivalent arguments, of ``attnkit.attention(..., backend="auto")``, the difference, and for
the full path that difference split into ``make_request`` (the one validation point),
``decide`` (the dispatch decision) and the rest (the backend's own Python around the kernel); for the fast path, the
cost of its own Python before the prepared call: the call's signature and its lookup.
Interleaved: the callables are timed in turns, one call each, so machine noise hits all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import attnkit
from attnkit import _calibrate, _dispatch, _fast, _request, masks

CASES = [  # (name, B, H, Hkv, L, S, D, attnkit kwargs, SDPA equivalent kwargs)
    ("decode L=1 S=128 GQA causal", 1, 8, 2, 1, 128, 64, dict(causal=True), dict()),
    ("decode L=1 S=2048 GQA causal", 1, 8, 2, 1, 2048, 64, dict(causal=True), dict()),
    ("decode L=4 S=2048 GQA causal", 1, 8, 2, 4, 2048, 64, dict(causal=True), "bottom_right"),
    ("decode L=16 S=2048 GQA window 512", 1, 8, 2, 16, 2048, 64, dict(mask=masks.sliding_window(512)), "window512"),
    ("decode L=1 S=2048 GQA float bias", 1, 8, 2, 1, 2048, 64, dict(mask="bias"), "bias"),
    ("L=S=64 random bool mask", 1, 8, 8, 64, 64, 64, dict(mask="bool"), "bool"),
    ("prefill L=S=64 causal", 2, 4, 4, 64, 64, 16, dict(causal=True), dict(is_causal=True)),
    ("prefill L=S=200 GQA causal", 1, 4, 2, 200, 200, 64, dict(causal=True), dict(is_causal=True)),
    ("prefill L=S=512 causal", 1, 8, 8, 512, 512, 64, dict(causal=True), dict(is_causal=True)),
]


def _sdpa_kwargs(spec, L, S, bias=None):
    if spec in ("bias", "bool"):
        return dict(attn_mask=bias)
    if spec == "bottom_right":
        return dict(attn_mask=masks.causal().materialize(1, 1, L, S))
    if spec == "window512":
        return dict(attn_mask=masks.sliding_window(512).materialize(1, 1, L, S))
    return spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2000)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    print(f"auto's table: {_calibrate.crossovers().source}\n")
    print("| case | path | SDPA µs | attnkit µs | added µs | validate µs | decide µs | backend + rest µs | "
          "signature + lookup µs | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, B, H, Hkv, L, S, D, kw, spec in CASES:
        q, k, v = torch.randn(B, H, L, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
        bias = torch.randn(1, 1, L, S)
        if kw.get("mask") == "bool":
            bias = (bias > -1.0) | (torch.arange(S) == 0)  # every tile partial: auto sends it to SDPA
        if kw.get("mask") in ("bias", "bool"):
            kw = dict(kw, mask=bias)
        skw = _sdpa_kwargs(spec, L, S, bias)  # the dense mask is built once, outside the timing
        full = dict(mask=None, causal=False, scale=None, score_mod=None, dropout_p=0.0, return_lse=False,
                    backend="auto")
        full.update(kw)
        fns = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hkv, **skw),
            "attnkit": lambda: attnkit.attention(q, k, v, **kw),
            "validate": lambda: _request.make_request(q, k, v, **full),
        }
        req = _request.make_request(q, k, v, **full)
        fns["decide"] = lambda: _dispatch.decide(req, "auto")
        mask_kw, causal_kw = kw.get("mask"), kw.get("causal", False)
        # the fast path's own Python: the call's signature and its lookup (what a replayed call adds to its kernel)
        fns["lookup"] = lambda: _fast._REPLAY.get(_fast._signature(q, k, v, mask_kw, causal_kw, None))
        ts = {n: [] for n in fns}
        with torch.no_grad():
            for f in fns.values():
                for _ in range(50):
                    f()
            for _ in range(a.repeats):
                for n, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    ts[n].append(time.perf_counter() - t0)
        m = {n: statistics.median(x) * 1e6 for n, x in ts.items()}
        added = m["attnkit"] - m["sdpa"]
        with torch.no_grad():
            fast = _fast.attention(q, k, v, kw.get("mask"), kw.get("causal", False), None) is not None
        if fast:  # validate / decide are the full path's steps: this call skips them (its own: signature + lookup)
            cols = f"fast | {m['sdpa']:.1f} | {m['attnkit']:.1f} | {added:.1f} | — | — | — | {m['lookup']:.1f} |"
        else:
            rest = added - m["validate"] - m["decide"]
            cols = (f"full | {m['sdpa']:.1f} | {m['attnkit']:.1f} | {added:.1f} | {m['validate']:.1f} | "
                    f"{m['decide']:.1f} | {rest:.1f} | — |")
        print(f"| {name} | {cols} {m['sdpa'] / m['attnkit']:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
