"""attnkit.plan: the public block plan — tile kinds, reuse in attention, FlexAttention BlockMask."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, budget, golden, rand_qkv
from torch.nn.attention.flex_attention import create_block_mask

import attnkit
from attnkit import masks as M
from attnkit.plans import EMPTY, FULL, PARTIAL

L, S, B, H = 640, 700, 2, 3
IDS = torch.cat([torch.zeros(150), torch.ones(333), torch.full((217,), 2)]).long()
IDS2 = torch.stack([IDS, IDS.flip(0)])


def _cases():
    return {
        "causal": M.causal(),
        "causal top-left": M.causal("top_left"),
        "window 100": M.sliding_window(100),
        "prefix 200": M.prefix_lm(200),
        "chunked 100": M.chunked(100),
        "chunked 64 top-left": M.chunked(64, "top_left"),
        "padding": M.padding([700, 311]),
        "document (S,)": M.document(IDS),
        "document (B, S)": M.document(IDS2),
        "window & document": M.sliding_window(300) & M.document(IDS),
        "causal | prefix": M.causal() | M.prefix_lm(64),
        "~window": ~M.sliding_window(50),
        "from_mod band": M.from_mod(lambda b, h, q, kv: (q - kv).abs() <= 90),
        "from_mod per head": M.from_mod(lambda b, h, q, kv: (kv <= q + 60) & (kv >= h * 100)),
    }


def _dense_kinds(mask, bm, bn):
    """Tile kinds from the dense mask, the definition the closed forms must match or bound."""
    d = mask.materialize(B, H, L, S)
    nq, nk = -(-L // bm), -(-S // bn)
    out = torch.empty(B, H, nq, nk, dtype=torch.int8)
    for i in range(nq):
        for j in range(nk):
            t = d[:, :, i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            a, n = t.flatten(2).all(-1), t.flatten(2).any(-1)
            out[:, :, i, j] = torch.where(a, FULL, torch.where(n, PARTIAL, EMPTY)).to(torch.int8)
    return out


@pytest.mark.parametrize("name", list(_cases()))
def test_plan_kinds_are_exact_or_conservative(name):
    mask = _cases()[name]
    p = attnkit.plan(mask, L, S, B=B, H=H, block=(64, 128))
    want = _dense_kinds(mask, 64, 128)
    got = p.kinds.expand_as(want)
    # never wrong: an EMPTY tile has no visible entry, a FULL tile no hidden one
    assert not ((got == EMPTY) & (want != EMPTY)).any(), "a tile with visible entries would be skipped"
    assert not ((got == FULL) & (want != FULL)).any(), "a tile with masked entries would not be masked"
    if not name.startswith("~") and "&" not in name and "|" not in name:
        assert torch.equal(got, want), "closed forms of single masks are exact"


@pytest.mark.parametrize("name", list(_cases()))
def test_to_block_mask_equals_create_block_mask(name):
    mask = _cases()[name]
    mb = mask.batch_size
    bsz = mb if mb is not None else B
    ours = attnkit.plan(mask, L, S, B=bsz, H=H, block=(128, 128)).to_block_mask()
    theirs = create_block_mask(mask.flex_mask_mod(L, S), bsz, H, L, S, device="cpu", BLOCK_SIZE=128)
    for a, b in ((ours.kv_num_blocks, theirs.kv_num_blocks), (ours.full_kv_num_blocks, theirs.full_kv_num_blocks)):
        a, b = a.expand_as(b) if a.dim() == b.dim() else a, b
        assert torch.equal(a.expand_as(b), b), f"{name}: block counts differ"
    # the counts are equal (checked above): the first count indices of each row are the same set
    for idx_a, idx_b, num_b in ((ours.kv_indices, theirs.kv_indices, theirs.kv_num_blocks),
                                (ours.full_kv_indices, theirs.full_kv_indices, theirs.full_kv_num_blocks)):
        idx_a = idx_a.expand_as(idx_b)
        for pos in torch.cartesian_prod(*(torch.arange(n) for n in num_b.shape)).tolist():
            n = int(num_b[tuple(pos)])
            assert sorted(idx_a[tuple(pos)][:n].tolist()) == sorted(idx_b[tuple(pos)][:n].tolist()), (name, pos)


@pytest.mark.parametrize("name", ["causal", "window 100", "document (B, S)", "padding", "from_mod band"])
@pytest.mark.parametrize("backend", ["auto", "tiled", "eager"])
def test_attention_with_a_plan_equals_the_mask(name, backend):
    mask = _cases()[name]
    q, k, v = rand_qkv(B, H, H, L, S, 16)
    p = attnkit.plan(mask, L, S, B=B, H=H)
    ref, ref_lse = golden(q, k, v, mask=mask)
    out, lse = attnkit.attention(q, k, v, mask=p, return_lse=True, backend=backend)
    assert_close(out, ref, budget(torch.float32, 16, S), f"{name} {backend}")
    assert_close(lse, ref_lse, budget(torch.float32, 16, S), f"{name} {backend} lse")


def test_plan_with_causal_on_top():
    q, k, v = rand_qkv(1, 2, 2, 300, 300, 8)
    p = attnkit.plan(M.document(torch.arange(300) // 70), 300)
    ref, _ = golden(q, k, v, mask=M.document(torch.arange(300) // 70) & M.causal())
    assert_close(attnkit.attention(q, k, v, mask=p, causal=True, backend="tiled"), ref, budget(torch.float32, 8, 300))


def test_plan_is_immutable_and_checked():
    p = attnkit.plan(M.causal(), 128)
    with pytest.raises(AttributeError):
        p.L = 3
    k = p.kinds
    k.zero_()
    assert p.density > 0  # the copy changed, not the plan
    q, kk, v = rand_qkv(1, 1, 1, 64, 64, 8)
    with pytest.raises(ValueError, match="built for L=128, S=128"):
        attnkit.attention(q, kk, v, mask=p)
    pp = attnkit.plan(M.padding([100, 20]), 128)
    q, kk, v = rand_qkv(3, 1, 1, 128, 128, 8)
    with pytest.raises(ValueError, match="B=2"):
        attnkit.attention(q, kk, v, mask=pp)


def test_a_plan_whose_mask_data_was_edited_in_place_is_refused_by_every_backend():
    """A plan describes its mask as planned: after the tensor its mask_mod reads is edited in place, the tiles it
    holds are another mask's (here 4 documents' diagonal tiles for 16 documents). Every backend refuses it with the
    fix; planned again, the call matches float64 of the mod as it is now; restored, the old plan works again."""
    L = 256
    doc = torch.arange(L) // 64
    mod = lambda b, h, q, kv: doc[q] == doc[kv]  # noqa: E731
    p = attnkit.plan(mod, L=L)
    q, k, v = rand_qkv(1, 2, 2, L, L, 16)
    before = attnkit.attention(q, k, v, mask=p)
    doc.copy_(torch.arange(L) // 16)
    for backend in ("auto", "tiled", "eager", "reference"):
        with pytest.raises(ValueError, match=r"changed after attnkit.plan.*Plan again"):
            attnkit.attention(q, k, v, mask=p, backend=backend)
    s = (q.double() @ k.double().transpose(-1, -2)) * 16 ** -0.5
    s = s.masked_fill(doc.view(-1, 1) != doc.view(1, -1), float("-inf"))
    want = torch.softmax(s, -1) @ v.double()
    got = attnkit.attention(q, k, v, mask=attnkit.plan(mod, L=L))
    assert (got.double() - want).abs().max() < 1e-5
    doc.copy_(torch.arange(L) // 64)
    assert torch.equal(attnkit.attention(q, k, v, mask=p), before)


def test_a_plan_of_one_head_over_a_mod_that_reads_h_is_refused_at_more_heads_and_serves_a_mod_that_does_not():
    """attnkit.plan's H defaults to 1: its tiles are head 0's. Called with H = 2 over a window per head, the tiled
    paths skipped head 1's tiles (off by 0.6, gradients by 0.9) while eager followed the mod: now every backend
    refuses it with the fix. A mod that reads neither b nor h keeps serving any B and H (the common case)."""
    L = 256
    windows = torch.tensor([16, 200])
    per_head = lambda b, h, q, kv: (q >= kv) & (q - kv < windows[h])  # noqa: E731
    q, k, v = rand_qkv(2, 2, 2, L, L, 16)
    p = attnkit.plan(per_head, L=L)
    for backend in ("auto", "tiled", "eager", "sdpa", "reference"):
        with pytest.raises(ValueError, match=r"made for B=1, H=1 .* reads h .* attnkit.plan\(mask, L=256, S=256, "
                                             r"B=2, H=2\)"):
            attnkit.attention(q, k, v, mask=p, backend=backend)
    s = (q.double() @ k.double().transpose(-1, -2)) * 16 ** -0.5
    allowed = per_head(0, torch.arange(2).view(1, 2, 1, 1), torch.arange(L).view(-1, 1), torch.arange(L))
    want = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v.double()
    got = attnkit.attention(q, k, v, mask=attnkit.plan(per_head, L=L, H=2))
    assert (got.double() - want).abs().max() < 1e-5
    band = lambda b, h, q, kv: (q >= kv) & (q - kv < 40)  # noqa: E731
    got = attnkit.attention(q, k, v, mask=attnkit.plan(band, L=L))
    want = torch.softmax(s.masked_fill(~band(0, 0, torch.arange(L).view(-1, 1), torch.arange(L)), float("-inf")),
                         -1) @ v.double()
    assert (got.double() - want).abs().max() < 1e-5


def test_plan_draws_its_tiles():
    text = str(attnkit.plan(M.causal(), 256))
    assert text.splitlines()[-5:] == ["    k0 k1 k2 k3", "q0   P  .  .  .", "q1   F  P  .  .", "q2   F  F  P  .",
                                      "q3   F  F  F  P"]
    assert "10 of 16 computed (62.5%)" in text


def test_builtin_plan_never_evaluates_the_mask(monkeypatch):
    def boom(self, L, S):
        raise AssertionError("evaluated pointwise")

    for cls in (M.Causal, M.SlidingWindow, M.Document, M.Padding, M.PrefixLM):
        monkeypatch.setattr(cls, "bind", boom)
    m = M.sliding_window(4096) & M.document(torch.arange(131072) // 5000) & (M.prefix_lm(128) | M.causal())
    p = attnkit.plan(m, 131072, block=(128, 128))
    assert 0 < p.density < 0.1


@pytest.mark.parametrize("bad", [dict(block=(0, 64)), dict(block="x"), dict(B=0), dict(H=True)])
def test_plan_bad_arguments(bad):
    with pytest.raises(ValueError):
        attnkit.plan(M.causal(), 64, **bad)


@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("L,S_", [(1, 700), (3, 700), (16, 700), (640, 700)])
def test_key_span_covers_every_visible_key(name, L, S_):
    """The decode path hands SDPA only keys [j0, j1): every key some query sees must be inside."""
    mask = _cases()[name]
    if isinstance(mask, M.Document) or "document" in name:
        S_ = S  # the ids fix S
    Bm = mask.batch_size or 1
    d = mask.materialize(Bm, H, L, S_).flatten(0, 2).any(0)
    j0, j1 = mask.key_span(Bm, H, L, S_)
    nz = d.nonzero()
    if nz.numel():
        assert j0 <= int(nz[0]) and int(nz[-1]) < j1, (name, j0, j1, int(nz[0]), int(nz[-1]))


def test_print_reports_point_evaluated_tiles():
    builtin = attnkit.plan(M.causal(), 256, block=64)
    assert builtin.point_tiles == 0 and "0 point-evaluated" in str(builtin)
    mod = attnkit.plan(lambda b, h, q, kv: kv <= q, 256, block=64)
    assert torch.equal(mod.kinds, builtin.kinds)
    assert mod.point_tiles == 4 and "4 point-evaluated" in repr(mod)  # the 4 diagonal tiles only


def test_a_plan_is_copied_as_itself_and_pickles_as_its_parts():
    """copy.deepcopy of a model holding a plan (an EMA copy, a checkpoint) raised "a BlockPlan is immutable"."""
    import copy
    import pickle

    ids = torch.tensor([0] * 40 + [1] * 24)
    p = attnkit.plan(M.causal() & M.document(ids), 64, B=1, H=2, block=(16, 16))
    holder = torch.nn.Module()
    holder.plan = p
    assert copy.copy(p) is p and copy.deepcopy(p) is p and copy.deepcopy(holder).plan is p
    back = pickle.loads(pickle.dumps(p))
    assert (back.B, back.H, back.L, back.S, back.block) == (p.B, p.H, p.L, p.S, p.block)
    assert torch.equal(back.kinds, p.kinds) and repr(back.mask) == repr(p.mask)
    q = torch.randn(1, 2, 64, 16, dtype=torch.float64)
    torch.testing.assert_close(attnkit.attention(q, q, q, mask=back),
                               attnkit.attention(q, q, q, mask=M.causal() & M.document(ids), backend="eager"),
                               rtol=0, atol=1e-12)
