"""``attnkit`` command line: explain | masks | show | bench | demo.

Each subcommand lives in ``attnkit._cli.<name>`` with ``add_arguments(parser)``
and ``run(args) -> int``; heavy imports happen only when that subcommand runs.
User errors (bad input, missing extras) print one line with the fix and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "CLIError"]

_COMMANDS = {
    "explain": "attention step by step on the seed examples or your own Q, K, V",
    "masks": "draw a mask as ASCII (causal, sliding window, document, prefix-LM, padding)",
    "show": "a real model's attention on your sentence: table, PNG and offline HTML",
    "bench": "benchmark attnkit against torch SDPA, FlexAttention and naive attention",
    "demo": "the tour: explain, a real model's attention, a speed table",
}


class CLIError(Exception):
    """A user error: printed as one line (with the fix), exit code 2, no traceback."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnkit", description="Exact Transformer attention: run it, see it, build with it.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_ in _COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        try:
            mod = importlib.import_module(f"attnkit._cli.{name}")
        except ImportError:  # a subcommand whose module is not part of this build
            continue
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if not getattr(args, "_run", None):
        p.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args._run(args) or 0)
    except CLIError as e:
        print(f"attnkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # attnkit's validation errors name the argument and the fix
        print(f"attnkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
