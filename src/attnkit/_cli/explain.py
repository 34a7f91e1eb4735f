"""``attnkit explain``: attention step by step, on the seeds' examples or your own Q, K, V."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["add_arguments", "run", "EXAMPLES"]

# The tutorials' own examples (shared/seeds). Their printed numbers have errors;
# ``note`` says what the tutorial printed and what is right.
EXAMPLES = {
    "seed": dict(
        title="Seed 003: 3 tokens, d_k = 2",
        q=[[1, 0], [0, 1], [1, 1]], k=[[1, 1], [1, 0], [0, 1]], v=[[10, 0], [0, 10], [5, 5]],
        tokens=None,
        note=("Tutorial erratum: it prints weights [0.42, 0.42, 0.16] and output row 1 = [5.3, 4.2] "
              "(later [0.4, 0.4, 0.2] → [5, 4]). The exact values are weights [0.4011, 0.4011, 0.1978] "
              "and output [5.0, 5.0]: 0.4011·[10, 0] + 0.4011·[0, 10] + 0.1978·[5, 5]."),
    ),
    "cat": dict(
        title='Seed 002: "The cat chased the mouse" — the query "chased" against The, cat, mouse (Q = K = V = word vectors)',
        q=[[5, 1]], k=[[1, 0], [2, 3], [4, 4]], v=[[1, 0], [2, 3], [4, 4]],
        tokens=(["chased"], ["The", "cat", "mouse"]),
        note=("The tutorial stops at 'scaled scores 5/√2, 13/√2, 24/√2' (it typesets them as 5/25/2 …). "
              "Carried through: 3.5355, 9.1924, 16.9706, and softmax gives ≈ [0.000001, 0.000419, 0.999580] "
              '— "mouse" takes almost all of the attention.'),
    ),
    "random": dict(title="Seed 000: random 3×4 Q, K, V (use --seed)", tokens=None, note=None),
    "positional": dict(title="Seed 003: sinusoidal positional encoding, d_model = 4", tokens=None, note=None),
}


def add_arguments(p):
    p.add_argument("--example", choices=sorted(EXAMPLES), default="seed",
                   help="which seed example to run (default: seed, the 3-token example of seed 003)")
    p.add_argument("--seed", type=int, default=0, help="random seed for --example random (default 0)")
    p.add_argument("--q", type=Path, help="Q as .npy, .csv or .json, shape (L, D)")
    p.add_argument("--k", type=Path, help="K as .npy, .csv or .json, shape (S, D)")
    p.add_argument("--v", type=Path, help="V as .npy, .csv or .json, shape (S, Dv)")
    p.add_argument("--causal", action="store_true", help="look-ahead mask (bottom-right aligned when L ≠ S)")
    p.add_argument("--mask", help="mask: 'causal', 'window:N', 'prefix:N', 'document:0,0,1,1', 'padding:N', "
                                  "or a .npy/.csv/.json bool matrix (True/1 = attend)")
    p.add_argument("--precision", type=int, default=4, help="decimals shown (default 4)")


def _load(path: Path, name: str) -> np.ndarray:
    from ..cli import CLIError

    if not path.exists():
        raise CLIError(f"--{name}: file {str(path)!r} not found. Pass an existing .npy, .csv or .json file.")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            arr = np.load(path)
        elif suffix == ".csv":
            arr = np.loadtxt(path, delimiter=",", ndmin=2)
        elif suffix == ".json":
            arr = np.asarray(json.loads(path.read_text()))
        else:
            raise CLIError(f"--{name}: expected a .npy, .csv or .json file, got {path.name!r}.")
    except (OSError, ValueError) as e:
        raise CLIError(f"--{name}: could not read {path.name!r}: {e}") from None
    if arr.dtype == bool or name == "mask":
        return arr.astype(bool)
    if arr.dtype.kind not in "iuf":
        raise CLIError(f"--{name}: expected numbers, got dtype {arr.dtype}.")
    return arr.astype(np.float64)


def _parse_mask(spec: str | None, L: int, S: int):
    from .. import masks
    from ..cli import CLIError

    if spec is None:
        return None
    kind, _, arg = spec.partition(":")
    try:
        if kind == "causal":
            return masks.causal(arg or "bottom_right")
        if kind == "window":
            return masks.sliding_window(int(arg))
        if kind == "prefix":
            return masks.prefix_lm(int(arg))
        if kind == "document":
            return masks.document([int(x) for x in arg.split(",")])
        if kind == "padding":
            return masks.padding([int(arg)])
    except ValueError as e:
        raise CLIError(f"--mask {spec!r}: {e}") from None
    path = Path(spec)
    if path.suffix.lower() in (".npy", ".csv", ".json"):
        return _load(path, "mask")
    raise CLIError(f"--mask: expected causal, window:N, prefix:N, document:ids, padding:N or a file, got {spec!r}.")


def _positional(args) -> int:
    from .._format import format_matrix
    from ..positional import sinusoidal

    pe = sinusoidal(5, 4, dtype=__import__("torch").float64).numpy()
    print("Seed 003: sinusoidal positional encoding, 5 positions, d_model = 4")
    print("PE(pos, 2i) = sin(pos / 10000^(2i/d_model)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))\n")
    print(format_matrix(pe, [f"pos{i}" for i in range(5)], [f"d{j}" for j in range(4)], args.precision))
    print("\nNote: the tutorial prints PE(1, 2) = sin(0.0001) ≈ 0.0001 and PE(1, 3) ≈ 1.0000; its code raises "
          "10000 to 2*i/d_model while i already steps by 2, doubling the exponent. Correct: "
          f"PE(1, 2) = sin(1/10000^(2/4)) = sin(0.01) = {pe[1, 2]:.4f}, PE(1, 3) = cos(0.01) = {pe[1, 3]:.5f}.")
    return 0


def run(args) -> int:
    from .. import explain
    from .._format import format_trace
    from ..cli import CLIError

    if args.example == "positional" and not (args.q or args.k or args.v):
        return _positional(args)
    own = [args.q, args.k, args.v]
    tokens, note = None, None
    if any(own):
        if not all(own):
            raise CLIError("--q, --k, --v: pass all three files (or none, for a built-in --example).")
        q, k, v = (_load(p, n) for p, n in zip(own, "qkv"))
        title = f"Your Q {q.shape}, K {k.shape}, V {v.shape}"
    elif args.example == "random":
        rng = np.random.default_rng(args.seed)
        q, k, v = (rng.standard_normal((3, 4)) for _ in range(3))
        title = f"{EXAMPLES['random']['title']} — seed {args.seed}"
        note = ("The tutorial's softmax computes exp(x) without subtracting the row maximum, which "
                "overflows to inf/nan once a score passes ~709 (float64); attnkit subtracts the maximum.")
    else:
        ex = EXAMPLES[args.example]
        q, k, v = (np.asarray(ex[n], dtype=np.float64) for n in "qkv")
        title, tokens, note = ex["title"], ex["tokens"], ex["note"]
    for n, a in zip("qkv", (q, k, v)):
        if a.ndim != 2:
            raise CLIError(f"--{n}: expected a 2-D matrix (rows = tokens), got shape {a.shape}.")
    mask = _parse_mask(args.mask, q.shape[0], k.shape[0])
    t = explain(q, k, v, mask=mask, causal=args.causal)
    print(title)
    print(f"Q {q.shape}, K {k.shape}, V {v.shape}; scale = 1/√d_k = {t.scale:.6f}\n")
    q_tokens, k_tokens = tokens if isinstance(tokens, tuple) else (tokens, tokens)
    print(format_trace(t, q_tokens=q_tokens, k_tokens=k_tokens, prec=args.precision))
    if note:
        print("\nNote: " + note)
    return 0
