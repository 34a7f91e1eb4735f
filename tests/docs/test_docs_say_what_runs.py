"""The small inconsistencies a newcomer met in their first hour (issue 21), each pinned:

* ``examples/train_reverse.py`` leaves no PNG in the directory it runs in;
* ``attnkit demo --model /bad/path`` and ``attnkit explain --html /bad/dir/x.html`` are refused
  before anything is printed (exit 2, one line naming the option);
* the README's backend table says which backends apply dropout — the ones that do;
* a ``from_torch`` module takes torch's ``key_padding_mask=`` (True = ignore), exactly;
* "tour" is the notebook; ``attnkit demo`` is the demo.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from conftest import ROOT

import attnkit
from attnkit import cli
from attnkit.nn import MultiHeadAttention

# ---------------------------------------------------------------- examples/train_reverse.py

def test_train_reverse_leaves_no_png_where_it_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason="saving attention maps needs matplotlib: pip install 'attnkit[viz]'")
    spec = importlib.util.spec_from_file_location("train_reverse_newcomer", ROOT / "examples" / "train_reverse.py")
    example = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    spec.loader.exec_module(example)
    monkeypatch.chdir(tmp_path)
    example.main(["--seq-len", "4", "--vocab", "5", "--embed-dim", "16", "--heads", "2", "--layers", "1",
                  "--steps", "2"])
    out = capsys.readouterr().out
    assert not list(tmp_path.glob("*.png")), "a PNG was written into the working directory"
    png = tmp_path / "attnkit-out" / "reverse_attention.png"
    assert png.stat().st_size > 1000 and f"-> {Path('attnkit-out') / 'reverse_attention.png'}" in out
    assert "attnkit-out/" in (ROOT / ".gitignore").read_text().splitlines()  # the default folder is ignored


# ---------------------------------------------------------------- CLI: bad paths refused up front

def _run(capsys, argv):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("kind", ["missing", "file", "no-config"])
def test_demo_refuses_a_bad_model_path_before_running(tmp_path, capsys, kind):
    bad = tmp_path / "model"
    if kind == "file":
        bad.write_text("not a model")
    elif kind == "no-config":
        bad.mkdir()
    rc, out, err = _run(capsys, ["demo", "--quick", "--model", str(bad), "--out", str(tmp_path / "o")])
    assert rc == 2
    assert out == "" and "[1/3]" not in err  # nothing ran
    line = err.strip()
    assert "\n" not in line and line.startswith("attnkit demo: error: --model:") and str(bad) in line
    assert not (tmp_path / "o").exists()


def test_demo_refuses_an_out_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "o"
    f.write_text("x")
    rc, out, err = _run(capsys, ["demo", "--quick", "--out", str(f)])
    assert rc == 2 and out == "" and err.startswith("attnkit demo: error: --out:")


@pytest.mark.parametrize("where", ["missing-folder", "a-folder"])
def test_explain_html_checks_the_path_before_printing(tmp_path, capsys, where):
    path = tmp_path / "nope" / "x.html" if where == "missing-folder" else tmp_path
    rc, out, err = _run(capsys, ["explain", "--html", str(path)])
    assert rc == 2
    assert out == ""  # before: the whole explanation was printed, then the write failed
    assert err.startswith("attnkit explain: error: --html:") and err.strip().count("\n") == 0
    assert ("does not exist" if where == "missing-folder" else "a directory") in err


def test_explain_html_still_writes_a_good_path(tmp_path, capsys):
    rc, out, _ = _run(capsys, ["explain", "--html", str(tmp_path / "p.html")])
    assert rc == 0 and (tmp_path / "p.html").stat().st_size > 1000 and "5.0000" in out


# ---------------------------------------------------------------- dropout: what the docs say is what runs

def _applies_dropout(backend: str) -> bool:
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    try:
        torch.manual_seed(0)
        dropped = attnkit.attention(q, k, v, dropout_p=0.5, backend=backend)
    except (ValueError, TypeError, NotImplementedError):
        return False
    plain = attnkit.attention(q, k, v, backend=backend)
    return not torch.allclose(dropped, plain)


def test_readme_backend_table_names_the_backends_with_dropout():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)` \|(.*)$", text.split("## Backends", 1)[1].split("\n## ", 1)[0], re.M)
    table = {name: "dropout" in rest for name, rest in rows}
    assert {"reference", "eager", "sdpa", "tiled", "flex"} <= set(table)
    documented = {n for n, says in table.items() if says and n != "auto"}
    actual = {n for n in ("reference", "eager", "sdpa", "tiled", "flex") if _applies_dropout(n)}
    assert actual == documented, (actual, documented)
    assert "only" not in attnkit.attention.__doc__.split("dropout_p:", 1)[1].split("\n")[0]


# ---------------------------------------------------------------- from_torch: torch's key_padding_mask

@pytest.mark.parametrize("batch_first", [True, False])
def test_from_torch_takes_torchs_key_padding_mask_exactly(batch_first):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(16, 4, batch_first=batch_first, dtype=torch.float64).eval()
    ours = MultiHeadAttention.from_torch(theirs)
    x = torch.randn(3, 7, 16, dtype=torch.float64)  # (B, L, E)
    if not batch_first:
        x = x.transpose(0, 1)  # (L, B, E)
    pad = torch.zeros(3, 7, dtype=torch.bool)  # (B, S): True = padding (torch's polarity)
    pad[1, 5:] = True
    pad[2, 1:] = True
    ref, _ = theirs(x, x, x, key_padding_mask=pad)
    got = ours(x, x, x, key_padding_mask=pad)
    assert (got - ref).abs().max().item() < 1e-12
    # a float key_padding_mask is added to the scores, as torch does
    bias = torch.randn(3, 7, dtype=torch.float64)
    ref, _ = theirs(x, x, x, key_padding_mask=bias)
    assert (ours(x, key_padding_mask=bias) - ref).abs().max().item() < 1e-12
    # and it is the same as attnkit's own polarity
    assert torch.equal(got, ours(x, mask=~pad[:, None, None, :]))


def test_from_torch_key_padding_mask_errors_name_the_argument():
    ours = MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, batch_first=True))
    x = torch.randn(2, 3, 8)
    pad = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"key_padding_mask: pass either .* not both"):
        ours(x, key_padding_mask=pad, mask=~pad[:, None, None, :])
    with pytest.raises(ValueError, match=r"key_padding_mask: expected torch's \(B, S\)"):
        ours(x, key_padding_mask=pad[:, None, None, :])
    with pytest.raises(ValueError, match=r"key_padding_mask: expected a bool .* key_padding_mask\.bool\(\)"):
        ours(x, key_padding_mask=pad.long())


# ---------------------------------------------------------------- "tour" is the notebook

def test_tour_names_the_notebook_and_demo_names_the_demo():
    assert "tour" not in cli._COMMANDS["demo"].split("(")[0]  # the demo's one-line help
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "src/attnkit/_cli/demo.py"]
    clash = [f"{p.name}: {ln.strip()}" for p in pages for ln in p.read_text(encoding="utf-8").splitlines()
             if "attnkit demo" in ln and re.search(r"\bthe tour\b", ln) and "tour.ipynb" not in ln]
    assert not clash, clash
