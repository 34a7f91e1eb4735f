"""``attnkit show`` and ``attnkit demo`` refuse an unusable ``--out`` folder before the model runs, and a
``--model`` folder that lacks weights is named precisely (not "has no config.json")."""

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
