"""Inputs for the long-input view: synthetic q, k with a document or window mask, and MiniLM's own q, k.

Shape legend: B batch, H query heads, Hkv key/value heads, L query length, S key length, D head dim.

* :func:`synthetic` — ``q (1, H, L, D)``, ``k (1, Hkv, L, D)`` and a mask, built to look like a
  trained model's heads (seeded, in O(L·H·D)): the heads of kv head ``c`` prefer keys within about
  ``2^(c+2)`` tokens (a position code), and the first token of each document is an attention sink.
* :func:`minilm_qk` — the query and key projections of every layer of the bundled
  all-MiniLM-L6-v2 on a text (up to its 512 positions): ``q, k (1, 12, L, 32)`` per layer, the
  tensors its attention layers multiply (checked against the model's own weights in the tests).
"""

from __future__ import annotations

import torch

from .. import masks as _masks

__all__ = ["synthetic", "minilm_qk", "MINILM_MAX_TOKENS", "DEFAULT_TEXT", "MASKS"]

MASKS = ("document", "window", "causal", "none")
MINILM_MAX_TOKENS = 512  # all-MiniLM-L6-v2's position embeddings (config.max_position_embeddings)

DEFAULT_TEXT = (
    "The river had carved its bank for a thousand years before the town was built beside it. Every spring "
    "the water rose, brown with mud from the hills, and the fishermen pulled their boats higher onto the "
    "stones. The bank kept the ledger of the floods in thin bands of clay, one for each year, and children "
    "learned to count them as their grandparents had. When the new bridge was planned, the engineers read "
    "the same bands to decide how high the arches must stand. A clerk at the savings bank across the square "
    "lent the money, and the two banks of the town, one of water and one of coins, were joined by stone. "
)


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}.")
    return value


def synthetic(L: int = 131072, *, H: int = 8, Hkv: int | None = None, D: int = 64, mask: str = "document",
              window: int = 512, doc_range=(128, 2048), seed: int = 0, dtype=torch.float32):
    """Seeded ``(q, k, mask)`` with trained-looking heads, for the long-input view.

    Args:
        L: tokens (L = S). H, Hkv: query and key/value heads (``H % Hkv == 0``; default MHA). D: head dim.
        mask: ``"document"`` (packed documents of ``doc_range`` tokens, causal inside each),
            ``"window"`` (sliding window of ``window`` keys), ``"causal"`` or ``"none"``.
        seed: the generator's seed (the same seed gives the same tensors).

    Returns:
        ``q (1, H, L, D)``, ``k (1, Hkv, L, D)``, and an :mod:`attnkit.masks` mask (or None).
    """
    L, H, D = _check_int("L", L, 1), _check_int("H", H, 1), _check_int("D", D, 16)
    Hkv = H if Hkv is None else _check_int("Hkv", Hkv, 1)
    if H % Hkv:
        raise ValueError(f"Hkv: expected a divisor of H={H}, got {Hkv}. Query head h uses kv head h // (H // Hkv).")
    if mask not in MASKS:
        raise ValueError(f"mask: expected one of {MASKS}, got {mask!r}.")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, L, D, generator=g, dtype=dtype) * 0.6
    k = torch.randn(1, Hkv, L, D, generator=g, dtype=dtype) * 0.6
    pos = torch.arange(L, dtype=torch.float64)
    # a position code in 8 of the D dims: q_i·k_j gains a·cos(ω (i - j)), so the heads of kv
    # head c favour keys within about 1/ω = 2^(c+2) tokens (rotary-like locality, a different
    # reach per kv head; the query heads sharing it differ in how sharply they hold to it)
    gsz = H // Hkv
    for kh in range(Hkv):
        w = 1.0 / 2 ** (kh % 10 + 2)
        for c in range(4):
            ang = pos * w * 1.9 ** c / 4  # incommensurate frequencies: all in phase only at i = j
            code = torch.stack([torch.cos(ang), torch.sin(ang)], -1).to(dtype)  # (L, 2)
            k[0, kh, :, 2 * c:2 * c + 2] += 3.0 * code
            for h in range(kh * gsz, (kh + 1) * gsz):
                q[0, h, :, 2 * c:2 * c + 2] += 3.0 * (1 + (h - kh * gsz)) / gsz * code
    doc_ids = None
    if mask == "document":
        lo, hi = doc_range
        lens = torch.randint(lo, hi + 1, (L // lo + 1,), generator=g)
        doc_ids = torch.repeat_interleave(torch.arange(lens.numel()), lens)[:L]
        starts = torch.nonzero(torch.diff(doc_ids, prepend=torch.tensor([-1]))).flatten()
    else:
        starts = torch.tensor([0])
    # attention sinks: the first token of each document answers every query a little
    k[0, :, starts, 8:12] += 3.0
    q[0, :, :, 8:12] += 1.0
    m = {"document": lambda: _masks.document(doc_ids) & _masks.causal(),
         "window": lambda: _masks.sliding_window(window),
         "causal": lambda: _masks.causal(),
         "none": lambda: None}[mask]()
    return q, k, m


def minilm_qk(text: str | None = None, *, max_tokens: int = MINILM_MAX_TOKENS, model_path=None, fill: bool = False):
    """all-MiniLM-L6-v2's ``q`` and ``k`` of every layer on ``text``: ``(qs, ks, tokens, note)``.

    ``qs[l]``, ``ks[l]``: ``(1, 12, L, 32)`` float32 for layer ``l`` (0..5), the projections its
    attention multiplies (``softmax(q kᵀ/√32)``, no mask for one unpadded text). ``tokens``: the
    L token strings ([CLS] … [SEP]). A text longer than ``max_tokens`` (≤ 512, the model's
    positions) is cut there and ``note`` says so (None when nothing was cut); ``fill=True``
    repeats the text up to ``max_tokens`` (the default text is filled, to show the longest input).
    """
    from ..integrations import minilm

    max_tokens = _check_int("max_tokens", max_tokens, 3)
    if max_tokens > MINILM_MAX_TOKENS:
        raise ValueError(f"max_tokens: expected at most {MINILM_MAX_TOKENS} (all-MiniLM-L6-v2's positions), "
                         f"got {max_tokens}. Pass --max-tokens {MINILM_MAX_TOKENS} or less.")
    if text is None:
        text, fill = DEFAULT_TEXT, True
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text: expected a non-empty string, got {text!r}.")
    tok, model = minilm.load(model_path, attn_implementation="eager")
    ids = tok(text, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
    room = max_tokens - 2
    note = None
    if fill and len(ids) < room:
        ids = (ids * (room // max(1, len(ids)) + 1))[:room]
    elif len(ids) > room:
        note = (f"kept the first {room} of {len(ids)} text tokens "
                f"(the model has {max_tokens} positions with [CLS] and [SEP])")
        ids = ids[:room]
    input_ids = torch.tensor([[tok.cls_token_id, *ids, tok.sep_token_id]])
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True)
    cfg = model.config
    nh, hd = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    qs, ks = [], []
    # hidden_states[l] is layer l's input: one per layer, and the last output
    for layer, h in zip(model.encoder.layer, out.hidden_states[:-1], strict=True):
        sa = layer.attention.self
        with torch.no_grad():
            q = sa.query(h).view(1, -1, nh, hd).transpose(1, 2).contiguous()
            k = sa.key(h).view(1, -1, nh, hd).transpose(1, 2).contiguous()
        qs.append(q)
        ks.append(k)
    tokens = tok.convert_ids_to_tokens(input_ids[0].tolist())
    return qs, ks, tokens, note
