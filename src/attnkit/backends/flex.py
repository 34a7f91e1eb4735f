"""``backend="flex"``: FlexAttention's kernels driven by attnkit's block plan.

``torch.nn.attention.flex_attention`` generates a fused kernel (Triton on a GPU, C++ on
the CPU) from a ``mask_mod`` / ``score_mod`` and skips the tiles a ``BlockMask`` marks
empty. attnkit hands it:

* the ``BlockMask`` built from its own plan (``attnkit.plan(...).to_block_mask()``,
  128 × 128 tiles): closed form for built-in masks, no per-point evaluation — the part
  ``create_block_mask`` spends its time on (and at long context its memory: it holds the
  whole L × S mask);
* the ``score_mod`` as given (attnkit's mods have FlexAttention's signature);
* a float mask as a ``score_mod`` that adds it, a bool tensor mask as a ``mask_mod`` that reads it.

The compiled function is built once per process (``torch.compile(flex_attention,
dynamic=False)``: a specialisation per shape is what the CPU code generator handles
reliably); torch's own compile cache then holds one specialisation per mod and
shape signature. Block masks of cacheable masks (built-in ones, pure mask_mods) are
cached per (mask key, sizes, device). torch keeps at most
``torch._dynamo.config.recompile_limit`` specialisations of one function; past that it
runs FlexAttention's unfused implementation (exact, slower, and torch warns).

Limits (``unsupported`` says which applies): no dropout; on the CPU FlexAttention
compiles for **inference only** and returns no lse, so a call that needs a gradient or
lse (``return_lse``, ``return_weights``, ``sinks``) raises when named, and ``auto`` never
picks flex on a CPU. Fully masked rows give 0 (FlexAttention's rule, the same as attnkit's).

Shape legend: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) → (B, H, L, Dv);
GQA through FlexAttention's ``enable_gqa`` (no copy of K/V).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .. import masks as _masks
from .. import plans as _plans
from ..score_mods import ScoreMod
from ._base import Request
from ._kernel import Kernel

__all__ = ["NAME", "FLEX", "unsupported", "run", "BLOCK"]

NAME = "flex"
BLOCK = 128  # FlexAttention's default tile

_compiled: dict = {}  # "fn": the compiled flex_attention (one per process)
_BLOCK_MASKS: OrderedDict = OrderedDict()  # (mask key, B, H, L, S, device) -> BlockMask
_BLOCK_MASKS_MAX = 64


def _flex_attention():
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:  # pragma: no cover - torch without FlexAttention
        return None
    return flex_attention


def unsupported(req: Request) -> str | None:
    if _flex_attention() is None:
        return "this torch has no torch.nn.attention.flex_attention (torch >= 2.5 needed)"
    if req.dropout_p > 0:
        return "FlexAttention has no dropout (use backend='eager')"
    if req.device_type == "cpu":
        if req.q.dtype == torch.float64:  # torch's CPU lowering raised a LoweringException deep in inductor
            return ("FlexAttention's compiled CPU kernel takes float32, float16 and bfloat16, not float64 (use "
                    "backend='tiled', 'eager' or 'auto', which compute float64 exactly)")
        if req.requires_grad():
            return ("FlexAttention compiles for inference only on the CPU; a gradient is wanted here "
                    "(use backend='tiled' or 'auto', which train on the CPU)")
        if req.need_lse:
            return ("FlexAttention's compiled CPU kernel returns no lse (needed for return_lse, return_weights "
                    "or sinks); use backend='tiled' or 'auto'")
    if req.grad_tensors or req.grad_hidden:
        return "gradients into tensors a score_mod captures are not wired through FlexAttention here (use 'tiled')"
    if req.bias is not None and req.bias.requires_grad:
        return "gradients into a float mask are not wired through FlexAttention here (use 'tiled' or 'sdpa')"
    if req.bias is not None and req.requires_grad():
        # measured on an H200 (torch 2.11): gradients off by 60 on such rows (tests/backends/test_gpu.py)
        return ("a float bias with gradients: FlexAttention's backward rebuilds the weights as exp(s - lse), wrong "
                "on a row whose scores are all a huge finite negative (finfo.min padding: 1 instead of 1/S); "
                "use 'tiled'")
    return None


class Flex(Kernel):
    """torch.compile(flex_attention) with attnkit's BlockMask: auto's path for masks and score_mods on a GPU."""

    name = "flex"
    backend = "flex"
    worker = "compiled"
    title = "FlexAttention"
    measured = "benchmarks/gpu.py: FlexAttention's kernels skip a BlockMask's empty blocks on a GPU"

    def not_supported(self, req: Request) -> list[str]:
        return [w for w in (unsupported(req),) if w is not None]

    def why(self, req: Request) -> str:
        return ("torch.compile(flex_attention) with attnkit's BlockMask"
                + (" (CPU: inference only)" if req.device_type == "cpu" else ""))

    def auto_reason(self, req: Request, passed) -> str:
        what = ("a score_mod" if req.score_mod is not None
                else f"mask {req.mask!r}" if req.mask is not None else "a tensor mask")
        return f"{what} on a GPU: FlexAttention's kernel with attnkit's BlockMask (no dense mask)"

    def run(self, req: Request):
        return run(req)


FLEX = Flex()


# Each mask_mod / score_mod code, dtype and (static) shape is its own compiled kernel, and torch.compile allows
# 8 per function by default: past that it runs flex_attention unfused, which materialises every score (measured on
# an H200, torch 2.11: benchmarks/gpu.py's 9th mask asked for 256 GiB at L = 32768). attnkit's calls get this many.
RECOMPILES = 256


def _compiled_flex(device_type: str = "cuda"):
    """The compiled flex_attention, static shapes. Not ``dynamic=None``: on an H200 (torch 2.11) a shape that turned
    dynamic made an int a score_mod captures symbolic, and compiling relative_bias then failed in inductor's
    lowering. Decode steps, whose key count changes every step, go to SDPA instead (sdpa.Fused._declines_cuda)."""
    key = "cpu" if device_type == "cpu" else "gpu"
    fn = _compiled.get(key)
    if fn is None:
        fn = _compiled[key] = torch.compile(_flex_attention(), dynamic=False)
    return fn


def _many_kernels():
    """torch.compile's recompile limits raised to :data:`RECOMPILES` for the duration of one attnkit call."""
    cfg = torch._dynamo.config
    names = [n for n in ("recompile_limit", "accumulated_recompile_limit", "cache_size_limit",
                         "accumulated_cache_size_limit") if hasattr(cfg, n)]
    return cfg.patch(**{n: max(getattr(cfg, n), RECOMPILES) for n in names[:2]})


def _block_mask(req: Request):
    """FlexAttention BlockMask for the request's structured mask and user bool tensor, or None."""
    B, H, L, S, *_ = req.shape
    mask = req.mask
    if req.dense_mask is not None:
        dense = req.dense_mask.expand(B, H, L, S)  # a view: read per point by the mask_mod
        tensor_mask = _masks.from_mod(lambda b, h, q, kv: dense[b, h, q, kv])
        mask = tensor_mask if mask is None else (mask & tensor_mask)
    if mask is None:
        return None
    device = req.q.device
    if req.plan is not None and req.plan.block == (BLOCK, BLOCK) and req.dense_mask is None and req.plan_extra is None:
        return req.plan.to_block_mask(device)
    key = mask.cache_key()
    full_key = None if key is None else (key, B, H, L, S, str(device))
    if full_key is not None and full_key in _BLOCK_MASKS:
        _BLOCK_MASKS.move_to_end(full_key)
        return _BLOCK_MASKS[full_key]
    bsz = mask.batch_size or (B if req.dense_mask is not None and req.dense_mask.shape[0] != 1 else None)
    heads = H if req.dense_mask is not None and req.dense_mask.shape[1] != 1 else None
    bm = _plans.plan(mask, L, S, B=bsz, H=heads, block=(BLOCK, BLOCK)).to_block_mask(device)
    if full_key is not None:
        _BLOCK_MASKS[full_key] = bm
        if len(_BLOCK_MASKS) > _BLOCK_MASKS_MAX:
            _BLOCK_MASKS.popitem(last=False)
    return bm


def _score_mod(req: Request):
    """The user's score_mod, then the float mask added (attnkit's order), as one score_mod."""
    mod, bias = req.score_mod, req.bias
    if isinstance(mod, ScoreMod):
        mod = mod.on_device(req.q.device)  # its slopes / table on q's device, loaded by the compiled kernel
    if bias is None:
        return mod
    B, H, L, S, *_ = req.shape
    b4 = bias.expand(B, H, L, S)  # a view, read per point

    def term(s, b, h, q, kv):
        # A finite bias below -2**127 (finfo.min padding) is raised to -2**127 (in fp32, whatever the bias's dtype):
        # FlexAttention's kernel multiplies scores by log2(e) for exp2, which takes finfo.min to -inf and a row of
        # such scores to a dead row (0), where attnkit's contract (and SDPA's) is the mean of V. -inf stays -inf;
        # two finite biases both below -2**127 in one row become equal (their weights, 0 beside any score above
        # them, are then split evenly where nothing else is in the row).
        x = b4[b, h, q, kv].float()
        return torch.where(torch.isinf(x), x, x.clamp_min(-(2.0 ** 127))).to(s.dtype)

    if mod is None:
        return lambda s, b, h, q, kv: s + term(s, b, h, q, kv)
    return lambda s, b, h, q, kv: mod(s, b, h, q, kv) + term(s, b, h, q, kv)


# torch's GPU kernel for FlexAttention picks its tile sizes per dtype and head dim; for some score_mods (a gathered
# bias table in bf16 / fp16, measured on an H200 with torch 2.11) its choice needs more shared memory than the chip
# has, and compiling fails. Then the call is compiled again once with these smaller tiles (64 divides the
# BlockMask's 128).
SMALL_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1}


def _out_of_resources(e: Exception) -> bool:
    text = str(e)
    return "out of resource" in text or "No valid triton configs" in text


def run(req: Request, worker: str | None = None):
    B, H, L, S, D, Dv, Hkv = req.shape
    fn = _compiled_flex(req.device_type)
    kw = dict(score_mod=_score_mod(req), block_mask=_block_mask(req), scale=req.scale, enable_gqa=H != Hkv)
    if req.need_lse:  # GPU only (see unsupported)
        kw["return_lse"] = True
    try:
        with _many_kernels():
            res = fn(req.q, req.k, req.v, **kw)
    except Exception as e:  # torch's compile errors have no stable class across versions
        if req.device_type == "cpu" or not _out_of_resources(e):
            raise
        try:
            with _many_kernels():
                res = fn(req.q, req.k, req.v, kernel_options=dict(SMALL_TILES), **kw)
        except Exception as e2:
            if not _out_of_resources(e2):
                raise
            raise RuntimeError(
                f"backend='flex': torch could not compile FlexAttention's GPU kernel for this call ({req.q.dtype}, "
                f"D = {D}) even with tiles of 64: it needs more shared memory than this GPU has. Use backend='tiled' "
                "(exact, no compiled kernel), or fp32 inputs.") from e2
    if req.need_lse:
        out, lse = res
        return out, lse
    return res, None
