"""``attnkit bench``: parse the options, print an estimate, run :mod:`attnkit.bench`, print the table.

Writes files only where asked (``--json PATH``, ``--markdown PATH``); by default it
prints the table on stdout and nothing else. Progress and the estimate go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time

__all__ = ["add_arguments", "run"]

_FULL_MEMORY = "65536,131072"
_DEFAULT_MEMORY = "8192"


def add_arguments(p) -> None:
    from ..bench.cases import CASES, DEFAULT_CASES, DEFAULT_PEERS, DEFAULT_SIZE, PEERS

    p.description = (
        "Benchmark attnkit against torch SDPA, naive attention and (with --full) compiled FlexAttention. "
        "The default is small (about a minute on a quiet 2-core machine, under 2 when the cores are shared): "
        f"{','.join(DEFAULT_CASES)} at L={DEFAULT_SIZE}, fp32, "
        f"forward and forward+backward, peers {','.join(DEFAULT_PEERS)}, and the peak-RSS check at "
        f"L={_DEFAULT_MEMORY}. --full runs the suite behind BENCHMARKS.md (all cases at L=4096/16384, fp32 and "
        "bf16, every peer, memory at 65536 and 131072): tens of minutes. Nothing is written unless you pass "
        "--json or --markdown.")
    p.add_argument("--full", action="store_true",
                   help="the whole suite (every case, fp32 and bf16, flex included, L up to 16384; tens of minutes)")
    p.add_argument("--cases", default=None, help=f"comma list from {','.join(CASES)} "
                                                 f"(default {','.join(DEFAULT_CASES)}; --full: all)")
    p.add_argument("--dtypes", default=None, help="comma list from fp32,bf16 (default fp32; --full: both)")
    p.add_argument("--modes", default=None, help="comma list from fwd,fwdbwd (default both)")
    p.add_argument("--peers", default=None, help=f"comma list from {','.join(PEERS)} "
                                                 f"(default {','.join(DEFAULT_PEERS)}; --full: all)")
    p.add_argument("--length", type=int, default=None,
                   help=f"L (= S) for every case (default {DEFAULT_SIZE}; --full: 4096, 16384 for window/document)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds, >= 1 (default 5; --full 7)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds per peer and case before it stops repeating, > 0 (default 2; --full 20)")
    p.add_argument("--memory", default=None, metavar="L[,L...]|none",
                   help=f"lengths for the peak-RSS check (default {_DEFAULT_MEMORY}; --full {_FULL_MEMORY}; "
                        "'none' to skip)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON here "
                                                                "(rewritten after each case)")
    p.add_argument("--markdown", default=None, metavar="PATH", help="also write a markdown report here")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the estimate, run nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _memory(arg: str | None, full: bool):
    from ..bench import BenchSettingsError

    arg = arg if arg is not None else (_FULL_MEMORY if full else _DEFAULT_MEMORY)
    if arg.strip().lower() == "none":
        return []
    try:
        lengths = [int(x) for x in arg.split(",")]
    except ValueError:
        raise BenchSettingsError("memory", f"expected a comma list of ints or 'none', got {arg!r}") from None
    return lengths


def _writable(path: str, flag: str):
    from . import CLIError

    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise CLIError(f"{flag}: cannot write {path!r} (a directory, or its folder is missing or read-only); "
                       "pass a file path in a writable folder")


def _fmt_s(s: float) -> str:
    """A duration as a person reads it: under 1 s, 42 s, 7 min, 3.5 h, 12 days."""
    if s < 1:
        return "under 1 s"
    if s < 120:
        return f"{s:.0f} s"
    if s < 2 * 3600:
        return f"{s / 60:.0f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:,.0f} days"


def run(args) -> int:
    from .. import bench
    from . import CLIError

    try:
        cases, peers = bench.select(full=args.full, cases=args.cases, dtypes=args.dtypes, modes=args.modes,
                                    peers=args.peers, length=args.length)
        repeats = args.repeats if args.repeats is not None else (7 if args.full else 5)
        budget = args.budget if args.budget is not None else (20.0 if args.full else 2.0)
        memory = _memory(args.memory, args.full)
        bench.runner.check_settings(repeats=repeats, budget=budget, memory=memory)
        bench.runner.check_fits(cases, peers, memory)
    except bench.BenchSettingsError as e:
        raise CLIError(f"--{e.option}: {e.message}") from None
    for path, flag in ((args.json, "--json"), (args.markdown, "--markdown")):
        if path is not None:
            _writable(path, flag)

    est = bench.estimate(cases, peers, repeats=repeats, budget=budget, memory=memory)
    mem = f" + peak RSS at L={','.join(map(str, memory))}" if memory else ""
    print(f"attnkit bench: {len(cases)} case(s) × {len(peers)} peer(s) ({','.join(peers)}){mem}, {repeats} rounds; "
          f"estimated {_fmt_s(est)} on this machine"
          + ("" if args.full else " (the whole suite: --full, tens of minutes)"), file=sys.stderr, flush=True)
    if args.dry_run:
        for c in cases:
            print(c.label)
        return 0

    command = "attnkit bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])

    def save(report):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    progress = bench.runner.Progress(len(cases) * len(peers) + len(memory), enabled=not args.no_progress)
    t0 = time.perf_counter()
    report = bench.run(cases, peers, repeats=repeats, budget=budget, memory=memory, progress=progress,
                       on_case=save, command=command.strip())
    wall = time.perf_counter() - t0
    save(report)
    print(bench.report.text(report))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(bench.report.markdown(report))
    wrote = [p for p in (args.json, args.markdown) if p]
    print(f"attnkit bench: done in {_fmt_s(wall)} (estimated {_fmt_s(est)})"
          + (f"; wrote {', '.join(wrote)}" if wrote else ""), file=sys.stderr)
    return 0
