"""The benchmark harness behind ``attnkit bench`` and ``benchmarks/suite.py`` (one implementation).

Method
------
* Every case (mask × dtype × forward or forward+backward) builds its inputs once,
  then each peer's callable; setup that a user pays once (SDPA's dense mask,
  FlexAttention's BlockMask) is timed apart as ``setup``.
* **First call** is timed on its own: for ``tiled``/``auto`` on a mask object it has
  never seen (no cached block plan), for compiled FlexAttention it includes
  ``torch.compile`` (reported as compile time).
* Then one warm-up call per peer, then ``repeats`` **interleaved rounds** (peers in
  a fresh random order each round, so drifting machine load hits all alike), each
  call timed with ``time.perf_counter``; we report the **median** and the
  interquartile range. A peer stops early once it has used ``budget`` seconds and
  has at least 3 samples (SDPA with a dense 16k mask takes seconds per call).
* Ratios are against torch SDPA measured in the same run (``x SDPA`` > 1: faster).

FLOP formula (written down, as in the Triton tutorial)::

    forward   = 4 · B · H · L · S · D · f      f = fraction of (i, j) the mask keeps
    fwd + bwd = forward · (1 + 2.5)

``f`` is counted exactly (the mask is evaluated in row chunks; never L×S at once), so
GFLOP/s is the *useful* rate: a dense kernel on a sparse mask is not credited for
work the mask throws away.

Memory: peak RSS (``VmHWM``) of a fresh subprocess running window-256
forward+backward through ``tiled``, next to the same subprocess doing only the
setup (imports + inputs), so the attention's own peak is the difference.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks as _masks
from attnkit import score_mods as _score_mods

__all__ = ["main", "run_suite", "add_arguments"]

B, H, D = 1, 8, 64
CASES = ("dense", "causal", "window", "document", "prefix", "alibi")
PEERS = ("sdpa", "flex", "naive", "auto", "tiled")
FULL_SIZES = {"dense": 4096, "causal": 4096, "window": 16384, "document": 16384, "prefix": 4096, "alibi": 4096}
QUICK_SIZES = {"dense": 512, "causal": 512, "window": 2048, "document": 2048, "prefix": 512, "alibi": 512}
WINDOW, N_DOCS = 256, 16
NAIVE_MAX_BYTES = 2 << 30  # naive softmax(QKᵀ)V holds ~3 (B, H, L, S) fp32 tensors; skip beyond this


@dataclass
class Result:
    case: str
    dtype: str
    mode: str
    L: int
    peer: str
    median_s: float | None = None
    iqr_s: float | None = None
    n: int = 0
    first_call_s: float | None = None
    setup_s: float | None = None
    gflops: float | None = None
    x_sdpa: float | None = None
    backend_ran: str | None = None
    note: str = ""


@dataclass
class Case:
    name: str
    L: int
    dtype: torch.dtype
    mode: str  # "fwd" | "fwdbwd"
    results: list = field(default_factory=list)

    @property
    def label(self):
        return f"{self.name}-{self.L} {str(self.dtype).replace('torch.', '')} {self.mode}"


# --- masks of each case, in each peer's language -------------------------------------

def _attnkit_kwargs(name: str, L: int):
    """Fresh attnkit mask objects each call (so a first call really has not seen them)."""
    if name == "dense":
        return {}
    if name == "causal":
        return {"causal": True}
    if name == "window":
        return {"mask": _masks.sliding_window(WINDOW)}
    if name == "document":
        ids = torch.arange(N_DOCS).repeat_interleave(-(-L // N_DOCS))[:L]
        return {"mask": _masks.document(ids)}
    if name == "prefix":
        return {"mask": _masks.prefix_lm(L // 4)}
    if name == "alibi":
        return {"causal": True, "score_mod": _score_mods.alibi(_alibi_slopes())}
    raise ValueError(name)


def _alibi_slopes():
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])


def _mask_of(kw) -> _masks.Mask | None:
    if kw.get("causal"):
        return _masks.causal()
    return kw.get("mask")


def _density(name: str, L: int) -> float:
    """Exact fraction of (i, j) the mask keeps, counted in row chunks."""
    mask = _mask_of(_attnkit_kwargs(name, L))
    if mask is None:
        return 1.0
    mod = mask.bind(L, L)
    kv = torch.arange(L).view(1, 1, 1, L)
    kept = 0
    for r0 in range(0, L, 512):
        q = torch.arange(r0, min(L, r0 + 512)).view(1, 1, -1, 1)
        kept += int(mod(torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1, 1, dtype=torch.long), q, kv)
                    .expand(1, 1, q.shape[2], L).sum())
    return kept / (L * L)


def _dense_bool(name: str, L: int):
    mask = _mask_of(_attnkit_kwargs(name, L))
    return None if mask is None else mask.materialize(1, 1, L, L)


def _alibi_bias(L: int, dtype):
    """(1, H, L, L) float bias: ALiBi plus -inf above the diagonal (SDPA/naive's way to say it)."""
    pos = torch.arange(L)
    rel = (pos.view(1, L) - pos.view(L, 1)).to(torch.float32)  # kv - q
    bias = _alibi_slopes().view(H, 1, 1) * rel
    bias = bias.masked_fill(rel > 0, float("-inf"))
    return bias.unsqueeze(0).to(dtype)


# --- peers ---------------------------------------------------------------------------

def _peer_sdpa(case: Case, q, k, v):
    t0 = time.perf_counter()
    if case.name == "dense":
        fn, note = (lambda: F.scaled_dot_product_attention(q, k, v)), "no mask"
    elif case.name == "causal":
        fn, note = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), "is_causal"
    elif case.name == "alibi":
        bias = _alibi_bias(case.L, q.dtype)
        fn, note = (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)), "dense float bias (ALiBi + causal)"
    else:
        m = _dense_bool(case.name, case.L)
        fn, note = (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m)), "dense bool mask"
    return fn, time.perf_counter() - t0, note


def _peer_naive(case: Case, q, k, v):
    if 3 * B * H * case.L * case.L * 4 > NAIVE_MAX_BYTES:
        return None, None, f"skipped: needs ~{3 * B * H * case.L * case.L * 4 / 2**30:.0f} GiB for (B, H, L, S) scores"
    scale = 1.0 / math.sqrt(D)
    if case.name == "alibi":
        add = _alibi_bias(case.L, torch.float32)
    else:
        m = _dense_bool(case.name, case.L)
        add = None if m is None else torch.zeros(m.shape).masked_fill(~m, float("-inf"))

    def fn():
        s = (q @ k.transpose(-1, -2)).float() * scale
        if add is not None:
            s = s + add
        return torch.softmax(s, dim=-1).to(v.dtype) @ v

    return fn, 0.0, "softmax(QKᵀ·scale + mask)·V"


def _peer_attnkit(backend: str):
    def build(case: Case, q, k, v):
        kw = _attnkit_kwargs(case.name, case.L)
        return (lambda: attnkit.attention(q, k, v, backend=backend, **kw)), 0.0, ""
    return build


def _flex_available():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"unavailable: {e}"
    return None


def _peer_flex(case: Case, q, k, v):
    why = _flex_available()
    if why:
        return None, None, why
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    # A fresh compile per case: one shared compiled function would hit dynamo's recompile
    # limit after a few cases and silently fall back to eager flex_attention, which
    # materialises (B, H, L, S) scores (tens of GiB at L = 16384).
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    kw = _attnkit_kwargs(case.name, case.L)
    mask = _mask_of(kw)
    t0 = time.perf_counter()
    block_mask = None
    if mask is not None:
        block_mask = create_block_mask(mask.bind(case.L, case.L), None, None, case.L, case.L, device="cpu")
    setup = time.perf_counter() - t0
    score_mod = kw.get("score_mod")
    fn = lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)  # noqa: E731
    return fn, setup, "torch.compile(flex_attention); first call = compile"


_BUILDERS = {"sdpa": _peer_sdpa, "flex": _peer_flex, "naive": _peer_naive,
             "auto": _peer_attnkit("auto"), "tiled": _peer_attnkit("tiled")}


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


class _Progress:
    """A plain stderr progress bar (no dependency)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self.t0 = max(total, 1), 0, enabled, time.perf_counter()

    def update(self, what: str):
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / self.total
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r[{bar:<30}] {self.done}/{self.total} {time.perf_counter() - self.t0:6.1f}s {what[:40]:<40}")
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def _run_case(case: Case, peers, repeats: int, budget: float, progress: _Progress):
    torch.manual_seed(0)
    req_grad = case.mode == "fwdbwd"
    q, k, v = (torch.randn(B, H, case.L, D).to(case.dtype).requires_grad_(req_grad) for _ in range(3))
    grad_out = torch.randn(B, H, case.L, D).to(case.dtype)
    inputs = (q, k, v)
    flops = 4 * B * H * case.L * case.L * D * _density(case.name, case.L) * (3.5 if req_grad else 1.0)
    live = {}
    for peer in peers:
        r = Result(case.name, str(case.dtype).replace("torch.", ""), case.mode, case.L, peer)
        case.results.append(r)
        try:
            fn, setup, note = _BUILDERS[peer](case, q, k, v)
        except Exception as e:  # a peer that cannot run here is reported, not dropped
            fn, setup, note = None, None, f"failed to build: {type(e).__name__}: {str(e)[:120]}"
        r.setup_s, r.note = setup, note
        if fn is None:
            progress.update(f"{case.label} {peer}")
            continue
        try:
            if peer in ("auto", "tiled"):
                r.backend_ran = attnkit.dispatch(q, k, v, backend=peer, **_attnkit_kwargs(case.name, case.L)).backend
            r.first_call_s = _timed(fn, case.mode, inputs, grad_out)
            if r.first_call_s < budget / 4:  # a slow first call already warmed everything up
                _step(fn, case.mode, inputs, grad_out)
            live[peer] = (fn, r, [])
        except Exception as e:
            msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            r.note = (r.note + "; " if r.note else "") + f"{'no CPU backward' if req_grad else 'failed'}: {type(e).__name__}: {msg}"
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
    for peer, (fn, r, samples) in live.items():
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


# --- memory --------------------------------------------------------------------------

_MEM_CHILD = """
import resource, sys, torch, attnkit

def peak_kib():
    # VmHWM is this process's own high-water mark; ru_maxrss can include the parent's pages
    # at fork time (the parent here is a benchmark that has held GiBs)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

L, run = int(sys.argv[1]), sys.argv[2] == "run"
torch.manual_seed(0)
q, k, v = (torch.randn(1, 8, L, 64, requires_grad=True) for _ in range(3))
if run:
    out = attnkit.attention(q, k, v, mask=attnkit.masks.sliding_window(256), backend="tiled")
    out.sum().backward()  # dO is an expanded scalar: the peak is attention's, not the harness's
print(peak_kib())
"""


def _peak_rss_mib(L: int, run: bool) -> float:
    out = subprocess.run([sys.executable, "-c", _MEM_CHILD, str(L), "run" if run else "setup"],
                         capture_output=True, text=True, check=True, timeout=600)
    return int(out.stdout.strip().splitlines()[-1]) / 1024  # KiB -> MiB


def memory_rows(lengths, progress: _Progress):
    rows = []
    for L in lengths:
        setup = _peak_rss_mib(L, False)
        peak = _peak_rss_mib(L, True)
        rows.append({"L": L, "H": H, "peak_rss_mib": peak, "setup_rss_mib": setup,
                     "attention_mib": peak - setup, "dense_scores_mib": B * H * L * L * 4 / 2**20})
        progress.update(f"memory L={L}")
    return rows


# --- report --------------------------------------------------------------------------

def _fmt_ms(s):
    return "—" if s is None else (f"{s * 1e3:.1f}" if s < 10 else f"{s:.1f}s")


def table(cases, peers) -> str:
    head = ["case", *[f"{p} ms" for p in peers], "tiled x SDPA", "auto x SDPA", "tiled GFLOP/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        by = {r.peer: r for r in c.results}
        cells = [c.label]
        for p in peers:
            r = by.get(p)
            cells.append("—" if r is None else (_fmt_ms(r.median_s) if r.median_s else "n/a"))
        for p in ("tiled", "auto"):
            r = by.get(p)
            cells.append(f"{r.x_sdpa:.2f}" if r and r.x_sdpa else "—")
        r = by.get("tiled")
        cells.append(f"{r.gflops:.0f}" if r and r.gflops else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def first_call_table(cases) -> str:
    lines = ["| case | peer | setup ms | first call ms | steady median ms | note |", "|---|---|---|---|---|---|"]
    for c in cases:
        for r in c.results:
            lines.append(f"| {c.label} | {r.peer}{'→' + r.backend_ran if r.backend_ran and r.peer == 'auto' else ''} | "
                         f"{_fmt_ms(r.setup_s) if r.setup_s else '—'} | {_fmt_ms(r.first_call_s)} | "
                         f"{_fmt_ms(r.median_s)} | {r.note} |")
    return "\n".join(lines)


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


def _get(cases, name, dtype, mode, peer):
    for c in cases:
        if c.name == name and str(c.dtype).endswith(dtype) and c.mode == mode:
            for r in c.results:
                if r.peer == peer:
                    return r
    return None


def targets(cases, memory) -> list[str]:
    """The issue's targets, each with what this run measured (only those this run covers)."""
    rows = []

    def ratio(name, dtype, mode, peer, vs, goal, what):
        a, b = _get(cases, name, dtype, mode, peer), _get(cases, name, dtype, mode, vs)
        if not (a and b and a.median_s and b.median_s):
            return
        x = b.median_s / a.median_s
        rows.append(f"| {what} | ≥ {goal:g}× | {x:.2f}× | {'met' if x >= goal else f'missed by {100 * (1 - x / goal):.0f}%'} |")

    ratio("window", "float32", "fwd", "tiled", "sdpa", 10, "window-256 fp32 forward: tiled vs SDPA+mask")
    ratio("window", "float32", "fwd", "tiled", "flex", 1.0, "window-256 fp32 forward: tiled vs compiled FlexAttention")
    ratio("window", "float32", "fwdbwd", "tiled", "sdpa", 5, "window-256 fp32 fwd+bwd: tiled vs SDPA+mask")
    for name in ("dense", "causal"):
        ratio(name, "float32", "fwd", "auto", "sdpa", 0.95, f"{name} fp32 forward: auto vs SDPA")
        ratio(name, "float32", "fwdbwd", "auto", "sdpa", 0.95, f"{name} fp32 fwd+bwd: auto vs SDPA")
    ratio("dense", "float32", "fwd", "tiled", "sdpa", 0.7, "dense fp32 forward: tiled alone vs SDPA")
    ratio("dense", "bfloat16", "fwd", "auto", "sdpa", 1.0, "dense bf16 forward: auto vs SDPA bf16")
    ratio("dense", "bfloat16", "fwd", "tiled", "sdpa", 1.0, "dense bf16 forward: tiled vs SDPA bf16")
    for c in cases:
        r = next((r for r in c.results if r.peer == "tiled" and r.first_call_s is not None and r.median_s), None)
        if r and c.mode == "fwd" and c.dtype == torch.float32 and c.name != "dense":
            extra = r.first_call_s - r.median_s
            rows.append(f"| first call of tiled on an unseen mask, {c.label}: first − steady | < 100 ms | "
                        f"{extra * 1e3:.0f} ms (first {r.first_call_s * 1e3:.0f} ms) | {'met' if extra < 0.1 else 'missed'} |")
    for m in memory:
        if m["L"] == 131072:
            rows.append(f"| window-256 fwd+bwd L=131072 H=8 peak RSS | < 2048 MiB | {m['peak_rss_mib']:.0f} MiB "
                        f"(floor: setup {m['setup_rss_mib']:.0f} + out, dq, dk, dv {4 * 8 * 131072 * 64 * 4 / 2**20:.0f}) | "
                        f"{'met' if m['peak_rss_mib'] < 2048 else 'missed'} |")
    if not rows:
        return []
    return ["| target | goal | measured | verdict |", "|---|---|---|---|", *rows]


def markdown(report: dict, peers) -> str:
    m = report["machine"]
    cases = report["_cases"]
    out = [
        "# attnkit benchmarks",
        "",
        f"Command: `{report['command']}`  ",
        f"Date: {report['date']}  ",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, load average at start "
        f"{m['load_avg']}  ",
        f"Versions: Python {m['python']}, torch {m['torch']}, attnkit {m['attnkit']}  ",
        f"Shapes: B={B}, H={H}, D={D}; window {WINDOW}; document mask {N_DOCS} equal documents; prefix-LM prefix L/4; "
        "ALiBi slopes 2^(-8(h+1)/H) with causal.",
        "",
        "Method: interleaved rounds (random peer order each round), median of "
        f"{report['repeats']} rounds (a peer stops after {report['budget_s']} s with ≥ 3 samples), "
        "`time.perf_counter`; ratios against torch SDPA from the same run (> 1 = faster than SDPA). "
        "FLOPs: forward 4·B·H·L·S·D·f with f the exact fraction of (i, j) the mask keeps; forward+backward ×3.5. "
        "SDPA is given `is_causal` where it can express the mask, otherwise a dense bool mask (or a dense float "
        "bias for ALiBi), built once outside the timing (its build time is the setup column).",
        "",
        "## Time (median ms)",
        "",
        table(cases, peers),
        "",
        "## Setup, first call and notes",
        "",
        "`first call` for tiled/auto is on a mask object never seen before (the block plan is built inside it); "
        "for FlexAttention it includes `torch.compile`.",
        "",
        first_call_table(cases),
    ]
    tg = targets(cases, report.get("memory") or [])
    if tg:
        out += ["", "## Targets (from the issue) against this run", "", *tg]
    if report.get("memory"):
        out += ["", "## Memory: window-256 forward+backward through `tiled` (fresh subprocess, peak RSS)", "",
                "| L | H | peak RSS MiB | setup-only RSS MiB | attention's own MiB | one fp32 (B,H,L,S) score tensor MiB |",
                "|---|---|---|---|---|---|"]
        for r in report["memory"]:
            out.append(f"| {r['L']} | {r['H']} | {r['peak_rss_mib']:.0f} | {r['setup_rss_mib']:.0f} | "
                       f"{r['attention_mib']:.0f} | {r['dense_scores_mib']:.0f} |")
    if report.get("notes"):
        out += ["", "## Notes", "", *report["notes"]]
    return "\n".join(out) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats: seconds (used by the smoke test)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list from {','.join(CASES)}")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list from fp32,bf16")
    p.add_argument("--modes", default="fwd,fwdbwd", help="comma list from fwd,fwdbwd")
    p.add_argument("--peers", default=None, help=f"comma list from {','.join(PEERS)} (default: all; --quick skips flex)")
    p.add_argument("--length", type=int, default=None, help="override L (= S) for every case")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 7, quick 3)")
    p.add_argument("--budget", type=float, default=None, help="seconds per peer and case before it stops repeating")
    p.add_argument("--memory", default=None,
                   help="comma list of L for the peak-RSS check (default 65536,131072; quick 8192; 'none' to skip)")
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--markdown", default=None, help="write the BENCHMARKS.md report here (default: none with "
                                                     "--quick, BENCHMARKS.md otherwise)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


class BenchArgumentError(ValueError):
    pass


def _choices(arg: str, allowed, what: str):
    items = [x.strip() for x in arg.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise BenchArgumentError(f"--{what}: expected a comma list from {','.join(allowed)}, got {arg!r}.")
    return items


def run_suite(args) -> int:
    dtypes_map = {"fp32": torch.float32, "bf16": torch.bfloat16}
    names = _choices(args.cases, CASES, "cases")
    dtypes = _choices(args.dtypes, tuple(dtypes_map), "dtypes")
    modes = _choices(args.modes, ("fwd", "fwdbwd"), "modes")
    default_peers = [p for p in PEERS if not (args.quick and p == "flex")]
    peers = _choices(args.peers, PEERS, "peers") if args.peers else default_peers
    repeats = args.repeats or (3 if args.quick else 7)
    budget = args.budget or (2.0 if args.quick else 20.0)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if args.length is not None and args.length < 1:
        raise BenchArgumentError(f"--length: expected an int >= 1, got {args.length}.")
    mem_arg = args.memory or ("8192" if args.quick else "65536,131072")
    try:
        mem_lengths = [] if mem_arg == "none" else [int(x) for x in mem_arg.split(",")]
    except ValueError:
        raise BenchArgumentError(f"--memory: expected a comma list of ints or 'none', got {mem_arg!r}.") from None
    cases = [Case(n, args.length or sizes[n], dtypes_map[d], m) for n in names for d in dtypes for m in modes]
    progress = _Progress(len(cases) * len(peers) + len(mem_lengths), not args.no_progress)
    report = {"command": "attnkit bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(), "repeats": repeats,
              "budget_s": budget, "notes": []}
    def dump():
        if args.json:
            payload = {k: v for k, v in report.items() if k != "_cases"}
            payload["results"] = [asdict(r) for c in cases for r in c.results]
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=1)

    report["memory"] = []
    for c in cases:
        _run_case(c, peers, repeats, budget, progress)
        dump()  # partial results survive an interrupted run
    report["memory"] = memory_rows(mem_lengths, progress) if mem_lengths else []
    report["_cases"] = cases
    print(table(cases, peers))
    print()
    print(first_call_table(cases))
    tg = targets(cases, report["memory"])
    if tg:
        print()
        print("\n".join(tg))
    for r in report["memory"]:
        print(f"memory: window-256 fwd+bwd L={r['L']} H={r['H']}: peak RSS {r['peak_rss_mib']:.0f} MiB "
              f"(setup alone {r['setup_rss_mib']:.0f} MiB; one dense fp32 score tensor would be "
              f"{r['dense_scores_mib']:.0f} MiB)")
    dump()
    md = args.markdown if args.markdown is not None else (None if args.quick else "BENCHMARKS.md")
    if md:
        with open(md, "w") as f:
            f.write(markdown(report, peers))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/suite.py", description="attnkit benchmark suite")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_suite(args)
    except BenchArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
