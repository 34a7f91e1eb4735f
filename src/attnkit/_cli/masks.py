"""``attnkit masks``: draw a mask as ASCII (``#`` attend, ``.`` masked)."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]

_KINDS = ("causal", "causal-top-left", "window", "chunked", "document", "prefix", "padding")
# the names of attnkit.masks (a user who wrote masks.sliding_window(3) types sliding_window), with - or _
_ALIASES = {"sliding_window": "window", "sliding-window": "window", "prefix_lm": "prefix", "prefix-lm": "prefix",
            "causal_top_left": "causal-top-left", "top_left": "causal-top-left", "top-left": "causal-top-left"}
MAX_DRAW = 64


def _size(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or not 1 <= n <= MAX_DRAW:
        raise argparse.ArgumentTypeError(f"expected a size in 1..{MAX_DRAW} for a drawing, got {text!r}")
    return n


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _kind(text: str) -> str:
    return _ALIASES.get(text, text)


def add_arguments(p):
    p.add_argument("kind", type=_kind, choices=_KINDS,
                   help="which mask to draw (attnkit.masks' names too: sliding_window, prefix_lm)")
    p.add_argument("-L", type=_size, default=8, help=f"query length, 1..{MAX_DRAW} (default 8)")
    p.add_argument("-S", type=_size, default=None, help=f"key length, 1..{MAX_DRAW} (default: L)")
    p.add_argument("--size", type=_count, default=None,
                   help="window or chunk size (>= 1) / prefix length (0..S) / valid keys for padding (0..S) "
                        "(default 3)")
    p.add_argument("--docs", default=None,
                   help="document ids for 'document', one integer per key, e.g. 0,0,0,1,1,2,2,2 (default: three "
                        "documents of about S/3 keys each)")
    p.add_argument("--and-causal", action="store_true", help="combine with a causal mask (&)")


def run(args) -> int:
    from .. import masks
    from . import CLIError

    L = args.L
    S = L if args.S is None else args.S
    if args.docs is not None and args.kind != "document":
        raise CLIError(f"--docs: document ids are for the 'document' mask, got kind {args.kind!r}. Drop --docs, or "
                       "draw 'document'.")
    sized = ("window", "chunked", "prefix", "padding")
    if args.size is not None and args.kind not in sized:
        raise CLIError(f"--size: only for {', '.join(sized)}; the '{args.kind}' mask has no size. Drop --size.")
    size = 3 if args.size is None else args.size
    if args.kind == "causal":
        m = masks.causal()
    elif args.kind == "causal-top-left":
        m = masks.causal("top_left")
    elif args.kind in ("window", "chunked"):
        what = "window" if args.kind == "window" else "chunk"
        if size < 1:
            raise CLIError(f"--size: expected a {what} size >= 1 for '{args.kind}', got {size}.")
        m = masks.sliding_window(size) if args.kind == "window" else masks.chunked(size)
    elif args.kind in ("prefix", "padding"):
        if not 0 <= size <= S:
            what = "prefix length" if args.kind == "prefix" else "number of valid keys"
            raise CLIError(f"--size: expected a {what} in 0..S = 0..{S} for '{args.kind}', got {size}. "
                           + ("Pass a smaller --size or a larger -S." if size > S else "Pass 0 or more."))
        m = masks.prefix_lm(size) if args.kind == "prefix" else masks.padding([size])
    else:
        if args.docs:
            parts = [x.strip() for x in args.docs.split(",")]
            if not all(x.lstrip("+-").isdigit() for x in parts):
                raise CLIError(f"--docs: expected comma-separated integer ids (one per key), e.g. 0,0,1,1, "
                               f"got {args.docs!r}.")
            if len(parts) != S:
                raise CLIError(f"--docs: expected one id per key (S = {S}), got {len(parts)} ids in {args.docs!r}. "
                               "Pass S ids or set -S to their number.")
            ids = [int(x) for x in parts]
        else:
            ids = [j * 3 // S for j in range(S)]
        if L > S:
            raise CLIError(f"-L/-S: a document mask aligns the queries to the last L keys, so it needs L <= S; "
                           f"got L={L}, S={S}.")
        m = masks.document(ids)
    if args.and_causal:
        m = m & masks.causal()
    try:
        m.validate(1, 1, L, S)
    except ValueError as e:  # any check of attnkit.masks not caught above: still the user's sizes
        raise CLIError(f"{args.kind} with -L {L} -S {S} --size {size}: {e}") from None
    drawing = m.draw(L, S)
    print(f"{m!r}   L={L}, S={S}   (# attend, . masked; rows = queries, columns = keys)")
    if args.kind == "document":
        print(f"document ids of the keys: {','.join(map(str, ids))}" + ("" if args.docs else " (the default; --docs)"))
    print(drawing)
    dead = [i for i, row in enumerate(drawing.splitlines()[1:]) if "#" not in row]
    if dead:
        rows = "every query row" if len(dead) == L else "query row" + ("s " if len(dead) > 1 else " ") + ", ".join(
            f"q{i}" for i in dead)
        print(f"note: {rows} see{'' if 1 < len(dead) < L else 's'} no key (fully masked): attention "
              "gives such a row output 0 (and lse -inf), not NaN.")
    return 0
