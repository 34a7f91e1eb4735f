"""``attnkit.attention`` as a torch op: ``torch.compile(fullgraph=True)`` with no graph break, and ``torch.export``.

Shape legend: B batch, H query heads, Hkv key/value heads, L query length, S key length, D head dim,
Dv value head dim. q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) -> out (B, H, L, Dv), lse (B, H, L).

Eager calls never come here. Under ``torch.compile`` (TorchDynamo) or ``torch.export``,
:func:`attnkit.attention` hands its arguments to :func:`attention` below, which TorchDynamo traces, and which
ends in ONE call of the op ``torch.ops.attnkit.attention``: attnkit's tiled backend (its compiled kernel where
the call fits it) with a fake (meta) implementation for tracing and an autograd formula whose backward is the
op ``torch.ops.attnkit.attention_backward``.

What crosses into the op, and how (the data flow)::

    traced by TorchDynamo (cheap Python, no tensor data read)        runs eagerly, per call, inside the op
    ─────────────────────────────────────────────────────────        ───────────────────────────────────────
    mask=document(ids) & sliding_window(w)  ┐ describe: a spec       key ──► spec (parsed once, cached) ─┐
    score_mod=rel (closes over a table)     ┘ with slots                                                ▼
            │                                                        tensors, ints, floats ──► the same mask
            ├── tensors: ids, the table, a tensor mask (graph          and score_mod, rebuilt around THESE
            │     values: read at run time, gradients flow)            values
            ├── ints, floats: w, numbers a closure holds                          │
            │     (TorchDynamo may trace them as symbols)                         ▼
            └── key: a string of constants (JSON); a user            make_request → the tiled engine's kernels →
                  function by its number in a registry of            their autograd functions' forward / backward
                  (code object, what its closure holds)              (the compiled kernel where it fits)

    out, lse, out_hi = torch.ops.attnkit.attention(q, k, v, tensors, ints, floats, key, scale, learn)

Why this keeps results exact (never stale):

* Every tensor a mask or score_mod reads through its closure, defaults or a built-in's attributes is an op
  *input*: the op reads its current values on every call (an in-place edit after compiling is seen), the
  graph orders it after whatever produced it, and a learnable table gets its gradient through the op's
  autograd formula. Tile maps and score programs are then found inside the op exactly as eagerly: cached
  by *content* (a digest of the tensors taken on every call), never by identity or shapes.
* Numbers (a window size, an int a closure holds) are op inputs too, so a value TorchDynamo traces as a
  symbol (an argument of the compiled function, after a recompile: automatic dynamic) still reaches the op
  exactly. A closure's or a global's number is guarded instead: a new value recompiles (docs/compile.md).
* The key holds only constants: built-in masks and score_mods as readable JSON (their kinds, alignments and
  slot numbers), user functions as a number into a registry of ``(code object, the constants
  in its closure and defaults)``. It is made by :func:`_register`, which TorchDynamo runs once per trace
  and stores as a constant (``assume_constant_result``). That is safe because :func:`_register` depends on
  its arguments only, and the traced code *read* every one of them from the live objects first: the code
  object, each closure cell, the defaults, a built-in mask's sizes. TorchDynamo guards what it reads, so a
  call with another function, another window size or another captured constant recompiles and registers a
  new key. A function defined inside the compiled region is made by TorchDynamo from constants it traced,
  which it guards the same way.
* A FlexAttention ``BlockMask`` (``mask=`` here, ``block_mask=`` of :func:`attnkit.flex_attention`) crosses as its
  four kv index tensors (op inputs: an edited or new block mask of the same sizes is read when the op runs),
  its block size and lengths (ints) and its ``mask_mod`` (a user function as above); inside the op it is a
  ``BlockMask`` again (``from_kv_blocks``) and planned as eagerly, by content.
* Globals a user function reads (``torch``, ``math``, helpers) are read live, inside the op, as eagerly.
* A repeated call (every layer of every step) replays its forward where the compiled kernel runs it: the
  prepared call record is kept under the op's spec, numbers, the *content* of every tensor it was given (a
  digest taken on each call), shapes, dtypes, scale and thread count (``_STEPS``), and holds copies of what it
  reads (a score_mod's program, ALiBi's slopes, the mask's rows or tile map). The backward recomputes as before.

Not taken by the op (a ``TypeError`` / ``ValueError`` naming it, raised while tracing: under
``fullgraph=True`` the compile fails with that message; without it TorchDynamo breaks the graph there and
the call runs eagerly): ``dropout_p``, ``return_weights``, a backend other than ``auto`` / ``tiled``, NumPy
inputs, an ``attnkit.plan``, a user ``Mask`` or ``ScoreMod`` subclass or a
callable object, a closure holding something that is neither a tensor nor a constant. A function made
inside the compiled region that captures a *tensor* cannot be described (TorchDynamo does not expose the
closure of such a function): define it outside the compiled code, e.g. in the module's ``__init__``, or use
``attnkit.score_mods``; TorchDynamo then reports "assume_constant_result argument conversion failed".
A score_mod reading a tensor that requires grad through a global variable raises ``ValueError`` inside the
op (its gradient could not reach it): capture it in a closure.

``auto`` under compilation always runs the tiled backend (the compiled kernel where the call fits): the
eager ``auto`` may pick torch's SDPA for small calls; both are exact, results agree to rounding.
"""

from __future__ import annotations

import json
import math
import sys
import types
from collections import OrderedDict

import torch

from . import _mods
from . import masks as _m
from . import score_mods as _sm
from ._blockmask import is_block_mask
from ._request import _check_sinks, _scale_value, make_request, positive_scale
from .backends import _native, _softmax, native, tiled
from .backends._tiled_ctx import TileContext

__all__ = ["attention", "registered", "OP", "BACKWARD_OP"]

_PREFIX = "attnkit/1:"
_HALF = (torch.float16, torch.bfloat16)

# user functions by number: (code, globals, name, cells, defaults, kwdefaults); cells / defaults are tuples of
# ("t", slot) or ("c", constant)
_FNS: list[tuple] = []
_FN_IDS: dict = {}
_SPECS: dict[str, dict] = {}  # key -> its parsed spec


# ---------------------------------------------------------------- traced side (TorchDynamo reads this code)

def attention(q, k, v, *, mask=None, causal=False, scale=None, score_mod=None, dropout_p=0.0, return_lse=False,
              return_weights=False, sinks=None, backend="auto"):
    """:func:`attnkit.attention` under ``torch.compile`` / ``torch.export``: the same arguments and results,
    one call of ``torch.ops.attnkit.attention`` (see the module docstring for what it takes)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        raise TypeError("q, k, v: under torch.compile / torch.export attnkit.attention takes torch tensors, got "
                        f"{type(q).__name__}, {type(k).__name__}, {type(v).__name__}. Convert NumPy arrays "
                        "with torch.from_numpy outside the compiled code.")
    if not isinstance(backend, str) or backend not in ("auto", "tiled"):
        raise ValueError(f"backend: under torch.compile / torch.export attnkit.attention runs the tiled backend "
                         f"('auto' or 'tiled'), got {backend!r}. Pass backend='auto', or call it outside the "
                         "compiled code.")
    if dropout_p != 0.0 and dropout_p != 0:
        raise ValueError(f"dropout_p: under torch.compile / torch.export attnkit.attention has no dropout, got "
                         f"{dropout_p!r}. Use dropout_p=0.0, or call it outside the compiled code.")
    if return_weights is not False and return_weights is not None:
        raise ValueError("return_weights: not available under torch.compile / torch.export; call "
                         "attnkit.attention(..., return_weights=...) outside the compiled code.")
    if type(causal) is not bool:
        raise TypeError(f"causal: expected True or False, got {causal!r}.")
    if type(return_lse) is not bool:
        raise TypeError(f"return_lse: expected True or False, got {return_lse!r}.")
    if scale is not None:
        q, scale = positive_scale(q, _scale_value(scale))  # (the op's kernels take a scale > 0)
    rank = q.dim()
    if rank not in (2, 3, 4) or k.dim() != rank or v.dim() != rank:
        raise ValueError(f"q, k, v: expected the same rank 2, 3 or 4, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}.")
    q4, k4, v4 = _lift(q, rank), _lift(k, rank), _lift(v, rank)
    acc = _Acc()
    mspec = None if mask is None else _mask_spec(mask, acc, True)
    sspec = None if score_mod is None else _score_spec(score_mod, acc)
    grad = torch.is_grad_enabled()
    learn = "".join("1" if grad and t.requires_grad and t.is_floating_point() else "0" for t in acc.tensors)
    key = _register(causal, mspec, sspec)
    out, lse, _ = torch.ops.attnkit.attention(q4, k4, v4, acc.tensors, acc.ints, acc.floats, key, scale, learn)
    if sinks is not None:
        B, H, L = q4.shape[0], q4.shape[1], q4.shape[2]
        out, lse = _softmax.add_sink(out, lse, _check_sinks(sinks, q4, B, H, L))
    if rank == 3:
        out, lse = out[0], lse[0]
    elif rank == 2:
        out, lse = out[0, 0], lse[0, 0]
    return (out, lse) if return_lse else out


def _lift(t, rank: int):
    if rank == 2:
        return t.unsqueeze(0).unsqueeze(0)
    if rank == 3:
        return t.unsqueeze(0)
    return t


class _Acc:
    """What a spec's slots point into: the op's tensor inputs, and its int and float inputs. Numbers travel as op
    inputs, not in the key: TorchDynamo traces a number that changed between calls as a symbol (automatic
    dynamic), which a constant key could not hold."""

    def __init__(self):
        self.tensors: list = []
        self.ints: list = []
        self.floats: list = []


def _slot(acc: _Acc, t) -> int:
    """The op input number of tensor ``t`` (each tensor object once)."""
    for i, x in enumerate(acc.tensors):
        if x is t:
            return i
    acc.tensors.append(t)
    return len(acc.tensors) - 1


def _num(acc: _Acc, x):
    """``["i", n]`` / ``["f", n]``: the op's n-th int / float input holds ``x``."""
    if isinstance(x, int):
        acc.ints.append(x)
        return ("i", len(acc.ints) - 1)
    acc.floats.append(x)
    return ("f", len(acc.floats) - 1)


def _mask_spec(m, acc: _Acc, top: bool):
    t = type(m)
    if t is _m.Causal:
        return ("causal", m.align)
    if t is _m.SlidingWindow:
        return ("sliding_window", _num(acc, m.size), m.align)
    if t is _m.Chunked:
        return ("chunked", _num(acc, m.size), m.align)
    if t is _m.PrefixLM:
        return ("prefix_lm", _num(acc, m.prefix_length))
    if t is _m.Full:
        return ("full",)
    if t is _m.Document:
        return ("document", _slot(acc, m._doc_ids))
    if t is _m.Padding:
        return ("padding", _slot(acc, m._key_lengths))
    if t is _m.KeyPadding:
        return ("key_padding", _slot(acc, m._valid))
    if t is _m.And or t is _m.Or:
        return ("and" if t is _m.And else "or", tuple(_mask_spec(p, acc, False) for p in m.parts))
    if t is _m.Not:
        return ("not", _mask_spec(m.inner, acc, False))
    if t is _m.FromMod:
        return ("mod", _fn_spec(m.fn, acc, "mask_mod"))
    if isinstance(m, torch.Tensor):
        if not top:
            raise TypeError("mask: a tensor inside a combined mask; pass it as mask= on its own.")
        return ("tensor", _slot(acc, m))
    if top and is_block_mask(m):
        return _block_mask_spec(m, acc)
    if isinstance(m, _m.Mask):
        raise TypeError(f"mask: {t.__name__} is a Mask subclass attnkit's torch op does not know; under "
                        "torch.compile / torch.export pass its mask_mod function (mask=fn) or a built-in mask.")
    if isinstance(m, types.FunctionType):
        return ("mod", _fn_spec(m, acc, "mask_mod"))
    raise TypeError(f"mask: under torch.compile / torch.export attnkit.attention takes None, a tensor, a built-in "
                    f"attnkit.masks mask, a mask_mod function or a BlockMask, got {t.__name__} (a plan or a callable "
                    "object needs the eager call: make it outside the compiled code).")


def _block_mask_spec(bm, acc: _Acc):
    """``("block_mask", kv slots, full kv slots or None, block size, lengths, mod spec or None)``: a torch BlockMask
    as the op's inputs — its four kv index tensors (the blocks: read when the op runs, so a new block mask with the
    same sizes needs no new graph), its block size and lengths, and its mask_mod as any mask_mod is taken."""
    mod = bm.mask_mod
    flex = sys.modules["torch.nn.attention.flex_attention"]
    full = None if bm.full_kv_num_blocks is None else (_slot(acc, bm.full_kv_num_blocks),
                                                      _slot(acc, bm.full_kv_indices))
    if mod is None or mod is flex.noop_mask:
        mspec = None
    elif isinstance(mod, types.FunctionType):
        mspec = _fn_spec(mod, acc, "mask_mod")
    else:
        raise TypeError(f"mask: under torch.compile / torch.export a BlockMask's mask_mod must be a function, got "
                        f"{type(mod).__name__}. Build the block mask from a function (def or lambda), or call "
                        "outside the compiled code.")
    # block size and lengths as the op's int inputs: a new length traced as a symbol (automatic dynamic) still
    # reaches the op, where a constant in the key could not hold it
    return ("block_mask", (_slot(acc, bm.kv_num_blocks), _slot(acc, bm.kv_indices)), full,
            tuple(_num(acc, x) for x in bm.BLOCK_SIZE), tuple(_num(acc, x) for x in bm.seq_lengths), mspec)


def _score_spec(fn, acc: _Acc):
    t = type(fn)
    if t is _sm.Softcap:
        return ("softcap", _num(acc, fn.cap))
    if t is _sm.RelativeBias:
        return ("relative_bias", _slot(acc, fn.table))
    if t is _sm.Alibi:
        return ("alibi", _slot(acc, fn.slopes))
    if isinstance(fn, types.FunctionType):
        return ("fn", _fn_spec(fn, acc, "score_mod"))
    raise TypeError(f"score_mod: under torch.compile / torch.export attnkit.attention takes a function or an "
                    f"attnkit.score_mods built-in, got {t.__name__}; wrap it in a function.")


def _fn_spec(fn, acc: _Acc, what: str):
    """``("fn", fn, code, cells, defaults)``: the function's code and what its closure and defaults hold, each a
    tensor (an op input: ``("t", slot)``) or a constant (``("c", value)``), read here so TorchDynamo guards them;
    ``("nested", fn)`` for a function TorchDynamo made inside the compiled region (it guards how it made it)."""
    try:
        cells = fn.__closure__
    except AttributeError:  # TorchDynamo does not expose the closure of a function made while tracing
        return ("nested", fn)
    code = fn.__code__
    got = tuple(_part(c.cell_contents, acc, what) for c in (cells or ()))
    defaults = tuple(_part(d, acc, what) for d in (fn.__defaults__ or ()))
    return ("fn", fn, code, got, defaults)


def _part(x, acc: _Acc, what: str):
    if isinstance(x, torch.Tensor):
        return ("t", _slot(acc, x))
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return _num(acc, x)
    if isinstance(x, tuple) and _constant(x):
        return ("tuple", tuple(_part(y, acc, what) for y in x))
    if _constant(x):
        return ("c", x)
    raise TypeError(f"{what}: under torch.compile / torch.export its closure and defaults may hold tensors and "
                    f"constants (numbers, strings, tuples of them, functions, modules), got a {type(x).__name__}. "
                    "Capture the tensor or value itself.")


def _constant(x) -> bool:
    if x is None or isinstance(x, (bool, int, float, str, types.FunctionType, types.ModuleType)):
        return True
    if isinstance(x, tuple):
        return all(_constant(y) for y in x)
    return False


# ------------------------------------------------------- the key: made once per trace, stored as a constant

def _register(causal: bool, mspec, sspec) -> str:
    """The op's key for this spec (plain JSON; a user function by its number in the registry)."""
    doc = {"causal": bool(causal), "mask": None if mspec is None else _enc_mask(mspec),
           "score": None if sspec is None else _enc_score(sspec)}
    return _PREFIX + json.dumps(doc, separators=(",", ":"), sort_keys=True)


# TorchDynamo calls it once while tracing and keeps the result as a constant (torch._dynamo.assume_constant_result,
# set without importing TorchDynamo): safe because it depends on its arguments only, which the traced code read
# from the live objects (and TorchDynamo guards). torch.export's non-strict tracing just calls it.
_register._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _enc_mask(s):
    kind = s[0]
    if kind in ("and", "or"):
        return [kind, [_enc_mask(p) for p in s[1]]]
    if kind == "not":
        return [kind, _enc_mask(s[1])]
    if kind == "mod":
        return [kind, _enc_fn(s[1])]
    if kind == "block_mask":
        return [kind, list(s[1]), None if s[2] is None else list(s[2]), [list(p) for p in s[3]],
                [list(p) for p in s[4]], None if s[5] is None else _enc_fn(s[5])]
    return list(s)


def _enc_score(s):
    return ["fn", _enc_fn(s[1])] if s[0] == "fn" else list(s)


def _typed(x):
    """A hashable stand-in telling 1, 1.0 and True (and 0.0 from -0.0) apart."""
    if isinstance(x, tuple):
        return ("tuple", tuple(_typed(y) for y in x))
    if isinstance(x, (bool, int, float, str)) or x is None:
        return (type(x).__name__, repr(x))
    return ("obj", id(x), x)


def _enc_fn(s) -> int:
    if s[0] == "nested":
        fn = s[1]
        cl = fn.__closure__ or ()
        cells = tuple(("c", c.cell_contents) for c in cl)
        defaults = tuple(("c", d) for d in (fn.__defaults__ or ()))
        code = fn.__code__
        for _, x in cells + defaults:
            if isinstance(x, torch.Tensor) or not _constant(x):
                raise TypeError("a mask_mod / score_mod made inside the compiled code captures a "
                                f"{type(x).__name__}: define it outside the compiled code.")
    else:
        _, fn, code, cells, defaults = s
    kw = fn.__kwdefaults__
    if kw and any(isinstance(x, torch.Tensor) or not _constant(x) for x in kw.values()):
        raise TypeError(f"{fn.__name__}: keyword-only defaults holding tensors are not taken under torch.compile; "
                        "use a closure.")
    g = fn.__globals__
    names = [n for n in code.co_names if isinstance(g.get(n), torch.Tensor) and g[n].requires_grad]
    if names:
        raise ValueError(f"{fn.__name__} reads the global tensor {names[0]!r}, which requires grad: under "
                         "torch.compile its gradient could not reach it. Capture it in a closure "
                         "(def make(t): def mod(...): ... t ...; return mod).")
    ident = (code, id(g), fn.__name__, tuple((k, _typed(x)) for k, x in cells),
             tuple((k, _typed(x)) for k, x in defaults), tuple(sorted((kw or {}).items())))
    n = _FN_IDS.get(ident)
    if n is None:
        n = len(_FNS)
        _FNS.append((code, g, fn.__name__, cells, defaults, dict(kw) if kw else None))
        _FN_IDS[ident] = n
    return n


def registered() -> int:
    """How many user functions the op's registry holds (one per distinct code and constants traced)."""
    return len(_FNS)


# ------------------------------------------------------------------ inside the op: rebuilt, then run eagerly

def _spec(key: str) -> dict:
    doc = _SPECS.get(key)
    if doc is None:
        if not key.startswith(_PREFIX):
            raise ValueError(f"attnkit op: a key from another version of attnkit ({key[:40]!r}); re-export.")
        doc = json.loads(key[len(_PREFIX):])
        _SPECS[key] = doc
    return doc


def _val(part, ts: list, ints: list, floats: list):
    """The value a spec part names: a tensor, int or float input of this call, or a constant."""
    kind, x = part
    if kind == "t":
        return ts[x]
    if kind == "i":
        return int(ints[x])
    if kind == "f":
        return float(floats[x])
    if kind == "tuple":
        return tuple(_val(p, ts, ints, floats) for p in x)
    return x


def _fn(n: int, ts: list, ints: list, floats: list):
    if n >= len(_FNS):
        raise RuntimeError(f"attnkit op: user function #{n} is not registered in this process (a program exported "
                           "elsewhere runs where the model's code has been traced once; built-in masks and "
                           "score_mods need nothing).")
    code, g, name, cells, defaults, kw = _FNS[n]
    val = [_val(p, ts, ints, floats) for p in cells]
    dfl = tuple(_val(p, ts, ints, floats) for p in defaults) or None
    f = types.FunctionType(code, g, name, dfl, tuple(types.CellType(x) for x in val) or None)
    if kw:
        f.__kwdefaults__ = dict(kw)
    return f


def _build_mask(s, ts: list, ints: list, floats: list):
    kind = s[0]
    if kind == "causal":
        return _m.causal(s[1])
    if kind == "sliding_window":
        return _m.sliding_window(_val(s[1], ts, ints, floats), s[2])
    if kind == "chunked":
        return _m.chunked(_val(s[1], ts, ints, floats), s[2])
    if kind == "prefix_lm":
        return _m.prefix_lm(_val(s[1], ts, ints, floats))
    if kind == "full":
        return _m.full()
    if kind == "document":
        return _m.document(ts[s[1]])
    if kind == "padding":
        return _m.padding(ts[s[1]])
    if kind == "key_padding":
        return _m.key_padding(ts[s[1]])
    if kind == "and" or kind == "or":
        parts = [_build_mask(p, ts, ints, floats) for p in s[1]]
        return _m.And(*parts) if kind == "and" else _m.Or(*parts)
    if kind == "not":
        return _m.Not(_build_mask(s[1], ts, ints, floats))
    if kind == "mod":
        return _m.from_mod(_fn(s[1], ts, ints, floats))
    if kind == "tensor":
        return ts[s[1]]
    if kind == "block_mask":  # the BlockMask again, from this call's tensors (its q-side lists are not read)
        from torch.nn.attention.flex_attention import BlockMask

        (nb, ix), full = s[1], s[2]
        fnb, fix = (None, None) if full is None else (ts[full[0]], ts[full[1]])
        return BlockMask.from_kv_blocks(ts[nb], ts[ix], fnb, fix,
                                        BLOCK_SIZE=tuple(_val(p, ts, ints, floats) for p in s[3]),
                                        mask_mod=None if s[5] is None else _fn(s[5], ts, ints, floats),
                                        seq_lengths=tuple(_val(p, ts, ints, floats) for p in s[4]),
                                        compute_q_blocks=False)
    raise ValueError(f"attnkit op: unknown mask kind {kind!r}")


def _build_score(s, ts: list, ints: list, floats: list):
    kind = s[0]
    if kind == "softcap":
        return _sm.softcap(_val(s[1], ts, ints, floats))
    if kind == "relative_bias":
        return _sm.relative_bias(ts[s[1]])
    if kind == "alibi":
        return _sm.alibi(ts[s[1]])
    if kind == "fn":
        return _fn(s[1], ts, ints, floats)
    raise ValueError(f"attnkit op: unknown score_mod kind {kind!r}")


def _prepare(q, k, v, tensors, ints, floats, key: str, scale, learn):
    """The request and tile context of one op call, the tensors as the mods see them (a learnable one as a
    fresh leaf that requires grad, so the backend returns its gradient)."""
    doc = _spec(key)
    wants = [c == "1" for c in learn]
    ts = [t.detach().requires_grad_(True) if want else t.detach() for t, want in zip(tensors, wants, strict=True)]
    with torch.enable_grad():
        mask = None if doc["mask"] is None else _build_mask(doc["mask"], ts, ints, floats)
        sm = None if doc["score"] is None else _build_score(doc["score"], ts, ints, floats)
        req = make_request(q.detach(), k.detach(), v.detach(), mask=mask, causal=doc["causal"], scale=scale,
                           score_mod=sm, dropout_p=0.0, return_lse=True, backend="tiled")
        mine = [t for t, want in zip(ts, wants, strict=True) if want]
        if req.grad_hidden or any(not any(t is x for x in mine) for t in req.grad_tensors):
            raise ValueError("score_mod reads a tensor that requires grad outside its closure and defaults (a "
                             "global, an object's attribute): under torch.compile its gradient could not reach it. "
                             "Capture the tensor in the function's closure.")
        why = tiled.unsupported(req)
        if why is not None:
            raise ValueError(f"attnkit op: {why}")
        # the tiled engine's kernels with a backward, in the table's order (the decode entry has none)
        kern = next((k for k in (native.NATIVE, tiled.FLASH_RUNS) if not k.not_supported(req)), tiled.PLAIN)
        c = TileContext(req, "native") if kern is native.NATIVE else tiled.context(req, kern.worker)
    return req, c, ts


class _Saved:
    """What the kernels' autograd functions (``tiled._TiledAttention``, ``native._NativeAttention``) read and
    write on their context."""

    saved_tensors: tuple = ()
    c = None
    req = None
    captured: tuple = ()

    def save_for_backward(self, *ts):
        self.saved_tensors = ts

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _with_autograd(fn):
    """Run ``fn`` with autograd recording on again: a custom op's implementation runs below the autograd key, but
    the tiled backend differentiates score_mod tiles itself (its torch workers, the exact-rows fix) by autograd."""
    import functools

    @functools.wraps(fn)
    def run(*args):
        C = torch._C
        ex = C._dispatch_tls_local_exclude_set().remove(C.DispatchKey.AutogradFunctionality)
        with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), ex):
            return fn(*args)

    return run


def _lse_dtype(dt):
    return torch.float64 if dt == torch.float64 else torch.float32


@torch.library.custom_op("attnkit::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor], ints: list[int],
                  floats: list[float], key: str,
                  scale: float | None, learn: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out (B, H, L, Dv), lse (B, H, L), out_hi)``: out_hi is the fp32 output before rounding for fp16 /
    bf16 inputs (the backward's delta is taken from it), an empty tensor otherwise."""
    sig = _step_signature(q, k, v, tensors, ints, floats, key, scale)
    step = _STEPS.get(sig) if sig is not None else None
    if step is not None:  # a replayed forward (below): no autograd inside it
        return _finish_step(q, *step(q, k, v, 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)))
    return _FORWARD(q, k, v, tensors, ints, floats, key, scale, learn, sig)


# A compiled model makes the same op call at every layer of every step. Where the call runs on the compiled kernel,
# its forward is prepared once per signature (native.forward_step: the mask's rows or tile map, the score_mod's
# program, ALiBi's slopes, each a copy) and replayed: the signature holds the spec, the numbers, the *content* of
# every tensor the mods read (a digest taken on this call), the shapes, dtypes, scale and thread count.
_STEPS: OrderedDict = OrderedDict()  # signature -> run(q, k, v, scale) -> (out fp32, lse), or None (not replayed)
_STEPS_MAX = 64


def _step_signature(q, k, v, tensors, ints, floats, key, scale):
    """The forward's signature (see _STEPS), or None where a tensor has no content key (too large, not on the CPU)
    or a user function reads something live that has none (a list, a user module's attribute)."""
    if not (q.is_cpu and k.is_cpu and v.is_cpu) or not tiled.NATIVE:
        return None
    parts = []
    for t in tensors:
        c = _mods.content_key(t)
        if c is None:
            return None
        parts.append(c)
    live = _live_key(key)
    if live is None:
        return None
    # floats by their bits: 0.0 and -0.0 are equal numbers but not equal values (copysign, 1 / x)
    return (key, tuple(ints), tuple(float.hex(float(f)) for f in floats), tuple(parts), live, q.shape, k.shape,
            v.shape, q.dtype, k.dtype, v.dtype, scale, torch.get_num_threads())


_FN_NUMS: dict[str, tuple[int, ...]] = {}  # key -> the user functions (registry numbers) its mask and score name


def _fns_of(key: str) -> tuple[int, ...]:
    got = _FN_NUMS.get(key)
    if got is None:
        doc, nums = _spec(key), []

        def walk(m):
            if m[0] in ("and", "or"):
                for p in m[1]:
                    walk(p)
            elif m[0] == "not":
                walk(m[1])
            elif m[0] == "mod":
                nums.append(m[1])
            elif m[0] == "block_mask" and m[5] is not None:
                nums.append(m[5])

        if doc["mask"] is not None:
            walk(doc["mask"])
        if doc["score"] is not None and doc["score"][0] == "fn":
            nums.append(doc["score"][1])
        got = _FN_NUMS[key] = tuple(nums)
    return got


def _live_key(key: str):
    """What the key's user functions read live, by value: the globals their code names, and the functions and
    modules their closures hold (attnkit._mods content keys); None where one has no such key. The key itself
    holds only the functions' code and constants: what they read at run time is read inside the op, and a
    replayed forward must not outlive a change of it."""
    parts: list = []

    def held(p) -> bool:  # a closure / default part ("c", x) or ("tuple", parts); tensors and numbers are inputs
        if p[0] == "tuple":
            return all(held(y) for y in p[1])
        if p[0] == "c" and isinstance(p[1], (types.FunctionType, types.ModuleType)):
            c = _mods.value_key(p[1]) if isinstance(p[1], types.FunctionType) else _mods._const(p[1], 0)
            if c is None:
                return False
            parts.append(c)
        return True

    for n in _fns_of(key):
        if n >= len(_FNS):  # not registered in this process: the full path says so
            return None
        code, g, _, cells, defaults, _ = _FNS[n]
        for name in _mods._global_names(code):  # nested lambdas and comprehensions included
            if name in g:
                c = _mods._const(g[name], 0)
                if c is None:
                    return None
                parts.append((name, c))
        if not all(held(p) for p in tuple(cells) + tuple(defaults)):
            return None
    return tuple(parts)


def _learn_step(req, c):
    """The prepared forward of a call the compiled kernel runs, or None: a decode step's (at most 16 query rows,
    each one or a few stretches of keys) on the kernel's decode entry, as an eager call under ``no_grad`` runs it
    (the op's backward recomputes from ``out`` and ``lse``, which the decode entry gives as the forward does);
    other calls on the forward's tiles."""
    decode = _decode_step(req)
    if decode is not None:
        return decode
    if c.worker != "native" or ("row_intervals" not in req.memo and "tile_bits" not in req.memo):
        return None
    with torch.no_grad():
        alibi = native._alibi(req)
        lo, hi, tiles = native._mask_of(req)
        return _native.forward_step(req.q, req.k, req.v, lo, hi, tiles,
                                    alibi=None if alibi is None else alibi.detach().clone(),
                                    prog=req.memo.get("score_prog"), with_lse=True)


def _decode_step(req):
    """The decode entry's prepared call ``run(q, k, v, scale) -> (out fp32, lse)`` for ``req``, or None where the
    entry does not take it (more than 16 query rows, a gradient into a captured tensor, rows of more stretches)."""
    if native.NATIVE_DECODE.not_supported(req):
        return None
    st = req.memo.get("row_stretches")  # (the rows: their stretch planes, or one interval each)
    lo, hi = st if st is not None else req.memo["row_intervals"]
    alibi = native._alibi(req)
    rows = native._rows  # (the last dim contiguous, as the eager decode entry reads them: a packed qkv's q is not)
    try:
        with torch.no_grad():
            return _native.decode_step(rows(req.q), rows(req.k), rows(req.v), lo.contiguous(), hi.contiguous(),
                                       alibi=None if alibi is None else alibi.detach().clone(),
                                       prog=req.memo.get("score_prog"), with_lse=True)
    except (ValueError, TypeError):  # a call the entry's record refuses: the forward's tiles, as before
        return None


def _forward(q, k, v, tensors, ints, floats, key, scale, learn, sig=None):
    """The op's forward on the full path; with a signature not seen before (``sig``), its prepared step is kept."""
    if q.shape[2] == 0:  # no query rows: the empty answer (the tile maps divide by L)
        B, H, _, _ = q.shape
        out_hi = q.new_empty(B, H, 0, v.shape[-1], dtype=torch.float32) if q.dtype in _HALF else q.new_empty(0)
        return q.new_empty(B, H, 0, v.shape[-1]), q.new_empty(B, H, 0, dtype=_lse_dtype(q.dtype)), out_hi
    req, c, _ = _prepare(q, k, v, tensors, ints, floats, key, scale, learn)
    if sig is not None and sig not in _STEPS:
        step = _STEPS[sig] = _learn_step(req, c)
        if len(_STEPS) > _STEPS_MAX:
            _STEPS.popitem(last=False)
        if step is not None:
            return _finish_step(q, *step(req.q, req.k, req.v, req.scale))
    ctx = _Saved()
    with torch.no_grad():
        if c.worker == "native":
            out, lse = native._NativeAttention.forward(ctx, req.q, req.k, req.v, req, *c.captured)
        else:
            out, lse = tiled._TiledAttention.forward(ctx, req.q, req.k, req.v, req.bias, c, *c.captured)
    hi = ctx.saved_tensors[3]
    out_hi = hi.float().contiguous() if q.dtype in _HALF else q.new_empty(0)
    return out.contiguous(), lse.to(_lse_dtype(q.dtype)).contiguous(), out_hi


_FORWARD = _with_autograd(_forward)


def _finish_step(q, out_hi, lse):
    """The op's three outputs from the prepared forward's fp32 ``out_hi`` and ``lse`` (as ``_forward`` below)."""
    if q.dtype in _HALF:
        return out_hi.to(q.dtype), lse, out_hi
    return out_hi, lse, q.new_empty(0)


@_attention_op.register_fake
def _attention_fake(q, k, v, tensors, ints, floats, key, scale, learn):
    B, H, L, _ = q.shape
    Dv = v.shape[-1]
    out_hi = q.new_empty(B, H, L, Dv, dtype=torch.float32) if q.dtype in _HALF else q.new_empty(0)
    return q.new_empty(B, H, L, Dv), q.new_empty(B, H, L, dtype=_lse_dtype(q.dtype)), out_hi


@torch.library.custom_op("attnkit::attention_backward", mutates_args=())
def _attention_backward_op(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, out_hi: torch.Tensor,
                           tensors: list[torch.Tensor], ints: list[int], floats: list[float], key: str,
                           scale: float | None,
                           learn: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``(dq, dk, dv, [gradient of each tensor with learn set])`` for the forward above."""
    return _BACKWARD(dout, dlse, q, k, v, out, lse, out_hi, tensors, ints, floats, key, scale, learn)


def _backward_impl(dout, dlse, q, k, v, out, lse, out_hi, tensors, ints, floats, key, scale, learn):
    if q.shape[2] == 0:  # no query rows: nothing flows back
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                [torch.zeros_like(t) for t, want in zip(tensors, learn, strict=True) if want == "1"])
    req, c, ts = _prepare(q, k, v, tensors, ints, floats, key, scale, learn)
    ctx = _Saved()
    ctx.saved_tensors = (req.q, req.k, req.v, out_hi if out_hi.numel() else out, lse)
    ctx.c, ctx.req, ctx.captured = c, req, tuple(c.captured)
    with torch.no_grad():
        if c.worker == "native":
            dq, dk, dv, _, *dcap = native._NativeAttention.backward(ctx, dout, dlse)
            dbias = None
        else:
            dq, dk, dv, dbias, _, *dcap = tiled._TiledAttention.backward(ctx, dout, dlse)
    grads: list = [None] * len(ts)
    for t, g in zip(c.captured, dcap, strict=True):
        for i, x in enumerate(ts):
            if x is t and g is not None:
                grads[i] = g if grads[i] is None else grads[i] + g
    mspec = _spec(key)["mask"]
    if dbias is not None and mspec is not None and mspec[0] == "tensor":  # a float mask's gradient, its shape
        i = mspec[1]
        g = dbias.reshape(ts[i].shape)
        grads[i] = g if grads[i] is None else grads[i] + g
    dt = [(torch.zeros_like(tensors[i]) if grads[i] is None else grads[i].to(tensors[i].dtype)).contiguous()
          for i, want in enumerate(learn) if want == "1"]
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dt


_BACKWARD = _with_autograd(_backward_impl)


@_attention_backward_op.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, out, lse, out_hi, tensors, ints, floats, key, scale, learn):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),  # contiguous, as the real ones
            [t.new_empty(t.shape) for t, want in zip(tensors, learn, strict=True) if want == "1"])


def _setup_context(ctx, inputs, output):
    q, k, v, tensors, ints, floats, key, scale, learn = inputs
    out, lse, out_hi = output
    ctx.save_for_backward(q, k, v, out, lse, out_hi, *tensors)
    ctx.ints, ctx.floats, ctx.key, ctx.scale, ctx.learn = ints, floats, key, scale, learn
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, _dout_hi):
    q, k, v, out, lse, out_hi, *tensors = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dt = torch.ops.attnkit.attention_backward(dout, dlse, q, k, v, out, lse, out_hi, tensors, ctx.ints,
                                                          ctx.floats, ctx.key, ctx.scale, ctx.learn)
    grads: list = [None] * len(tensors)
    j = 0
    for i, want in enumerate(ctx.learn):
        if want == "1":
            grads[i] = dt[j]
            j += 1
    # no gradient for the numbers: an empty list is matched by an empty list, a filled one by None (its structure
    # as torch's autograd wrapper flattens the inputs)
    return dq, dk, dv, grads, [] if not ctx.ints else None, [] if not ctx.floats else None, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _register_no_grad_kernel() -> bool:
    """A lighter AutogradCPU kernel for calls that record no graph: CPU tensors, nothing below autograd to visit
    (no fake / functional / Python mode: torch.compile's traces take the full path) and no gradient wanted (no
    grad mode, or no input that requires grad) — the op's function called directly. What it skips, on each call
    of a compiled model's attention: torch.library's autograd wrapper (its no-grad branch redispatches below
    autograd), and the dispatch to the implementation with its output-aliasing check (the outputs are new
    tensors: ``_forward``, ``_finish_step``). A compiled decode step over 1024 keys: 35-40 us less on a 2-core
    AMD EPYC (`python benchmarks/compile_decode.py --lengths 1024`, BENCHMARKS.md).
    Every other call goes on to the wrapper torch.library built for the op, as before. Registered for AutogradCPU
    (the op's own registration is for the Autograd alias: a backend's key takes precedence); False where this
    torch has no such wrapper to hand on to (the op's own path serves every call)."""
    try:
        from torch._library.autograd import make_autograd_impl
    except ImportError:  # pragma: no cover - a torch without it: the op's own registration serves
        return False
    full = make_autograd_impl(torch.ops.attnkit.attention.default, _attention_op)
    after, cpu = torch._C._after_autograd_keyset, torch._C.DispatchKey.CPU
    grad_on, wants_grad, direct = torch.is_grad_enabled, torch._C._any_requires_grad, _attention_op._init_fn

    def kernel(keyset, *args):
        if (keyset & after).highestPriorityTypeId() == cpu and not (grad_on() and wants_grad(*args)):
            return direct(*args)
        return full(keyset, *args)

    _LIB.impl("attention", kernel, "AutogradCPU", with_keyset=True)
    return True


_LIB = torch.library.Library("attnkit", "FRAGMENT")
NO_GRAD_KERNEL = _register_no_grad_kernel()

OP = torch.ops.attnkit.attention
BACKWARD_OP = torch.ops.attnkit.attention_backward
