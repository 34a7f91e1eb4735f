"""How ``attnkit bench`` measures: the peers timed interleaved in one run, a subprocess's peak RSS, a time estimate.

Method
------
* Every case builds its inputs once, then each peer's callable; setup a user pays
  once (SDPA's dense mask, FlexAttention's BlockMask) is timed apart as ``setup``.
* The **first call** is timed on its own: for ``tiled``/``auto`` on a mask object it
  has never seen (no cached block plan), for compiled FlexAttention it includes
  ``torch.compile``.
* Then one warm-up call per peer, then ``repeats`` **interleaved rounds** (peers in a
  fresh random order each round, so drifting machine load hits all alike), each call
  timed with ``time.perf_counter``; the report gives the **median** and the
  interquartile range. A peer stops early once it has used ``budget`` seconds and has
  at least 3 samples (SDPA with a dense 16k mask takes seconds per call).
* Ratios are against torch SDPA measured in the same run (``x SDPA`` > 1: faster).

Memory: peak RSS (``VmHWM``) of a fresh subprocess running window-256
forward+backward through ``tiled``, next to the same subprocess doing only the setup
(imports + inputs), so the attention's own peak is the difference.
"""

from __future__ import annotations

import gc
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

import attnkit

from . import cases as _c
from .cases import BenchSettingsError, Case, Result

__all__ = ["Progress", "run", "run_case", "memory_rows", "machine", "estimate", "calibrate", "check_settings",
           "check_fits", "case_bytes", "case_parts"]


class Progress:
    """A plain stderr progress bar (no dependency); ``enabled=False`` keeps quiet."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.done, self.enabled, self.t0 = max(total, 1), 0, enabled, time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr

    def update(self, what: str):
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / self.total
        bar = "#" * int(30 * frac)
        self.stream.write(f"\r[{bar:<30}] {self.done}/{self.total} {time.perf_counter() - self.t0:6.1f}s "
                          f"{what[:40]:<40}")
        self.stream.flush()
        if self.done == self.total:
            self.stream.write("\n")


def check_settings(*, repeats: int, budget: float, memory=()) -> None:
    """Raise :class:`BenchSettingsError` for a count or time that cannot run."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise BenchSettingsError("repeats", f"expected an int >= 1 (interleaved rounds), got {repeats!r}")
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not budget > 0 or budget == float("inf"):
        raise BenchSettingsError("budget", f"expected seconds > 0 (per peer and case), got {budget!r}")
    for L in memory:
        if isinstance(L, bool) or not isinstance(L, int) or L < 1:
            raise BenchSettingsError("memory", f"expected lengths >= 1 (or 'none'), got {L!r}")


def case_parts(case, peers) -> dict[str, int]:
    """What one case holds at its peak, in bytes: q, k, v, the output and (fwd+bwd) their gradients and the
    backward's saved tensors, in the case's dtype; and SDPA's dense (L, S) mask where SDPA gets one (bool; ALiBi's
    float bias (1, H, L, S))."""
    esize = torch.tensor([], dtype=case.dtype).element_size()
    fwd = case.mode == "fwd"
    parts = {"q, k, v, output" + ("" if fwd else ", gradients"): (4 if fwd else 10) * _c.B * _c.H * case.L * _c.D
             * esize}
    if "sdpa" in peers and case.name not in ("dense", "causal"):
        parts["SDPA's dense mask"] = case.L * case.L * (_c.H * esize if case.name == "alibi" else 1)
    return parts


def case_bytes(case, peers) -> int:
    """Peak bytes one case can hold (:func:`case_parts`), at least the naive peer's ``NAIVE_MAX_BYTES`` where it
    runs (it is skipped past them on its own)."""
    need = sum(case_parts(case, peers).values())
    return max(need, _c.NAIVE_MAX_BYTES) if "naive" in peers and _c.naive_fits(case.L) else need


def check_fits(cases, peers, memory=(), have: int | None = None) -> None:
    """Raise :class:`BenchSettingsError` for a case or memory length whose tensors cannot fit in this machine's
    memory (``have`` bytes; default: physical memory), before anything is allocated."""
    from .._machine import physical_memory

    have = physical_memory() if have is None else have
    if have is None:
        return
    for case in cases:
        need = case_bytes(case, peers)
        if need > 0.8 * have:
            raise BenchSettingsError("length", f"{case.label} needs about {need / 2**30:,.1f} GiB "
                                     f"({', '.join(case_parts(case, peers))}), and this machine has "
                                     f"{have / 2**30:.1f} GiB; expected a smaller --length (the default is "
                                     f"{_c.DEFAULT_SIZE})")
    for L in memory:  # the peak-RSS check runs window fwd+bwd through tiled
        need = case_bytes(Case("window", L, torch.float32, "fwdbwd"), ("tiled",))
        if need > 0.8 * have:
            raise BenchSettingsError("memory", f"the peak-RSS check at L={L:,} needs about {need / 2**30:,.1f} GiB, "
                                     f"and this machine has {have / 2**30:.1f} GiB; expected smaller lengths")


# --- timing --------------------------------------------------------------------------

def _step(fn, mode, inputs, grad_out):
    if mode == "fwd":
        with torch.no_grad():
            fn()
        return
    for t in inputs:
        t.grad = None
    out = fn()
    out.backward(grad_out)


def _timed(fn, mode, inputs, grad_out) -> float:
    t0 = time.perf_counter()
    _step(fn, mode, inputs, grad_out)
    return time.perf_counter() - t0


def run_case(case: Case, peers, repeats: int, budget: float, progress: Progress | None = None) -> list[Result]:
    """Time every peer on one case, interleaved; fills and returns ``case.results``."""
    progress = progress or Progress(1, enabled=False)
    torch.manual_seed(0)
    req_grad = case.mode == "fwdbwd"
    q, k, v = (torch.randn(_c.B, _c.H, case.L, _c.D).to(case.dtype).requires_grad_(req_grad) for _ in range(3))
    grad_out = torch.randn(_c.B, _c.H, case.L, _c.D).to(case.dtype)
    inputs = (q, k, v)
    flops = _c.flops(case.name, case.L, case.mode)
    live: dict[str, tuple[Callable[[], object], Result, list[float]]] = {}  # peer -> (fn, result, seconds)
    for peer in peers:
        r = Result(case.name, case.dtype_name, case.mode, case.L, peer)
        case.results.append(r)
        try:
            fn, setup, note = _c.build_peer(peer, case, q, k, v)
        except Exception as e:  # a peer that cannot run here is reported, not dropped
            fn, setup, note = None, None, f"failed to build: {type(e).__name__}: {str(e)[:120]}"
        r.setup_s, r.note = setup, note
        if fn is None:
            progress.update(f"{case.label} {peer}")
            continue
        try:
            if peer in ("auto", "tiled"):
                r.backend_ran = attnkit.dispatch(q, k, v, backend=peer, **_c.attnkit_kwargs(case.name, case.L)).backend
            r.first_call_s = _timed(fn, case.mode, inputs, grad_out)
            if r.first_call_s < budget / 4:  # a slow first call already warmed everything up
                _step(fn, case.mode, inputs, grad_out)
            live[peer] = (fn, r, [])
        except Exception as e:
            msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            r.note = (r.note + "; " if r.note else "") + \
                f"{'no CPU backward' if req_grad else 'failed'}: {type(e).__name__}: {msg}"
        progress.update(f"{case.label} {peer}")
    for _ in range(repeats):
        order = list(live)
        random.shuffle(order)
        for peer in order:
            fn, r, samples = live[peer]
            if len(samples) >= 3 and sum(samples) > budget:
                continue
            samples.append(_timed(fn, case.mode, inputs, grad_out))
        gc.collect()
    for _fn, r, samples in live.values():
        samples.sort()
        r.n = len(samples)
        r.median_s = statistics.median(samples)
        if len(samples) >= 4:
            qs = statistics.quantiles(samples, n=4)
            r.iqr_s = qs[2] - qs[0]
        r.gflops = flops / r.median_s / 1e9
    base = next((r for r in case.results if r.peer == "sdpa" and r.median_s), None)
    for r in case.results:
        if base and r.median_s:
            r.x_sdpa = base.median_s / r.median_s
    del live
    gc.collect()
    return case.results


# --- memory --------------------------------------------------------------------------


def peak_rss_kib() -> int:
    """This process's own peak resident memory in KiB (``VmHWM``; Linux).

    Not ``ru_maxrss``: on Linux that survives ``exec`` and so starts at the parent's
    RSS at fork time — a child of a test run holding 3 GiB reports 3 GiB however
    little it uses. Falls back to ``ru_maxrss`` where ``/proc`` is absent.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


_MEM_CHILD = """
import sys, torch, attnkit
from attnkit.bench.runner import peak_rss_kib

L, run = int(sys.argv[1]), sys.argv[2] == "run"
torch.manual_seed(0)
q, k, v = (torch.randn(1, 8, L, 64, requires_grad=True) for _ in range(3))
if run:
    out = attnkit.attention(q, k, v, mask=attnkit.masks.sliding_window(256), backend="tiled")
    out.sum().backward()  # dO is an expanded scalar: the peak is attention's, not the harness's
print(peak_rss_kib())
"""


def _peak_rss_mib(L: int, run: bool) -> float:
    out = subprocess.run([sys.executable, "-c", _MEM_CHILD, str(L), "run" if run else "setup"],
                         capture_output=True, text=True, check=True, timeout=600)
    return int(out.stdout.strip().splitlines()[-1]) / 1024  # KiB -> MiB


def memory_rows(lengths, progress: Progress | None = None) -> list[dict]:
    """Peak RSS of window-256 fwd+bwd through ``tiled`` at each L, in a fresh subprocess (and its setup alone)."""
    progress = progress or Progress(1, enabled=False)
    rows = []
    for L in lengths:
        setup = _peak_rss_mib(L, False)
        peak = _peak_rss_mib(L, True)
        rows.append({"L": L, "H": _c.H, "peak_rss_mib": peak, "setup_rss_mib": setup,
                     "attention_mib": peak - setup, "dense_scores_mib": _c.B * _c.H * L * L * 4 / 2**20})
        progress.update(f"memory L={L}")
    return rows


# --- machine and estimate --------------------------------------------------------------

def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "attnkit": attnkit.__version__,
            "platform": platform.platform(), "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def calibrate() -> float:
    """This machine's fp32 matmul rate now, in GFLOP/s (median of 3 timed 1536³ products after a warm-up: ~0.2 s).

    Big enough that per-call overhead does not count (a 512³ product runs at a quarter of the rate).
    """
    a, b = torch.randn(1536, 1536), torch.randn(1536, 1536)
    a @ b  # the first product starts the thread pool
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * 1536 ** 3 / max(statistics.median(times), 1e-9) / 1e9


# Per-call rate as a fraction of the matmul rate, fitted to BENCHMARKS.md's full run (2-core EPYC, matmul
# ~140-150 GFLOP/s): SDPA ~150 GFLOP/s on its (dense) work, naive ~45-70, tiled ~80-150 useful, flex ~60.
_EFF = {"sdpa": 1.0, "naive": 0.33, "flex": 0.4, "tiled": 0.7, "auto": 0.7}
_FLEX_COMPILE_S = 4.0
_SUBPROCESS_S = 4.0  # a fresh interpreter importing torch and attnkit (2 s quiet, more when the cores are shared)
_CALL_OVERHEAD_S = 2e-3


def _call_estimate(peer: str, case: Case, rate: float) -> float | None:
    """Seconds for one call (None: the peer is skipped without running)."""
    if peer == "naive" and not _c.naive_fits(case.L):
        return None
    dense_kernel = peer == "naive" or (peer == "sdpa" and case.name not in ("dense", "causal"))
    if peer == "auto" and case.name in ("dense", "causal"):
        peer = "sdpa"  # auto routes these to SDPA
    work = _c.flops(case.name, case.L, case.mode, useful=not dense_kernel, exact=False)
    return _CALL_OVERHEAD_S + work / (rate * 1e9 * _EFF[peer])


def estimate(cases, peers, *, repeats: int, budget: float, memory=(), rate: float | None = None) -> float:
    """Expected wall time in seconds of :func:`run` on these settings (from a calibrated matmul rate)."""
    rate = rate or calibrate()
    total = 0.0
    for case in cases:
        for peer in peers:
            if peer == "flex":
                total += _FLEX_COMPILE_S
                if case.mode == "fwdbwd":
                    continue  # no CPU backward: fails after the compile
            t = _call_estimate(peer, case, rate)
            if t is None:
                continue
            calls = 1 + (1 if t < budget / 4 else 0)  # first call (+ warm-up)
            n = 0
            while n < repeats and not (n >= 3 and n * t > budget):
                n += 1
            total += (calls + n) * t
        total += 0.1  # inputs, density, gc
    for L in memory:  # a setup-only and a measuring subprocess, the latter running window fwd+bwd through tiled
        t = _call_estimate("tiled", Case("window", L, torch.float32, "fwdbwd"), rate)
        assert t is not None  # only the naive peer is ever skipped
        total += 2 * _SUBPROCESS_S + t
    return total


# --- the whole run ---------------------------------------------------------------------

def run(cases, peers, *, repeats: int, budget: float, memory=(), progress: Progress | None = None,
        on_case=None, command: str = "") -> dict:
    """Run the cases (then the memory check) and return the report as a JSON-able dict.

    ``on_case(report)`` is called after each case with the partial report (e.g. to save
    it, so an interrupted run keeps what it measured).
    """
    memory = list(memory)
    check_settings(repeats=repeats, budget=budget, memory=memory)
    check_fits(cases, peers, memory)
    progress = progress or Progress(len(cases) * len(peers) + len(memory), enabled=False)
    results: list[dict] = []
    report = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
              "repeats": repeats, "budget_s": float(budget), "peers": list(peers),
              "shapes": {"B": _c.B, "H": _c.H, "D": _c.D, "window": _c.WINDOW, "documents": _c.N_DOCS},
              "notes": [], "memory": [], "results": results}
    for c in cases:
        run_case(c, peers, repeats, budget, progress)
        results.extend(asdict(r) for r in c.results)
        if on_case:
            on_case(report)
    report["memory"] = memory_rows(memory, progress) if memory else []
    return report
