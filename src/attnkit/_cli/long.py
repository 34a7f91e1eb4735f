"""``attnkit long``: attention over a long input, as a zoomable map of the mass per tile.

Three inputs: a seeded synthetic one (``--length``, ``--mask document|window|causal|none``,
``--heads``); the bundled all-MiniLM-L6-v2 on a text (``--model minilm --text ... | --file``,
up to its 512 positions); or any transformers causal LM (``--model DIR``, a model directory or
a config.json; ``--tokens N`` random ids or a text), its post-RoPE q and k captured per layer
on attnkit's fast path in O(L) memory. A model's page holds every layer, with a layer and head
selector, and opens on the layer whose heaviest tiles the summary lists. Prints a short summary
(sizes, time, where the mass goes, the heaviest tiles) and writes one offline HTML page (``--out``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

__all__ = ["add_arguments", "run"]


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def add_arguments(p):
    p.add_argument("--model", default="synthetic", metavar="synthetic|minilm|DIR",
                   help="synthetic q, k (default); the bundled all-MiniLM-L6-v2 on --text/--file; or DIR, any "
                        "transformers causal LM: a model directory (config.json and weights) or a config.json "
                        "file (built with random weights, seed --seed). A directory with a config and no "
                        "weights needs --from-config")
    p.add_argument("--from-config", action="store_true",
                   help="DIR: build the model from DIR/config.json with random weights (seed --seed), "
                        "whether or not DIR has weights")
    p.add_argument("--tokens", type=_positive, default=None, metavar="N",
                   help="DIR: run on N random token ids (seed --seed); the input when DIR has no tokenizer "
                        "(default 4096 when no --text/--file is given)")
    p.add_argument("--length", "-L", type=_positive, default=16384,
                   help="synthetic: tokens (default 16384; 131072 for the 128k view)")
    p.add_argument("--mask", choices=("document", "window", "causal", "none"), default="document",
                   help="synthetic: packed documents with causal inside (default), a sliding window, causal, none")
    p.add_argument("--window", type=_positive, default=512,
                   help="synthetic: window size for --mask window (default 512)")
    p.add_argument("--heads", type=_positive, default=8, help="synthetic: query heads (default 8)")
    p.add_argument("--kv-heads", type=_positive, default=None,
                   help="synthetic: key/value heads (GQA; default = --heads)")
    p.add_argument("--dim", type=_positive, default=64, help="synthetic: head dim (default 64)")
    p.add_argument("--seed", type=int, default=0,
                   help="the seed of the synthetic input, of DIR's random token ids and of weights built from a config "
                        "(default 0)")
    p.add_argument("--text", default=None,
                   help="minilm, DIR: the text (minilm's default: a built-in paragraph filled to 512 tokens; DIR "
                        "needs its tokenizer)")
    p.add_argument("--file", "--text-file", dest="file", default=None, metavar="PATH",
                   help="minilm, DIR: read the text from a file")
    p.add_argument("--max-tokens", type=_positive, default=None,
                   help="minilm, DIR: cut the text at this many tokens (minilm: <= 512, default 512; DIR: default "
                        "the model's max_position_embeddings)")
    p.add_argument("--block", type=_positive, default=None,
                   help="tile size in tokens (default 64 for synthetic, 8 for minilm; DIR: about L/512, 8 to 64)")
    p.add_argument("--rows", default=None, help="query rows whose exact weights the page embeds, e.g. 0,100,5000 "
                                                "(default: 8 spread over the input)")
    p.add_argument("--top", type=_positive, default=5, help="heaviest tiles to list (default 5)")
    p.add_argument("--out", default="attnkit-long.html", metavar="FILE",
                   help="the page to write (default ./attnkit-long.html)")


def _rows(text, L):
    from . import CLIError

    if text is None:
        return None
    try:
        rows = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"--rows: expected comma-separated query rows, e.g. 0,100,5000, got {text!r}.") from None
    bad = [r for r in rows if not 0 <= r < L]
    if not rows or bad:
        raise CLIError(f"--rows: expected rows in 0..{L - 1}, got {text!r}. Pick rows inside the input.")
    return rows


def _check_out(out: str) -> Path:
    from . import CLIError

    path = Path(out)
    if path.is_dir():
        raise CLIError(f"--out: expected a file name for the page, got the directory {out!r}. "
                       f"Pass e.g. --out {os.path.join(out, 'attnkit-long.html')}.")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise CLIError(f"--out: the directory {str(parent)!r} does not exist. Create it or write elsewhere.")
    return path


def _check_memory(args) -> None:
    """Refuse a synthetic input whose q, k and tile map could not fit in this machine's memory, before any work.

    The estimate: q and k in fp32 (H + Hkv) · L · D · 4 bytes, twice over while they are made, and for each tile
    the plan can compute its mass per head (4 bytes) and its place (16 bytes), and the page's float64 copies of
    those masses with their mean over heads (2 · 8 · (H + 1)) and sorting of places (24). Tiles: all of them
    without a mask, half under causal, and about L / block rows of (reach / block + 2) for a window or documents
    (up to 2048 tokens).
    """
    from .._machine import physical_memory
    from . import CLIError

    L, H, D, block = args.length, args.heads, args.dim, args.block or 64
    Hkv = args.kv_heads or H
    nq = -(-L // block)
    reach = {"window": args.window, "document": 2048}.get(args.mask)
    if reach is not None:
        tiles = nq * min(nq, reach // block + 2)
    else:
        tiles = nq * nq if args.mask == "none" else nq * (nq + 1) // 2
    per_tile = 4 * H + 16 + 16 * (H + 1) + 24
    need = 2 * 4 * (H + Hkv) * L * D + tiles * per_tile
    have = physical_memory()
    if have is not None and need > 0.8 * have:
        raise CLIError(f"--length: L={L:,} with H={H}, Hkv={Hkv}, D={D}, --mask {args.mask} and {block}-token tiles "
                       f"needs about {need / 2**30:,.1f} GiB (q and k: {2 * 4 * (H + Hkv) * L * D / 2**30:,.1f}; "
                       f"{tiles:,} tiles and their page: {tiles * per_tile / 2**30:,.1f}), and this machine has "
                       f"{have / 2**30:.1f} GiB. Pass a smaller --length, fewer --heads, or a larger --block.")


def _text(args):
    """The text of --text or --file (None when neither), checked."""
    from . import CLIError

    if args.text is not None and args.file is not None:
        raise CLIError("--text/--file: expected one of them, got both. Pass the text inline or in a file.")
    text = args.text
    if args.file is not None:
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(
                f"--file: cannot read {args.file!r} as UTF-8 text ({e}). Pass a readable text file.") from None
    if text is not None and not text.strip():
        raise CLIError("--text/--file: expected some text, got an empty one.")
    return text


def run(args) -> int:
    from . import CLIError

    out = _check_out(args.out)  # before any work: a bad path fails first
    if args.model not in ("synthetic", "minilm"):
        return _run_model(args, out)
    if args.tokens is not None or args.from_config:
        raise CLIError(f"--{'tokens' if args.tokens is not None else 'from-config'}: only with --model DIR (a "
                       f"transformers model directory or config.json), got --model {args.model}.")
    if args.model == "minilm":
        return _run_minilm(args, out)
    if args.text is not None or args.file is not None:
        raise CLIError("--text/--file: only with --model minilm or --model DIR (the synthetic input has no text). "
                       "Add --model minilm, or leave them out.")
    import torch

    from ..apps.long_inputs import synthetic
    from ..tilemass import tile_mass

    if args.kv_heads is not None and args.heads % args.kv_heads:
        raise CLIError(f"--kv-heads: expected a divisor of --heads {args.heads}, got {args.kv_heads}.")
    if args.dim < 16:
        raise CLIError(f"--dim: expected a head dim >= 16, got {args.dim}.")
    _check_memory(args)
    rows = _rows(args.rows, args.length)
    t0 = time.perf_counter()
    q, k, mask = synthetic(args.length, H=args.heads, Hkv=args.kv_heads, D=args.dim, mask=args.mask,
                           window=args.window, seed=args.seed)
    t_in = time.perf_counter() - t0
    block = args.block or 64
    tm = tile_mass(q, k, mask=mask, block=block)
    print(f"synthetic input: L=S={args.length}, H={args.heads}, Hkv={args.kv_heads or args.heads}, "
          f"D={args.dim}, seed {args.seed} ({t_in:.2f} s to make; threads {torch.get_num_threads()})")
    print(tm.summary(top=args.top))
    t1 = time.perf_counter()
    page = tm.to_html(out, title=f"Attention mass per tile: synthetic, {args.length} tokens, {args.mask} mask",
                      rows=rows)
    print(f"wrote {out} ({len(page.encode()) / 1e6:.2f} MB, {time.perf_counter() - t1:.2f} s; one offline file: "
          "open it in a browser, drag to zoom, hover a tile)")
    return 0


def _run_minilm(args, out) -> int:
    from ..integrations.minilm import ModelUnavailable
    from . import CLIError

    text = _text(args)
    max_tokens = 512 if args.max_tokens is None else args.max_tokens
    if max_tokens > 512 or max_tokens < 3:
        raise CLIError(f"--max-tokens: expected 3..512 (all-MiniLM-L6-v2 has 512 positions), got {max_tokens}.")
    from ..apps.long_inputs import minilm_qk
    from ..tilemass import tile_mass
    from ..viz.long_html import tile_mass_page

    t0 = time.perf_counter()
    try:
        qs, ks, tokens, note = minilm_qk(text, max_tokens=max_tokens)
    except ModelUnavailable as e:
        raise CLIError(str(e)) from None
    t_model = time.perf_counter() - t0
    if note:
        print(f"note: {note}")
    L = len(tokens)
    rows = _rows(args.rows, L)
    block = args.block or 8
    maps, secs = [], 0.0
    for layer, (q, k) in enumerate(zip(qs, ks, strict=True)):
        tm = tile_mass(q, k, block=block)
        tm.labels = tokens
        secs += tm.seconds
        maps.append((f"layer {layer}", tm))
    print(f"all-MiniLM-L6-v2: {L} tokens, 6 layers × 12 heads (model load and run {t_model:.2f} s; "
          f"tile masses {secs:.2f} s)")
    last = maps[-1][1]
    print(f"last layer (5), {block}×{block} tiles:")
    print("\n".join(last.summary(top=0).splitlines()[2:]))
    far = last.top(args.top, off_diagonal=True)
    if far:
        print("heaviest tiles away from the diagonal (mean of heads):")
        for _mass, sh, (q0, q1), (k0, k1) in far:
            print(f"  queries {q0}-{q1 - 1} {' '.join(tokens[q0:q1])!r} -> keys {k0}-{k1 - 1} "
                  f"{' '.join(tokens[k0:k1])!r}: share {100 * sh:.1f}%")
    page = tile_mass_page(last, maps=maps, rows=rows,  # opens on the last layer, whose tiles are listed above
                          title=f"Attention mass per tile: all-MiniLM-L6-v2, {L} tokens, every layer")
    out.write_text(page, encoding="utf-8")
    print(f"wrote {out} ({len(page.encode()) / 1e6:.2f} MB; pick a layer and head, drag to zoom, hover a tile)")
    return 0


def _run_model(args, out) -> int:
    """--model DIR: a transformers causal LM's every layer on a long input."""
    from . import CLIError

    text = _text(args)
    if text is not None and args.tokens is not None:
        raise CLIError("--tokens: expected either a text (--text/--file) or --tokens N, got both. Drop one.")
    path = Path(args.model)
    if not path.exists():
        raise CLIError(f"--model: expected synthetic, minilm, or a transformers model directory / config.json, got "
                       f"{args.model!r}, which does not exist.")
    if path.is_file() and path.suffix != ".json":
        raise CLIError(f"--model: expected a model directory or its config.json, got the file {args.model!r}.")
    try:
        from ..apps import long_inputs
        from ..integrations import long_capture
        from ..integrations.minilm import INSTALL_HINT
    except ImportError as e:  # pragma: no cover - transformers is missing
        raise CLIError(f"--model DIR needs transformers ({e}).") from None
    t0 = time.perf_counter()
    try:
        loaded = long_capture.load_causal_lm(path, from_config=args.from_config, seed=args.seed)
    except ImportError as e:
        raise CLIError(f"--model DIR needs the 'transformers' package ({e}); install it with {INSTALL_HINT}.") \
            from None
    except ValueError as e:
        msg = str(e).replace("from_config=True (attnkit long: --from-config, seeded by --seed)",
                             "--from-config (seeded by --seed)")
        raise CLIError("--" + msg) from None
    t_load = time.perf_counter() - t0
    cfg = loaded.model.config
    npos = getattr(cfg, "max_position_embeddings", None)
    npos = npos if isinstance(npos, int) else None
    note = None
    if text is not None:
        if loaded.tokenizer is None:
            raise CLIError(f"--text/--file: {args.model!r} has no tokenizer, so the text cannot become token ids; "
                           "pass --tokens N instead (N random token ids, seed --seed).")
        ids = loaded.tokenizer(text, return_tensors="pt", verbose=False)["input_ids"][:1]
        cut = args.max_tokens or npos
        if cut is not None and ids.shape[1] > cut:
            note = f"kept the first {cut} of {ids.shape[1]} tokens (--max-tokens / the model's positions)"
            ids = ids[:, :cut]
        what = f"a text of {ids.shape[1]} tokens"
    else:
        n = 4096 if args.tokens is None else args.tokens
        if npos is not None and n > npos:
            raise CLIError(f"--tokens: expected at most {npos} (the model's max_position_embeddings), got {n}. "
                           "Pass fewer tokens, or a config with more positions.")
        vocab = getattr(cfg, "vocab_size", None)
        if not isinstance(vocab, int):
            raise CLIError("--tokens: the model's config has no vocab_size to draw ids from; pass --text/--file.")
        ids = long_inputs.random_ids(n, vocab, seed=args.seed)
        what = f"{n} random token ids (seed {args.seed})"
    L = int(ids.shape[1])
    rows = _rows(args.rows, L)
    if note:
        print(f"note: {note}")
    print(f"input: {what}")
    try:
        res = long_inputs.model_long_page(loaded, ids, out, block=args.block, rows=rows)
    except (ValueError, TypeError) as e:
        raise CLIError(f"--model: {e}") from None
    res.seconds["model"] = t_load
    print(res.summary(top=args.top))
    print(f"wrote {out} ({len(res.html.encode()) / 1e6:.2f} MB, {res.seconds['page']:.2f} s; pick a layer and head, "
          "drag to zoom, hover a tile)")
    return 0

