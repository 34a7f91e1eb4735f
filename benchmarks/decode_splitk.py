"""Long-cache decode on the compiled kernel (split-K, GQA packed) vs torch SDPA vs reading K and V once.

    OMP_NUM_THREADS=2 python benchmarks/decode_splitk.py [--repeats 15] [--S 65536]

One query row (B = 1, L = 1, D = 128) over S cached keys: MHA (H = Hkv = 8) and GQA (H = 32, Hkv = 8), fp32 and
bf16 caches. Three calls, timed interleaved (one of each in turn), medians:

* kernel: ``attnkit.backends._native.decode`` (the decode entry: the g heads of a kv head packed as rows,
  keys split into chunks across the threads, exact lse merge);
* SDPA: ``F.scaled_dot_product_attention(q, k, v, enable_gqa=...)`` on the same tensors;
* read: ``k.sum()`` then ``v.sum()`` — reading K and V once, the floor of a memory-bound decode step.

"kernel / read" is the goal's ratio (<= 1.25); GB/s is K and V's bytes over each call's time.

``--order blocked|memory``: the decode entry's read order forced (default: this machine's calibration, ``attnkit
calibrate``, else the rule: register-blocked below 8 MB of K and V, from 8 MB the order the kernel learns on a call
shape's first calls, timing both). ``--no-learn``: the rule without learning (memory order from 8 MB).

``--user``: two more tables, MHA 8/8 and GQA 32/8 fp32, the same step through ``attnkit.attention`` as a user
writes it: the built-in ``masks.causal()``, the same mask as a ``mask_mod`` (``kv <= q + S - 1``: the query is the last
position), a soft-cap ``score_mod`` (built-in, and as a user's lambda: a traced program) and ALiBi (its slopes), all
on the decode entry, and SDPA's plain step for scale (it runs neither score_mod), each / the read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from _interleave import cpu_name

from attnkit.backends import _native


def _bench(fns, repeats):
    # warm-up: the kernel's first calls of a shape learn its read order (one untimed, six alternating the two orders:
    # csrc/attn_common.h); the timed calls are the steady state a decode loop runs in after them
    for f in fns:
        for _ in range(8 if f is fns[0] else 1):
            f()
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            f()
            ts[i].append(time.perf_counter() - t)
    return [statistics.median(x) for x in ts]


def _case(name, H, Hkv, S, D, dtype, repeats, g) -> str:
    q = torch.randn(1, H, 1, D, generator=g).to(dtype)
    k = torch.randn(1, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(1, Hkv, S, D, generator=g).to(dtype)
    lo = torch.zeros(1, 1, dtype=torch.int32)
    hi = torch.full((1, 1), S, dtype=torch.int32)
    scale = D ** -0.5
    ours = lambda: _native.decode(q, k, v, lo, hi, scale)  # noqa: E731
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hkv)  # noqa: E731
    read = lambda: (k.sum(), v.sum())  # noqa: E731
    t_ours, t_sdpa, t_read = _bench([ours, sdpa, read], repeats)
    nbytes = 2 * Hkv * S * D * k.element_size()
    return (f"| {name} | {str(dtype).replace('torch.', '')} | {t_ours * 1e3:.2f} | {t_sdpa * 1e3:.2f} | "
            f"{t_read * 1e3:.2f} | {t_ours / t_read:.2f} | {t_sdpa / t_read:.2f} | "
            f"{nbytes / t_ours / 1e9:.1f} | {nbytes / t_read / 1e9:.1f} |")


def _user_rows(S: int, D: int, repeats: int, g, H: int = 8, Hkv: int = 8) -> None:
    import attnkit
    from attnkit import masks, score_mods

    q = torch.randn(1, H, 1, D, generator=g)
    k = torch.randn(1, Hkv, S, D, generator=g)
    v = torch.randn(1, Hkv, S, D, generator=g)
    last = S - 1
    alibi = score_mods.alibi(attnkit.positional.alibi_slopes(H))
    calls = {
        "built-in `masks.causal()`": lambda: attnkit.attention(q, k, v, mask=masks.causal()),
        "`mask_mod`: `kv <= q + S - 1`": lambda: attnkit.attention(q, k, v, mask=lambda b, h, i, j: j <= i + last),
        "`masks.causal()` + `score_mods.softcap(30)`":
            lambda: attnkit.attention(q, k, v, mask=masks.causal(), score_mod=score_mods.softcap(30.0)),
        "`masks.causal()` + a soft cap as a lambda": lambda: attnkit.attention(
            q, k, v, mask=masks.causal(), score_mod=lambda s, b, h, i, j: 30.0 * torch.tanh(s / 30.0)),
        "`masks.causal()` + `score_mods.alibi(slopes)`":
            lambda: attnkit.attention(q, k, v, mask=masks.causal(), score_mod=alibi),
        "SDPA, `is_causal=False` (its plain step)": lambda: F.scaled_dot_product_attention(q, k, v,
                                                                                          enable_gqa=H != Hkv),
    }
    times = _bench([*calls.values(), lambda: (k.sum(), v.sum())], repeats)
    kind = "MHA" if H == Hkv else "GQA"
    print(f"\n| {kind} {H}/{Hkv} fp32, through `attnkit.attention` | ms | / read |\n|---|---|---|")
    for name, t in zip(calls, times[:-1], strict=True):
        print(f"| {name} | {t * 1e3:.2f} | {t / times[-1]:.2f} |")
    print(f"| read K+V | {times[-1] * 1e3:.2f} | 1.00 |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--S", type=int, default=65536)
    ap.add_argument("--user", action="store_true", help="also the step through attnkit.attention: a built-in mask, "
                    "the same as a mask_mod, score_mods (soft cap, ALiBi)")
    ap.add_argument("--order", choices=("auto", "blocked", "memory"), default="auto",
                    help="the decode entry's read order: as its records say (auto: this machine's calibration, else "
                         "the rule: from 8 MB of K and V the order learned on a call shape's first calls), "
                         "register-blocked, or memory order")
    ap.add_argument("--no-learn", action="store_true", help="the rule without learning: memory order from 8 MB of K "
                    "and V (measured faster on an AMD EPYC)")
    a = ap.parse_args(argv)
    _native._require().ak_set_decode_order({"auto": -1, "blocked": 0, "memory": 1}[a.order])  # (as the tests do)
    _native.set_read_order_learning(not a.no_learn, forget=True)
    threads = int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))
    torch.set_num_threads(threads)
    S, D = a.S, 128
    order = a.order if a.order != "auto" else "auto: " + _native.read_order(threads)
    if order == "auto: rule":
        order += (" (memory order from 8 MB)" if a.no_learn
                  else " (from 8 MB the order learned on a shape's first calls)")
    print(f"{cpu_name()}, {_native.status()}, {threads} threads, B = 1, L = 1, D = {D}, S = {S}, read order "
          f"{order}, {a.repeats} interleaved repeats, medians\n")
    print("| case | dtype | kernel ms | SDPA ms | read K+V ms | kernel / read | SDPA / read | kernel GB/s | "
          "read GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, H, Hkv in (("MHA 8/8", 8, 8), ("GQA 32/8", 32, 8)):
        for dtype in (torch.float32, torch.bfloat16):
            print(_case(name, H, Hkv, S, D, dtype, a.repeats, g), flush=True)
    shapes, memory = _native.learned_read_orders()
    if shapes:
        print(f"\nread orders learned: {shapes} call shapes, {memory} in memory order, "
              f"{shapes - memory} register-blocked")
    if a.user:
        for H, Hkv in ((8, 8), (32, 8)):
            _user_rows(S, D, a.repeats, g, H, Hkv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
