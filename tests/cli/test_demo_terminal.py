"""``attnkit demo`` in a terminal prints each part's heading once. (Its progress line on stderr says the
same thing; it is for runs whose stdout goes to a file or a pipe, where the terminal shows only stderr.)"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

SRC = str(ROOT / "src")

# The demo with its three parts stubbed out: only the headings and progress lines are printed.
_SCRIPT = textwrap.dedent("""
    import sys
    from attnkit import cli
    from attnkit._cli import demo
    demo._explain_part = demo._speed_part = lambda *a: None
    demo._model_part = lambda *a: None
    sys.exit(cli.main(["demo", "--quick", "--out", sys.argv[1]]))
""")
TITLES = ("Attention step by step", "A real model's attention", "Speed: naive vs torch SDPA")


def _run_in_terminal(tmp_path) -> str:
    """stdout and stderr both on one pseudo-terminal, as in an interactive shell."""
    primary, secondary = pty.openpty()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(tmp_path)], stdin=subprocess.DEVNULL, stdout=secondary,
                         stderr=secondary, env=env)
    os.close(secondary)
    chunks = []
    while True:
        ready, _, _ = select.select([primary], [], [], 120)
        if not ready:
            p.kill()
            pytest.fail("the demo printed nothing for 120 s")
        try:
            data = os.read(primary, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(primary)
    assert p.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode("utf-8", errors="replace")


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals (the pty module) are POSIX only")
def test_each_heading_is_printed_once_in_a_terminal(tmp_path):
    screen = _run_in_terminal(tmp_path)
    for title in TITLES:
        assert screen.count(title) == 1, f"{title!r} shown {screen.count(title)} times:\n{screen}"


def test_progress_goes_to_stderr_when_stdout_is_not_a_terminal(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    for n, title in enumerate(TITLES, 1):
        assert f"[{n}/3] {title}" in r.stderr and f"━━ {n}. {title}" in r.stdout
