"""Train a 2-layer attnkit Transformer on the CPU to reverse token sequences, then draw its attention.

    python examples/train_reverse.py                    # seq_len 12, vocab 16, stops at 99.9 % accuracy
    python examples/train_reverse.py --out maps.png --seq-len 16

The picture goes to ``attnkit-out/reverse_attention.png`` (the folder ``attnkit demo`` writes to,
ignored by git) unless ``--out`` names another file, so a run never litters the directory it
starts in.

Reversal needs attention (output i copies input L-1-i), so the trained model's
attention maps show an anti-diagonal. The model, data and training loop are
``reverse_task.py`` next to this script (also used by the test suite); this script adds
the CLI and the picture.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # reverse_task.py sits next to this script
from reverse_task import accuracy, reverse_batch, train_reverse


@torch.no_grad()
def sequence_accuracy(model, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of whole sequences reversed without a single wrong token (eval mode, no autograd)."""
    was = model.training
    model.eval()
    try:
        return (model(x).argmax(-1) == y).all(-1).float().mean().item()
    finally:
        model.train(was)


def plot_attention(model, tokens: torch.Tensor, path: str) -> None:
    """One heatmap per (layer, head) for a single sequence ``tokens (L,)``."""
    was = model.training
    model.eval()
    with torch.no_grad():
        logits, maps = model(tokens[None], need_weights=True)  # maps: [(1, H, L, L)] per layer
    model.train(was)
    pred = logits.argmax(-1)[0].tolist()
    layers, heads = len(maps), maps[0].shape[1]
    labels = [str(t) for t in tokens.tolist()]
    fig, axes = plt.subplots(layers, heads, figsize=(2.6 * heads + 0.8, 2.7 * layers), squeeze=False)
    im = None
    for li, w in enumerate(maps):
        for h in range(heads):
            ax = axes[li][h]
            im = ax.imshow(w[0, h].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_title(f"layer {li} head {h}", fontsize=9)
            ax.set_xticks(range(len(labels)), labels, fontsize=6)
            ax.set_yticks(range(len(labels)), [str(p) for p in pred], fontsize=6)
            ax.set_xlabel("key (input token)", fontsize=7)
            if h == 0:
                ax.set_ylabel("query (predicted token)", fontsize=7)
    fig.suptitle(f"attention of a model trained to reverse {tokens.tolist()}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    cax = fig.add_axes((0.915, 0.15, 0.012, 0.7))  # one colour bar for every panel (shared 0..1 scale)
    cb = fig.colorbar(im, cax=cax)
    cb.set_label("attention weight", fontsize=8)
    cb.ax.tick_params(labelsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)


DEFAULT_OUT = pathlib.Path("attnkit-out") / "reverse_attention.png"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=16)
    ap.add_argument("--embed-dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3000, help="upper bound; stops early at --target")
    ap.add_argument("--target", type=float, default=0.999, help="held-out token accuracy to stop at")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DEFAULT_OUT), metavar="PNG",
                    help=f"PNG of the attention maps (default {DEFAULT_OUT}; its folder is created)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads; 1 is fastest for a model this small, and does not stall "
                         "when other processes share the cores")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    res = train_reverse(seq_len=args.seq_len, vocab_size=args.vocab, embed_dim=args.embed_dim,
                        num_heads=args.heads, num_layers=args.layers, steps=args.steps,
                        target=args.target, seed=args.seed, log=lambda s: print(s, flush=True))
    x, y = reverse_batch(4096, args.seq_len, args.vocab, torch.Generator().manual_seed(args.seed + 1))
    test_acc = accuracy(res.model, x, y)
    seq_acc = sequence_accuracy(res.model, x, y)
    print(f"done: {res.steps} steps in {res.seconds:.1f} s; fresh test set: token accuracy {test_acc:.4f}, "
          f"whole-sequence accuracy {seq_acc:.4f}")
    out = args.out if args.out.lower().endswith(".png") else args.out + ".png"  # say where it really goes
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    plot_attention(res.model, x[0], out)
    print(f"attention maps -> {out}  (total {time.perf_counter() - t0:.1f} s)")
    return 0 if test_acc >= 0.99 else 1


if __name__ == "__main__":
    raise SystemExit(main())
