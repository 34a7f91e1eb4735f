"""score_mods traced into small programs that attnkit's compiled kernel runs on each score tile.

A ``score_mod(score, b, h, q_idx, kv_idx)`` is called ONCE with symbolic stand-ins for its five
arguments; every operation it performs is recorded as one instruction of a straight-line program::

    def rel(score, b, h, q, kv):              r0 = score            r1 = q         r2 = kv
        return score + table[h, q - kv + 7]   r3 = h               r4 = r1 - r2   r5 = r4 + 7
                                              r6 = table[r3, r5]   r7 = r0 + r6   return r7

The kernel runs the program on 64 scores at a time (their b, h, q, kv known), in fp32 for floats
and int32 for integers, and in the backward runs it again and then backwards (reverse mode) for
d(out)/d(score). What the program covers:

* constants; the ``b``, ``h``, ``q_idx``, ``kv_idx`` indices; ``+ - * /``, ``//`` and ``%`` on
  integers, unary ``-``, ``abs``, ``sign``, ``tanh``, ``exp``, ``log``, ``log1p``, ``floor``,
  ``minimum`` / ``maximum`` / ``clamp``, ``where``, comparisons, ``& | ~`` on conditions, casts
  (``.to``, ``.float()``, ``.long()``, ``.int()``: float → int truncates toward zero);
* reads of captured CPU tensors (float or integer, up to 4 dims) at index expressions, e.g. a
  relative-position table, per-head slopes, T5 log buckets, per-document biases; a float tensor that
  requires grad (a learnable table) gets its gradient from the kernel's backward.

Anything else refuses (:class:`Refused`, naming the operation): Python control flow on a traced
value, an unlisted torch function, an integer that could leave int32 (tracked by interval arithmetic), a
non-CPU tensor. A refusal changes nothing: the call runs where it ran before, and ``dispatch``
says why. Programs are cached by the function's code and the *content* of what it captures
(:func:`attnkit._mods.value_key`), never by its identity.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import _mods

__all__ = ["Program", "Refused", "compile_score_mod", "OPS"]

# opcode names, in the order csrc/attn_prog.h numbers them
OPS = ("score", "qidx", "kvidx", "bidx", "hidx", "constf", "consti",
       "add", "sub", "mul", "div", "fmin", "fmax",
       "iadd", "isub", "imul", "ifloordiv", "imod", "imin", "imax",
       "neg", "abs", "sign", "tanh", "exp", "log", "log1p", "floor",
       "ineg", "iabs", "isign",
       "i2f", "f2i",
       "flt", "fle", "feq", "fne", "ilt", "ile", "ieq", "ine",
       "and", "or", "not",
       "where", "iwhere", "readf", "readi")
OP = {n: i for i, n in enumerate(OPS)}
WIDTH = 7  # int32 words per instruction: op, dst, a, b, c, d, e
_I32 = (-(2 ** 31), 2 ** 31 - 1)
_MAX_TABLE_ELEMS = 1 << 24
_MAX_TABLES = 16  # MAX_GRAD_TABLES in csrc/attn_prog.h


class Refused(Exception):
    """The score_mod does something the kernel's programs do not cover (the message names it)."""


@dataclass(frozen=True)
class Program:
    """A traced score_mod: ``code`` int32 ``(n, WIDTH)``, ``consts`` float32, ``tables`` (float32 or int32
    contiguous CPU tensors, read at ``table_dims`` indices each), ``n_regs`` registers, ``out`` the result
    register (float)."""

    code: torch.Tensor
    consts: torch.Tensor
    tables: tuple
    n_regs: int
    out: int
    # per table, the captured tensor whose gradient the kernel accumulates (one that requires grad), else None
    grad_of: tuple = ()
    max_s: int = 0  # the key count it was traced for: it runs any call of at most this many keys exactly

    @property
    def wants_grads(self) -> bool:
        return any(t is not None for t in self.grad_of)

    @property
    def ops(self) -> list[str]:
        return [OPS[int(op)] for op in self.code[:, 0]]


class _Builder:
    def __init__(self, B, H, L, S):
        self.code: list[list[int]] = []
        self.consts: list[float] = []
        self.tables: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []
        self.table_ids: dict[int, int] = {}
        self.n = 0
        self.sizes = (B, H, L, S)

    def emit(self, op, args=(), kind="f", rng=None):
        dst = self.n
        self.n += 1
        self.code.append([OP[op], dst, *args, *([0] * (WIDTH - 2 - len(args)))])
        return _Sym(self, dst, kind, rng)


_SLACK = 1e-4  # relative widening of each end of a float range: fp32 rounding (2^-24 an op) never leaves it


def _frange(op, a, b):
    """The range of a float op's result from its operands' ranges (None: unknown), widened for rounding."""
    try:
        if op in ("tanh", "sign"):
            return (-1.0, 1.0)
        if a is None or (b is None and op in ("add", "sub", "mul", "div", "min", "max")):
            return None
        lo, hi = a
        if op in ("add", "sub", "mul", "div"):
            bl, bh = b
            if op == "add":
                r = (lo + bl, hi + bh)
            elif op == "sub":
                r = (lo - bh, hi - bl)
            elif op == "mul":
                c = (lo * bl, lo * bh, hi * bl, hi * bh)
                r = (min(c), max(c))
            else:
                if bl <= 0 <= bh:
                    return None
                c = (lo / bl, lo / bh, hi / bl, hi / bh)
                r = (min(c), max(c))
        elif op in ("min", "max"):
            bl, bh = b
            r = (min(lo, bl), min(hi, bh)) if op == "min" else (max(lo, bl), max(hi, bh))
        elif op == "neg":
            r = (-hi, -lo)
        elif op == "abs":
            r = (0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
        elif op == "exp":
            r = (math.exp(min(lo, 700)), math.exp(min(hi, 700)))
        elif op in ("log", "log1p"):
            base = 0.0 if op == "log" else -1.0
            if lo <= base:
                return None
            f = math.log if op == "log" else math.log1p
            r = (f(lo), f(hi))
        elif op == "floor":
            r = (math.floor(lo), math.floor(hi))
        else:
            return None
    except (OverflowError, ValueError, ZeroDivisionError):
        return None
    if not all(math.isfinite(x) for x in r):
        return None
    return (r[0] - _SLACK * abs(r[0]), r[1] + _SLACK * abs(r[1]))  # each end widened by its own magnitude


def _int_range(lo, hi):
    if lo < _I32[0] or hi > _I32[1]:
        raise Refused(f"an integer that may reach [{lo}, {hi}], outside int32 (the kernel's integers)")
    return (lo, hi)


class _Sym:
    """A traced value: its register, its kind ('f' float32, 'i' int32, 'b' condition as int 0/1) and the
    range of values it can take (ints: always; floats: when known, else None) — what proves that an
    integer stays in int32 and an index inside its tensor."""

    def __init__(self, bld: _Builder, reg: int, kind: str, rng=None):
        self.bld, self.reg, self.kind, self.rng = bld, reg, kind, rng
        # a value torch would hold in bf16 / fp16 (a read of such a tensor): torch rounds arithmetic on it to 8 / 11
        # bits where no fp32 operand joins it, the kernel's programs would not (see _low_arith); weak: a constant
        # from a number, which torch's promotion gives the dtype of the tensor beside it
        self.low = False
        self.weak = False

    # ---- conversions -------------------------------------------------------------------------
    def _f(self) -> _Sym:
        return self if self.kind == "f" else self.bld.emit("i2f", (self.reg,), "f", self.rng)

    def _i(self) -> _Sym:
        if self.kind == "f":
            raise Refused("a float used where torch would keep an integer")
        return self

    def __bool__(self):
        raise Refused("Python control flow (if / and / or / bool()) on a traced value")

    def __index__(self):
        raise Refused("a traced value used as a Python integer")

    def __float__(self):
        raise Refused("float() of a traced value")

    def __int__(self):
        raise Refused("int() of a traced value")

    def __iter__(self):
        raise Refused("iteration over a traced value")

    def __len__(self):
        raise Refused("len() of a traced value")

    @property
    def dtype(self):
        return torch.float32 if self.kind == "f" else torch.bool if self.kind == "b" else torch.int64

    @property
    def device(self):
        return torch.device("cpu")

    @property
    def shape(self):
        raise Refused("the shape of a traced value")

    def dim(self):
        raise Refused("the rank of a traced value")

    # ---- arithmetic --------------------------------------------------------------------------
    def __add__(self, o): return _binary("add", self, o)
    def __radd__(self, o): return _binary("add", o, self)
    def __sub__(self, o): return _binary("sub", self, o)
    def __rsub__(self, o): return _binary("sub", o, self)
    def __mul__(self, o): return _binary("mul", self, o)
    def __rmul__(self, o): return _binary("mul", o, self)
    def __truediv__(self, o): return _binary("div", self, o)
    def __rtruediv__(self, o): return _binary("div", o, self)
    def __floordiv__(self, o): return _binary("floordiv", self, o)
    def __rfloordiv__(self, o): return _binary("floordiv", o, self)
    def __mod__(self, o): return _binary("mod", self, o)
    def __rmod__(self, o): return _binary("mod", o, self)
    def __neg__(self): return _unary("neg", self)
    def __pos__(self): return self
    def __abs__(self): return _unary("abs", self)
    def __lt__(self, o): return _compare("lt", self, o)
    def __le__(self, o): return _compare("le", self, o)
    def __gt__(self, o): return _compare("lt", o, self)
    def __ge__(self, o): return _compare("le", o, self)
    def __eq__(self, o): return _compare("eq", self, o)
    def __ne__(self, o): return _compare("ne", self, o)
    def __and__(self, o): return _logic("and", self, o)
    def __rand__(self, o): return _logic("and", o, self)
    def __or__(self, o): return _logic("or", self, o)
    def __ror__(self, o): return _logic("or", o, self)
    def __invert__(self): return _not(self)
    __hash__ = None  # type: ignore[assignment]

    # ---- tensor methods users call -----------------------------------------------------------
    def abs(self): return _unary("abs", self)
    def neg(self): return _unary("neg", self)
    def sign(self): return _unary("sign", self)
    def tanh(self): return _unary("tanh", self)
    def exp(self): return _unary("exp", self)
    def log(self): return _unary("log", self)
    def log1p(self): return _unary("log1p", self)
    def floor(self): return _unary("floor", self)
    def float(self): return _widened(self._f())
    def double(self): return _widened(self._f())
    def long(self): return _to_int(self)
    def int(self): return _to_int(self)
    def bool(self): return _compare("ne", self, 0)
    def minimum(self, o): return _minmax("min", self, o)
    def maximum(self, o): return _minmax("max", self, o)
    def clamp(self, min=None, max=None): return _clamp(self, min, max)
    def clamp_min(self, m): return _clamp(self, m, None)
    def clamp_max(self, m): return _clamp(self, None, m)
    def logical_not(self): return _not(self)
    def logical_and(self, o): return _logic("and", self, o)
    def logical_or(self, o): return _logic("or", self, o)
    def add(self, o): return _binary("add", self, o)
    def sub(self, o): return _binary("sub", self, o)
    def mul(self, o): return _binary("mul", self, o)
    def div(self, o, rounding_mode=None): return _div(self, o, rounding_mode)
    def remainder(self, o): return _binary("mod", self, o)
    def floor_divide(self, o): return _binary("floordiv", self, o)

    def to(self, *args, **kwargs):
        dtype = kwargs.get("dtype")
        for a in args:
            if isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, torch.Tensor | _Sym):
                dtype = a.dtype
            elif isinstance(a, str | torch.device) and torch.device(a).type != "cpu":
                raise Refused(f"a traced value moved to {a}")
        if dtype is None:
            return self
        return _cast(self, dtype)

    def type(self, dtype):
        return _cast(self, dtype)

    def __getitem__(self, idx):
        raise Refused("indexing a traced value (score[...])")

    def __getattr__(self, name):  # only reached for names not defined above
        if name.startswith("__"):
            raise AttributeError(name)
        raise Refused(f"the tensor method .{name}()")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func is torch.Tensor.__getitem__:
            return _read(args[0], args[1])
        handler = _TORCH.get(name)
        if handler is None:
            raise Refused(f"torch.{name}")
        return handler(*args, **kwargs)


def _lift(bld: _Builder, x) -> _Sym:
    """A Python number or a 0-d CPU tensor as a constant; a traced value as itself."""
    if isinstance(x, _Sym):
        return x
    if isinstance(x, torch.Tensor):
        if x.dim() != 0:
            raise Refused(f"a captured tensor of shape {tuple(x.shape)} used whole (read it at indices)")
        if x.requires_grad:
            raise Refused("a captured scalar tensor that requires grad")
        x = x.item()
    if isinstance(x, bool):
        return bld.emit("consti", (int(x),), "b", (int(x), int(x)))
    if isinstance(x, int):
        _int_range(x, x)
        return bld.emit("consti", (x,), "i", (x, x))
    if isinstance(x, float):
        bld.consts.append(x)
        out = bld.emit("constf", (len(bld.consts) - 1,), "f", (x, x) if math.isfinite(x) else None)
        out.weak = True  # a number: beside a bf16 value torch takes it in bf16 (_low_arith)
        return out
    raise Refused(f"a value of type {type(x).__name__}")


def _bld(*xs) -> _Builder:
    return next(x.bld for x in xs if isinstance(x, _Sym))


def _both(a, b):
    bld = _bld(a, b)
    return _lift(bld, a), _lift(bld, b)


def _widened(a: _Sym) -> _Sym:
    """``a`` as torch's fp32 / fp64 of it (exact): no longer a low-precision value."""
    return _Sym(a.bld, a.reg, a.kind, a.rng) if a.low else a


def _low_arith(what: str, *xs) -> None:
    """Refuse arithmetic that torch would do in bf16 / fp16: a low-precision value with no fp32 float beside it
    (a number or an index tensor promotes to bf16). torch rounds such a result; a kernel program computes in fp32,
    so the compiled kernel would answer differently from every other path (0.2 at the output for a bf16 slope
    times a distance of ~100). With an fp32 operand (the score) torch computes in fp32, as the program does."""
    if any(x.low for x in xs) and not any(x.kind == "f" and not x.low and not x.weak for x in xs):
        raise Refused(f"{what} on a value read from a bf16 / fp16 tensor (torch rounds it to that dtype, the "
                      "kernel's programs compute in fp32; capture the tensor as fp32 for the kernel)")


def _binary(op, a, b):
    a, b = _both(a, b)
    _low_arith(op, a, b)
    bld = a.bld
    if op == "div":
        return bld.emit("div", (a._f().reg, b._f().reg), "f", _frange(op, a.rng, b.rng))
    if a.kind == "f" or b.kind == "f":
        if op in ("floordiv", "mod"):
            raise Refused(f"float {'//' if op == 'floordiv' else '%'}")
        return bld.emit(op, (a._f().reg, b._f().reg), "f", _frange(op, a.rng, b.rng))
    (al, ah), (bl, bh) = a.rng, b.rng
    if op == "add":
        rng = _int_range(al + bl, ah + bh)
    elif op == "sub":
        rng = _int_range(al - bh, ah - bl)
    elif op == "mul":
        c = (al * bl, al * bh, ah * bl, ah * bh)
        rng = _int_range(min(c), max(c))
    else:
        if bl <= 0 <= bh:
            raise Refused(f"integer {'//' if op == 'floordiv' else '%'} by a value that may be 0 or negative")
        if op == "floordiv":
            c = (al // bl, al // bh, ah // bl, ah // bh)
            rng = (min(c), max(c))
        else:
            rng = (0, bh - 1) if bl > 0 else (bl + 1, 0)
    return bld.emit("i" + op, (a.reg, b.reg), "i", rng)


def _div(a, b, rounding_mode):
    if rounding_mode is None:
        return _binary("div", a, b)
    if rounding_mode == "floor":
        a2, b2 = _both(a, b)
        if a2.kind != "f" and b2.kind != "f":
            return _binary("floordiv", a2, b2)
        return _unary("floor", _binary("div", a2, b2))
    raise Refused(f"div(rounding_mode={rounding_mode!r})")


def _unary(op, a):
    bld = a.bld
    if a.low:
        if op not in ("neg", "abs", "sign"):
            _low_arith(op, a)
        out = bld.emit(op, (a.reg,), "f", _frange(op, a.rng, None))  # exact in any dtype: still low
        out.low = True
        return out
    if op in ("neg", "abs", "sign") and a.kind != "f":
        lo, hi = a.rng
        rng = {"neg": (-hi, -lo), "abs": (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi))),
               "sign": (-1, 1)}[op]
        return bld.emit("i" + op, (a.reg,), "i", _int_range(*rng))
    if op == "floor" and a.kind != "f":
        return a
    return bld.emit(op, (a._f().reg,), "f", _frange(op, a.rng, None))


def _to_int(a):
    if a.kind != "f":
        return a if a.kind == "i" else a.bld.emit("iadd", (a.reg, _lift(a.bld, 0).reg), "i", a.rng)
    # float -> int truncates toward zero (torch's .to(int)); with the float's range known the int's is too,
    # else any int32 (the kernel saturates there, where torch's int64 would not: what follows must bound it)
    rng = a.rng
    if rng is not None and _I32[0] < rng[0] and rng[1] < _I32[1]:
        return a.bld.emit("f2i", (a.reg,), "i", (math.trunc(rng[0]), math.trunc(rng[1])))
    return a.bld.emit("f2i", (a.reg,), "i", (_I32[0] + 1, _I32[1] - 1))


def _cast(a, dtype):
    if dtype.is_floating_point:
        if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise Refused(f"a cast to {dtype}")
        if dtype in (torch.bfloat16, torch.float16):
            raise Refused(f"a cast to {dtype} (the kernel's floats are fp32)")
        return a._f()
    if dtype == torch.bool:
        return _compare("ne", a, 0)
    if dtype in (torch.int64, torch.int32):
        return _to_int(a)
    raise Refused(f"a cast to {dtype}")


def _compare(op, a, b):
    a, b = _both(a, b)
    _low_arith("a comparison", a, b)  # (a number beside it is rounded to the low dtype first)
    if a.kind == "f" or b.kind == "f":
        return a.bld.emit("f" + op, (a._f().reg, b._f().reg), "b", (0, 1))
    return a.bld.emit("i" + op, (a.reg, b.reg), "b", (0, 1))


def _logic(op, a, b):
    a, b = _both(a, b)
    if a.kind != "b" or b.kind != "b":
        raise Refused(f"'{'&' if op == 'and' else '|'}' on non-boolean values (bitwise integer logic)")
    return a.bld.emit(op, (a.reg, b.reg), "b", (0, 1))


def _not(a):
    if a.kind != "b":
        raise Refused("'~' on a non-boolean value (bitwise integer not)")
    return a.bld.emit("not", (a.reg,), "b", (0, 1))


def _minmax(op, a, b):
    a, b = _both(a, b)
    _low_arith("a minimum / maximum", a, b)  # (a number beside it would be rounded to the low dtype)
    if a.kind == "f" or b.kind == "f":
        return a.bld.emit("f" + op, (a._f().reg, b._f().reg), "f", _frange(op, a.rng, b.rng))
    (al, ah), (bl, bh) = a.rng, b.rng
    rng = (min(al, bl), min(ah, bh)) if op == "min" else (max(al, bl), max(ah, bh))
    return a.bld.emit("i" + op, (a.reg, b.reg), "i", rng)


def _clamp(a, lo, hi):
    if isinstance(lo, torch.Tensor | _Sym) or isinstance(hi, torch.Tensor | _Sym):
        pass
    out = a
    if lo is not None:
        out = _minmax("max", out, lo)
    if hi is not None:
        out = _minmax("min", out, hi)
    return out


def _where(c, a, b):
    bld = _bld(c, a, b)
    c, a, b = _lift(bld, c), _lift(bld, a), _lift(bld, b)
    if c.kind != "b":
        raise Refused("torch.where on a non-boolean condition")
    _low_arith("torch.where", a, b)
    if a.kind == "f" or b.kind == "f":
        rng = None if a.rng is None or b.rng is None else (min(a.rng[0], b.rng[0]), max(a.rng[1], b.rng[1]))
        return bld.emit("where", (c.reg, a._f().reg, b._f().reg), "f", rng)
    rng = (min(a.rng[0], b.rng[0]), max(a.rng[1], b.rng[1]))
    return bld.emit("iwhere", (c.reg, a.reg, b.reg), "b" if a.kind == b.kind == "b" else "i", rng)


def _read(table, idx):
    """``table[idx]``: a captured tensor read at traced / constant indices (one per dim, all dims)."""
    if not isinstance(table, torch.Tensor):
        raise Refused(f"indexing a {type(table).__name__}")
    idx = idx if isinstance(idx, tuple) else (idx,)
    bld = _bld(*idx)
    if table.device.type != "cpu":
        raise Refused(f"a captured tensor on {table.device} (the kernel reads CPU memory)")
    if table.requires_grad and not table.is_floating_point():
        raise Refused("an integer tensor that requires grad")
    if len(idx) != table.dim() or any(i is None or i is Ellipsis or isinstance(i, slice) for i in idx):
        raise Refused(f"a read of a {table.dim()}-d tensor with {len(idx)} indices (read one element per point)")
    if table.dim() > 4 or table.dim() == 0:
        raise Refused(f"a read of a {table.dim()}-d tensor")
    if table.numel() > _MAX_TABLE_ELEMS:
        raise Refused(f"a captured tensor of {table.numel()} elements")
    regs = []
    for i in idx:
        s = _lift(bld, i)
        if s.kind == "f":
            raise Refused("a tensor indexed by a float")
        lo, hi = s.rng
        if _from_score(bld, s.reg):
            raise Refused("a tensor read at an index computed from the score")
        # an index the ranges cannot bound inside [-n, n) is checked by the kernel at every visible point: out of
        # range it reads the edge and reports, and attention raises IndexError as torch's indexing would
        regs.append(s.reg)
    regs += [-1] * (4 - len(regs))
    if table.is_floating_point():
        # a copy, always: .to() / .contiguous() return the tensor itself when nothing changes, and a cached program
        # must never see the caller's later in-place edits (its key is the content at trace time)
        data, kind = table.detach().to(torch.float32, copy=True).contiguous(), "f"
        finite = bool(torch.isfinite(data).all()) and data.numel() > 0
        rng = (float(data.min()), float(data.max())) if finite else None
        if table.dtype == torch.float64 and not torch.equal(data.double(), table.detach()):
            raise Refused("a float64 table whose values fp32 cannot hold exactly")
    elif table.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool):
        if table.numel() == 0:
            raise Refused("an empty tensor")
        lo, hi = int(table.min()), int(table.max())
        kind = "b" if table.dtype == torch.bool else "i"
        data, rng = table.detach().to(torch.int32, copy=True).contiguous(), _int_range(lo, hi)
    else:
        raise Refused(f"a captured tensor of {table.dtype}")
    key = id(table)
    if key not in bld.table_ids:
        bld.table_ids[key] = len(bld.tables)
        bld.tables.append(data)
        bld.sources.append(table)
    t = bld.table_ids[key]
    out = bld.emit("readf" if kind == "f" else "readi", (t, *regs), kind, rng)
    out.low = table.dtype in (torch.bfloat16, torch.float16)
    return out


def _from_score(bld: _Builder, reg: int) -> bool:
    """Whether register ``reg`` depends on the score (register 0)."""
    seen, stack = set(), [reg]
    while stack:
        r = stack.pop()
        if r == 0:
            return True
        if r in seen:
            continue
        seen.add(r)
        ins = bld.code[r]  # one instruction per register, in order
        stack.extend(_operands(ins))
    return False


def _t_where(cond, a=None, b=None):
    if a is None or b is None:
        raise Refused("torch.where(cond) with one argument")
    return _where(cond, a, b)


def _t_clamp(x, min=None, max=None):
    return _clamp(_lift(_bld(x, min, max), x), min, max)


_TORCH: dict[str, Callable[..., Any]] = {
    "add": lambda a, b, alpha=1: _binary("add", a, b if alpha == 1 else _binary("mul", b, alpha)),
    "sub": lambda a, b, alpha=1: _binary("sub", a, b if alpha == 1 else _binary("mul", b, alpha)),
    "mul": lambda a, b: _binary("mul", a, b), "multiply": lambda a, b: _binary("mul", a, b),
    "div": lambda a, b, rounding_mode=None: _div(a, b, rounding_mode),
    "true_divide": lambda a, b: _binary("div", a, b),
    "floor_divide": lambda a, b: _binary("floordiv", a, b),
    "remainder": lambda a, b: _binary("mod", a, b),
    "neg": lambda a: _unary("neg", a), "negative": lambda a: _unary("neg", a),
    "abs": lambda a: _unary("abs", a), "sign": lambda a: _unary("sign", a),
    "tanh": lambda a: _unary("tanh", a), "exp": lambda a: _unary("exp", a),
    "log": lambda a: _unary("log", a), "log1p": lambda a: _unary("log1p", a),
    "floor": lambda a: _unary("floor", a),
    "minimum": lambda a, b: _minmax("min", a, b), "maximum": lambda a, b: _minmax("max", a, b),
    "clamp": _t_clamp, "clip": _t_clamp,
    "where": _t_where,
    "lt": lambda a, b: _compare("lt", a, b), "le": lambda a, b: _compare("le", a, b),
    "gt": lambda a, b: _compare("lt", b, a), "ge": lambda a, b: _compare("le", b, a),
    "eq": lambda a, b: _compare("eq", a, b), "ne": lambda a, b: _compare("ne", a, b),
    "logical_and": lambda a, b: _logic("and", a, b), "logical_or": lambda a, b: _logic("or", a, b),
    "logical_not": lambda a: _not(a),
    "__getitem__": _read,
}
# Tensor methods that reach __torch_function__ with the traced value as an argument of a real tensor's method
for _n, _m in list(_TORCH.items()):
    _TORCH.setdefault("__" + _n + "__", _m)
_TORCH.update({"__radd__": lambda a, b: _binary("add", b, a), "__rsub__": lambda a, b: _binary("sub", b, a),
               "__rmul__": lambda a, b: _binary("mul", b, a), "__rtruediv__": lambda a, b: _binary("div", b, a),
               "__truediv__": lambda a, b: _binary("div", a, b), "__and__": lambda a, b: _logic("and", a, b),
               "__or__": lambda a, b: _logic("or", a, b), "__lt__": lambda a, b: _compare("lt", a, b),
               "__le__": lambda a, b: _compare("le", a, b), "__gt__": lambda a, b: _compare("lt", b, a),
               "__ge__": lambda a, b: _compare("le", b, a), "__eq__": lambda a, b: _compare("eq", a, b),
               "__ne__": lambda a, b: _compare("ne", a, b), "__invert__": lambda a: _not(a),
               "__floordiv__": lambda a, b: _binary("floordiv", a, b), "__mod__": lambda a, b: _binary("mod", a, b),
               "__rfloordiv__": lambda a, b: _binary("floordiv", b, a), "__rmod__": lambda a, b: _binary("mod", b, a)})

_CACHE: OrderedDict = OrderedDict()
_CACHE_MAX = 64


def compile_score_mod(fn, B: int, H: int, L: int, S: int) -> Program:
    """The program of ``fn`` for a call of these sizes, or :class:`Refused` naming what it does not cover.

    Cached under the function's value key (code + the content of what it captures) and the sizes; a
    function whose key cannot be made (it reads a list, an object's attribute) is traced on every call.

    S only bounds the key index's range (what the tracer proves about integers: int32, a divisor's sign): a
    program traced for any S' >= S runs a call of S keys exactly (the kernel clamps and checks every index at
    run time). So a decode loop, one key more every step, is traced for S rounded up to a power of two (once
    per doubling, not once per token); where that wider range is refused (an integer that would leave int32 only
    past S), the exact S is traced instead."""
    wide = max(64, 1 << (S - 1).bit_length()) if S > 0 else S
    if wide != S:
        try:
            return _compile(fn, B, H, L, wide)
        except Refused:
            pass
    return _compile(fn, B, H, L, S)


def _compile(fn, B: int, H: int, L: int, S: int) -> Program:
    from . import score_mods  # (it imports nothing of this module; imported here to keep the import order flat)

    vk = score_mods.builtin_key(fn) if type(fn) in score_mods.BUILT_IN else _mods.value_key(fn)
    # grad mode too: a program traced under no_grad has no gradient slots (Program.grad_of), so a validation pass
    # must not leave it for the training calls that follow
    key = None if vk is None else (vk, B, H, L, S, torch.is_grad_enabled())
    if key is not None and key in _CACHE:
        _CACHE.move_to_end(key)
        hit = _CACHE[key]
        if isinstance(hit, Refused):
            raise hit
        return hit
    try:
        prog = _trace(fn, B, H, L, S)
    except Refused as e:
        if key is not None:
            _CACHE[key] = e
        raise
    except Exception as e:  # anything the stand-ins do not model: the mod keeps its old path
        raise Refused(f"{type(e).__name__} while tracing: {e}") from e
    if key is not None and not prog.wants_grads:  # a gradient goes to this call's tensor objects: not cached
        _CACHE[key] = prog
        if len(_CACHE) > _CACHE_MAX:
            _CACHE.popitem(last=False)
    return prog


def _operands(ins) -> list[int]:
    """The registers an instruction reads (its other words are constants, table numbers or -1 padding)."""
    name = OPS[ins[0]]
    if name in ("score", "qidx", "kvidx", "bidx", "hidx", "constf", "consti"):
        return []
    if name in ("readf", "readi"):
        return [r for r in ins[3:7] if r >= 0]
    if name in ("where", "iwhere"):
        return list(ins[2:5])
    if name in ("neg", "abs", "sign", "tanh", "exp", "log", "log1p", "floor", "ineg", "iabs", "isign", "i2f", "f2i",
                "not"):
        return [ins[2]]
    return list(ins[2:4])


def _live(code: list, out: int) -> list:
    """The instructions the result depends on, in order (the score's, register 0, is always kept: the
    backward reads its adjoint there)."""
    need = {out, 0}
    keep = []
    for ins in reversed(code):
        if ins[1] in need:
            keep.append(ins)
            need.update(_operands(ins))
    return list(reversed(keep))


def _trace(fn, B, H, L, S) -> Program:
    bld = _Builder(B, H, L, S)
    score = bld.emit("score", (), "f")
    q = bld.emit("qidx", (), "i", (0, L - 1))
    kv = bld.emit("kvidx", (), "i", (0, S - 1))
    b = bld.emit("bidx", (), "i", (0, B - 1))
    h = bld.emit("hidx", (), "i", (0, H - 1))
    with torch.no_grad():
        out = fn(score, b, h, q, kv)
    if isinstance(out, torch.Tensor) or not isinstance(out, _Sym | int | float | bool):
        raise Refused(f"a result of type {type(out).__name__} (not computed from the score and indices)")
    out = _lift(bld, out)._f()
    if any(not math.isfinite(c) for c in bld.consts if not math.isinf(c)):
        raise Refused("a NaN constant")
    code = torch.tensor(_live(bld.code, out.reg), dtype=torch.int32).reshape(-1, WIDTH)
    grad_of = tuple(t if t.requires_grad and torch.is_grad_enabled() else None for t in bld.sources)
    if len(grad_of) > _MAX_TABLES:
        raise Refused(f"reads of {len(grad_of)} captured tensors (the kernel takes {_MAX_TABLES})")
    return Program(code, torch.tensor(bld.consts or [0.0], dtype=torch.float32), tuple(bld.tables), bld.n, out.reg,
                   grad_of, S)
