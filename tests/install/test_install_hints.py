"""Install hints say how to install attnkit from its repository: attnkit is not on a package index,
so ``pip install attnkit`` or ``pip install 'attnkit[model]'`` fails for whoever follows them."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

# Installing attnkit by name from an index: `pip install attnkit`, `pip install 'attnkit[model]'`, `"attnkit[viz]"`.
BY_NAME = re.compile(r"""pip install\s+(?:-U\s+)?['"]?attnkit\b|['"]attnkit\[\w""")


def _pages():
    for path in [*sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def test_no_hint_installs_attnkit_from_an_index():
    bad = [f"{rel}:{n}: {line.strip()}" for rel, text in _pages() for n, line in enumerate(text.splitlines(), 1)
           if BY_NAME.search(line)]
    assert not bad, "hints that install attnkit by name (it is installed from its repository):\n" + "\n".join(bad)


def test_the_model_hint_names_the_repository_and_an_extra_that_exists():
    from attnkit.integrations.minilm import INSTALL_HINT

    assert "attnkit repository" in INSTALL_HINT
    tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with tomllib (Python >= 3.11)")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    named = set()
    for _, text in _pages():
        for group in re.findall(r"pip install (?:-c \S+ )?-e '\.\[([\w,]+)\]'", text):
            named |= set(group.split(","))
    assert "model" in named and named <= set(extras), (named, sorted(extras))
