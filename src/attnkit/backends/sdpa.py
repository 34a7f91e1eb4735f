"""``backend="sdpa"``: torch's fused ``scaled_dot_product_attention``.

It can express: no mask, causal (top-left, or bottom-right when L == S) through
``is_causal``, and any other mask as an explicit dense mask (attnkit builds the
(B, H, L, S) tensor -- O(L·S) memory, which is why ``auto`` prefers ``tiled`` for
structured masks). It cannot apply a ``score_mod``. With ``return_lse`` it calls
the CPU flash kernel directly (the public function does not return lse) and sets
lse to -inf on fully masked rows (the kernel reports 0 there).

NaN: torch's CPU kernel turns some rows whose scores contain NaN (or inf) into zeros,
hiding the NaN; an inf in a key the mask hides reaches the row (inf + -inf: NaN where the
formula, which never reads a hidden key, has a number); and a NaN / inf value at a hidden
key is read at weight 0 (0 · NaN: NaN in that value's columns). attnkit documents that NaN
propagates to the rows it touches and only to them, so an output with an all-zero row that
the mask does not empty, or a NaN (in a row's first element; anywhere, under a mask), has
its inputs scanned for NaN and inf (an O(B·H·S·D) pass, done only then), and if they hold
any the call is recomputed by the math path of ``eager``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from .. import _calibrate
from .. import masks as _masks
from . import _decode, _flash_cpu, _native, eager, tiled
from ._base import Request
from ._kernel import Kernel
from ._tiles import allowed_tile, has_nonfinite, tile_of

__all__ = ["NAME", "FUSED", "WIDENED", "MATH", "unsupported", "backward_flaw", "run", "may_hide_nan"]

NAME = "sdpa"


def unsupported(req: Request) -> str | None:
    if req.score_mod is not None:
        return "torch SDPA cannot apply a score_mod (use backend='tiled' or 'eager')"
    if req.need_lse and req.dropout_p > 0:
        return "torch SDPA cannot return lse together with dropout (use backend='eager')"
    if req.need_lse and req.device_type != "cpu":
        return "lse from torch SDPA is only wired for the CPU kernel here"
    if req.need_lse and req.q.shape[-1] != req.v.shape[-1]:
        return "lse from torch SDPA needs D == Dv (the CPU flash kernel's restriction)"
    if req.need_lse and not _flash_cpu.available():
        return ("lse from torch SDPA needs torch's private CPU flash kernel, "
                f"unavailable here ({_flash_cpu.unavailable_reason()})")
    if req.need_lse and req.requires_grad():
        return "lse from torch SDPA comes from a private kernel without autograd here (use backend='tiled' or 'eager')"
    if req.bias is not None and req.q.dtype in (torch.float16, torch.bfloat16) and req.bias.dtype != req.q.dtype:
        # SDPA takes the bias in the inputs' dtype. fp16: fp32 finfo.min padding cast to fp16 is -inf, its row a dead
        # one (0) where attnkit (and eager, tiled) give the mean of V; a bias clamped to fp16's range instead would
        # no longer swamp the scores (SDPA's kernels add it in fp32). bf16: every value rounded to 8 bits (a bias
        # of 20 by 0.06), where the other paths add the fp32 bias to fp32 scores (0.054 off at the output against
        # float64, the others 0.0065: a bf16 call with an fp32 bias of ~20)
        return (f"a {req.bias.dtype} float mask with {req.q.dtype} inputs: SDPA would round it to {req.q.dtype} "
                "(fp16: values below its range, finfo.min padding, become -inf); pass the mask in the inputs' dtype, "
                "or use backend='tiled'")
    return None


def _is_causal_only(req: Request) -> bool:
    L, S = req.q.shape[2], req.k.shape[2]
    return (req.causal and req.dense_mask is None and req.bias is None
            and (req.causal_align == "top_left" or L == S))


# Up to this many query rows, a structured mask is handed to SDPA as a dense (L, n) mask built
# per call over only the keys it can reach (decoding and short chunks: see key_range).
DECODE_MAX_L = 16


_CLOSED_FORM = _masks.BUILT_IN  # their decode tiles and row intervals in closed form


def key_range(req: Request) -> tuple[int, int]:
    """``[j0, j1)``: the keys any query can see, from the mask's closed-form tile kinds
    (one block of all L rows × 64 keys); the whole ``[0, S)`` without a structured mask.

        sliding_window(4), L = 2, S = 10, bottom-right:   only keys 5..9 are reachable
            k0 .. k4 k5 k6 k7 k8 k9
        q0   .     .  #  #  #  #  .
        q1   .     .  .  #  #  #  #
    """
    B, H, L, S, *_ = req.shape
    if req.mask is None or req.plan is not None:
        return 0, S
    return req.mask.key_span(B, H, L, S)


def _attn_mask(req: Request, j0: int, j1: int):
    """Dense mask over keys ``[j0, j1)`` for SDPA: bool (True = attend) or float bias, or None."""
    B, H, L, S, *_ = req.shape
    allowed = None if _is_causal_only(req) else allowed_tile(req, 0, L, j0, j1 - j0)
    if req.bias is None:
        return allowed
    return _with_bias(req, allowed, j0, j1)


def _with_bias(req: Request, allowed, j0: int, j1: int):
    """The float bias over keys ``[j0, j1)``, -inf where ``allowed`` (if any) is False."""
    L = req.q.shape[2]
    assert req.bias is not None  # only called for a request with a float bias
    bias = tile_of(req.bias, 0, L, j0, j1 - j0)  # in the inputs' dtype (a wider one is refused: unsupported)
    bias = bias.to(req.q.dtype)
    if allowed is not None:
        bias = bias.masked_fill(~allowed, float("-inf"))
    return bias


def may_hide_nan(out: torch.Tensor, whole: bool = False) -> bool:
    """Whether the fused output may have an all-zero row (where torch's CPU kernel may have
    hidden a NaN/inf) or a NaN row (which may come from an inf in a key the mask hides), or,
    for a decode step with a mask (``whole``: :func:`_reads_whole`), a NaN anywhere (a NaN / inf
    value at a key the mask hides, read at weight 0: NaN in that value's columns — the unused
    slots of a cache from ``torch.empty``); the caller then looks closer. Conservative and
    cheap: the first column alone (1/Dv of the output), or the whole small output of a decode
    step: in C where the compiled kernel is loaded (a CPU (B, H, L, Dv) output of its dtypes),
    else a reduction. (A whole 64 x 64 output, 8 heads, costs ~6 µs more on a 2-core AMD EPYC:
    a prefill's is not read whole; there, as in the compiled kernel's tiles, such a value may
    make its column NaN — an extra NaN, never a missing one.)"""
    return _nan_check(out.device, out.dtype, out.dim(), whole)(out)


def _reads_whole(req: Request) -> bool:
    """Whether the NaN check reads the call's whole output, not its first column: a decode step (L <=
    DECODE_MAX_L) with a mask, where a NaN / inf value at a key the mask hides (a cache's unused slots) would
    otherwise reach the output through torch's ``0 · NaN`` (see :func:`may_hide_nan`)."""
    return req.has_mask and req.q.shape[-2] <= DECODE_MAX_L


def _reduce_check(out: torch.Tensor, whole: bool = False) -> bool:
    first = out.select(-1, 0)
    return not first.all() or bool((out if whole else first).isnan().any())


def _decode_would_take(req: Request, user_mask: torch.Tensor):
    """For a bool tensor mask the compiled decode entry refused for its values alone (a row of two stretches, heads
    that differ: :data:`native.ROWS_REFUSAL`), ``f(mask) -> bool``: whether it would take *this* call's mask — the
    full path's decision, which reads the values, where the replayed signature holds only the mask's shape; None
    where the refusal did not read the values (its answer holds for every call of the signature)."""
    if req.dense_mask is None or req.device_type != "cpu" or user_mask.dtype is not torch.bool:
        return None
    from .native import NATIVE_DECODE, ROWS_REFUSAL, _bool_row_intervals

    if NATIVE_DECODE.not_supported(req) != [ROWS_REFUSAL]:
        return None
    L, S = req.q.shape[2], req.k.shape[2]
    return lambda m: _bool_row_intervals(m, L, S, spans=True) is not None


def _nan_check(device: torch.device, dtype: torch.dtype, dim: int, whole: bool = False):
    """:func:`may_hide_nan` for outputs of this device, dtype and rank, reading them whole or not (chosen once per
    replayed signature): ``f(out) -> bool``."""
    check = _reduce_check
    if device.type == "cpu" and dim == 4 and dtype in (torch.float32, torch.bfloat16, torch.float16):
        check = _native.suspect_rows_fn() or _reduce_check
    return functools.partial(check, whole=True) if whole else check


def backward_flaw(req: Request) -> str | None:
    """Why torch SDPA's own autograd would give inexact gradients for this call (None: it would not).

    * a float bias: its backward rebuilds weights as ``exp(s - lse)``, wrong on a row whose
      scores are all a huge finite negative (``finfo.min`` padding: 1 instead of 1/S);
    * fp16 on the CPU: its backward takes ``delta = rowsum(dO ∘ O)`` from the fp16-rounded
      output; on a peaked row ``dp - delta`` cancels and the error of O (2^-11 relative) becomes
      dq/dk errors far beyond PyTorch's own fp16 error (tiny causal shapes: up to 40×).
    """
    if not req.requires_grad():
        return None
    if req.bias is not None:
        return ("a float bias with gradients: torch SDPA's backward is wrong on rows whose scores are all a huge "
                "finite negative (finfo.min padding)")
    if req.q.dtype == torch.float16 and req.device_type == "cpu":
        return ("fp16 with gradients on the CPU: torch SDPA's backward takes rowsum(dO * O) from the fp16-rounded "
                "output")
    return None


# Where attnkit's compiled kernel beats torch SDPA on SDPA's own ground: this machine's measurement
# (`attnkit calibrate`, attnkit._calibrate.crossovers()), else these defaults (benchmarks/auto_grid.py, 2 threads,
# fp32, D = 64: causal from L = 64 (L = 128: 1.41x forward, 1.21x forward+backward; L = 64: 1.28x forward, even
# forward+backward); no mask from L·S = 1024², forward 1.03-1.04x, forward+backward 1.12x).
NATIVE_CAUSAL_MIN = _calibrate.DEFAULT_NATIVE_CAUSAL_MIN
NATIVE_DENSE_MIN_LS = _calibrate.DEFAULT_NATIVE_DENSE_MIN_LS
# fp32 with gradients at a few query rows (the kernel's few-rows backward: native.few_rows_backward) goes to the
# compiled kernel where its rows reach at least this many keys (the span of their intervals; the table may say
# otherwise: Crossovers.few_rows_grad). A default measured on one CPU (a 2-core AMD EPYC, AVX2, 2 threads), forward +
# backward through auto, 8 heads over 2 or 8 kv heads, D = 64, before / after this rule (benchmarks/
# compare_revisions.py --only "rows:", BENCHMARKS.md): 1.3-2.0x faster from 2048 keys to 16384, L = 1 to 16, causal
# or causal as a user's mask_mod. Over 1024 keys the kernel's lead came and went between runs (0.82-1.19x, by hand):
# SDPA keeps those, and a window of 256 keys (the kernel 1.21x SDPA's time there)
FEW_ROWS_GRAD_MIN_KEYS = 2048
# the sdpa-fp32 row (a bf16 call with gradients the kernel does not run: switched off or not built) from this many
# scores (B·H·L·S) on: below, the four casts cost more than torch's bf16 kernel loses (a 2-core AMD EPYC, forward +
# backward of 8 heads, D = 64: over 128 keys torch's bf16 1.14-1.38x fp32, widened 1.22-1.32x; over 512, 1.56x /
# 1.25-1.32x)
WIDEN_MIN_SCORES = 4096


def _square(n: int) -> str:
    r = math.isqrt(n)
    return f"{r}²" if r * r == n else f"{n:,}"


def _small_to_kernel(req: Request, x) -> str | None:
    """Why a bf16 / fp16 call without gradients that SDPA would take on size grounds (no mask, causal) goes to the
    compiled kernel after all (:meth:`attnkit._calibrate.Crossovers.small_to_kernel`), or None."""
    if req.q.dtype not in (torch.bfloat16, torch.float16) or req.requires_grad() or not _native_runs(req):
        return None
    from .native import _bf16_hardware

    return x.small_to_kernel(req.q.dtype, _bf16_hardware)


# bf16 with gradients goes to the compiled kernel wherever it runs the call and the table says its backward wins
# (Crossovers.grad_to_kernel), at every size: a replayed signature runs the kernel's forward and backward prepared
# once (native._NativeStep), so its fixed cost is below torch's. An Intel Xeon with AMX (2 threads, the
# twenty-ninth session), forward + backward, bf16 against fp32 through auto, before / after: a decode step of
# 8 heads over 2 kv heads and 128 keys, D = 64, torch's bf16 kernel 1.55x / the kernel 0.98x; L = S = 64, 8
# heads, no mask, widened 1.35x / the kernel 0.89x (`benchmarks/bf16_small.py --rounds 200`). (The floors this
# replaced — 128 x 64 scores, a few rows from 16384 — were the kernel's call built afresh each time, on a 2-core AMD
# EPYC.)
def _bf16_grads_fit_kernel(req: Request) -> bool:
    """Whether a bf16 call with gradients is one the compiled kernel runs (it goes there where the table says the
    kernel's backward wins: the rule above)."""
    return _native_runs(req)


def _small_mask_to_kernel(req: Request, x) -> str | None:
    """Why a call with a bool tensor mask of one tile (L, S <= ``tiled.SMALL_MASK``; above ``DECODE_MAX_L`` query
    rows: a decode step's stays with the decode route) and no gradients goes to the compiled kernel (its C pass reads
    the tile's bits, ~3 µs a call, and the kernel masks the scores by them), or None (SDPA applies the mask as it
    is): this machine's measurement (``Crossovers.small_mask``, measured in fp32; a bf16 / fp16 call reaches the
    kernel only where the table's choice for its dtype lets it), else today's rule, the kernel where it runs the call
    (an Intel Xeon with AMX, 2 threads, L = S = 64, 8 heads, D = 64, fp32: the kernel's call 0.121 ms against SDPA's
    0.158 in the calibration's point; ``attnkit calibrate``, ``benchmarks/overhead.py``)."""
    if req.requires_grad() or not _native_runs(req):
        return None
    return x.small_mask_to_kernel()


def _few_rows_grad_to_kernel(req: Request, x) -> str | None:
    """Why an fp32 call that wants gradients at a few query rows goes to the compiled kernel rather than SDPA (its
    few-rows backward, rows reaching at least ``FEW_ROWS_GRAD_MIN_KEYS`` keys; the table may say SDPA), or None."""
    L, S = req.q.shape[2], req.k.shape[2]
    if (req.q.dtype != torch.float32 or L > DECODE_MAX_L or S < FEW_ROWS_GRAD_MIN_KEYS or req.bias is not None
            or req.dense_mask is not None or not req.requires_grad() or not _native_runs(req)):
        return None
    from .native import few_rows_backward

    if not few_rows_backward(req):
        return None
    lo, hi = req.memo["row_intervals"]  # (left by _native_runs) the keys the rows reach: the span of their intervals
    lo, hi = lo.clamp(min=0), hi.clamp(max=S)
    seen = hi > lo  # (a row that sees no key, stored as (0, 0), would stretch the span to key 0)
    if not bool(seen.any()) or int(hi[seen].max()) - int(lo[seen].min()) < FEW_ROWS_GRAD_MIN_KEYS:
        return None
    return x.few_rows_grad_to_kernel(FEW_ROWS_GRAD_MIN_KEYS)


def _native_runs(req: Request) -> bool:
    from .native import NATIVE

    return req.device_type == "cpu" and not NATIVE.not_supported(req)


class Fused(Kernel):
    """``torch.nn.functional.scaled_dot_product_attention`` (with the grouped-query decode fold, and lse from
    torch's CPU flash kernel): the fastest path where nothing can be skipped."""

    name = "sdpa"
    backend = "sdpa"
    worker = "fused"
    title = "torch SDPA"
    measured = ("benchmarks/auto_grid.py and benchmarks/overhead.py (2 threads): fastest for no mask and causal "
                f"below L = {NATIVE_CAUSAL_MIN}, decode-sized calls, float biases and all-partial bool masks")

    def not_supported(self, req: Request) -> list[str]:
        why = [w for w in (unsupported(req),) if w is not None]
        flaw = backward_flaw(req)
        if flaw is not None:
            why.append(flaw)
        return why

    def backward_flaw(self, req: Request) -> str | None:
        """Why SDPA's own autograd would be inexact for ``req`` (:func:`backward_flaw`)."""
        return backward_flaw(req)

    def declines(self, req: Request) -> str | None:
        if req.dropout_p > 0:
            return "dropout_p > 0: auto runs dropout on the eager path"
        if req.device_type != "cpu":
            return self._declines_cuda(req)
        why = self._declines_cpu(req)
        return widen_reason(req) if why is None else why  # (a call SDPA keeps: in bf16, or widened to fp32)

    @staticmethod
    def _declines_cpu(req: Request) -> str | None:
        L, S = req.q.shape[2], req.k.shape[2]
        x = _calibrate.crossovers()
        if req.q.dtype == torch.bfloat16 and req.requires_grad() and _bf16_grads_fit_kernel(req):
            from .native import _torch_alone_multiplies_bf16

            why = x.grad_to_kernel(req.q.dtype, _torch_alone_multiplies_bf16)
            if why is not None:
                return why
        few = _few_rows_grad_to_kernel(req, x)
        if few is not None:
            return few
        if req.mask is None and req.dense_mask is None:
            if req.bias is None and L * S >= x.native_dense_min_ls and _native_runs(req):
                return (f"no mask at L·S >= {_square(x.native_dense_min_ls)}: attnkit's compiled kernel is faster "
                        f"than SDPA here (table: {x.source})")
            if req.bias is None:
                small = _small_to_kernel(req, x)
                if small is not None:
                    return small
            return None  # no mask, or only a float bias: nothing to skip, SDPA applies it in one fused pass
        if L <= DECODE_MAX_L and req.plan is None:
            return None  # decoding: SDPA over the keys the mask can reach, with an (L × n) mask built per call
        if req.dense_mask is not None and req.mask is None:
            if L <= tiled.SMALL_MASK and S <= tiled.SMALL_MASK:
                return _small_mask_to_kernel(req, x)
            partial = tiled.partial_fraction(req)
            if partial > tiled.DENSE_PARTIAL_MAX:
                return None
            return f"a bool mask with {100 * (1 - partial):.0f}% of its tiles empty or full"
        if req.causal and (req.causal_align == "top_left" or L == S):
            if req.bias is None and req.dense_mask is None:
                if min(L, S) >= x.native_causal_min and _native_runs(req):
                    return (f"causal at L >= {x.native_causal_min}: attnkit's compiled kernel is faster than SDPA's "
                            f"is_causal (table: {x.source})")
                return _small_to_kernel(req, x)
            return "causal with a tensor mask (SDPA would merge them into a dense (B, H, L, S) mask)"
        return f"mask {req.mask!r} (SDPA would need a dense (B, H, L, S) mask)"

    @staticmethod
    def _declines_cuda(req: Request) -> str | None:
        L, S = req.q.shape[2], req.k.shape[2]
        plain = (req.score_mod is None and req.dense_mask is None and req.bias is None
                 and (req.mask is None or (req.causal and (req.causal_align == "top_left" or L == S))))
        if plain:
            return None
        if L <= DECODE_MAX_L and req.score_mod is None and req.plan is None and req.dense_mask is None:
            # decoding: SDPA over the keys the mask can reach with a small (L x n) mask built per call, as on the
            # CPU; FlexAttention would compile a kernel for every new key count (a decode loop: one a step)
            return None
        from .flex import FLEX

        flex_no = FLEX.not_supported(req)
        if not flex_no:
            return "a mask or score_mod on a GPU: FlexAttention runs it with attnkit's BlockMask (no dense mask)"
        if (req.bias is not None or req.dense_mask is not None) and req.mask is None and req.score_mod is None:
            return None  # a tensor mask, FlexAttention unavailable: SDPA applies it
        return f"mask {req.mask!r} (SDPA would need a dense (B, H, L, S) mask)"

    def auto_reason(self, req: Request, passed) -> str:
        L = req.q.shape[2]
        kind = "causal" if req.causal else "dense"
        if req.device_type != "cpu":
            if req.bias is not None or req.dense_mask is not None:
                from .flex import FLEX

                return (f"a tensor mask on a GPU, FlexAttention unavailable ({'; '.join(FLEX.not_supported(req))}): "
                        "SDPA applies it")
            if req.mask is not None and L <= DECODE_MAX_L and not _is_causal_only(req):
                return (f"decoding ({L} query rows) with mask {req.mask!r} on a GPU: SDPA over the keys it can reach, "
                        "with an (L × n) mask (no kernel compiled per key count)")
            return f"{kind} attention on a GPU: torch SDPA's fused kernels (flash / cuDNN / efficient)"
        if L <= DECODE_MAX_L and (req.mask is not None or req.dense_mask is not None):
            how = ("the tensor mask over them" if req.mask is None else
                   "a small dense mask (built once per call signature where the mask has a content key)")
            return (f"decode-sized L <= {DECODE_MAX_L}: torch's fused kernel over the keys the mask can reach, "
                    f"with {how}")
        if req.dense_mask is not None:
            if L <= tiled.SMALL_MASK and req.k.shape[2] <= tiled.SMALL_MASK:
                n = tiled.SMALL_MASK
                return (f"a bool mask of one {n} x {n} tile: torch's fused kernel applies it as "
                        "it is (no tile to skip)")
            return ("bool mask with almost every tile partial: nothing to skip, torch's fused kernel applies it in "
                    "one pass")
        if req.bias is not None:
            return "float bias and nothing to skip: torch's fused kernel applies it in one pass"
        return (f"{kind} attention without score_mod: torch's fused kernel is fastest here "
                f"(table: {_calibrate.crossovers().source})")

    def why(self, req: Request) -> str:
        why = "torch.nn.functional.scaled_dot_product_attention"
        if req.need_lse:
            why += " (lse from its CPU flash kernel)"
        elif _folds(req):
            why += (f" with the {req.q.shape[1] // req.k.shape[1]} query heads of each K/V head folded into rows "
                    "(grouped-query decode: K/V read once per group, not once per query head)")
        return why + ("; an all-zero output row the mask does not empty is re-checked for NaN (then recomputed by "
                      "plain ops)")

    def run(self, req: Request):
        return run(req, "fused")

    def replay(self, req: Request, user_mask):
        """The prepared call ``(q, k, v, mask, scale) -> out | None`` that :mod:`attnkit._fast` replays for
        every call with ``req``'s signature, or None when this decision cannot be replayed (it read values
        the signature does not hold, or asks for more than an output). What it prepares is what
        :func:`_fused` computes for ``req``: the keys the mask can reach, the decode tile, the GQA fold.
        It returns None on an all-zero output row (a NaN torch's kernel may have hidden: the caller takes
        the full path, which looks closer)."""
        B, H, L, S, D, Dv, Hkv = req.shape
        if (req.need_lse or req.dropout_p > 0 or req.score_mod is not None or req.plan is not None
                or req.sinks is not None or req.weight_heads is not None):
            return None
        gqa = H != Hkv
        hides_nan = _nan_check(req.q.device, req.q.dtype, 4, whole=_reads_whole(req))
        if type(user_mask) is torch.Tensor:  # the call's own tensor, as SDPA takes it (True = attend, or a bias)
            if req.mask is not None or user_mask.dim() < 2 or (req.dense_mask is not None and req.bias is not None):
                return None
            if req.bias is not None and user_mask.dtype != req.q.dtype:
                return None
            one_tile = L <= tiled.SMALL_MASK and S <= tiled.SMALL_MASK
            if req.dense_mask is not None and not (L <= DECODE_MAX_L or one_tile):
                return None  # the table read the mask's tiles: a decision about these values only

            taken = _decode_would_take(req, user_mask)

            def run_tensor(q, k, v, mask, scale):
                if taken is not None and taken(mask):  # the full path's decision for this call's mask values
                    return None
                out = zero_dead_rows(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                    enable_gqa=gqa), mask)
                return None if hides_nan(out) else out

            return run_tensor
        is_causal = _is_causal_only(req)
        j0, j1, allowed = 0, S, None
        if req.mask is not None and not is_causal:
            if L > DECODE_MAX_L:
                return None
            tile = req.mask.decode_tile(B, L, S, req.q.device)
            if tile is not None:
                j0, j1, allowed = tile  # built once for this signature (a built-in mask is a value): read only
            elif req.plan is None and type(req.mask) not in _CLOSED_FORM:
                # a user's mask (a mask_mod, bare or in & | ~), keyed by its content: the dense mask the full path
                # builds per call (_fused), built once for this signature
                j0, j1 = key_range(req)
                if j1 <= j0:
                    return None
                allowed = _attn_mask(req, j0, j1)
            else:
                return None
        n = j1 - j0
        fold = gqa and _decode.foldable(req.q, req.k[:, :, j0:j1], allowed, is_causal) is None
        if fold and allowed is not None and allowed.shape[-2] != 1:  # the rows of the g heads, repeated once here
            reps = [1] * allowed.dim()
            reps[-2] = H // Hkv
            allowed = allowed.repeat(*reps)

        def run(q, k, v, mask, scale):
            if n < S:
                k, v = k.narrow(2, j0, n), v.narrow(2, j0, n)  # views: only the keys the mask can reach
            if fold:
                out = F.scaled_dot_product_attention(q.reshape(B, Hkv, -1, D), k, v, attn_mask=allowed,
                                                     scale=scale).view(B, H, L, Dv)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=is_causal, scale=scale,
                                                     enable_gqa=gqa)
            out = zero_dead_rows(out, allowed if not fold else None)  # (a fold: the CPU only)
            return None if hides_nan(out) else out

        return run


def widen_reason(req: Request) -> str | None:
    """Why a bf16 call that wants gradients, which torch SDPA keeps, runs SDPA in fp32 on widened copies (the
    ``sdpa-fp32`` row, :class:`Widened`), or None: on a CPU without bf16 instructions torch's bf16 kernels convert
    every block through fp32 (on a 2-core AMD EPYC its bf16 forward + backward cost 1.2-2.6x its fp32 one at the
    sizes SDPA keeps — decode steps, a bool mask of one tile; ``benchmarks/bf16_small.py``); converting the inputs
    once and rounding the output back costs four casts and their backward, more than that below
    ``WIDEN_MIN_SCORES`` scores (B·H·L·S)."""
    if req.q.dtype != torch.bfloat16 or req.device_type != "cpu" or not req.requires_grad():
        return None
    B, H, L, S, *_ = req.shape
    if B * H * L * S < WIDEN_MIN_SCORES:
        return None
    from .native import _torch_alone_multiplies_bf16

    measured = _calibrate.crossovers().bf16_grad  # torch's bf16 backward against the kernel's, measured here
    if measured == "torch" or (measured is None and _torch_alone_multiplies_bf16()):
        return None
    return ("bfloat16 with gradients where SDPA keeps the call and its bf16 backward is the slower (no bf16 "
            "instructions: it converts every block through fp32; AMX: measured, or the kernel multiplies bf16 itself; "
            "on an Intel Xeon with AMX its bf16 forward + backward at L = S = 64 cost 2.4x its fp32 one): SDPA in fp32 "
            "on widened copies, the output rounded back")


class Widened(Kernel):
    """torch SDPA in fp32 on fp32 copies of bf16 inputs, the output rounded back to bf16 (autograd through the
    casts: the gradients come back in bf16): ``auto``'s choice for a bf16 call that wants gradients where SDPA
    keeps it, on a CPU without bf16 instructions (:func:`widen_reason`). Never a named backend's choice
    (``backend="sdpa"`` runs torch's bf16 kernel, as asked)."""

    name = "sdpa-fp32"
    backend = "sdpa"
    worker = "fused"
    title = "torch SDPA in fp32 on widened copies"
    devices = ("cpu",)
    measured = ("benchmarks/bf16_small.py (2 threads): bf16 with gradients where SDPA keeps the call, against fp32 "
                "through auto")

    def not_supported(self, req: Request) -> list[str]:
        why = FUSED.not_supported(req) + Kernel.not_supported(self, req)
        if req.q.dtype != torch.bfloat16:
            why.append(f"{req.q.dtype} (this row widens bf16 for torch's fp32 kernel)")
        if not req.requires_grad():
            why.append("no gradient wanted (torch's bf16 forward is kept)")
        return why

    def declines(self, req: Request) -> str | None:
        why, widen = FUSED.declines(req), widen_reason(req)
        if widen is not None and why == widen:
            return None
        return why or "torch's kernel runs this call in its own dtype"

    def auto_reason(self, req: Request, passed) -> str:
        return widen_reason(req) or self.title

    def why(self, req: Request) -> str:
        return ("torch.nn.functional.scaled_dot_product_attention in fp32 on fp32 copies of q, k, v (and a float "
                "mask), the output rounded back to bf16; gradients through the casts")

    @staticmethod
    def _widened(req: Request) -> Request:
        f = torch.float32
        memo = {n: req.memo[n] for n in ("device_type",) if n in req.memo}
        return dataclasses.replace(req, q=req.q.to(f), k=req.k.to(f), v=req.v.to(f),
                                   bias=None if req.bias is None else req.bias.to(f), memo=memo)

    def run(self, req: Request):
        out, lse = run(self._widened(req), "fused")
        return out.to(req.q.dtype), lse

    def replay(self, req: Request, user_mask):
        """:meth:`Fused.replay` of the widened request, its prepared call given fp32 copies and its output rounded
        back (None where Fused's is None: a float mask, whose dtype the signature fixes, takes the full path)."""
        if type(user_mask) is torch.Tensor and user_mask.is_floating_point():
            return None
        inner = FUSED.replay(self._widened(req), user_mask)
        if inner is None:
            return None
        f, dt = torch.float32, req.q.dtype

        def run_widened(q, k, v, mask, scale):
            out = inner(q.to(f), k.to(f), v.to(f), mask, scale)
            return None if out is None else out.to(dt)

        return run_widened


class Math(Kernel):
    """The same formula in plain ops (``eager``'s), for a named ``backend="sdpa"`` call with dropout whose
    gradients SDPA's own autograd would get wrong."""

    name = "sdpa-math"
    backend = "sdpa"
    worker = "math"
    title = "SDPA's formula in plain ops"

    def not_supported(self, req: Request) -> list[str]:
        why = [w for w in (unsupported(req),) if w is not None]
        if backward_flaw(req) is None or req.dropout_p == 0:
            why.append("only for dropout with gradients SDPA's backward gets wrong")
        return why

    def why(self, req: Request) -> str:
        return f"{backward_flaw(req)}; with dropout, the same formula in plain ops (autograd through it)"

    def run(self, req: Request):
        return run(req, "math")


FUSED = Fused()
WIDENED = Widened()
MATH = Math()


def run(req: Request, worker: str = "fused"):
    """``"fused"``: torch's kernels, the NaN check of :meth:`Fused.why`; ``"math"``: the same formula in plain ops."""
    if worker == "math":
        out, lse = eager.run(req)
        return out, (lse if req.need_lse else None)
    out, lse, attn_mask = _fused(req)
    out = zero_dead_rows(out, attn_mask)
    # cheap; then: an all-zero row the mask does not empty, a NaN -> input scan
    if may_hide_nan(out, _reads_whole(req)):
        zero_rows = (out == 0).all(dim=-1)  # (B, H, L)
        if attn_mask is not None:  # only rows the mask leaves some key
            zero_rows = zero_rows & ~dead_rows(attn_mask)
        if bool((zero_rows | out.isnan().any(dim=-1)).any()) and (has_nonfinite(req.q, req.k, req.v) or (
                req.bias is not None and bool((req.bias.isnan() | req.bias.isposinf()).any()))):  # (-inf: masked)
            return run(req, "math")  # the kernel hid a NaN or let a hidden key's inf in (see the module's note)
    return out, lse


def zero_dead_rows(out: torch.Tensor, attn_mask) -> torch.Tensor:
    """``out`` with the rows ``attn_mask`` fully masks set to 0, off the CPU (attnkit's contract; torch's GPU kernels
    disagree on such rows: on an H200 with torch 2.11, fp16 with a bool mask gave neither 0 nor NaN). No sync. On
    the CPU, torch's kernels give 0 there already: ``out`` as it is."""
    if attn_mask is None or out.device.type == "cpu":
        return out
    return out.masked_fill(dead_rows(attn_mask).unsqueeze(-1), 0)


def dead_rows(attn_mask: torch.Tensor) -> torch.Tensor:
    """The rows of an SDPA mask (bool: True = attend; float: additive) that no key survives: ``(..., L)`` bool."""
    return ~attn_mask.any(-1) if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask).all(-1)


def _folds(req: Request, head_free_mask: bool | None = None) -> bool:
    """Whether :func:`_fused` folds the query heads of each K/V head into rows (:mod:`._decode`): a
    grouped-query decode-sized CPU call with no lse, dropout or bias, whose mask (if any) is the
    built-in decode tile — the same for every head. ``head_free_mask``: known by the caller."""
    B, H, L, S, D, Dv, Hkv = req.shape
    if H == Hkv or L > _decode.FOLD_MAX_L or req.need_lse or req.dropout_p > 0 or req.bias is not None:
        return False
    is_causal = _is_causal_only(req)
    if _decode.foldable(req.q, req.k, None, is_causal) is not None:
        return False
    if head_free_mask is None:
        if req.plan is not None or req.dense_mask is not None:
            return False
        tile = None if req.mask is None else req.mask.decode_tile(B, L, S, req.q.device)
        if req.mask is not None and (tile is None or _decode.foldable(req.q, req.k, tile[2], is_causal) is not None):
            return False
        head_free_mask = True
    return head_free_mask


def _fused(req: Request):
    B, H, L, S, D, Dv, Hkv = req.shape
    is_causal = _is_causal_only(req)
    tile = None
    if L <= DECODE_MAX_L and not is_causal and req.mask is not None and req.plan is None and req.dense_mask is None:
        tile = req.mask.decode_tile(B, L, S, req.q.device)  # closed form, or None (see Mask.decode_tile)
    if tile is not None:
        j0, j1, allowed = tile
        attn_mask = allowed if req.bias is None else _with_bias(req, allowed, j0, j1)
    else:
        j0, j1 = key_range(req) if (L <= DECODE_MAX_L and not is_causal) else (0, S)
        if j1 <= j0:  # no query sees any key: keep the whole (masked) problem, so gradients stay defined
            j0, j1 = 0, S
        attn_mask = _attn_mask(req, j0, j1)
    k, v = req.k[:, :, j0:j1], req.v[:, :, j0:j1]  # views: only the keys the mask can reach
    # a structured mask's own tile or dense bool mask (no tensor mask, no plan): folded where it is the same for
    # every head (foldable reads its head dim)
    structured = req.dense_mask is None and req.plan is None and req.bias is None
    if _folds(req, (tile is not None or structured) and _decode.foldable(req.q, k, attn_mask, is_causal) is None):
        return _decode.sdpa_folded(req.q, k, v, attn_mask, req.scale), None, attn_mask
    if not req.need_lse:
        out = F.scaled_dot_product_attention(
            req.q, k, v, attn_mask=attn_mask, dropout_p=req.dropout_p, is_causal=is_causal,
            scale=req.scale, enable_gqa=H != Hkv)
        return out, None, attn_mask
    if H != Hkv:  # the private kernel has no GQA switch
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=req.q.dtype).masked_fill(~attn_mask, float("-inf"))
    # is_causal is the kernel's top-left causal: _is_causal_only allows it only then (or L == S)
    out, lse = _flash_cpu.forward(req.q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=req.scale)
    return out, lse, attn_mask
