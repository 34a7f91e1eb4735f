"""The README's first screen says what attnkit is for and why, with measured ratios that BENCHMARKS.md
records with the same command; then the two commands, install mechanics further down. BENCHMARKS.md
speaks of the library (not of the issues that changed it), and the README names no machine's folder."""

from __future__ import annotations

import re

from conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")
BENCH = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
FIRST = README.splitlines()[:25]


def _why_table():
    rows = [ln for ln in FIRST if ln.startswith("| ") and not ln.startswith("| workload")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in rows]
    return [c for c in cells if not set(c[0]) <= set("-")]


def test_the_why_is_in_the_first_25_lines():
    text = "\n".join(FIRST)
    assert "SDPA" in text and "FlexAttention" in text and " for " in text
    rows = _why_table()
    assert 3 <= len(rows) <= 5, rows
    assert "flex_attention" in text  # FlexAttention users' one-import switch


def test_every_ratio_is_measured_in_benchmarks_md_with_its_cpu_and_command():
    command = None
    for workload, _peer, ratio, cpu, cmd in _why_table():
        if cmd.startswith("`"):
            command = cmd.strip("`")
        assert command and command in " ".join(BENCH.split()), (workload, command)
        assert cpu.split(",")[0] in BENCH, (workload, cpu)
        for r in re.findall(r"\d+(?:\.\d+)?×", ratio):
            assert r in BENCH, (workload, r)


def test_the_two_commands_come_before_the_install_details():
    demo, test = README.index("make demo     #"), README.index("make test     #")
    details = README.index("## Install")
    assert demo < test < details and README[:demo].count("\n") < 35
    for mechanics in ("WHEEL_DIR", "TORCH_INDEX", "constraints.txt"):
        assert README.index(mechanics) > details, mechanics


def test_readme_describes_wheel_dir_without_a_machine_folder():
    assert "/opt/" not in README
    assert "WHEEL_DIR" in README


def test_benchmarks_md_speaks_of_the_library_not_of_issue_numbers():
    said = re.compile(r"\bissues?\s*#?\d+|\b(this|the) issue('s)?\b", re.I)
    hits = [ln.strip() for ln in BENCH.splitlines() if said.search(ln)]
    assert not hits, hits
