"""Pictures of attention: it renders only (plain arrays and attnkit's own results in, files or HTML out).

Everything here takes numbers that were computed elsewhere — weights ``(H, L, S)`` for the PNG,
``{layer: (B, H, L, S)}`` for the page, a :class:`~attnkit.Trace`, a :class:`~attnkit.TileMass` —
and token labels; nothing here runs attention or loads a model (those are :mod:`attnkit`,
:func:`attnkit.tile_mass` and the applications in :mod:`attnkit.apps`). matplotlib is imported
only when a PNG is drawn (the viz extra: ``pip install -e '.[viz]'`` in the attnkit repository);
the HTML pages need nothing but a browser.

* :func:`save_heads_png` — one heatmap per head, token labels, a shared 0–1 colour scale.
* :func:`save_attention_html` — ONE self-contained file (inline JS/CSS, no network):
  pick sentence, layer and head, hover a token to see its attention lines.
* :func:`explain_page` — ONE self-contained page that walks through attention on your own
  numbers (``attnkit explain --html FILE``): hover a score or an output to see how it is made.
* :func:`tile_mass_page` — ONE offline zoomable page of a :class:`~attnkit.TileMass` (what
  ``TileMass.to_html`` writes and ``attnkit long`` opens). See ``docs/long.md``.
* the inline HTML a notebook shows for a mask, a plan, a dispatch decision and a trace
  (``_html_repr``; the objects reach it through ``attnkit._display``, never by importing it).
"""

from .explain_html import explain_page, save_explain_page
from .html import save_attention_html
from .long_html import tile_mass_page
from .png import save_heads_png

__all__ = ["save_heads_png", "save_attention_html", "explain_page", "save_explain_page", "tile_mass_page"]
