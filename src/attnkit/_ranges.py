"""Range evaluation of a ``mask_mod``: one call over whole tiles, three-valued per tile.

Shape legend: B batch, H heads, L query length, S key length; tiles of ``bm × bn``,
``nq = ceil(L / bm)`` query blocks, ``nk = ceil(S / bn)`` key blocks.

A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` is written for index tensors. Here it is
called ONCE with :class:`_Range` arguments instead: ``q_idx`` holds, per query block, the
interval ``[first row, last row]`` ``(1, 1, nq, 1)``; ``kv_idx`` the interval of each key
block ``(1, 1, 1, nk)``; ``b`` and ``h`` are exact values ``(B, 1, 1, 1)``, ``(1, H, 1, 1)``.
Every operation the mod does is replayed on intervals (interval arithmetic), so the result
holds, per tile, an interval of booleans::

    [True, True]   every point of the tile attends     -> FULL
    [False, False] no point attends                    -> EMPTY
    [False, True]  undecided ("mixed")                 -> point-evaluated (exactly)

    causal, q block [128, 255], kv block [0, 127]:  kv <= q  ->  hi(kv)=127 <= lo(q)=128: always True
                      kv block [128, 255]:                       lo(kv)=128 <= hi(q)=255 but not always

Interval results are *sound* (they contain every value the points can take) but not tight
(``q - q`` gives ``[lo - hi, hi - lo]``, not 0): a tile is never called full or empty
wrongly; a tile the intervals cannot decide is evaluated at its points.

Covered: ``< <= > >= == !=``; ``& | ^ ~`` (three-valued); ``+ - *``; ``//`` and ``%`` (by
constants, tensors and intervals of one sign); ``abs``, negation, ``torch.where``,
``minimum / maximum / clamp``; Python and tensor constants; indexing a captured tensor
with intervals (``doc[q_idx]``, ``lengths[b]``, ``bias[h, q_idx]``): the range of the
tensor's values over the index range, from a min/max table (:class:`_MinMaxTable`) built
once per tensor *content* and reused while the content is unchanged. Indexing with two
undecided indices at once gives the tensor's global value range (sound, not tight).

Anything else raises :class:`Unsupported` — an unknown torch function, ``bool(interval)``
(Python control flow on an index), ``.item()``, ``.shape``, float division, integer
bitwise ops — and the caller abandons range evaluation for that mod and evaluates every
point, as before: never a guess.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["Unsupported", "evaluate", "minmax_table", "checked_once"]


class Unsupported(Exception):
    """The mod did something the intervals cannot follow soundly."""


class _NoAttribute(Unsupported, AttributeError):
    """A missing attribute of an interval: an AttributeError too, so ``hasattr`` probes answer False."""


_INT = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Integer bounds past this could overflow int64 in a product: refuse rather than wrap.
_MUL_LIMIT = 1 << 31


def _kind(dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype in _INT:
        return "int"
    if dtype in _FLOAT:
        return "float"
    raise Unsupported(f"dtype {dtype}")


class _Range:
    """Per element, the interval ``[lo, hi]`` of the values a tensor can take (``lo``/``hi``
    broadcast together). Booleans: ``lo`` = surely True, ``hi`` = possibly True."""

    __slots__ = ("exact", "hi", "kind", "lo")

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor, exact: bool = False):
        self.lo, self.hi = lo, hi
        self.kind = _kind(lo.dtype)
        if self.kind != _kind(hi.dtype):
            raise Unsupported("mixed bound dtypes")
        self.exact = exact  # lo is hi: a value known exactly (b, h, a constant)

    # --- what a mod may read off an index tensor ---------------------------------------
    @property
    def device(self):
        return self.lo.device

    @property
    def dtype(self):
        return self.lo.dtype

    def __bool__(self):
        raise Unsupported("bool() of an interval (Python control flow on an index)")

    def __index__(self):
        raise Unsupported("an interval used as a Python int")

    __int__ = __float__ = __index__

    def __len__(self):
        raise Unsupported("len() of an interval")

    def __iter__(self):
        raise Unsupported("iterating an interval")

    def __getattr__(self, name):
        # shape, item(), view(), sum() ...: shape tricks and reductions are not followed
        raise _NoAttribute(f"attribute {name!r} of an index")

    def __repr__(self):
        return f"_Range(kind={self.kind}, shape={tuple(torch.broadcast_shapes(self.lo.shape, self.hi.shape))})"

    # --- operators -------------------------------------------------------------------
    def __add__(self, o): return _add(self, o)
    def __radd__(self, o): return _add(o, self)
    def __sub__(self, o): return _sub(self, o)
    def __rsub__(self, o): return _sub(o, self)
    def __mul__(self, o): return _mul(self, o)
    def __rmul__(self, o): return _mul(o, self)
    def __floordiv__(self, o): return _floordiv(self, o)
    def __rfloordiv__(self, o): return _floordiv(o, self)
    def __mod__(self, o): return _mod(self, o)
    def __rmod__(self, o): return _mod(o, self)
    def __neg__(self): return _neg(self)
    def __pos__(self): return self
    def __abs__(self): return _abs(self)
    def __and__(self, o): return _and(self, o)
    def __rand__(self, o): return _and(o, self)
    def __or__(self, o): return _or(self, o)
    def __ror__(self, o): return _or(o, self)
    def __xor__(self, o): return _xor(self, o)
    def __rxor__(self, o): return _xor(o, self)
    def __invert__(self): return _not(self)
    def __lt__(self, o): return _lt(self, o)
    def __le__(self, o): return _le(self, o)
    def __gt__(self, o): return _lt(o, self)
    def __ge__(self, o): return _le(o, self)
    def __eq__(self, o): return _eq(self, o)
    def __ne__(self, o): return _not(_eq(self, o))
    __hash__ = None  # type: ignore[assignment]  # unhashable (== is elementwise): the data model's idiom, not a method

    def abs(self): return _abs(self)
    def neg(self): return _neg(self)
    def logical_not(self): return _not(self)
    def logical_and(self, o): return _and(self, o)
    def logical_or(self, o): return _or(self, o)
    def minimum(self, o): return _minimum(self, o)
    def maximum(self, o): return _maximum(self, o)
    def clamp(self, min=None, max=None): return _clamp(self, min, max)  # torch's names
    clip = clamp
    def clamp_min(self, m): return _clamp(self, m, None)
    def clamp_max(self, m): return _clamp(self, None, m)
    def remainder(self, o): return _mod(self, o)
    def floor_divide(self, o): return _floordiv(self, o)
    def div(self, o, rounding_mode=None): return _div(self, o, rounding_mode)
    def eq(self, o): return _eq(self, o)
    def ne(self, o): return _not(_eq(self, o))
    def lt(self, o): return _lt(self, o)
    def le(self, o): return _le(self, o)
    def gt(self, o): return _lt(o, self)
    def ge(self, o): return _le(o, self)

    def to(self, *args, **kwargs):
        # .to(device) is a no-op on index values; a dtype change could round or wrap: refused
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.dtype) and a != self.lo.dtype:
                raise Unsupported(f"cast of an index to {a}")
            if isinstance(a, torch.Tensor):
                raise Unsupported(".to(tensor)")
        return self

    def long(self):
        if self.lo.dtype != torch.int64:
            raise Unsupported("cast to long")
        return self

    def bool(self):
        if self.kind != "bool":
            raise Unsupported("cast to bool")
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        impl = _TORCH.get(name) if name is not None else None
        if impl is None:
            raise Unsupported(f"torch function {name!r}")
        return impl(*args, **kwargs)


def _lift(x) -> _Range:
    """An operand as an interval: intervals as they are, constants as exact intervals."""
    if isinstance(x, _Range):
        return x
    if isinstance(x, bool):
        t = torch.tensor(x)
    elif isinstance(x, int):
        if abs(x) >= 1 << 62:
            raise Unsupported("an integer constant near int64's limits (sums could wrap)")
        t = torch.tensor(x, dtype=torch.int64)
    elif isinstance(x, float):
        # float64 0-d, like torch's wrapped Python number: a float32 tensor op casts it to float32,
        # a float64 one keeps every bit (the default dtype would round it first)
        t = torch.tensor(x, dtype=torch.float64)
    elif isinstance(x, torch.Tensor):
        if x.numel() > 1:
            # a captured tensor used elementwise lines up with the (b, h, q, kv) grid by position,
            # which the tile grid of intervals does not have: only indexing (doc[q]) is followed
            raise Unsupported("a captured tensor of several values used elementwise")
        if x.requires_grad:
            x = x.detach()
        if x.is_floating_point() and bool(torch.isnan(x).any()):
            raise Unsupported("NaN constant")
        t = x
    else:
        raise Unsupported(f"operand of type {type(x).__name__}")
    return _Range(t, t, exact=True)


def _result_dtype(a, b):
    """torch's promotion for ``a op b`` (Python scalars as wrapped numbers)."""
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        return torch.result_type(_lift(a).lo, _lift(b).lo)
    return torch.result_type(a, b)


def _operand(x):
    """What torch.result_type should see for x: the bound tensor, or the Python scalar."""
    return x.lo if isinstance(x, _Range) else x


def _same_kinds(a: _Range, b: _Range, ok=("int", "float")):
    if a.kind not in ok or b.kind not in ok:
        raise Unsupported(f"{a.kind} with {b.kind}")
    if a.kind != b.kind:
        # int vs float: torch converts the int to the float dtype, which rounds past 2**24 (fp32)
        raise Unsupported("mixed int and float operands")


def _check_float(lo, hi):
    if lo.is_floating_point() and bool(torch.isnan(lo).any() | torch.isnan(hi).any()):
        raise Unsupported("NaN bound")  # inf - inf: NaN compares False everywhere, not sound
    return lo, hi


def _widen(r: _Range, dt) -> _Range:
    """Integer arithmetic in a dtype narrower than int64 wraps around in the real evaluation, and
    a wrapped interval is not an interval: compute such bounds in int64, check they fit (``_fit``)."""
    if r.kind != "int" or dt == torch.int64 or r.lo.dtype == torch.int64:
        return r
    return _Range(r.lo.to(torch.int64), r.hi.to(torch.int64), r.exact)


def _fit(lo, hi, dt):
    """Bounds computed in int64 for a narrower integer dtype: cast back when every value in them
    fits (then no point overflowed either), else Unsupported."""
    if dt == torch.int64 or lo.dtype != torch.int64 or dt not in _INT:
        return lo.to(dt), hi.to(dt)
    info = torch.iinfo(dt)
    if bool((lo < info.min).any() | (hi > info.max).any()):
        raise Unsupported(f"{dt} arithmetic that may wrap around")
    return lo.to(dt), hi.to(dt)


def _exact(a, b) -> bool:
    return a.exact and b.exact


def _mk(lo, hi, a, b):
    return _Range(lo, hi, exact=_exact(a, b) and lo is hi)


def _add(a, b):
    ra, rb = _lift(a), _lift(b)
    _same_kinds(ra, rb)
    dt = _result_dtype(_operand(a), _operand(b))
    ra, rb = _widen(ra, dt), _widen(rb, dt)
    if _exact(ra, rb):
        v = _fit(*(torch.add(ra.lo, rb.lo),) * 2, dt)[0]
        return _Range(v, v, exact=True)
    return _Range(*_check_float(*_fit(torch.add(ra.lo, rb.lo), torch.add(ra.hi, rb.hi), dt)))


def _sub(a, b):
    ra, rb = _lift(a), _lift(b)
    _same_kinds(ra, rb)
    dt = _result_dtype(_operand(a), _operand(b))
    ra, rb = _widen(ra, dt), _widen(rb, dt)
    if _exact(ra, rb):
        v = _fit(*(torch.sub(ra.lo, rb.lo),) * 2, dt)[0]
        return _Range(v, v, exact=True)
    return _Range(*_check_float(*_fit(torch.sub(ra.lo, rb.hi), torch.sub(ra.hi, rb.lo), dt)))


def _neg(a):
    ra = _lift(a)
    if ra.kind == "bool":
        raise Unsupported("negation of a bool")
    dt = ra.lo.dtype
    ra = _widen(ra, dt)
    if ra.exact:
        v = _fit(-ra.lo, -ra.lo, dt)[0]
        return _Range(v, v, exact=True)
    return _Range(*_fit(-ra.hi, -ra.lo, dt))


def _abs(a):
    ra = _lift(a)
    if ra.kind == "bool":
        raise Unsupported("abs of a bool")
    if ra.kind == "int" and ra.lo.dtype != torch.int64:
        raise Unsupported("abs of a narrow integer (abs(min) wraps)")
    if ra.exact:
        v = ra.lo.abs()
        return _Range(v, v, exact=True)
    lo, hi = ra.lo, ra.hi
    zero = torch.zeros((), dtype=lo.dtype)
    # [lo, hi] >= 0: itself; <= 0: mirrored; straddling 0: [0, max(-lo, hi)]
    new_lo = torch.where(lo >= 0, lo, torch.where(hi <= 0, -hi, zero))
    new_hi = torch.maximum(-lo, hi)
    return _Range(new_lo, new_hi)


def _corners(op, ra, rb, dt):
    ra, rb = _widen(ra, dt), _widen(rb, dt)
    c = [op(x, y) for x in (ra.lo, ra.hi) for y in (rb.lo, rb.hi)]
    lo = torch.minimum(torch.minimum(c[0], c[1]), torch.minimum(c[2], c[3]))
    hi = torch.maximum(torch.maximum(c[0], c[1]), torch.maximum(c[2], c[3]))
    return _fit(lo, hi, dt)


def _mul(a, b):
    ra, rb = _lift(a), _lift(b)
    _same_kinds(ra, rb)
    dt = _result_dtype(_operand(a), _operand(b))
    if ra.kind == "int":
        for r in (ra, rb):
            lo64, hi64 = r.lo.to(torch.int64), r.hi.to(torch.int64)  # a narrow dtype would wrap the limit
            if bool((lo64.abs() >= _MUL_LIMIT).any() | (hi64.abs() >= _MUL_LIMIT).any()):
                raise Unsupported("a product that could overflow")
    if _exact(ra, rb):
        v = _corners(torch.mul, ra, rb, dt)[0]
        return _Range(v, v, exact=True)
    # x·y over a box is extremal at its corners (linear in each argument); rounding is monotone
    return _Range(*_check_float(*_corners(torch.mul, ra, rb, dt)))


def _divisor_sign(rd: _Range) -> None:
    if not bool(((rd.lo > 0) | (rd.hi < 0)).all()):
        raise Unsupported("a divisor range that contains 0")


def _floordiv(a, b):
    return _div(a, b, "floor")


def _div(a, b, rounding_mode=None):
    if rounding_mode not in ("floor", "trunc"):
        raise Unsupported("true division (float result)")
    ra, rb = _lift(a), _lift(b)
    _same_kinds(ra, rb, ok=("int",))
    _divisor_sign(rb)
    dt = _result_dtype(_operand(a), _operand(b))

    def op(x, y):
        return torch.div(x, y, rounding_mode=rounding_mode)

    if _exact(ra, rb):
        v = _corners(op, ra, rb, dt)[0]
        return _Range(v, v, exact=True)
    # x / y with y of one sign is monotone in x and in y separately, so its extremes over the
    # box are at the corners; floor and trunc are monotone, so they keep them there
    return _Range(*_corners(op, ra, rb, dt))


def _mod(a, b):
    """Floor modulo (Python's and torch.remainder's): the result has the divisor's sign.

    For a divisor d > 0 (elementwise): x in [lo, hi] within one period (floor(lo/d) == floor(hi/d))
    maps to [lo mod d, hi mod d]; otherwise it wraps and may take any value in [0, d - 1]::

        d = 4:   x  5 6 7 | 8 9         [5, 7] -> [1, 3];  [6, 9] wraps -> [0, 3]
                 x%4 1 2 3 | 0 1
    """
    ra, rb = _lift(a), _lift(b)
    _same_kinds(ra, rb, ok=("int",))
    _divisor_sign(rb)
    dt = _result_dtype(_operand(a), _operand(b))
    ra, rb = _widen(ra, dt), _widen(rb, dt)  # |x mod d| < |d| fits dt; -x below does not always
    if _exact(ra, rb):
        v = torch.remainder(ra.lo, rb.lo).to(dt)
        return _Range(v, v, exact=True)
    neg = rb.hi < 0
    if bool(neg.any()):
        # x mod d = -((-x) mod (-d)) for d < 0; elementwise, so split by the divisor's sign
        if not bool(neg.all()):
            pos_part = _mod_pos(ra.lo, ra.hi, rb.lo.clamp(min=1), rb.hi.clamp(min=1))
            neg_part = _mod_pos(-ra.hi, -ra.lo, (-rb.hi).clamp(min=1), (-rb.lo).clamp(min=1))
            lo = torch.where(neg, -neg_part[1], pos_part[0])
            hi = torch.where(neg, -neg_part[0], pos_part[1])
            return _Range(lo.to(dt), hi.to(dt))
        lo2, hi2 = _mod_pos(-ra.hi, -ra.lo, -rb.hi, -rb.lo)
        return _Range((-hi2).to(dt), (-lo2).to(dt))
    lo, hi = _mod_pos(ra.lo, ra.hi, rb.lo, rb.hi)
    return _Range(lo.to(dt), hi.to(dt))


def _mod_pos(lo, hi, dlo, dhi):
    """[lo, hi] mod d for every d in [dlo, dhi], dlo >= 1: a sound interval."""
    zero = torch.zeros((), dtype=torch.result_type(lo, dlo))
    same_d = dlo == dhi
    d = dlo
    one_period = same_d & (torch.div(lo, d, rounding_mode="floor") == torch.div(hi, d, rounding_mode="floor"))
    # varying divisor: x in [0, dlo) is unchanged by any d in the range; else [0, min(hi, dhi - 1)] for x >= 0
    untouched = (lo >= 0) & (hi < dlo)
    new_lo = torch.where(one_period, torch.remainder(lo, d), torch.where(untouched, lo, zero))
    wrap_hi = torch.where(lo >= 0, torch.minimum(hi, dhi - 1), dhi - 1)
    new_hi = torch.where(one_period, torch.remainder(hi, d), torch.where(untouched, hi, wrap_hi))
    return new_lo, new_hi


# --- booleans: three-valued logic ------------------------------------------------------

def _bools(a, b):
    ra, rb = _lift(a), _lift(b)
    if ra.kind != "bool" or rb.kind != "bool":
        raise Unsupported("bitwise op on integers")
    return ra, rb


def _and(a, b):
    ra, rb = _bools(a, b)
    return _mk(ra.lo & rb.lo, ra.hi & rb.hi, ra, rb) if not _exact(ra, rb) else _exact_bool(ra.lo & rb.lo)


def _or(a, b):
    ra, rb = _bools(a, b)
    return _mk(ra.lo | rb.lo, ra.hi | rb.hi, ra, rb) if not _exact(ra, rb) else _exact_bool(ra.lo | rb.lo)


def _xor(a, b):
    ra, rb = _bools(a, b)
    if _exact(ra, rb):
        return _exact_bool(ra.lo ^ rb.lo)
    can_true = (ra.hi & ~rb.lo) | (~ra.lo & rb.hi)  # (True, False) or (False, True) possible
    can_false = (ra.hi & rb.hi) | (~ra.lo & ~rb.lo)  # equal values possible
    return _Range(~can_false, can_true)


def _not(a):
    ra = _lift(a)
    if ra.kind != "bool":
        raise Unsupported("~ on integers (bitwise not)")
    if ra.exact:
        return _exact_bool(~ra.lo)
    return _Range(~ra.hi, ~ra.lo)


def _exact_bool(v):
    return _Range(v, v, exact=True)


# --- comparisons -------------------------------------------------------------------------

def _cmp_operands(a, b):
    ra, rb = _lift(a), _lift(b)
    if ra.kind == "bool" or rb.kind == "bool":
        if ra.kind != rb.kind:
            raise Unsupported("comparison of a bool with a number")
        ra = _Range(ra.lo.to(torch.int8), ra.hi.to(torch.int8), ra.exact)
        rb = _Range(rb.lo.to(torch.int8), rb.hi.to(torch.int8), rb.exact)
    else:
        _same_kinds(ra, rb)
    return ra, rb


def _lt(a, b):
    ra, rb = _cmp_operands(a, b)
    if _exact(ra, rb):
        return _exact_bool(ra.lo < rb.lo)
    return _Range(ra.hi < rb.lo, ra.lo < rb.hi)


def _le(a, b):
    ra, rb = _cmp_operands(a, b)
    if _exact(ra, rb):
        return _exact_bool(ra.lo <= rb.lo)
    return _Range(ra.hi <= rb.lo, ra.lo <= rb.hi)


def _eq(a, b):
    ra, rb = _cmp_operands(a, b)
    if _exact(ra, rb):
        return _exact_bool(ra.lo == rb.lo)
    surely = (ra.lo == ra.hi) & (rb.lo == rb.hi) & (ra.lo == rb.lo)
    overlap = (ra.lo <= rb.hi) & (rb.lo <= ra.hi)
    return _Range(surely, overlap)


# --- selection ----------------------------------------------------------------------------

def _minimum(a, b):
    ra, rb = _lift(a), _lift(b)
    _same_kinds(ra, rb)
    dt = _result_dtype(_operand(a), _operand(b))
    lo = torch.minimum(ra.lo.to(dt), rb.lo.to(dt))
    if _exact(ra, rb):
        return _Range(lo, lo, exact=True)
    return _Range(lo, torch.minimum(ra.hi.to(dt), rb.hi.to(dt)))


def _maximum(a, b):
    ra, rb = _lift(a), _lift(b)
    _same_kinds(ra, rb)
    dt = _result_dtype(_operand(a), _operand(b))
    lo = torch.maximum(ra.lo.to(dt), rb.lo.to(dt))
    if _exact(ra, rb):
        return _Range(lo, lo, exact=True)
    return _Range(lo, torch.maximum(ra.hi.to(dt), rb.hi.to(dt)))


def _clamp(x, min=None, max=None):  # torch's keyword names
    out = x
    if min is not None:
        out = _maximum(out, min)
    if max is not None:
        out = _minimum(out, max)
    if min is None and max is None:
        raise Unsupported("clamp without bounds")
    return out


def _where(cond, a=None, b=None):
    if a is None or b is None:
        raise Unsupported("one-argument torch.where (nonzero)")
    rc, ra, rb = _lift(cond), _lift(a), _lift(b)
    if rc.kind != "bool":
        raise Unsupported("where on a non-bool condition")
    if ra.kind != rb.kind:
        raise Unsupported("where with branches of different kinds")
    if ra.kind != "bool":
        dt = _result_dtype(_operand(a), _operand(b))
        ra = _Range(ra.lo.to(dt), ra.hi.to(dt), ra.exact)
        rb = _Range(rb.lo.to(dt), rb.hi.to(dt), rb.exact)
    if rc.exact and ra.exact and rb.exact:
        v = torch.where(rc.lo, ra.lo, rb.lo)
        return _Range(v, v, exact=True)
    # surely True -> a's interval; surely False -> b's; undecided -> the hull of both
    if ra.kind == "bool":
        hull_lo, hull_hi = ra.lo & rb.lo, ra.hi | rb.hi
    else:
        hull_lo, hull_hi = torch.minimum(ra.lo, rb.lo), torch.maximum(ra.hi, rb.hi)
    lo = torch.where(rc.lo, ra.lo, torch.where(rc.hi, hull_lo, rb.lo))
    hi = torch.where(rc.lo, ra.hi, torch.where(rc.hi, hull_hi, rb.hi))
    return _Range(lo, hi)


def _minmax2(fn):
    def impl(a, b=None, *rest, **kw):
        if b is None or rest or kw or not isinstance(b, (torch.Tensor, _Range)):
            raise Unsupported("torch.min/max as a reduction")
        return fn(a, b)
    return impl


# --- indexing a captured tensor with intervals -------------------------------------------

def _getitem(t, index):
    if isinstance(t, _Range):
        raise Unsupported("indexing an index tensor")
    if not isinstance(t, torch.Tensor):
        raise Unsupported("indexing a non-tensor")
    idx = index if isinstance(index, tuple) else (index,)
    if len(idx) != t.dim():
        # doc[q] on a 2-D tensor selects rows (a trailing dim), slices, None, ...: not followed
        raise Unsupported(f"indexing a {t.dim()}-D tensor with {len(idx)} indices")
    rs = []
    for d, i in enumerate(idx):
        if isinstance(i, bool) or not isinstance(i, (int, torch.Tensor, _Range)):
            raise Unsupported(f"index of type {type(i).__name__}")
        r = _lift(i)
        if r.kind != "int":
            raise Unsupported("a non-integer index")
        n = t.shape[d]
        # out of [-n, n): the point evaluation raises (or the index is only a loose bound): let it decide
        if bool((r.lo.to(torch.int64) < -n).any() | (r.hi.to(torch.int64) >= n).any()):  # no wrapped -n
            raise Unsupported("an index range reaching outside the tensor")
        rs.append(r)
    src = t.detach()
    if _kind(src.dtype) == "float" and bool(torch.isnan(src).any()):
        raise Unsupported("indexing a tensor holding NaN")
    src8 = src.to(torch.int8) if src.dtype == torch.bool else src
    # the captured tensor may live on a GPU while the intervals are on the CPU: look up there,
    # bring the (small: one value per block) answers back
    dev, home = src.device, rs[0].lo.device
    rs = [r if r.lo.device == dev else _Range(r.lo.to(dev), r.hi.to(dev), r.exact) for r in rs]
    inexact = [d for d, r in enumerate(rs) if not r.exact and not bool(torch.equal(r.lo, r.hi))]
    if not inexact:
        v = src8[tuple(r.lo for r in rs)].to(home)
        return _finish(v, v, src.dtype, exact=all(r.exact for r in rs))
    if len(inexact) > 1 or bool((rs[inexact[0]].lo < 0).any()):
        # two ranges at once, or a range that may wrap around the end: the global value range (sound)
        shape = torch.broadcast_shapes(*[r.lo.shape for r in rs], *[r.hi.shape for r in rs])
        lo = src8.min().to(home).expand(shape)
        hi = src8.max().to(home).expand(shape)
        return _finish(lo, hi, src.dtype)
    p = inexact[0]
    table = minmax_table(t, p)  # keyed on the caller's tensor object (a detached view is new each call)
    others = [r.lo for d, r in enumerate(rs) if d != p]
    lo, hi = table.query(others, rs[p].lo, rs[p].hi)
    return _finish(lo.to(home), hi.to(home), src.dtype)


def _finish(lo, hi, dtype, exact=False):
    if dtype == torch.bool:
        lo, hi = lo.to(torch.bool), hi.to(torch.bool)
    return _Range(lo, hi, exact=exact and lo is hi)


class _MinMaxTable:
    """Range min / max over one dim of a tensor: exact for an index interval that spans two
    chunks or more, or touches a chunk's end; sound (a bound, not the value) otherwise.

    The dim is moved last and the other dims flattened into rows ``(R, n)``; keys are cut into
    chunks of ``c``. A query ``[lo, hi]`` inside one chunk reads a small per-chunk sparse table
    of its own; across chunks it combines the suffix of lo's chunk, a sparse table over whole
    chunks, and the prefix of hi's chunk::

        keys   | chunk 0      | chunk 1      | chunk 2      | chunk 3      |
        query        [lo ......................................... hi]
                     suffix(0)  table[chunks 1..2]             prefix(3)

    Memory ~ 4·R·n + 2·R·(n/c)·log2(n/c) values; built in O(n + (n/c) log(n/c)).
    """

    _C = 32

    def __init__(self, t: torch.Tensor, dim: int):
        x = t.movedim(dim, -1)
        self.lead = tuple(x.shape[:-1])
        n = x.shape[-1]
        x = x.reshape(-1, n)
        self.n = n
        c = self._C
        pad = (-n) % c
        # pad with the last value: a pad position is never inside a query (hi < n)
        xp = torch.cat([x, x[:, -1:].expand(-1, pad)], dim=1) if pad else x
        R, nc = xp.shape[0], xp.shape[1] // c
        blocks = xp.view(R, nc, c)
        self.pre_min = blocks.cummin(dim=2).values.reshape(R, -1)
        self.pre_max = blocks.cummax(dim=2).values.reshape(R, -1)
        self.suf_min = blocks.flip(2).cummin(dim=2).values.flip(2).reshape(R, -1)
        self.suf_max = blocks.flip(2).cummax(dim=2).values.flip(2).reshape(R, -1)
        self.chunk_min = self._sparse(blocks.amin(dim=2), torch.minimum)  # list over levels of (R, nc)
        self.chunk_max = self._sparse(blocks.amax(dim=2), torch.maximum)

    @staticmethod
    def _sparse(v, op):
        """Sparse table: level k holds op over [j, j + 2**k) (clipped at the end)."""
        out = [v]
        k = 1
        while (1 << k) <= v.shape[1]:
            prev, half = out[-1], 1 << (k - 1)
            nxt = prev.clone()
            nxt[:, :-half] = op(prev[:, :-half], prev[:, half:])
            out.append(nxt)
            k += 1
        return torch.stack(out)

    @staticmethod
    def _span(table, row, a, b, op):
        """op over [a, b] (inclusive, a <= b) of each row, from a sparse table."""
        length = (b - a + 1).clamp(min=1)
        k = torch.floor(torch.log2(length.to(torch.float64))).to(torch.int64)
        # log2 in float64 is exact at powers of two; correct a rounding at their neighbours
        k = torch.where((1 << (k + 1)) <= length, k + 1, k)
        k = torch.where((1 << k) > length, k - 1, k)
        k = k.clamp(max=table.shape[0] - 1)
        return op(table[k, row, a], table[k, row, (b - (1 << k) + 1).clamp(min=0)])

    def query(self, others, lo, hi):
        """min and max over keys [lo, hi] of the row picked by the exact ``others`` indices."""
        if self.lead:
            row = torch.zeros((), dtype=torch.int64)
            for size, i in zip(self.lead, others, strict=True):  # one exact index per leading dim
                row = row * size + torch.remainder(i, size)  # negative exact indices wrap, as torch's
        else:
            row = torch.zeros((), dtype=torch.int64)
        lo, hi, row = torch.broadcast_tensors(lo.to(torch.int64), hi.to(torch.int64), row)
        c = self._C
        clo, chi = torch.div(lo, c, rounding_mode="floor"), torch.div(hi, c, rounding_mode="floor")
        same = clo == chi
        # within one chunk: [lo, chunk end] and [chunk start, hi] both contain [lo, hi], so the larger
        # of their minima is still a lower bound (and the smaller maximum an upper bound): sound,
        # and exact whenever the range touches either end of its chunk
        f_min = torch.maximum(self.suf_min[row, lo], self.pre_min[row, hi])
        f_max = torch.minimum(self.suf_max[row, lo], self.pre_max[row, hi])
        # across chunks: suffix of lo's chunk, whole chunks in between, prefix of hi's chunk
        a_min = torch.minimum(self.suf_min[row, lo], self.pre_min[row, hi])
        a_max = torch.maximum(self.suf_max[row, lo], self.pre_max[row, hi])
        mid = chi - clo >= 2
        m0, m1 = torch.where(mid, clo + 1, clo), torch.where(mid, chi - 1, clo)
        mid_min = self._span(self.chunk_min, row, m0, m1, torch.minimum)
        mid_max = self._span(self.chunk_max, row, m0, m1, torch.maximum)
        a_min = torch.where(mid, torch.minimum(a_min, mid_min), a_min)
        a_max = torch.where(mid, torch.maximum(a_max, mid_max), a_max)
        return torch.where(same, f_min, a_min), torch.where(same, f_max, a_max)


# (id, dim) -> (private copy of the content, table); hit only when the content is equal
_TABLES: OrderedDict = OrderedDict()
_TABLES_MAX = 8  # each holds a copy of its tensor and ~4 of its size in tables


# id(tensor) -> its table, for tensors already checked during the current plan (see checked_once)
_SESSION: dict | None = None


class checked_once:
    """Within this context (one plan being built), a tensor's content is compared with the
    cached copy once, not at every chunk of the range evaluation."""

    def __enter__(self):
        global _SESSION
        self._outer = _SESSION
        _SESSION = {} if _SESSION is None else _SESSION

    def __exit__(self, *exc):
        global _SESSION
        _SESSION = self._outer


def minmax_table(t: torch.Tensor, dim: int) -> _MinMaxTable:
    """The min/max table of ``t`` along ``dim``, reused while ``t``'s *content* is unchanged.

    Keyed on (id, dim) only to find a candidate; a hit requires a stored private copy equal to
    ``t`` now (same dtype, shape and values), so an in-place change, or a new tensor at a
    recycled id, always rebuilds. Checking costs one O(n) comparison, building O(n log n)."""
    key = (id(t), dim)
    if _SESSION is not None and key in _SESSION:
        return _SESSION[key][1]  # the same object, checked earlier in this plan (and kept alive)
    table = _cached_table(t, dim, key)
    if _SESSION is not None:
        _SESSION[key] = (t, table)
    return table


def _cached_table(t, dim, key):
    hit = _TABLES.get(key)
    if hit is not None:
        copy, table = hit
        if copy.dtype == t.dtype and copy.shape == t.shape and copy.device == t.device and torch.equal(copy, t):
            _TABLES.move_to_end(key)
            return table
    data = t.detach()
    table = _MinMaxTable(data.to(torch.int8) if data.dtype == torch.bool else data, dim)
    _TABLES[key] = (data.clone(), table)
    if len(_TABLES) > _TABLES_MAX:
        _TABLES.popitem(last=False)
    return table


_TORCH = {
    "add": _add, "__add__": _add, "__radd__": lambda a, b: _add(b, a),
    "sub": _sub, "subtract": _sub, "__sub__": _sub, "__rsub__": lambda a, b: _sub(b, a),
    "rsub": lambda a, b: _sub(b, a),
    "mul": _mul, "multiply": _mul, "__mul__": _mul, "__rmul__": lambda a, b: _mul(b, a),
    "floor_divide": _floordiv, "__floordiv__": _floordiv, "__rfloordiv__": lambda a, b: _floordiv(b, a),
    "div": _div, "divide": _div,
    "remainder": _mod, "__mod__": _mod, "__rmod__": lambda a, b: _mod(b, a),
    "neg": _neg, "negative": _neg, "__neg__": _neg,
    "abs": _abs, "absolute": _abs, "__abs__": _abs,
    "__and__": _and, "__rand__": lambda a, b: _and(b, a), "logical_and": _and, "bitwise_and": _and,
    "__or__": _or, "__ror__": lambda a, b: _or(b, a), "logical_or": _or, "bitwise_or": _or,
    "__xor__": _xor, "__rxor__": lambda a, b: _xor(b, a), "logical_xor": _xor, "bitwise_xor": _xor,
    "__invert__": _not, "logical_not": _not, "bitwise_not": _not,
    "lt": _lt, "less": _lt, "__lt__": _lt,
    "le": _le, "less_equal": _le, "__le__": _le,
    "gt": lambda a, b: _lt(b, a), "greater": lambda a, b: _lt(b, a), "__gt__": lambda a, b: _lt(b, a),
    "ge": lambda a, b: _le(b, a), "greater_equal": lambda a, b: _le(b, a), "__ge__": lambda a, b: _le(b, a),
    "eq": _eq, "__eq__": _eq,
    "ne": lambda a, b: _not(_eq(a, b)), "not_equal": lambda a, b: _not(_eq(a, b)),
    "__ne__": lambda a, b: _not(_eq(a, b)),
    "where": _where,
    "minimum": _minimum, "maximum": _maximum, "fmin": None, "fmax": None,
    "min": _minmax2(_minimum), "max": _minmax2(_maximum),
    "clamp": _clamp, "clip": _clamp,
    "clamp_min": lambda x, m: _clamp(x, m, None), "clamp_max": lambda x, m: _clamp(x, None, m),
    "__getitem__": _getitem,
}
_TORCH = {k: v for k, v in _TORCH.items() if v is not None}


def _interval(lo: torch.Tensor, hi: torch.Tensor) -> _Range:
    return _Range(lo, hi)


def evaluate(fn, b: torch.Tensor, h: torch.Tensor, q_lo, q_hi, kv_lo, kv_hi):
    """``fn`` on intervals: ``b``, ``h`` exact, ``q_idx ∈ [q_lo, q_hi]``, ``kv_idx ∈ [kv_lo, kv_hi]``.

    Returns ``(surely, possibly)``: bool tensors broadcastable to the (b, h, q, kv) grid —
    True where every point attends / some point may attend. Raises :class:`Unsupported`
    when the mod does something the intervals do not follow (the caller evaluates points).
    """
    args = (_Range(b, b, exact=True), _Range(h, h, exact=True), _interval(q_lo, q_hi), _interval(kv_lo, kv_hi))
    with torch.no_grad():
        try:
            out = fn(*args)
        except Unsupported:
            raise
        except Exception as e:  # any failure on intervals: the points decide (and raise)
            raise Unsupported(f"{type(e).__name__}: {e}") from e
    if isinstance(out, bool):
        out = torch.tensor(out)
    if isinstance(out, torch.Tensor):
        if out.dtype != torch.bool:
            raise Unsupported("a non-bool result")
        return out, out
    if not isinstance(out, _Range) or out.kind != "bool":
        raise Unsupported("a non-bool result")
    return out.lo, out.hi
