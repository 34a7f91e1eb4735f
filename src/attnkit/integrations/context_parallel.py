"""Context parallelism for a transformers causal LM: train one long sequence across processes.

Shape legend: B batch, L the whole sequence, L_r this rank's positions (``cp.positions``), V vocabulary.

One call wires a model (:func:`prepare`); two helpers do what a training step needs around it::

    import torch.distributed as dist
    import attnkit.distributed as akd
    from attnkit import masks
    from attnkit.integrations import context_parallel as akcp

    dist.init_process_group("gloo")                       # torchrun --nproc-per-node W train.py
    cp = akd.ContextParallel(seq_len=L, mask=masks.causal(), layout="zigzag")
    model = akcp.prepare(AutoModelForCausalLM.from_config(cfg), cp)
    batch = akcp.shard_batch(cp, input_ids, labels)       # this rank's rows, global positions, targets
    loss = akcp.causal_lm_loss(model, batch, cp)          # this rank's share of the global mean
    loss.backward()
    akcp.sync_gradients(model, cp)                        # sum the shares over the CP group
    optimizer.step()

What each piece does, and why it must:

* **attention** — every attention layer calls :meth:`ContextParallel.attention` with its q, k, v
  rows (causal, GQA as the model has it), registered as ``attn_implementation="attnkit_cp"``; the
  mask hook builds no (L, L) mask. A layer that asks for something else (a sliding window, a
  non-causal layer, attention dropout in training) is refused, never half-run.
* **positions** — a rank's rows are not contiguous under zigzag or balanced layouts, so RoPE (and
  any position embedding) must see their *global* positions: ``position_ids = cp.positions``.
* **labels** — the next-token targets are shifted on the **full** sequence before sharding
  (shifting a zigzag shard would pair tokens from different chunks)::

        input_ids   t0 t1 t2 t3 t4 t5 t6 t7       zigzag W = 2: rank 0 rows 0 1 6 7
        targets     t1 t2 t3 t4 t5 t6 t7 --                      targets t1 t2 t7 --

* **loss** — each rank's cross-entropy sum over its targets divided by the *global* count of
  targets (all-reduced), so the ranks' losses add up to the one-process mean loss, and so do
  their gradients once summed (:func:`sync_gradients`; under a data × context mesh DDP then
  averages over the data-parallel replicas).

Refused with :class:`~attnkit.integrations.transformers.UnsupportedModelError`: encoder-decoder
models, models that compute attention in their own layers, models whose forward takes no
``position_ids``; a padding ``attention_mask`` (pack sequences instead) raises ``ValueError``.
"""

from __future__ import annotations

import inspect
import weakref

import torch
import torch.nn.functional as F

from .transformers import UnsupportedModelError, _check_uses_attention_interface, _import_transformers

__all__ = ["NAME", "prepare", "shard_batch", "causal_lm_loss", "sync_gradients"]

NAME = "attnkit_cp"

_CPS: dict[int, object] = {}  # id(config of an attention layer) -> its ContextParallel


def prepare(model, cp):
    """Make ``model`` (a transformers causal LM) run its attention through ``cp``; returns the model.

    Registers ``attn_implementation="attnkit_cp"`` (attention and mask hook) and switches the model
    to it. Check the model first: refuses what it cannot run exactly (see the module docstring)."""
    transformers, masking_utils = _import_transformers()
    cfg = model.config
    name = type(model).__name__
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name}: context parallelism with attnkit runs decoder-only causal LMs; an "
                                    "encoder-decoder model has cross-attention over another sequence.")
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise UnsupportedModelError(f"{name}: its forward takes no position_ids, so the rows of a shard cannot be "
                                    "given their global positions. Use a model whose forward accepts position_ids.")
    _check_uses_attention_interface(getattr(cfg, "get_text_config", lambda: cfg)())
    _check_uses_attention_interface(cfg)
    transformers.AttentionInterface.register(NAME, _attention)
    masking_utils.AttentionMaskInterface.register(NAME, _no_mask)
    keys = {id(m.config) for m in model.modules() if getattr(m, "config", None) is not None}
    for key in keys:
        _CPS[key] = cp
    weakref.finalize(model, _forget, tuple(keys))
    model.set_attn_implementation(NAME)
    return model


def _forget(keys):
    for key in keys:
        _CPS.pop(key, None)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention hook: ``query (B, H, L_r, D)``, ``key/value (B, Hkv, L_r, ·)`` of this
    rank → ``(B, L_r, H, Dv)``, no weights."""
    cp = _CPS.get(id(getattr(module, "config", None)))
    where = type(module).__name__
    if cp is None:
        raise RuntimeError(f"{where}: attn_implementation={NAME!r} needs the model wired to a ContextParallel: "
                           "call attnkit.integrations.context_parallel.prepare(model, cp) first.")
    if kwargs.get("sliding_window") is not None:
        raise UnsupportedModelError(f"{where}: a sliding-window layer (window {kwargs['sliding_window']}); the "
                                    "ContextParallel's mask is fixed at construction. Use a model without sliding "
                                    "window layers (or one ContextParallel per mask).")
    if getattr(module, "is_causal", True) is False:
        raise UnsupportedModelError(f"{where}: a non-causal attention layer; context parallelism here runs causal "
                                    "self-attention.")
    if dropout and module.training:
        raise ValueError(f"{where}: attention dropout {dropout} in training is not supported by context "
                         "parallelism (set attention_dropout=0 in the config).")
    out = cp.attention(query, key, value, causal=True, scale=scaling)  # type: ignore[attr-defined]
    return out.transpose(1, 2).contiguous(), None


def _no_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
             **kwargs):
    """transformers' mask hook: nothing to build (the causal mask lives in the ContextParallel)."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("attention_mask: context parallelism trains unpadded (packed) sequences, got padding "
                         "zeros in attention_mask. Pack the sequences (or drop the padding) before sharding.")
    return None


def shard_batch(cp, input_ids: torch.Tensor, labels: torch.Tensor | None = None, ignore_index: int = -100) -> dict:
    """This rank's part of a batch of full sequences ``input_ids (B, L)`` (``labels`` defaults to
    ``input_ids``): ``input_ids (B, L_r)``, ``position_ids (B, L_r)`` (global), and ``targets (B, L_r)``
    — the next-token labels, shifted on the full sequence before sharding (the last position has
    none: ``ignore_index``)."""
    if input_ids.dim() != 2 or input_ids.shape[1] != cp.seq_len:
        raise ValueError(f"input_ids: expected (B, seq_len={cp.seq_len}) full sequences, got "
                         f"{tuple(input_ids.shape)}. Shard the whole sequence here, not a piece of it.")
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels: expected the shape of input_ids {tuple(input_ids.shape)}, got "
                         f"{tuple(labels.shape)}.")
    targets = torch.full_like(labels, ignore_index)
    targets[:, :-1] = labels[:, 1:]
    pos = cp.positions.to(input_ids.device)
    return {"input_ids": cp.shard(input_ids, dim=1), "position_ids": pos.expand(input_ids.shape[0], -1),
            "targets": cp.shard(targets, dim=1), "ignore_index": ignore_index}


def causal_lm_loss(model, batch: dict, cp) -> torch.Tensor:
    """This rank's share of the global mean next-token loss: its cross-entropy sum over its targets
    divided by the number of targets on **all** ranks of ``cp``'s group (summed over the ranks it is
    the one-process loss; backward gives this rank's share of every parameter's gradient)."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    logits, tgt, ign = out.logits, batch["targets"], batch["ignore_index"]
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # bf16/fp16 logits: the loss in fp32
    total = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=ign, reduction="sum")
    count = (tgt != ign).sum().to(torch.float64).reshape(1)
    cp.dist.all_reduce(count, group=cp.group)
    return total / count.clamp(min=1).to(total.dtype)


def sync_gradients(model, cp) -> None:
    """Sum every parameter's gradient over ``cp``'s group (each rank holds its share after
    :func:`causal_lm_loss`'s backward), in one flat all-reduce."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    cp.dist.all_reduce(flat, group=cp.group)
    i = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[i:i + n].view_as(g))
        i += n
