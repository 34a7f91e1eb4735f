"""``attnkit.flex_attention``: FlexAttention's signature on attnkit's engines, forward and backward on the CPU.

Shape legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
D head dim, Dv value head dim; a ``BlockMask`` cuts the ``(L, S)`` scores into blocks of
``BLOCK_SIZE = (BM, BN)``.

A torch ``BlockMask`` becomes an attnkit :class:`~attnkit.plans.BlockPlan` with the block
mask's own tiles and the meaning FlexAttention's kernels give it::

    attended(b, h, i, j) =  block (i // BM, j // BN) is full                        (full_kv_*)
                         or block (i // BM, j // BN) is partial and mask_mod(b, h, i, j)   (kv_*)

A block in neither list is skipped, whatever ``mask_mod`` says there. For a block mask made by
``create_block_mask`` (torch's or attnkit's) that is exactly ``mask_mod``; for one assembled
from blocks (``BlockMask.from_kv_blocks`` with no ``mask_mod``) it is the blocks. The tiled
backend runs the plan's tiles as given: empty blocks skipped, full ones unmasked.
"""

from __future__ import annotations

import warnings

import torch

from . import _mods
from ._blockmask import block_mask_plan, is_block_mask
from .api import attention

__all__ = ["flex_attention"]

# torch's kernel_options (FlexKernelOptions), each with why attnkit may ignore it: none changes which
# positions attend or what is computed, only how torch's GPU kernels do it (or their rounding).
_TUNING = ("tune torch's own kernels (tile sizes, launch, kernel choice); attnkit picks its own "
           "(attnkit.dispatch(...) says which)")
_KERNEL_OPTIONS = {
    **dict.fromkeys(("num_warps", "num_stages", "BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2",
                     "BLOCK_N2", "WRITE_DQ", "USE_TMA", "kpack", "matrix_instr_nonkdim", "waves_per_eu",
                     "FORCE_USE_FLEX_ATTENTION", "BACKEND"), _TUNING),
    "PRESCALE_QK": "torch's cheaper rounding (q scaled before q·kᵀ); attnkit's result differs by rounding only",
    "ROWS_GUARANTEED_SAFE": "a promise that no row is fully masked, so torch may skip a check; attnkit needs none "
                            "(a fully masked row gives 0 either way)",
    "BLOCKS_ARE_CONTIGUOUS": "a promise about the block layout, so torch may skip work; attnkit needs none",
}
_BACKENDS = ("AUTO", "TRITON", "FLASH", "TRITON_DECODE")
_INTERNAL_OPTIONS = ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX")
_WARNED: set[frozenset] = set()  # the sets of kernel_options keys already warned about (once per process)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    r"""Drop-in for ``torch.nn.attention.flex_attention.flex_attention``, with a backward on the CPU.

    Change one import and a FlexAttention model trains on the CPU::

        from torch.nn.attention.flex_attention import flex_attention   # before
        from attnkit import flex_attention                              # after

    The same signature, defaults and results as torch 2.13's ``flex_attention`` (eager, or
    ``torch.compile``-d); it runs :func:`attnkit.attention` (``backend="auto"``, so
    :func:`attnkit.dispatch` says which engine), which differentiates every input, including
    tensors a ``score_mod`` captures (a learnable bias table).

    Shape legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
    D head dim, Dv value head dim.

    Args:
        query: ``(B, H, L, D)`` torch tensor.
        key: ``(B, Hkv, S, D)``; ``Hkv != H`` needs ``enable_gqa=True`` (query head ``h`` uses
            kv head ``h // (H // Hkv)``). ``B`` may be 1 where ``block_mask`` has ``B`` rows (torch's rule).
        value: ``(B, Hkv, S, Dv)``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` on the scaled scores.
        block_mask: a torch ``BlockMask`` built for ``(L, S)``, by torch's ``create_block_mask``,
            :func:`attnkit.create_block_mask` or ``BlockMask.from_kv_blocks``. Its blocks count as
            in FlexAttention's kernels: a block in neither its partial nor its full list is skipped,
            a full block is attended without ``mask_mod``, ``mask_mod`` decides inside a partial one
            (torch's non-compiled CPU path evaluates ``mask_mod`` everywhere instead; the two agree
            for every block mask ``create_block_mask`` builds). None: no mask.
        scale: multiplier of ``q kᵀ``; default ``1/√D``.
        enable_gqa: allow ``Hkv != H`` (grouped-query attention), as in torch.
        return_lse: also return ``lse (B, H, L)`` (torch deprecates it for ``return_aux``; attnkit
            keeps it without a warning).
        kernel_options: torch's ``FlexKernelOptions``. None of them changes which positions attend;
            they tune torch's own kernels, so attnkit ignores them, listing them in one
            ``UserWarning`` per set of keys: ``num_warps``, ``num_stages``, ``BLOCK_M``, ``BLOCK_N``,
            ``BLOCK_M1``, ``BLOCK_N1``, ``BLOCK_M2``, ``BLOCK_N2`` (also with a ``fwd_`` / ``bwd_``
            prefix), ``WRITE_DQ``, ``USE_TMA``, ``kpack``, ``matrix_instr_nonkdim``,
            ``waves_per_eu``, ``FORCE_USE_FLEX_ATTENTION``, ``BACKEND`` (tuning and kernel choice);
            ``PRESCALE_QK`` (torch's cheaper rounding; attnkit's differs by rounding only);
            ``ROWS_GUARANTEED_SAFE``, ``BLOCKS_ARE_CONTIGUOUS`` (promises that let torch skip
            checks; attnkit needs none); under ``torch.compile`` the keys are checked the same way and
            the warning is left to eager calls. An unknown key, or torch's internal ``OUTPUT_LOGSUMEXP`` /
            ``OUTPUT_MAX``, raises ``ValueError`` naming it, as does a ``BACKEND`` torch would refuse.
        return_aux: None, or torch's ``AuxRequest``: ``AuxRequest(lse=True)`` returns
            ``(out, AuxOutput(lse=lse, max_scores=None))``. ``max_scores=True`` raises ``ValueError``
            (attnkit does not compute the row maxima; torch's CPU path does not either).

    Returns:
        ``out (B, H, L, Dv)`` in the inputs' dtype; ``(out, lse)`` with ``return_lse``;
        ``(out, AuxOutput)`` with ``return_aux``. ``lse (B, H, L)`` is the natural-log
        log-sum-exp of each row's scores (float32 for fp16/bf16 inputs, as torch's). A fully masked
        row gives output 0 and lse -inf, with zero gradients.

    Raises:
        TypeError: a wrong kind of argument (not a tensor, not a BlockMask, not an AuxRequest).
        ValueError: sizes that disagree (a ``block_mask`` built for another ``(L, S)``: the message
            names both; ``Hkv != H`` without ``enable_gqa``), an unknown ``kernel_options`` key,
            ``return_lse`` with ``return_aux``, ``max_scores``.
    """
    _check_kernel_options(kernel_options)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}. "
                            "For NumPy arrays use attnkit.attention(q, k, v, ...).")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor (B, H, L, D) as FlexAttention takes, got shape "
                             f"{tuple(t.shape)}. For (H, L, D) or (L, D) inputs use attnkit.attention, or "
                             f"add the batch dim with {name}.unsqueeze(0).")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa: expected True or False, got {enable_gqa!r}.")
    H, Hkv = query.shape[1], key.shape[1]
    if H != Hkv and not enable_gqa:
        raise ValueError(f"enable_gqa: query has H={H} heads and key has Hkv={Hkv}, which needs enable_gqa=True "
                         f"(grouped-query attention, as torch's flex_attention asks). Pass enable_gqa=True, or "
                         f"give key and value {H} heads.")
    want_lse = _check_aux(return_lse, return_aux)
    B, L, S = query.shape[0], query.shape[2], key.shape[2]
    if block_mask is not None and not is_block_mask(block_mask):
        raise TypeError(f"block_mask: expected a torch BlockMask (from create_block_mask) or None, got "
                        f"{type(block_mask).__name__}. Build one with attnkit.create_block_mask(mask_mod, B, H, "
                        f"L, S), or pass a mask_mod to attnkit.attention(..., mask=mask_mod).")
    if key.shape[0] != B and key.shape[0] == 1 and value.shape[0] == 1 and block_mask is not None \
            and block_mask.kv_num_blocks.shape[0] == B:
        key, value = key.expand(B, -1, -1, -1), value.expand(B, -1, -1, -1)  # torch's rule: one key row for all
    if (torch.compiler.is_compiling() or torch._C._is_tracing()) and query.is_cpu:
        # traced on the CPU: one call of attnkit's torch op, the block mask's tensors among its inputs (attnkit._op),
        # so torch.compile(fullgraph=True) has no graph break here
        res = attention(query, key, value, mask=block_mask, score_mod=score_mod, scale=scale, return_lse=want_lse)
    else:
        res = _run(query, key, value, block_mask, score_mod, scale, want_lse)
    if return_aux is None:
        return res
    from torch.nn.attention.flex_attention import AuxOutput

    out, lse = res if want_lse else (res, None)
    return out, AuxOutput(lse=lse, max_scores=None)


def _run(query, key, value, block_mask, score_mod, scale, want_lse):
    """The eager call: the block mask read into a plan (kept by content), then :func:`attnkit.attention` (on a GPU
    its dispatch may pick torch's own kernels, so compiled code calls this eagerly off the CPU)."""
    B, H, L, S = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    mask = None if block_mask is None else block_mask_plan(block_mask, B, H, L, S, query.device, "block_mask")
    return attention(query, key, value, mask=mask, score_mod=score_mod, scale=scale, return_lse=want_lse)


_mods.opaque_to_torch_compile(_run, "attnkit.flex_attention off the CPU runs attnkit's dispatch eagerly")


def _check_aux(return_lse, return_aux) -> bool:
    """Whether lse is wanted; refuses what attnkit cannot return."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected True or False, got {return_lse!r}.")
    if return_aux is None:
        return return_lse
    from torch.nn.attention.flex_attention import AuxRequest

    if not isinstance(return_aux, AuxRequest):
        raise TypeError(f"return_aux: expected None or torch's AuxRequest (from torch.nn.attention.flex_attention "
                        f"import AuxRequest), got {type(return_aux).__name__}.")
    if return_lse:
        raise ValueError("return_lse, return_aux: expected one of them, got both (as torch refuses). "
                         "Pass return_aux=AuxRequest(lse=True) alone.")
    if return_aux.max_scores:
        raise ValueError("return_aux: attnkit returns lse but not the row maxima, got AuxRequest(max_scores=True). "
                         "Pass AuxRequest(lse=True); the weights' largest entry per row is "
                         "attnkit.attention(..., return_weights=True)[1].amax(-1).")
    return bool(return_aux.lse)


def _check_kernel_options(kernel_options) -> None:
    """Refuse unknown keys; warn once per set of keys that attnkit ignores the known ones."""
    if kernel_options is None:
        return
    if not hasattr(kernel_options, "keys") or not hasattr(kernel_options, "__getitem__"):
        raise TypeError(f"kernel_options: expected a dict (torch's FlexKernelOptions) or None, "
                        f"got {type(kernel_options).__name__}.")
    keys = list(kernel_options.keys())
    for k in keys:
        base = k[4:] if isinstance(k, str) and k.startswith(("fwd_", "bwd_")) else k
        if k in _INTERNAL_OPTIONS:
            raise ValueError(f"kernel_options: {k!r} is torch's internal option, not one a caller sets (torch "
                             "refuses it too). Ask for the log-sum-exp with return_aux=AuxRequest(lse=True).")
        if base not in _KERNEL_OPTIONS:
            raise ValueError(f"kernel_options: unknown key {k!r}. Expected torch's FlexKernelOptions keys "
                             f"({', '.join(sorted(_KERNEL_OPTIONS, key=str.lower))}; each also with a fwd_ / bwd_ "
                             "prefix). attnkit does not ignore an option it does not know: it could "
                             "change the result. Remove it or fix its spelling.")
    if "BACKEND" in kernel_options:
        if kernel_options["BACKEND"] not in _BACKENDS:
            raise ValueError(f"kernel_options: BACKEND must be one of {_BACKENDS} (as torch checks), got "
                             f"{kernel_options['BACKEND']!r}.")
        if kernel_options.get("FORCE_USE_FLEX_ATTENTION", False):
            raise ValueError("kernel_options: BACKEND and FORCE_USE_FLEX_ATTENTION together, which torch refuses "
                             "(BACKEND supersedes it). Keep only BACKEND.")
    if torch.compiler.is_compiling():  # the keys are checked above; the once-per-set notice is an eager call's
        return                          # (TorchDynamo cannot trace warnings.warn: fullgraph=True would fail on it)
    seen = frozenset(keys)
    if not seen or seen in _WARNED:
        return
    _WARNED.add(seen)
    why: dict[str, list[str]] = {}
    for k in sorted(keys):
        why.setdefault(_KERNEL_OPTIONS[k[4:] if k.startswith(("fwd_", "bwd_")) else k], []).append(k)
    lines = "; ".join(f"{', '.join(ks)}: {reason}" for reason, ks in why.items())
    warnings.warn(f"kernel_options: attnkit ignores {', '.join(sorted(keys))}, which only tune how torch computes "
                  f"the same result. {lines}. (Shown once for this set of keys.)", UserWarning, stacklevel=3)

