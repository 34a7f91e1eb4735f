"""Inputs for the long-input view: synthetic q, k with a document or window mask, MiniLM's own q, k,
and any transformers causal LM's q, k at tens of thousands of tokens.

Shape legend: B batch, H query heads, Hkv key/value heads, L query length, S key length, D head dim.

* :func:`synthetic` — ``q (1, H, L, D)``, ``k (1, Hkv, L, D)`` and a mask, built to look like a
  trained model's heads (seeded, in O(L·H·D)): the heads of kv head ``c`` prefer keys within about
  ``2^(c+2)`` tokens (a position code), and the first token of each document is an attention sink.
* :func:`minilm_qk` — the query and key projections of every layer of the bundled
  all-MiniLM-L6-v2 on a text (up to its 512 positions): ``q, k (1, 12, L, 32)`` per layer, the
  tensors its attention layers multiply (checked against the model's own weights in the tests).
* :func:`model_long_page` — a transformers causal LM (a model, a model directory, or a config.json
  built with seeded random weights) on a long input: every layer's post-RoPE ``q (1, H, L, D)``
  and ``k (1, Hkv, L, D)`` captured on attnkit's fast path (:mod:`attnkit.integrations.long_capture`,
  O(L) memory), each layer's tile masses (:func:`attnkit.tile_mass`), and one page with a layer
  and head selector that opens on the layer whose heaviest tiles it lists.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import masks as _masks

__all__ = ["synthetic", "minilm_qk", "model_long_page", "ModelLongPage", "layer_tile_masses", "heaviest_layer",
           "random_ids", "default_block", "MINILM_MAX_TOKENS", "DEFAULT_TEXT", "MASKS"]

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


# ----------------------------------------------------------------------------------------------
# a transformers causal LM on a long input


def random_ids(n: int, vocab_size: int, *, seed: int = 0) -> torch.Tensor:
    """``(1, n)`` int64 token ids drawn uniformly from ``0..vocab_size-1`` by a generator seeded with
    ``seed`` (the same seed, the same ids; the global RNG is untouched): an input for a model
    directory without a tokenizer."""
    n, vocab_size = _check_int("n", n, 1), _check_int("vocab_size", vocab_size, 1)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {seed!r}.")
    return torch.randint(0, vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def default_block(L: int) -> int:
    """The tile size for ``L`` tokens: the power of two nearest above ``L / 512`` (about 512 tiles per
    side), at least 8 and at most 64."""
    b = 8
    while b < 64 and b * 512 < L:
        b *= 2
    return b


def layer_tile_masses(layers, *, block: int | tuple = 64, labels=None) -> list:
    """``[("layer i", TileMass), ...]`` from :func:`attnkit.integrations.long_capture.capture_qk`'s
    ``LayerQK`` list: each layer's exact mass per tile under the mask, causal flag, scale and
    score_mod that layer ran with (O(L) memory per layer; see :func:`attnkit.tile_mass`)."""
    from ..tilemass import tile_mass

    maps = []
    for lq in layers:
        tm = tile_mass(lq.q, lq.k, mask=lq.mask, causal=lq.causal, scale=lq.scale, score_mod=lq.score_mod,
                       block=block)
        tm.labels = labels
        maps.append((f"layer {lq.layer}", tm))
    return maps


def heaviest_layer(maps) -> int:
    """The index into ``maps`` (``[(name, TileMass), ...]``) of the layer with the heaviest tile away
    from the diagonal (largest share, mean of heads): the layer a summary lists and a page opens on.
    Ties (or no tile away from the diagonal anywhere) go to the earliest layer."""
    best, best_share = 0, -1.0
    for i, (_, tm) in enumerate(maps):
        top = tm.top(1, off_diagonal=True)
        share = top[0][1] if top else 0.0
        if share > best_share:
            best, best_share = i, share
    return best


@dataclass
class ModelLongPage:
    """What :func:`model_long_page` made.

    Attributes:
        html: the page's text (one offline file). path: where it was written (None: not written).
        maps: ``[("layer i", TileMass), ...]``, every captured layer (``TileMass.mass (1, H, T)``).
        open: the index into ``maps`` of the layer the page opens on, whose heaviest tiles it lists
            (:func:`heaviest_layer`).
        input_ids: ``(1, L)`` the tokens the model ran on. labels: their strings, or None.
        model_name, random_weights, seed: which model; ``random_weights`` True: built from its config with
            ``seed``; False: trained weights loaded from a directory; None: a model object passed in.
        seconds: ``{"model": load, "forward": capture, "tile_mass": all layers, "page": build}``.
    """

    html: str
    path: Path | None
    maps: list
    open: int
    input_ids: torch.Tensor
    labels: Any
    model_name: str
    random_weights: bool | None
    seed: int | None
    seconds: dict

    @property
    def L(self) -> int:
        """Tokens."""
        return int(self.input_ids.shape[1])

    def summary(self, top: int = 5) -> str:
        """A few lines: the model, the input, the times, and the opening layer's summary and heaviest tiles."""
        name, tm = self.maps[self.open]
        bm, bn = tm.block
        t = self.seconds
        lines = [f"model {self.model_name}{_weights_note(self.random_weights, self.seed, ' (', ')')}: "
                 f"{len(self.maps)} layers × {tm.H} heads, {self.L} tokens",
                 f"forward with q, k captured {t['forward']:.2f} s (load {t['model']:.2f} s); tile masses "
                 f"{t['tile_mass']:.2f} s for {len(self.maps)} layers",
                 f"{name} (the heaviest tile away from the diagonal; the page opens on it), {bm}×{bn} tiles:"]
        lines += tm.summary(top=0).splitlines()[1:]
        far = tm.top(top, off_diagonal=True) if top else []
        if far:
            lines.append(f"heaviest tiles away from the diagonal ({name}, mean of heads; share = fraction of those "
                         "query rows' attention):")
        lab = self.labels
        for _m, sh, (q0, q1), (k0, k1) in far:
            words = (f" {' '.join(lab[q0:q1])!r} -> {' '.join(lab[k0:k1])!r}"
                     if lab is not None and q1 - q0 <= 16 and k1 - k0 <= 16 else "")
            lines.append(f"  queries {q0}-{q1 - 1} -> keys {k0}-{k1 - 1}: share {100 * sh:.1f}%{words}")
        return "\n".join(lines)


def _weights_note(random_weights, seed, pre="", post="") -> str:
    if random_weights is None:
        return ""
    return pre + (f"random weights from its config, seed {seed}" if random_weights else "trained weights") + post


def model_long_page(model, input_ids, out=None, *, block=None, rows=None, labels=None, layers=None,
                    from_config: bool = False, seed: int = 0, title=None, max_bytes: int = 4_000_000) -> ModelLongPage:
    """A transformers causal LM's attention on a long input, as the tile-mass page (every layer and head).

    Shape legend: H query heads, Hkv key/value heads, L tokens, D head dim.

    Args:
        model: a transformers causal LM (any ``attn_implementation``: switched to attnkit's capturing
            one for the forward and back), the path of a model directory (config.json and weights)
            or of a config.json file (see :func:`attnkit.integrations.long_capture.load_causal_lm`:
            a config.json file is built with random weights seeded by ``seed``; a directory without
            weights needs ``from_config=True``), or what ``load_causal_lm`` returned.
        input_ids: ``(1, L)`` or ``(L,)`` token ids, or an int ``L``: that many random ids (seeded by
            ``seed``; for a model without a tokenizer).
        out: where to write the page (None: not written; the text is in ``.html``).
        block: tile size in tokens (default :func:`default_block` of L: 64 at 32k tokens).
        rows: query rows whose exact weights the page embeds (default: 6 spread over L).
        labels: L token strings shown on hover (default: the directory's tokenizer, when it has one).
        layers: keep the first ``layers`` layers (None: all).

    Returns:
        :class:`ModelLongPage`: the page (text and path), every layer's :class:`~attnkit.TileMass`,
        the layer it opens on (the one with the heaviest tile away from the diagonal, whose list it
        shows), and the times.

    Memory is O(L): q and k of each layer are captured (never an L×S tensor; see
    :mod:`attnkit.integrations.long_capture`), the tile masses keep ``(H, tiles)`` per layer.
    """
    from ..integrations import long_capture
    from ..viz.long_html import tile_mass_page

    t0 = time.perf_counter()
    if isinstance(model, (str, Path)):
        model = long_capture.load_causal_lm(model, from_config=from_config, seed=seed)
    random_w: bool | None
    if isinstance(model, long_capture.LoadedModel):
        model_obj, tok = model.model, model.tokenizer
        name, random_w, used_seed = model.name, model.random_weights, model.seed
    else:
        if not hasattr(model, "config") or not hasattr(model, "set_attn_implementation"):
            raise TypeError(f"model: expected a transformers model or the path of a model directory / config.json, "
                            f"got {type(model).__name__}.")
        # built by long_capture.build_from_config: random weights, and the seed; otherwise not known here
        used_seed = getattr(model, "_attnkit_from_config_seed", None)
        model_obj, tok, random_w = model, None, (True if used_seed is not None else None)
        name = str(getattr(model.config, "_name_or_path", "") or getattr(model.config, "model_type", "model"))
    t_model = time.perf_counter() - t0
    cfg = model_obj.config
    if isinstance(input_ids, int) and not isinstance(input_ids, bool):
        vocab = getattr(cfg, "vocab_size", None)
        if not isinstance(vocab, int):
            raise ValueError("input_ids: an int asks for random token ids, but the model's config has no vocab_size; "
                             "pass the token ids.")
        input_ids = random_ids(input_ids, vocab, seed=seed)
    ids = long_capture._check_ids(input_ids)
    L = int(ids.shape[1])
    npos = getattr(cfg, "max_position_embeddings", None)
    if isinstance(npos, int) and L > npos:
        raise ValueError(f"input_ids: {L} tokens, but the model has max_position_embeddings={npos}; pass at most "
                         f"{npos} tokens (or a config with more positions).")
    if labels is None and tok is not None:
        labels = tok.convert_ids_to_tokens(ids[0].tolist())
    if labels is not None and len(labels) != L:
        raise ValueError(f"labels: expected {L} token strings (one per input id), got {len(labels)}.")
    block = default_block(L) if block is None else block
    t1 = time.perf_counter()
    captured = long_capture.capture_qk(model_obj, ids, layers=layers)
    t_fwd = time.perf_counter() - t1
    t2 = time.perf_counter()
    maps = layer_tile_masses(captured, block=block, labels=labels)
    del captured
    t_tm = time.perf_counter() - t2
    best = heaviest_layer(maps)
    t3 = time.perf_counter()
    title = title or f"Attention mass per tile: {name}{_weights_note(random_w, used_seed, ' (', ')')}, {L} tokens, " \
                     "every layer"
    page = tile_mass_page(maps[best][1], maps=maps, rows=rows, title=title, max_bytes=max_bytes)
    path = None
    if out is not None:
        path = Path(out)
        path.write_text(page, encoding="utf-8")
    t_page = time.perf_counter() - t3
    return ModelLongPage(html=page, path=path, maps=maps, open=best, input_ids=ids, labels=labels, model_name=name,
                         random_weights=random_w, seed=used_seed,
                         seconds={"model": t_model, "forward": t_fwd, "tile_mass": t_tm, "page": t_page})
