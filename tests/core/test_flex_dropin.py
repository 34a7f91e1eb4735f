"""attnkit.flex_attention, a drop-in for torch's flex_attention: attention-gym's mask_mods and score_mods
give torch's own forward (float64), the gradients of float64 autograd through the dense formula, with
torch's and attnkit's BlockMasks; attnkit.attention takes a BlockMask; bad input is refused by name;
and a FlexAttention training script trains on the CPU by changing one import."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import budget
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, FlexKernelOptions
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

import attnkit
from attnkit import _blockmask, _flex_api

B, H, L, D = 2, 4, 300, 16
F64 = torch.float64
TOL = budget(F64, D, L)  # float64: both sides are exact to a few ulps of the rounding budget
pytestmark = [  # torch's own notices: its non-compiled flex_attention is unfused; TorchDynamo's import
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

# --- attention-gym's mask_mods, written here -------------------------------------------------------------
_DOC = torch.repeat_interleave(torch.arange(6), torch.tensor([40, 1, 90, 77, 12, 80]))  # packed: 300 ids
_LENGTHS = torch.tensor([300, 130])  # per-batch valid keys (padding)
_WINDOWS = torch.tensor([16, 32, 64, 300])  # one sliding window per head


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 48)


def prefix_lm(b, h, q, kv):
    return (kv <= q) | (kv < 70)


def document(b, h, q, kv):
    return (_DOC[q] == _DOC[kv]) & (q >= kv)


def dilated_sliding_window(b, h, q, kv):
    return ((q - kv).abs() <= 90) & ((q - kv) % 3 == 0)


def natten_2d(b, h, q, kv):  # 15 × 20 image, 5 × 5 neighbourhoods
    return (((q // 20) - (kv // 20)).abs() <= 2) & (((q % 20) - (kv % 20)).abs() <= 2)


def global_tokens(b, h, q, kv):  # Longformer-style: a few global tokens plus a band
    return (q < 8) | (kv < 8) | ((q - kv).abs() < 40)


def chunked_causal(b, h, q, kv):
    return (kv <= q) & (q // 64 == kv // 64)


def padding(b, h, q, kv):
    return kv < _LENGTHS[b]


def per_head_window(b, h, q, kv):
    return (q >= kv) & (q - kv < _WINDOWS[h])


def dead_rows(b, h, q, kv):  # the first 10 queries see nothing: output 0, lse -inf
    return (q >= kv) & (q >= 10)


MASK_MODS = {f.__name__: f for f in (causal, sliding_window, prefix_lm, document, dilated_sliding_window, natten_2d,
                                      global_tokens, chunked_causal, padding, per_head_window, dead_rows)}
_NEEDS_BH = {"padding", "per_head_window"}  # the block mask depends on the batch row / head


# --- attention-gym's score_mods -------------------------------------------------------------------------
_SLOPES = torch.tensor([2.0 ** -(i + 1) for i in range(H)], dtype=F64)


def softcap(score, b, h, q, kv):
    return 5.0 * torch.tanh(score / 5.0)


def relative_position(score, b, h, q, kv):
    return score + (q - kv) * 0.01


def alibi(score, b, h, q, kv):
    return score + _SLOPES[h] * (kv - q)


def _t5_bucket(rel, num_buckets=32, max_distance=128):
    """T5's bidirectional log buckets of the relative position ``kv - q``."""
    half = num_buckets // 2
    base = (rel > 0).long() * half
    n = rel.abs()
    exact = half // 2
    big = exact + (torch.log(n.double().clamp(min=1) / exact) / math.log(max_distance / exact)
                   * (half - exact)).long()
    return base + torch.where(n < exact, n, big.clamp(max=half - 1))


_T5 = torch.randn(H, 32, dtype=F64)


def t5_bias(score, b, h, q, kv):
    return score + _T5[h, _t5_bucket(kv - q)]


SCORE_MODS = {f.__name__: f for f in (softcap, relative_position, alibi, t5_bias)}


def _qkv(Hkv=H, Lq=L, S=L, Bkv=B, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, dtype=F64, generator=g)
    k = torch.randn(Bkv, Hkv, S, D, dtype=F64, generator=g)
    v = torch.randn(Bkv, Hkv, S, D, dtype=F64, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _dense(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """The formula in float64 with torch ops, differentiable: softmax(score_mod(q kᵀ·scale) masked) v."""
    Hq, Hkv = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    idx = [torch.arange(n).view(*(1 if j != i else n for j in range(4))) for i, n in enumerate(s.shape)]
    if score_mod is not None:
        s = score_mod(s, *idx)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(*idx).expand(s.shape), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row with no key: weights 0
    return p @ v, lse


def _close(a, b, tol, what):
    assert a.shape == b.shape, what
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin), f"{what}: infinities differ"
    err = (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= tol * max(1.0, b[fin].abs().max().item()), f"{what}: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("name", list(MASK_MODS))
def test_mask_mods_equal_torch_forward(name):
    mod = MASK_MODS[name]
    bh = (B, H) if name in _NEEDS_BH else (None, None)
    q, k, v = _qkv()
    theirs = torch_flex_attention(q, k, v, block_mask=torch_create_block_mask(mod, *bh, L, L, device="cpu",
                                                                             BLOCK_SIZE=64))
    for maker in (torch_create_block_mask, attnkit.create_block_mask):
        bm = maker(mod, *bh, L, L, device="cpu", BLOCK_SIZE=64)
        ours, aux = attnkit.flex_attention(q, k, v, block_mask=bm, return_aux=AuxRequest(lse=True))
        _close(ours, theirs, TOL, f"{name} via {maker.__module__}")
        ref, lse = _dense(q, k, v, mask_mod=mod)
        _close(ours, ref, TOL, name)
        _close(aux.lse, lse, TOL, f"{name} lse")
    if name == "dead_rows":
        assert torch.equal(ours[:, :, :10], torch.zeros_like(ours[:, :, :10]))
        assert torch.isneginf(aux.lse[:, :, :10]).all()


@pytest.mark.parametrize("mask", [None, "causal", "document"])
@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_score_mods_equal_torch_forward(name, mask):
    fn, mod = SCORE_MODS[name], MASK_MODS.get(mask)
    q, k, v = _qkv()
    bm = None if mod is None else torch_create_block_mask(mod, None, None, L, L, device="cpu")  # 128-blocks
    theirs = torch_flex_attention(q, k, v, score_mod=fn, block_mask=bm)
    ours = attnkit.flex_attention(q, k, v, score_mod=fn, block_mask=bm)
    _close(ours, theirs, TOL, f"{name} & {mask}")
    _close(ours, _dense(q, k, v, score_mod=fn, mask_mod=mod)[0], TOL, f"{name} & {mask}")


def test_gqa_unequal_lengths_scale_and_lse_equal_torch():
    Lq, S = 200, 330  # neither a multiple of the 128 block
    q, k, v = _qkv(Hkv=2, Lq=Lq, S=S)
    bm = torch_create_block_mask(sliding_window, None, None, Lq, S, device="cpu")
    kw = dict(score_mod=alibi, block_mask=bm, scale=0.3, enable_gqa=True)
    theirs, t_aux = torch_flex_attention(q, k, v, **kw, return_aux=AuxRequest(lse=True))
    ours, o_aux = attnkit.flex_attention(q, k, v, **kw, return_aux=AuxRequest(lse=True))
    _close(ours, theirs, TOL, "gqa out")
    _close(o_aux.lse, t_aux.lse, TOL, "gqa lse")  # natural log, as torch returns it
    assert o_aux.max_scores is None
    out2, lse2 = attnkit.flex_attention(q, k, v, **kw, return_lse=True)  # the older spelling
    assert torch.equal(out2, ours) and torch.equal(lse2, o_aux.lse)
    assert torch.equal(attnkit.flex_attention(q, k, v, **kw), ours)


def test_key_batch_of_one_broadcasts_as_in_torch():
    q, k, v = _qkv(Bkv=1)
    bm = torch_create_block_mask(padding, B, None, L, L, device="cpu")
    theirs = torch_flex_attention(q, k, v, block_mask=bm)
    _close(attnkit.flex_attention(q, k, v, block_mask=bm), theirs, TOL, "B_kv = 1")


def test_default_scale_is_one_over_sqrt_d():
    q, k, v = _qkv()
    _close(attnkit.flex_attention(q, k, v), _dense(q, k, v)[0], TOL, "default scale")
    _close(attnkit.flex_attention(q, k, v, scale=0.05), _dense(q, k, v, scale=0.05)[0], TOL, "scale")


# --- gradients: float64 autograd through the dense formula -------------------------------------------------
GRAD_CASES = {
    "causal": (causal, None),
    "document & softcap": (document, softcap),
    "dilated window & t5": (dilated_sliding_window, t5_bias),
    "padding & alibi": (padding, alibi),
    "per-head window & relative": (per_head_window, relative_position),
    "dead rows": (dead_rows, None),
    "no mask & softcap": (None, softcap),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradients_match_float64_autograd(name):
    mod, fn = GRAD_CASES[name]
    q, k, v = _qkv(Hkv=2, Lq=200, S=L, grad=True)
    bm = None if mod is None else attnkit.create_block_mask(mod, B, H, 200, L, BLOCK_SIZE=(32, 64))
    g = torch.randn(B, H, 200, D, dtype=F64)
    ours = attnkit.flex_attention(q, k, v, score_mod=fn, block_mask=bm, enable_gqa=True)
    ref = _dense(q, k, v, score_mod=fn, mask_mod=mod)[0]
    got = torch.autograd.grad(ours, (q, k, v), g)
    for a, b, n in zip(got, torch.autograd.grad(ref, (q, k, v), g), "qkv", strict=True):
        _close(a, b, 4 * TOL, f"{name}: d{n}")
    if name == "dead rows":  # queries that see no key: zero gradient
        assert torch.equal(got[0][:, :, :10], torch.zeros(B, H, 10, D, dtype=F64))


@pytest.mark.parametrize("name", ["document & softcap", "padding & alibi", "no mask & softcap"])
def test_float32_within_its_rounding_budget(name):
    """What training runs in: float32 inputs, output and gradients within the float32 budget of float64's."""
    mod, fn = GRAD_CASES[name]
    q, k, v = (t.float().requires_grad_() for t in _qkv(Hkv=2, Lq=200, S=L))
    bm = None if mod is None else torch_create_block_mask(mod, B, H, 200, L, device="cpu")
    g = torch.randn(B, H, 200, D, dtype=F64)
    ours = attnkit.flex_attention(q, k, v, score_mod=fn, block_mask=bm, enable_gqa=True)
    assert ours.dtype == torch.float32
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _dense(q64, k64, v64, score_mod=fn, mask_mod=mod)[0]
    tol = budget(torch.float32, D, L)
    _close(ours.double(), ref, tol, f"{name}: out")
    for a, b, n in zip(torch.autograd.grad(ours, (q, k, v), g.float()), torch.autograd.grad(ref, (q64, k64, v64), g),
                       "qkv", strict=True):
        _close(a.double(), b, 4 * tol, f"{name}: d{n}")


def test_learnable_bias_table_gets_its_gradient():
    """A score_mod reading a learnable table (relative-position bias, as in attention-gym): the table's
    gradient equals float64 autograd's."""
    table = torch.randn(H, 2 * L - 1, dtype=F64, requires_grad=True)

    def learned_bias(score, b, h, q, kv):
        return score + table[h, q - kv + L - 1]

    q, k, v = _qkv(grad=True)
    bm = torch_create_block_mask(causal, None, None, L, L, device="cpu")
    g = torch.randn(B, H, L, D, dtype=F64)
    ours = attnkit.flex_attention(q, k, v, score_mod=learned_bias, block_mask=bm)
    ref = _dense(q, k, v, score_mod=learned_bias, mask_mod=causal)[0]
    _close(ours, ref, TOL, "out")
    for a, b, n in zip(torch.autograd.grad(ours, (q, k, v, table), g), torch.autograd.grad(ref, (q, k, v, table), g),
                       ("q", "k", "v", "table"), strict=True):
        _close(a, b, 4 * TOL, f"d{n}")


def test_torch_itself_has_no_cpu_backward():
    """What attnkit offers: the same call with gradients, which torch's own refuses on the CPU."""
    q, k, v = _qkv(grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        torch_flex_attention(q, k, v).sum().backward()
    attnkit.flex_attention(q, k, v).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_torch_compile_of_it_runs_attnkit():
    """``flex_attention = torch.compile(flex_attention)``, a FlexAttention script's usual line, keeps
    working after the import change: torch.compile runs attnkit's function as it is, forward and backward,
    and a compiled module calling it too."""
    q, k, v = _qkv(Lq=128, S=128, grad=True)
    bm = attnkit.create_block_mask(causal, None, None, 128, 128)
    want = attnkit.flex_attention(q, k, v, score_mod=softcap, block_mask=bm)
    g = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), g)
    got = torch.compile(attnkit.flex_attention)(q, k, v, score_mod=softcap, block_mask=bm)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), want_grads, strict=True):
        assert torch.equal(a, b)

    class Attend(torch.nn.Module):
        def forward(self, x):
            y = torch.sin(x)
            return attnkit.flex_attention(y, k, v, score_mod=softcap, block_mask=bm)

    out = torch.compile(Attend())(q)
    _close(out, attnkit.flex_attention(torch.sin(q), k, v, score_mod=softcap, block_mask=bm), TOL, "compiled module")
    assert torch.autograd.grad(out, q, g)[0].abs().sum() > 0


# --- BlockMask semantics -----------------------------------------------------------------------------------
def test_blocks_count_as_in_flex_kernels():
    """A BlockMask assembled from blocks with no mask_mod: a block in neither list is skipped (what torch's
    compiled kernel does; torch's non-compiled CPU path evaluates mask_mod alone), a partial block with a
    mask_mod is that mod, a full block is attended whole."""
    Lq, S = 100, 130  # ragged edges, 64-blocks: 2 × 3
    q, k, v = _qkv(Lq=Lq, S=S)
    kv_num = torch.tensor([[[1, 2]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 1, 2], [2, 0, 1]]]], dtype=torch.int32)
    blocks = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=64, seq_lengths=(Lq, S))
    allowed = torch.zeros(Lq, S, dtype=torch.bool)
    allowed[:64, :64] = allowed[64:, 128:] = allowed[64:, :64] = True
    _close(attnkit.flex_attention(q, k, v, block_mask=blocks),
           _dense(q, k, v, mask_mod=lambda b, h, i, j: allowed[i, j])[0], TOL, "blocks, no mask_mod")
    # partial blocks with a mask_mod, one full block: full is attended whole even where the mod says no
    full_num = torch.tensor([[[0, 1]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[0, 1, 2], [1, 0, 2]]]], dtype=torch.int32)
    mixed = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=64, seq_lengths=(Lq, S),
                                     mask_mod=causal)
    want = (allowed & (torch.arange(Lq)[:, None] >= torch.arange(S))) | (
        (torch.arange(Lq)[:, None] >= 64) & (torch.arange(S) >= 64) & (torch.arange(S) < 128))
    _close(attnkit.flex_attention(q, k, v, block_mask=mixed),
           _dense(q, k, v, mask_mod=lambda b, h, i, j: want[i, j])[0], TOL, "full and partial blocks")


def test_tile_kinds_at_other_block_sizes_are_sound():
    """The BlockMask's kinds re-cut to other tiles (for an engine with its own tile size): a tile called
    EMPTY has nothing attended, FULL everything."""
    g = torch.Generator().manual_seed(3)
    for bmask_block, (Lq, S) in (((64, 32), (200, 150)), ((16, 128), (90, 300))):
        kinds = torch.randint(0, 3, (1, 2, math.ceil(Lq / bmask_block[0]), math.ceil(S / bmask_block[1])),
                              generator=g).to(torch.int8)
        m = _blockmask._BlockMaskMask(kinds, bmask_block, lambda b, h, i, j: (i + j) % 3 == 0)
        dense = m.materialize(1, 2, Lq, S)
        for bm, bn in ((32, 32), (48, 100), (7, 64), (200, 150)):
            t = m.tile_kinds(1, 2, Lq, S, bm, bn)
            for i in range(t.shape[-2]):
                for j in range(t.shape[-1]):
                    tile = dense[0, :, i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
                    for h in range(2):
                        if t[0, h, i, j] == 0:
                            assert not tile[h].any(), (bm, bn, i, j)
                        elif t[0, h, i, j] == 2:
                            assert tile[h].all(), (bm, bn, i, j)
        assert torch.equal(m.tile_kinds(1, 2, Lq, S, *bmask_block), kinds)


def test_attention_takes_a_block_mask():
    q, k, v = _qkv(Lq=200, S=L)
    bm = torch_create_block_mask(document, None, None, 200, L, device="cpu")
    want = attnkit.flex_attention(q, k, v, block_mask=bm)
    _close(attnkit.attention(q, k, v, mask=bm), want, TOL, "mask=BlockMask")
    _close(attnkit.attention(q, k, v, mask=bm, backend="eager"), want, TOL, "eager")
    both = attnkit.attention(q, k, v, mask=bm, causal=True)  # causal (bottom-right) on top of the block mask
    _close(both, _dense(q, k, v, mask_mod=lambda b, h, i, j: document(b, h, i, j) & (j <= i + L - 200))[0],
           TOL, "BlockMask & causal")
    assert "block_mask(document" in attnkit.dispatch(q, k, v, mask=bm).reason


# --- bad input -----------------------------------------------------------------------------------------------
def test_block_mask_sizes_that_disagree_name_both():
    q, k, v = _qkv()
    bm = torch_create_block_mask(causal, None, None, 256, L, device="cpu")
    for call in (lambda: attnkit.flex_attention(q, k, v, block_mask=bm), lambda: attnkit.attention(q, k, v, mask=bm)):
        with pytest.raises(ValueError, match=r"built for \(Q_LEN, KV_LEN\) = \(256, 300\).*\(L, S\) = \(300, 300\)"
                                             r".*create_block_mask\(mask_mod, B, H, 300, 300\)"):
            call()
    heads = torch_create_block_mask(causal, None, 3, L, L, device="cpu")
    with pytest.raises(ValueError, match=r"H=3.*H=4"):
        attnkit.flex_attention(q, k, v, block_mask=heads)


def test_gqa_needs_enable_gqa_as_in_torch():
    q, k, v = _qkv(Hkv=2)
    with pytest.raises(ValueError, match="Try setting enable_gqa=True"):
        torch_flex_attention(q, k, v)
    with pytest.raises(ValueError, match=r"enable_gqa: query has H=4 heads and key has Hkv=2.*enable_gqa=True"):
        attnkit.flex_attention(q, k, v)
    q3, k3, v3 = _qkv(Hkv=3)
    with pytest.raises(ValueError, match="divides H=4"):
        attnkit.flex_attention(q3, k3, v3, enable_gqa=True)


def test_other_bad_arguments():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="block_mask: expected a torch BlockMask"):
        attnkit.flex_attention(q, k, v, block_mask=causal)
    with pytest.raises(ValueError, match=r"query: expected a 4-D tensor.*unsqueeze\(0\)"):
        attnkit.flex_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="got both"):
        attnkit.flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))
    with pytest.raises(ValueError, match=r"max_scores=True.*AuxRequest\(lse=True\)"):
        attnkit.flex_attention(q, k, v, return_aux=AuxRequest(lse=True, max_scores=True))
    with pytest.raises(TypeError, match="return_aux: expected None or torch's AuxRequest"):
        attnkit.flex_attention(q, k, v, return_aux=True)
    with pytest.raises(ValueError, match="sliced BlockMask"):
        attnkit.flex_attention(q, k, v, block_mask=torch_create_block_mask(causal, B, None, L, L, device="cpu")[0])


def test_unknown_kernel_option_is_refused_by_name():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"kernel_options: unknown key 'BLOCK_SIZE_M'.*fix its spelling"):
        attnkit.flex_attention(q, k, v, kernel_options={"BLOCK_SIZE_M": 64})
    with pytest.raises(ValueError, match=r"OUTPUT_LOGSUMEXP.*internal"):
        attnkit.flex_attention(q, k, v, kernel_options={"OUTPUT_LOGSUMEXP": True})
    with pytest.raises(ValueError, match="BACKEND must be one of"):
        attnkit.flex_attention(q, k, v, kernel_options={"BACKEND": "CUTLASS"})
    with pytest.raises(TypeError, match="kernel_options: expected a dict"):
        attnkit.flex_attention(q, k, v, kernel_options=["BLOCK_M"])


def test_known_kernel_options_are_listed_in_one_warning_per_set(monkeypatch):
    monkeypatch.setattr(_flex_api, "_WARNED", set())
    q, k, v = _qkv()
    opts = {"BLOCK_M": 64, "fwd_num_stages": 2, "PRESCALE_QK": True, "ROWS_GUARANTEED_SAFE": True}
    with pytest.warns(UserWarning, match=r"kernel_options: attnkit ignores BLOCK_M, PRESCALE_QK, ROWS_GUARANTEED_SAFE, "
                                         r"fwd_num_stages.*PRESCALE_QK: torch's cheaper rounding"):
        out = attnkit.flex_attention(q, k, v, kernel_options=opts)
    _close(out, _dense(q, k, v)[0], TOL, "options change nothing")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same set again: silent
        attnkit.flex_attention(q, k, v, kernel_options=dict(opts))
    with pytest.warns(UserWarning, match="attnkit ignores BLOCK_N"):  # another set: its own warning
        attnkit.flex_attention(q, k, v, kernel_options={"BLOCK_N": 32})


def test_every_torch_kernel_option_is_decided():
    """A key torch adds to FlexKernelOptions must be decided here (ignored with a reason, or refused)."""
    assert set(FlexKernelOptions.__annotations__) <= set(_flex_api._KERNEL_OPTIONS)


# --- a FlexAttention training script, one import changed -------------------------------------------------
_SCRIPT = """
import torch
from torch.nn.attention.flex_attention import create_block_mask
from torch.nn.attention.flex_attention import flex_attention

torch.manual_seed(0)
V, L, E, H, N = 16, 64, 32, 4, 8
tokens = torch.randint(0, V, (N, L))
target = tokens.roll(1, dims=1)  # each position predicts the previous token: attention must find it


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


block_mask = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)
bias = torch.nn.Parameter(torch.zeros(H, 2 * L - 1))  # a learnable relative-position bias


def rel_bias(score, b, h, q_idx, kv_idx):
    return score + bias[h, q_idx - kv_idx + L - 1]


emb, qkv, out = torch.nn.Embedding(V, E), torch.nn.Linear(E, 3 * E), torch.nn.Linear(E, V)
opt = torch.optim.Adam([*emb.parameters(), *qkv.parameters(), *out.parameters(), bias], lr=3e-2)
losses = []
for step in range(25):
    q, k, v = qkv(emb(tokens)).view(N, L, 3, H, E // H).permute(2, 0, 3, 1, 4)
    y = flex_attention(q, k, v, score_mod=rel_bias, block_mask=block_mask)
    logits = out(y.transpose(1, 2).reshape(N, L, E))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
"""


@pytest.mark.slow
def test_flex_training_script_runs_on_cpu_by_changing_one_import():
    ours = _SCRIPT.replace("from torch.nn.attention.flex_attention import flex_attention",
                           "from attnkit import flex_attention")
    changed = [(a, b) for a, b in zip(_SCRIPT.splitlines(), ours.splitlines(), strict=True) if a != b]
    assert len(changed) == 1
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        exec(compile(_SCRIPT, "flex_script.py", "exec"), {})  # torch's own: no backward on the CPU
    ns: dict = {}
    exec(compile(ours, "flex_script.py", "exec"), ns)
    losses = ns["losses"]
    assert all(map(math.isfinite, losses))
    assert losses[-1] < 0.5 * losses[0], losses  # it learned: the previous token is found through attention
    assert ns["bias"].grad is not None and ns["bias"].grad.abs().sum() > 0  # the score_mod's table trained too


def test_a_block_masks_blocks_read_with_numpy_equal_the_torch_reading(monkeypatch):
    """Small block lists are read with NumPy, large ones with torch: the same dense map, for counts past the list,
    indices past the key blocks, negative (unused) entries, int32 and int64."""

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.int32, torch.int64):
        for Bb, Hb, nq, nk, K in ((1, 1, 1, 10, 10), (2, 3, 4, 7, 9), (1, 2, 5, 5, 3)):
            num = torch.randint(0, K + 2, (Bb, Hb, nq + 1), generator=g).to(dtype)
            idx = torch.randint(-1, nk + 3, (Bb, Hb, nq + 1, K), generator=g).to(dtype)
            small = _blockmask._dense(num, idx, nq, nk)
            monkeypatch.setattr(_blockmask, "_SMALL_BLOCKS", -1)
            large = _blockmask._dense(num, idx, nq, nk)
            monkeypatch.undo()
            assert small.dtype == torch.bool and small.shape == large.shape == (Bb, Hb, nq, nk)
            assert torch.equal(small, large), (dtype, Bb, Hb, nq, nk, K)


def test_block_orders_with_numpy_equal_the_torch_ordering(monkeypatch):
    """create_block_mask orders small block maps with NumPy's stable sort, large ones by counting in torch: the same
    (num, indices), int32, for random maps, all-wanted and none-wanted rows, transposed (non-contiguous) views."""
    from attnkit import plans

    g = torch.Generator().manual_seed(4)
    for shape in ((10,), (3, 10), (1, 1, 1, 10), (2, 3, 5, 7), (1, 2, 9, 1)):
        w = torch.rand(shape, generator=g) < 0.4
        if w.dim() > 1:
            w[..., 0, :] = True
        for m in (w,) if w.dim() < 2 else (w, w.transpose(-2, -1)):
            small = plans._ordered(m)
            monkeypatch.setattr(plans, "_SMALL_MAP", -1)
            large = plans._ordered(m)
            monkeypatch.undo()
            for a, b in zip(small, large, strict=True):
                assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), shape


def test_a_block_masks_points_looked_up_with_numpy_equal_the_torch_lookup():
    """A BlockMask's points at a decode step's few rows (its kinds looked up with NumPy) equal torch's lookup, for
    kinds per batch row and head, blocks 64 / 128, with a mod, without one, and a mod reading ``b`` and ``h``; a mod
    whose result is not bool gives the same result either way (checked later by the caller, as before)."""
    from attnkit.backends import native

    g = torch.Generator().manual_seed(5)
    mods = [None, lambda b, h, q, kv: kv <= q + 150, lambda b, h, q, kv: (kv + b + h) % 3 != 0,
            lambda b, h, q, kv: (kv % 2).to(torch.int32)]
    for Bb, Hb in ((1, 1), (2, 1), (1, 4), (2, 4)):
        for bs in (64, 128):
            for L, S in ((1, 300), (3, 257), (16, 64)):
                nq, nk = math.ceil(L / bs), math.ceil(S / bs)
                kinds = torch.randint(0, 3, (Bb, Hb, nq, nk), generator=g).to(torch.int8)
                for fn in mods:
                    m = _blockmask._BlockMaskMask(kinds, (bs, bs), fn)
                    assert m._kinds_np is not None
                    idx = (native._index(2, 0), native._index(4, 1), native._index(L, 2), native._index(S, 3))
                    fast = m.bind(L, S)(*idx)
                    m._kinds_np = None  # torch's lookup
                    slow = m.bind(L, S)(*idx)
                    assert fast.dtype == slow.dtype and torch.equal(fast.expand(slow.shape), slow), (Bb, Hb, bs, L, S)
                    assert native._indices_intact(max(L, S, 4))


@pytest.mark.parametrize("backend", ["auto", "tiled", "eager", "sdpa"])
@pytest.mark.parametrize("maker", [torch_create_block_mask, attnkit.create_block_mask], ids=["torch", "attnkit"])
def test_a_block_mask_of_one_head_runs_the_mod_at_every_head_inside_its_partial_blocks(maker, backend):
    """A BlockMask built with H=None over a mod that reads h (a window per head): its blocks are head 0's and
    inside a partial block the mod decides at the real head, as FlexAttention's kernels read it. The compiled
    kernel used head 0's points on every head (off by order 1 on heads 1-3). Here every block another head
    needs is partial for head 0, so the answer is the mod's everywhere: forward and gradients against float64."""
    windows = torch.tensor([8, 32, 100, 300])
    mod = lambda b, h, q, kv: (q >= kv) & (q - kv < windows[h])  # noqa: E731
    bm = maker(mod, None, None, 256, 256, device="cpu")
    q, k, v = (t.float().detach().requires_grad_() for t in _qkv(Lq=256, S=256))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every block another head needs is partial here: nothing to warn of
        out = attnkit.attention(q, k, v, mask=bm, backend=backend)
    ref, _ = _dense(*(t.detach().double().requires_grad_() for t in (q, k, v)), mask_mod=mod)
    tol = budget(torch.float32, D, 256)
    _close(out.double(), ref, tol, f"{backend} forward")
    g = torch.randn_like(ref)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(_dense(q64, k64, v64, mask_mod=mod)[0], (q64, k64, v64), g)
    got = torch.autograd.grad(out, (q, k, v), g.float())
    for a, b, n in zip(got, want, "qkv", strict=True):
        _close(a.double(), b, 4 * tol, f"{backend} d{n}")


def test_a_block_mask_of_one_batch_row_whose_other_rows_differ_is_warned_of_and_run_as_flex_kernels_do():
    """B=None over a padding mod: row 0's blocks are all full, so FlexAttention's kernels attend row 1's padded
    keys whole (torch's eager flex_attention, which evaluates the mod everywhere, disagrees). Every attnkit backend
    answers as the kernels do — and warns once, naming the fix, since that answer is not the mod's."""
    lengths = torch.tensor([256, 50])
    mod = lambda b, h, q, kv: kv < lengths[b]  # noqa: E731
    bm = torch_create_block_mask(mod, None, None, 256, 256, device="cpu")
    q, k, v = (t.float() for t in _qkv(Lq=256, S=256))
    as_blocks, _ = _dense(q.double(), k.double(), v.double())  # every block full for row 0: nothing masked
    for backend in ("auto", "tiled", "eager", "sdpa"):
        _blockmask._PLANS.clear()
        with pytest.warns(UserWarning, match=r"mask_mod reads b: 4 blocks .*create_block_mask\(mask_mod, 2, 4, "):
            out = attnkit.attention(q, k, v, mask=bm, backend=backend)
        _close(out.double(), as_blocks, budget(torch.float32, D, 256), backend)
    right = torch_create_block_mask(mod, 2, None, 256, 256, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = attnkit.attention(q, k, v, mask=right)
    _close(out.double(), _dense(q.double(), k.double(), v.double(), mask_mod=mod)[0], budget(torch.float32, D, 256),
           "built with B=2")
