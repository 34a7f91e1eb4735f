"""`attnkit bench --quick` runs end to end (table, JSON, markdown), and rejects bad flags."""

from __future__ import annotations

import json

import pytest

from attnkit import cli


@pytest.mark.slow
def test_bench_quick_smoke(tmp_path, capsys):
    js, md = tmp_path / "r.json", tmp_path / "B.md"
    rc = cli.main(["bench", "--quick", "--cases", "window,alibi", "--dtypes", "fp32", "--length", "256",
                   "--repeats", "2", "--memory", "2048", "--peers", "sdpa,naive,auto,tiled",
                   "--json", str(js), "--markdown", str(md), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| window-256 float32 fwd |" in out and "tiled x SDPA" in out
    data = json.loads(js.read_text())
    rows = {(r["case"], r["mode"], r["peer"]): r for r in data["results"]}
    assert rows[("window", "fwd", "tiled")]["median_s"] > 0
    assert rows[("window", "fwd", "auto")]["backend_ran"] == "tiled"
    assert rows[("alibi", "fwdbwd", "sdpa")]["x_sdpa"] == pytest.approx(1.0)
    assert data["memory"][0]["L"] == 2048 and data["memory"][0]["peak_rss_mib"] > 0
    text = md.read_text()
    assert "FLOPs: forward 4·B·H·L·S·D" in text and "torch" in text


def test_bench_bad_flag(capsys):
    assert cli.main(["bench", "--cases", "nope"]) == 2
    assert "--cases" in capsys.readouterr().err
