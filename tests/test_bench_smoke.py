"""`attnkit bench --quick` runs end to end (table, JSON, markdown), and rejects bad flags."""

from __future__ import annotations

import json
import math

import pytest

from attnkit import cli


def _ms(s):  # the report's millisecond format
    if s is None:
        return "n/a"
    return f"{s * 1e3:.1f}" if s < 10 else f"{s:.1f}s"


@pytest.mark.slow
def test_bench_quick_smoke(tmp_path, capsys):
    js, md = tmp_path / "r.json", tmp_path / "B.md"
    peers = ["sdpa", "naive", "auto", "tiled"]
    rc = cli.main(["bench", "--quick", "--cases", "window,alibi", "--dtypes", "fp32", "--length", "256",
                   "--repeats", "2", "--memory", "2048", "--peers", ",".join(peers),
                   "--json", str(js), "--markdown", str(md), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| window-256 float32 fwd |" in out and "tiled x SDPA" in out
    data = json.loads(js.read_text())
    rows = {(r["case"], r["mode"], r["peer"]): r for r in data["results"]}
    assert {(c, m, p) for c in ("window", "alibi") for m in ("fwd", "fwdbwd") for p in peers} <= set(rows)
    assert rows[("window", "fwd", "tiled")]["median_s"] > 0
    assert rows[("window", "fwd", "auto")]["backend_ran"] == "tiled"
    # every non-SDPA peer's ratio is a positive finite number equal to sdpa_median / peer_median
    for (case, mode, peer), r in rows.items():
        if peer == "sdpa" or not r["median_s"]:
            continue
        sdpa_med = rows[(case, mode, "sdpa")]["median_s"]
        assert sdpa_med > 0 and math.isfinite(sdpa_med)
        x = r["x_sdpa"]
        assert x is not None and x > 0 and math.isfinite(x), (case, mode, peer, x)
        assert x == pytest.approx(sdpa_med / r["median_s"], rel=1e-9), (case, mode, peer)
    assert data["memory"][0]["L"] == 2048 and data["memory"][0]["peak_rss_mib"] > 0
    text = md.read_text()
    assert "FLOPs: forward 4·B·H·L·S·D" in text
    assert f"torch {data['machine']['torch']}" in text
    # the time table holds this run's measured medians and ratios, row by row
    lines = text.splitlines()
    for case in ("window", "alibi"):
        for mode in ("fwd", "fwdbwd"):
            label = f"{case}-256 float32 {mode}"
            row = next(line for line in lines if line.startswith(f"| {label} |"))
            cells = [c.strip() for c in row.strip("|").split("|")]
            want = [label] + [_ms(rows[(case, mode, p)]["median_s"]) for p in peers]
            want += [f"{rows[(case, mode, p)]['x_sdpa']:.2f}" for p in ("tiled", "auto")]
            assert cells[:len(want)] == want, (row, want)


def test_bench_bad_flag(capsys):
    assert cli.main(["bench", "--cases", "nope"]) == 2
    assert "--cases" in capsys.readouterr().err
