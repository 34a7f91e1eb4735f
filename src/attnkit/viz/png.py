"""A grid of attention heatmaps (one per head) as a PNG, drawn with matplotlib's Agg backend.

Layout (12 heads → 3 rows × 4 columns; rows = queries, columns = keys)::

    ┌ head 0 ───────┐┌ head 1 ───────┐ ...   ┐
    │ [CLS] ■ □ □ □ ││ ■ □ □ □ □ □   │       │ colour bar 0 … 1
    │ bank  □ ■ □ □ ││ ...           │       │ (shared by all heads)
    └───────────────┘└───────────────┘       ┘
      keys →  (labels on the bottom row; query labels on the left column)

A highlighted query row (the word being explained) is outlined in every panel and
each panel title names that row's strongest key.
"""

from __future__ import annotations

import functools
import math
import textwrap
import unicodedata
import warnings

import numpy as np

__all__ = ["save_heads_png", "short_title", "MissingGlyphWarning"]


class MissingGlyphWarning(UserWarning):
    """A label holds characters no installed font draws; the PNG names them by code point (``<U+6211>``)."""


MAX_TITLE_LINES = 2

_HIGHLIGHT = "#e8590c"


def short_title(title: str, width: int, max_lines: int = MAX_TITLE_LINES) -> str:
    """``title`` wrapped at ``width`` characters, at most ``max_lines`` lines; a longer title is cut
    at a word boundary and ends with an ellipsis (…) — a long sentence never becomes a page of title."""
    lines = textwrap.wrap(" ".join(str(title).split()), width=width) or [""]
    if len(lines) <= max_lines:
        return "\n".join(lines)
    kept = lines[:max_lines]
    last = kept[-1]
    if len(last) > width - 2:
        last = last[:width - 2].rsplit(" ", 1)[0] if " " in last[:width - 2] else last[:width - 2]
    kept[-1] = last.rstrip() + " …"
    return "\n".join(kept)


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("drawing a PNG needs matplotlib: pip install matplotlib (or, in the attnkit repository, "
                          "pip install -e '.[viz]')") from e
    matplotlib.use("Agg", force=True)  # files only: never open a window
    import matplotlib.pyplot as plt
    return plt


@functools.lru_cache(maxsize=64)
def _charmap(path: str) -> frozenset[int]:
    from matplotlib import ft2font

    try:
        return frozenset(ft2font.FT2Font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):
        return frozenset()


def _glyphs(texts):
    """Where matplotlib's font cannot draw a character of ``texts``: the installed fonts that can (to fall back
    on, per glyph) and the characters none can, mapped to their code point (``<U+6211>``) so the PNG says what
    it cannot show instead of an empty box. Returns ``(fallback family names, {char: replacement})``."""
    import matplotlib
    from matplotlib import font_manager

    chars = {c for t in texts for c in str(t) if not c.isspace()}
    if all(ord(c) < 0x250 for c in chars):  # Latin: every default font has it
        return [], {}
    default = font_manager.findfont(font_manager.FontProperties(family=matplotlib.rcParams["font.family"]))
    missing = sorted(c for c in chars if ord(c) not in _charmap(default) and unicodedata.category(c)[0] != "M")
    families: list[str] = []
    nowhere = {}
    for c in missing:
        entry = next((f for f in font_manager.fontManager.ttflist
                      if f.fname.lower().endswith((".ttf", ".otf")) and "last resort" not in f.name.lower()
                      and ord(c) in _charmap(f.fname)), None)
        if entry is None:
            nowhere[c] = f"<U+{ord(c):04X}>"
        elif entry.name not in families:
            families.append(entry.name)
    return families, nowhere


def _cut(text: str, n: int) -> str:
    """``text`` in at most ``n`` characters, its end replaced by "…" when cut."""
    return text if len(text) <= n else text[:max(1, n - 1)] + "…"


def save_heads_png(path, weights, q_tokens, k_tokens=None, *, title="", heads=None, highlight_row=None,
                   cols=4, dpi=130) -> str:
    """Save heatmaps of ``weights (H, L, S)`` (one panel per head) to ``path``; returns the path.

    Args:
        weights: array ``(H, L, S)`` of attention weights in [0, 1] (rows sum to 1), or ``(L, S)``
            for one head (what :func:`attnkit.explain` gives for unbatched ``(L, D)`` inputs).
        q_tokens: L query labels; ``k_tokens``: S key labels (default: ``q_tokens``).
        title: figure title.
        heads: the head number of each panel (default ``0..H-1``).
        highlight_row: query row to outline (the word being explained), or None.
        cols: panels per row; one head is drawn large, alone.
    """
    if hasattr(weights, "detach"):  # a torch tensor (one that wants a gradient too)
        weights = weights.detach().cpu().double()
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(f"weights: expected an array of attention weights (H, L, S) or (L, S), got "
                        f"{type(weights).__name__} ({e}).") from None
    if w.ndim == 2:  # (L, S): one head
        w = w[None]
    if w.ndim != 3:
        raise ValueError(f"weights: expected (H, L, S) or (L, S) for one head, got shape {w.shape}.")
    H, L, S = w.shape
    k_tokens = list(q_tokens) if k_tokens is None else list(k_tokens)
    q_tokens = list(q_tokens)
    if len(q_tokens) != L or len(k_tokens) != S:
        raise ValueError(f"tokens: expected {L} query and {S} key labels, got {len(q_tokens)} and {len(k_tokens)}.")
    heads = list(range(H)) if heads is None else list(heads)
    plt = _pyplot()
    fallback, nowhere = _glyphs([*q_tokens, *k_tokens, title])
    if nowhere:  # no installed font has these: named by code point, and said once
        swap = str.maketrans(nowhere)
        q_tokens, k_tokens, title = ([t.translate(swap) for t in q_tokens], [t.translate(swap) for t in k_tokens],
                                     str(title).translate(swap))
        warnings.warn("no installed font draws " + ", ".join(f"{c} as {u}" for c, u in nowhere.items())
                      + ": the PNG names them by code point (an HTML page shows them as the browser draws them; "
                      "a font such as Noto Sans CJK or Noto Color Emoji draws them in the PNG too)",
                      MissingGlyphWarning, stacklevel=2)
    import matplotlib

    with matplotlib.rc_context({"font.family": [*matplotlib.rcParams["font.family"], *fallback]}):
        return _draw(plt, path, w, q_tokens, k_tokens, title, heads, highlight_row, cols, dpi)


def _draw(plt, path, w, q_tokens, k_tokens, title, heads, highlight_row, cols, dpi) -> str:
    H, L, S = w.shape

    ncols = min(cols, H)
    nrows = math.ceil(H / ncols)
    # inches per token, shrunk for long sentences so the figure stays under ~24 inches across
    cell = min(0.26 if H > 1 else 0.42, 20.0 / (ncols * max(L, S)))
    label_pad = 0.085 * max(len(t) for t in q_tokens + k_tokens) + 0.3
    panel_w = max(1.9, cell * S)
    panel_h = max(1.9, cell * L)
    fig_w = ncols * (panel_w + label_pad * (1 if H == 1 else 0.25)) + label_pad + 1.0
    fig_h = nrows * (panel_h + 0.55) + label_pad + 0.9
    fig, axes = plt.subplots(nrows, ncols, figsize=(fig_w, fig_h), squeeze=False, sharex=True, sharey=True,
                             layout="constrained")  # makes room for titles, labels and the colour bar
    fs = min(8 if H > 1 else 10, max(4.0, cell * 72 * 0.75))  # a label never taller than its row
    # square-root colour scale: attention sinks ([CLS], [SEP]) often take most of a row, and on a
    # linear scale the weaker structure next to them would vanish
    from matplotlib.colors import PowerNorm
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
    im = None
    for idx in range(nrows * ncols):
        ax = axes[idx // ncols][idx % ncols]
        if idx >= H:
            ax.set_visible(False)
            continue
        im = ax.imshow(w[idx], cmap="Blues", norm=norm, aspect="auto", interpolation="nearest")
        name = f"head {heads[idx]}"
        if highlight_row is not None:
            top2 = np.argsort(-w[idx, highlight_row], kind="stable")[:2]
            # as many characters as the panel is wide (a title's glyph ~0.6 of its size): a long token label is
            # cut with "…" rather than running into the next panel's title
            room = max(16, int((panel_w + 0.25 * label_pad) * 72 / ((fs + 1) * 0.6)))
            keys = ", ".join(f"{k_tokens[j]} {w[idx, highlight_row, j]:.2f}" for j in top2)
            word = q_tokens[highlight_row]
            if len(word) + 3 + len(keys) > room:  # too wide: the query's label first, then the keys' if need be
                if len(keys) > room - 7:  # long key labels: each cut to its share of what the query leaves
                    share = max(3, (room - 7 - 12) // 2)
                    keys = ", ".join(f"{_cut(k_tokens[j], share)} {w[idx, highlight_row, j]:.2f}" for j in top2)
                word = _cut(word, max(4, room - len(keys) - 3))
            name += "\n" + _cut(f"{word} → {keys}", room)
            ax.add_patch(plt.Rectangle((-0.5, highlight_row - 0.5), S, 1, fill=False, edgecolor=_HIGHLIGHT,
                                       linewidth=1.6, clip_on=False))
        ax.set_title(name, fontsize=fs + 1, pad=4)
        ax.set_xticks(range(S))
        ax.set_yticks(range(L))
        ax.tick_params(length=0, labelsize=fs)
        ax.set_xticklabels(k_tokens, rotation=90)
        ax.set_yticklabels(q_tokens)
        for spine in ax.spines.values():
            spine.set_visible(False)
        # a thin grid between cells so single cells read as cells
        ax.set_xticks(np.arange(-0.5, S, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, L, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=0.6)
        ax.tick_params(which="minor", length=0)
        if highlight_row is not None:
            labels = ax.get_yticklabels()
            if len(labels) == L:  # shared axes: only the left column shows query labels
                labels[highlight_row].set_color(_HIGHLIGHT)
                labels[highlight_row].set_fontweight("bold")
    fig.supxlabel("keys (attended to)", fontsize=fs + 1)
    fig.supylabel("queries (attending)", fontsize=fs + 1)
    if title:
        fig.suptitle(short_title(title, width=max(40, int(fig_w * 100 / (fs + 4)))), fontsize=fs + 4)
    cb = fig.colorbar(im, ax=axes, shrink=0.5, pad=0.02, aspect=30)
    cb.set_label("attention weight (square-root scale)", fontsize=fs)
    cb.set_ticks([0, 0.05, 0.2, 0.4, 0.6, 0.8, 1.0])
    cb.ax.tick_params(labelsize=fs)
    with warnings.catch_warnings():  # what is left undrawable (a combining mark: kept on its letter) is a box
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font", category=UserWarning)
        fig.savefig(path, dpi=dpi, facecolor="white")
    plt.close(fig)
    return str(path)
