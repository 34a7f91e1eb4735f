"""Calling user mods exactly as FlexAttention does, and finding the tensors they capture.

``mask_mod(b, h, q_idx, kv_idx) -> bool`` and ``score_mod(score, b, h, q_idx, kv_idx)
-> score`` are written for *scalars*: FlexAttention evaluates them under ``torch.vmap``
over the four index dimensions. attnkit evaluates them on broadcasting index tensors
instead (much faster, no per-point dispatch)::

    b (B, 1, 1, 1)   h (1, H, 1, 1)   q_idx (1, 1, l, 1)   kv_idx (1, 1, 1, n)

which gives the same result for every mod written with elementwise ops and single
indexing (``doc[q_idx] == doc[kv_idx]``, ``kv_idx < lengths[b]``). Some valid
FlexAttention mods are not broadcast-safe: chained indexing ``bias[b][q_idx]`` (the
second index lands on the wrong dimension), reductions, ``.shape``-dependent code.
Such a mod is evaluated with ``torch.vmap`` over (b, h, q, kv), FlexAttention's way.

Which way a mod goes is decided by :func:`broadcast_safe`: both evaluations on a small
probe grid (the first indices of each axis), compared. The decision is cached per
*code object*: what makes broadcasting wrong is the code (which indexing it does), not
the data it reads, and the data is never cached — every call evaluates the mod afresh.
Every broadcast evaluation is also checked for a result shape that broadcasts to the
tile, so a mod that slips past the probe fails loudly instead of silently.

Arity follows FlexAttention: a parameter with a default does not count, so
``def band(b, h, q, kv, w=w)`` is a mask_mod.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import inspect
import itertools
import types
from collections.abc import Callable

import numpy as np
import torch
from torch.autograd.graph import Node

__all__ = ["positional_arity", "eval_mask_mod", "eval_score_mod", "captured_grad_tensors", "reads_uncaptured_grad",
           "value_key"]

_P = inspect.Parameter


def uncalled(fn) -> str:
    """A hint when ``fn`` is one of attnkit's mask / score_mod factories or classes passed without calling it
    (``mask=masks.causal``): the call to write; else ''."""
    mod = getattr(fn, "__module__", "") or ""
    if mod not in ("attnkit.masks", "attnkit.score_mods"):
        return ""
    name = getattr(fn, "__name__", "")
    if not name or name.startswith("_"):
        return ""
    where = mod.rsplit(".", 1)[1]
    if isinstance(fn, type):
        snake = "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
        return f"{where}.{name} is a class: build the {'mask' if where == 'masks' else 'score_mod'} with its " \
               f"function, {where}.{snake}(...)."
    try:
        need = [p.name for p in inspect.signature(fn).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        need = ["..."]
    return f"{where}.{name} builds one: call it, {where}.{name}({', '.join(need)})."


def positional_arity(fn) -> int | None:
    """Number of required positional parameters (FlexAttention's count); None if unknown or ``*args``."""
    if type(fn) is types.FunctionType and "__wrapped__" not in fn.__dict__ and "__signature__" not in fn.__dict__:
        code = fn.__code__  # a plain function: read off its code (what inspect.signature reports, ~50x faster)
        if code.co_flags & inspect.CO_VARARGS:
            return None
        return code.co_argcount - len(fn.__defaults__ or ())
    call = next((c.__dict__["__call__"] for c in type(fn).__mro__ if "__call__" in c.__dict__), None)
    if (type(call) is types.FunctionType and not isinstance(fn, type) and "__wrapped__" not in call.__dict__
            and "__signature__" not in call.__dict__ and getattr(fn, "__signature__", None) is None
            and getattr(fn, "__wrapped__", None) is None):
        code = call.__code__  # an instance of a class with a plain __call__ (attnkit's score mods): self not counted
        if code.co_flags & inspect.CO_VARARGS:
            return None
        return code.co_argcount - 1 - len(call.__defaults__ or ())
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    n = 0
    for p in params:
        if p.kind is _P.VAR_POSITIONAL:
            return None
        if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD) and p.default is _P.empty:
            n += 1
    return n


def _vmapped(fn: Callable, with_score: bool) -> Callable:
    """fn vmapped over (b, h, q, kv) given 1-D index vectors: output (B, H, l, n).

    Innermost level maps kv, outermost b; the score's leading dim is mapped at every level.
    """
    prefix = (0,) if with_score else ()
    f = fn
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        f = torch.vmap(f, in_dims=prefix + dims, out_dims=0)
    return f


# --- mods that read tensors on another device than their index tensors ------------------------------------------

def data_device(fn, depth: int = 0) -> torch.device | None:
    """The device of the tensors ``fn`` reads (its closure, defaults, globals, attributes, the first items of the
    lists and dicts among them, and those of the functions it calls from there, two levels down) when that is not
    the CPU; None when it reads none or only CPU tensors, or keeps them where this does not look (an attribute of
    a plain object it reads). A GPU user's mask_mod reads its document ids on the GPU (``doc[q] == doc[kv]`` with
    ``doc`` on ``cuda``)."""
    for obj in _sources(fn):
        for t in _tensors_in(obj, limit=_LOOK):
            if t.device.type != "cpu":
                return t.device
        if depth >= 2:
            continue
        # the functions it calls: named directly, or held in a list / tuple (torch's and_masks / or_masks, attnkit's
        # & and | of masks keep their parts so)
        inner = list(obj[:_LOOK]) if isinstance(obj, (list, tuple)) else [obj]
        for f in inner:
            if callable(f) and not isinstance(f, (type, torch.Tensor, torch.nn.Module)):
                dev = data_device(f, depth + 1)
                if dev is not None:
                    return dev
    return None


def reads_transformed(fn, depth: int = 0) -> bool:
    """Whether ``fn`` (a mask_mod or score_mod function, a ``Mask`` / ``ScoreMod`` object) reads a tensor a
    torch.func transform wraps (grad's or vmap's: it has no memory), where ``data_device`` looks: its closure,
    defaults, globals, attributes, the first items of lists and dicts among them, and the functions it calls from
    there, two levels down."""
    if fn is None:
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for obj in _sources(fn):
        if any(wrapped(t) for t in _tensors_in(obj, limit=_LOOK)):
            return True
        if depth >= 2:
            continue
        inner = list(obj[:_LOOK]) if isinstance(obj, (list, tuple)) else [obj]
        for f in inner:
            if callable(f) and not isinstance(f, (type, torch.Tensor, torch.nn.Module)) and reads_transformed(
                    f, depth + 1):
                return True
    return False


_LOOK = 64  # items of a list / dict that data_device reads (a global list of a million ints: not walked)

# what a device clash says (torch's messages): only such an error is worth a retry on the data's device
_CLASH = ("same device", "expected device", "device type", "devices")


def _device_of(args) -> torch.device | None:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), None)


def call(fn, *args, run: Callable | None = None):
    """``run(*args)`` (``run`` defaults to ``fn``; pass the vmapped ``fn`` as ``run``) where ``fn`` may read tensors
    on another device than ``args``: attnkit builds its plans and probes on the CPU, and a GPU user's mod reads its
    data on the GPU (or a mod reading CPU data is evaluated on a GPU call's indices). Where the call fails on a
    device clash, or answers on another device, it runs again with ``args`` on ``fn``'s data device and the answer
    comes back to ``args``' device (a differentiable copy: a captured tensor's gradient still reaches it). A mod
    whose data sits with its indices, the common case, costs nothing more."""
    run = fn if run is None else run
    home = _device_of(args)
    try:
        out = run(*args)
    except RuntimeError as e:
        if home is None or isinstance(e, torch.cuda.OutOfMemoryError) or not any(c in str(e) for c in _CLASH):
            raise  # the user's own error, as it is
        try:
            dev = data_device(fn) or torch.device("cpu")  # CPU data read by GPU indices: the other way round
        except Exception:  # a source that fails when looked at (a mock, a __getattr__ that raises): no retry
            raise e from None
        if dev == home:
            raise
        out = run(*(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args))
    if isinstance(out, torch.Tensor) and home is not None and out.device != home:
        out = out.to(home)
    return out


# code object -> True (broadcast-safe) / False (use vmap). Code objects live as long as
# their function's module; a bounded dict keeps lambdas made in a loop from growing it.
_SAFE: dict = {}
_SAFE_MAX = 4096


def _code_key(fn):
    code = getattr(fn, "__code__", None)
    if code is None:
        call = getattr(type(fn), "__call__", None)  # noqa: B004 - reads the method's code, not a callability test
        code = getattr(call, "__code__", None)
    return code


def _grid_shape(b, h, q, kv):
    return (b.numel(), h.numel(), q.numel(), kv.numel())


def _fits(out, shape) -> bool:
    if not isinstance(out, torch.Tensor) or out.dim() > 4:
        return False
    o = (1,) * (4 - out.dim()) + tuple(out.shape)
    return all(a in (1, w) for a, w in zip(o, shape, strict=True))


def _flat(*idx):
    return tuple(t.reshape(-1) for t in idx)


def broadcast_safe(fn, score: bool, B: int, H: int, L: int, S: int, dtype=torch.float32) -> bool:
    """Whether ``fn`` gives the same result on broadcasting index tensors as under vmap."""
    key = _code_key(fn)
    if key is not None and key in _SAFE:
        return _SAFE[key]
    b = torch.arange(min(B, 2)).view(-1, 1, 1, 1)
    h = torch.arange(min(H, 2)).view(1, -1, 1, 1)
    q = torch.arange(min(L, 3)).view(1, 1, -1, 1)
    kv = torch.arange(min(S, 3)).view(1, 1, 1, -1)
    shape = _grid_shape(b, h, q, kv)
    idx = (b, h, q, kv)
    args: tuple[torch.Tensor, ...] = idx
    if score:
        args = (torch.linspace(-1.5, 1.5, steps=int(torch.tensor(shape).prod()), dtype=dtype).view(shape), *idx)
    with torch.no_grad():
        try:
            wide = call(fn, *args)
            wide_err = None
        except Exception as e:  # any failure means "not broadcast-safe"
            wide, wide_err = None, e
        try:
            flat = _flat(b, h, q, kv)
            narrow = call(fn, *((args[0],) if score else ()), *flat, run=_vmapped(fn, score))
        except Exception:  # vmap-hostile code (.item(), data-dependent if): broadcast it
            narrow = None
    if wide_err is not None and narrow is None:
        raise wide_err
    if narrow is None or tuple(narrow.shape) != shape:
        # vmap unusable (vmap-hostile code) or not one value per point: broadcasting is the only reading
        if wide_err is not None:
            raise wide_err
        safe = True
    elif wide is None or not _fits(wide, shape):
        safe = False
    else:
        w = wide if wide.dim() == 4 else wide.reshape((1,) * (4 - wide.dim()) + tuple(wide.shape))
        w = w.expand(shape)
        n = narrow.to(w.dtype) if narrow.dtype != w.dtype else narrow
        safe = bool(torch.equal(w, n)) if w.dtype == torch.bool else bool(torch.allclose(w, n, equal_nan=True))
    if key is not None:
        if len(_SAFE) >= _SAFE_MAX:
            _SAFE.clear()
        _SAFE[key] = safe
    return safe


def _check_shape(what: str, fn, out, shape):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{what} {getattr(fn, '__name__', fn)!r} must return a tensor, got {type(out).__name__}.")
    if not _fits(out, shape):
        raise ValueError(
            f"{what} {getattr(fn, '__name__', fn)!r}: on index tensors of the (b, h, q, kv) grid {shape} it "
            f"returned shape {tuple(out.shape)}, which does not broadcast to the grid. Write it for scalar "
            "indices with single indexing (e.g. bias[b, q_idx], not bias[b][q_idx])."
        )


def eval_mask_mod(fn, b, h, q, kv, sizes: tuple[int, int, int, int]) -> torch.Tensor:
    """``fn(b, h, q, kv)`` on broadcasting index tensors; a bool tensor broadcastable to the grid, 4-d (a mod's
    ``(S,)`` row or 0-d answer gets leading dims of 1: every reader of a mask tile takes its last two dims as rows
    and keys).

    ``sizes = (B, H, L, S)`` of the whole call, for the one-time probe.
    """
    B, H, L, S = sizes
    shape = _grid_shape(b, h, q, kv)
    if broadcast_safe(fn, False, B, H, L, S):
        out = call(fn, b, h, q, kv)
        _check_shape("mask_mod", fn, out, shape)
        if isinstance(out, torch.Tensor) and out.dim() < 4:
            out = out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))
        return out
    return call(fn, *_flat(b, h, q, kv), run=_vmapped(fn, False))


def eval_score_mod(fn, s, b, h, q, kv, sizes: tuple[int, int, int, int]) -> torch.Tensor:
    """``fn(s, b, h, q, kv)`` for a score tile ``s (B', H', l, n)``; same shape as ``s``.

    ``sizes = (B, H, L, S)`` of the whole call, for the one-time probe.
    """
    B, H, L, S = sizes  # unpacked by name: spread as *sizes, a fifth item would collide with dtype=
    shape = _grid_shape(b, h, q, kv)
    if broadcast_safe(fn, True, B, H, L, S, dtype=s.dtype if s.is_floating_point() else torch.float32):
        out = call(fn, s, b, h, q, kv)
        _check_shape("score_mod", fn, out, shape)
        return out
    return call(fn, s.expand(shape), *_flat(b, h, q, kv), run=_vmapped(fn, True))


# --- tensors a score_mod captures -------------------------------------------------------

def _tensors_in(obj, depth: int = 0, limit: int | None = None):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif depth < 2 and isinstance(obj, (list, tuple)):
        for x in obj[:limit]:
            yield from _tensors_in(x, depth + 1, limit)
    elif depth < 2 and isinstance(obj, dict):
        for x in itertools.islice(obj.values(), limit):
            yield from _tensors_in(x, depth + 1, limit)


def _sources(fn):
    """The objects a callable can read tensors from: closure cells, defaults, globals it names,
    its ``__self__`` / instance attributes, a functools.partial's arguments."""
    seen: list = []
    f = fn
    if isinstance(f, functools.partial):
        seen.extend(f.args)
        seen.extend((f.keywords or {}).values())
        f = f.func
    if isinstance(f, types.MethodType):
        seen.append(f.__self__)
        seen.extend(vars(f.__self__).values() if hasattr(f.__self__, "__dict__") else ())
        f = f.__func__
    if not isinstance(f, types.FunctionType):  # a callable object: its attributes
        seen.extend(getattr(f, "__dict__", {}).values())
        f = getattr(type(f), "__call__", None)  # noqa: B004 - reads the method's code, not a callability test
        if not isinstance(f, types.FunctionType):
            return seen
    seen.extend(c.cell_contents for c in (f.__closure__ or ()) if _cell_full(c))
    seen.extend(f.__defaults__ or ())
    seen.extend((f.__kwdefaults__ or {}).values())
    g = f.__globals__
    seen.extend(g[n] for n in f.__code__.co_names if n in g)
    seen.extend(getattr(fn, "__dict__", {}).values())  # attributes set on the function itself
    return seen


def _cell_full(c) -> bool:
    try:
        c.cell_contents  # noqa: B018 - the read is the test: an empty cell raises ValueError
    except ValueError:
        return False
    return True


def captured_grad_tensors(fn) -> list[torch.Tensor]:
    """Tensors requiring grad that ``fn`` can read directly (deduplicated, in a stable order)."""
    out, ids = [], set()
    for obj in _sources(fn):
        for t in _tensors_in(obj):
            if t.requires_grad and id(t) not in ids:
                ids.add(id(t))
                out.append(t)
    return out


def _leaves(t: torch.Tensor) -> set:
    """ids of the leaf tensors ``t`` depends on through autograd."""
    if t.grad_fn is None:
        return {id(t)} if t.requires_grad else set()
    found, seen = set(), set()
    stack: list[Node | None] = [t.grad_fn]  # next_functions hold None for inputs that need no grad
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            found.add(id(var))
        stack.extend(n for n, _ in node.next_functions)
    return found


def reads_uncaptured_grad(fn, captured: list[torch.Tensor], sizes, dtype) -> bool:
    """Whether ``fn`` produces a result that depends, through autograd, on a leaf that
    none of ``captured`` reaches (a tensor hidden where :func:`captured_grad_tensors`
    does not look). Then only a backend differentiating through the mod itself (eager)
    can deliver that gradient."""
    B, H, L, S = sizes
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    s = torch.zeros(1, 1, 1, 1, dtype=dtype)
    with torch.enable_grad():
        out = eval_score_mod(fn, s, b, b, b, b, (1, 1, L, S))
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        return False
    reach = set()
    for t in captured:
        reach |= _leaves(t)
    return not _leaves(out) <= reach


# --- when a mod's result provably depends on nothing but its indices -----------------------

_SCALARS = (int, float, bool, str, bytes, type(None), complex)


# Largest captured tensor / array a key is made for (its bytes are hashed on every call).
CONTENT_KEY_MAX_BYTES = 1 << 24


def _content(x):
    """A key made of a CPU tensor's or NumPy array's *content* (dtype, shape, whether it requires grad, a
    BLAKE2 digest of its bytes), or None (another device, or too large to hash on every call). Taken afresh
    on every call, so an in-place edit between calls gives a new key: nothing cached under the old one is
    reused."""
    if isinstance(x, torch.Tensor):
        if not x.is_cpu or x.layout is not torch.strided:
            return None
        n = x.numel() * x.element_size()
        if n > CONTENT_KEY_MAX_BYTES:
            return None
        t = x.detach()
        if t.is_conj() or t.is_neg():  # lazy bits: the values, not the memory
            t = t.resolve_conj().resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        try:  # the bytes read in place (a fake or batched tensor has none: no key)
            data = ctypes.string_at(t.data_ptr(), n) if n else b""
        except RuntimeError:
            return None
        # requires_grad too: a call learned with a frozen table must not be replayed for one that wants a gradient
        return ("tensor", str(x.dtype), tuple(x.shape), x.requires_grad,
                hashlib.blake2b(data, digest_size=16).digest())
    if isinstance(x, np.ndarray):
        if x.dtype == object or x.nbytes > CONTENT_KEY_MAX_BYTES:
            return None
        a = np.ascontiguousarray(x).reshape(-1)
        return ("ndarray", str(x.dtype), x.shape, hashlib.blake2b(a.view(np.uint8).data, digest_size=16).digest())
    return None


content_key = _content  # the public name: a tensor's or an array's content key (attnkit.score_mods)


_LIBRARIES = frozenset(("torch", "math", "cmath", "numpy", "operator", "functools", "builtins", "attnkit", "einops"))


def _const(x, depth: int):
    """A hashable stand-in for ``x`` if it is an immutable value (scalars, tuples/frozensets of
    them, modules, pure functions by their own key) or a CPU tensor / array keyed by its content
    (:func:`_content`); None if it may change under us."""
    if isinstance(x, float):  # by its bits: 0.0 and -0.0 are equal as numbers but not as values (1 / x, copysign)
        return ("float", float.hex(x))
    if isinstance(x, _SCALARS):
        return (type(x).__name__, x)
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return _content(x)
    if isinstance(x, (tuple, frozenset)):
        parts = tuple(_const(y, depth) for y in x)
        return None if any(p is None for p in parts) else (type(x).__name__, parts)
    if isinstance(x, types.ModuleType):  # a library's functions and constants (torch.where, math.pi) by name; any
        # other module (a user's config module) may have its attributes reassigned between calls unseen: no key
        return ("module", x.__name__) if x.__name__.partition(".")[0] in _LIBRARIES else None
    if isinstance(x, types.BuiltinFunctionType):
        owner = getattr(x, "__self__", None)  # a bound method reads its object: keyed by it, or not at all
        if owner is None or isinstance(owner, (types.ModuleType, type)):
            return ("builtin", getattr(x, "__module__", None), x.__qualname__)
        o = _const(owner, depth)
        return None if o is None else ("bound builtin", x.__qualname__, o)
    if isinstance(x, types.FunctionType) and depth < 3:
        return value_key(x, depth + 1)
    return None


def value_key(fn, depth: int = 0):
    """A hashable key that determines everything ``fn`` reads besides its arguments, or None.

    ``fn``'s code plus the *values* of its closure cells, defaults and the globals its code
    names — accepted only when each is an immutable value (ints, floats, strings, tuples of
    them, a library's modules such as ``torch`` or ``math``, other functions with a key of their
    own) or a CPU tensor / NumPy array,
    which enters by its content (a digest of its bytes, taken on every call: an in-place edit
    gives a new key). A mod that reads a list, a dict, a GPU tensor or any other object gets
    None: its data may change between calls unseen, so nothing derived from it may be cached.
    Used to reuse the tile map of a ``mask_mod`` such as ``lambda b, h, q, kv: (q - kv).abs() <=
    128`` — or one reading the document ids of a packed batch — across calls.
    """
    if not isinstance(fn, types.FunctionType):
        return None
    code = fn.__code__
    cells = []
    for c in fn.__closure__ or ():
        if not _cell_full(c):
            return None
        k = _const(c.cell_contents, depth)
        if k is None:
            return None
        cells.append(k)
    defaults = _const(tuple(fn.__defaults__ or ()), depth)
    kwdefaults = _const(tuple(sorted((fn.__kwdefaults__ or {}).items())), depth)
    g = fn.__globals__
    names = []
    every = _global_names(code)
    if _RANDOM.intersection(every):  # it draws random numbers: no two calls are the same mask or score
        return None
    for n in every:
        if n in g:
            k = _const(g[n], depth)
            if k is None:
                return None
            names.append((n, k))
    if defaults is None or kwdefaults is None:
        return None
    attrs = _const(tuple(sorted(fn.__dict__.items())), depth) if fn.__dict__ else ()  # a function used as a
    if attrs is None:  # settings holder (fn.W = 4): its attributes are read like globals
        return None
    return (code, tuple(cells), defaults, kwdefaults, tuple(names), attrs)


# names whose call draws random numbers (torch.rand, np.random.uniform, random.random, t.normal_, dropout, ...)
_RANDOM = frozenset(("rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
                     "multinomial", "normal", "poisson", "random", "uniform", "uniform_", "normal_", "random_",
                     "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_", "dropout", "choice",
                     "shuffle", "permutation", "randrange", "gauss"))


def has_code(key) -> bool:
    """Whether a content key holds a function's key (:func:`value_key`: its code and the values it reads)."""
    if type(key) is not tuple:
        return False
    if len(key) == 6 and type(key[0]) is types.CodeType:
        return True
    return any(has_code(x) for x in key)


def code_only(key):
    """``key`` with each function's key (:func:`value_key`) cut to its code: the same kind of mod, whatever values
    it reads (for what is derived afresh from the mod itself at every call, never from the key)."""
    if type(key) is not tuple:
        return key
    if len(key) == 6 and type(key[0]) is types.CodeType:
        return ("code", key[0])
    return tuple([code_only(x) for x in key])


def holds_data(key) -> bool:
    """Whether a content key holds a tensor's or an array's content (its data, not only code and numbers). A walk
    with a stack, no generator per level: a decode loop's new mod asks it at every step."""
    stack = [key]
    pop, push = stack.pop, stack.extend
    while stack:
        x = pop()
        if type(x) is tuple:
            if (len(x) == 5 and x[0] == "tensor") or (len(x) == 4 and x[0] == "ndarray"):
                return True
            push(x)
    return False


def _global_names(code) -> tuple:
    """The names ``code`` and the functions nested in it (lambdas, comprehensions: code objects among its
    constants) may read as globals or attributes."""
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.extend(_global_names(c))
    return tuple(dict.fromkeys(names))


def opaque_to_torch_compile(fn, why: str) -> None:
    """Let ``torch.compile`` run ``fn`` as it is instead of tracing attnkit's engines (which it cannot): a
    compiled caller runs ``fn`` eagerly at that point (a graph break) — ``create_block_mask``, and
    ``flex_attention``'s eager call off the CPU. What ``torch.compiler.disable`` does, set without importing
    TorchDynamo (seconds) for every attnkit user; on a torch without these hooks, calling ``fn`` directly still
    works."""
    fn._torchdynamo_disable = True  # a compiled caller does not inline it: the call runs eagerly
    fn._torchdynamo_disable_msg = why
    try:  # and a frame of it, or of anything it calls, is never traced (torch.compile(flex_attention))
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

        set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    except (ImportError, AttributeError, TypeError, RuntimeError):
        pass
