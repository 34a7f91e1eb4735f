"""The benchmark harness behind ``attnkit bench``: attnkit against torch SDPA, FlexAttention and naive attention.

Three modules, one job each:

* :mod:`attnkit.bench.cases` — what is measured: the cases (mask × length × dtype ×
  mode), each peer's callable, the FLOP formula; :func:`~attnkit.bench.cases.select`
  picks the small default set or the full suite.
* :mod:`attnkit.bench.runner` — how it is measured: interleaved timing of the peers
  in one run, peak RSS of a fresh subprocess, the run-time estimate.
* :mod:`attnkit.bench.report` — how it is reported: tables, the targets, markdown,
  and :func:`~attnkit.bench.report.splice` for the generated section of BENCHMARKS.md.

Installed with the package (``attnkit bench`` works from a wheel); it imports torch
and runs nothing on import. Repository-only scripts live in ``benchmarks/``.

    from attnkit import bench
    cases, peers = bench.select(cases="window", length=1024)
    rep = bench.run(cases, peers, repeats=3, budget=2.0)
    print(bench.report.text(rep))
"""

from . import cases, report, runner
from .cases import BenchSettingsError, select
from .runner import estimate, run

__all__ = ["cases", "runner", "report", "select", "run", "estimate", "BenchSettingsError"]
