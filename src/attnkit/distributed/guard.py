"""What keeps the ranks of a call honest: content signatures agreed before the call, a status after
it, timeouts, and process groups marked dead after a failure (:class:`ContextParallelError`)."""

from __future__ import annotations

import functools
import hashlib
import types

import torch

from .. import _mods
from .. import masks as _masks
from .._tiling import host_array


class ContextParallelError(RuntimeError):
    """A context-parallel call failed on some rank (mismatch, exception, timeout); raised on every rank."""


_REBUILD = ("The process group must be rebuilt before context parallelism can run again: messages of the failed "
            "call are left unmatched on some ranks. On every rank: torch.distributed.destroy_process_group(), "
            "init_process_group(...) again, and a new ContextParallel.")


_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Compared in this order, so the first difference named is the root one: a rank with another
# seq_len is told that, not that its layout (which follows from it) differs.
_FIELDS = ("status", "call", "seq_len", "layout", "B", "H", "Hkv", "D", "Dv", "rows", "dtype", "causal", "scale",
           "score_mod", "mask", "keep_kv", "return_lse", "grad", "comm", "module")
_MSG = 384
_HASHED = ("dtype", "scale", "score_mod", "mask", "layout", "comm", "module")


def _field_text(message: str, name: str) -> str:
    """The ``name=...`` part of a signature's description (what was hashed), or all of it."""
    return next((x.strip() for x in message.split("; ") if x.strip().startswith(name + "=")), message)


# ------------------------------------------------------------------------- content digests
# A signature compared across ranks must be made of what decides the answer (DESIGN, "Caching and
# signatures"): two document masks with one boundary moved have the same repr, two closures of
# one function the same name. So the mask and the score_mod are hashed by content: tensors by
# their bytes, functions by their code and every value they capture, objects by their public
# attributes (private ones are derived caches, e.g. a mask's per-device copies). Issue 18, item 4.

_DIGEST_DEPTH = 8


def _digest(obj) -> int:
    """A signed 64-bit digest of ``obj``'s content (equal on every rank iff the content is)."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, obj, 0, set())
    return int.from_bytes(h.digest(), "little", signed=True)


def _tag(h, *parts):
    for p in parts:
        h.update(str(p).encode())
        h.update(b"\0")


def _feed(h, x, depth, active):
    if x is None or isinstance(x, (bool, int, str, bytes, complex)):
        return _tag(h, type(x).__name__, repr(x))  # a scalar's repr is its value
    if isinstance(x, float):
        return _tag(h, "float", x.hex())
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu").contiguous()
        _tag(h, "tensor", t.dtype, tuple(t.shape))
        # any dtype, bf16 included; not .numpy(), which would leave a parameter unable to resize_ (FSDP frees one so)
        h.update(host_array(t.reshape(-1).view(torch.uint8)).tobytes())
        return None
    if _is_numpy(x):  # arrays and scalars (np.float32(0.3), np.int64(2): hashed by type alone before)
        _tag(h, "ndarray", x.dtype, x.shape)
        h.update(x.tobytes())  # C order, whatever the strides
        return None
    if isinstance(x, (types.ModuleType, type)):
        return _tag(h, "named", getattr(x, "__module__", ""), getattr(x, "__qualname__", getattr(x, "__name__", "")))
    if isinstance(x, types.BuiltinFunctionType):
        return _tag(h, "builtin", getattr(x, "__module__", ""), x.__qualname__)
    if depth >= _DIGEST_DEPTH or id(x) in active:
        return _tag(h, "deep" if depth >= _DIGEST_DEPTH else "cycle", type(x).__qualname__)
    active.add(id(x))
    try:
        _feed_container(h, x, depth + 1, active)
    finally:
        active.discard(id(x))
    return None


def _feed_container(h, x, depth, active):
    if isinstance(x, (list, tuple)):
        _tag(h, type(x).__name__, len(x))
        for y in x:
            _feed(h, y, depth, active)
    elif isinstance(x, dict):
        _tag(h, "dict", len(x))
        for key in sorted(x, key=repr):
            _feed(h, key, depth, active)
            _feed(h, x[key], depth, active)
    elif isinstance(x, (set, frozenset)):
        _tag(h, "set", len(x))
        for d in sorted(_digest(y) for y in x):
            _tag(h, d)
    elif isinstance(x, types.CodeType):  # the code itself, not where it was defined
        _tag(h, "code", x.co_name, x.co_argcount, x.co_names, x.co_varnames)
        h.update(x.co_code)
        _feed(h, x.co_consts, depth, active)
    elif isinstance(x, functools.partial):
        _tag(h, "partial")
        for part in (x.func, x.args, x.keywords):
            _feed(h, part, depth, active)
    elif isinstance(x, types.MethodType):
        _tag(h, "method")
        _feed(h, x.__func__, depth, active)
        _feed(h, x.__self__, depth, active)
    elif isinstance(x, types.FunctionType):
        _tag(h, "function")
        _feed(h, x.__code__, depth, active)
        cells = []
        for c in x.__closure__ or ():
            try:
                cells.append(c.cell_contents)
            except ValueError:  # an empty cell
                cells.append("<empty cell>")
        _feed(h, cells, depth, active)
        _feed(h, (x.__defaults__, x.__kwdefaults__), depth, active)
        # the globals its code and the code nested in it (a lambda inside) read — a tensor of document ids, a window
        # size — and the values it reads off a module it names (cfg.BIAS: `cfg` alone is hashed by its name)
        names = _mods._global_names(x.__code__)
        g = x.__globals__
        _feed(h, {n: g[n] for n in names if n in g}, depth, active)
        # (read from the module's own dict: never a lazy module's __getattr__, which may import)
        # (and off a class it names: Cfg.slope, a class attribute)
        _feed(h, {(n, a): vars(g[n])[a] for n in names if isinstance(g.get(n), (types.ModuleType, type))
                  for a in names if _is_data(vars(g[n]).get(a))}, depth, active)
        _feed(h, dict(vars(x)), depth, active)
    elif isinstance(x, torch.nn.Module):
        # its state, its buffers kept out of the state (persistent=False) and the data of its plain attributes (a
        # tensor a forward reads, set as module.table = ...)
        _tag(h, "module", type(x).__module__, type(x).__qualname__)
        _feed(h, dict(x.state_dict()), depth, active)
        _feed(h, dict(x.named_buffers()), depth, active)
        _feed(h, {k: v for k, v in vars(x).items() if _is_data(v)}, depth, active)  # self._bias too
    else:  # an object (a mask, a score_mod, a callable): its type and attributes
        _tag(h, "object", type(x).__module__, type(x).__qualname__)
        attrs = getattr(x, "__dict__", None)
        if attrs is not None:
            # attnkit's masks keep their data private (Document's ids, Padding's lengths: copies the
            # caller cannot change) and no lazy cache in __dict__, so every attribute is content;
            # another object's private attributes may be caches filled on some ranks only.
            # Its private tensors, arrays and numbers are content too (ids kept as self._ids).
            whole = isinstance(x, _masks.Mask)
            _feed(h, {k: v for k, v in attrs.items() if whole or not k.startswith("_") or _is_data(v)}, depth,
                  active)
        slots = [n for c in type(x).__mro__ for n in _slot_names(c) if n not in ("__dict__", "__weakref__")]
        if slots:  # an object with __slots__ keeps its data there, not in __dict__
            _feed(h, {n: getattr(x, n) for n in slots if hasattr(x, n)}, depth, active)
        call = getattr(type(x), "__call__", None)  # noqa: B004 - reads the method's code, not a callability test
        if isinstance(call, types.FunctionType):
            _feed(h, call.__code__, depth, active)


def _is_numpy(v) -> bool:
    """A NumPy array or scalar (np.float32(0.3)), without importing NumPy."""
    return type(v).__module__ == "numpy" and hasattr(v, "dtype") and hasattr(v, "tobytes")


def _slot_names(cls) -> tuple:
    slots = vars(cls).get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _is_data(v) -> bool:
    """A tensor, an array or a number, or a list / tuple of them: what an attribute holds as data (not a cache dict
    or an object)."""
    if isinstance(v, (list, tuple)):
        return len(v) > 0 and all(_is_data(y) for y in v)
    return isinstance(v, (torch.Tensor, bool, int, float, complex, str)) or _is_numpy(v)


# -------------------------------------------------------------------- dead process groups
# After a timeout or a lost peer, a group has messages left unmatched and gloo closes its
# connections: every later collective fails with gloo's own RuntimeError, or worse, matches a
# stale message. The group is recorded here (held, so its id is not reused) and every later call
# on it says so at once.
_DEAD_GROUPS: dict = {}


def _group_object(dist, group):
    return group if group is not None else dist.group.WORLD


def _short(x, n: int = 48) -> str:
    """A readable value for a mismatch message (never compared: the digests are), without "; "."""
    s = repr(x).replace("; ", ", ")
    return s if len(s) <= n else s[:n - 1] + "…"
