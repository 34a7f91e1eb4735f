"""`attnkit bench` end to end on tiny inputs, its flag checks, its default size, and where it writes.

Tiny lengths and 2 rounds: the whole file runs in seconds. Nothing here compares a peer
with itself or looks for text the report template always prints: each assertion reads
something the run measured or computed from it.
"""

from __future__ import annotations

import json
import re

import pytest

from attnkit import bench, cli
from attnkit.backends import _native
from attnkit.bench import cases as bcases

L = 128


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    d = tmp_path / "cwd"
    d.mkdir()
    monkeypatch.chdir(d)  # anything written "by default" would land here
    return d


def test_bench_tiny_run_measures_every_peer_and_writes_only_where_asked(run_dir, tmp_path, capsys):
    out_dir = tmp_path / "asked"
    out_dir.mkdir()
    js, md = out_dir / "r.json", out_dir / "B.md"
    rc = cli.main(["bench", "--cases", "causal,window", "--length", str(L), "--repeats", "2",
                   "--peers", "sdpa,naive,auto,tiled", "--memory", "2048", "--json", str(js), "--markdown", str(md)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert list(run_dir.iterdir()) == []  # nothing in the working directory: no BENCHMARKS.md, no results file
    assert sorted(p.name for p in out_dir.iterdir()) == ["B.md", "r.json"]

    # stderr: the estimate comes first, then progress, then the wall time
    assert re.match(r"attnkit bench: 4 case\(s\) × 4 peer\(s\) .*estimated (under 1|\d+) s", err)
    assert "] 17/17 " in err and re.search(r"done in (under 1|\d+) s \(estimated (under 1|\d+) s\)", err)

    data = json.loads(js.read_text())
    rows = {(r["case"], r["mode"], r["peer"]): r for r in data["results"]}
    assert len(rows) == 2 * 2 * 4 and {r["L"] for r in rows.values()} == {L}
    for key, r in rows.items():
        assert r["n"] == 2 and r["median_s"] > 0 and r["first_call_s"] > 0, key  # 2 rounds, each peer timed
    # a window of 256 covers every key at L = 128: auto simplifies it to causal, past the defaults' crossover (64)
    # on the compiled kernel (where it is built)
    assert rows[("window", "fwd", "auto")]["backend_ran"] == ("tiled" if _native.available() else "sdpa")
    for case in ("causal", "window"):
        for mode in ("fwd", "fwdbwd"):
            sdpa, tiled = rows[(case, mode, "sdpa")], rows[(case, mode, "tiled")]
            # ratios against SDPA of the same run, > 1 = faster than SDPA
            assert tiled["x_sdpa"] == pytest.approx(sdpa["median_s"] / tiled["median_s"])
            # useful GFLOP/s: 4·B·H·L·S·D·f (causal at L=128: f = 129/256), ×3.5 with the backward
            f = 129 / 256  # both masks here keep the lower triangle (the window of 256 is wider than L)
            want = 4 * 1 * 8 * L * L * 64 * f * (3.5 if mode == "fwdbwd" else 1) / tiled["median_s"] / 1e9
            assert tiled["gflops"] == pytest.approx(want, rel=1e-9)
    mem = data["memory"]
    assert [m["L"] for m in mem] == [2048] and mem[0]["peak_rss_mib"] > mem[0]["setup_rss_mib"] > 50

    # the table on stdout has one row per case run, with the measured median of each peer
    tiled = rows[("window", "fwd", "tiled")]
    row = next(ln for ln in out.splitlines() if ln.startswith(f"| window-{L} float32 fwd |"))
    assert f"{tiled['median_s'] * 1e3:.1f}" in row and f"{tiled['x_sdpa']:.2f}" in row
    # the markdown page holds exactly one generated section, which update_md can replace
    page = md.read_text()
    assert page.count(bench.report.END) == 1 and row in page
    assert bench.report.splice(page, "X\n").endswith(f"X\n{bench.report.END}\n")


def test_default_run_writes_nothing(run_dir, capsys, monkeypatch):
    monkeypatch.setattr(bench.runner, "memory_rows", lambda lengths, progress=None: [])  # no subprocess here
    rc = cli.main(["bench", "--cases", "window", "--modes", "fwd", "--length", "64", "--repeats", "1",
                   "--peers", "sdpa,tiled", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "| window-64 float32 fwd |" in out
    assert list(run_dir.iterdir()) == [] and "wrote" not in err


@pytest.mark.parametrize("argv, flag", [
    (["--repeats", "0"], "--repeats"),
    (["--repeats", "-3"], "--repeats"),
    (["--budget", "-1"], "--budget"),
    (["--budget", "0"], "--budget"),
    (["--cases", "nope"], "--cases"),
    (["--cases", "window,nope"], "--cases"),
    (["--dtypes", "fp16"], "--dtypes"),
    (["--modes", "bwd"], "--modes"),
    (["--peers", "xformers"], "--peers"),
    (["--length", "0"], "--length"),
    (["--memory", "8k"], "--memory"),
    (["--memory", "0"], "--memory"),
    (["--json", "/nonexistent-dir/r.json"], "--json"),
    (["--markdown", "."], "--markdown"),
    # past this machine's memory, refused by the estimate before anything is allocated (--dry-run too)
    (["--length", "100000000", "--dry-run"], "--length"),
    (["--memory", "100000000", "--dry-run"], "--memory"),
])
def test_bad_flag_is_one_line_naming_it(run_dir, capsys, argv, flag):
    rc = cli.main(["bench", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"attnkit bench: error: {flag}: "), err
    assert list(run_dir.iterdir()) == []


def test_default_is_small_and_full_is_the_suite():
    cases, peers = bench.select()
    assert {c.L for c in cases} == {bcases.DEFAULT_SIZE} and len(cases) == 8 and "flex" not in peers
    full, full_peers = bench.select(full=True)
    assert len(full) == 24 and max(c.L for c in full) == 16384 and "flex" in full_peers
    # on the 2-core machine BENCHMARKS.md was measured on (matmul ~140 GFLOP/s): default ~1 min, full ~20+ min
    quick = bench.estimate(cases, peers, repeats=5, budget=2.0, memory=[8192], rate=140)
    slow = bench.estimate(full, full_peers, repeats=7, budget=20.0, memory=[65536, 131072], rate=140)
    assert 10 < quick < 90 and slow > 15 * 60


def test_dry_run_prints_the_plan_and_runs_nothing(run_dir, capsys, monkeypatch):
    monkeypatch.setattr(bench.runner, "run_case", lambda *a, **k: pytest.fail("--dry-run ran a case"))
    rc = cli.main(["bench", "--dry-run", "--cases", "document", "--modes", "fwd"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.split() == ["document-2048", "float32", "fwd"]
    assert "1 case(s) × 4 peer(s)" in err and "estimated" in err and "--full" in err


def test_durations_read_as_a_person_reads_them():
    from attnkit._cli.bench import _fmt_s

    assert [_fmt_s(x) for x in (0.2, 42, 7 * 60, 3.5 * 3600, 12 * 86400, 2.5e9 * 60)] == [
        "under 1 s", "42 s", "7 min", "3.5 h", "12 days", "1,736,111 days"]


def test_what_does_not_fit_is_named_with_its_size():
    cases, peers = bench.select(cases="window", modes="fwdbwd", length=65536)
    need = bench.runner.case_bytes(cases[0], peers)
    # q, k, v, out, their gradients and saved tensors (10 × B·H·L·D fp32) and SDPA's (L, S) bool mask
    assert need == 10 * 8 * 65536 * 64 * 4 + 65536 ** 2
    bench.runner.check_fits(cases, peers, have=2 * need)
    with pytest.raises(bench.BenchSettingsError, match=r"window-65536 float32 fwdbwd needs about 5\.2 GiB \(q, k, v, "
                                                       r"output, gradients, SDPA's dense mask\)"):
        bench.runner.check_fits(cases, peers, have=need)
    bench.runner.check_fits(cases, ["auto", "tiled"], have=need)  # without SDPA's mask it fits
