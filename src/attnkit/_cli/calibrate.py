"""``attnkit calibrate``: measure where attnkit's compiled kernel beats torch SDPA on this machine, and store it.

This module parses, calls :func:`attnkit._calibrate.calibrate` (or reads / deletes the stored table)
and prints a table: each measured point, each crossover (default and measured), where the file went
and how long it took.
"""

from __future__ import annotations

import argparse
import math
import os

__all__ = ["add_arguments", "run"]

MAX_BUDGET_S = 600.0


def _budget(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not 0 < x <= MAX_BUDGET_S:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, {MAX_BUDGET_S:g}], got {text!r}")
    return x


def _threads(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a thread count >= 1, got {text!r}")
    return n


def add_arguments(p):
    p.add_argument("--budget", type=_budget, default=2.0, metavar="SECONDS",
                   help="wall-time bound of the measurement (default 2; what it cannot measure in time keeps "
                        "its default)")
    p.add_argument("--threads", type=_threads, default=None,
                   help="torch thread count to measure at (default: torch's, i.e. OMP_NUM_THREADS or the cores); "
                        "the table is stored per thread count")
    p.add_argument("--backward", action="store_true",
                   help="measure forward+backward too (the kernel must win both); takes about twice the time")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    what.add_argument("--show", action="store_true",
                      help="print the table auto uses now (the stored one, or the defaults and why); measure nothing")
    what.add_argument("--reset", action="store_true",
                      help="delete the stored calibration files (auto goes back to the defaults); measure nothing")


def _fmt_ls(n: int) -> str:
    r = math.isqrt(n)
    return f"{r}²" if r * r == n else f"{n:,}"


def _choice(v, dtype: str) -> str:
    if v is None and dtype == "small_mask":  # today's rule: the kernel (its C pass reads the tile's bits)
        return "the compiled kernel (today's rule)"
    if v is None:  # today's rule: bf16, with or without gradients, on torch's kernel where the CPU multiplies
        from ..backends import native  # bf16 in hardware, else the kernel; fp16 on the kernel; bf16's forward on

        # the kernel where it multiplies bf16 on AMX tiles itself
        hw = native._torch_alone_multiplies_bf16() if dtype in ("bf16", "bf16_grad") else native._bf16_hardware()
        v = "torch" if (dtype.startswith("bf16") or dtype == "fp16_small") and hw else "kernel"
        return {"kernel": "the compiled kernel", "torch": "torch's kernel"}[v] + " (today's rule)"
    return {"kernel": "the compiled kernel", "torch": "torch's kernel"}[v]


def _order(v) -> str:
    if v == "blocked":
        return "register-blocked (as below 8 MB)"
    return "as learned on each call shape's first calls" + (" (today's rule)" if v is None else "")


def _by_case(c, dtype: str) -> str:
    """The measured choice for ``dtype``'s forward, per mask case where the causal and the no-mask points disagree
    (auto follows each for its own case: ``Crossovers.case_choice``)."""
    import torch

    dt = torch.bfloat16 if dtype == "bf16" else torch.float16
    causal, none = c.case_choice(dt, "causal"), c.case_choice(dt, "none")
    if causal and none and causal != none:
        return f"{_choice(causal, dtype)} causal, {_choice(none, dtype)} no mask"
    return _choice(c.bf16 if dtype == "bf16" else c.fp16, dtype)


def _verdict(p, margin: float) -> str:
    return "kernel" if p.ratio >= margin else "SDPA" if p.ratio <= 1 / margin else "tie"


def _print_table(c, defaults) -> None:
    from .. import _calibrate as C
    from ..backends.sdpa import DECODE_MAX_L, FEW_ROWS_GRAD_MIN_KEYS

    if c.points:
        print(f"{'case':<8}{'dtype':<10}{'L x S':>12}{'mode':>9}{'kernel ms':>11}{'SDPA ms':>10}"
              f"{'SDPA/kernel':>13}  faster  rounds")
        for p in c.points:
            print(f"{p.case:<8}{p.dtype:<10}{f'{p.L} x {p.S}':>12}{p.mode:>9}{p.kernel_ms:>11.3f}{p.sdpa_ms:>10.3f}"
                  f"{p.ratio:>13.2f}  {_verdict(p, C.WIN_MARGIN):<6}  {p.rounds:>6}")
        print(f"(a kernel less than {100 * (C.WIN_MARGIN - 1):.0f} % faster is a tie; a tie stays on SDPA)\n")
    if c.order_points:
        print(f"{'decode read order':<19}{'H/Hkv':>6}{'S':>6}{'D':>5}{'blocked ms':>12}{'memory ms':>11}"
              f"{'memory/blocked':>16}  faster   rounds")
        for o in c.order_points:
            faster = "blocked" if o.ratio >= C.WIN_MARGIN else "memory" if o.ratio <= 1 / C.WIN_MARGIN else "tie"
            print(f"{'one fp32 query row':<19}{f'{o.H}/{o.Hkv}':>6}{o.S:>6}{o.D:>5}{o.blocked_ms:>12.3f}"
                  f"{o.memory_ms:>11.3f}{o.ratio:>16.2f}  {faster:<7}  {o.rounds:>6}")
        print("(K and V of 32 MiB; register-blocked must be 3 % faster to replace today's rule: from 8 MB the order "
              "the kernel learns on each call shape's first calls, timing both)\n")
    rows = [("causal (L = S or top-left): kernel from min(L, S) >=", str(defaults.native_causal_min),
             str(c.native_causal_min)),
            ("no mask: kernel from L·S >=", _fmt_ls(defaults.native_dense_min_ls), _fmt_ls(c.native_dense_min_ls)),
            ("bf16 runs on", _choice(defaults.bf16, "bf16"), _by_case(c, "bf16")),
            ("fp16 runs on", _choice(defaults.fp16, "fp16"), _choice(c.fp16, "fp16")),
            ("bf16 with gradients (where SDPA would run it) on", _choice(defaults.bf16_grad, "bf16_grad"),
             _choice(c.bf16_grad, "bf16_grad")),
            ("bf16 below the fp32 crossovers (no gradients) on", _choice(defaults.bf16_small, "bf16_small"),
             _choice(c.bf16_small, "bf16_small")),
            ("fp16 below the fp32 crossovers (no gradients) on", _choice(defaults.fp16_small, "fp16_small"),
             _choice(c.fp16_small, "fp16_small")),
            (f"fp32 with grads, <= {DECODE_MAX_L} query rows, >= {FEW_ROWS_GRAD_MIN_KEYS} keys, on",
             _choice(defaults.few_rows_grad, "few_rows_grad"), _choice(c.few_rows_grad, "few_rows_grad")),
            ("a bool mask of one 64 x 64 tile (no gradients) on", _choice(defaults.small_mask, "small_mask"),
             _choice(c.small_mask, "small_mask")),
            ("the decode entry reads K and V of >= 8 MB", _order(defaults.decode_order), _order(c.decode_order))]
    head = "measured" if c.calibrated else "in use"
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len("default"), *(len(r[1]) for r in rows))
    print(f"{'crossover':<{w0}}  {'default':<{w1}}  {head}")
    for name, d, m in rows:
        print(f"{name:<{w0}}  {d:<{w1}}  {m}")


def _load_note() -> str | None:
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = os.cpu_count() or 1
    if load > 0.5 * cores:
        return (f"note: this machine was busy (load {load:.1f} on {cores} cores): other work shares the cores, "
                "so these times include waiting; calibrate again when it is quiet")
    return None


def run(args) -> int:
    from .. import _calibrate as C

    defaults = C.Crossovers()
    if args.reset:
        gone = C.reset()
        where = C._home(C.cache_dir())
        print(f"deleted {len(gone)} calibration file{'s' if len(gone) != 1 else ''} from {where}"
              + ("" if gone else " (there were none)") + "; auto uses the defaults until the next calibration")
        return 0
    if args.show:
        C.forget()
        c = C.crossovers(args.threads)
        print(f"attnkit calibrate --show: {C._threads(args.threads or C.machine_key()['threads'])}")
        print(f"table in use: {c.source}\n")
        _print_table(c, defaults)
        if c.calibrated and c.elapsed_s is not None:
            print(f"\nthat calibration took {c.elapsed_s:.2f} s")
        path = C.cache_path(args.threads)
        if not c.calibrated and os.environ.get(C.ENV_SWITCH, "").strip().lower() in C._OFF and path.is_file():
            print(f"\nnote: a calibration file is stored ({C._home(path)}); {C.ENV_SWITCH}=off here: auto ignores it "
                  "until that is unset")
        return 0
    key = C.machine_key(args.threads)
    busy = _load_note()
    print(f"attnkit calibrate: {key['cpu']}, torch {key['torch']}, {C._threads(key['threads'])}, "
          f"budget {args.budget:g} s{', forward+backward' if args.backward else ''}", flush=True)
    c = C.calibrate(args.budget, threads=args.threads, write=not args.dry_run, backward=args.backward)
    print()
    _print_table(c, defaults)
    print()
    took = f"took {c.elapsed_s:.2f} s" if c.elapsed_s is not None else "took ?"
    if c.failure is not None:
        print(f"{took}; {c.source}; nothing written")
        return 130 if c.failure == "interrupted" else 1
    kept = c.source.partition("; defaults kept for ")[2]
    if kept:
        print(f"defaults kept for {kept}")
    if args.dry_run:
        print(f"{took}; dry run: nothing written (it would go to {C._home(C.cache_path(args.threads))})")
    elif c.path is None:  # measured, not stored: a script's `attnkit calibrate && ...` must not read success
        print(f"{took}; {c.source.partition(' (')[2].partition(')')[0]}")
        return 1
    else:
        print(f"{took}; stored in {C._home(c.path)}")
        if os.environ.get(C.ENV_SWITCH, "").strip().lower() in C._OFF:
            print(f"note: {C.ENV_SWITCH}=off here: auto ignores the file until that is unset")
    if busy:
        print(busy)
    return 0
