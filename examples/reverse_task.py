"""A tiny Transformer encoder and the sequence-reversal task it learns in seconds on a CPU.

Reversal needs attention: output position ``i`` must copy input token ``L - 1 - i``,
so a trained model shows the anti-diagonal in its attention maps::

    input   3 1 4 1 5          attention (query i -> key j)    j: 0 1 2 3 4
    target  5 1 4 1 3                                       i=0   . . . . #
                                                            i=1   . . . # .
                                                            i=2   . . # . .

An example application of :mod:`attnkit.nn`, not part of the library: the model, the
data and the training loop. Used by ``examples/train_reverse.py`` (the script: CLI and
picture) and by ``tests/nn/test_train_small.py`` (the check that the blocks learn), which
put ``examples/`` on ``sys.path``. Needs only attnkit and torch.
Shape legend: B batch, L sequence length, E embed dim, H heads, V vocabulary size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.nn import TransformerBlock
from attnkit.positional import LearnedPositionalEmbedding

__all__ = ["reverse_batch", "TinyTransformer", "TrainResult", "accuracy", "train_reverse"]


def reverse_batch(batch_size: int, seq_len: int, vocab_size: int, generator: torch.Generator | None = None):
    """Random tokens ``x (B, L)`` in ``[0, V)`` and their reversal ``y = x.flip(1)``."""
    x = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    return x, x.flip(1)


class TinyTransformer(nn.Module):
    """Token embedding + learned positions → ``num_layers`` :class:`TransformerBlock` → LayerNorm → logits.

    Output ``(B, L, V)``.
    """

    def __init__(self, vocab_size: int, seq_len: int, *, embed_dim: int = 64, num_heads: int = 4,
                 num_layers: int = 2, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.pos = LearnedPositionalEmbedding(seq_len, embed_dim)
        self.blocks = nn.ModuleList(TransformerBlock(embed_dim, num_heads, dropout=dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, vocab_size)

    def forward(self, tokens: torch.Tensor, *, need_weights: bool = False):
        """``tokens (B, L)`` → ``logits (B, L, V)``, or ``(logits, [weights (B, H, L, L) per layer])``."""
        x = self.pos(self.embed(tokens))  # (B, L, E)
        maps = []
        for block in self.blocks:
            if need_weights:
                x, w = block(x, need_weights=True)
                maps.append(w)
            else:
                x = block(x)
        logits = self.head(self.norm(x))  # (B, L, V)
        return (logits, maps) if need_weights else logits


@torch.no_grad()
def accuracy(model: TinyTransformer, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of tokens predicted right (eval mode)."""
    was = model.training
    model.eval()
    acc = (model(x).argmax(-1) == y).float().mean().item()
    model.train(was)
    return acc


@dataclass
class TrainResult:
    model: TinyTransformer
    accuracy: float  # token accuracy on a held-out batch
    steps: int
    seconds: float
    history: list = field(default_factory=list)  # (step, loss, accuracy) at each evaluation


def train_reverse(*, seq_len: int = 8, vocab_size: int = 10, embed_dim: int = 64, num_heads: int = 4,
                  num_layers: int = 2, batch_size: int = 128, steps: int = 1000, lr: float = 3e-3,
                  eval_every: int = 50, target: float = 1.0, seed: int = 0,
                  log: Callable[[str], None] | None = None) -> TrainResult:
    """Train a :class:`TinyTransformer` to reverse random sequences with AdamW.

    Stops after ``steps`` or once held-out token accuracy reaches ``target``
    (checked every ``eval_every`` steps). ``log`` receives one progress line per check.
    """
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TinyTransformer(vocab_size, seq_len, embed_dim=embed_dim, num_heads=num_heads, num_layers=num_layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = max(1, steps // 20)  # linear warm-up, then cosine decay to 0 at ``steps``
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1.0 + math.cos(math.pi * min(s, steps) / steps)))
    x_val, y_val = reverse_batch(1024, seq_len, vocab_size, gen)
    history, acc, t0, step = [], 0.0, time.perf_counter(), 0
    model.train()
    for step in range(1, steps + 1):
        x, y = reverse_batch(batch_size, seq_len, vocab_size, gen)
        loss = F.cross_entropy(model(x).reshape(-1, vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % eval_every == 0 or step == steps:
            acc = accuracy(model, x_val, y_val)
            history.append((step, loss.item(), acc))
            if log is not None:
                log(f"step {step:5d}  loss {loss.item():.4f}  token accuracy {acc:.4f}  "
                    f"({time.perf_counter() - t0:.1f} s)")
            if acc >= target:
                break
    return TrainResult(model, acc, step, time.perf_counter() - t0, history)
