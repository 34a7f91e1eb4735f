"""Positional encodings: absolute (sinusoidal, learned), rotary (RoPE) and ALiBi slopes.

Shape legend: B batch, H heads, L sequence length, D head dim, E (d_model) embedding size.

Where each one acts::

    tokens ─► embed (B, L, E) ─► + SinusoidalPositionalEncoding / LearnedPositionalEmbedding
                                  │  (absolute: added once, before the first block)
                                  ▼
              q, k (B, H, L, D) ─► RotaryEmbedding.rotate(·, offset)   (relative, in every layer)
                                  ▼
              scores (B, H, L, S) ─► score_mods.alibi(alibi_slopes(H))  (relative bias, every layer)

``offset`` is the absolute position of the first of the ``L`` rows; during KV-cache
decoding it is the number of tokens already cached.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._args import as_int

__all__ = [
    "sinusoidal",
    "SinusoidalPositionalEncoding",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "alibi_slopes",
]


# Shared validators for attnkit.positional and attnkit.nn (one copy, here: this module imports
# nothing from attnkit, and attnkit.nn imports it, so keeping them here cannot create an import cycle).
# Wrong type -> TypeError, right type with a bad value -> ValueError.


def _check_pos_int(name: str, value) -> int:
    n = as_int(value)
    if n is None:
        raise TypeError(f"{name}: expected a positive int, got {type(value).__name__} {value!r}.")
    value = n
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}.")
    return value


def _check_base(base, *, minimum: float = 0.0, default: float = 10000.0) -> float:
    """A finite real ``base > minimum`` (the wavelength base of sinusoidal / rotary encodings)."""
    if isinstance(base, bool) or not isinstance(base, (int, float)):
        raise TypeError(f"base: expected a finite float > {minimum:g} (default {default:g}), "
                        f"got {type(base).__name__} {base!r}.")
    if not (math.isfinite(base) and base > minimum):
        raise ValueError(f"base: expected a finite float > {minimum:g} (default {default:g}), got {base!r}.")
    return float(base)


def _check_offset(offset) -> int:
    n = as_int(offset)
    if n is None:
        raise TypeError("offset: expected an int >= 0 (position of the first row), got "
                        f"{type(offset).__name__} {offset!r}.")
    offset = n
    if offset < 0:
        raise ValueError(f"offset: expected an int >= 0 (position of the first row), got {offset}.")
    return offset


def _check_ble(x, E: int, who: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor (B, L, E), got {type(x).__name__}.")
    if x.dim() != 3 or x.shape[-1] != E:
        raise ValueError(
            f"x: expected shape (B, L, E={E}) for {who}, got {tuple(x.shape)}. "
            "Pass batch-first embeddings (add a batch dim with x.unsqueeze(0))."
        )


def sinusoidal(length: int, d_model: int, *, base: float = 10000.0, dtype=torch.float32) -> torch.Tensor:
    """The Transformer paper's encoding, ``(length, d_model)``:

        PE(pos, 2i)   = sin(pos / base^(2i / d_model))
        PE(pos, 2i+1) = cos(pos / base^(2i / d_model))

    ``i`` counts dimension *pairs*. (Code that raises base to ``2*i/d_model`` while
    its ``i`` already steps by 2 doubles the exponent; for d_model = 4 the
    correct PE(1, 2) is sin(0.01) ≈ 0.0100, not sin(0.0001).)

    Computed in float64 and rounded once to ``dtype``. ``length`` and ``d_model`` are
    positive ints (``d_model`` even); ``base`` is a finite float > 0.
    """
    length = _check_pos_int("length", length)
    d_model = _check_pos_int("d_model", d_model)
    if d_model % 2:
        raise ValueError(f"d_model: expected an even size (sin/cos pairs), got {d_model}.")
    base = _check_base(base)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype (sin/cos values in [-1, 1]), got {dtype!r}.")
    pos = torch.arange(length, dtype=torch.float64).unsqueeze(1)  # (L, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # 2i = 0, 2, 4, ...
    angle = pos / base ** (two_i / d_model)  # (L, E/2)
    pe = torch.empty(length, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe.to(dtype)


class SinusoidalPositionalEncoding(nn.Module):
    """Adds :func:`sinusoidal` to batch-first embeddings: ``x (B, L, E) + PE[offset : offset + L]``.

    No parameters and no length limit: the table is computed in float64 and grown
    on demand. It is deliberately *not* a buffer: it is not saved in ``state_dict``
    and ``module.half()`` / ``.to(dtype)`` do not round it; each call rounds the
    float64 table once to the dtype (and device) of ``x``, which must be floating.
    ``offset`` is the position of the first row (the cache length when decoding token by token).
    """

    def __init__(self, embed_dim: int, *, base: float = 10000.0):
        super().__init__()
        self.embed_dim = _check_pos_int("embed_dim", embed_dim)
        if embed_dim % 2:
            raise ValueError(f"embed_dim: expected an even size (sin/cos pairs), got {embed_dim}. "
                             "Use an even embed_dim.")
        self.base = _check_base(base)
        self._table = sinusoidal(1, embed_dim, base=self.base, dtype=torch.float64)  # (n, E) float64, CPU
        self._rounded: dict = {}  # (device, dtype) -> the table rounded once to that dtype on that device

    def _table_as(self, end: int, like: torch.Tensor) -> torch.Tensor:
        if end > self._table.shape[0]:  # grow geometrically so decoding does not recompute every step
            n = max(end, 2 * self._table.shape[0])
            self._table = sinusoidal(n, self.embed_dim, base=self.base, dtype=torch.float64)
            self._rounded.clear()
        key = (like.device, like.dtype)
        if key not in self._rounded:  # float64 -> x's dtype on the CPU (MPS has no float64), then move
            self._rounded[key] = self._table.to(dtype=like.dtype).to(device=like.device)
        return self._rounded[key]

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        _check_ble(x, self.embed_dim, "SinusoidalPositionalEncoding")
        if not x.is_floating_point():
            raise TypeError(f"x: expected floating embeddings (B, L, E), got {x.dtype}. Embed the tokens first.")
        offset = _check_offset(offset)
        end = offset + x.shape[1]
        return x + self._table_as(end, x)[offset:end]  # (B, L, E), in x's dtype

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, base={self.base:g}"


class LearnedPositionalEmbedding(nn.Module):
    """A learned table ``weight (max_length, E)`` added to ``x (B, L, E)`` at ``offset``.

    Positions ``offset .. offset + L - 1`` must be ``< max_length``; beyond that a
    ``ValueError`` is raised (nothing is truncated or wrapped around). ``x`` must have
    the table's dtype and device (``TypeError`` otherwise; convert the module with
    ``.to(...)``): nothing is cast silently, so bf16 in is bf16 out.
    """

    def __init__(self, max_length: int, embed_dim: int):
        super().__init__()
        self.max_length = _check_pos_int("max_length", max_length)
        self.embed_dim = _check_pos_int("embed_dim", embed_dim)
        self.weight = nn.Parameter(torch.empty(max_length, embed_dim))
        nn.init.normal_(self.weight, std=0.02)  # GPT-2's initialisation for position tables

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        _check_ble(x, self.embed_dim, "LearnedPositionalEmbedding")
        w = self.weight
        if x.dtype != w.dtype or x.device != w.device:
            raise TypeError(
                f"x: expected {w.dtype} on {w.device} (the table's dtype and device), got {x.dtype} on {x.device}. "
                "Convert the module (emb.to(x.dtype)) or the input; nothing is cast silently."
            )
        offset = _check_offset(offset)
        end = offset + x.shape[1]
        if end > self.max_length:
            raise ValueError(
                f"x: positions {offset}..{end - 1} exceed max_length={self.max_length} of this "
                f"LearnedPositionalEmbedding (offset={offset}, L={x.shape[1]}). Build it with "
                f"max_length >= {end}, or use SinusoidalPositionalEncoding / RoPE, which have no limit."
            )
        return x + self.weight[offset:end]  # (B, L, E)

    def extra_repr(self) -> str:
        return f"max_length={self.max_length}, embed_dim={self.embed_dim}"


class RotaryEmbedding(nn.Module):
    r"""Rotary position embedding (RoPE, Su et al. 2021), applied to q and k of shape ``(B, H, L, D)``.

    Dimension pair ``i`` (of ``D/2``) at position ``p`` is rotated by the angle
    ``p · θ_i`` with ``θ_i = base^(-2i/D)``. Then ``q_m · k_n`` depends only on
    ``m - n``: relative position from an absolute rotation.

    Which dimensions form pair ``i``::

        interleaved=False (rotate half; GPT-NeoX, Llama):  (x[i], x[i + D/2])
            [x0 x1 x2 x3 | x4 x5 x6 x7]   pairs (0,4) (1,5) (2,6) (3,7)
        interleaved=True (GPT-J, the paper's layout):       (x[2i], x[2i + 1])
            [x0 x1|x2 x3|x4 x5|x6 x7]     pairs (0,1) (2,3) (4,5) (6,7)

    Each pair ``(a, b)`` becomes ``(a cos − b sin, a sin + b cos)``.
    Angles are computed in float64 and rounded once to the input dtype.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, interleaved: bool = False):
        super().__init__()
        self.head_dim = _check_pos_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(
                f"head_dim: RoPE rotates pairs of dimensions, so it needs an even head_dim, got {head_dim}. "
                f"Use head_dim {head_dim - 1} or {head_dim + 1}."
            )
        base = _check_base(base, minimum=1.0)
        if not isinstance(interleaved, bool):
            raise TypeError(f"interleaved: expected True or False, got {interleaved!r}.")
        self.base = float(base)
        self.interleaved = interleaved
        # cos/sin of positions 0..n-1, grown on demand (decoding reads one row per step). Keyed
        # by everything the values depend on (head_dim, base, dtype, device), so a changed
        # attribute can never read a stale table; each row is computed exactly as rotate would.
        self._tables: dict = {}

    def _table(self, n: int, dtype, device):
        """``(cos, sin)`` rows ``(≥ n, D/2)`` and, for the half-split layout, ``(C, S)`` rows
        ``(≥ n, D)`` with ``C = [cos, cos]``, ``S = [-sin, sin]`` (see :meth:`rotate`)."""
        key = (self.head_dim, self.base, dtype, device)
        tracing = torch._C._is_tracing()  # torch.jit.trace: no cache, whose rows it would record as constants
        hit = None if tracing else self._tables.get(key)
        if hit is None or hit[0].shape[0] < n:
            size = n if tracing else max(n, 2 * (hit[0].shape[0] if hit is not None else 0), 256)
            fdt = torch.float32 if torch.device(device).type == "mps" else torch.float64
            ang = self._angles(torch.arange(size, dtype=fdt, device=device))
            cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
            hit = (cos, sin, torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))
            if not tracing:
                self._tables = {key: hit}
        return hit

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions (...)`` float64 -> angles ``(..., D/2)``."""
        two_i = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=positions.device)
        inv_freq = self.base ** (-two_i / self.head_dim)  # θ_i, (D/2,)
        return positions.unsqueeze(-1) * inv_freq

    def rotate(self, x: torch.Tensor, offset=0, *, positions=None) -> torch.Tensor:
        """Rotate ``x (..., L, D)`` as if its rows sat at positions ``offset + 0 .. offset + L - 1``.

        ``offset`` is an int, or an integer tensor ``(B,)`` (one start per batch row,
        for left-padded batches) when ``x`` is ``(B, H, L, D)``. ``positions``: an integer
        tensor ``(L,)`` of arbitrary positions instead (a context-parallel shard's rows).
        """
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x: expected a floating torch.Tensor (B, H, L, D), got {type(x).__name__}"
                            f"{' of ' + str(x.dtype) if isinstance(x, torch.Tensor) else ''}.")
        if x.dim() < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x: expected shape (..., L, D={self.head_dim}), got {tuple(x.shape)}. "
                "RotaryEmbedding(head_dim) must be built with the head dim of q and k."
            )
        L = x.shape[-2]
        if positions is None and type(offset) is int and offset >= 0 and not self.interleaved:
            # the decoding case: rows off .. off + L - 1 of the cached table, in 4 ops;
            # x·[cos, cos] + [b, a]·[-sin, sin] = [a cos - b sin, b cos + a sin], the same
            # products and sums (negation is exact) as the general path below
            _, _, C, Sn = self._table(offset + L, x.dtype, x.device)
            half = self.head_dim // 2
            swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # [b, a]
            return x * C[offset:offset + L] + swapped * Sn[offset:offset + L]
        # float64 angles where the device has it (MPS does not)
        fdt = torch.float32 if x.device.type == "mps" else torch.float64
        if positions is not None:
            if not isinstance(offset, int) or offset != 0:
                raise ValueError(f"offset: expected none (0) with positions=, got {offset!r}: positions are the "
                                 "rows' own positions. Add the offset to them instead (positions + offset).")
            if (not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex()
                    or positions.dtype == torch.bool or positions.dim() != 1 or positions.shape[0] != L):
                raise ValueError(f"positions: expected an integer tensor of shape (L,) = ({L},), got "
                                 f"{getattr(positions, 'dtype', type(positions).__name__)} "
                                 f"{tuple(getattr(positions, 'shape', ()))}.")
            ang = self._angles(positions.to(device=x.device, dtype=fdt))  # (L, D/2)
            cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        elif isinstance(offset, torch.Tensor):
            steps = torch.arange(L, dtype=fdt, device=x.device)
            if (offset.is_floating_point() or offset.is_complex() or offset.dtype == torch.bool or offset.dim() != 1
                    or x.dim() != 4 or offset.shape[0] != x.shape[0]):
                raise ValueError(
                    f"offset: a tensor offset must be integer with shape (B,) = ({x.shape[0]},) for x (B, H, L, D), "
                    f"got {offset.dtype} {tuple(offset.shape)} with x {tuple(x.shape)}. Pass an int for one offset."
                )
            if (offset < 0).any():
                raise ValueError(f"offset: expected offsets >= 0, got {offset.tolist()}.")
            pos = offset.to(device=x.device, dtype=fdt).unsqueeze(1) + steps  # (B, L)
            ang = self._angles(pos).unsqueeze(1)  # (B, 1, L, D/2)
            cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        else:
            off = _check_offset(offset)
            cos, sin, _, _ = self._table(off + L, x.dtype, x.device)
            cos, sin = cos[off:off + L], sin[off:off + L]  # (L, D/2), the rows rotate would compute
        if self.interleaved:
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        half = self.head_dim // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    def forward(self, x: torch.Tensor, offset=0) -> torch.Tensor:
        """Same as :meth:`rotate`."""
        return self.rotate(x, offset)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}, interleaved={self.interleaved}"


def alibi_slopes(num_heads: int, *, dtype=torch.float32) -> torch.Tensor:
    """ALiBi head slopes ``(H,)`` (Press et al., 2022), for :func:`attnkit.score_mods.alibi`.

    For ``n`` a power of two the slopes are the geometric sequence
    ``2^(-8/n), 2^(-16/n), ..., 2^(-8)`` (8 heads: 1/2, 1/4, ..., 1/256).
    Otherwise, as in the paper's reference code, take the ``m`` slopes of the
    closest power of two ``m < n``, then the first ``n - m`` of every other slope
    of ``2m`` heads (which interleave between them)::

        6 heads = slopes(4) + slopes(8)[0::2][:2]
                = [1/4, 1/16, 1/64, 1/256] + [1/2, 1/8]
    """
    num_heads = _check_pos_int("num_heads", num_heads)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"dtype: expected a floating dtype for the slopes (all below 1), got {dtype!r}. Pass e.g. "
                        "dtype=torch.float32.")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    m = 1 << (num_heads.bit_length() - 1)  # largest power of two <= num_heads
    slopes = power_of_two(m)
    if m != num_heads:
        slopes += power_of_two(2 * m)[0::2][: num_heads - m]
    return torch.tensor(slopes, dtype=torch.float64).to(dtype)
