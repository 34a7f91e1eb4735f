"""Data × context parallelism on a 2-D mesh: 4 processes = 2 data-parallel replicas × 2 context-parallel
ranks (DDP over each data-parallel group, ContextParallel inside each context-parallel group).
After three SGD steps on different data per replica, the loss and every parameter equal one process
training on the whole global batch (float64 Llama)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs the transformers extra: pip install 'attnkit[transformers]'")

import _cp_spawn
from test_cp_transformers import tiny_llama

L, STEPS, DP, CP = 29, 3, 2, 2


def batches():
    """Per step and replica: a (2, L) batch of token ids (the replicas see different data)."""
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 97, (STEPS, DP, 2, L), generator=g)


def one_process():
    model = tiny_llama()
    model.set_attn_implementation("eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in batches():
        # the global objective: the mean over replicas of each replica's mean next-token loss
        loss = sum(torch.nn.functional.cross_entropy(model(input_ids=ids).logits[:, :-1].flatten(0, 1),
                                                     ids[:, 1:].flatten()) for ids in step) / DP
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _mesh(rank, W, layout):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import attnkit.distributed as akd
    from attnkit import masks
    from attnkit.integrations import context_parallel as akcp

    dp_rank, cp_rank = divmod(rank, CP)  # ranks 0,1: replica 0; ranks 2,3: replica 1
    cp_groups = [dist.new_group([d * CP + c for c in range(CP)]) for d in range(DP)]  # every rank makes every group
    dp_groups = [dist.new_group([d * CP + c for d in range(DP)]) for c in range(CP)]
    cp = akd.ContextParallel(L, mask=masks.causal(), layout="zigzag", block=2, group=cp_groups[dp_rank])
    model = akcp.prepare(tiny_llama(), cp)
    ddp = DDP(model, process_group=dp_groups[cp_rank])  # averages gradients over the replicas
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in batches():
        batch = akcp.shard_batch(cp, step[dp_rank])
        loss = akcp.causal_lm_loss(ddp, batch, cp)
        opt.zero_grad()
        loss.backward()
        akcp.sync_gradients(model, cp)  # sum the context-parallel shares (DDP already averaged the replicas)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # over all 4 ranks: Σ replicas of each replica's mean
        losses.append(total.item() / DP)
    ref_losses, ref_params = one_process()
    return {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "param": max((p.detach() - ref_params[n]).abs().max().item() for n, p in model.named_parameters()),
            "rows": len(cp.positions)}


@pytest.mark.slow
def test_data_times_context_parallel_equals_one_process():
    results = _cp_spawn.run(DP * CP, _mesh, "zigzag")
    for rank, r in sorted(results.items()):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        # float64 model with fp32 RMSNorm inside (see test_cp_transformers): agreement to ~1e-9
        assert r["loss"] <= 1e-7 and r["param"] <= 1e-6, (rank, r)
        assert r["rows"] < L  # a shard, not the whole sequence
