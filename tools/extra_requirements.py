"""Print the requirements of one of attnkit's extras (pyproject.toml), one per line, for ``pip install -r``.

    python tools/extra_requirements.py test > .venv/test-requirements.txt

`make test` installs the `test` extra's tools this way on top of the demo's venv: ``pip install -e '.[test]'``
would install attnkit itself again, and with it compile its kernel a second time (~20 s on 2 cores), for nothing
that changed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tools/extra_requirements.py EXTRA", file=sys.stderr)
        return 2
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    if argv[0] not in extras:
        print(f"extra_requirements.py: no extra {argv[0]!r} in pyproject.toml; expected one of {sorted(extras)}",
              file=sys.stderr)
        return 2
    print("\n".join(extras[argv[0]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
