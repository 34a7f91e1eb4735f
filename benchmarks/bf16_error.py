"""bf16 accuracy of sdpa, tiled and auto against float64 on the same bf16-rounded inputs.

    python benchmarks/bf16_error.py [L]

Rounding the inputs once and using them for the float64 attention too isolates the
kernels' own error from the (shared) input rounding. Shape: B=1, H=8, L=S, D=64, dense.

Then calls ``auto`` sends to the compiled kernel, each against its budget (the tests' own):

* a decode step over 2048 keys (GQA 8/2, D = 64) — on a CPU with AMX its scores on tiles, with avx512_bf16 only by
  VDPBF16PS, and the same call with the bf16 products off (the widening order): the fp32 budget
  ``16 eps32 (sqrt(D) + sqrt(S))`` of the largest value plus one rounding of the output (``2^-8 |ref|``), in fp32
  output units before that rounding;
* your own bool mask at L = S = 64 (H = 8, D = 64) with gradients (the kernel's prepared forward and backward, the
  mask's tile map): output within one bf16 unit of the largest value plus the fp32 budget, gradients within four
  (tests/backends/test_native_bool_mask.py); and without gradients (the replayed forward, each call's mask read in
  C, edited between calls): each element within one rounding of itself, P's rounding and the fp32 budget;
* causal calls at D = 16 and D = 80 with gradients (on a CPU with AMX: the tiles, the scores' depth zero-padded
  to 32 / 96): the same budgets, the output's with P's rounding (``2^-9 max|v|``) added
  (tests/backends/test_native_amx.py).
"""

import sys

import torch

import attnkit
from attnkit.backends import _native

EPS32, UNIT = 2.0 ** -23, 2.0 ** -8


def _fp32_budget(D: int, S: int, top: float) -> float:
    return 16 * EPS32 * (D ** 0.5 + S ** 0.5) * max(1.0, top)


def main(L: int = 2048) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, L, 64).bfloat16() for _ in range(3))
    ref = attnkit.attention(q.double(), k.double(), v.double(), backend="eager")
    for backend in ("sdpa", "tiled", "auto"):
        err = (attnkit.attention(q, k, v, backend=backend).double() - ref).abs()
        print(f"{backend:6s} max error {err.max():.3e}   mean error {err.mean():.3e}")

    # a decode step: the kernel's fp32 output (before its one rounding), the products on and off
    S = 2048
    qd = torch.randn(1, 8, 1, 64).bfloat16()
    kd, vd = (torch.randn(1, 2, S, 64).bfloat16() for _ in range(2))
    lo, hi = torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), S, dtype=torch.int32)
    refd = attnkit.attention(qd.double(), kd.double(), vd.double(), backend="eager")
    bound = _fp32_budget(64, S, refd.abs().max().item())
    if _native.available():
        # (a GQA group of 4 rows: on AMX tiles where the CPU has them, else VDPBF16PS where it has avx512_bf16)
        first = ("AMX tiles" if _native.bf16_dot() else "vector dot products" if _native.bf16_vdot()
                 else "widened (no avx512_bf16)")
        for name, on in ((first, True), ("widened", False)):
            before = _native.set_bf16_dot(on)
            try:
                out, _ = _native.decode(qd, kd, vd, lo, hi, 64 ** -0.5)
            finally:
                _native.set_bf16_dot(before)
            err = (out.double() - refd).abs().max().item()
            print(f"decode S={S} GQA 8/2, fp32 out, {name:26s} max error {err:.3e}   budget {bound:.3e}")
    got = attnkit.attention(qd, kd, vd)
    err = (got.double() - refd).abs()
    over = (err - UNIT * refd.abs()).max().item()
    print(f"decode S={S} GQA 8/2, auto, bf16 out: max error {err.max():.3e}; its excess over one rounding "
          f"(2^-8 |ref|) {over:.3e}, within the budget {bound:.3e}: {over <= bound}   "
          f"[{attnkit.dispatch(qd, kd, vd).worker}]")

    # your own bool mask with gradients: the kernel's prepared pair
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(64, 64, generator=g) < 0.7
    mask[:, 0] = True
    qb, kb, vb = (torch.randn(1, 8, 64, 64, generator=g).bfloat16().requires_grad_() for _ in range(3))
    go = torch.randn(1, 8, 64, 64, generator=g).bfloat16()
    for _ in range(2):  # the first call, then its replay
        out = attnkit.attention(qb, kb, vb, mask=mask)
        grads = torch.autograd.grad(out, (qb, kb, vb), go)
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (qb, kb, vb))
    r2 = attnkit.attention(q2, k2, v2, mask=mask, backend="eager")
    want = torch.autograd.grad(r2, (q2, k2, v2), go.double())
    print(f"bool mask L=S=64 with gradients [{attnkit.dispatch(qb, kb, vb, mask=mask).worker}]:")
    for name, a, b, units in (("out", out, r2, 1), *((f"d{n}", x, y, 4) for n, x, y in zip("qkv", grads, want,
                                                                                          strict=True))):
        top = max(1.0, b.abs().max().item())
        bound = units * UNIT * top + _fp32_budget(64, 64, top)
        print(f"  {name:4s} max error {(a.double() - b).abs().max().item():.3e}   budget {bound:.3e}")

    # the same mask without gradients: the replayed forward, each call's mask read into its tile map in C; the mask
    # edited in place between the calls (the second call's answer is the edited mask's)
    qn, kn, vn = (t.detach() for t in (qb, kb, vb))
    vmax = vn.double().abs().max().item()
    with torch.no_grad():
        for step in range(3):
            out = attnkit.attention(qn, kn, vn, mask=mask)
            ref = attnkit.attention(qn.double(), kn.double(), vn.double(), mask=mask, backend="eager")
            err = (out.double() - ref).abs()
            bound = UNIT * ref.abs() + 2.0 ** -9 * vmax + _fp32_budget(64, 64, max(1.0, ref.abs().max().item()))
            print(f"bool mask L=S=64 without gradients, call {step} [{attnkit.dispatch(qn, kn, vn, mask=mask).worker}]"
                  f" (one unit of each element + P's rounding 2^-9 max|v|): max error {err.max().item():.3e}, "
                  f"largest share of its element's budget {(err / bound).max().item():.2f}")
            mask[step * 7:step * 7 + 5] = ~mask[step * 7:step * 7 + 5]

    # a head dimension that is not a multiple of 32, with gradients (AMX: the scores' depth zero-padded)
    for B, H, Lc, D in ((2, 4, 64, 16), (1, 8, 256, 80)):
        qc, kc, vc = (torch.randn(B, H, Lc, D, generator=g).bfloat16().requires_grad_() for _ in range(3))
        goc = torch.randn(B, H, Lc, D, generator=g).bfloat16()
        out = attnkit.attention(qc, kc, vc, causal=True)
        grads = torch.autograd.grad(out, (qc, kc, vc), goc)
        q2, k2, v2 = (t.detach().double().requires_grad_() for t in (qc, kc, vc))
        r2 = attnkit.attention(q2, k2, v2, causal=True, backend="eager")
        want = torch.autograd.grad(r2, (q2, k2, v2), goc.double())
        print(f"causal L=S={Lc}, D={D}, B={B}, H={H} with gradients [{attnkit.dispatch(qc, kc, vc, causal=True).worker}"
              f"{', AMX tiles' if _native.available() and _native.bf16_dot() else ''}] (out: one unit + P's rounding "
              f"2^-9 max|v|; gradients: four units):")
        vmax = vc.detach().double().abs().max().item()
        for name, a, b, units in (("out", out, r2, 1), *((f"d{n}", x, y, 4) for n, x, y in zip("qkv", grads, want,
                                                                                              strict=True))):
            top = max(1.0, b.abs().max().item())
            bound = units * UNIT * top + _fp32_budget(D, Lc, top) + (2.0 ** -9 * vmax if name == "out" else 0.0)
            print(f"  {name:4s} max error {(a.double() - b).abs().max().item():.3e}   budget {bound:.3e}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2048)
