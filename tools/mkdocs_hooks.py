"""MkDocs hooks: pages made from the repository's own sources, so the site never drifts from them.

* ``<!-- attnkit:tour -->``       → examples/tour.ipynb (its cells and saved outputs)
* ``<!-- attnkit:cli -->``        → ``attnkit --help`` and every subcommand's ``--help``
* ``<!-- attnkit:benchmarks -->`` → BENCHMARKS.md
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _fence(text: str, lang: str = "") -> str:
    ticks = "````" if "```" in text else "```"
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}\n"


def tour_markdown(path: Path = ROOT / "examples" / "tour.ipynb") -> str:
    nb = json.loads(path.read_text(encoding="utf-8"))
    out = ["*This page is `examples/tour.ipynb` rendered with its saved outputs (the test suite executes the "
           "notebook afresh and checks them); run it yourself with `jupyter lab examples/tour.ipynb`.*\n"]
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            out.append(src + "\n")
            continue
        out.append(_fence(src, "python"))
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream" and o.get("name") == "stdout":
                out.append(_fence("".join(o["text"]), "text"))
            elif "data" in o:
                data = o["data"]
                if "text/html" in data:
                    html = "".join(data["text/html"])
                    out.append(f'<div class="nb-output">{html}</div>\n')
                elif "text/plain" in data:
                    out.append(_fence("".join(data["text/plain"]), "text"))
    return "\n".join(out)


def cli_markdown() -> str:
    from attnkit import cli

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        parts = []
        for argv in [["--help"]] + [[name, "--help"] for name in cli._COMMANDS]:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
                cli._parser().parse_args(argv)
            title = "attnkit" if len(argv) == 1 else f"attnkit {argv[0]}"
            parts.append(f"### `{title}`\n\n" + _fence(buf.getvalue(), "text"))
        return "\n".join(parts)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def benchmarks_markdown() -> str:
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):  # the page has its own title
        lines = lines[1:]
    return "\n".join(lines)


_SLOTS = {"<!-- attnkit:tour -->": tour_markdown, "<!-- attnkit:cli -->": cli_markdown,
          "<!-- attnkit:benchmarks -->": benchmarks_markdown}


def on_page_markdown(markdown, page, config, files):  # the MkDocs hook signature (page, config, files unused)
    for slot, make in _SLOTS.items():
        if slot in markdown:
            markdown = markdown.replace(slot, make())
    return markdown


_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):(?=<code>)")


# reST's literal-block marker, as docstrings use it ("a picture::" then an indented block): the
# block already renders as code, so the marker reads as reST says — "text::" → "text:",
# "text ::" and a lone "::" → nothing.
_LITERAL = re.compile(r"(\s*)::</p>")
_LONE_LITERAL = re.compile(r"<p>\s*::</p>\n?")


def on_page_content(html, page, config, files):  # the MkDocs hook signature
    """Docstrings use Sphinx roles (:func:`x`) and reST's ``::``: the code span stays, the role
    prefix goes; the ``::`` ending a paragraph becomes what reST prints."""
    html = _ROLE.sub("", html)
    html = _LONE_LITERAL.sub("", html)
    return _LITERAL.sub(lambda m: "</p>" if m.group(1) else ":</p>", html)
