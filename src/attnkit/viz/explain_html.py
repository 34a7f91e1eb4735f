"""One self-contained offline page that walks through attention on your own numbers.

``explain_page(trace)`` returns the page as a string (``attnkit explain --html FILE``
writes it): Q, K, V; the scores Q·Kᵀ, where hovering a score highlights the query row
and the key row that made it and spells out the dot product; the scale; the mask; the
softmax per row; the output weights·V, where hovering an output shows the values it
blends and the sum; and the flow of the computation as an inline SVG diagram.

ONE file: inline CSS, JS and SVG, the numbers as inline JSON; no network, no external
URL of any kind. DOM hooks (stable, used by the browser test): ``#Q``, ``#K``, ``#V``,
``#scores``, ``#scaled``, ``#masked``, ``#weights``, ``#output`` tables whose cells are
``td[data-i][data-j]`` (row i, column j) inside ``tr[data-i]``; ``#readout``; ``#flow``
(the diagram, one ``g[data-step]`` per step); ``.hl`` marks highlighted rows/cells.
"""

from __future__ import annotations

import json

import numpy as np

from ._checks import need_kind
from ._html_repr import _slice, esc, fmt

__all__ = ["explain_page", "save_explain_page", "MAX_TOKENS"]

MAX_TOKENS = 64  # queries or keys: the page shows every number, so it stays small enough to read


def _table(tid, m, rows, cols, prec, heat=False, caption=""):
    m = np.atleast_2d(np.asarray(m, dtype=np.float64))
    out = [f'<table id="{tid}" class="mat">']
    if caption:
        out.append(f"<caption>{caption}</caption>")
    out.append("<tr><th></th>" + "".join(f'<th class="col" data-j="{j}">{esc(c)}</th>' for j, c in enumerate(cols))
               + "</tr>")
    for i, r in enumerate(m):
        cells = []
        for j, x in enumerate(r):
            style = ""
            if heat and np.isfinite(x):
                f = min(max(x, 0.0), 1.0)
                style = f' style="background:rgba(28,126,214,{f:.3f});color:{"#fff" if f > 0.55 else "inherit"}"'
            elif not np.isfinite(x):
                style = ' style="color:#999;background:#f1f3f5"'
            cells.append(f'<td data-i="{i}" data-j="{j}"{style}>{fmt(x, prec)}</td>')
        out.append(f'<tr data-i="{i}"><th class="row">{esc(rows[i])}</th>' + "".join(cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _flow_svg(masked: bool, scale_txt: str) -> str:
    """The computation as boxes and arrows: Q, K → MatMul → Scale → (Mask) → Softmax → MatMul ← V → output."""
    steps = [("matmul1", "MatMul", "Q·Kᵀ"), ("scale", "Scale", scale_txt)]
    if masked:
        steps.append(("mask", "Mask", "forbidden → −inf"))
    steps += [("softmax", "Softmax", "per row"), ("matmul2", "MatMul", "weights·V"), ("out", "Output", "(L, Dv)")]
    w, h, gap, x0, y = 124, 46, 26, 110, 70
    n = len(steps)
    width = x0 + 60 + n * (w + gap)
    parts = [f'<svg id="flow" width="{width}" height="150" viewBox="0 0 {width} 150" role="img" '
             f'aria-label="flow of the attention computation">',
             '<defs><marker id="arr" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#495057"></path></marker></defs>']

    def box(x, yy, label, sub, step, fill):
        return (f'<g data-step="{step}"><rect x="{x}" y="{yy}" width="{w}" height="{h}" rx="8" fill="{fill}" '
                f'stroke="#495057"></rect><text x="{x + w / 2}" y="{yy + 19}" text-anchor="middle" '
                f'font-weight="600">{esc(label)}</text><text x="{x + w / 2}" y="{yy + 36}" text-anchor="middle" '
                f'font-size="11" fill="#495057">{esc(sub)}</text></g>')

    def arrow(x1, y1, x2, y2):
        return (f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#495057" stroke-width="1.5" '
                f'marker-end="url(#arr)"></line>')

    # inputs Q and K feed the first MatMul; V feeds the second
    parts.append(box(4, 10, "Q", "(L, D)", "Q", "#fff4e6"))
    parts.append(box(4, 94, "K", "(S, D)", "K", "#fff4e6"))
    xs = [x0 + 60 + i * (w + gap) for i in range(n)]
    parts.append(arrow(4 + w, 33, xs[0], y + h / 2 - 8))
    parts.append(arrow(4 + w, 117, xs[0], y + h / 2 + 8))
    for i, (step, label, sub) in enumerate(steps):
        fill = "#e7f5ff" if step != "out" else "#ebfbee"
        parts.append(box(xs[i], y - 20, label, sub, step, fill))
        if i:
            parts.append(arrow(xs[i - 1] + w, y + 3, xs[i], y + 3))
    vi = [s[0] for s in steps].index("matmul2")
    parts.append(box(xs[vi], 104, "V", "(S, Dv)", "V", "#fff4e6"))
    parts.append(arrow(xs[vi] + w / 2, 104, xs[vi] + w / 2, y + h - 20))
    parts.append("</svg>")
    return "".join(parts)


def explain_page(trace, *, b: int = 0, h: int = 0, title: str = "Attention, step by step", prec: int = 4,
                 q_tokens=None, k_tokens=None) -> str:
    """The interactive page for one (batch ``b``, head ``h``) of an :func:`attnkit.explain` trace.

    >>> import numpy as np, attnkit
    >>> t = attnkit.explain(np.array([[1., 0], [0, 1], [1, 1]]), np.array([[1., 1], [1, 0], [0, 1]]),
    ...                     np.array([[10., 0], [0, 10], [5, 5]]))
    >>> page = attnkit.viz.explain_page(t, title="the 3-token example")
    >>> page.startswith("<!DOCTYPE html>") and "0.4011" in page
    True
    """
    need_kind("trace", trace, ("q", "k", "v", "scores", "scaled", "masked", "weights", "output", "scale"),
              "an attnkit.explain(q, k, v) Trace", "Make one with attnkit.explain(q, k, v, mask=...)")
    q, k, v = _slice(trace.q, 2, b, h), _slice(trace.k, 2, b, h), _slice(trace.v, 2, b, h)
    sc, scl = _slice(trace.scores, 2, b, h), _slice(trace.scaled, 2, b, h)
    msk, w, out = _slice(trace.masked, 2, b, h), _slice(trace.weights, 2, b, h), _slice(trace.output, 2, b, h)
    L, S = sc.shape
    D, Dv = q.shape[-1], v.shape[-1]
    if max(L, S, D, Dv) > MAX_TOKENS:
        raise ValueError(f"trace: the page shows every number, so at most {MAX_TOKENS} queries, keys and dims; "
                         f"got L={L}, S={S}, D={D}, Dv={Dv}. Explain a slice (e.g. the first {MAX_TOKENS} rows).")
    ql = [str(x) for x in q_tokens] if q_tokens is not None and len(q_tokens) == L else [f"q{i}" for i in range(L)]
    kl = [str(x) for x in k_tokens] if k_tokens is not None and len(k_tokens) == S else [f"k{j}" for j in range(S)]
    dl = [f"d{j}" for j in range(D)]
    vl = [f"dv{j}" for j in range(Dv)]  # V's and the output's columns are the value dimensions
    has_mask = bool(trace.has_mask) or not np.array_equal(msk, scl)
    is_default = abs(trace.scale - D ** -0.5) < 1e-12
    scale_txt = f"× {trace.scale:.6g}" + (f" = 1/√{D}" if is_default else "")
    lead = np.shape(trace.scores)[:-2]
    where = ""
    if len(lead) == 2 and lead[0] * lead[1] > 1:
        where = f"batch {b}, head {h} of B={lead[0]}, H={lead[1]}. "
    elif len(lead) == 1 and lead[0] > 1:
        where = f"head {h} of H={lead[0]}. "

    def finite(a):
        return [[None if not np.isfinite(x) else float(x) for x in r] for r in np.asarray(a)]

    data = {"q": finite(q), "k": finite(k), "v": finite(v), "scores": finite(sc), "scaled": finite(scl),
            "masked": finite(msk), "weights": finite(w), "output": finite(out), "scale": float(trace.scale),
            "ql": ql, "kl": kl, "vl": vl, "prec": int(prec)}
    blob = json.dumps(data, separators=(",", ":"), ensure_ascii=True).replace("<", "\\u003c")
    sections = [
        ('<section><h2>1. The inputs</h2><p>Each query row of Q is compared with every key row of K; the values '
         f'V are what gets blended. d_k = {D}, d_v = {Dv}.</p><div class="row3">'
         + _table("Q", q, ql, dl, prec, caption=f"Q ({L} × {D})")
         + _table("K", k, kl, dl, prec, caption=f"K ({S} × {D})")
         + _table("V", v, kl, vl, prec, caption=f"V ({S} × {Dv})") + "</div></section>"),
        ('<section><h2>2. Scores Q·Kᵀ</h2><p>score[i, j] = q_i · k_j. <b>Hover a score</b> to see the query '
         "row and key row that made it.</p>" + _table("scores", sc, ql, kl, prec) + "</section>"),
        (f'<section><h2>3. Scale {esc(scale_txt)}</h2><p>'
         + ("Dividing by √d_k keeps the scores' spread near 1 whatever d_k is (a dot product of d_k terms with "
            "variance 1 has variance d_k), so softmax does not saturate." if is_default else
            "A scale given by the caller.")
         + "</p>" + _table("scaled", scl, ql, kl, prec) + "</section>"),
    ]
    if has_mask:
        attend = ~np.isneginf(np.asarray(msk))  # a bool mask's hidden pairs and a float mask's -inf alike
        sections.append(
            '<section><h2>4. Mask</h2><p>Forbidden pairs become −inf (and weigh 0 after softmax); a float mask '
            f"is added. {int(attend.sum())} of {L * S} pairs attend.</p>"
            + _table("masked", msk, ql, kl, prec) + "</section>")
    n = len(sections) + 1
    sections.append(
        f'<section><h2>{n}. Softmax per row</h2><p>weights[i, j] = exp(s_ij − max_j s_ij) / Σ_j exp(s_ij − '
        "max_j s_ij): each row sums to 1 (a fully masked row is 0). Colour = weight.</p>"
        + _table("weights", w, ql, kl, prec, heat=True) + "</section>")
    sections.append(
        f'<section><h2>{n + 1}. Output weights·V</h2><p>output[i, c] = Σ_j weights[i, j] · V[j, c]. '
        "<b>Hover an output</b> to see which values it blends.</p>"
        + _table("output", out, ql, vl, prec) + "</section>")
    scale_label = f"× 1/√{D}" if is_default else f"× {trace.scale:.4g}"
    body = (f"<h1>{esc(title)}</h1><p class=\"sub\">{esc(where)}L = {L} queries, S = {S} keys. Every number on this "
            "page is computed by attnkit's float64 reference.</p>"
            f'<section><h2>The flow</h2>{_flow_svg(has_mask, scale_label)}</section>'
            '<p id="readout" aria-live="polite">Hover a score or an output to see how it is made.</p>'
            + "".join(sections))
    return (_PAGE.replace("%TITLE%", esc(title)).replace("%CSS%", _CSS).replace("%JS%", _JS)
            .replace("%DATA%", blob).replace("%BODY%", body))


def save_explain_page(path, trace, **kw) -> str:
    """Write :func:`explain_page` to ``path``; returns the path."""
    page = explain_page(trace, **kw)  # (before opening: a wrong argument leaves no empty file behind)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return str(path)


# the body goes last: user text in it can never be mistaken for a later slot's marker
_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>%TITLE%</title>
<style>%CSS%</style>
</head>
<body>
<script type="application/json" id="explain-data">%DATA%</script>
<main>%BODY%</main>
<script>%JS%</script>
</body>
</html>
"""

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d2433; margin: 0;
       padding: 16px 24px 60px; background: #fbfbfd; max-width: 1100px; }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 15px; margin: 18px 0 4px; }
p { margin: 4px 0 8px; }
.sub { color: #667085; }
.row3 { display: flex; gap: 24px; flex-wrap: wrap; align-items: flex-start; }
table.mat { border-collapse: collapse; font: 12px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
table.mat caption { caption-side: top; text-align: left; font-weight: 600; padding: 2px 0; }
table.mat th { font-weight: 400; color: #667085; padding: 2px 6px; text-align: right; }
table.mat td { padding: 3px 8px; text-align: right; border: 1px solid #dee2e6; min-width: 60px; background: #fff; }
#scores td, #output td { cursor: crosshair; }
table.mat tr.hl th, table.mat th.hl { color: #d9480f; font-weight: 700; }
table.mat td.hl { outline: 2px solid #d9480f; outline-offset: -2px; background-color: #fff4e6 !important;
                  color: #1d2433 !important; }
table.mat td.sel { outline: 3px solid #c92a2a; outline-offset: -3px; }
#readout { position: sticky; top: 0; background: #fff; border: 1px solid #ced4da; border-radius: 6px;
           padding: 6px 10px; min-height: 1.5em; font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
           z-index: 1; }
#flow text { font: 13px system-ui, sans-serif; }
#flow g.hl rect { stroke: #d9480f; stroke-width: 3; }
"""

_JS = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("explain-data").textContent);
  var P = D.prec;
  function f(x) { return x === null ? "-inf" : x.toFixed(P); }
  function all(sel) { return Array.prototype.slice.call(document.querySelectorAll(sel)); }
  function clear() {
    all(".hl").forEach(function (e) { e.classList.remove("hl"); });
    all(".sel").forEach(function (e) { e.classList.remove("sel"); });
  }
  function cell(t, i, j) { return document.querySelector("#" + t + ' td[data-i="' + i + '"][data-j="' + j + '"]'); }
  function row(t, i) { return document.querySelector("#" + t + ' tr[data-i="' + i + '"]'); }
  function flow(steps) {
    steps.forEach(function (s) {
      var g = document.querySelector('#flow g[data-step="' + s + '"]');
      if (g) g.classList.add("hl");
    });
  }
  function say(text) { document.getElementById("readout").textContent = text; }

  all("#scores td").forEach(function (td) {
    td.addEventListener("mouseenter", function () {
      var i = +td.getAttribute("data-i"), j = +td.getAttribute("data-j");
      clear();
      td.classList.add("sel");
      [row("Q", i), row("K", j)].forEach(function (r) {
        r.classList.add("hl");
        Array.prototype.forEach.call(r.querySelectorAll("td"), function (c) { c.classList.add("hl"); });
      });
      flow(["Q", "K", "matmul1"]);
      var terms = D.q[i].map(function (qa, a) { return f(qa) + "×" + f(D.k[j][a]); });
      say("score[" + D.ql[i] + ", " + D.kl[j] + "] = " + D.ql[i] + " · " + D.kl[j] + " = " + terms.join(" + ") +
          " = " + f(D.scores[i][j]) + "   → scaled " + f(D.scaled[i][j]) + " → weight " + f(D.weights[i][j]));
    });
  });

  all("#output td").forEach(function (td) {
    td.addEventListener("mouseenter", function () {
      var i = +td.getAttribute("data-i"), c = +td.getAttribute("data-j");
      clear();
      td.classList.add("sel");
      row("weights", i).classList.add("hl");
      Array.prototype.forEach.call(row("weights", i).querySelectorAll("td"), function (x) { x.classList.add("hl"); });
      D.v.forEach(function (_, j) { cell("V", j, c).classList.add("hl"); });
      var h = document.querySelector('#V th.col[data-j="' + c + '"]'); if (h) h.classList.add("hl");
      flow(["softmax", "matmul2", "V", "out"]);
      var terms = D.weights[i].map(function (w, j) { return f(w) + "×" + f(D.v[j][c]); });
      say("output[" + D.ql[i] + ", " + D.vl[c] + "] = Σ_j weight[" + D.ql[i] + ", j] × V[j, " + D.vl[c] + "] = " +
          terms.join(" + ") + " = " + f(D.output[i][c]));
    });
  });
  document.body.setAttribute("data-ready", "1");
})();
"""
