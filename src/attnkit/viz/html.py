"""An offline, self-contained HTML page to explore attention: pick sentence, layer and head,
hover (or click/focus) a token to see where it looks.

ONE file: inline CSS and JS, the weights as inline JSON, no CDN, no fonts, no
network, no external URL of any kind (even SVG is built by the HTML parser, so
no namespace URL is needed). Open it from disk in any browser.

Page layout::

    [sentence ▾] [layer ▾] [head ▾ (mean of heads | 0 … H-1)]
    queries          lines (opacity = weight)          keys
    [CLS]  ───────────────────────────────────────── [CLS]
    bank   ═══════════════╲────────────────────────── river
    ...                                                 ...
    readout: "bank" → river 0.69 · [SEP] 0.12 · ...
    heatmap of the selected head or the mean of heads (rows = queries, columns = keys), colour legend

DOM hooks (stable, used by the browser test): ``#item``, ``#layer``, ``#head``
selects; ``.tok.q[data-i]`` / ``.tok.k[data-j]`` tokens; ``#lines line`` with
``data-i``, ``data-j``, ``data-w``; ``#readout``; ``#heatmap td[data-i][data-j]``; ``#heattitle`` (names the
layer and "head h" or "mean of heads"); ``#legend`` (the colour scale, 0 to 1).
"""

from __future__ import annotations

import html as _html
import json
import re

import numpy as np

__all__ = ["save_attention_html", "attention_html"]


def _rounded(a: np.ndarray, digits: int):
    return np.round(np.asarray(a, dtype=np.float64), digits).tolist()


def _positions(b, n, attention_mask, L, S):
    """Indices of item b's valid tokens along L and S: ``attention_mask[b].nonzero()``, else the first n."""
    if attention_mask is None:
        if n > L or n > S:
            raise ValueError(f"items[{b}]: {n} tokens but the weights are only {L}×{S}.")
        return np.arange(n)
    row = np.asarray(attention_mask[b]).astype(bool)
    if row.shape != (L,) or L != S:
        raise ValueError(f"attention_mask[{b}]: expected shape ({L},) for weights of {L}×{S} (self-attention), "
                         f"got {row.shape}.")
    pos = np.flatnonzero(row)
    if len(pos) != n:
        raise ValueError(f"items[{b}]: {n} tokens but attention_mask[{b}] marks {len(pos)} valid positions.")
    return pos


_SLOT = re.compile(r"%(TITLE|SUBTITLE|CSS|JS|DATA)%")


def attention_html(items, weights, *, title="attention", subtitle="", initial=None, digits=4,
                   attention_mask=None) -> str:
    """The page as a string. See :func:`save_attention_html`."""
    for i, it in enumerate(items):
        if not (isinstance(it, dict) and "label" in it and "tokens" in it):
            raise TypeError(f"items: expected a list of {{'label': ..., 'tokens': [...]}} dicts, one per sentence, "
                            f"got {type(it).__name__} {it!r:.40} at {i}.")
    items = [dict(label=str(it["label"]), tokens=[str(t) for t in it["tokens"]]) for it in items]
    if not items:
        raise ValueError("items: expected at least one sentence with tokens, got none.")
    if not hasattr(weights, "keys"):
        raise TypeError(f"weights: expected a dict {{layer: (B, H, L, S) array}}, got {type(weights).__name__}. "
                        "For one layer pass {0: weights}.")
    layers = sorted(int(k) for k in weights)
    if not layers:
        raise ValueError("weights: expected at least one layer, got none.")
    if attention_mask is not None:
        attention_mask = np.asarray(attention_mask)
        if attention_mask.ndim != 2 or attention_mask.shape[0] != len(items):
            raise ValueError(f"attention_mask: expected (B={len(items)}, L), got shape {attention_mask.shape}.")
    n_heads: int | None = None
    data_w = {}
    for layer in layers:
        w = np.asarray(weights[layer])
        if w.ndim != 4 or w.shape[0] != len(items):
            raise ValueError(f"weights[{layer}]: expected (B={len(items)}, H, L, S), got shape {w.shape}.")
        n_heads = w.shape[1] if n_heads is None else n_heads
        if w.shape[1] != n_heads:
            raise ValueError(f"weights[{layer}]: expected {n_heads} heads like the other layers, got {w.shape[1]}.")
        per_item = []
        for b, it in enumerate(items):
            pos = _positions(b, len(it["tokens"]), attention_mask, w.shape[2], w.shape[3])
            per_item.append(_rounded(w[b][:, pos][:, :, pos], digits))  # (H, n, n): padding dropped (either side)
        data_w[str(layer)] = per_item
    assert n_heads is not None  # set by the first layer; `layers` is not empty (checked above)
    init = {"item": 0, "layer": layers[0], "head": -1, "token": None}
    init.update(initial or {})
    data = {"title": title, "subtitle": subtitle, "items": items, "layers": layers, "heads": n_heads,
            "weights": data_w, "initial": init}
    blob = json.dumps(data, separators=(",", ":"), ensure_ascii=True).replace("<", "\\u003c")
    parts = {"TITLE": _html.escape(str(title)), "SUBTITLE": _html.escape(str(subtitle)), "CSS": _CSS, "JS": _JS,
             "DATA": blob}
    # one pass over the template: text put into one slot is never searched for another slot's marker
    return _SLOT.sub(lambda m: parts[m.group(1)], _PAGE)


def save_attention_html(path, items, weights, *, title="attention", subtitle="", initial=None,
                        attention_mask=None) -> str:
    """Write the self-contained page to ``path``; returns the path.

    Args:
        items: one dict per batch element: ``{"label": sentence, "tokens": [...]}``
            (its valid tokens only; padding is dropped from the weights).
        weights: ``{layer: array (B, H, L, S)}`` of attention weights.
        attention_mask: ``(B, L)`` 1 = real token, 0 = padding (either side); item b's
            tokens are the positions ``attention_mask[b].nonzero()``. None: each item's
            tokens are the first ``len(tokens)`` positions (right padding only).
        title, subtitle: page headings.
        initial: ``{"item", "layer", "head" (-1 = mean of heads), "token" (None or a query index)}``
            selected when the page opens.
    """
    text = attention_html(items, weights, title=title, subtitle=subtitle, initial=initial,
                          attention_mask=attention_mask)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>%TITLE%</title>
<style>%CSS%</style>
</head>
<body>
<header>
  <h1>%TITLE%</h1>
  <p class="sub">%SUBTITLE%</p>
  <div id="controls">
    <label>sentence <select id="item"></select></label>
    <label>layer <select id="layer"></select></label>
    <label>head <select id="head"></select></label>
  </div>
  <p class="hint">Hover a token (or click to pin it, or Tab to it) to see where it looks (left) or what looks at it
  (right). Line opacity = attention weight.</p>
</header>
<main>
  <section id="view">
    <div class="col" id="qcol" aria-label="queries"></div>
    <div id="linebox"></div>
    <div class="col" id="kcol" aria-label="keys"></div>
  </section>
  <p id="readout" aria-live="polite"></p>
  <section id="heatwrap"><h2 id="heattitle">Attention weights</h2>
    <div id="heatgrid"><div id="keyaxis">keys (attended to) &#8594;</div>
      <div id="queryaxis">queries (attending) &#8594;</div><div id="heatmap"></div></div>
    <div id="legend" aria-label="colour scale"><span>0</span><span id="legendbar"></span><span>1</span>
      <span class="lname">attention weight (colour opacity = weight)</span></div></section>
</main>
<script type="application/json" id="attn-data">%DATA%</script>
<script>%JS%</script>
</body>
</html>
"""

_CSS = """
:root { --row: 24px; --accent: #d9480f; --ink: #1d2433; --muted: #667085; }
* { box-sizing: border-box; }
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--ink);
       margin: 0; padding: 16px 24px; background: #fbfbfd; }
h1 { font-size: 20px; margin: 0 0 2px; }
h2 { font-size: 14px; margin: 18px 0 6px; color: var(--muted); font-weight: 600; }
.sub, .hint { color: var(--muted); margin: 2px 0 8px; }
#controls { display: flex; gap: 18px; flex-wrap: wrap; margin: 8px 0; }
#controls label { font-weight: 600; }
select { font: inherit; padding: 2px 6px; margin-left: 4px; }
#view { display: flex; align-items: flex-start; margin-top: 10px; }
.col { display: flex; flex-direction: column; }
#qcol { align-items: flex-end; }
#kcol { align-items: flex-start; }
.tok { height: var(--row); line-height: var(--row); padding: 0 8px; border-radius: 4px; cursor: pointer;
       font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; white-space: pre;
       outline: none; transition: background-color 80ms; }
.tok:hover, .tok:focus, .tok.active { box-shadow: inset 0 0 0 2px var(--accent); }
.tok.pinned { font-weight: 700; }
#linebox svg { display: block; }
#readout { min-height: 1.4em; margin: 10px 0; font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
#heatmap table { border-collapse: collapse; font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
                 font-size: 11px; }
#heatmap th { font-weight: 400; color: var(--muted); padding: 0 4px; white-space: pre; }
#heatmap thead th { writing-mode: vertical-rl; transform: rotate(180deg); text-align: left; height: 70px; }
#heatmap td { width: 22px; height: 18px; border: 1px solid #fff; }
#heatmap tr.active th { color: var(--accent); font-weight: 700; }
#heatgrid { display: grid; grid-template-columns: auto auto; grid-template-rows: auto auto; justify-content: start; }
#keyaxis { grid-column: 2; grid-row: 1; color: var(--muted); font-size: 12px; padding-left: 60px; }
#queryaxis { grid-column: 1; grid-row: 2; writing-mode: vertical-rl; color: var(--muted);
             font-size: 12px; padding-top: 80px; }
#heatmap { grid-column: 2; grid-row: 2; }
#legend { display: flex; align-items: center; gap: 6px; margin-top: 8px; font-size: 12px; color: var(--muted); }
#legendbar { display: inline-block; width: 160px; height: 12px; border: 1px solid #ced4da; }
#legend .lname { margin-left: 8px; }
"""

_JS = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("attn-data").textContent);
  var PALETTE = ["#1c7ed6", "#e8590c", "#2f9e44", "#c2255c", "#7048e8", "#0c8599",
                 "#f08c00", "#5c940d", "#ae3ec9", "#364fc7", "#e03131", "#087f5b"];
  var LINE_W = 300, ROW = 24;
  var el = function (id) { return document.getElementById(id); };
  var S = { item: D.initial.item, layer: D.initial.layer, head: D.initial.head,
            hover: null, pinned: D.initial.token === null ? null : { side: "q", idx: D.initial.token } };

  function opt(sel, value, text) {
    var o = document.createElement("option"); o.value = String(value); o.textContent = text; sel.appendChild(o);
  }
  D.items.forEach(function (it, b) { opt(el("item"), b, D.items.length > 1 ? (b + ": " + it.label) : it.label); });
  D.layers.forEach(function (l) { opt(el("layer"), l, String(l)); });
  opt(el("head"), -1, "mean of heads");
  for (var h = 0; h < D.heads; h++) { opt(el("head"), h, String(h)); }
  el("item").value = String(S.item); el("layer").value = String(S.layer); el("head").value = String(S.head);

  function tokens() { return D.items[S.item].tokens; }
  function matrix() {              // (L, L) weights of the selected sentence, layer and head
    var per = D.weights[String(S.layer)][S.item];
    if (S.head >= 0) { return per[S.head]; }
    var L = per[0].length, m = [];
    for (var i = 0; i < L; i++) {
      var row = [];
      for (var j = 0; j < L; j++) {
        var s = 0; for (var h = 0; h < per.length; h++) { s += per[h][i][j]; }
        row.push(s / per.length);
      }
      m.push(row);
    }
    return m;
  }
  function colour() { return S.head >= 0 ? PALETTE[S.head % PALETTE.length] : "#3b5bdb"; }
  function focus() { return S.hover || S.pinned; }
  function esc(t) {
    return t.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
  }
  function tint(w) {               // background for a token or cell carrying weight w
    var hex = colour(), r = parseInt(hex.substr(1, 2), 16), g = parseInt(hex.substr(3, 2), 16),
        b = parseInt(hex.substr(5, 2), 16);
    return "rgba(" + r + "," + g + "," + b + "," + Math.min(1, w).toFixed(3) + ")";
  }

  function buildColumns() {
    var t = tokens();
    ["qcol", "kcol"].forEach(function (id) {
      var col = el(id); col.innerHTML = "";
      var side = id === "qcol" ? "q" : "k";
      t.forEach(function (tok, i) {
        var d = document.createElement("div");
        d.className = "tok " + side; d.tabIndex = 0; d.textContent = tok;
        d.setAttribute(side === "q" ? "data-i" : "data-j", String(i));
        d.addEventListener("mouseenter", function () { S.hover = { side: side, idx: i }; draw(); });
        d.addEventListener("mouseleave", function () { S.hover = null; draw(); });
        d.addEventListener("focus", function () { S.hover = { side: side, idx: i }; draw(); });
        d.addEventListener("blur", function () { S.hover = null; draw(); });
        d.addEventListener("click", function () {
          var p = S.pinned;
          S.pinned = (p && p.side === side && p.idx === i) ? null : { side: side, idx: i }; draw();
        });
        col.appendChild(d);
      });
    });
  }

  function draw() {
    var t = tokens(), L = t.length, m = matrix(), f = focus(), c = colour(), parts = [];
    var H = L * ROW;
    for (var i = 0; i < L; i++) {
      for (var j = 0; j < L; j++) {
        var w = m[i][j];
        var shown = f === null || (f.side === "q" ? f.idx === i : f.idx === j);
        if (!shown || w < 0.005) { continue; }
        var op = f === null ? 0.15 + 0.6 * w : 0.1 + 0.9 * w;
        parts.push('<line data-i="' + i + '" data-j="' + j + '" data-w="' + w.toFixed(4) + '" x1="2" y1="' +
                   (i * ROW + ROW / 2) + '" x2="' + (LINE_W - 2) + '" y2="' + (j * ROW + ROW / 2) +
                   '" stroke="' + c + '" stroke-opacity="' + op.toFixed(3) + '" stroke-width="' +
                   (1 + 5 * w).toFixed(2) + '" stroke-linecap="round"></line>');
      }
    }
    // the HTML parser puts <svg> in the SVG namespace itself: no namespace URL needed in this file
    el("linebox").innerHTML = '<svg id="lines" width="' + LINE_W + '" height="' + H + '" viewBox="0 0 ' + LINE_W +
                              ' ' + H + '">' + parts.join("") + "</svg>";
    var qs = el("qcol").children, ks = el("kcol").children;
    for (var a = 0; a < L; a++) {
      var qa = "", ka = "";
      if (f !== null && f.side === "q") { ka = tint(m[f.idx][a]); }
      if (f !== null && f.side === "k") { qa = tint(m[a][f.idx]); }
      qs[a].style.backgroundColor = qa; ks[a].style.backgroundColor = ka;
      qs[a].classList.toggle("active", f !== null && f.side === "q" && f.idx === a);
      ks[a].classList.toggle("active", f !== null && f.side === "k" && f.idx === a);
      qs[a].classList.toggle("pinned", S.pinned !== null && S.pinned.side === "q" && S.pinned.idx === a);
      ks[a].classList.toggle("pinned", S.pinned !== null && S.pinned.side === "k" && S.pinned.idx === a);
    }
    readout(t, m, f);
    heatmap(t, m, f);
  }

  function readout(t, m, f) {
    var where = "layer " + S.layer + ", " + (S.head >= 0 ? "head " + S.head : "mean of heads") + ": ";
    if (f === null) { el("readout").textContent = where + "hover a token to see its attention."; return; }
    var pairs = [];
    for (var a = 0; a < t.length; a++) {
      pairs.push([a, f.side === "q" ? m[f.idx][a] : m[a][f.idx]]);
    }
    pairs.sort(function (x, y) { return y[1] - x[1]; });
    var top = pairs.slice(0, 5).map(function (p) { return t[p[0]] + " " + p[1].toFixed(2); }).join(" · ");
    el("readout").textContent = where + (f.side === "q" ? '"' + t[f.idx] + '" attends to: ' :
                                          'attending to "' + t[f.idx] + '": ') + top;
  }

  function heatmap(t, m, f) {
    var L = t.length;
    el("heattitle").textContent = "Attention weights: layer " + S.layer + ", " +
      (S.head >= 0 ? "head " + S.head : "mean of heads");
    el("legendbar").style.background = "linear-gradient(to right, " + tint(0) + ", " + tint(1) + ")";
    if (L > 80) { el("heatmap").textContent = "(" + L + " tokens: too many for a readable table)"; return; }
    var h = ["<table><thead><tr><th></th>"];
    t.forEach(function (tok) { h.push("<th>" + esc(tok) + "</th>"); });
    h.push("</tr></thead><tbody>");
    for (var i = 0; i < L; i++) {
      var act = f !== null && f.side === "q" && f.idx === i;
      h.push('<tr' + (act ? ' class="active"' : "") + '><th>' + esc(t[i]) + "</th>");
      for (var j = 0; j < L; j++) {
        h.push('<td data-i="' + i + '" data-j="' + j + '" title="' + esc(t[i]) + " → " + esc(t[j]) + " " +
               m[i][j].toFixed(3) + '" style="background:' + tint(m[i][j]) + '"></td>');
      }
      h.push("</tr>");
    }
    h.push("</tbody></table>");
    el("heatmap").innerHTML = h.join("");
  }

  el("item").addEventListener("change", function () {
    S.item = +this.value; S.hover = null; S.pinned = null; buildColumns(); draw();
  });
  el("layer").addEventListener("change", function () { S.layer = +this.value; draw(); });
  el("head").addEventListener("change", function () { S.head = +this.value; draw(); });
  buildColumns();
  draw();
  document.body.setAttribute("data-ready", "1");
})();
"""
