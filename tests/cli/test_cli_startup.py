"""``attnkit --help`` answers at once: neither the command line nor ``import attnkit`` imports torch or
numpy until a subcommand (or a library function) needs them; the package still behaves as if it had
imported its public names eagerly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT

SRC = str(ROOT / "src")
HEAVY = ("torch", "numpy", "transformers", "matplotlib")
HELP_BUDGET_S = 0.5  # what `attnkit --help` may add to a bare interpreter's start


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))


def _loaded_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; which of HEAVY it imported, and what it printed."""
    script = (
        "import contextlib, io, json, sys\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    try:\n"
        + "".join(f"        {line}\n" for line in code.splitlines()) +
        "    except SystemExit:\n"
        "        pass\n"
        f"print(json.dumps({{'loaded': [m for m in {HEAVY!r} if m in sys.modules], 'out': buf.getvalue()}}))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_help_and_version_import_neither_torch_nor_numpy(argv):
    got = _loaded_after(f"from attnkit import cli\ncli.main({argv!r})")
    assert got["loaded"] == [], f"attnkit {' '.join(argv)} imported {got['loaded']}"
    assert "attnkit" in got["out"]
    if argv != ["--version"]:
        assert all(name in got["out"] for name in ("explain", "show", "demo", "long", "bench", "masks"))


def test_import_attnkit_is_light_until_a_function_is_used():
    got = _loaded_after("import attnkit")
    assert got["loaded"] == []
    got = _loaded_after("import attnkit\nattnkit.attention")
    assert "torch" in got["loaded"]


def test_a_subcommand_help_still_lists_its_options():
    got = _loaded_after("from attnkit import cli\ncli.main(['masks', '--help'])")
    assert "--size" in got["out"] and got["loaded"] == []
    got = _loaded_after("from attnkit import cli\ncli.main(['explain', '--help'])")
    assert "--causal" in got["out"] and "--example" in got["out"] and "torch" not in got["loaded"]


def test_help_takes_at_most_half_a_second_over_a_bare_interpreter():
    def best(cmd):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run(cmd, capture_output=True, env=_env(), timeout=120, check=True)
            times.append(time.perf_counter() - t0)
        return min(times)

    bare = best([sys.executable, "-c", "pass"])
    helped = best([sys.executable, "-m", "attnkit", "--help"])
    assert helped - bare <= HELP_BUDGET_S, f"attnkit --help took {helped:.2f} s, a bare interpreter {bare:.2f} s"


def test_the_package_behaves_as_if_imported_eagerly():
    # in a fresh interpreter, importing the submodule attnkit/explain.py first must not replace the function
    got = _loaded_after("import attnkit.explain\nimport attnkit\nprint(callable(attnkit.explain))")
    assert got["out"].strip() == "True"
    import attnkit
    from attnkit import explain, masks

    assert callable(attnkit.explain) and attnkit.explain is explain
    assert attnkit.masks is masks and callable(attnkit.attention)
    assert set(attnkit.__all__) <= set(dir(attnkit))
    assert all(getattr(attnkit, name) is not None for name in attnkit.__all__)
    assert attnkit.backends.__name__ == "attnkit.backends"  # any submodule, as the eager import made available
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        attnkit.no_such_name  # noqa: B018
    star: dict = {}
    exec("from attnkit import *", star)
    assert set(attnkit.__all__) <= set(star)
