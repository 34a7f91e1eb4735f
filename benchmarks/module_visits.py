"""Which attnkit modules one ``attention()`` call enters (its Python frames), for a repeated call of each kind.

    OMP_NUM_THREADS=1 python benchmarks/module_visits.py

Each call is made twice first (the first call of a signature takes the full path and remembers the decision:
``attnkit._fast``), then a third time under ``sys.setprofile``, which records the module of every Python frame
entered. A call the replay covers enters ``api``, ``_fast`` and the chosen kernel's modules; one it does not cover
walks ``_request``, ``_dispatch`` and the device's table of kernels.
"""

from __future__ import annotations

import sys

import torch

import attnkit
from attnkit import masks as M


def visits(f) -> list[str]:
    f()
    f()
    mods: list[str] = []

    def prof(frame, event, arg):
        if event == "call":
            m = frame.f_globals.get("__name__", "")
            if m.startswith("attnkit") and m not in mods:
                mods.append(m)

    sys.setprofile(prof)
    try:
        f()
    finally:
        sys.setprofile(None)
    return mods


def main() -> None:
    torch.manual_seed(0)
    q = k = v = torch.randn(1, 8, 1024, 64)
    qd, kd = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 2048, 64)
    qs = torch.randn(1, 8, 64, 64)
    qg = torch.randn(1, 8, 1024, 64, requires_grad=True)
    window, doc = M.sliding_window(128), M.document(torch.arange(1024) // 300)
    cases = {
        "decode, causal, GQA 8/2 (no gradient)": lambda: attnkit.attention(qd, kd, kd, causal=True),
        "prefill 64, causal": lambda: attnkit.attention(qs, qs, qs, causal=True),
        "causal, L = 1024": lambda: attnkit.attention(q, k, v, causal=True),
        "causal, L = 1024, q wants a gradient": lambda: attnkit.attention(qg, k, v, causal=True),
        "sliding window 128, L = 1024": lambda: attnkit.attention(q, k, v, mask=window),
        "document, L = 1024 (the same mask object)": lambda: attnkit.attention(q, k, v, mask=doc),
        "a mask_mod, L = 1024": lambda: attnkit.attention(q, k, v, mask=lambda b, h, i, j: j <= i),
        "a score_mod + causal, L = 1024": lambda: attnkit.attention(q, k, v, causal=True,
                                                                    score_mod=lambda s, b, h, i, j: s * 0.5),
    }
    for name, f in cases.items():
        mods = visits(f)
        print(f"{name}: {len(mods)} modules: {', '.join(m.replace('attnkit.', '') for m in mods)}")


if __name__ == "__main__":
    main()
