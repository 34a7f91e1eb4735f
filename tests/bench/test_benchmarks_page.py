"""BENCHMARKS.md's commands reproduce what their rows claim (issue 21): every `attnkit bench` command on the page
is accepted and plans the length its front-table row names (a suite row needs `--full`: without it the default
length is used), and every `python benchmarks/...` command names a script that exists with options it accepts."""

from __future__ import annotations

import re
import shlex

import pytest
from conftest import ROOT

PAGE = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
HAND_WRITTEN = PAGE[:PAGE.index("<!-- attnkit-bench:begin")]  # the generated section records the command as typed
COMMANDS = [" ".join(c.split())  # a command may wrap across lines of the page
            for c in re.findall(r"`((?:[A-Z_]+=\S+\s+)*(?:attnkit\s+bench|python\s+benchmarks/)[^`]*)`", HAND_WRITTEN)]


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    while re.fullmatch(r"[A-Z_]+=\S+", words[0]):  # OMP_NUM_THREADS=1 python ...
        words = words[1:]
    return words


def _planned(command: str, capsys) -> str:
    from attnkit import cli

    rc = cli.main([*_argv(command)[1:], "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0, f"{command!r} is rejected"
    return out


def test_the_page_has_commands():
    assert sum(c.startswith("attnkit bench") for c in COMMANDS) >= 3
    assert sum(_argv(c)[0] == "python" for c in COMMANDS) >= 5


@pytest.mark.parametrize("command", sorted({c for c in COMMANDS if c.startswith("attnkit bench")}))
def test_bench_command_is_accepted(command, capsys):
    assert _planned(command, capsys).strip()


def test_front_table_bench_rows_plan_their_length(capsys):
    start = HAND_WRITTEN.index("## At a glance")
    front = HAND_WRITTEN[start:HAND_WRITTEN.index("\n## ", start + 3)]
    checked = 0
    for row in front.splitlines():
        cmd = re.search(r"`(attnkit bench[^`]*)`", row)
        length = re.search(r"L = (\d+)", row)
        if cmd and length:
            labels = _planned(cmd.group(1), capsys).split()
            assert any(f"-{length.group(1)}" in lab for lab in labels), (row, labels)
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("command", sorted({c for c in COMMANDS if _argv(c)[0] == "python"}))
def test_script_command_names_a_script_and_its_options(command):
    words = _argv(command)
    script = ROOT / words[1]
    assert script.is_file(), command
    source = script.read_text(encoding="utf-8")
    for opt in (w for w in words[2:] if w.startswith("--")):
        assert f'"{opt.split("=")[0]}"' in source, f"{command!r}: {script.name} has no option {opt}"
