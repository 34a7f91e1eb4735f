"""``attnkit masks``: draw a mask as ASCII (``#`` attend, ``.`` masked)."""

from __future__ import annotations

__all__ = ["add_arguments", "run"]

_KINDS = ("causal", "causal-top-left", "window", "document", "prefix", "padding")


def add_arguments(p):
    p.add_argument("kind", choices=_KINDS, help="which mask to draw")
    p.add_argument("-L", type=int, default=8, help="query length (default 8)")
    p.add_argument("-S", type=int, default=None, help="key length (default: L)")
    p.add_argument("--size", type=int, default=3, help="window size / prefix length / valid keys (default 3)")
    p.add_argument("--docs", default=None, help="document ids for 'document', e.g. 0,0,0,1,1,2,2,2")
    p.add_argument("--and-causal", action="store_true", help="combine with a causal mask (&)")


def run(args) -> int:
    from .. import masks
    from ..cli import CLIError

    L = args.L
    S = L if args.S is None else args.S
    if not (1 <= L <= 64 and 1 <= S <= 64):
        raise CLIError(f"-L/-S: expected sizes in 1..64 for a drawing, got L={L}, S={S}.")
    if args.kind == "causal":
        m = masks.causal()
    elif args.kind == "causal-top-left":
        m = masks.causal("top_left")
    elif args.kind == "window":
        m = masks.sliding_window(args.size)
    elif args.kind == "prefix":
        m = masks.prefix_lm(args.size)
    elif args.kind == "padding":
        m = masks.padding([args.size])
    else:
        ids = [int(x) for x in args.docs.split(",")] if args.docs else [j * 3 // S for j in range(S)]
        m = masks.document(ids)
    if args.and_causal:
        m = m & masks.causal()
    print(f"{m!r}   L={L}, S={S}   (# attend, . masked; rows = queries, columns = keys)")
    print(m.draw(L, S))
    return 0
