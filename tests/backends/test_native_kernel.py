"""attnkit's compiled CPU kernel (``backends/_native.py``, ``src/attnkit/csrc``) against the float64 golden.

Every case goes through the public API (``attnkit.attention``), checks that ``attnkit.dispatch``
names the compiled kernel, and compares output, lse and the gradients of q, k, v with the float64
reference within conftest's error budget. Masks reach the kernel as per-row key intervals; those
are checked against the dense mask first (``Mask.row_intervals``), then each instruction set the
CPU has, strided layouts, bf16/fp16, rows that see no key, gradients into lse, and the fallback
when the extension is missing.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import assert_close, budget, golden, low_precision_error, rand_qkv, require_kernel

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM
from attnkit.backends import _native, native, tiled

# Skipped only where the user switched the kernel off; a kernel that failed to build fails here, loudly
# (make test / pip install build it; the fallback itself is tested in test_wheel_install.py).
pytestmark = pytest.mark.skipif(os.environ.get("ATTNKIT_NATIVE", "1").lower() in ("0", "off", "false", "no"),
                                reason="the compiled kernel is switched off by ATTNKIT_NATIVE=0")


def test_the_kernel_was_built():
    assert _native.available(), _native.unavailable_reason()


def _docs(S, sizes=(0.2, 0.5)):
    cuts = [int(S * f) for f in sizes]
    ids = torch.zeros(S, dtype=torch.long)
    for c in cuts:
        ids[c:] += 1
    return ids


def interval_masks(B, L, S):
    """(id, mask) pairs: every built-in mask that is one stretch of keys per row, at these sizes."""
    cases = [
        ("none", None),
        ("causal", M.causal()),
        ("causal_top_left", M.causal("top_left")),
        ("window5", M.sliding_window(5)),
        ("window40_top_left", M.sliding_window(40, "top_left")),
        ("chunked16", M.chunked(16)),
        ("padding", M.padding([S, max(0, S // 3)][:B] + [S] * (B - 2))),
        ("padding_dead_batch_row", M.padding([0] + [S] * (B - 1))),
        ("key_padding_prefix", M.key_padding(torch.arange(S).expand(B, S) < torch.tensor([[S], [max(1, S // 2)]])[:B])),
        ("window_and_chunk", M.sliding_window(9) & M.chunked(24)),
        ("causal_and_padding", M.causal() & M.padding([S] + [max(1, S - 5)] * (B - 1))),
    ]
    if L <= S:
        cases += [("document", M.document(_docs(S))), ("document_causal", M.document(_docs(S)) & M.causal()),
                  ("prefix_lm", M.prefix_lm(S // 4))]
    return cases


SIZES = [(1, 1), (7, 7), (64, 64), (65, 130), (130, 65), (200, 37)]


def _check(q, k, v, mask, dtype=torch.float32, lse_grad=False, score_mod=None):
    B, H, L, D = q.shape
    S = k.shape[2]
    kw = {"mask": mask, "score_mod": score_mod}
    d = attnkit.dispatch(q, k, v, backend="tiled", **kw)
    assert d.worker == "native", d
    out, lse = attnkit.attention(q, k, v, backend="tiled", return_lse=True, **kw)
    ref, ref_lse = golden(q, k, v, **kw)
    tol = budget(torch.float32, D, S)
    assert_close(out, ref, tol, "out")
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live), "rows that see no key: lse -inf exactly there"
    assert_close(lse[live], ref_lse[live], tol, "lse")
    assert (out[~live.unsqueeze(-1).expand_as(out)] == 0).all(), "rows that see no key: output 0"
    if q.requires_grad:
        go = torch.randn_like(out)
        gl = torch.randn_like(lse).masked_fill(~live, 0) if lse_grad else None
        loss = (out * go).sum() + ((lse.masked_fill(~live, 0) * gl).sum() if lse_grad else 0)
        grads = torch.autograd.grad(loss, (q, k, v))
        q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
        r2, rl2 = attnkit.attention(q2, k2, v2, backend="eager", return_lse=True, **kw)
        loss2 = (r2 * go.double()).sum() + ((rl2.masked_fill(~live, 0) * gl.double()).sum() if lse_grad else 0)
        refs = torch.autograd.grad(loss2, (q2, k2, v2))
        for name, a, b in zip("qkv", grads, refs, strict=True):
            assert_close(a, b, 4 * tol * max(1.0, b.abs().max().item()), f"d{name}")


@pytest.mark.parametrize("L,S", SIZES, ids=[f"L{L}_S{S}" for L, S in SIZES])
def test_every_interval_mask_matches_float64(L, S):
    B, H, Hkv, D = 2, 4, 2, 16
    for name, mask in interval_masks(B, L, S):
        q, k, v = rand_qkv(B, H, Hkv, L, S, D, requires_grad=True)
        try:
            _check(q, k, v, mask)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("D,Dv", [(8, 8), (33, 17), (64, 64), (80, 96), (128, 128)])
def test_heads_and_head_dims(H, Hkv, D, Dv):
    q, k, v = rand_qkv(1, H, Hkv, 97, 150, D, Dv, requires_grad=True)
    _check(q, k, v, M.sliding_window(70))


@contextlib.contextmanager
def instruction_set(isa: str):
    """Run the kernel with ``isa`` ("base", "avx2", "avx512") inside the block, skipping where the CPU lacks it;
    the CPU's best is restored after."""
    best = _native.isa()
    order = {"portable": 0, "AVX2": 1, "AVX-512": 2}
    if {"base": 0, "avx2": 1, "avx512": 2}[isa] > order[best]:
        pytest.skip(f"this CPU runs {best} at most")
    try:
        got = _native.set_isa(isa)
        assert got == {"base": "portable", "avx2": "AVX2", "avx512": "AVX-512"}[isa]
        yield
    finally:
        assert _native.set_isa(best) == best  # (the names isa() returns are taken back)


def test_set_isa_takes_its_own_names_and_refuses_others():
    """set_isa takes the names isa() returns (any case, the hyphen optional) as well as its own, and a name it does
    not know is a ValueError naming the argument and the choices; the CPU's best is restored."""
    require_kernel()
    best = _native.isa()
    try:
        assert _native.set_isa("portable") == "portable" == _native.set_isa("Base")
        for name in (best, best.lower(), best.upper()):
            assert _native.set_isa(name) == best
        with pytest.raises(ValueError, match=r"name: expected an instruction set.*got 'sse4'"):
            _native.set_isa("sse4")
        with pytest.raises(ValueError, match="got 2"):
            _native.set_isa(2)  # type: ignore[arg-type]
    finally:
        _native.set_isa(best)
    assert _native.isa() == best


def test_a_bad_isa_environment_variable_is_refused_at_every_call():
    """A bad ATTNKIT_NATIVE_ISA (read by the rule set_isa uses, so "Portable" would be taken: another process, once
    with each value) is a ValueError naming the variable at the first call and again at the next — never a kernel
    quietly switched off."""
    require_kernel()
    code = ("from attnkit.backends import _native\n"
            "for _ in range(2):\n"
            "    try:\n"
            "        print(_native.isa(), _native.available())\n"
            "    except ValueError as e:\n"
            "        print('ValueError', e)\n")
    for value, want in (("sse4", "ValueError ATTNKIT_NATIVE_ISA: expected"),):
        env = dict(os.environ, ATTNKIT_NATIVE_ISA=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        lines = out.stdout.strip().splitlines()
        assert len(lines) == 2 and all(line.startswith(want) for line in lines), (value, out.stdout, out.stderr)


@pytest.mark.parametrize("isa", ["base", "avx2", "avx512"])
def test_every_instruction_set(isa):
    with instruction_set(isa):
        for L, S in [(7, 7), (130, 65), (129, 300)]:
            for name, mask in interval_masks(2, L, S)[:8]:
                q, k, v = rand_qkv(2, 4, 2, L, S, 24, 40, requires_grad=True)
                try:
                    _check(q, k, v, mask)
                except AssertionError as e:
                    raise AssertionError(f"{isa} {name} L={L} S={S}: {e}") from None


def test_strided_layouts_read_in_place_or_copied():
    """(B, L, H, D) transposed queries, a K shared by the batch (stride 0), V whose last dim is strided,
    a transposed upstream gradient: the kernel reads rows at their strides, copies only a strided last dim."""
    B, H, L, S, D = 3, 4, 70, 90, 32
    q = torch.randn(B, L, H, D).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 2, S, D).expand(B, 2, S, D).requires_grad_()
    base = torch.randn(B, 2, D, S)
    v = base.transpose(-1, -2).requires_grad_()  # last-dim stride S
    assert q.stride(-1) != 0 and k.stride(0) == 0 and v.stride(-1) != 1
    _check(q, k, v, M.causal() & M.padding([S, 40, 71]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L,D", [(70, 67), (13, 16), (64, 5)])
def test_query_blocks_packed_at_any_stride_and_dtype_give_the_same_bits(dtype, L, D, widened_bf16):
    """The forward packs each query block transposed (8 x 8 blocks in registers at AVX2, then a row or column at a
    time for what is left): a strided view gives the bits of its contiguous copy, and bf16 / fp16 inputs the bits
    of the fp32 kernel on their widened copies (the same sums: only the packing differs; bf16 on AMX tiles, which
    rounds P, is switched off here: tests/backends/test_native_amx.py)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, L, 3, D, generator=g).to(dtype).transpose(1, 2)  # rows 3 * D apart
    k, v = (torch.randn(2, 3, 90, D, generator=g).to(dtype) for _ in range(2))
    lo = torch.zeros(1, L, dtype=torch.int32)
    hi = torch.full((1, L), 90, dtype=torch.int32)
    out, lse, _ = _native.forward(q, k, v, lo, hi, 0.3)
    out2, lse2, _ = _native.forward(q.contiguous(), k, v, lo, hi, 0.3)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    if dtype is not torch.float32:
        out3, lse3, _ = _native.forward(q.float(), k.float(), v.float(), lo, hi, 0.3)
        assert torch.equal(out, out3) and torch.equal(lse, lse3)


@pytest.mark.parametrize("L,S", [(64, 64), (130, 130), (37, 200), (200, 37)])
def test_alibi_is_added_inside_the_kernel(L, S):
    """ALiBi (score + slope[h]·(kv − q), the offset taken in integers) runs on the compiled kernel with any
    interval mask; a slope that requires grad goes to the plain worker, which returns its gradient."""
    slopes = attnkit.positional.alibi_slopes(4)
    for mask in (M.causal(), M.sliding_window(50), None, M.padding([S, S // 2])):
        q, k, v = rand_qkv(2, 4, 2, L, S, 32, requires_grad=True)
        _check(q, k, v, mask, score_mod=SM.alibi(slopes), lse_grad=True)
    learned = slopes.clone().requires_grad_()  # learned slopes: the traced program, which returns their gradient
    d = attnkit.dispatch(q, k, v, mask=M.causal(), score_mod=SM.alibi(learned), backend="tiled")
    assert d.worker == "native" and "program" in d.worker_reason, d
    d = attnkit.dispatch(q, k, v, mask=M.causal(), score_mod=SM.alibi(slopes), backend="tiled")
    assert d.worker == "native" and "program" not in d.worker_reason, d  # ALiBi's own path in the kernel


def test_lse_gradient():
    q, k, v = rand_qkv(2, 4, 2, 100, 100, 32, requires_grad=True)
    _check(q, k, v, M.sliding_window(30), lse_grad=True)
    _check(q, k, v, M.padding([0, 64]), lse_grad=True)


def test_rows_that_see_no_key():
    """A zero-length sequence and bottom-right causal with L > S (the first rows see nothing):
    output 0, lse -inf, gradients 0, never NaN."""
    q, k, v = rand_qkv(2, 2, 2, 40, 25, 16, requires_grad=True)
    _check(q, k, v, M.causal())
    _check(q, k, v, M.padding([0, 10]))
    out = attnkit.attention(q, k, v, mask=M.padding([0, 10]), backend="tiled")
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[0] == 0).all() and (k.grad[0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_the_low_precision_math(dtype, monkeypatch):
    q, k, v = rand_qkv(2, 4, 2, 130, 130, 64, dtype=dtype)
    if dtype == torch.bfloat16 and native._torch_alone_multiplies_bf16():  # bf16 stays on torch's bf16 GEMMs
        d = attnkit.dispatch(q, k, v, mask=M.causal(), backend="tiled")  # where only torch's multiply bf16
        assert d.worker == "fused" and "bf16 in hardware" in d.worker_reason, d
        monkeypatch.setattr(native, "_BF16_HW", False)  # the kernel's own bf16 handling, checked all the same
    # (where the kernel multiplies bf16 on AMX tiles, it takes bf16 by default: the loop below runs them)
    for mask in (M.causal(), M.sliding_window(33)):
        assert attnkit.dispatch(q, k, v, mask=mask, backend="tiled").worker == "native"
        out = attnkit.attention(q, k, v, mask=mask, backend="tiled")
        assert out.dtype == dtype
        ref, _ = golden(q, k, v, mask=mask)
        err = low_precision_error(q, k, v, ref, mask=mask)
        assert_close(out, ref, 2 * err + 4 * budget(dtype, 64, 130) / 16, f"{dtype}")


def test_forward_is_the_same_on_one_thread_and_two():
    """Each query block is one work item whatever the thread count: the forward is bitwise the same."""
    q, k, v = rand_qkv(2, 4, 2, 300, 300, 64)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attnkit.attention(q, k, v, mask=M.sliding_window(100))
        torch.set_num_threads(2)
        two = attnkit.attention(q, k, v, mask=M.sliding_window(100))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)


def test_masks_that_are_not_intervals_run_on_the_tile_map_and_say_so():
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 16)
    for mask in [M.key_padding(torch.tensor([[True, False] * 32])), M.document(torch.tensor([0, 1] * 32)),
                 M.sliding_window(8) | M.from_mod(lambda b, h, q_idx, kv_idx: kv_idx < 4)]:  # a hole from row 12
        d = attnkit.dispatch(q, k, v, mask=mask, backend="tiled")
        assert d.worker == "native" and "tile map" in d.worker_reason and "partial tiles masked" in d.worker_reason, d
    # a union whose rows are still one stretch each (here: causal) runs on the intervals read off its tile map
    d = attnkit.dispatch(q, k, v, mask=M.sliding_window(8) | M.causal("top_left"), backend="tiled")
    assert d.worker == "native" and "row intervals (read off its tile map" in d.worker_reason, d
    d = attnkit.dispatch(q, k, v, mask=M.causal(), backend="tiled")
    assert d.worker == "native" and "row intervals" in d.worker_reason, d
    d = attnkit.dispatch(q.double(), k.double(), v.double(), mask=M.causal(), backend="tiled")
    assert d.worker == "fused" and "float64" in d.worker_reason
    d = attnkit.dispatch(q, k, v, mask=M.causal(), score_mod=lambda s, b, h, i, j: s + torch.sin(s), backend="tiled")
    assert d.worker == "plain" and "torch.sin" in d.worker_reason


@pytest.mark.parametrize("B,L,S", [(1, 7, 7), (2, 5, 13), (2, 13, 5), (2, 64, 64), (1, 1, 9)])
def test_row_intervals_equal_the_dense_mask(B, L, S):
    g = torch.Generator().manual_seed(L * S)
    masks = [m for _, m in interval_masks(B, L, S) if m is not None]
    masks += [M.key_padding(torch.rand(B, S, generator=g) > 0.5)]
    if L <= S:
        masks += [M.document(torch.randint(0, 3, (S,), generator=g)), M.document(_docs(S)) & M.sliding_window(4)]
    j = torch.arange(S)
    for mask in masks:
        dense = mask.materialize(B, 1, L, S)[:, 0]
        iv = mask.row_intervals(B, L, S)
        if iv is None:  # then some row really is not one stretch
            runs = (dense[..., 1:] & ~dense[..., :-1]).sum(-1) + dense[..., :1].long().squeeze(-1)
            assert (runs > 1).any(), f"{mask!r}: refused, yet every row is one stretch"
            continue
        lo, hi = iv
        assert lo.dtype == torch.int32 and lo.shape[0] in (1, B) and lo.shape[1] == L
        mine = (j >= lo[..., None].long()) & (j < hi[..., None].long())
        assert torch.equal(mine.expand_as(dense), dense), repr(mask)


def test_switched_off_by_environment_runs_torch_kernels_without_a_warning():
    code = ("import warnings, torch, attnkit\n"
            "from attnkit import masks as M\n"
            "warnings.simplefilter('error')\n"
            "q = k = v = torch.randn(1, 2, 64, 16)\n"
            "d = attnkit.dispatch(q, k, v, mask=M.sliding_window(8))\n"
            "print(d.worker, '|', d.worker_reason)\n"
            "attnkit.attention(q, k, v, mask=M.sliding_window(8))\n")
    env = dict(os.environ, ATTNKIT_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.startswith("fused |") and "ATTNKIT_NATIVE=0" in out, out


def test_a_missing_build_warns_once_and_stays_exact(monkeypatch):
    """As on a machine where pip could not compile the extension: one RuntimeWarning naming the fix,
    torch's kernels run, results exact, and dispatch says why."""
    monkeypatch.setattr(_native, "_loaded", False)
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_why", None)
    monkeypatch.setattr(_native, "_warned", False)
    monkeypatch.setattr(_native.importlib.util, "find_spec", lambda name: None)
    q, k, v = rand_qkv(1, 2, 2, 100, 100, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = attnkit.attention(q, k, v, mask=M.sliding_window(8))
        attnkit.attention(q, k, v, mask=M.sliding_window(8))
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "without its compiled CPU kernel" in msgs[0] and "compiler" in msgs[0], msgs
    d = attnkit.dispatch(q, k, v, mask=M.sliding_window(8))
    assert d.worker == "fused" and "without its compiled CPU kernel" in d.worker_reason
    ref, _ = golden(q, k, v, mask=M.sliding_window(8))
    assert_close(out, ref, budget(torch.float32, 16, 100))
    assert not _native.available() and "not used" in _native.status()


def test_status_names_the_instruction_set():
    assert _native.status().startswith("attnkit's compiled CPU kernel (") and _native.isa() in _native.status()
    assert tiled.NATIVE
