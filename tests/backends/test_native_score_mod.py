"""score_mods on attnkit's compiled kernel: traced into programs (``attnkit._scoreprog``), forward and backward.

attention-gym's score_mods, written as users write them (lambdas and closures over captured tensors),
run on the kernel (``dispatch`` names the program) and match the float64 golden: output, lse and the
gradients of q, k, v, with interval masks and tile maps, GQA, L != S, dead rows, every instruction set.
Each refusal of the tracer has a test: the call then runs where it ran before, exactly, and ``dispatch``
names the operation that kept it off the kernel.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from _flashmask import families
from conftest import rand_qkv
from test_native_kernel import _check, instruction_set

import attnkit
from attnkit import _scoreprog
from attnkit import masks as M
from attnkit import score_mods as SM
from attnkit.backends import _native

pytestmark = pytest.mark.skipif(os.environ.get("ATTNKIT_NATIVE", "1").lower() in ("0", "off", "false", "no"),
                                reason="the compiled kernel is switched off by ATTNKIT_NATIVE=0")


def _t5_buckets(num_buckets=32, max_distance=128, bidirectional=True):
    """T5's relative-position buckets (exact below num_buckets / 2, log-spaced above) and a bias per head."""
    table = torch.randn(4, num_buckets)

    def t5(score, b, h, q_idx, kv_idx):
        rel = kv_idx - q_idx
        nb = num_buckets // 2 if bidirectional else num_buckets
        ret = (rel > 0).long() * nb if bidirectional else torch.zeros_like(rel)
        n = rel.abs() if bidirectional else (-rel).clamp(min=0)
        max_exact = nb // 2
        is_small = n < max_exact
        large = max_exact + (torch.log(n.float() / max_exact + 1e-6) / math.log(max_distance / max_exact)
                             * (nb - max_exact)).to(torch.long)
        large = torch.minimum(large, torch.full_like(large, nb - 1)) if isinstance(large, torch.Tensor) \
            else large.clamp(max=nb - 1)
        bucket = ret + torch.where(is_small, n, large)
        return score + table[h, bucket]

    return t5


def gym_score_mods(H=4, L=300):
    slopes = attnkit.positional.alibi_slopes(H)
    rel_table = torch.randn(H, 2 * L + 1)
    doc = torch.tensor([0] * (L // 3) + [1] * (L - L // 3))
    doc_bias = torch.randn(2)
    head_scale = torch.rand(H) + 0.5
    return {
        "softcap": lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0),
        "softcap_builtin": SM.softcap(5.0),
        "relative_position": lambda s, b, h, q, kv: s + (q - kv) * 0.05,
        "alibi_lambda": lambda s, b, h, q, kv: s + slopes[h] * (kv - q),
        "relative_table": lambda s, b, h, q, kv: s + rel_table[h, kv - q + L],
        "t5_buckets": _t5_buckets(),
        "document_bias": lambda s, b, h, q, kv: s + doc_bias[doc[kv]] * (doc[q] == doc[kv]),
        "head_scale_where": lambda s, b, h, q, kv: torch.where(q >= kv, s * head_scale[h], s - 1.0),
        "abs_sign_floor": lambda s, b, h, q, kv: s - ((q - kv).abs() // 16).float() * 0.1 + torch.sign(s) * 0.01
        + torch.floor(s * 3.0) * 0.001,
        "exp_log": lambda s, b, h, q, kv: s + torch.log1p(torch.exp(-s.abs())) - torch.log((q - kv).abs() + 2.0),
        "clamp_minmax": lambda s, b, h, q, kv: torch.clamp(s, -2.0, 2.0) + torch.maximum(s, 0.5 * s)
        - torch.minimum(s, s * 0.25),
        "integer_result": lambda s, b, h, q, kv: s + ((q + kv) % 3 == 0),
        "bool_mask_as_score": lambda s, b, h, q, kv: torch.where((q - kv) % 7 == 0, s - 30.0, s),
    }


MODS = gym_score_mods()
SIZES = [(1, 1), (130, 97), (97, 300)]


@pytest.mark.parametrize("name", sorted(MODS))
@pytest.mark.parametrize("L,S", SIZES, ids=[f"L{L}_S{S}" for L, S in SIZES])
def test_gym_score_mod_on_the_kernel_matches_float64(name, L, S):
    mod = MODS[name]
    q, k, v = rand_qkv(2, 4, 2, L, S, 24, 40, requires_grad=True)
    for mask in (M.causal(), None):
        d = attnkit.dispatch(q, k, v, mask=mask, score_mod=mod, backend="tiled")
        assert d.worker == "native" and "program" in d.worker_reason, d
        _check(q, k, v, mask, score_mod=mod, lse_grad=True)


def test_score_mods_with_tile_maps_and_heads():
    fams = families(200, H=4, seed=4)
    q, k, v = rand_qkv(2, 4, 2, 200, 200, 32, requires_grad=True)
    for mask_name in ("share_question", "random_eviction"):
        for name in ("softcap", "t5_buckets", "document_bias"):
            mask = M.from_mod(fams[mask_name][0])
            d = attnkit.dispatch(q, k, v, mask=mask, score_mod=MODS[name], backend="tiled")
            assert d.worker == "native" and "tile map" in d.worker_reason and "program" in d.worker_reason, d
            _check(q, k, v, mask, score_mod=MODS[name], lse_grad=True)


def test_dead_rows_and_bottom_right_causal():
    q, k, v = rand_qkv(1, 2, 1, 150, 60, 16, requires_grad=True)
    _check(q, k, v, M.causal(), score_mod=MODS["softcap"])
    _check(q, k, v, M.padding([0]), score_mod=MODS["relative_position"])


@pytest.mark.parametrize("isa", ["base", "avx2", "avx512"])
def test_every_instruction_set(isa):
    with instruction_set(isa):
        for name in ("softcap", "t5_buckets", "exp_log", "clamp_minmax"):
            q, k, v = rand_qkv(2, 4, 2, 130, 97, 24, 40, requires_grad=True)
            _check(q, k, v, M.causal(), score_mod=MODS[name], lse_grad=True)


def test_a_captured_tensor_edited_in_place_gives_a_new_program():
    bias = torch.zeros(4)
    mod = lambda s, b, h, q, kv: s + bias[h]  # noqa: E731
    q, k, v = rand_qkv(1, 4, 2, 70, 70, 16, requires_grad=True)
    _check(q, k, v, M.causal(), score_mod=mod)
    bias[:] = torch.tensor([3.0, -2.0, 1.0, 0.5])
    _check(q, k, v, M.causal(), score_mod=mod)


# ---- refusals: each keeps the call on its old path (exact), and dispatch names why --------------

def _refused(mod, why, **kw):
    q, k, v = rand_qkv(1, 2, 2, 70, 70, 16, requires_grad=True)
    d = attnkit.dispatch(q, k, v, mask=M.causal(), score_mod=mod, backend="tiled", **kw)
    assert d.worker != "native" and why in d.worker_reason, d
    _check_off_kernel(q, k, v, mod)


def _check_off_kernel(q, k, v, mod):
    from conftest import assert_close, budget, golden
    out = attnkit.attention(q, k, v, mask=M.causal(), score_mod=mod, backend="tiled")
    ref, _ = golden(q, k, v, mask=M.causal(), score_mod=mod)
    assert_close(out, ref, budget(torch.float32, 16, 70), "out")


def test_refuses_python_control_flow():
    """(Such a mod fails on torch's broadcasting evaluation too; the tracer refuses it before.)"""
    with pytest.raises(_scoreprog.Refused, match="Python control flow"):
        _scoreprog.compile_score_mod(lambda s, b, h, q, kv: s * 2 if q > 3 else s, 1, 2, 50, 50)
    with pytest.raises(_scoreprog.Refused, match=r"\.any\(\)"):
        _scoreprog.compile_score_mod(lambda s, b, h, q, kv: s * 2 if (q > 3).any() else s, 1, 2, 50, 50)


def test_refuses_an_unlisted_torch_function():
    _refused(lambda s, b, h, q, kv: s + torch.sin(s), "torch.sin")


def _learned_grads(mod, leaves, L=150, mask=None):
    mask = M.causal() if mask is None else mask
    q, k, v = rand_qkv(2, 4, 2, L, L, 32, requires_grad=True)
    out = attnkit.attention(q, k, v, mask=mask, score_mod=mod, backend="tiled")
    go = torch.randn_like(out)
    got = torch.autograd.grad((out * go).sum(), (q, k, v, *leaves))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attnkit.attention(qd, kd, vd, mask=mask, score_mod=mod, backend="eager")
    want = torch.autograd.grad((ref * go.double()).sum(), (qd, kd, vd, *leaves))
    from conftest import assert_close, budget
    tol = budget(torch.float32, 32, L)
    for name, a, b in zip(["dq", "dk", "dv"] + [f"table{i}" for i in range(len(leaves))], got, want, strict=True):
        assert_close(a, b, 4 * tol * max(1.0, b.abs().max().item()), name)


def test_learnable_tables_get_their_gradients_from_the_kernel():
    """A relative-position table, learned ALiBi slopes and a per-head scale that require grad: the kernel
    accumulates their gradients (per work item, added in item order) and they match float64 autograd."""
    L = 150
    table = torch.randn(4, 2 * L + 1, requires_grad=True)
    slopes = attnkit.positional.alibi_slopes(4).clone().requires_grad_()
    scale = (torch.rand(4) + 0.5).requires_grad_()
    cases = [
        (lambda s, b, h, q, kv: s + table[h, kv - q + L], [table]),
        (SM.alibi(slopes), [slopes]),
        (lambda s, b, h, q, kv: torch.tanh(s * scale[h]) * 3.0 + table[h, kv - q + L] * scale[h], [table, scale]),
    ]
    for mod, leaves in cases:
        q, k, v = rand_qkv(1, 4, 2, L, L, 32, requires_grad=True)
        d = attnkit.dispatch(q, k, v, mask=M.causal(), score_mod=mod, backend="tiled")
        assert d.worker == "native" and "program" in d.worker_reason, d
        _learned_grads(mod, leaves)
    fam = families(L, H=4, seed=1)["share_question"][0]
    _learned_grads(cases[0][0], [table], mask=M.from_mod(fam))


def test_a_no_grad_pass_leaves_no_program_without_gradients_for_training():
    """A validation pass under ``torch.no_grad()`` traces the mod with no gradient slots; the training call after
    it (the same mod, the same table) must get its own program: on the kernel, with the table's gradient."""
    L = 130
    table = torch.nn.Parameter(torch.randn(2 * L) * 0.1)
    mod = lambda s, b, h, q, kv: s + table[q - kv + L]  # noqa: E731
    q, k, v = rand_qkv(2, 4, 2, L, L, 32, requires_grad=True)  # _learned_grads' call
    with torch.no_grad():
        attnkit.attention(q, k, v, mask=M.causal(), score_mod=mod, backend="tiled")
    d = attnkit.dispatch(q, k, v, mask=M.causal(), score_mod=mod, backend="tiled")
    assert d.worker == "native" and "program" in d.worker_reason, d
    _learned_grads(mod, [table], L=L)


def test_refuses_a_learnable_tensor_copied_inside_the_score_mod():
    """A copy made inside the mod (``table.double()``) is not the tensor autograd routes to: refused, and the
    plain worker returns the gradient."""
    table = torch.randn(2, requires_grad=True)
    mod = lambda s, b, h, q, kv: s + table.double()[h].float()  # noqa: E731
    q, k, v = rand_qkv(1, 2, 2, 70, 70, 16, requires_grad=True)
    d = attnkit.dispatch(q, k, v, mask=M.causal(), score_mod=mod, backend="tiled")
    assert d.worker == "plain" and "not read as a table" in d.worker_reason, d
    out = attnkit.attention(q, k, v, mask=M.causal(), score_mod=mod, backend="tiled")
    (g,) = torch.autograd.grad(out.sum(), (table,))
    t2 = table.detach().double().requires_grad_()
    r = attnkit.attention(q.double(), k.double(), v.double(), mask=M.causal(),
                          score_mod=lambda s, b, h, q_, kv: s + t2[h], backend="eager")
    (g2,) = torch.autograd.grad(r.sum(), (t2,))
    assert torch.allclose(g.double(), g2, atol=1e-4)


def test_refuses_an_integer_that_may_leave_int32():
    with pytest.raises(_scoreprog.Refused, match="int32"):
        _scoreprog.compile_score_mod(lambda s, b, h, q, kv: s + (q * kv) % 7, 1, 1, 70000, 70000)


def test_an_index_out_of_range_raises_index_error_as_torch_does():
    """Ranges cannot prove every index in bounds (T5's buckets are clamped by a where); the kernel then checks
    each read: out of range at a point of the call, attention raises IndexError, as torch's indexing does."""
    t = torch.randn(10)
    mod = lambda s, b, h, q, kv: s + t[q]  # noqa: E731
    q, k, v = rand_qkv(1, 2, 2, 70, 70, 16)
    assert attnkit.dispatch(q, k, v, mask=M.causal(), score_mod=mod, backend="tiled").worker == "native"
    with pytest.raises(IndexError, match=r"shape \(10,\)"):
        attnkit.attention(q, k, v, mask=M.causal(), score_mod=mod, backend="tiled")
    with pytest.raises(IndexError):
        attnkit.attention(q, k, v, mask=M.causal(), score_mod=mod, backend="eager")
    with pytest.raises(_scoreprog.Refused, match="computed from the score"):
        _scoreprog.compile_score_mod(lambda s, b, h, q, kv: s + t[(s * 0).long().clamp(0, 9)], 1, 2, 50, 50)


def test_refuses_a_tensor_on_another_device():
    t = torch.empty(4, device="meta")
    with pytest.raises(_scoreprog.Refused, match="meta"):
        _scoreprog.compile_score_mod(lambda s, b, h, q, kv: s + t[h], 1, 2, 8, 8)


def test_refuses_float_indexing_and_bitwise_integer_logic():
    t = torch.randn(100)
    with pytest.raises(_scoreprog.Refused, match="float"):
        _scoreprog.compile_score_mod(lambda s, b, h, q, kv: s + t[(q * 0.5)], 1, 2, 50, 50)
    _refused(lambda s, b, h, q, kv: s + ((q & kv) == 0), "bitwise")


def test_refuses_a_tensor_used_whole_and_indexing_the_score():
    """A captured tensor must be read at indices (w[kv]); a 0-d result of a captured tensor is a constant."""
    w = torch.randn(70)
    with pytest.raises(_scoreprog.Refused, match="used whole"):
        _scoreprog.compile_score_mod(lambda s, b, h, q, kv: s + w, 1, 2, 50, 70)
    with pytest.raises(_scoreprog.Refused, match="indexing a traced value"):
        _scoreprog.compile_score_mod(lambda s, b, h, q, kv: s[..., 0], 1, 2, 50, 50)
    assert _scoreprog.compile_score_mod(lambda s, b, h, q, kv: s + w.sum(), 1, 2, 50, 50).ops[-1] == "add"


def test_an_exception_inside_the_mod_while_tracing_keeps_the_old_path():
    def picky(s, b, h, q, kv):
        if not isinstance(q, torch.Tensor):
            raise RuntimeError("I only take tensors")
        return s + q
    _refused(picky, "I only take tensors")


def test_bad_score_mods_raise_the_same_errors_as_before():
    q, k, v = rand_qkv(1, 2, 2, 40, 40, 16)
    with pytest.raises(TypeError, match="must return a tensor"):
        attnkit.attention(q, k, v, score_mod=lambda s, b, h, q, kv: None, causal=True)
    with pytest.raises(ValueError, match="does not broadcast to the grid"):
        attnkit.attention(q, k, v, score_mod=lambda s, b, h, q, kv: s[..., :3], causal=True)
    out = attnkit.attention(q, k, v, score_mod=lambda s, b, h, q_, kv: s * float("nan"), causal=True,
                            backend="tiled")
    assert torch.isnan(out).all(), "NaN from a score_mod propagates, as on every path"


def test_a_cached_program_never_sees_later_edits_of_the_tensor_it_was_traced_from():
    """The program keeps a copy of each table: a program cached for one tensor's content is reused for another
    tensor with that content (same code), and must not carry the first tensor's later in-place edits."""
    def make(bias):
        return lambda s, b, h, q, kv: s + bias[kv]

    first = torch.zeros(70)
    q, k, v = rand_qkv(1, 2, 2, 1, 70, 16)
    _check(q, k, v, None, score_mod=make(first))
    first.copy_(torch.linspace(-3, 3, 70))  # the cached program's key is the zeros it was traced from
    _check(q, k, v, None, score_mod=make(torch.zeros(70)))


def test_backward_of_a_program_with_a_large_integer_constant():
    """An integer constant's value sits in an instruction's operand field: the backward must never read it as a
    register (it once did: a constant of 3 000 127 sent the reverse pass far outside its buffer, a segfault)."""
    g = torch.Generator().manual_seed(11)
    tab = torch.randn(4, 401, generator=g, dtype=torch.float64).float().requires_grad_()
    q, k, v = (torch.randn(1, 4, 130, 16, generator=g).requires_grad_() for _ in range(3))

    def sm(score, b, h, qi, kv):
        return score + tab[h, (qi - kv + 3000127) % 401] * 0.5

    d = attnkit.dispatch(q, k, v, causal=True, score_mod=sm)
    assert d.worker == "native" and "program" in d.worker_reason, d
    out = attnkit.attention(q, k, v, causal=True, score_mod=sm)
    go = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v, tab), go)
    td = tab.detach().double().requires_grad_()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attnkit.attention(qd, kd, vd, causal=True, backend="eager",
                            score_mod=lambda s, b, h, qi, kv: s + td[h, (qi - kv + 3000127) % 401] * 0.5)
    refs = torch.autograd.grad(ref, (qd, kd, vd, td), go.double())
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), grads, refs, strict=True):
        assert (a.double() - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item()), name


_SLOPES = torch.rand(4, generator=torch.Generator().manual_seed(3)).bfloat16()
_TABLE = torch.randn(4, 130, generator=torch.Generator().manual_seed(4)).bfloat16()
_LOW_MODS = {  # (mod, whether torch computes part of it in bf16: the kernel's fp32 program would differ)
    "bf16 slope * distance": (lambda s, b, h, i, j: s + _SLOPES[h] * (j - i), True),
    "bf16 table > 0.3": (lambda s, b, h, i, j: torch.where(_TABLE[h, j] > 0.3, s, s - 1), True),
    "score + bf16 table": (lambda s, b, h, i, j: s + _TABLE[h, j], False),
    "score * bf16 table": (lambda s, b, h, i, j: s * _TABLE[h, j], False),
    "fp32 of a bf16 read, times 2": (lambda s, b, h, i, j: s + _TABLE[h, j].float() * 2, False),
    "score - (-bf16 read)": (lambda s, b, h, i, j: s - (-_TABLE[h, j]), False),
}


@pytest.mark.parametrize("name", list(_LOW_MODS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_score_mod_reading_a_bf16_tensor_answers_as_torch_computes_it_on_every_path(name, dtype, kernel_takes_bf16):
    """torch rounds arithmetic on a bf16 tensor's values to bf16 where no fp32 operand joins it; the kernel's
    programs compute in fp32, so auto (the kernel) and eager (torch's promotion) differed by 0.18 for a bf16 slope
    times a distance. Such a program is refused (the plain worker runs it, as torch does); one where an fp32
    operand joins the read stays on the kernel."""
    mod, rounds = _LOW_MODS[name]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 70, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 4, 130, 16, generator=g).to(dtype) for _ in range(2))
    d = attnkit.dispatch(q, k, v, score_mod=mod, causal=True)
    if _native.available():
        assert (d.worker == "native") is not rounds, d.worker_reason
    got = attnkit.attention(q, k, v, score_mod=mod, causal=True)
    want = attnkit.attention(q, k, v, score_mod=mod, causal=True, backend="eager")
    tol = 5e-6 if dtype == torch.float32 else 2e-2
    assert (got.double() - want.double()).abs().max() <= tol
