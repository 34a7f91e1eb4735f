"""``attnkit explain``: attention step by step, on the worked examples or your own Q, K, V.

Files (``--q/--k/--v/--mask``): ``.npy``; ``.csv``/``.txt``/``.tsv`` text tables (one row per
line, values separated by commas or by whitespace, as ``np.savetxt`` writes by default; ``#``
lines are comments); ``.json`` nested lists. Q, K, V are read as float64 matrices (L, D),
(S, D), (S, Dv). A mask file is an (L, S) matrix whose dtype says what it means: bool
(True = attend), integers 0/1 (1 = attend) or floats (an additive bias on the scaled scores:
0 = attend, -inf = masked, any other value is added).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["add_arguments", "run", "EXAMPLES", "MASK_SPECS", "load_matrix", "parse_mask"]

SUFFIXES = (".npy", ".csv", ".txt", ".tsv", ".json")
MAX_PRECISION = 16  # float64 has ~16 significant decimal digits; more would print noise

MASK_SPECS = ("causal, causal:top_left, window:N (N >= 1), prefix:N, padding:N (N <= S), "
              "document:ID,ID,... (one integer id per key), or a .npy/.csv/.txt/.json file")

MASK_FILE_HELP = ("A mask file is an (L, S) matrix (rows = queries, columns = keys) read by its type: "
                  "bool (true/false) = True attends; integers 0/1 = 1 attends, 0 is masked (other "
                  "integers are an error); floats = an additive bias on the scaled scores (0 attends, "
                  "-inf is masked, any other value is added; write -inf, or -Infinity in JSON).")

# The worked examples. ``note(trace, masked, prec)`` writes the note from what was computed.
EXAMPLES: dict[str, dict[str, Any]] = {
    "3-token": dict(
        title=("The 3-token example: Q = [[1,0],[0,1],[1,1]], K = [[1,1],[1,0],[0,1]], "
               "V = [[10,0],[0,10],[5,5]], d_k = 2"),
        q=[[1, 0], [0, 1], [1, 1]], k=[[1, 1], [1, 0], [0, 1]], v=[[10, 0], [0, 10], [5, 5]],
        tokens=None,
    ),
    "cat": dict(
        title='The cat/mouse example: "The cat chased the mouse", the query "chased" against The, cat, mouse '
              "(Q = K = V = word vectors)",
        q=[[5, 1]], k=[[1, 0], [2, 3], [4, 4]], v=[[1, 0], [2, 3], [4, 4]],
        tokens=(["chased"], ["The", "cat", "mouse"]),
    ),
    "random": dict(title="Random 3×4 Q, K, V", tokens=None),
    "positional": dict(title="Sinusoidal positional encoding, 5 positions, d_model = 4", tokens=None),
}
_ALIASES = {"seed": "3-token"}  # the old name of the 3-token example, still accepted


def _example(text: str) -> str:
    return _ALIASES.get(text, text)


def _nonneg_int(what: str, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < 0 or (hi is not None and n > hi):
            rng = f"in 0..{hi}" if hi is not None else ">= 0"
            raise argparse.ArgumentTypeError(f"expected {what} {rng}, got {text!r}")
        return n
    return parse


def add_arguments(p):
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = ("files: .npy, .json (nested lists), or .csv/.txt/.tsv text tables (one row per line, values "
                "separated\nby commas or whitespace, as np.savetxt writes). Q, K, V are read as float64.\n"
                + "\n".join(_wrap(MASK_FILE_HELP)) +
                "\nexit status: 0 ok, 2 bad input, 141 when the reader of stdout goes away (e.g. | head).")
    p.add_argument("--example", type=_example, choices=sorted(EXAMPLES), default=None,
                   help="worked example to run (default: 3-token; cat = the cat/mouse example; random; positional)")
    p.add_argument("--seed", type=_nonneg_int("an integer"), default=0,
                   help="random seed for --example random (default 0)")
    p.add_argument("--q", type=Path, metavar="FILE", help="Q, shape (L, D)")
    p.add_argument("--k", type=Path, metavar="FILE", help="K, shape (S, D)")
    p.add_argument("--v", type=Path, metavar="FILE", help="V, shape (S, Dv)")
    p.add_argument("--causal", action="store_true", help="look-ahead mask (bottom-right aligned when L ≠ S)")
    p.add_argument("--mask", metavar="SPEC", help=f"mask: {MASK_SPECS}. See the mask file rules below.")
    p.add_argument("--html", type=Path, metavar="FILE",
                   help="also write one self-contained offline page for these numbers: hover a score or an "
                        "output to see how it is made")
    p.add_argument("--precision", type=_nonneg_int("a number of decimals", MAX_PRECISION), default=4,
                   help=f"decimals shown, 0..{MAX_PRECISION} (default 4)")


def _wrap(text, width=100):
    import textwrap

    return textwrap.wrap(text, width)


# ---------------------------------------------------------------------------------------------
# reading files

_INT = re.compile(r"[+-]?\d+\Z")
_BOOL = {"true": True, "false": False}
_TEXT_FORMAT = ("a text table of numbers: one row per line, values separated by commas or by whitespace "
                "(as np.savetxt writes)")


def _err(msg):
    from . import CLIError

    return CLIError(msg)


def _read_text(path: Path, name: str) -> np.ndarray:
    """A comma- or whitespace-separated table → bool, int64 or float64 array by its tokens."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise _err(f"--{name}: {path.name!r} is not a text file; expected {_TEXT_FORMAT}.") from None
    rows: list[list[str]] = []
    lines: list[int] = []
    for ln, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        toks = [t.strip() for t in line.split(",")] if "," in line else line.split()
        if any(t == "" for t in toks):
            raise _err(f"--{name}: {path.name!r} line {ln} has an empty value ({line!r}); expected {_TEXT_FORMAT}.")
        if rows and len(toks) != len(rows[0]):
            raise _err(f"--{name}: {path.name!r} line {ln} has {len(toks)} value(s) but line {lines[0]} has "
                       f"{len(rows[0])}; every row needs the same number of values.")
        rows.append(toks)
        lines.append(ln)
    if not rows:
        raise _err(f"--{name}: {path.name!r} holds no numbers; expected {_TEXT_FORMAT}.")
    flat = [t for r in rows for t in r]
    if all(t.lower() in _BOOL for t in flat):
        return np.array([[_BOOL[t.lower()] for t in r] for r in rows], dtype=bool)
    if all(_INT.match(t) for t in flat):
        return np.array([[int(t) for t in r] for r in rows], dtype=np.int64)
    out = np.empty((len(rows), len(rows[0])), dtype=np.float64)
    for i, (ln, r) in enumerate(zip(lines, rows, strict=True)):
        for j, t in enumerate(r):
            try:
                out[i, j] = float(t)
            except ValueError:
                raise _err(f"--{name}: {path.name!r} line {ln}: {t!r} is not a number; "
                           f"expected {_TEXT_FORMAT}.") from None
    return out


def _read_json(path: Path, name: str) -> np.ndarray:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise _err(f"--{name}: {path.name!r} is not valid JSON ({e}); expected nested lists of numbers, "
                   "e.g. [[1, 0], [0, 1]].") from None
    try:
        arr = np.asarray(data)
    except ValueError:
        raise _err(f"--{name}: {path.name!r} has rows of different lengths; expected a rectangular matrix "
                   "(nested lists, every row the same length).") from None
    if arr.dtype.kind == "U":  # "-inf" and friends written as strings
        try:
            arr = arr.astype(np.float64)
        except ValueError:
            raise _err(f"--{name}: {path.name!r} holds text that is not a number; expected nested lists of "
                       "numbers (write -inf as -Infinity or \"-inf\").") from None
    return arr


def load_matrix(path: Path, name: str) -> np.ndarray:
    """Read a 2-D array from ``path`` keeping its kind (bool, int or float); errors name ``--name``."""
    if not path.exists():
        raise _err(f"--{name}: file {str(path)!r} not found. Pass an existing {', '.join(SUFFIXES)} file.")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise _err(f"--{name}: expected a {', '.join(SUFFIXES)} file, got {path.name!r}.")
    if path.is_dir():
        raise _err(f"--{name}: {str(path)!r} is a directory; expected a {suffix} file.")
    try:
        if suffix == ".npy":
            try:
                arr = np.load(path, allow_pickle=False)
            except (ValueError, EOFError) as e:
                raise _err(f"--{name}: {path.name!r} is not a readable .npy array ({e}); save it with "
                           "np.save(path, array) from a numeric array.") from None
        elif suffix == ".json":
            arr = _read_json(path, name)
        else:
            arr = _read_text(path, name)
    except OSError as e:
        raise _err(f"--{name}: could not read {str(path)!r}: {e.strerror or e}.") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biuf":
        raise _err(f"--{name}: expected numbers in {path.name!r}, got dtype {getattr(arr, 'dtype', type(arr))}.")
    if arr.ndim != 2:
        raise _err(f"--{name}: expected a 2-D matrix (rows = tokens) in {path.name!r}, got shape {arr.shape}.")
    if arr.size == 0:
        raise _err(f"--{name}: {path.name!r} is empty (shape {arr.shape}); expected at least one row and column.")
    return arr


def _qkv(path: Path, name: str) -> np.ndarray:
    arr = load_matrix(path, name)
    if arr.dtype.kind == "b":
        raise _err(f"--{name}: expected numbers in {path.name!r}, got true/false values.")
    arr = arr.astype(np.float64)
    bad = np.argwhere(~np.isfinite(arr))
    if len(bad):
        i, j = bad[0]
        raise _err(f"--{name}: expected finite numbers, got {arr[i, j]} at row {i}, column {j} of {path.name!r}.")
    return arr


def _mask_file(path: Path, L: int, S: int) -> np.ndarray:
    """bool (True = attend) or float64 additive bias, shape exactly (L, S)."""
    arr = load_matrix(path, "mask")
    if arr.shape != (L, S):
        raise _err(f"--mask: expected an (L, S) = ({L}, {S}) matrix (rows = queries, columns = keys), got shape "
                   f"{arr.shape} from {path.name!r}.")
    kind = arr.dtype.kind
    if kind == "b":
        return arr
    if kind in "iu":
        values = np.unique(arr)
        if not set(values.tolist()) <= {0, 1}:
            raise _err(f"--mask: an integer mask file holds 0 (masked) and 1 (attend) only, got values "
                       f"{values.tolist()[:8]} in {path.name!r}. For an additive bias write floats "
                       "(0.0 = attend, -inf = masked).")
        return arr == 1
    arr = arr.astype(np.float64)
    bad = np.argwhere(np.isnan(arr) | np.isposinf(arr))
    if len(bad):
        i, j = bad[0]
        raise _err(f"--mask: a float mask is an additive bias (0 = attend, -inf = masked), got {arr[i, j]} at "
                   f"row {i}, column {j} of {path.name!r}; use -inf to mask.")
    if np.isin(arr, (0.0, 1.0)).all() and (arr == 1.0).any():
        print(f"attnkit explain: note: --mask {path.name!r} holds floats, read as an additive bias (0 = attend, "
              "-inf = masked), so its 1.0 entries add 1 to the score and mask nothing. For a 0/1 mask "
              "(1 = attend) write integers (np.savetxt(..., fmt='%d')) or bools.", file=sys.stderr)
    return arr


def _int_arg(spec: str, kind: str, arg: str) -> int:
    if not _INT.match(arg.strip()):
        raise _err(f"--mask: expected {kind}:N with N a whole number, got {spec!r}. Accepted: {MASK_SPECS}.")
    return int(arg)


def parse_mask(spec: str | None, L: int, S: int):
    """``--mask SPEC`` → None, an attnkit mask, a bool (L, S) array or a float bias (L, S)."""
    from .. import masks

    if spec is None:
        return None
    kind, _, arg = spec.partition(":")
    try:
        if kind == "causal":
            if arg not in ("", "bottom_right", "top_left"):
                raise _err(f"--mask: expected causal, causal:bottom_right or causal:top_left, got {spec!r}.")
            m = masks.causal(arg or "bottom_right")
        elif kind == "window":
            m = masks.sliding_window(_int_arg(spec, kind, arg))
        elif kind == "prefix":
            m = masks.prefix_lm(_int_arg(spec, kind, arg))
        elif kind == "padding":
            m = masks.padding([_int_arg(spec, kind, arg)])
        elif kind == "document":
            ids = arg.split(",")
            if not arg or not all(_INT.match(x.strip()) for x in ids):
                raise _err(f"--mask: expected document:ID,ID,... (one integer id per key), got {spec!r}. "
                           f"Accepted: {MASK_SPECS}.")
            if len(ids) != S:
                raise _err(f"--mask: expected one document id per key (S = {S}), got {len(ids)} in {spec!r}.")
            m = masks.document([int(x) for x in ids])
        else:
            m = None
        if m is not None:
            m.validate(1, 1, L, S)
            return m
    except (ValueError, TypeError) as e:  # attnkit.masks' own checks (sizes, ranges)
        raise _err(f"--mask {spec!r}: {e}") from None
    path = Path(spec)
    if path.suffix.lower() in SUFFIXES or path.exists():
        return _mask_file(path, L, S)
    raise _err(f"--mask: expected {MASK_SPECS}; got {spec!r}.")


# ---------------------------------------------------------------------------------------------
# notes, written from what was computed


def _vec(x, prec):
    return "[" + ", ".join(f"{v:.{prec}f}" for v in np.atleast_1d(x)) + "]"


def _note_3token(t, masked, prec, q, k, v):
    w, row = t.weights[0], t.output[0]
    if not masked:
        terms = " + ".join(f"{wi:.4f}·{_vec(vi, 0)}" for wi, vi in zip(w, v, strict=True))
        equal = ("; q0 scores k0 and k1 equally, so their weights are equal and the row is exactly "
                 f"{_vec(row, 1)}" if t.scores[0, 0] == t.scores[0, 1] else "")
        return (f"First output row: {_vec(row, prec)} = {terms}{equal}. Erratum for a known misprint of this "
                "example: weights [0.42, 0.42, 0.16] with first row [5.3, 4.2] (or [0.4, 0.4, 0.2] → [5, 4]) are "
                f"wrong; the exact weights are {_vec(w, 4)}.")
    seen = [f"k{j}" for j in np.flatnonzero(t.weights[0] > 0)]
    return (f"With this mask query 0 attends to {', '.join(seen) or 'no key'} (weights {_vec(w, prec)}), so the "
            f"first output row is {_vec(row, prec)}; without a mask it would be {_vec(_unmasked_row0(q, k, v), 1)}.")


def _unmasked_row0(q, k, v):
    from .. import explain

    return explain(q, k, v).output[0]


def _note_cat(t, masked, prec, q, k, v):
    k_tok = EXAMPLES["cat"]["tokens"][1]
    s, w = t.scores[0], t.weights[0]
    j = int(np.argmax(w))
    d = q.shape[1]
    frac = ", ".join(f"{int(x)}/√{d}" if float(x).is_integer() else f"{x:.4f}/√{d}" for x in s)
    return (f"Scaled scores {frac} = {', '.join(f'{x:.4f}' for x in t.scaled[0])}; softmax gives "
            f"{_vec(w, 6)}: \"{k_tok[j]}\" takes {w[j]:.2%} of the attention of \"chased\".")


def _nothing_hidden(causal: bool, L: int, S: int) -> str:
    if causal and L == 1:
        return (f"--causal hides no key here. With one query and S = {S} keys the look-ahead mask is bottom-right "
                "aligned: the query is the newest position (as when decoding), so it sees every key and the numbers "
                "are the unmasked ones. With several queries the mask hides each query's later keys: "
                "attnkit explain --causal (3 queries) shows it.")
    return (f"the mask hides no key here: each of the {L} queries sees all {S} keys, so the numbers are the "
            "unmasked ones.")


_RANDOM_NOTE = ("A softmax computed as exp(x) / Σ exp(x) without subtracting the row maximum overflows to "
                "inf/nan once a score passes ~709 (float64); attnkit subtracts the maximum first.")


def _positional(args) -> int:
    from .._format import format_matrix
    from ..positional import sinusoidal

    pe = sinusoidal(5, 4, dtype=__import__("torch").float64).numpy()
    p = args.precision
    print(EXAMPLES["positional"]["title"])
    print("PE(pos, 2i) = sin(pos / 10000^(2i/d_model)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))\n")
    print(format_matrix(pe, [f"pos{i}" for i in range(5)], [f"d{j}" for j in range(4)], p))
    wrong = np.sin(1 / 10000 ** (4 / 4)), np.cos(1 / 10000 ** (4 / 4))
    print("\nNote: a common bug raises 10000 to 2*i/d_model while i already steps by 2, doubling the exponent: "
          f"it gives PE(1, 2) = sin(0.0001) = {wrong[0]:.{p}f} and PE(1, 3) = cos(0.0001) = {wrong[1]:.{p}f}. "
          f"Correct: PE(1, 2) = sin(1/10000^(2/4)) = sin(0.01) = {pe[1, 2]:.{p}f}, "
          f"PE(1, 3) = cos(0.01) = {pe[1, 3]:.{max(p, 5)}f}.")
    return 0


def run(args) -> int:
    from .. import explain
    from .._format import format_trace
    from .._request import make_request
    from ..backends.reference import ScoreOverflowWarning

    if args.html:  # where the page goes is checked before anything is computed or printed
        _check_html_path(args.html)
    if args.example is not None and (args.q or args.k or args.v):
        raise _err(f"--example: runs a built-in example, and --q/--k/--v give your own numbers; got both "
                   f"(--example {args.example}). Pass one or the other.")
    if args.seed != 0 and args.example != "random":
        raise _err(f"--seed: seeds --example random only, got --seed {args.seed} with "
                   + (f"--example {args.example}" if args.example else "--q/--k/--v" if args.q or args.k or args.v
                      else "the default 3-token example") + ". Add --example random, or leave --seed out.")
    args.example = args.example or "3-token"
    if args.example == "positional" and not (args.q or args.k or args.v):
        if args.html:
            raise _err("--html: the page walks through attention; --example positional has none. "
                       "Use --example 3-token, cat or random, or --q/--k/--v.")
        return _positional(args)
    own = [args.q, args.k, args.v]
    tokens, note = None, None
    if any(own):
        if not all(own):
            missing = ", ".join(f"--{n}" for n, p in zip("qkv", own, strict=True) if not p)
            raise _err(f"--q, --k, --v: pass all three files (or none, for a built-in --example); missing {missing}.")
        q, k, v = (_qkv(p, n) for p, n in zip(own, "qkv", strict=True))
        _check_size(q, k, v)
        title = f"Your Q {q.shape}, K {k.shape}, V {v.shape}"
    elif args.example == "random":
        rng = np.random.default_rng(args.seed)
        q, k, v = (rng.standard_normal((3, 4)) for _ in range(3))
        title = f"{EXAMPLES['random']['title']} (--seed {args.seed})"
        note = lambda *a: _RANDOM_NOTE  # noqa: E731
    else:
        ex = EXAMPLES[args.example]
        q, k, v = (np.asarray(ex[n], dtype=np.float64) for n in "qkv")
        title, tokens = ex["title"], ex["tokens"]
        note = {"3-token": _note_3token, "cat": _note_cat}[args.example]
    mask = parse_mask(args.mask, q.shape[0], k.shape[0])
    try:  # validation of the user's shapes and mask: a user error, not a bug
        make_request(q, k, v, mask=mask, causal=args.causal, scale=None, score_mod=None, dropout_p=0.0,
                     return_lse=False, backend="reference")
    except (ValueError, TypeError) as e:  # attnkit's messages start with the argument: q, k, v, mask
        msg = str(e)
        name = msg.split(":", 1)[0]
        raise _err(f"--{msg}" if name in ("q", "k", "v", "mask") else f"--q/--k/--v/--mask: {msg}") from None
    if args.html:  # checked before anything is printed
        from ..viz.explain_html import MAX_TOKENS

        sizes = dict(L=q.shape[0], S=k.shape[0], D=q.shape[1], Dv=v.shape[1])
        if max(sizes.values()) > MAX_TOKENS:
            raise _err(f"--html: the page shows every number, so at most {MAX_TOKENS} queries, keys and dims; got "
                       + ", ".join(f"{n}={x}" for n, x in sizes.items()) + ". Pass a slice of your Q, K, V.")
    with warnings.catch_warnings():  # an overflow is said as a note under the tables (_overflow_note)
        warnings.simplefilter("ignore", ScoreOverflowWarning)
        t = explain(q, k, v, mask=mask, causal=args.causal)  # (L, S) / (L, Dv) arrays: 2-D in, 2-D out
    q_tokens, k_tokens = tokens if isinstance(tokens, tuple) else (tokens, tokens)
    if args.html:  # written before anything is printed: a path that cannot take it fails alone, in one line
        _write_page(args.html, t, title, q_tokens, k_tokens, args.precision)
    print(title)
    print(f"Q {q.shape}, K {k.shape}, V {v.shape}; scale = 1/√d_k = {t.scale:.6f}\n")
    print(format_trace(t, q_tokens=q_tokens, k_tokens=k_tokens, prec=args.precision, inputs=True))
    masked = bool(args.causal or args.mask)
    over = _overflow_note(t, q_tokens, k_tokens)
    if over:
        print("\nNote: " + over)
    if note:
        print("\nNote: " + note(t, masked, args.precision, q, k, v))
    # the mask was asked for and changed nothing (no key hidden, no bias added: a float mask's -inf hides a key
    # that `allowed`, the bool mask, still holds): say why
    if masked and bool(np.all(t.allowed)) and np.array_equal(t.masked, t.scaled, equal_nan=True):
        print("\nNote: " + _nothing_hidden(args.causal, q.shape[0], k.shape[0]))
    if args.html:
        print(f"\nPage: {args.html} (one offline file; open it in a browser)")
    return 0


# The step-by-step tables print every score: a million of them (1024 × 1024) is already far past what a person
# reads, and each costs ~100 bytes on the way to the screen. Past it the CLI says so instead of running out of memory.
MAX_SCORES = 1 << 20


def _check_size(q, k, v):
    """Every table explain prints (Q, K, V, the L × S scores, the output) holds at most MAX_SCORES numbers."""
    (L, D), S, Dv = q.shape, k.shape[0], v.shape[1]
    tables = {"the scores": (L, S), "Q": (L, D), "K": k.shape, "V": v.shape, "the output": (L, Dv)}
    for what, (r, c) in tables.items():
        if r * c > MAX_SCORES:
            raise _err(f"--q/--k/--v: explain prints every number, at most {MAX_SCORES:,} in one table; {what} "
                       f"would be {r:,} × {c:,} = {r * c:,}. Pass a slice of your Q, K, V (the rows and dims you "
                       "want to see), or call attnkit.attention for the output alone.")


def _overflow_note(t, q_tokens, k_tokens) -> str | None:
    """Say where finite Q and K gave a score past float64's range (inf), and what that does to the row."""
    import torch

    from ..backends.reference import overflowed

    over = overflowed(t.q, t.k, t.scaled, torch.float64)
    if not over.any():
        return None
    qlab = list(q_tokens) if q_tokens and len(q_tokens) == t.scaled.shape[0] else None
    klab = list(k_tokens) if k_tokens and len(k_tokens) == t.scaled.shape[1] else None
    cells = [f"{qlab[i] if qlab else f'q{i}'}·{klab[j] if klab else f'k{j}'}" for i, j in zip(*np.nonzero(over),
                                                                                               strict=True)]
    shown = ", ".join(cells[:4]) + (f" and {len(cells) - 4} more" if len(cells) > 4 else "")
    rows = int((np.isnan(t.weights).any(axis=-1) & over.any(axis=-1)).sum())
    return (f"Q·Kᵀ overflows float64 (|score| > {np.finfo(np.float64).max:.3g}) at {shown}: those scores are ±inf, "
            f"and {rows} row(s) holding +inf have NaN weights and output (inf − inf), as torch gives too. "
            "Inputs this large are usually a mistake upstream; scale your Q or K down to see finite scores.")


def _check_html_path(path: Path):
    """The page's folder must exist and be writable, and the path must not be a folder."""
    parent = path.resolve().parent
    if path.is_dir():
        raise _err(f"--html: expected a file path for the page, got {str(path)!r} (a directory). "
                   "Pass a file name such as page.html.")
    if not parent.is_dir():
        raise _err(f"--html: the folder {str(parent)!r} does not exist (for {str(path)!r}). "
                   "Create it first, or pass a path in an existing folder.")
    if not os.access(parent, os.W_OK):
        raise _err(f"--html: the folder {str(parent)!r} is not writable (for {str(path)!r}). "
                   "Pass a path in a writable folder.")


def _write_page(path: Path, t, title, q_tokens, k_tokens, prec):
    from ..viz.explain_html import explain_page

    try:
        text = explain_page(t, title=title, prec=prec, q_tokens=q_tokens, k_tokens=k_tokens)
    except ValueError as e:
        raise _err(f"--html: {str(e).split(': ', 1)[1]}") from None
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise _err(f"--html: could not write {str(path)!r}: {e.strerror or e}. Pass a path in a writable folder "
                   "with room for the page.") from None
