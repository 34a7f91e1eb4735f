"""``attnkit show`` and ``attnkit demo`` refuse an unusable ``--out`` folder before the model runs, and a
``--model`` folder that lacks weights is named precisely (not "has no config.json"); ``attnkit demo --model
/bad/path`` and ``attnkit explain --html /bad/dir/x.html`` are refused before anything is printed (exit 2,
one line naming the option)."""

from __future__ import annotations

import pytest

from attnkit import cli


@pytest.fixture
def no_model(monkeypatch):
    """Loading or running a model fails the test: the checks must come before it."""
    from attnkit._cli import demo
    from attnkit.apps import sentences

    def ran(*a, **k):
        raise AssertionError("the model (or the demo's first part) ran before --out / --model were checked")

    monkeypatch.setattr(sentences, "_load", ran)
    monkeypatch.setattr(demo, "_explain_part", ran)


def _bad_outs(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return {"a file": (a_file, "a file"), "below a file": (a_file / "sub" / "dir", "is a file, not a folder")}


@pytest.mark.parametrize("command", ["show", "demo"])
@pytest.mark.parametrize("case", ["a file", "below a file"])
def test_bad_out_fails_fast_with_one_line(command, case, tmp_path, capsys, no_model):
    out_dir, says = _bad_outs(tmp_path)[case]
    rc = cli.main([command, "--out", str(out_dir)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", out
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"attnkit {command}: error: --out: ") and says in err and str(out_dir) in err


def test_a_folder_that_does_not_exist_yet_is_fine(tmp_path):
    from attnkit._cli import check_out_dir

    check_out_dir("--out", tmp_path / "new" / "deeper")  # created later, with its parents
    check_out_dir("--out", tmp_path)
    assert not (tmp_path / "new").exists()  # checking creates nothing


@pytest.mark.parametrize("command", ["show", "demo"])
def test_model_folder_with_config_and_no_weights_says_so(command, tmp_path, capsys, no_model):
    (tmp_path / "config.json").write_text("{}")
    rc = cli.main([command, "--model", str(tmp_path), "--out", str(tmp_path / "out")])
    _, err = capsys.readouterr()
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{str(tmp_path)!r} has config.json but no weights (model.safetensors / pytorch_model.bin" in err
    assert "no config.json" not in err and "--model" in err


def test_model_folder_messages_name_what_is_missing(tmp_path):
    from attnkit.integrations.minilm import ModelUnavailable, check_model_dir

    with pytest.raises(ModelUnavailable, match=r"has no config\.json;"):
        check_model_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelUnavailable, match=r"has no config\.json \(it has weights\)"):
        check_model_dir(tmp_path)
    with pytest.raises(ModelUnavailable, match=r"is not a directory \(no such directory\)"):
        check_model_dir(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    assert check_model_dir(tmp_path) == tmp_path
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text("{}")
    (sharded / "model.safetensors.index.json").write_text("{}")
    assert check_model_dir(sharded) == sharded  # a sharded checkpoint is weights too
    (sharded / "model.safetensors.index.json").unlink()
    with pytest.raises(ModelUnavailable, match=r"has config\.json but no weights .* model\.save_pretrained\(path\)"):
        check_model_dir(sharded)


# ---------------------------------------------------------------- demo --model, explain --html: refused up front

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


@pytest.mark.parametrize("where", ["missing-folder", "a-folder", "a-full-disk"])
def test_explain_html_checks_the_path_before_printing(tmp_path, capsys, monkeypatch, where):
    path = tmp_path / "nope" / "x.html" if where == "missing-folder" else tmp_path
    if where == "a-full-disk":
        # a path that passes every check and fails only in the write (a full disk, /dev/full, /proc as root): the
        # page is written before the tables are printed, so that failure is the only output too
        import errno
        from pathlib import Path

        path = tmp_path / "page.html"

        def full(self, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(Path, "write_text", full)
    rc, out, err = _run(capsys, ["explain", "--html", str(path)])
    assert rc == 2
    assert out == ""  # before: the whole explanation was printed, then the write failed
    assert err.startswith("attnkit explain: error: --html:") and err.strip().count("\n") == 0
    assert {"missing-folder": "does not exist", "a-folder": "a directory",
            "a-full-disk": "could not write"}[where] in err
    if where == "a-full-disk":
        assert "No space left on device" in err and not path.exists()


@pytest.mark.parametrize("argv, needle", [
    (["--example", "cat", "--q", "q.txt", "--k", "q.txt", "--v", "q.txt"], "--example: runs a built-in example"),
    (["--example", "random", "--q", "q.txt", "--k", "q.txt", "--v", "q.txt"], "got both (--example random)"),
    (["--seed", "3"], "--seed: seeds --example random only, got --seed 3 with the default 3-token example"),
    (["--seed", "3", "--example", "cat"], "got --seed 3 with --example cat"),
])
def test_explain_options_that_would_be_ignored_are_refused(tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "q.txt").write_text("1 0\n0 1\n")
    rc, out, err = _run(capsys, ["explain", *argv])
    assert rc == 2 and out == "" and err.startswith("attnkit explain: error: ") and needle in err, err


def test_explain_html_still_writes_a_good_path(tmp_path, capsys):
    rc, out, _ = _run(capsys, ["explain", "--html", str(tmp_path / "p.html")])
    assert rc == 0 and (tmp_path / "p.html").stat().st_size > 1000 and "5.0000" in out


@pytest.mark.parametrize("argv, names", [(["explain", "--precision", "17"], "--precision"),
                                         (["masks", "-L", "65"], "-L"), (["long", "--length", "0"], "--length"),
                                         (["explain", "--seed", "-1"], "--seed"), (["explain", "--bogus"], "--bogus")])
def test_a_mistake_argparse_finds_is_one_line_too(capsys, argv, names):
    """docs/cli.md: a mistake is one line on stderr and exit status 2 — argparse's own (a value its type refuses,
    an unknown option) printed its usage block first."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1 and "error:" in err and names in err and "--help lists the options" in err
