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
