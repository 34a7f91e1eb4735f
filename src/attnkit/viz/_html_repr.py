"""Rich display in Jupyter: small inline HTML for a :class:`~attnkit.Trace`, a mask, a
:class:`~attnkit.BlockPlan` and a dispatch :class:`~attnkit.Decision`.

Every renderer returns one self-contained HTML fragment (inline styles, no scripts, no
external assets) whose numbers are the object's own; all text is escaped. The classes do not
import this module: their ``_repr_html_`` asks ``attnkit._display``, where the package registers
:func:`render` (see that module).
"""

from __future__ import annotations

import html as _html
from collections.abc import Callable

import numpy as np

from .._format import format_number

__all__ = ["render", "trace_html", "mask_html", "plan_html", "decision_html", "matrix_table"]

_BOX = "font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;line-height:1.3"
_CELL = "padding:2px 6px;text-align:right;border:1px solid #e5e7eb"
_HEAD = "padding:2px 6px;color:#555;font-weight:normal;text-align:right"
_CAP = "caption-side:top;text-align:left;font-weight:600;padding:4px 0"
MAX_CELLS = 64  # rows/columns shown per table; more are summarised


def esc(x) -> str:
    return _html.escape(str(x), quote=True)


fmt = format_number  # one number format for text tables and HTML


def _blue(frac: float) -> tuple[str, str]:
    """Background and text colour for a value at ``frac`` in [0, 1] of a white→blue scale."""
    f = min(max(float(frac), 0.0), 1.0)
    r, g, b = (round(255 + (c - 255) * f) for c in (8, 81, 156))
    return f"rgb({r},{g},{b})", ("#fff" if f > 0.55 else "#111")


def matrix_table(m, row_labels=None, col_labels=None, *, caption="", prec=4, heat=None, attrs="") -> str:
    """An HTML table of a 2-D matrix. ``heat``: None (plain), ``"unit"`` (colour 0..1, for
    weights) or ``"range"`` (colour between the matrix's finite min and max)."""
    m = np.atleast_2d(np.asarray(m, dtype=np.float64))
    L, S = m.shape
    rows = list(row_labels) if row_labels is not None else [f"q{i}" for i in range(L)]
    cols = list(col_labels) if col_labels is not None else [f"k{j}" for j in range(S)]
    lo, hi = 0.0, 1.0
    if heat == "range":
        fin = m[np.isfinite(m)]
        lo, hi = (float(fin.min()), float(fin.max())) if fin.size else (0.0, 1.0)
    span = hi - lo if hi > lo else 1.0
    nr, nc = min(L, MAX_CELLS), min(S, MAX_CELLS)
    out = ['<table style="border-collapse:collapse;font:inherit;margin:2px 12px 8px 0;display:inline-table;'
           f'vertical-align:top"{attrs}>']
    if caption:
        out.append(f'<caption style="{_CAP}">{caption}</caption>')
    out.append("<tr><th></th>" + "".join(f'<th style="{_HEAD}">{esc(c)}</th>' for c in cols[:nc]) + "</tr>")
    for i in range(nr):
        cells = []
        for j in range(nc):
            x = m[i, j]
            style = _CELL
            if heat and np.isfinite(x):
                bg, fg = _blue((x - lo) / span)
                style += f";background:{bg};color:{fg}"
            elif heat:
                style += ";background:#f3f4f6;color:#999"
            cells.append(f'<td style="{style}" title="{esc(rows[i])} · {esc(cols[j])}">{fmt(x, prec)}</td>')
        out.append(f'<tr><th style="{_HEAD}">{esc(rows[i])}</th>' + "".join(cells) + "</tr>")
    out.append("</table>")
    if L > nr or S > nc:
        out.append(f"<div>(first {nr} × {nc} of {L} × {S})</div>")
    return "".join(out)


def _slice(a, ndim_tail, b, h):
    a = np.asarray(a)
    lead = a.ndim - ndim_tail
    if lead == 2:
        return a[b, h]
    if lead == 1:
        return a[h]
    return a


def trace_html(t, b: int = 0, h: int = 0, prec: int = 4, q_tokens=None, k_tokens=None) -> str:
    """Each step of ``t`` (batch ``b``, head ``h``) as a small table with its formula; the
    weights as a heatmap."""
    q, k, v = _slice(t.q, 2, b, h), _slice(t.k, 2, b, h), _slice(t.v, 2, b, h)
    sc, scl, msk = _slice(t.scores, 2, b, h), _slice(t.scaled, 2, b, h), _slice(t.masked, 2, b, h)
    w, out = _slice(t.weights, 2, b, h), _slice(t.output, 2, b, h)
    L, S = sc.shape
    D, Dv = q.shape[-1], v.shape[-1]
    ql = list(q_tokens) if q_tokens is not None and len(q_tokens) == L else [f"q{i}" for i in range(L)]
    kl = list(k_tokens) if k_tokens is not None and len(k_tokens) == S else [f"k{j}" for j in range(S)]
    dl, vl = [f"d{j}" for j in range(D)], [f"dv{j}" for j in range(Dv)]
    where = ""
    lead = np.shape(t.scores)[:-2]
    if len(lead) == 2 and lead[0] * lead[1] > 1:
        where = f" — batch {b}, head {h} of B={lead[0]}, H={lead[1]}"
    elif len(lead) == 1 and lead[0] > 1:
        where = f" — head {h} of H={lead[0]}"
    scale_txt = f"{t.scale:.6g}" + (f" = 1/√{D}" if abs(t.scale - D ** -0.5) < 1e-12 else "")
    steps = [
        ("1", "Raw scores", "Q·Kᵀ", matrix_table(sc, ql, kl, prec=prec)),
        ("2", "Scaled scores", f"Q·Kᵀ × {esc(scale_txt)}", matrix_table(scl, ql, kl, prec=prec)),
    ]
    if t.has_mask or not np.array_equal(np.asarray(t.masked), np.asarray(t.scaled)):
        steps.append((str(len(steps) + 1), "Masked scores", "−inf where the mask forbids",
                      matrix_table(msk, ql, kl, prec=prec)))
    n = len(steps) + 1
    steps.append((str(n), "Weights", "softmax per row (rows sum to 1; a fully masked row is 0)",
                  matrix_table(w, ql, kl, prec=prec, heat="unit", attrs=' class="attnkit-weights"')))
    steps.append((str(n + 1), "Output", "weights · V", matrix_table(out, ql, vl, prec=prec)))
    parts = [f'<div class="attnkit-trace" style="{_BOX}">',
             f"<div><b>attnkit Trace</b>: L={L} queries, S={S} keys, d_k={D}, d_v={Dv}{esc(where)}</div>",
             "<div>",
             matrix_table(q, ql, dl, caption="Q", prec=prec),
             matrix_table(k, kl, dl, caption="K", prec=prec),
             matrix_table(v, kl, vl, caption="V", prec=prec),
             "</div>"]
    for num, name, formula, table in steps:
        parts.append(f'<div style="margin-top:6px"><b>{num}. {name}</b> <span style="color:#555">{formula}</span>'
                     f"<br>{table}</div>")
    parts.append("</div>")
    return "".join(parts)


def _grid(cells, row_labels, col_labels, colours, symbols, title) -> str:
    """A grid of small squares: ``cells`` (L, S) ints into ``colours``/``symbols``."""
    L, S = cells.shape
    nr, nc = min(L, MAX_CELLS), min(S, MAX_CELLS)
    out = [f'<div style="{_BOX}"><div>{title}</div><table style="border-collapse:collapse;font:inherit;margin:4px 0">',
           "<tr><th></th>" + "".join(f'<th style="{_HEAD};font-size:10px;padding:0 2px">{esc(c)}</th>'
                                    for c in col_labels[:nc]) + "</tr>"]
    for i in range(nr):
        row = "".join(f'<td title="{esc(row_labels[i])} · {esc(col_labels[j])}: {symbols[int(cells[i, j])]}" '
                      f'style="width:14px;height:14px;padding:0;border:1px solid #fff;'
                      f'background:{colours[int(cells[i, j])]}"></td>' for j in range(nc))
        out.append(f'<tr><th style="{_HEAD};font-size:10px;padding:0 4px">{esc(row_labels[i])}</th>{row}</tr>')
    out.append("</table>")
    if L > nr or S > nc:
        out.append(f"<div>(first {nr} × {nc} of {L} × {S})</div>")
    return "".join(out)


def mask_html(mask, L: int | None = None, S: int | None = None, b: int = 0, h: int = 0) -> str:
    """The mask drawn as a grid (filled = attend), at its natural size or 8 × 8."""
    nat = mask._natural_size()
    L = L if L is not None else (nat[0] if nat else 8)
    S = S if S is not None else (nat[1] if nat else L)
    head = f"<b>{esc(repr(mask))}</b> at L={L}, S={S}"
    try:
        B = max(mask.batch_size or 1, b + 1)
        dense = mask.materialize(B, h + 1, L, S)[b, h].cpu().numpy().astype(int)
    except (ValueError, TypeError, IndexError, RuntimeError) as e:
        return f'<div style="{_BOX}">{head}: not drawn at this size ({esc(e)})</div>'
    n = int(dense.sum())
    title = f"{head}: {n} of {L * S} pairs attend (filled = attend, rows = queries, columns = keys)"
    return _grid(dense, [f"q{i}" for i in range(L)], [f"k{j}" for j in range(S)],
                 {0: "#e5e7eb", 1: "#1c7ed6"}, {0: "masked", 1: "attend"}, title) + "</div>"


def plan_html(plan, b: int = 0, h: int = 0) -> str:
    """The tile map: full / partial / empty tiles in three colours, with the counts."""
    from .._tiling import EMPTY, FULL, PARTIAL

    kinds = plan.kinds
    k = kinds[min(b, kinds.shape[0] - 1), min(h, kinds.shape[1] - 1)].numpy().astype(int)
    nq, nk = k.shape
    bm, bn = plan.block
    counts = {name: int((kinds == kind).sum()) for name, kind in (("full", FULL), ("partial", PARTIAL),
                                                                  ("empty", EMPTY))}
    colours = {FULL: "#1c7ed6", PARTIAL: "#a5d8ff", EMPTY: "#e5e7eb"}
    symbols = {FULL: "full (no mask evaluated)", PARTIAL: "partial (mask evaluated)", EMPTY: "empty (skipped)"}
    legend = " ".join(f'<span style="display:inline-block;width:10px;height:10px;background:{colours[kd]}"></span> '
                      f"{esc(symbols[kd])}" for kd in (FULL, PARTIAL, EMPTY))
    title = (f"<b>BlockPlan</b> {esc(repr(plan.mask))}, L={plan.L}, S={plan.S}, tiles {bm}×{bn} ({nq}×{nk}): "
             f"{counts['full'] + counts['partial']} of {kinds.numel()} computed ({100 * plan.density:.1f}%) — "
             f"{counts['full']} full, {counts['partial']} partial, {counts['empty']} empty<br>{legend}")
    return _grid(k, [f"q{i}" for i in range(nq)], [f"k{j}" for j in range(nk)], colours, symbols, title) + "</div>"


def decision_html(d) -> str:
    """Backend, worker and why, as a two-row table."""
    rows = [("backend", d.backend, d.reason)]
    if d.worker:
        rows.append(("worker", d.worker, d.worker_reason))
    body = "".join(f'<tr><th style="{_HEAD};text-align:left">{esc(a)}</th><td style="{_CELL};text-align:left">'
                   f"<b>{esc(b)}</b></td><td style=\"{_CELL};text-align:left\">{esc(c)}</td></tr>" for a, b, c in rows)
    return (f'<div style="{_BOX}"><b>attnkit dispatch Decision</b><table style="border-collapse:collapse;font:inherit">'
            f"<tr><th></th><th style=\"{_HEAD};text-align:left\">choice</th>"
            f"<th style=\"{_HEAD};text-align:left\">why</th></tr>{body}</table></div>")


def render(kind: str, obj, **options) -> str:
    """The HTML of ``obj`` drawn as ``kind`` (``attnkit._display.KINDS``): what the core's
    ``_repr_html_`` methods show, registered by the package."""
    if kind == "tile_mass":
        from .long_html import tile_mass_page

        return tile_mass_page(obj, **options)
    draws: dict[str, Callable[..., str]] = {"trace": trace_html, "mask": mask_html, "plan": plan_html,
                                            "decision": decision_html}
    return draws[kind](obj, **options)
