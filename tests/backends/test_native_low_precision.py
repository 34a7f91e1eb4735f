"""bf16 / fp16 in the compiled kernel's forward and backward: the inputs are read as they are and widened to fp32
tile by tile (csrc/attn_widen.h), never converted whole. (On a CPU with AMX a bf16 forward multiplies bf16 on tiles
instead; these tests switch that off, and tests/backends/test_native_amx.py tests it.)

Widening is exact and the math after it is the fp32 kernel's, so the strongest check is bitwise: a bf16 / fp16
call gives exactly the fp32 kernel's results on the widened inputs, rounded once to the input dtype (forward and
every gradient, NaN and inf in the same places), at every instruction set, layout and mask kind. The error budget
against the float64 golden follows from that (see :func:`_budget`).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_close, budget, golden, rand_qkv
from test_native_kernel import instruction_set
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM
from attnkit.backends import _native

pytestmark = pytest.mark.skipif(os.environ.get("ATTNKIT_NATIVE", "1").lower() in ("0", "off", "false", "no"),
                                reason="the compiled kernel is switched off by ATTNKIT_NATIVE=0")

LOW = [torch.bfloat16, torch.float16]
# unit roundoff of one rounding to the dtype (half an ulp of 1): bf16 keeps 8 significant bits, fp16 11
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


# On a CPU with bf16 instructions auto may keep bf16 on torch's kernel (kernel_takes_bf16 sends it to the kernel);
# these tests are about the kernel's own widening path (on a CPU with AMX its bf16 products run on tiles by default,
# tests/backends/test_native_amx.py; widened_bf16 switches that off)
pytestmark = [pytestmark, pytest.mark.usefixtures("kernel_takes_bf16", "widened_bf16")]


def _checkerboard(b, h, q_idx, kv_idx):  # a mask_mod that is not intervals: the tile map with partial bits
    return ((q_idx // 8 + kv_idx // 8) % 2 == 0) | (q_idx == kv_idx)


def _cases(L: int, S: int):
    slopes = attnkit.positional.alibi_slopes(4)
    yield "causal", dict(mask=M.causal())
    yield "window", dict(mask=M.sliding_window(37))
    yield "padding", dict(mask=M.padding([S, S // 3]))
    yield "document", dict(mask=M.document(torch.arange(S) * 3 // S))
    yield "mask_mod", dict(mask=attnkit.create_block_mask(_checkerboard, None, None, L, S))
    yield "alibi", dict(mask=M.causal(), score_mod=SM.alibi(slopes))
    yield "softcap", dict(mask=M.causal(), score_mod=SM.softcap(20.0))


def _run(q, k, v, go, **kw):
    d = attnkit.dispatch(q, k, v, backend="tiled", **kw)
    assert d.worker == "native", d
    out = attnkit.attention(q, k, v, backend="tiled", **kw)
    grads = torch.autograd.grad(out, (q, k, v), go)
    return out, grads


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    same = (a == b) | (a.isnan() & b.isnan())
    assert bool(same.all()), f"{what}: {int((~same).sum())} of {a.numel()} elements differ from the fp32 kernel's"


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("isa", ["base", "avx2", "avx512"])
def test_low_precision_is_the_fp32_kernel_on_the_widened_inputs_bit_for_bit(dtype, isa):
    with instruction_set(isa):
        for (L, S, D, Dv, H, Hkv) in ((130, 130, 64, 64, 4, 2), (70, 100, 33, 40, 4, 4)):
            for name, kw in _cases(L, S):
                if name in ("causal", "alibi", "softcap") and L != S:
                    kw["mask"] = M.causal("top_left")
                q, k, v = rand_qkv(2, H, Hkv, L, S, D, Dv, dtype=dtype, requires_grad=True)
                go = torch.randn(2, H, L, Dv).to(dtype)
                out, grads = _run(q, k, v, go, **kw)
                q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
                out32, grads32 = _run(q32, k32, v32, go.float(), **kw)
                _same_bits(out, out32.to(dtype), f"{isa} {name} L={L} S={S} out")
                for n, a, b in zip("qkv", grads, grads32, strict=True):
                    _same_bits(a, b.to(dtype), f"{isa} {name} L={L} S={S} d{n}")


@pytest.mark.parametrize("dtype", LOW)
def test_strided_inputs_and_an_expanded_gradient_are_read_in_place(dtype):
    """(B, L, H, D) queries, a K shared by the batch (stride 0), V with a strided last dim, and the gradient of
    ``out.sum()`` (stride 0 everywhere): bit for bit the fp32 kernel's on the widened inputs."""
    B, H, L, S, D = 3, 4, 70, 90, 32
    q = torch.randn(B, L, H, D).to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 2, S, D).to(dtype).expand(B, 2, S, D).requires_grad_()
    v = torch.randn(B, 2, D, S).to(dtype).transpose(-1, -2).requires_grad_()
    go = torch.ones((), dtype=dtype).expand(B, H, L, D)
    kw = dict(mask=M.causal() & M.padding([S, 40, 71]))
    out, grads = _run(q, k, v, go, **kw)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out32, grads32 = _run(q32, k32, v32, go.float(), **kw)
    _same_bits(out, out32.to(dtype), "out")
    for n, a, b in zip("qkv", grads, grads32, strict=True):
        _same_bits(a, b.to(dtype), f"d{n}")


@pytest.mark.parametrize("dtype", LOW)
def test_nan_and_inf_behave_as_in_fp32(dtype):
    """A NaN in a query, an inf in a key and a NaN in a value: NaN exactly where the fp32 kernel has NaN."""
    q, k, v = rand_qkv(1, 2, 2, 96, 96, 16, dtype=dtype, requires_grad=True)
    with torch.no_grad():
        q[0, 0, 5, 3] = float("nan")
        k[0, 1, 40, 0] = float("inf")
        v[0, 0, 70, 2] = float("nan")
    go = torch.randn(1, 2, 96, 16).to(dtype)
    out, grads = _run(q, k, v, go, mask=M.sliding_window(20))
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out32, grads32 = _run(q32, k32, v32, go.float(), mask=M.sliding_window(20))
    assert out.isnan().any()
    _same_bits(out, out32.to(dtype), "out")
    for n, a, b in zip("qkv", grads, grads32, strict=True):
        _same_bits(a, b.to(dtype), f"d{n}")


def _budget(dtype, ref: torch.Tensor, D: int, S: int) -> torch.Tensor:
    """Per element: the fp32 kernel's budget (conftest's, on the widened inputs, which the golden also reads) plus
    one rounding of the result to ``dtype`` (half an ulp: ``UNIT · |ref|``, and the same again for the fp32 error
    it rounds). Gradients scale with the largest reference gradient, as in test_native_kernel."""
    tol32 = 4 * budget(torch.float32, D, S) * max(1.0, ref.abs().max().item())
    return tol32 * (1 + UNIT[dtype]) + UNIT[dtype] * ref.abs()


@pytest.mark.parametrize("dtype", LOW)
def test_errors_against_float64_within_one_rounding_of_the_fp32_budget(dtype):
    B, H, Hkv, L, S, D = 2, 4, 2, 200, 200, 64
    for kw in (dict(mask=M.causal()), dict(mask=M.sliding_window(50)), dict(mask=M.document(torch.arange(S) // 70))):
        q, k, v = rand_qkv(B, H, Hkv, L, S, D, dtype=dtype, requires_grad=True)
        go = torch.randn(B, H, L, D).to(dtype)
        out, grads = _run(q, k, v, go, **kw)
        ref, _ = golden(q, k, v, **kw)
        assert bool(((out.double() - ref).abs() <= _budget(dtype, ref, D, S)).all()), "out"
        q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
        r2 = attnkit.attention(q2, k2, v2, backend="eager", **kw)
        refs = torch.autograd.grad(r2, (q2, k2, v2), go.double())
        for n, a, b in zip("qkv", grads, refs, strict=True):
            err = (a.double() - b).abs()
            assert bool((err <= _budget(dtype, b, D, S)).all()), f"d{n}: max error {err.max().item():.3g}"


class _Widenings(TorchDispatchMode):
    """Records every dtype conversion torch performs: (source dtype, numel)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[0] if func is torch.ops.aten._to_copy.default else args[1]
            dst_dtype = kwargs.get("dtype", args[0].dtype if func is torch.ops.aten.copy_.default else None)
            if isinstance(src, torch.Tensor) and dst_dtype is not None and dst_dtype != src.dtype:
                self.seen.append((src.dtype, src.numel()))
        return func(*args, **kwargs)


@pytest.mark.parametrize("dtype", LOW)
def test_no_input_is_converted_whole(dtype):
    """Forward and backward: torch converts no bf16 / fp16 tensor to fp32 (only the fp32 results are rounded)."""
    q, k, v = rand_qkv(1, 4, 2, 256, 256, 64, dtype=dtype, requires_grad=True)
    go = torch.randn(1, 4, 256, 64).to(dtype)
    with _Widenings() as w:
        out = attnkit.attention(q, k, v, mask=M.sliding_window(64), backend="tiled")
        torch.autograd.grad(out, (q, k, v), go)
    widened = [(dt, n) for dt, n in w.seen if dt == dtype]
    assert not widened, f"{dtype} tensors converted whole: {widened}"


@pytest.mark.parametrize("dtype", LOW)
def test_outputs_are_rounded_by_the_kernel_with_no_conversion_pass(dtype):
    """The output and the three gradients come out of the kernel in the input dtype: torch rounds no fp32 tensor of
    the output's or an input's size (forward with autograd, its backward, and a no-grad call and its replay)."""
    B, H, L, D = 1, 4, 256, 64
    q, k, v = rand_qkv(B, H, 2, L, L, D, dtype=dtype, requires_grad=True)
    go = torch.randn(B, H, L, D).to(dtype)
    kw = dict(mask=M.sliding_window(64), backend="tiled")
    with _Widenings() as w:
        out = attnkit.attention(q, k, v, **kw)
        grads = torch.autograd.grad(out, (q, k, v), go)
        with torch.no_grad():
            for _ in range(3):  # the first call, then the prepared step of its signature
                attnkit.attention(q, k, v, **kw)
    big = [(dt, n) for dt, n in w.seen if n >= L * D]
    assert not big, f"whole tensors converted by torch: {big}"
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("isa", ["base", "avx2", "avx512"])
def test_rounding_at_the_dtype_edges_is_torchs(dtype, isa):
    """Outputs near the dtype's edges, rounded by the kernel exactly as torch's ``.to()`` rounds the fp32 kernel's
    results: fp16 subnormals (values ~1e-6), gradients past the largest finite value (inf), NaN from a value, and
    ties (q = 0: a row over 2^n keys averages them exactly in fp32, often halfway between two low-precision
    numbers: ties go to even), at head sizes that leave a tail after the last full vector (the scalar rounding)
    and at 64."""
    big = 6e4 if dtype is torch.float16 else 3e38  # a gradient summed over rows passes the largest finite value
    with instruction_set(isa):
        for D in (5, 64, 67):
            g = torch.Generator().manual_seed(D)
            q = torch.randn(1, 2, 130, D, generator=g).to(dtype).requires_grad_()
            k = torch.randn(1, 2, 130, D, generator=g).to(dtype).requires_grad_()
            v = (torch.randn(1, 2, 130, D, generator=g) * torch.logspace(-7, 1, D)).to(dtype)
            with torch.no_grad():
                v[0, 1, 90, 1] = float("nan")
            v.requires_grad_()
            go = (torch.randn(1, 2, 130, D, generator=g) * torch.logspace(-6, 0, D) * big).to(dtype)
            q0 = torch.zeros_like(q).requires_grad_()
            for qq, kw in ((q, dict(mask=M.causal())), (q, dict(mask=M.sliding_window(40))),
                           (q0, dict(mask=M.sliding_window(4)))):
                q = qq
                out, grads = _run(q, k, v, go, **kw)
                q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
                out32, grads32 = _run(q32, k32, v32, go.float(), **kw)
                _same_bits(out, out32.to(dtype), f"{isa} D={D} out")
                assert bool(out.isnan().any()) and bool((out.float().abs() < 6.1e-5).any())
                for n, a, b in zip("qkv", grads, grads32, strict=True):
                    _same_bits(a, b.to(dtype), f"{isa} D={D} d{n}")
                    # the NaN compare above ignores which NaN: the rest bit for bit, inf included
                    fin = ~(a.isnan() | b.to(dtype).isnan())
                    assert torch.equal(a[fin].view(torch.int16), b.to(dtype)[fin].view(torch.int16)), n
                assert any(bool(gr.isinf().any()) for gr in grads), "no gradient reached the dtype's overflow"


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("isa", ["base", "avx2", "avx512"])
def test_the_decode_entry_rounds_its_output_as_torch_does(dtype, isa):
    """``decode(..., rounded=True)``: out in the input dtype, each row merged in fp32 (over the split-K chunks of a
    long cache) and rounded once as it is written — bit for bit ``.to(dtype)`` of the fp32 output, at every
    instruction set, at head sizes with a tail after the last full vector: NaN rows, rows that see no key (zeros),
    ties (q = 0 over 2^n keys), fp16 subnormals; the prepared step (``decode_step``) and the one-shot call alike."""
    with instruction_set(isa):
        for D, S, L in ((5, 128, 1), (64, 4096, 3), (67, 1000, 2)):
            g = torch.Generator().manual_seed(D + S)
            q = torch.randn(3, 8, L, D, generator=g).to(dtype)
            q[1] = 0  # every score 0: the mean of the V rows a row sees, often a tie between two dtype numbers
            k = torch.randn(3, 2, S, D, generator=g).to(dtype)
            v = (torch.randn(3, 2, S, D, generator=g) * torch.logspace(-7, 1, D)).to(dtype)
            v[0, 1, S // 2, 0] = float("nan")
            lo = torch.zeros(3, L, dtype=torch.int32)
            hi = torch.full((3, L), S, dtype=torch.int32)
            hi[1] = 64  # 64 keys: q = 0 averages them exactly in fp32
            hi[2] = 0  # rows that see no key
            ref, ref_lse = _native.decode(q, k, v, lo, hi, D ** -0.5)
            out, lse = _native.decode(q, k, v, lo, hi, D ** -0.5, rounded=True)
            step = _native.decode_step(q, k, v, lo, hi, rounded=True)(q, k, v, D ** -0.5)
            for what, o in (("decode", out), ("decode_step", step)):
                assert o.dtype == dtype, (what, o.dtype)
                _same_bits(o, ref.to(dtype), f"{isa} D={D} S={S} {what}")
                fin = ~o.isnan()
                assert torch.equal(o[fin].view(torch.int16), ref.to(dtype)[fin].view(torch.int16)), what
            assert torch.equal(lse, ref_lse) or torch.equal(lse.isnan(), ref_lse.isnan())
            assert bool(out[0, 4:8].isnan().any()) and bool((out[2] == 0).all())
            if dtype is torch.float16:
                assert bool(((out.float().abs() < 6.1e-5) & (out != 0)).any()), "no fp16 subnormal reached"
            assert not torch.equal(ref.to(dtype).float(), ref), "no output needed rounding"


@pytest.mark.parametrize("dtype", LOW)
def test_a_decode_step_has_no_conversion_pass(dtype):
    """A no-grad decode step through ``auto`` (the decode entry, first call and its replays; a few stretches per
    row; a mask_mod's rows) comes out of the kernel in the input dtype: torch rounds no fp32 tensor of the
    output's size, and it equals the fp32 output of the same inputs rounded once."""
    q, k, v = rand_qkv(1, 8, 2, 1, 300, 64, dtype=dtype)
    cases = (dict(mask=M.causal()), dict(mask=lambda b, h, qi, kv: (kv < 4) | (kv >= 236)),  # sinks and a window
             dict(mask=M.padding([200])))
    for kw in cases:
        d = attnkit.dispatch(q, k, v, **kw)
        assert d.kernel is not None and d.kernel.name == "native-decode", d
        with torch.no_grad(), _Widenings() as w:
            outs = [attnkit.attention(q, k, v, **kw) for _ in range(3)]
        assert not [(dt, n) for dt, n in w.seen if n >= 8 * 64], f"{kw}: torch rounded the output: {w.seen}"
        ref = attnkit.attention(q.float(), k.float(), v.float(), **kw)
        for o in outs:
            assert o.dtype == dtype
            assert_close(o.float(), ref, UNIT[dtype] * ref.abs().max().item() + 1e-6, f"{kw}")


def test_the_amx_switch_and_a_bad_value_of_it():
    """ATTNKIT_NATIVE_BF16_DOT=0 widens bf16 on every CPU (status says which path runs, on a CPU with AMX too); a
    value that is not a switch is a ValueError naming the variable at every call (another process per value), never
    tiles quietly off."""
    import subprocess
    import sys

    code = ("from attnkit.backends import _native\n"
            "for _ in range(2):\n"
            "    try:\n"
            "        print(_native.bf16_dot(), 'AMX' in _native.status())\n"
            "    except ValueError as e:\n"
            "        print('ValueError', e)\n")
    for value, want in (("0", ("False False",)), ("1", ("True True", "False False")),
                        ("amx", ("ValueError ATTNKIT_NATIVE_BF16_DOT: expected",))):
        env = dict(os.environ, ATTNKIT_NATIVE_BF16_DOT=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        lines = out.stdout.strip().splitlines()
        assert len(lines) == 2 and lines[0] == lines[1] and lines[0].startswith(want), (value, out.stdout, out.stderr)
