"""Rewrite the generated section of BENCHMARKS.md from saved results.

    python benchmarks/update_md.py RESULTS.json [PAGE.md]

Only the text between ``<!-- attnkit-bench:begin … -->`` and ``<!-- attnkit-bench:end -->``
is replaced (by :func:`attnkit.bench.report.section` of the results); every byte outside
the markers — the hand-written sections — is kept. Measures nothing: run the suite
first (``make benchmarks-md`` does both).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from attnkit.bench import report


def update(results_path, page_path) -> bool:
    """Splice the section for ``results_path`` into ``page_path``; True if the page changed."""
    page = Path(page_path)
    data = json.loads(Path(results_path).read_text(encoding="utf-8"))
    with open(page, encoding="utf-8", newline="") as f:  # newline="": keep \r\n and every other byte as it is
        old = f.read()
    new = report.splice(old, report.section(data))
    if new != old:
        with open(page, "w", encoding="utf-8", newline="") as f:
            f.write(new)
    return new != old


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a JSON file written by attnkit bench --json")
    ap.add_argument("page", nargs="?", default="BENCHMARKS.md", help="the page to update (default BENCHMARKS.md)")
    args = ap.parse_args(argv)
    try:
        changed = update(args.results, args.page)
    except (OSError, json.JSONDecodeError, report.MarkerError, KeyError) as e:
        print(f"update_md: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(f"{args.page}: generated section {'rewritten' if changed else 'already up to date'} from {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
