"""``attnkit`` command line: explain | masks | show | bench | demo | long | calibrate.

Each subcommand lives in ``attnkit._cli.<name>`` with ``add_arguments(parser)``
and ``run(args) -> int``; heavy imports happen only when that subcommand runs.

Exit status: 0 ok; 2 a user error (bad option or input: one line ``attnkit CMD: error: …``
naming the option, what was expected, what was got and the fix; no traceback); 141
(128 + SIGPIPE, what ``cat`` or ``grep`` give) when the reader of stdout goes away, e.g.
``attnkit explain | head -2``, quietly; 130 on Ctrl-C. Subcommands turn user errors into
:class:`CLIError` where they check the input; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from ._cli import CLIError

__all__ = ["main", "CLIError", "EXIT_BROKEN_PIPE"]

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE(13)

_COMMANDS = {
    "explain": "attention step by step on the worked examples or your own Q, K, V",
    "masks": "draw a mask as ASCII (causal, sliding window, document, prefix-LM, padding)",
    "show": "a real model's attention on your sentence: table, PNG and offline HTML",
    "bench": "benchmark attnkit against torch SDPA, FlexAttention and naive attention",
    "demo": "a three-part demo: explain, a real model's attention, a speed table (the tour is examples/tour.ipynb)",
    "long": "attention over a long input (128k tokens, or MiniLM's 512): a zoomable map of the mass per tile",
    "calibrate": "measure where attnkit's compiled kernel beats torch SDPA on this CPU; auto decides by it",
}


def _version() -> str:
    """The installed distribution's version (the package's own when run from a source tree)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("attnkit")
    except PackageNotFoundError:
        from . import __version__

        return __version__


class _Version(argparse.Action):
    """``--version``: the version is looked up only when asked for (importlib.metadata takes a while to import)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
                         help="show attnkit's version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"attnkit {_version()}")
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """argparse's parser answering a mistake in one line on stderr (exit status 2), as every other error of the
    command line is, with where the options are listed instead of the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def _parser(command: str | None = None, *, every: bool = True) -> argparse.ArgumentParser:
    """The argument parser. ``every=False`` fills in only ``command``'s options (the others keep their
    one-line help): a subcommand's module is imported only when that subcommand is asked for, so
    ``attnkit --help`` and ``attnkit --version`` start without numpy or torch."""
    p = _Parser(prog="attnkit", description="Exact Transformer attention: run it, see it, build with it.",
                epilog="exit status: 0 ok, 2 bad input, 141 when stdout's reader goes away (| head).")
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_ in _COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if not every and name != command:
            continue
        try:
            mod = importlib.import_module(f"attnkit._cli.{name}")
        except ImportError:  # a subcommand whose module is not part of this build
            continue
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


def _command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (the top level has only
    ``-h/--help`` and ``--version``, which take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _silence_stdout():
    """After a broken pipe: point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # stdout without a file descriptor (captured in tests)
        pass


def main(argv=None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        p = _parser(_command(argv), every=False)
        args = p.parse_args(argv)
        if not getattr(args, "_run", None):
            p.print_help()
            return 0 if args.command is None else 2
        try:
            rc = int(args._run(args) or 0)
        except CLIError as e:
            sys.stdout.flush()
            print(f"attnkit {args.command}: error: {e}", file=sys.stderr)
            return 2
        sys.stdout.flush()  # a closed pipe shows up here, inside the handler, not at interpreter exit
        return rc
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return 130
