"""Plain-text tables for traces and matrices (the CLI and ``str(Trace)``)."""

from __future__ import annotations

import numpy as np

__all__ = ["format_matrix", "format_trace", "trace_repr", "display_width", "rjust"]


def display_width(text: str) -> int:
    """Columns ``text`` takes in a terminal: 2 for a wide character (CJK, most emoji), 0 for a combining mark."""
    import unicodedata

    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def rjust(text: str, width: int) -> str:
    """``text`` right-aligned in ``width`` terminal columns (``str.rjust`` counts characters, not columns)."""
    return " " * max(0, width - display_width(text)) + text


def format_number(x: float, prec: int = 4) -> str:
    """A score or weight as text: fixed ``prec`` decimals, or -inf / inf / nan (tables and pages alike).

    A magnitude of a million or more is written in scientific notation (``1.0000e+200``), so one large input
    does not widen every column of its table to hundreds of digits.
    """
    if np.isneginf(x):
        return "-inf"
    if np.isposinf(x):
        return "inf"
    if np.isnan(x):
        return "nan"
    if abs(x) >= 1e6:
        return f"{x:.{prec}e}"
    return f"{x:.{prec}f}"


def format_matrix(m, row_labels=None, col_labels=None, prec: int = 4) -> str:
    m = np.asarray(m, dtype=np.float64)
    if m.ndim == 1:
        m = m[None]
    if m.size == 0:
        return f"(empty {m.shape[0]}×{m.shape[1]} matrix)"
    rows = row_labels or [f"q{i}" for i in range(m.shape[0])]
    cols = col_labels or [f"k{j}" for j in range(m.shape[1])]
    cells = [[format_number(x, prec) for x in r] for r in m]
    w = max([len(c) for c in cols] + [len(c) for r in cells for c in r])
    rw = max(len(r) for r in rows)
    out = [" " * rw + " │ " + " ".join(c.rjust(w) for c in cols), "─" * rw + "─┼─" + "─" * ((w + 1) * len(cols) - 1)]
    for lab, r in zip(rows, cells, strict=True):
        out.append(lab.rjust(rw) + " │ " + " ".join(c.rjust(w) for c in r))
    return "\n".join(out)


def _as_rank4(t):
    """A view of trace ``t`` with (B, H, L, S)-shaped arrays, whatever its rank."""
    from types import SimpleNamespace

    lead = 4 - t.scores.ndim
    if lead == 0:
        return t
    up = lambda a: np.asarray(a).reshape((1,) * lead + np.shape(a))  # noqa: E731
    return SimpleNamespace(q=up(t.q), k=up(t.k), v=up(t.v), scale=t.scale, scores=up(t.scores), scaled=up(t.scaled),
                           masked=up(t.masked), weights=up(t.weights), output=up(t.output),
                           has_mask=t.has_mask)


def format_trace(t, b: int = 0, h: int = 0, tokens=None, prec: int = 4, q_tokens=None, k_tokens=None,
                 inputs: bool = False) -> str:
    """The trace of batch ``b``, head ``h`` as numbered tables (tokens label rows/columns).

    ``inputs``: first show Q, K and V (step 0). Q and K columns are the head dims ``d0…``;
    V's and the output's columns are the value dims ``dv0…``.

    ``t``'s arrays may have any rank the rank rule gives: scores (L, S), (H, L, S) or
    (B, H, L, S) with output (…, L, Dv); ``b`` and ``h`` pick from the dims that exist.
    """
    rank = np.ndim(t.scores)
    if rank == 3:  # (H, L, S): the head is the only leading dim
        b = 0
    t = _as_rank4(t)
    L, S = t.scores.shape[-2:]
    Dv = t.output.shape[-1]
    q_tokens, k_tokens = q_tokens or tokens, k_tokens or tokens
    qlab = list(q_tokens) if q_tokens and len(q_tokens) == L else None
    klab = list(k_tokens) if k_tokens and len(k_tokens) == S else None
    dk = t.q.shape[-1]
    parts = []
    if rank == 3 and t.scores.shape[1] > 1:
        parts.append(f"(head {h} of H={t.scores.shape[1]})")
    elif rank == 4 and t.scores.shape[0] * t.scores.shape[1] > 1:
        parts.append(f"(batch {b}, head {h} of B={t.scores.shape[0]}, H={t.scores.shape[1]})")
    dv = [f"dv{j}" for j in range(Dv)]
    if inputs:
        dl = [f"d{j}" for j in range(dk)]
        parts += [f"0. Inputs  Q ({L}×{dk}), K ({S}×{dk}), V ({S}×{Dv})",
                  "Q", format_matrix(t.q[b, h], qlab, dl, prec),
                  "K", format_matrix(t.k[b, h], klab or [f"k{j}" for j in range(S)], dl, prec),
                  "V", format_matrix(t.v[b, h], klab or [f"k{j}" for j in range(S)], dv, prec), ""]
    parts += [
        "1. Raw scores  Q·Kᵀ", format_matrix(t.scores[b, h], qlab, klab, prec),
        f"2. Scaled scores  Q·Kᵀ × {t.scale:.6g}" + (f"  (= 1/√{dk})" if abs(t.scale - dk ** -0.5) < 1e-12 else ""),
        format_matrix(t.scaled[b, h], qlab, klab, prec),
    ]
    if t.has_mask or not np.array_equal(t.masked, t.scaled):
        parts += ["3. Masked / modified scores  (-inf = not attended)", format_matrix(t.masked[b, h], qlab, klab, prec)]
    n = 4 if any(p.startswith("3. Masked") for p in parts) else 3
    parts += [f"{n}. Weights  softmax per row (each row sums to 1; a fully masked row is 0)",
              format_matrix(t.weights[b, h], qlab, klab, prec),
              f"{n + 1}. Output  weights · V", format_matrix(t.output[b, h], qlab, dv, prec)]
    return "\n".join(parts)


def trace_repr(t) -> str:
    """The plain ``repr`` of a trace: its sizes, not its arrays."""
    L, S = np.shape(t.scores)[-2:]
    lead = np.shape(t.scores)[:-2]
    D, Dv = np.shape(t.q)[-1], np.shape(t.output)[-1]
    names = ("B", "H")[-len(lead):] if 0 < len(lead) <= 2 else tuple(f"dim{i}" for i in range(len(lead)))
    pre = "".join(f"{n}={v}, " for n, v in zip(names, lead, strict=True))
    return f"Trace({pre}L={L}, S={S}, D={D}, Dv={Dv}, scale={t.scale:.6g}, masked={bool(t.has_mask)})"
