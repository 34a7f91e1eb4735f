"""``attnkit explain`` with a mask that hides nothing says so: the README's ``--causal`` example is not
silently the unmasked one (one query, bottom-right aligned, sees every key); with several queries
``--causal`` shows what it changed."""

from __future__ import annotations

import pytest
from conftest import ROOT

from attnkit import cli


def _explain(capsys, *argv):
    rc = cli.main(["explain", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def test_causal_on_one_query_says_it_sees_every_key(capsys):
    plain = _explain(capsys, "--example", "cat")
    causal = _explain(capsys, "--example", "cat", "--causal")
    assert causal != plain
    assert causal.startswith(plain)  # the same numbers, then a note saying why
    note = causal[len(plain):]
    assert "--causal hides no key here" in note and "bottom-right" in note and "sees every key" in note
    assert "attnkit explain --causal" in note  # where to see what the mask does


def test_causal_on_several_queries_shows_what_it_hid(capsys):
    plain = _explain(capsys)
    causal = _explain(capsys, "--causal")
    assert "Masked / modified scores" in causal and "Masked / modified scores" not in plain
    q0 = [ln for ln in causal.splitlines() if ln.startswith("q0 │") and "-inf" in ln]
    assert q0 and q0[0].split("│")[1].split() == ["0.7071", "-inf", "-inf"]  # query 0 sees key 0 only
    assert "hides no key" not in causal


@pytest.mark.parametrize("mask", ["padding:3", "prefix:3"])
def test_any_mask_that_hides_nothing_is_noted(capsys, mask):
    out = _explain(capsys, "--mask", mask)  # 3 queries, 3 keys: both keep every (query, key) pair
    assert "the mask hides no key here: each of the 3 queries sees all 3 keys" in out


def test_the_readme_shows_the_causal_example_that_changes_something():

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "attnkit explain --causal" in readme
    assert "--example cat --causal" not in readme


def test_a_float_mask_that_hides_a_key_or_adds_a_bias_is_not_noted_as_changing_nothing(capsys, tmp_path):
    """A float mask's -inf hides a key that the bool part (``Trace.allowed``) still holds; a finite bias
    hides none but changes every weight: neither is "the unmasked numbers"."""
    import numpy as np

    for row, want in (([0.0, -np.inf, 0.0], [0.6698, 0.0, 0.3302]), ([0.0, 1.0, 0.0], None)):
        np.save(tmp_path / "bias.npy", np.array([row]))
        for name, text in (("q", "1,0\n"), ("k", "1,1\n1,0\n0,1\n"), ("v", "10,0\n0,10\n5,5\n")):
            (tmp_path / f"{name}.csv").write_text(text)
        out = _explain(capsys, *(a for n in "qkv" for a in (f"--{n}", str(tmp_path / f"{n}.csv"))),
                       "--mask", str(tmp_path / "bias.npy"))
        assert "hides no key" not in out and "unmasked ones" not in out
        if want:
            assert "0.6698" in out and "0.3302" in out


def test_the_page_counts_the_pairs_a_float_mask_hides():
    import numpy as np

    import attnkit
    from attnkit.viz import explain_page

    q, k, v = np.eye(2, 2), np.array([[1.0, 1], [1, 0], [0, 1]]), np.arange(6.0).reshape(3, 2)
    page = explain_page(attnkit.explain(q, k, v, mask=np.array([[0.0, -np.inf, 0.5], [-np.inf, -np.inf, 0.0]])))
    assert "3 of 6 pairs attend" in page
    page = explain_page(attnkit.explain(q, k, v, mask=np.array([[True, False, True], [False, True, True]])))
    assert "4 of 6 pairs attend" in page
