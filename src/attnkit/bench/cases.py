"""What ``attnkit bench`` measures: the cases (mask × length × dtype × mode), each peer's callable, the FLOP count.

Shapes: B = 1, H = 8, D = 64, L = S. Masks: ``dense`` (none), ``causal``, ``window``
(sliding window of 256), ``document`` (16 equal documents), ``prefix`` (prefix-LM,
prefix L/4), ``alibi`` (ALiBi slopes 2^(-8(h+1)/H) with causal).

Peers, each given the mask in its own language: ``sdpa`` (torch SDPA: ``is_causal``
where it can say the mask, else a dense bool mask or a dense float bias built once
outside the timing), ``flex`` (``torch.compile(flex_attention)`` with a BlockMask),
``naive`` (``softmax(QKᵀ·scale + mask)·V``), ``auto`` and ``tiled`` (attnkit).

FLOP formula (written down, as in the Triton tutorial)::

    forward   = 4 · B · H · L · S · D · f      f = fraction of (i, j) the mask keeps
                                               (causal: f ≈ ½)
    fwd + bwd = forward · (1 + 2.5)            the backward counts 2.5 forwards

``f`` is counted exactly (the mask is evaluated in row chunks, never L×S at once), so
GFLOP/s is the *useful* rate: a dense kernel on a sparse mask is not credited for
work the mask throws away.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks as _masks
from attnkit import score_mods as _score_mods

__all__ = ["B", "H", "D", "WINDOW", "N_DOCS", "CASES", "PEERS", "DTYPES", "MODES", "FULL_SIZES", "DEFAULT_SIZE",
           "DEFAULT_CASES", "DEFAULT_PEERS", "Case", "Result", "BenchSettingsError", "select", "density", "flops",
           "build_peer", "attnkit_kwargs", "BACKWARD_FACTOR", "approx_density"]

B, H, D = 1, 8, 64
WINDOW, N_DOCS = 256, 16
CASES = ("dense", "causal", "window", "document", "prefix", "alibi")
PEERS = ("sdpa", "flex", "naive", "auto", "tiled")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("fwd", "fwdbwd")
BACKWARD_FACTOR = 2.5  # a backward counts 2.5 forwards: fwd + bwd = 3.5 × forward

# --full: the suite behind BENCHMARKS.md (tens of minutes on 2 cores: SDPA with a dense 16k mask takes seconds a call)
FULL_SIZES = {"dense": 4096, "causal": 4096, "window": 16384, "document": 16384, "prefix": 4096, "alibi": 4096}
# the default: a dense baseline, the causal fast path and two sparse masks, fp32, at one length (about a minute)
DEFAULT_CASES = ("dense", "causal", "window", "document")
DEFAULT_SIZE = 2048
DEFAULT_PEERS = ("sdpa", "naive", "auto", "tiled")  # flex compiles per case (seconds each): --full or --peers
NAIVE_MAX_BYTES = 2 << 30  # naive softmax(QKᵀ)V holds ~3 (B, H, L, S) fp32 tensors; skip beyond this


class BenchSettingsError(ValueError):
    """A benchmark setting out of range; ``option`` names it (``"cases"``, ``"repeats"``, …)."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option, self.message = option, message


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
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    @property
    def label(self) -> str:
        return f"{self.name}-{self.L} {self.dtype_name} {self.mode}"


def _items(value, allowed, option):
    items = [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else list(value)
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        got = ",".join(map(str, items)) or repr(value)
        raise BenchSettingsError(option, f"expected a comma list from {','.join(allowed)}, got {got}"
                                 + (f" (unknown: {','.join(map(str, bad))})" if bad else ""))
    return list(dict.fromkeys(items))


def select(*, full: bool = False, cases=None, dtypes=None, modes=None, peers=None, length: int | None = None):
    """The cases and peers to run: the small default set, or the whole suite with ``full``.

    Each argument overrides the choice (a comma string or a sequence); bad values raise
    :class:`BenchSettingsError` naming the setting. Returns ``(cases, peers)``.
    """
    names = _items(cases if cases is not None else (CASES if full else DEFAULT_CASES), CASES, "cases")
    dts = _items(dtypes if dtypes is not None else (("fp32", "bf16") if full else ("fp32",)), tuple(DTYPES), "dtypes")
    mds = _items(modes if modes is not None else MODES, MODES, "modes")
    prs = _items(peers if peers is not None else (PEERS if full else DEFAULT_PEERS), PEERS, "peers")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        raise BenchSettingsError("length", f"expected an int >= 1, got {length!r}")
    def size(name: str) -> int:
        if length is not None:
            return length
        return FULL_SIZES[name] if full else DEFAULT_SIZE

    return [Case(n, size(n), DTYPES[d], m) for n in names for d in dts for m in mds], prs


# --- masks of each case, in each peer's language -------------------------------------

def attnkit_kwargs(name: str, L: int) -> dict:
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
    raise ValueError(f"unknown case {name!r}; expected one of {', '.join(CASES)}")


def _alibi_slopes():
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])


def _mask_of(kw) -> _masks.Mask | None:
    if kw.get("causal"):
        return _masks.causal()
    return kw.get("mask")


@functools.lru_cache(maxsize=64)
def density(name: str, L: int) -> float:
    """Exact fraction f of (i, j) the mask keeps, counted in row chunks."""
    mask = _mask_of(attnkit_kwargs(name, L))
    if mask is None:
        return 1.0
    mod = mask.bind(L, L)
    kv = torch.arange(L).view(1, 1, 1, L)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    kept = 0
    for r0 in range(0, L, 512):
        q = torch.arange(r0, min(L, r0 + 512)).view(1, 1, -1, 1)
        kept += int(mod(zero, zero, q, kv).expand(1, 1, q.shape[2], L).sum())
    return kept / (L * L)


def approx_density(name: str, L: int) -> float:
    """f in closed form, within a few percent of :func:`density` (for the run-time estimate: no mask evaluated)."""
    tri = (L + 1) / (2 * L)  # the lower triangle, diagonal included
    if name == "dense":
        return 1.0
    if name in ("causal", "alibi"):
        return tri
    if name == "window":
        w = min(WINDOW, L)
        return (w * L - w * (w - 1) / 2) / (L * L)
    if name == "document":
        return 1.0 / N_DOCS
    if name == "prefix":
        p = L // 4
        return tri + p * p / (2 * L * L)
    raise ValueError(f"unknown case {name!r}; expected one of {', '.join(CASES)}")


def flops(name: str, L: int, mode: str, *, useful: bool = True, exact: bool = True) -> float:
    """4·B·H·L·S·D·f, ×(1 + 2.5) with the backward; ``useful=False``: f = 1 (what a dense kernel computes).

    ``exact=False`` takes f from :func:`approx_density` (instant; the estimate uses it).
    """
    f = (density(name, L) if exact else approx_density(name, L)) if useful else 1.0
    return 4 * B * H * L * L * D * f * ((1 + BACKWARD_FACTOR) if mode == "fwdbwd" else 1.0)


def _dense_bool(name: str, L: int):
    mask = _mask_of(attnkit_kwargs(name, L))
    return None if mask is None else mask.materialize(1, 1, L, L)


def _alibi_bias(L: int, dtype):
    """(1, H, L, L) float bias: ALiBi plus -inf above the diagonal (SDPA/naive's way to say it)."""
    pos = torch.arange(L)
    rel = (pos.view(1, L) - pos.view(L, 1)).to(torch.float32)  # kv - q
    bias = _alibi_slopes().view(H, 1, 1) * rel
    bias = bias.masked_fill(rel > 0, float("-inf"))
    return bias.unsqueeze(0).to(dtype)


# --- peers: build(case, q, k, v) -> (callable or None, setup seconds or None, note) ---

def _peer_sdpa(case: Case, q, k, v):
    t0 = time.perf_counter()
    if case.name == "dense":
        fn, note = (lambda: F.scaled_dot_product_attention(q, k, v)), "no mask"
    elif case.name == "causal":
        fn, note = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), "is_causal"
    elif case.name == "alibi":
        bias = _alibi_bias(case.L, q.dtype)
        fn, note = ((lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)),
                    "dense float bias (ALiBi + causal)")
    else:
        m = _dense_bool(case.name, case.L)
        fn, note = (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m)), "dense bool mask"
    return fn, time.perf_counter() - t0, note


def naive_fits(L: int) -> bool:
    return 3 * B * H * L * L * 4 <= NAIVE_MAX_BYTES


def _peer_naive(case: Case, q, k, v):
    if not naive_fits(case.L):
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
        kw = attnkit_kwargs(case.name, case.L)
        return (lambda: attnkit.attention(q, k, v, backend=backend, **kw)), 0.0, ""
    return build


def _peer_flex(case: Case, q, k, v):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return None, None, f"unavailable: {e}"
    # A fresh compile per case: one shared compiled function would hit dynamo's recompile
    # limit after a few cases and silently fall back to eager flex_attention, which
    # materialises (B, H, L, S) scores (tens of GiB at L = 16384).
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    kw = attnkit_kwargs(case.name, case.L)
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


def build_peer(peer: str, case: Case, q, k, v):
    """``(fn, setup_s, note)`` for one peer on one case; ``fn`` is None when the peer cannot run it."""
    return _BUILDERS[peer](case, q, k, v)
