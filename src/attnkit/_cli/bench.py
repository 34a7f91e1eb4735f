"""``attnkit bench``: the benchmark suite (the harness lives in :mod:`attnkit._bench`)."""

from __future__ import annotations

__all__ = ["add_arguments", "run"]


def add_arguments(parser) -> None:
    from .._bench import add_arguments as _add

    _add(parser)


def run(args) -> int:
    from .._bench import BenchArgumentError, run_suite
    from . import CLIError

    try:
        return run_suite(args)
    except BenchArgumentError as e:
        raise CLIError(str(e)) from None
