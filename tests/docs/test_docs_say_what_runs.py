"""The docs and examples say what runs:

* ``examples/train_reverse.py`` leaves no PNG in the directory it runs in (it writes to ``attnkit-out/``);
* the README's backend table says which backends apply dropout — the ones that do;
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

# ---------------------------------------------------------------- examples/train_reverse.py

def test_train_reverse_leaves_no_png_where_it_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason="saving attention maps needs matplotlib: pip install 'attnkit[viz]'")
    spec = importlib.util.spec_from_file_location("train_reverse_no_png", ROOT / "examples" / "train_reverse.py")
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


# ---------------------------------------------------------------- "tour" is the notebook

def test_tour_names_the_notebook_and_demo_names_the_demo():
    assert "tour" not in cli._COMMANDS["demo"].split("(")[0]  # the demo's one-line help
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "src/attnkit/_cli/demo.py"]
    clash = [f"{p.name}: {ln.strip()}" for p in pages for ln in p.read_text(encoding="utf-8").splitlines()
             if "attnkit demo" in ln and re.search(r"\bthe tour\b", ln) and "tour.ipynb" not in ln]
    assert not clash, clash
