"""attnkit's torch operators, registered by importing this module: ``torch.ops.attnkit.attention`` and
``torch.ops.attnkit.attention_backward`` (:mod:`attnkit._op`), the call ``attnkit.attention`` makes under
``torch.compile``, ``torch.export`` and ``torch.jit.trace``.

A program saved with ``torch.export.save`` or ``torch.jit.save`` names these operators; a new process registers them
before loading it::

    import attnkit.ops  # noqa: F401  (registers torch.ops.attnkit.*)
    program = torch.export.load("model.pt2")

(``import attnkit`` alone does not: it imports neither torch nor the operators until they are used.)
"""

from __future__ import annotations

from . import _op

__all__ = ["attention", "attention_backward"]

attention = _op._attention_op
attention_backward = _op._attention_backward_op
