"""BENCHMARKS.md regeneration: only the marked section changes; hand-written text is kept byte for byte.

Uses a temp page and tiny fake results: no benchmark runs here.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import ROOT

from attnkit.bench import report


def _update_md():
    spec = importlib.util.spec_from_file_location("update_md", ROOT / "benchmarks" / "update_md.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake(L=2048, tiled_s=0.010):
    machine = {"cpu": "Fake CPU", "cores": 2, "torch_threads": 2, "python": "3.x", "torch": "t", "attnkit": "a",
               "platform": "p", "load_avg": [0.5, 0.5, 0.5]}

    def row(peer, median):
        return {"case": "window", "dtype": "float32", "mode": "fwd", "L": L, "peer": peer, "median_s": median,
                "iqr_s": None, "n": 3, "first_call_s": median, "setup_s": None, "gflops": 1.0,
                "x_sdpa": 0.5 / median, "backend_ran": "tiled" if peer == "tiled" else None, "note": ""}

    return {"command": "attnkit bench --fake", "date": "2000-01-01 00:00:00 UTC", "machine": machine, "repeats": 3,
            "budget_s": 1.0, "peers": ["sdpa", "tiled"], "memory": [], "notes": [],
            "results": [row("sdpa", 0.5), row("tiled", tiled_s)]}


HEAD = ("# attnkit benchmarks\r\n\nHand-written intro with trailing spaces   \n"
        "and a mention of attnkit-bench that is not a marker, unicode ≥ × —.\n\n")
TAIL = ("\n## Rerun by hand\n\n| hand | table |\n|---|---|\n| kept | 1.00 |\n\n"
        "## Notes\n\n* written by a person, no final newline")


def test_regeneration_keeps_hand_written_sections_byte_for_byte(tmp_path):
    page = tmp_path / "BENCHMARKS.md"
    old_generated = "Command: `old`\n\n| old | table |\n"
    original = HEAD + report.BEGIN + "\n" + old_generated + report.END + TAIL
    page.write_bytes(original.encode("utf-8"))
    results = tmp_path / "r.json"
    results.write_text(json.dumps(_fake()))

    assert _update_md().main([str(results), str(page)]) == 0
    new = page.read_bytes().decode("utf-8")
    head_len = len(HEAD + report.BEGIN + "\n")
    assert new[:head_len] == original[:head_len]  # everything up to and including the begin line
    assert new.endswith(report.END + TAIL)  # the end marker and everything after it
    generated = new[head_len:len(new) - len(report.END + TAIL)]
    assert generated == report.section(_fake())  # the marked part is exactly the new section
    assert "old" not in generated and "Command: `attnkit bench --fake`" in generated
    assert "| window-2048 float32 fwd | 500.0 | 10.0 | 50.00 |" in generated  # from the fake numbers

    assert _update_md().update(results, page) is False  # a second pass changes nothing
    assert page.read_bytes().decode("utf-8") == new


@pytest.mark.parametrize("doc", [
    "no markers at all\n",
    f"{report.BEGIN}\nx\n",
    f"x\n{report.END}\n",
    f"{report.END}\nx\n{report.BEGIN}\n",
    f"{report.BEGIN}\na\n{report.END}\n{report.BEGIN}\nb\n{report.END}\n",
])
def test_splice_refuses_missing_doubled_or_reversed_markers(doc):
    with pytest.raises(report.MarkerError):
        report.splice(doc, "new\n")


def test_targets_are_checked_only_at_the_lengths_they_are_stated_for():
    assert report.targets(_fake(L=2048)) == []  # a small run claims no target
    rows = report.targets(_fake(L=16384, tiled_s=0.010))
    assert any("window-256 fp32 forward: tiled vs SDPA+mask | ≥ 10× | 50.00× | met" in r for r in rows)
    rows = report.targets(_fake(L=16384, tiled_s=0.100))
    assert any("| 5.00× | missed by 50% |" in r for r in rows)


def test_committed_page_is_what_its_committed_results_render_to():
    page = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    data = json.loads((ROOT / "benchmarks" / "results.json").read_text(encoding="utf-8"))
    assert page.count(report.END) == 1
    assert report.splice(page, report.section(data)) == page
