"""Pictures of attention weights: a PNG grid of heads and an offline interactive HTML page.

Both take plain arrays — weights ``(H, L, S)`` for the PNG, ``{layer: (B, H, L, S)}``
for the page — and token labels, so they work for any model or for
:func:`attnkit.explain` traces. matplotlib is imported only when a PNG is drawn
(the viz extra: ``pip install -e '.[viz]'`` in the attnkit repository); the HTML page needs nothing but a browser.

* :func:`save_heads_png` — one heatmap per head, token labels, a shared 0–1 colour scale.
* :func:`save_attention_html` — ONE self-contained file (inline JS/CSS, no network):
  pick sentence, layer and head, hover a token to see its attention lines.
* :func:`explain_page` — ONE self-contained page that walks through attention on your own
  numbers (``attnkit explain --html FILE``): hover a score or an output to see how it is made.
* :func:`tile_mass` — attention over a long input (128k tokens and more): the exact mass of
  every (query block × key block) tile from q, k and a mask, in O(L) memory, skipping the
  plan's empty tiles; exact row and tile weights on demand; ``TileMass.to_html`` writes ONE
  offline zoomable page (``attnkit long``). See ``docs/long.md``.
* :func:`show` — a real model's attention on your sentences (what ``attnkit show``
  runs): a table for one word, the PNG and the page. Needs the model extra
  (``pip install -e '.[model]'`` in the attnkit repository, or ``make demo``);
  bad arguments raise :class:`ShowInputError` (a ``ValueError`` naming the argument).
"""

from ._show import ShowDependencyError, ShowInputError, ShowResult, show
from .explain_html import explain_page, save_explain_page
from .html import save_attention_html
from .png import save_heads_png
from .tilemass import TileMass, tile_mass

__all__ = ["save_heads_png", "save_attention_html", "explain_page", "save_explain_page", "show", "ShowResult",
           "ShowInputError", "ShowDependencyError", "tile_mass", "TileMass"]
