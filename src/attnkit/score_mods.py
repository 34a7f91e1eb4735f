"""Score modifiers with FlexAttention's signature ``score_mod(score, b, h, q_idx, kv_idx)``.

They act on the *scaled* scores (after ``q kᵀ · scale``), before any bias or mask.
Indices are broadcasting integer tensors. Shape legend: H query heads.

The built-ins are :class:`ScoreMod` objects: plain callables with that signature (so
they port to FlexAttention unchanged), which also tell attnkit what it cannot see
in an opaque function — the sizes they are valid for (:meth:`ScoreMod.validate`),
the tensors they read (gradients flow into them), and their structure (an additive
bias ``f(h, kv - q)`` the fused kernel can take as a bias tile; softcap's derivative).
Any other function works too; attnkit then finds the tensors it captures itself
(closure, defaults, globals) and differentiates through it tile by tile.
"""

from __future__ import annotations

import math

import torch

from . import _mods

__all__ = ["ScoreMod", "alibi", "softcap", "relative_bias"]


def _float_vector(name: str, x) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected floats, got dtype {t.dtype}. Pass a float tensor or list of floats.")
    return t


class ScoreMod:
    """Base of attnkit's score mods. Subclasses define ``__call__(score, b, h, q_idx, kv_idx)``.

    * ``validate(B, H, L, S)`` raises ``ValueError`` when the mod does not fit the call;
    * ``tensors()`` lists the tensors it reads (a learnable ALiBi slope, a bias table):
      when they require grad, every backend that accepts the call returns their gradient;
    * ``additive_bias(h, q_idx, kv_idx, dtype, device)`` is ``f`` for mods of the form ``score + f`` (else None);
    * ``dscore(modified)`` is d(mod)/d(score) as a function of the modified score (or None:
      use autograd).
    """

    additive = False

    def validate(self, B: int, H: int, L: int, S: int) -> None:
        return None

    def cache_key(self):
        """A hashable key equal for mods that compute the same scores (their kind and the *content* of what they
        read), or None (no key: a call with it is decided afresh every time). A tensor that requires grad gives
        None: its gradient goes to this object."""
        return None

    def tensors(self) -> list[torch.Tensor]:
        return []

    def additive_bias(self, h, q_idx, kv_idx, dtype, device):  # pragma: no cover - only for additive mods
        raise NotImplementedError

    def dscore(self, modified: torch.Tensor) -> torch.Tensor | None:
        return None

    def on_device(self, device):
        """This mod as a plain ``score_mod`` whose tensors (slopes, a bias table) are already on ``device``, for
        FlexAttention's compiled GPU kernels, which load a captured tensor but cannot compile a copy made inside
        the mod. A mod reading no tensor is itself."""
        return self

    @property
    def analytic_grad(self) -> bool:
        """d(mod)/d(score) is known without autograd: 1 for an additive mod, else ``dscore``."""
        return self.additive or type(self).dscore is not ScoreMod.dscore

    @property
    def __name__(self) -> str:  # FlexAttention and error messages read a mod's __name__
        return str(type(self).__qualname__).lower()


class Alibi(ScoreMod):
    """``score + slopes[h] · (kv_idx − q_idx)``; see :func:`alibi`."""

    additive = True

    def __init__(self, slopes):
        slopes = _float_vector("slopes", slopes)
        if slopes.dim() != 1:
            raise ValueError(f"slopes: expected shape (H,), got {tuple(slopes.shape)}. Pass one slope per query head.")
        self.slopes = slopes

    def validate(self, B, H, L, S):
        if self.slopes.shape[0] != H:
            raise ValueError(
                f"alibi slopes: expected one slope per query head (H={H}), got {self.slopes.shape[0]}. "
                f"Build them with attnkit.positional.alibi_slopes({H})."
            )

    def tensors(self):
        return [self.slopes]

    def cache_key(self):
        c = None if self.slopes.requires_grad or type(self) is not Alibi else _mods.content_key(self.slopes)
        return None if c is None else ("alibi", c)  # a subclass's __call__ may compute something else: no key

    def additive_bias(self, h, q_idx, kv_idx, dtype, device):
        return self.slopes.to(device=device, dtype=dtype)[h] * (kv_idx - q_idx).to(dtype)

    def __call__(self, score, b, h, q_idx, kv_idx):
        sl = self.slopes.to(device=score.device, dtype=score.dtype)[h]
        return score + sl * (kv_idx - q_idx).to(score.dtype)

    def on_device(self, device):
        if type(self) is not Alibi:  # a subclass's __call__ may compute something else: itself
            return self
        slopes = self.slopes.to(device)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h].to(score.dtype) * (kv_idx - q_idx).to(score.dtype)

        return alibi

    def __repr__(self):
        return f"alibi(<{self.slopes.shape[0]} slopes>)"


class Softcap(ScoreMod):
    """``cap · tanh(score / cap)``; see :func:`softcap`."""

    def __init__(self, cap: float):
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (cap > 0 and math.isfinite(cap)):
            raise ValueError(f"cap: expected a positive finite float, got {cap!r}.")
        self.cap = float(cap)

    def dscore(self, modified):
        return 1 - (modified / self.cap) ** 2  # d/ds cap·tanh(s/cap) = 1 - tanh²

    def cache_key(self):
        return ("softcap", float.hex(self.cap)) if type(self) is Softcap else None  # a subclass: no key

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.cap * torch.tanh(score / self.cap)

    def __repr__(self):
        return f"softcap({self.cap:g})"


class RelativeBias(ScoreMod):
    """``score + table[h, clamp(kv_idx − q_idx, −R, R) + R]``; see :func:`relative_bias`."""

    additive = True

    def __init__(self, table):
        table = _float_vector("table", table)
        if table.dim() != 2 or table.shape[1] % 2 != 1:
            raise ValueError(
                f"table: expected shape (H, 2R + 1) (one row per query head, offsets -R..R), got {tuple(table.shape)}.")
        self.table = table
        self.R = (table.shape[1] - 1) // 2

    def validate(self, B, H, L, S):
        if self.table.shape[0] != H:
            raise ValueError(
                f"relative_bias table: expected one row per query head (H={H}), got {self.table.shape[0]} rows "
                f"(table shape {tuple(self.table.shape)}). Pass a table of shape ({H}, {self.table.shape[1]}); "
                f"for one bias shared by all heads use table.expand({H}, -1)."
            )

    def tensors(self):
        return [self.table]

    def cache_key(self):
        c = None if self.table.requires_grad or type(self) is not RelativeBias else _mods.content_key(self.table)
        return None if c is None else ("relative_bias", c)  # a subclass: no key

    def additive_bias(self, h, q_idx, kv_idx, dtype, device):
        rel = (kv_idx - q_idx).clamp(-self.R, self.R) + self.R
        return self.table.to(device=device, dtype=dtype)[h, rel]

    def __call__(self, score, b, h, q_idx, kv_idx):
        rel = (kv_idx - q_idx).clamp(-self.R, self.R) + self.R
        return score + self.table.to(device=score.device, dtype=score.dtype)[h, rel]

    def on_device(self, device):
        if type(self) is not RelativeBias:  # a subclass's __call__ may compute something else: itself
            return self
        table, R = self.table.to(device), self.R

        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + table[h, (kv_idx - q_idx).clamp(-R, R) + R].to(score.dtype)

        return relative_bias

    def __repr__(self):
        return f"relative_bias(<table {tuple(self.table.shape)}>)"


# attnkit's own score mods: immutable values whose ``cache_key()`` fixes what they compute (a subclass, whose
# ``__call__`` may compute something else under the same key, is not one of them)
BUILT_IN = frozenset((Alibi, Softcap, RelativeBias))


def builtin_key(score_mod):
    """A built-in score mod's content key (``ScoreMod.cache_key``), or None for anything else and for one that has
    none (learned slopes or table: a tensor that requires grad, whose values change under an optimizer)."""
    if type(score_mod) not in BUILT_IN:
        return None
    key = score_mod.cache_key()
    return None if key is None else ("score_mod", type(score_mod).__name__, key)


def alibi(slopes) -> ScoreMod:
    """ALiBi (Press et al., 2022): ``score + slopes[h] * (kv_idx - q_idx)``.

    ``slopes``: ``(H,)`` per-head slopes (see :func:`attnkit.positional.alibi_slopes`);
    a slope tensor that requires grad is learned (gradients reach it on every backend).
    The bias is 0 on the diagonal and grows more negative with distance::

        h=0, slope=0.5:   k0   k1   k2
                     q2  -1.0 -0.5  0.0

    Pair it with ``causal=True`` as in the paper (keys after the query get a
    positive bias otherwise).
    """
    return Alibi(slopes)


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping (Gemma 2): ``cap * tanh(score / cap)`` keeps scores in (-cap, cap)."""
    return Softcap(cap)


def relative_bias(table) -> ScoreMod:
    """Learned relative-position bias (T5-style, unbucketed): ``score + table[h, kv_idx - q_idx + R]``.

    ``table``: ``(H, 2R + 1)`` — one bias per query head and relative offset in ``[-R, R]``;
    offsets beyond ``R`` are clamped to the edge entries. A table that requires grad is
    learned (gradients reach it on every backend)::

        R = 1, h = 0, table[0] = [a, b, c]:    k0 k1 k2
                                           q1   a  b  c     (offsets -1, 0, +1)

    ``q_idx`` is the row's index in *this call's* queries (FlexAttention's convention), not its
    position in the sequence: a decode step's one query over S cached keys is ``q_idx = 0``,
    while ``causal=True`` places it at position S - 1 (bottom-right). For a call whose queries
    are the last L of S positions (KV-cache decoding, chunked prefill), shift the index yourself::

        off = S - L
        score_mod = lambda s, b, h, q, kv: s + table[h, (kv - (q + off)).clamp(-R, R) + R]

    (ALiBi needs no shift: its bias moves by a constant per row, which softmax ignores.)
    """
    return RelativeBias(table)
