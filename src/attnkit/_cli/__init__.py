"""The ``attnkit`` subcommands, one module each (``add_arguments(parser)``, ``run(args) -> int``).

``CLIError`` lives here, below ``attnkit.cli`` (which only parses and reports), so the
subcommands never import upward.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CLIError", "check_out_dir"]


class CLIError(Exception):
    """A user error: printed as one line (with the fix), exit code 2, no traceback."""


def check_out_dir(flag: str, path) -> None:
    """Refuse an output folder that could not be made or written, before any work runs.

    ``path`` may not exist yet (it is created later, with its parents): then its nearest existing
    ancestor must be a writable folder. Raises :class:`CLIError` naming ``flag`` and the fix.
    """
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise CLIError(f"{flag}: expected a folder for the output files, got {str(p)!r} (a file). "
                           "Pass a folder path (it is created if missing).")
        if not os.access(p, os.W_OK | os.X_OK):
            raise CLIError(f"{flag}: the folder {str(p)!r} is not writable. Pass a folder you can write to.")
        return
    parent = p.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise CLIError(f"{flag}: cannot create the folder {str(p)!r}: {str(parent)!r} is a file, not a folder. "
                       "Pass a folder path.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CLIError(f"{flag}: cannot create the folder {str(p)!r}: {str(parent)!r} is not writable. "
                       "Pass a folder you can write to.")
