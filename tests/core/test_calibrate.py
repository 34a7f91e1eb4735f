"""``auto``'s crossovers measured on this machine (issue 28, item 2): the table, its cache file per CPU /
torch / attnkit / threads, what a corrupt or foreign file, a failure and an interrupt give, the switch, the
budget and ``attnkit calibrate``.

Most tests replace the measurement by a model of it (``fake``): the decisions, the file and the messages
are what is tested, not this machine's timings. One test measures for real, with a tiny budget.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from conftest import assert_close, budget, rand_qkv

import attnkit
from attnkit import _calibrate as C
from attnkit import cli
from attnkit.backends import _native

# the fake machine: the kernel wins causal from L = 256, no mask from L·S = 1024², loses bf16, wins fp16, and wins
# bf16 with gradients (torch's bf16 backward slow, as on a CPU without bf16 instructions)
RATIO = {("none", "bfloat16", "grad"): lambda L: 3.0,
         ("causal", "float32"): lambda L: 1.3 if L >= 256 else 0.8,
         ("none", "float32"): lambda L: 1.1 if L >= 1024 else 0.95,
         ("causal", "bfloat16"): lambda L: 0.4, ("none", "bfloat16"): lambda L: 1.4 if L == 64 else 0.5,
         ("causal", "float16"): lambda L: 1.5, ("none", "float16"): lambda L: 1.2,
         ("rows", "float32"): lambda L: 1.6, ("mask", "float32"): lambda L: 1.3}


class Fake:
    """A stand-in for ``_measure_point``: times from RATIO, each point costing ``cost`` seconds of a fake clock; and
    for ``_measure_order``: memory order ``order_ratio`` times register-blocked's time (no clock time: the real one
    is a tenth of a second), its calls counted in ``orders``."""

    def __init__(self, monkeypatch, cost=0.0, fail_at=None, exc=None, order_ratio=1.2):
        self.now, self.cost, self.calls, self.fail_at = 0.0, cost, [], fail_at
        self.exc = RuntimeError("the kernel fell over") if exc is None else exc
        self.tables = []
        self.order_ratio, self.orders = order_ratio, 0
        monkeypatch.setattr(C, "_measure_point", self)
        monkeypatch.setattr(C, "_measure_order", self.order)
        monkeypatch.setattr(C, "_warm_backward", lambda: None)
        monkeypatch.setattr(C, "_clock", lambda: self.now)

    def __call__(self, case, dtype, L, backward, deadline, clock, S=None):
        self.tables.append(C.crossovers())  # what the measured call would see
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise self.exc
        self.calls.append((case, dtype, L, backward))
        self.now += self.cost
        sdpa = 1e-3 * L / 64
        ratio = RATIO.get((case, dtype, "grad"), RATIO[case, dtype]) if backward else RATIO[case, dtype]
        return sdpa / ratio(L), sdpa, 5

    def order(self, deadline, clock):
        self.orders += 1
        return [C.OrderPoint(H, Hkv, C.ORDER_KEYS, C.ORDER_D, "float32", 1.0, self.order_ratio, 5)
                for H, Hkv in C.ORDER_HEADS]


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """Calibration on, its files under tmp_path; the in-process table forgotten before and after."""
    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(C.ENV_SWITCH, "on")
    C.forget()
    yield tmp_path
    C.forget()


def _one_warning(caught):
    ours = [w for w in caught if "calibration" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    return str(ours[0].message)


def test_defaults_are_todays_table_and_say_so(cache):
    c = C.crossovers()
    assert (c.native_causal_min, c.native_dense_min_ls, c.bf16, c.fp16) == (C.DEFAULT_NATIVE_CAUSAL_MIN, 1024 * 1024,
                                                                             None, None)
    assert not c.calibrated and c.source.startswith("defaults (no calibration for this CPU")
    assert "attnkit calibrate" in c.source and f"{torch.get_num_threads()} thread" in c.source
    assert C.crossovers() is c  # memoised: a dict lookup on dispatch's hot path


def test_calibration_decides_from_the_measurements_and_is_stored_where_the_env_says(cache, monkeypatch):
    fake = Fake(monkeypatch)
    n = torch.get_num_threads()
    c = C.calibrate(budget_s=2.0)
    assert (c.native_causal_min, c.native_dense_min_ls, c.bf16, c.fp16) == (256, 1024 * 1024, "torch", "kernel")
    assert c.bf16_grad is None  # forward only (the first-use calibration): bf16 with gradients keeps today's rule
    # at L = S = 64 each dtype is its own decision: bf16's kernel loses at 512 and wins at 64 here
    assert (c.bf16_small, c.fp16_small) == ("kernel", "kernel")
    assert c.small_mask == "kernel"  # (a bool mask of one tile: the kernel 1.3x faster here)
    assert c.calibrated and c.failure is None and len(c.points) == len(fake.calls) == 16
    files = list(cache.glob("calibration-*.json"))
    assert files == [C.cache_path(n)] and files[0].name.endswith(f"-{n}t.json") and c.path == str(files[0])
    data = json.loads(files[0].read_text())
    assert data["key"] == C.machine_key(n) and data["key"]["torch"] == torch.__version__
    assert data["crossovers"] == {"native_causal_min": 256, "native_dense_min_ls": 1048576, "bf16": "torch",
                                  "fp16": "kernel", "bf16_grad": None, "bf16_small": "kernel",
                                  "fp16_small": "kernel", "few_rows_grad": None, "decode_order": "blocked",
                                  "small_mask": "kernel"}
    assert not list(cache.glob(".calibration-*"))  # the temporary file was renamed, none left behind
    # this process decides by it now, and a fresh one reads it back from the file
    assert C.crossovers() is c
    C.forget()
    again = C.crossovers()
    assert again.calibrated and len(again.points) == 16
    assert (again.native_causal_min, again.bf16, again.bf16_small) == (256, "torch", "kernel")
    assert again.source.startswith("calibrated ") and f"{n} thread" in again.source and files[0].name in again.source
    assert again.source.split(" on ")[1].startswith(C.machine_key()["cpu"].split(" [")[0])


def test_one_file_per_thread_count_cpu_and_torch_version(cache, monkeypatch):
    Fake(monkeypatch)
    one, two = C.calibrate(threads=1), C.calibrate(threads=2)
    assert one.path != two.path and one.path.endswith("-1t.json") and two.path.endswith("-2t.json")
    assert "1 thread (" in one.source and "2 threads" in two.source
    assert C.crossovers(1).path == one.path and C.crossovers(2).path == two.path
    here = C.cache_path(2)
    monkeypatch.setattr(C, "_KEY", {**C.machine_key(), "torch": "9.9.9"})
    assert C.cache_path(2) != here  # another torch version: another file
    monkeypatch.setattr(C, "_KEY", {**C.machine_key(), "cpu": "Some Other CPU [avx512f]"})
    assert C.cache_path(2) != here


def test_the_thread_count_is_restored(cache, monkeypatch):
    Fake(monkeypatch)
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    seen = []
    monkeypatch.setattr(C, "_measure_point", lambda *a, **kw: seen.append(torch.get_num_threads()) or (1e-3, 1e-3, 3))
    C.calibrate(threads=other)
    assert set(seen) == {other} and torch.get_num_threads() == before


@pytest.mark.parametrize("content, says", [
    ("{not json", "corrupt: JSONDecodeError"),
    (json.dumps({"key": {"schema": C.SCHEMA}}), "is for another cpu"),
    ('{"key": {"schema": 1}}', "has schema 1, not"),  # a file of the layout before bf16_grad
    ("[1, 2]", "corrupt: ValueError: no 'key' object"),
])
def test_a_corrupt_or_foreign_file_gives_the_defaults_and_is_rewritten(cache, monkeypatch, content, says):
    path = C.cache_path()
    path.write_text(content)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = C.crossovers()
        C.crossovers()  # (memoised: read, and warned about, once)
    if "corrupt" in says:  # one warning for a corrupt file; none for another machine's or version's
        assert "will be rewritten" in _one_warning(caught)
    else:
        assert not [w for w in caught if "calibration" in str(w.message)]
    assert not c.calibrated and (c.native_causal_min, c.native_dense_min_ls) == (C.DEFAULT_NATIVE_CAUSAL_MIN,
                                                                             1024 * 1024)
    assert c.source.startswith("defaults (") and says in c.source and "will be rewritten" in c.source
    Fake(monkeypatch)
    assert C.calibrate().calibrated
    C.forget()
    assert C.crossovers().calibrated and json.loads(path.read_text())["key"] == C.machine_key()


def _stored(cache, monkeypatch, **key):
    """A valid file for this machine, then its key changed to ``key``."""
    fake = Fake(monkeypatch)
    path = C.cache_path()
    C.calibrate()
    data = json.loads(path.read_text())
    data["key"].update(key)
    path.write_text(json.dumps(data))
    C.forget()
    return fake, path


@pytest.mark.parametrize("key, says", [
    ({"cpu": "Intel Xeon Platinum 8480 [avx512f amx_bf16]"}, "another cpu 'Intel Xeon Platinum 8480"),
    ({"torch": "2.0.0"}, "another torch '2.0.0'"),
    ({"threads": 64}, "another threads 64"),
    ({"attnkit": "0.0.1"}, "another attnkit '0.0.1'"),
    ({"schema": 0}, "has schema 0"),
])
def test_a_file_from_another_cpu_or_torch_version_is_ignored_and_rewritten(cache, monkeypatch, key, says):
    _, path = _stored(cache, monkeypatch, **key)
    c = C.crossovers()
    assert not c.calibrated and says in c.source and "will be rewritten" in c.source, c.source
    C.calibrate()
    C.forget()
    assert C.crossovers().calibrated and json.loads(path.read_text())["key"] == C.machine_key()


@pytest.mark.parametrize("field, value", [("native_causal_min", -4), ("native_causal_min", "256"),
                                          ("bf16", "fast"), ("native_dense_min_ls", None),
                                          ("decode_order", "kernel")])
def test_a_file_with_bad_values_is_corrupt(cache, monkeypatch, field, value):
    _, path = _stored(cache, monkeypatch)
    data = json.loads(path.read_text())
    data["crossovers"][field] = value
    path.write_text(json.dumps(data))
    with pytest.warns(RuntimeWarning, match="corrupt"):
        c = C.crossovers()
    assert not c.calibrated and "corrupt" in c.source and field in c.source


@pytest.mark.parametrize("field, value", [("elapsed_s", "0.3 s"), ("points", "none"), ("points", [{"case": 1}]),
                                          ("points", [{"case": "causal", "dtype": "float32", "L": 64.5, "S": 64,
                                                       "mode": "fwd", "kernel_ms": 1.0, "sdpa_ms": 1.0,
                                                       "rounds": 3}]),
                                          ("order_points", {"H": 8}),
                                          ("order_points", [{"H": 8, "Hkv": 8, "S": 4096, "D": 128,
                                                             "dtype": "float32", "blocked_ms": -1.0,
                                                             "memory_ms": 1.0, "rounds": 3}]),
                                          ("defaults_kept", "bf16")])
def test_a_file_with_a_bad_record_beside_its_table_is_corrupt_and_show_still_prints(cache, monkeypatch, capsys,
                                                                                    field, value):
    """The table may be sound and the record of its measurement not (a hand edit): the file is corrupt as a
    whole, and ``--show`` says so instead of failing on the record."""
    _, path = _stored(cache, monkeypatch)
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    with pytest.warns(RuntimeWarning, match="corrupt"):
        c = C.crossovers()
    assert not c.calibrated and "corrupt" in c.source and field in c.source
    with pytest.warns(RuntimeWarning, match="corrupt"):
        rc, out, _ = _cli(capsys, "--show")
    assert rc == 0 and "corrupt" in out, out


def test_the_hint_names_the_thread_count_and_a_cache_directory_that_is_a_file(cache, monkeypatch):
    n = torch.get_num_threads()
    assert C.crossovers().source.endswith("run `attnkit calibrate`)")
    C.forget()
    assert C.crossovers(n + 1).source.endswith(f"run `attnkit calibrate --threads {n + 1}`)")
    blocker = cache / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv(C.ENV_DIR, str(blocker))
    C.forget()
    assert "is a file; set ATTNKIT_CACHE_DIR to a folder" in C.crossovers().source


def test_a_new_table_in_this_process_takes_over_the_remembered_decisions(cache, monkeypatch):
    """The fast path remembers each call's route; a new table in the same process (a file then forget(), or a
    calibration) must not leave it replaying the route the old table chose while dispatch reports the new one."""
    import torch.nn.functional as F

    _stored(cache, monkeypatch)  # the fake machine: the kernel from L = 256 causal
    q, k, v = rand_qkv(1, 8, 8, 512, 512, 64)
    for _ in range(2):
        attnkit.attention(q, k, v, causal=True)  # learned: the kernel
    assert attnkit.dispatch(q, k, v, causal=True).backend == "tiled"
    path = C.cache_path()
    data = json.loads(path.read_text())
    data["crossovers"]["native_causal_min"] = 4096  # now SDPA up to 4096
    path.write_text(json.dumps(data))
    C.forget()
    assert attnkit.dispatch(q, k, v, causal=True).backend == "sdpa"
    seen = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: seen.append(1) or sdpa(*a, **kw))
    attnkit.attention(q, k, v, causal=True)
    assert seen, "the call replayed the old table's route"


@pytest.mark.parametrize("exc, says", [(RuntimeError("the kernel fell over"), "failed (RuntimeError: the kernel"),
                                       (KeyboardInterrupt(), "interrupted")])
def test_a_failed_or_interrupted_calibration_gives_the_defaults_with_one_warning(cache, monkeypatch, exc, says):
    Fake(monkeypatch, fail_at=3, exc=exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = C.calibrate()
    msg = _one_warning(caught)
    assert says in msg and "else the defaults" in msg and "nothing was written" in msg
    assert not c.calibrated and c.failure is not None and says in c.source
    assert (c.native_causal_min, c.native_dense_min_ls, c.bf16) == (C.DEFAULT_NATIVE_CAUSAL_MIN, 1024 * 1024, None)
    assert not list(cache.iterdir())  # nothing written, no temporary file left
    # attention keeps working, on the defaults
    assert not C.crossovers().calibrated
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 16)
    out = attnkit.attention(q, k, v, causal=True)
    ref = attnkit.attention(q, k, v, causal=True, backend="eager")
    assert (out - ref).abs().max().item() < 1e-5


def test_a_failed_calibration_leaves_the_previous_file_in_use(cache, monkeypatch):
    _, path = _stored(cache, monkeypatch)
    before = path.read_text()
    Fake(monkeypatch, fail_at=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert C.calibrate().failure
    _one_warning(caught)
    assert path.read_text() == before and C.crossovers().calibrated


def test_a_cache_that_cannot_be_written_keeps_the_measurement_in_this_process(cache, monkeypatch, capsys):
    blocker = cache / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv(C.ENV_DIR, str(blocker / "attnkit"))  # a folder below a file cannot be made
    Fake(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = C.calibrate()
    msg = _one_warning(caught)
    assert "could not be stored" in msg and C.ENV_DIR in msg
    assert c.calibrated and c.path is None and "(not stored: " in c.source and C.crossovers() is c
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        rc, out, _ = _cli(capsys)
    took = [line for line in out.splitlines() if line.startswith("took ")]
    assert rc == 1 and len(took) == 1 and "; not stored: " in took[0], out  # nothing stored: not a success


def test_the_off_switch_gives_the_defaults_even_with_a_file(cache, monkeypatch):
    _stored(cache, monkeypatch)
    assert C.crossovers().calibrated
    monkeypatch.setenv(C.ENV_SWITCH, "off")
    C.forget()
    c = C.crossovers()
    assert not c.calibrated and c.source == f"defaults (calibration switched off: {C.ENV_SWITCH}=off)"


def test_an_unknown_switch_value_warns_once_and_reads_the_file(cache, monkeypatch):
    _stored(cache, monkeypatch)
    monkeypatch.setenv(C.ENV_SWITCH, "sometimes")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert C.crossovers().calibrated and C.crossovers().calibrated
    assert len(caught) == 1 and "'on', 'off' or 'first-use'" in str(caught[0].message)


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.setattr(C.os, "getloadavg", lambda: (0.1, 0.1, 0.1))


def test_first_use_calibrates_once_and_nothing_runs_by_default(cache, monkeypatch, quiet):
    fake = Fake(monkeypatch)
    assert not C.crossovers().calibrated and fake.calls == []  # "on": nothing measured on its own
    monkeypatch.setenv(C.ENV_SWITCH, "first-use")
    monkeypatch.setattr(C._local, "tried", False)
    C.forget()
    c = C.crossovers()
    assert c.calibrated and len(fake.calls) == 16 and C.cache_path().exists()
    C.forget()
    assert C.crossovers().calibrated and len(fake.calls) == 16  # read back, not measured again


def test_first_use_waits_for_a_quiet_machine(cache, monkeypatch):
    fake = Fake(monkeypatch)
    monkeypatch.setattr(C.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    monkeypatch.setenv(C.ENV_SWITCH, "first-use")
    monkeypatch.setattr(C._local, "tried", False)
    c = C.crossovers()
    assert not c.calibrated and fake.calls == [] and not C.cache_path().exists()
    assert "first-use calibration skipped: load 64.0 on" in c.source and "attnkit calibrate" in c.source


def test_a_failing_first_use_warns_once_and_is_not_retried(cache, monkeypatch, quiet):
    fake = Fake(monkeypatch, fail_at=0)
    monkeypatch.setenv(C.ENV_SWITCH, "first-use")
    monkeypatch.setattr(C._local, "tried", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = C.crossovers()
        for _ in range(3):
            assert C.crossovers() is c
        C.forget()
        assert not C.crossovers().calibrated
    _one_warning(caught)
    assert not c.calibrated and c.source.startswith("defaults (calibration failed") and len(fake.tables) == 1


def test_the_measured_calls_see_every_dtype_on_the_kernel(cache, monkeypatch):
    fake = Fake(monkeypatch)
    C.calibrate()
    assert fake.tables and all(t.bf16 == "kernel" and t.fp16 == "kernel" for t in fake.tables)
    assert C.crossovers().bf16 == "torch"  # outside the calibration: the measured choice


def test_a_kept_default_names_the_size_whose_points_were_not_measured(cache, monkeypatch):
    """The small bf16 / fp16 points (64 × 64) are measured before the 512s: a budget that ends between them lists
    measured bf16 rows, and the kept defaults say which size they are for (they said "bf16, fp16" beside bf16 rows)."""
    fake = Fake(monkeypatch, cost=0.25)
    c = C.calibrate(budget_s=2.75)  # (the fake clock: eleven points of 0.25 s, the last two the 64 × 64 bf16 / fp16)
    assert [x[:3] for x in fake.calls if x[1] != "float32"] == [("none", "bfloat16", 64), ("none", "float16", 64)]
    assert c.source.endswith("; defaults kept for bf16 at 512 × 512, fp16 at 512 × 512 (not measured in the budget)")
    assert (c.bf16, c.fp16) == (None, None) and c.bf16_small is not None and c.fp16_small is not None


def test_the_budget_bounds_the_measurement_and_the_rest_keeps_its_default(cache, monkeypatch):
    fake = Fake(monkeypatch, cost=0.25)
    c = C.calibrate(budget_s=1.25)  # (causal 64, 128, the bool mask of one tile, causal 256, 512)
    assert len(fake.calls) == 5 and {x[:2] for x in fake.calls} == {("causal", "float32"), ("mask", "float32")}
    assert c.calibrated and c.native_causal_min == 256  # measured: 64, 128 lose, 256, 512 win
    assert c.small_mask == "kernel"
    assert (c.native_dense_min_ls, c.bf16, c.fp16, c.bf16_grad) == (1024 * 1024, None, None, None)
    kept = ("defaults kept for no mask, bf16 at 512 × 512, fp16 at 512 × 512, bf16 at 64 × 64, fp16 at 64 × 64, the "
            "decode's read order (not measured in the budget)")
    assert kept in c.source  # (bf16 with gradients:
    # planned only with backward=True, so not "kept" here)
    small = C.calibrate(budget_s=1.0, backward=True)
    assert small.bf16_grad is None and small.few_rows_grad is None and small.small_mask is None
    assert small.source.endswith("fp16 at 64 × 64, bf16 with gradients at 256 × 256, a few rows with gradients, the "
                                 "decode's read order, a bool mask of one 64 × 64 tile (not measured in the budget)")


def test_backward_decides_bf16_with_gradients_apart_from_bf16s_forward(cache, monkeypatch):
    fake = Fake(monkeypatch)
    c = C.calibrate(backward=True)
    assert ("none", "bfloat16", C.GRAD_LENGTH, True) in fake.calls
    assert (c.bf16, c.bf16_grad) == ("torch", "kernel")  # the fake's bf16: forward loses, forward + backward wins
    C.forget()
    assert C.crossovers().bf16_grad == "kernel"  # stored and read back


def test_backward_decides_a_few_rows_with_gradients_from_one_row_over_a_long_cache(cache, monkeypatch):
    """fp32 with gradients at a few query rows: one query row over ROWS_KEYS keys, forward + backward (planned with
    backward only), stored and read back; its point never moves the causal or no-mask crossovers."""
    fake = Fake(monkeypatch)
    c = C.calibrate(backward=True)
    assert ("rows", "float32", 1, True) in fake.calls
    rows = [p for p in c.points if p.case == "rows"]
    assert len(rows) == 1 and (rows[0].L, rows[0].S, rows[0].mode) == (1, C.ROWS_KEYS, "fwd+bwd")
    assert c.few_rows_grad == "kernel" and c.native_causal_min == 256  # the fake's rows: 1.6x
    C.forget()
    assert C.crossovers().few_rows_grad == "kernel"
    assert C.calibrate(budget_s=2.0).few_rows_grad is None  # forward only: today's rule
    slow = C.Point("rows", "float32", 1, C.ROWS_KEYS, "fwd+bwd", 1.0, 0.9, 5)
    values, kept = C._decide([slow, *_pts("causal", [(64, 1)])], backward=True)
    assert values["few_rows_grad"] == "torch" and values["native_causal_min"] == 64
    assert "a few rows with gradients" not in kept
    tie = C.Point("rows", "float32", 1, C.ROWS_KEYS, "fwd+bwd", 1.0, 1.02, 5)  # a tie stays on SDPA
    assert C._decide([tie], backward=True)[0]["few_rows_grad"] == "torch"


def test_the_few_rows_gradient_rule():
    """What SDPA's ``declines`` asks of an fp32 call with gradients at a few rows over a long cache: the measured
    choice, else today's rule (the kernel)."""
    d = C.Crossovers(source="defaults (no calibration for this CPU)")
    assert "(table: defaults (no calibration for this CPU))" in d.few_rows_grad_to_kernel(4096)  # the table named
    assert "(table: defaults (no calibration" in d.grad_to_kernel(torch.bfloat16, lambda: False)
    why = C.Crossovers(few_rows_grad="kernel", source="calibrated 2026-11-28 on X").few_rows_grad_to_kernel(4096)
    assert ">= 4096 keys" in why and "measured faster than SDPA here (calibrated 2026-11-28 on X)" in why
    assert C.Crossovers(few_rows_grad="torch").few_rows_grad_to_kernel(4096) is None


def test_backward_measures_both_modes_and_needs_both_won(cache, monkeypatch):
    fake = Fake(monkeypatch)
    c = C.calibrate(backward=True)
    assert {x[3] for x in fake.calls if x[1] == "float32"} == {False, True}
    assert {p.mode for p in c.points} == {"fwd", "fwd+bwd"} and c.native_causal_min == 256


def _pts(case, wins):
    return [C.Point(case, "float32", L, L, "fwd", 1.0, 1.2 if w else 1.0, 3) for L, w in wins]


@pytest.mark.parametrize("wins, want", [
    ([(64, 0), (128, 0), (256, 1), (512, 1)], 256),
    ([(64, 1), (128, 1)], 64),
    ([(64, 0), (128, 1), (256, 0), (512, 1)], 512),  # noise: the kernel must win at every larger size
    ([(64, 0), (128, 0)], 256),  # lost up to 128: the default (256) lies beyond what was measured
    ([(64, 0), (128, 0), (256, 0), (512, 0)], 1024),  # lost at 512: not before twice that
    ([], None),
])
def test_the_crossover_rule(wins, want):
    assert C._crossover(_pts("causal", wins), 256, lambda n: n) == want


def test_a_tie_stays_on_sdpa():
    close = C.Point("none", "float32", 1024, 1024, "fwd", 1.0, 1.02, 5)
    clear = C.Point("none", "float32", 1024, 1024, "fwd", 1.0, 1.04, 5)
    assert not close.kernel_wins and clear.kernel_wins and round(clear.ratio, 2) == 1.04


def test_the_dtype_rule_for_the_backends():
    """What tiled/native's ``native_unfit`` asks: the measured choice, else today's bf16 rule."""
    def hw():
        raise AssertionError("bf16_hardware asked although the table decided")

    today = C.Crossovers()
    assert today.torch_keeps(torch.float32, hw) is None and today.torch_keeps(torch.float16, hw) is None
    assert "multiplies bf16 in hardware" in today.torch_keeps(torch.bfloat16, lambda: True)
    assert today.torch_keeps(torch.bfloat16, lambda: False) is None
    measured = C.Crossovers(bf16="kernel", fp16="torch", source="calibrated 2026-11-26 on X")
    assert measured.torch_keeps(torch.bfloat16, hw) is None  # measured: the kernel, bf16 hardware or not
    why = measured.torch_keeps(torch.float16, hw)
    assert why.startswith("float16: torch's kernel measured faster") and "calibrated 2026-11-26 on X" in why
    assert C.Crossovers(bf16="torch").torch_keeps(torch.bfloat16, hw).startswith("bfloat16: torch's kernel")


def test_the_bf16_gradient_rule():
    """What SDPA's ``declines`` asks of a bf16 call that wants gradients: the measured choice, else today's rule
    (the kernel where the CPU has no bf16 instructions); never for another dtype."""
    def hw():
        raise AssertionError("bf16_hardware asked although the table decided")

    today = C.Crossovers()
    assert "no bf16 instructions" in today.grad_to_kernel(torch.bfloat16, lambda: False)
    assert today.grad_to_kernel(torch.bfloat16, lambda: True) is None
    assert today.grad_to_kernel(torch.float32, hw) is None and today.grad_to_kernel(torch.float16, hw) is None
    measured = C.Crossovers(bf16_grad="kernel", source="calibrated 2026-11-27 on X")
    why = measured.grad_to_kernel(torch.bfloat16, hw)
    assert why.startswith("bfloat16 with gradients: the compiled kernel measured faster") and "on X" in why
    assert C.Crossovers(bf16_grad="torch").grad_to_kernel(torch.bfloat16, hw) is None
    # forward-only bf16 points do not decide it, nor do forward + backward points decide bf16's forward
    fwd = C.Point("none", "bfloat16", 512, 512, "fwd", 1.0, 0.5, 3)
    grad = C.Point("none", "bfloat16", 256, 256, "fwd+bwd", 1.0, 4.0, 3)
    def choices(points):
        values = C._decide(points)[0]
        return tuple(values[n] for n in ("bf16", "fp16", "bf16_grad", "bf16_small"))

    assert choices([fwd]) == ("torch", None, None, None) and choices([grad]) == (None, None, "kernel", None)
    small = C.Point("none", "bfloat16", 64, 64, "fwd", 1.0, 1.3, 3)
    assert choices([fwd, small]) == ("torch", None, None, "kernel")  # 64's point decides only the small calls


def test_the_small_low_precision_rule():
    """What SDPA's ``declines`` asks of a bf16 / fp16 call without gradients below the fp32 crossovers: the measured
    choice at L = S = 64, else today's rule (the kernel where the CPU has no bf16 instructions); never for fp32."""
    def hw():
        raise AssertionError("bf16_hardware asked although the table decided")

    today = C.Crossovers()
    for dt in (torch.bfloat16, torch.float16):
        assert "without bf16 instructions" in today.small_to_kernel(dt, lambda: False)
        assert today.small_to_kernel(dt, lambda: True) is None
    assert today.small_to_kernel(torch.float32, hw) is None
    measured = C.Crossovers(bf16_small="kernel", fp16_small="torch", source="calibrated 2026-11-27 on X")
    why = measured.small_to_kernel(torch.bfloat16, hw)
    assert why.startswith("bfloat16 below the fp32 crossovers: torch's kernel in bfloat16 measured slower") and \
        "on X" in why
    assert measured.small_to_kernel(torch.float16, hw) is None


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"budget_s: expected a number of seconds > 0, got 0"):
        C.calibrate(budget_s=0)
    with pytest.raises(ValueError, match=r"threads: expected a whole number >= 1 or None .*got 0"):
        C.calibrate(threads=0)


def test_a_real_calibration_keeps_its_budget(cache):
    """The real measurement, briefly: it ends near its budget, on the compiled kernel when it is built."""
    c = C.calibrate(budget_s=0.3, write=False)
    assert c.elapsed_s is not None and c.elapsed_s < 0.3 + 0.5  # at most one warm-up past the budget
    if _native.available():
        assert c.calibrated and c.points and c.points[0].L == 64 and c.path is None and "(not written)" in c.source
    else:  # torch's kernel everywhere: nothing to compare, nothing written
        assert not c.calibrated and c.source.startswith("defaults (nothing to calibrate")
    assert not list(cache.iterdir())


@pytest.mark.parametrize("backward", [False, True])
def test_the_sdpa_side_is_timed_with_the_check_attnkit_runs_after_it(monkeypatch, backward):
    """attnkit's SDPA path reads the first column of every output (a zero row may hide a NaN); the kernel path does
    not: each SDPA round of the measurement runs the same check on SDPA's output, and no kernel round does. Without
    the compiled kernel there is nothing to compare: the point refuses, naming why."""
    if not _native.available():
        with pytest.raises(C._NoKernel, match="the compiled kernel is not available here"):
            C._measure_point("causal", "float32", 64, backward, deadline=1e9, clock=lambda: 0.0)
        return
    real = _native.suspect_rows_fn()
    seen: list[tuple] = []

    def counting(out):
        seen.append(tuple(out.shape))
        return real(out)

    monkeypatch.setattr(_native, "suspect_rows_fn", lambda: counting)
    clock = iter(float(i) * 1e-3 for i in range(10_000))
    got = C._measure_point("causal", "float32", 64, backward, deadline=1e9, clock=lambda: next(clock))
    assert got is not None
    rounds = got[2]
    assert seen and all(s == (1, C.H, 64, C.D) for s in seen)
    assert len(seen) == rounds + 1  # the warm-up and every SDPA round, once each


# --- attnkit calibrate --------------------------------------------------------------------------------------

def _cli(capsys, *argv):
    rc = cli.main(["calibrate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_measures_prints_the_table_and_stores_it(cache, monkeypatch, capsys):
    Fake(monkeypatch)
    rc, out, err = _cli(capsys)
    assert rc == 0 and err == ""
    path = C.cache_path()
    assert path.exists()
    assert out.startswith(f"attnkit calibrate: {C.machine_key()['cpu']}, torch {torch.__version__}")
    assert "causal  float32        64 x 64      fwd" in out and "SDPA/kernel" in out
    assert "crossover" in out and "default" in out and "measured" in out
    assert f"kernel from min(L, S) >=  {C.DEFAULT_NATIVE_CAUSAL_MIN}" in out and "1024²" in out  # (the default)
    assert "torch's kernel" in out
    assert f"stored in {C._home(path)}" in out
    assert "took " in out


def test_cli_dry_run_writes_nothing(cache, monkeypatch, capsys):
    Fake(monkeypatch)
    rc, out, _ = _cli(capsys, "--dry-run", "--budget", "1.5", "--threads", "1")
    assert rc == 0 and "dry run: nothing written" in out and "1 thread, budget 1.5 s" in out
    assert not list(cache.iterdir())


def test_cli_show_and_reset(cache, monkeypatch, capsys):
    rc, out, _ = _cli(capsys, "--show")
    assert rc == 0 and "table in use: defaults (no calibration for this CPU" in out and "in use" in out
    Fake(monkeypatch)
    _cli(capsys)
    rc, out, _ = _cli(capsys, "--show")
    assert rc == 0 and "table in use: calibrated " in out and "that calibration took" in out
    monkeypatch.setenv(C.ENV_SWITCH, "off")
    rc, out, _ = _cli(capsys)
    assert rc == 0 and f"note: {C.ENV_SWITCH}=off here" in out
    rc, out, _ = _cli(capsys, "--show")  # the file is there; the switch hides it: said so
    assert rc == 0 and "switched off" in out and "a calibration file is stored" in out and "auto ignores it" in out
    monkeypatch.setenv(C.ENV_SWITCH, "on")
    rc, out, _ = _cli(capsys, "--reset")
    assert rc == 0 and "deleted 1 calibration file from" in out and not list(cache.glob("calibration-*"))
    assert not C.crossovers().calibrated
    rc, out, _ = _cli(capsys, "--reset")
    assert "deleted 0 calibration files" in out and "(there were none)" in out


def test_cli_reports_a_failure(cache, monkeypatch, capsys):
    Fake(monkeypatch, fail_at=2)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        rc, out, _ = _cli(capsys)
    assert rc == 1 and "nothing written" in out and "calibration failed" in out
    Fake(monkeypatch, fail_at=2, exc=KeyboardInterrupt())
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        rc, out, _ = _cli(capsys)
    assert rc == 130 and "interrupted" in out


@pytest.mark.parametrize("argv, says", [(["--budget", "0"], "--budget"), (["--budget", "x"], "--budget"),
                                        (["--threads", "0"], "--threads"), (["--show", "--reset"], "not allowed")])
def test_cli_bad_options(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["calibrate", *argv])
    _, err = capsys.readouterr()
    assert e.value.code == 2 and says in err


def test_a_dtypes_forward_choice_is_taken_per_mask_case_where_its_points_disagree():
    """bf16 at 512 x 512: the kernel faster causal, torch's kernel faster with no mask (an Intel Xeon with AMX
    measured 1.2x and 0.76x): a causal bf16 call goes to the kernel and one without a mask stays on torch's, whatever
    the dtype's one choice (the geometric mean: torch); a mask of another kind follows that choice."""
    causal = C.Point("causal", "bfloat16", C.DTYPE_LENGTH, C.DTYPE_LENGTH, "fwd", 1.0, 1.2, 5)
    none = C.Point("none", "bfloat16", C.DTYPE_LENGTH, C.DTYPE_LENGTH, "fwd", 1.0, 0.76, 5)
    values = C._decide([causal, none])[0]
    assert values["bf16"] == "torch"
    x = C.Crossovers(bf16=values["bf16"], points=(causal, none), source="calibrated 2026-11-29 on X")

    def hw():
        raise AssertionError("bf16_hardware asked although the table decided")

    assert x.torch_keeps(torch.bfloat16, hw, "causal") is None
    why = x.torch_keeps(torch.bfloat16, hw, "none")
    assert why is not None and "no mask, 512 x 512" in why and "on X" in why
    assert x.torch_keeps(torch.bfloat16, hw) is not None  # another mask kind: the dtype's choice
    assert C.Crossovers(bf16="torch").torch_keeps(torch.bfloat16, hw, "causal") is not None  # no points: the choice


# --- the decode entry's read order ------------------------------------------------------------------------

@pytest.mark.parametrize("ratio, want", [(1.2, "blocked"), (1.02, "memory"), (0.7, "memory")])
def test_the_decode_read_order_is_measured_stored_and_read_back(cache, monkeypatch, ratio, want):
    """Register-blocked must win by WIN_MARGIN over memory order to replace today's rule (a tie, or memory order
    faster, keeps the rule: memory order from 8 MB); the points and the choice are stored and read back."""
    fake = Fake(monkeypatch, order_ratio=ratio)
    c = C.calibrate()
    assert fake.orders == 1 and c.decode_order == want
    assert [(o.H, o.Hkv, o.S, o.D) for o in c.order_points] == [(H, Hkv, C.ORDER_KEYS, C.ORDER_D)
                                                               for H, Hkv in C.ORDER_HEADS]
    assert all(o.ratio == pytest.approx(ratio) for o in c.order_points)
    C.forget()
    again = C.crossovers()
    assert again.decode_order == want and again.order_points == c.order_points
    assert "read order" not in again.source  # measured: not a kept default


def test_the_decode_read_order_not_measured_keeps_todays_rule_and_says_so(cache, monkeypatch):
    fake = Fake(monkeypatch)
    monkeypatch.setattr(C, "_measure_order", lambda deadline, clock: [])  # (did not fit in the budget)
    c = C.calibrate()
    assert c.decode_order is None and c.order_points == () and "the decode's read order" in c.source
    assert fake.calls  # the rest was measured
    assert C.Crossovers().decode_order is None  # the defaults: today's rule


def test_the_decode_records_carry_the_calibrated_read_order(cache, monkeypatch):
    """The kernel's decode records ask the table once, when prepared: register-blocked where it was measured faster,
    else today's rule; an explicit order wins; an unknown order is refused, named."""
    assert _native.read_order(torch.get_num_threads()) == "rule"  # the defaults
    Fake(monkeypatch, order_ratio=1.2)
    C.calibrate(threads=2)
    assert _native.read_order(2) == "blocked"
    Fake(monkeypatch, order_ratio=1.0)
    C.calibrate(threads=1)
    assert _native.read_order(1) == "rule" and _native.read_order(2) == "blocked"  # per thread count
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16)
    lo, hi = torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), 100, dtype=torch.int32)
    if not _native.available():  # no record without the kernel: refused, saying why
        with pytest.raises(RuntimeError, match=re.escape(_native.unavailable_reason())):
            _native._decode_call(q, k, v, lo, hi, 0.25, 0, 2, None)
        return
    recs = [_native._decode_call(q, k, v, lo, hi, 0.25, 0, 2, order) for order in (None, "rule", "memory")]
    assert [r.order for r in recs] == [_native.READ_ORDERS[o] for o in ("blocked", "rule", "memory")]
    with pytest.raises(ValueError, match=r"decode: order must be one of .*got 'fast'"):
        _native._decode_call(q, k, v, lo, hi, 0.25, 0, 2, "fast")


def test_the_read_orders_give_the_same_bits(monkeypatch):
    """Each read order, asked by the record (no global override), over a cache past the 8 MB line (fp32 and bf16,
    MHA and GQA, strided): the same bits as the others, and the float64 reference's values within the fp32 budget
    (bf16 is widened exactly). Without the compiled kernel there is nothing to order: the calibration's measurement
    and the decode entry refuse, naming why."""
    if not _native.available():
        with pytest.raises(C._NoKernel, match="the compiled kernel is not available here"):
            C._measure_order(deadline=1e9, clock=lambda: 0.0)
        with pytest.raises(RuntimeError, match=re.escape(_native.unavailable_reason())):
            _native.decode(torch.randn(1, 8, 1, 8), torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 8),
                           torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), 4, dtype=torch.int32), 0.5)
        return
    g = torch.Generator().manual_seed(3)
    S, D = 8192, 128  # K and V: 8 x 8192 x 128 x 4 x 2 = 64 MiB (fp32)
    for dtype in (torch.float32, torch.bfloat16):
        for H in (8, 32):
            q = torch.randn(1, H, 1, D, generator=g).to(dtype)
            big = torch.randn(1, 8, S + 5, D, generator=g).to(dtype)
            k = big[:, :, 5:]  # a view into a bigger cache: read in place
            v = torch.randn(1, 8, S, D, generator=g).to(dtype)
            lo, hi = torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), S, dtype=torch.int32)
            outs = [_native.decode(q, k, v, lo, hi, D ** -0.5, order=o)[0] for o in _native.READ_ORDERS]
            assert all(torch.equal(outs[0], o) for o in outs[1:])
            kr, vr = (t.double().repeat_interleave(H // 8, dim=1) for t in (k, v))
            ref = torch.softmax(q.double() @ kr.transpose(-1, -2) * D ** -0.5, -1) @ vr
            assert_close(outs[0], ref, budget(torch.float32, D, S), f"{dtype} H = {H}")


def test_calibrate_prints_the_read_order(cache, monkeypatch, capsys):
    Fake(monkeypatch, order_ratio=1.2)
    rc, out, _ = _cli(capsys)
    assert rc == 0 and "decode read order" in out and "memory/blocked" in out
    assert "one fp32 query row    8/8  4096  128" in out and "blocked" in out
    line = next(x for x in out.splitlines() if x.startswith("the decode entry reads K and V of >= 8 MB"))
    assert "as learned on each call shape's first calls (today's rule)" in line
    assert line.endswith("register-blocked (as below 8 MB)")
    rc, out, _ = _cli(capsys, "--show")
    assert "decode read order" in out and "register-blocked (as below 8 MB)" in out


def test_dispatch_names_the_read_order_and_the_table_that_chose_it(monkeypatch):
    """A decode step of 8 MB or more of K and V in units of <= 8 rows: `dispatch` says how its K and V are read and
    by which table; a smaller step says nothing of it. Without the compiled kernel the step is SDPA's, whose
    explanation has no read order."""
    q, k, v = torch.zeros(1, 32, 1, 128), torch.zeros(1, 8, 2048, 128), torch.zeros(1, 8, 2048, 128)  # 16 MiB
    if not _native.available():
        said = str(attnkit.dispatch(q, k, v))
        assert said.startswith("sdpa:") and "read order" not in said and "K/V of >= 8 MB" not in said
        return
    assert "K/V of >= 8 MB read in the order the kernel learns" in str(attnkit.dispatch(q, k, v))
    assert "(today's rule)" in str(attnkit.dispatch(q, k, v))
    table = C.Crossovers(decode_order="blocked", source="calibrated 2026-11-29 on X")
    monkeypatch.setattr(C, "crossovers", lambda threads=None: table)
    said = str(attnkit.dispatch(q, k, v))
    assert "K/V of >= 8 MB read register-blocked (measured faster here: calibrated 2026-11-29 on X)" in said
    assert "K/V of >= 8 MB" not in str(attnkit.dispatch(q, k[:, :, :512], v[:, :, :512]))  # 4 MiB
