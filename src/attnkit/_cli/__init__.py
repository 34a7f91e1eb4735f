"""The ``attnkit`` subcommands, one module each (``add_arguments(parser)``, ``run(args) -> int``).

``CLIError`` lives here, below ``attnkit.cli`` (which only parses and reports), so the
subcommands never import upward.
"""

__all__ = ["CLIError"]


class CLIError(Exception):
    """A user error: printed as one line (with the fix), exit code 2, no traceback."""
