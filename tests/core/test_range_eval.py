"""Range evaluation of mask_mods (attnkit._ranges): never wrong, falls back on what it cannot follow.

The differential test draws random compositions of the attention-gym mods (causal, document,
prefix-LM, sliding and dilated windows, NATTEN 2-D neighbourhoods, global tokens, chunked,
per-batch lengths, per-head mods, arithmetic / where / min / max / abs) at awkward sizes and
block shapes, and requires the plan's tile kinds to equal the dense classification exactly.
"""

from __future__ import annotations

import random

import pytest
import torch

import attnkit
from attnkit import _ranges, _tiling
from attnkit import masks as M
from attnkit.plans import EMPTY, FULL, PARTIAL


def _dense_kinds(fn, B, H, L, S, bm, bn):
    """The definition: evaluate every point, reduce per tile."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(L).view(1, 1, L, 1)
    kv = torch.arange(S).view(1, 1, 1, S)
    allowed = fn(b, h, q, kv).expand(B, H, L, S)
    return _tiling.reduce_allowed(allowed, bm, bn)


# --- the mods: each maker draws its parameters and returns mod(b, h, q, kv) -----------------

def _ids(rng, n, monotone=True):
    ids = sorted(rng.randrange(0, max(2, n // 5)) for _ in range(n))
    if not monotone:
        rng.shuffle(ids)
    return torch.tensor(ids, dtype=torch.long)


def _causal(rng, B, H, L, S):
    off = rng.choice([0, S - L, rng.randint(-5, 5)])
    return lambda b, h, q, kv: kv <= q + off


def _document(rng, B, H, L, S):
    doc = _ids(rng, max(L, S), monotone=rng.random() < 0.8)
    return lambda b, h, q, kv: doc[q] == doc[kv]


def _document_batched(rng, B, H, L, S):
    doc = torch.stack([_ids(rng, max(L, S)) for _ in range(B)])
    return lambda b, h, q, kv: doc[b, q] == doc[b, kv]


def _prefix(rng, B, H, L, S):
    p = rng.randint(0, S)
    return lambda b, h, q, kv: (kv < p) | (kv <= q)


def _window(rng, B, H, L, S):
    w = rng.randint(1, 40)
    if rng.random() < 0.5:
        return lambda b, h, q, kv: (q - kv).abs() <= w
    return lambda b, h, q, kv: (kv <= q) & (q - kv < w)


def _dilated(rng, B, H, L, S):
    d, w = rng.randint(2, 5), rng.randint(4, 60)
    return lambda b, h, q, kv: ((q - kv) % d == 0) & ((q - kv).abs() <= w)


def _natten(rng, B, H, L, S):
    W, r = rng.randint(3, 12), rng.randint(0, 3)
    return lambda b, h, q, kv: (((q // W) - (kv // W)).abs() <= r) & (((q % W) - (kv % W)).abs() <= r)


def _global(rng, B, H, L, S):
    g = rng.randint(0, 8)
    return lambda b, h, q, kv: (q < g) | (kv < g)


def _chunked(rng, B, H, L, S):
    c = rng.randint(1, 50)
    return lambda b, h, q, kv: torch.div(q, c, rounding_mode="floor") == kv // c


def _lengths(rng, B, H, L, S):
    lengths = torch.tensor([rng.randint(0, S) for _ in range(B)])
    return lambda b, h, q, kv: kv < lengths[b]


def _per_head(rng, B, H, L, S):
    k = rng.randint(1, 30)
    return lambda b, h, q, kv: kv <= q - h * k


def _head_table(rng, B, H, L, S):
    tbl = torch.randint(-3, S + 3, (H, L))
    return lambda b, h, q, kv: tbl[h, q] >= kv


def _valid(rng, B, H, L, S):
    valid = torch.rand(B, S, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) < rng.random()
    return lambda b, h, q, kv: valid[b, kv]


def _where(rng, B, H, L, S):
    t, w = rng.randint(0, L), rng.randint(1, 20)
    return lambda b, h, q, kv: torch.where(q >= t, kv <= q, (kv - q).abs() < w)


def _minmax(rng, B, H, L, S):
    t = rng.randint(0, S)
    zero = torch.zeros((), dtype=torch.long)
    return lambda b, h, q, kv: (torch.minimum(q, kv) >= t) | (torch.maximum(q - t, zero) <= kv // 2)


def _arith(rng, B, H, L, S):
    a, c = rng.randint(-3, 3), rng.randint(-20, 20)
    return lambda b, h, q, kv: (q * a + c) // 3 - kv * 2 <= (q % 7) - c


def _clamp(rng, B, H, L, S):
    lo, hi = sorted((rng.randint(0, S), rng.randint(0, S)))
    return lambda b, h, q, kv: kv.clamp(lo, hi) == q.clamp(min=lo, max=hi)


def _neg_mod(rng, B, H, L, S):
    d = rng.choice([-5, -3, 2, 4])
    return lambda b, h, q, kv: ((q - kv) % d) != 0


def _float_table(rng, B, H, L, S):
    dtype = rng.choice([torch.float32, torch.float64])
    thr = torch.rand(S, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)), dtype=dtype)
    x = rng.random()
    if rng.random() < 0.5 and S > 1:
        x = float(thr[rng.randrange(S)])  # a constant equal to a value: the boundary case
    return lambda b, h, q, kv: (thr[kv] > x) & (kv <= q)


def _narrow_table(rng, B, H, L, S):
    # tables of narrow integer dtypes: their arithmetic wraps in the real evaluation
    dtype = rng.choice([torch.uint8, torch.int8, torch.int16, torch.int32])
    info = torch.iinfo(dtype)
    n = max(L, S)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if rng.random() < 0.5:
        tbl = torch.randint(info.min, info.max + 1, (n,), generator=g).to(dtype)
    else:
        tbl = (torch.arange(n) // rng.randint(1, 20)).clamp(max=info.max).to(dtype)
    c = rng.randint(-3, 3)
    return lambda b, h, q, kv: (tbl[q] + c) >= tbl[kv] * 2 - 1


def _python_if(rng, B, H, L, S):
    # Python control flow on an index: ranges must give up, points must decide
    def mod(b, h, q, kv):
        if (q > 1000).any():
            return kv <= q
        return kv >= q
    return mod


_MAKERS = [_causal, _document, _document_batched, _prefix, _window, _dilated, _natten, _global, _chunked,
           _lengths, _per_head, _head_table, _valid, _where, _minmax, _arith, _clamp, _neg_mod, _float_table,
           _narrow_table, _python_if]


def _compose(rng, B, H, L, S, depth=0):
    if depth >= 2 or rng.random() < 0.45:
        return rng.choice(_MAKERS)(rng, B, H, L, S)
    a = _compose(rng, B, H, L, S, depth + 1)
    op = rng.choice(["&", "|", "^", "~"])
    if op == "~":
        return lambda b, h, q, kv: ~a(b, h, q, kv)
    c = _compose(rng, B, H, L, S, depth + 1)
    if op == "&":
        return lambda b, h, q, kv: a(b, h, q, kv) & c(b, h, q, kv)
    if op == "|":
        return lambda b, h, q, kv: a(b, h, q, kv) | c(b, h, q, kv)
    return lambda b, h, q, kv: a(b, h, q, kv) ^ c(b, h, q, kv)


_SIZES = [1, 2, 7, 33, 64, 100, 129, 200, 257]
_BLOCKS = [(1, 1), (1, 8), (4, 8), (16, 16), (32, 8), (7, 13), (64, 64), (128, 16)]
_CASES = 4000


def test_range_plans_equal_the_dense_classification():
    """Zero tolerance: every tile kind equals the one from evaluating every point."""
    rng = random.Random(17)
    checked = ranged = 0
    for _ in range(_CASES):
        L, S = rng.choice(_SIZES), rng.choice(_SIZES)
        B, H = rng.choice([1, 2]), rng.choice([1, 3])
        bm, bn = rng.choice(_BLOCKS)
        fn = _compose(rng, B, H, L, S)
        want = _dense_kinds(fn, B, H, L, S, bm, bn)
        p = attnkit.plan(fn, L, S, B=B, H=H, block=(bm, bn))
        got = p.kinds
        shape = (B, H, -(-L // bm), -(-S // bn))
        assert torch.equal(got.expand(shape), want.expand(shape)), (L, S, B, H, bm, bn)
        ntiles = got.numel()
        assert 0 <= p.point_tiles <= ntiles
        ranged += p.point_tiles < ntiles
        checked += 1
    assert checked == _CASES
    assert ranged > _CASES // 2, f"range evaluation decided tiles in only {ranged} of {_CASES} cases"


@pytest.mark.parametrize("name, mod", [
    ("causal", lambda b, h, q, kv: kv <= q),
    ("window", lambda b, h, q, kv: (q - kv).abs() < 100),
    ("causal&window", lambda b, h, q, kv: (kv <= q) & (q - kv < 100)),
    ("prefix", lambda b, h, q, kv: (kv < 200) | (kv <= q)),
    ("chunked", lambda b, h, q, kv: (kv <= q) & (q // 128 == kv // 128)),
])
def test_point_tiles_equal_partial_tiles_for_gym_mods(name, mod):
    """Nothing decidable is left undecided: only the partial tiles had their points evaluated."""
    p = attnkit.plan(mod, 1000, block=(64, 32))
    assert p.point_tiles == int((p.kinds == PARTIAL).sum()) > 0
    assert "point-evaluated" in str(p)


def test_document_mod_matches_builtin_and_point_tiles_are_partial_tiles():
    doc = torch.repeat_interleave(torch.arange(6), torch.tensor([100, 1, 300, 64, 200, 335]))
    p_mod = attnkit.plan(lambda b, h, q, kv: doc[q] == doc[kv], 1000, block=64)
    p_builtin = attnkit.plan(M.document(doc), 1000, block=64)
    assert torch.equal(p_mod.kinds, p_builtin.kinds)
    assert p_mod.point_tiles == int((p_mod.kinds == PARTIAL).sum())
    assert p_builtin.point_tiles == 0


@pytest.mark.parametrize("mod", [
    lambda b, h, q, kv: kv <= q if bool((q < 3).all()) else kv >= q,       # bool() of an interval
    lambda b, h, q, kv: kv <= q + int(q.max().item()) * 0,                   # .item()
    lambda b, h, q, kv: torch.sigmoid(q.float() - kv.float()) > 0.5,         # a function not followed
    lambda b, h, q, kv: (q / 2) >= kv,                                       # true division
    lambda b, h, q, kv: (q & 3) == (kv & 3),                                 # integer bitwise
    lambda b, h, q, kv: q.view(-1, 1).expand(q.shape[-2], 1).view(1, 1, -1, 1) >= kv,  # shape tricks
])
def test_what_ranges_cannot_follow_falls_back_to_every_point(mod):
    L, S, bm, bn = 37, 45, 8, 16
    want = _dense_kinds(mod, 1, 1, L, S, bm, bn)
    p = attnkit.plan(mod, L, S, block=(bm, bn))
    assert torch.equal(p.kinds, want.expand_as(p.kinds))
    assert p.point_tiles == p.kinds.numel(), "a mod the ranges cannot follow is evaluated at every point"


def test_unsupported_is_raised_not_guessed():
    lo, hi = torch.tensor([0, 5]).view(1, 1, 2, 1), torch.tensor([4, 9]).view(1, 1, 2, 1)
    z = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    with pytest.raises(_ranges.Unsupported):
        _ranges.evaluate(lambda b, h, q, kv: kv <= q if q > 2 else kv > q, z, z, lo, hi, lo.view(1, 1, 1, 2),
                         hi.view(1, 1, 1, 2))
    with pytest.raises(_ranges.Unsupported):
        _ranges.evaluate(lambda b, h, q, kv: torch.exp(q) > kv, z, z, lo, hi, lo.view(1, 1, 1, 2), hi.view(1, 1, 1, 2))
    # a captured tensor of several values used elementwise would pair by position with the tile
    # grid (2 key blocks here), not the key grid: refused, even where the shapes happen to broadcast
    vec = torch.tensor([True, False]).view(1, 1, 1, 2)
    with pytest.raises(_ranges.Unsupported):
        _ranges.evaluate(lambda b, h, q, kv: vec & (kv <= q), z, z, lo, hi, lo.view(1, 1, 1, 2), hi.view(1, 1, 1, 2))


def _brute(op, a, b):
    vals = [op(torch.tensor(x), torch.tensor(y)) for x in range(a[0], a[1] + 1) for y in range(b[0], b[1] + 1)]
    return min(int(v) for v in vals), max(int(v) for v in vals)


@pytest.mark.parametrize("opname", ["add", "sub", "mul", "floordiv", "mod", "trunc", "min", "max"])
def test_interval_arithmetic_contains_every_value(opname):
    """Sound on random integer intervals (divisors of one sign), and exact on singletons."""
    ops = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
           "floordiv": lambda x, y: x // y, "mod": lambda x, y: x % y,
           "trunc": lambda x, y: torch.div(x, y, rounding_mode="trunc"),
           "min": torch.minimum, "max": torch.maximum}
    op = ops[opname]
    rng = random.Random(5)
    for _ in range(150):
        a0 = rng.randint(-20, 20)
        a = (a0, a0 + rng.choice([0, 0, 1, 3, 9, 25]))
        if opname in ("floordiv", "mod", "trunc"):
            d0 = rng.randint(1, 7)
            b = (d0, d0 + rng.choice([0, 0, 2])) if rng.random() < 0.5 else (-d0 - rng.choice([0, 2]), -d0)
        else:
            b0 = rng.randint(-20, 20)
            b = (b0, b0 + rng.choice([0, 2, 7]))
        ra = _ranges._Range(torch.tensor(a[0]), torch.tensor(a[1]))
        rb = _ranges._Range(torch.tensor(b[0]), torch.tensor(b[1]))
        out = op(ra, rb)
        lo, hi = _brute(op, a, b)
        assert int(out.lo) <= lo and hi <= int(out.hi), (opname, a, b, (int(out.lo), int(out.hi)), (lo, hi))
        if a[0] == a[1] and b[0] == b[1]:
            assert (int(out.lo), int(out.hi)) == (lo, hi)


def test_interval_abs_neg_and_comparisons():
    for a in [(-5, -2), (-3, 4), (0, 6), (2, 2)]:
        r = _ranges._Range(torch.tensor(a[0]), torch.tensor(a[1]))
        vals = range(a[0], a[1] + 1)
        assert (int(abs(r).lo), int(abs(r).hi)) == (min(abs(v) for v in vals), max(abs(v) for v in vals))
        assert (int((-r).lo), int((-r).hi)) == (-a[1], -a[0])
        for c in (-4, 0, 2, 5):
            lt = r < c
            assert bool(lt.lo) == all(v < c for v in vals) and bool(lt.hi) == any(v < c for v in vals)
            eq = r == c
            assert bool(eq.lo) == all(v == c for v in vals) and bool(eq.hi) == any(v == c for v in vals)


def test_minmax_table_matches_brute_force_and_is_rebuilt_when_content_changes():
    g = torch.Generator().manual_seed(3)
    t = torch.randint(-50, 50, (3, 300), generator=g)
    tab = _ranges.minmax_table(t, 1)
    lo = torch.randint(0, 300, (400,), generator=g)
    hi = (lo + torch.randint(0, 120, (400,), generator=g)).clamp(max=299)
    row = torch.randint(0, 3, (400,), generator=g)
    mn, mx = tab.query([row], lo, hi)
    for i in range(400):
        seg = t[row[i], lo[i]:hi[i] + 1]
        same_chunk = int(lo[i]) // tab._C == int(hi[i]) // tab._C
        assert int(mn[i]) <= int(seg.min()) and int(mx[i]) >= int(seg.max())
        if not same_chunk:
            assert (int(mn[i]), int(mx[i])) == (int(seg.min()), int(seg.max()))
    assert _ranges.minmax_table(t, 1) is tab, "unchanged content: the table is reused"
    t[1, 7] = 1000
    assert _ranges.minmax_table(t, 1) is not tab, "changed content: the table is rebuilt"


def test_data_reading_mod_is_planned_afresh_with_new_data():
    doc = torch.repeat_interleave(torch.arange(4), 64)
    mod = lambda b, h, q, kv: doc[q] == doc[kv]  # noqa: E731 - a user's mask_mod
    first = attnkit.plan(mod, 256, block=32).kinds
    doc[:] = torch.repeat_interleave(torch.arange(2), 128)  # the next batch, in place
    second = attnkit.plan(mod, 256, block=32).kinds
    assert not torch.equal(first, second)
    assert torch.equal(second, attnkit.plan(M.document(doc.clone()), 256, block=32).kinds)


def test_per_batch_and_per_head_kinds_keep_their_dims():
    lengths = torch.tensor([100, 7])
    p = attnkit.plan(lambda b, h, q, kv: kv < lengths[b], 128, B=2, H=3, block=32)
    assert p.kinds.shape == (2, 1, 4, 4)
    assert p.kinds[1, 0, 0].tolist() == [PARTIAL, EMPTY, EMPTY, EMPTY]
    assert p.kinds[0, 0, 0].tolist() == [FULL, FULL, FULL, PARTIAL]
    p = attnkit.plan(lambda b, h, q, kv: kv <= q - h * 40, 128, B=2, H=3, block=32)
    assert p.kinds.shape == (1, 3, 4, 4)


def test_python_float_constants_keep_float64_precision():
    # 0.1 in float32 is 0.100000001490116...; a float64 table value between the two must
    # compare as in the real evaluation (float64), not against a float32-rounded constant
    thr = torch.tensor([0.1000000005] * 64, dtype=torch.float64)
    mod = lambda b, h, q, kv: (thr[kv] > 0.1) & (kv <= q)  # noqa: E731 - a user's mask_mod
    p = attnkit.plan(mod, 64, block=16)
    assert torch.equal(p.kinds, _dense_kinds(mod, 1, 1, 64, 64, 16, 16).expand_as(p.kinds))
    assert p.point_tiles < p.kinds.numel()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_narrow_integer_tables_follow_their_wraparound(dtype):
    """uint8 0 - 1 is 255 in the real evaluation: an interval [-1, ...] would be wrong, so such
    arithmetic is refused (points decide); arithmetic that cannot wrap keeps its ranges."""
    info = torch.iinfo(dtype)
    tbl = torch.tensor([info.min, 0, 1, info.max] * 16, dtype=dtype)
    wraps = lambda b, h, q, kv: (tbl[kv] - 1) < (tbl[q] + 1)  # noqa: E731 - a user's mask_mod
    p = attnkit.plan(wraps, 64, block=8)
    assert torch.equal(p.kinds, _dense_kinds(wraps, 1, 1, 64, 64, 8, 8).expand_as(p.kinds))
    small = (torch.arange(64) // 16).to(dtype)
    safe = lambda b, h, q, kv: (small[kv] + 1) <= small[q] * 2  # noqa: E731 - a user's mask_mod
    p = attnkit.plan(safe, 64, block=8)
    assert torch.equal(p.kinds, _dense_kinds(safe, 1, 1, 64, 64, 8, 8).expand_as(p.kinds))
    assert p.point_tiles < p.kinds.numel()


def test_huge_constants_are_refused():
    mod = lambda b, h, q, kv: (q + (1 << 62)) - (1 << 62) >= kv  # noqa: E731 - a user's mask_mod
    p = attnkit.plan(mod, 40, block=8)
    assert torch.equal(p.kinds, _dense_kinds(mod, 1, 1, 40, 40, 8, 8).expand_as(p.kinds))
