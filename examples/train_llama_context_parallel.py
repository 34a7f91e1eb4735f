"""Train a small Llama (random weights, transformers) with context parallelism on attnkit, and check it
learns exactly like one process.

    python examples/train_llama_context_parallel.py                  # spawns 4 local processes itself
    torchrun --nproc-per-node 4 examples/train_llama_context_parallel.py
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train_llama_context_parallel.py                     # two hosts

Every rank holds one shard of each 512-token sequence (the zigzag layout: causal work even on every
rank); attention runs through ``attnkit.distributed.ContextParallel``; rank 0 also trains the same
model in one process and prints both loss curves side by side. Options: ``--steps``, ``--seq-len``,
``--layout``, ``--world`` (local processes when not under torchrun).
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# imported before init_process_group (not where first used): then destroy_process_group ends the group even though
# the optimizers are built after it (docs/context_parallel.md, "Import attnkit.distributed before init_process_group")
import attnkit.distributed as akd
from attnkit import masks
from attnkit.integrations import context_parallel as akcp


def make_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      attention_dropout=0.0)
    torch.manual_seed(0)  # rank 0's reference run builds the same model; the other ranks get it from prepare()
    return LlamaForCausalLM(cfg)


def corpus(steps: int, batch: int, seq_len: int) -> torch.Tensor:
    """A fixed synthetic corpus with structure to learn: repeated byte patterns plus noise."""
    g = torch.Generator().manual_seed(42)
    period = torch.randint(3, 17, (steps, batch, 1), generator=g)
    pos = torch.arange(seq_len).expand(steps, batch, seq_len)
    base = torch.randint(0, 256, (steps, batch, 1), generator=g)
    ids = (base + pos % period * 7) % 256
    noise = torch.rand(steps, batch, seq_len, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, 256, ids.shape, generator=g), ids)


def one_process(data: torch.Tensor) -> list[float]:
    model = make_model()
    model.set_attn_implementation("sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids in data:
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def context_parallel(data: torch.Tensor, layout: str) -> tuple[list[float], object]:
    cp = akd.ContextParallel(data.shape[-1], mask=masks.causal(), layout=layout)
    model = akcp.prepare(make_model(), cp)  # every rank gets rank 0's weights (the seed is for the reference)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids in data:
        batch = akcp.shard_batch(cp, ids)
        loss = akcp.causal_lm_loss(model, batch, cp)  # this rank's share of the global mean
        opt.zero_grad()
        loss.backward()
        akcp.sync_gradients(model, cp)  # every rank now holds the full gradient
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses, cp


def worker(args) -> None:
    rank, W = dist.get_rank(), dist.get_world_size()
    data = corpus(args.steps, 2, args.seq_len)
    t = time.perf_counter()
    cp_losses, cp = context_parallel(data, args.layout)
    took = time.perf_counter() - t
    if rank != 0:
        return
    ref = one_process(data)
    host = socket.gethostname()
    print(f"Llama (random init, 2 layers, GQA 4/2 heads), {args.steps} steps of 2 × {args.seq_len} tokens; "
          f"{W} ranks, layout {args.layout!r} (rank 0 on {host}: {cp.layout.lengths[0]} positions, "
          f"K/V held at most {cp.backward_stats.kv_held_max} shards); {took:.1f}s")
    print(f"{'step':>5} {'one process':>12} {f'{W} ranks':>12} {'|diff|':>9}")
    for i, (a, b) in enumerate(zip(ref, cp_losses, strict=True)):
        print(f"{i:5d} {a:12.6f} {b:12.6f} {abs(a - b):9.2e}")
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, cp_losses, strict=True))
    ok = worst < 1e-3
    print(f"worst relative loss difference over {args.steps} steps: {worst:.2e} -> {'OK' if ok else 'MISMATCH'}")
    if not ok:
        raise SystemExit(1)


def _spawned(rank: int, W: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(W))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=W)
    try:
        worker(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag", "balanced"])
    ap.add_argument("--world", type=int, default=4, help="local processes to spawn when not under torchrun")
    args = ap.parse_args()
    if "RANK" in os.environ:  # under torchrun
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        try:
            worker(args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
