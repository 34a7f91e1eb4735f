"""Context parallelism for a transformers causal LM: train one long sequence across processes.

Shape legend: B batch, L the whole sequence, L_r this rank's positions (``cp.positions``), V vocabulary.

One call wires a model (:func:`prepare`); two helpers do what a training step needs around it::

    import torch.distributed as dist
    import attnkit.distributed as akd
    from attnkit import masks
    from attnkit.integrations import context_parallel as akcp

    dist.init_process_group("gloo")                       # torchrun --nproc-per-node W train.py
    cp = akd.ContextParallel(seq_len=L, mask=masks.causal(), layout="zigzag")
    model = akcp.prepare(AutoModelForCausalLM.from_config(cfg), cp)   # every rank: rank 0's weights
    batch = akcp.shard_batch(cp, input_ids, labels)       # this rank's rows, global positions, targets
    loss = akcp.causal_lm_loss(model, batch, cp)          # this rank's share of the global mean
    loss.backward()
    akcp.sync_gradients(model, cp)                        # sum the shares over the CP group
    optimizer.step()

What each piece does, and why it must:

* **weights** — every rank must train the same model, or the summed gradients belong to no model
  at all (and nothing fails: the loss is merely wrong). ``prepare`` broadcasts rank 0's parameters
  and buffers over ``cp``'s group, as ``DistributedDataParallel`` does at construction, so a model
  built with a random init on each rank (``from_config``, no seed) is made equal before the first
  step; ``sync="verify"`` instead checks that the ranks already agree, bitwise, and raises
  :class:`~attnkit.distributed.ContextParallelError` naming the first parameter that differs and the
  ranks that hold another value. :func:`sync_state` does either at any time (after loading a
  checkpoint on each rank, say)::

        rank 0: from_config → θ0 ─┐ broadcast      rank 0: θ0
        rank 1: from_config → θ1 ─┘ over cp.group  rank 1: θ0    (bitwise; tied weights once)

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

import ctypes
import hashlib
import inspect
import struct
import weakref

import torch
import torch.nn.functional as F

from .. import score_mods as _score_mods
from ..distributed.guard import ContextParallelError

__all__ = ["NAME", "prepare", "sync_state", "shard_batch", "causal_lm_loss", "sync_gradients"]

NAME = "attnkit_cp"

_CPS: dict[int, object] = {}  # id(config of an attention layer) -> its ContextParallel


def prepare(model, cp, *, sync: str = "broadcast"):
    """Make ``model`` (a transformers causal LM) run its attention through ``cp``; returns the model.

    Checks the model first: refuses what it cannot run exactly (see the module docstring). Then
    makes the ranks of ``cp``'s group agree on the model (:func:`sync_state`):

    * ``sync="broadcast"`` (default): every rank gets rank 0's parameters and buffers, bitwise. The
      default because it is what ``DistributedDataParallel`` does at construction, and for the same
      reason: a model built on each rank (``AutoModelForCausalLM.from_config(cfg)`` without a seed
      draws its init from each process's own random generator) differs from rank to rank, and
      context parallelism would train on those different weights without any error. The cost is
      one broadcast of the model's bytes, once.
    * ``sync="verify"``: nothing is copied; a content hash of every tensor (its bytes) is compared
      across the ranks, and a difference raises :class:`~attnkit.distributed.ContextParallelError`
      on every rank, naming the first differing parameter or buffer and the ranks. For a model each
      rank loads itself (the same checkpoint) when a silent broadcast would hide a mistake.

    Under a data × context mesh only ``cp``'s group is synchronised (DDP broadcasts over the
    data-parallel group). Then registers ``attn_implementation="attnkit_cp"`` (attention and mask
    hook) and switches the model to it."""
    # transformers (and attnkit's integration of it) only here: a model of your own (attnkit.nn) never imports it
    from .transformers._hf import import_transformers
    from .transformers._refusals import UnsupportedModelError, check_uses_attention_interface

    transformers, masking_utils = import_transformers()
    cfg = model.config
    name = type(model).__name__
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name}: context parallelism with attnkit runs decoder-only causal LMs; an "
                                    "encoder-decoder model has cross-attention over another sequence.")
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise UnsupportedModelError(f"{name}: its forward takes no position_ids, so the rows of a shard cannot be "
                                    "given their global positions. Use a model whose forward accepts position_ids.")
    check_uses_attention_interface(getattr(cfg, "get_text_config", lambda: cfg)())
    check_uses_attention_interface(cfg)
    sync_state(model, cp, sync)
    transformers.AttentionInterface.register(NAME, _attention)
    masking_utils.AttentionMaskInterface.register(NAME, _no_mask)
    keys = {id(m.config) for m in model.modules() if getattr(m, "config", None) is not None}
    for key in keys:
        _CPS[key] = cp
    weakref.finalize(model, _forget, tuple(keys))
    model.set_attn_implementation(NAME)
    return model


# ----------------------------------------------------------------------------------------------
# the ranks agree on the model (issue 27, item 2)

_SYNC_MODES = ("broadcast", "verify")
_BUCKET = 32 << 20  # bytes per broadcast message: the model is sent in pieces, never copied whole
_SYNC_MSG = 256  # bytes of a rank's status message in the header exchange


def sync_state(model, cp, mode: str = "broadcast"):
    """Make every rank of ``cp``'s group hold the same parameters and buffers; returns ``model``.

    ``mode="broadcast"``: rank 0 of the group sends its parameters and buffers (those with
    ``requires_grad=False`` and non-persistent ones included; a tied weight once) and every other
    rank copies them in place — bitwise equal afterwards. ``mode="verify"``: every rank hashes each
    tensor's bytes (dtype and shape included) and the hashes are compared; the first tensor that
    differs raises :class:`~attnkit.distributed.ContextParallelError` on every rank, naming it and
    the ranks whose copy differs from rank 0's.

    Either way the ranks first exchange a small header (the mode, and the names, shapes and dtypes of
    every tensor): ranks that hold different architectures, call with different modes, or hold a
    tensor on the meta device (no values to send or compare: load or materialise the model before)
    get a ContextParallelError on every rank instead of a hang or a broadcast into the wrong tensor.
    Only ``cp``'s group takes part (under a data × context mesh DDP syncs the data-parallel group).
    """
    if mode not in _SYNC_MODES:
        raise ValueError(f"sync: expected one of {_SYNC_MODES}, got {mode!r}. 'broadcast' gives every rank rank 0's "
                         "weights (what DDP does); 'verify' only checks that the ranks already agree.")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}.")
    check = getattr(cp, "_check_alive", None)
    if check is not None:
        check()
    tensors = _state_tensors(model)
    meta = next((f"{kind} {name!r}" for kind, name, t in tensors if t.is_meta), None)
    msg = "" if meta is None else (f"{meta} is on the meta device (no values to {mode}): load or materialise the "
                                   "model (to_empty() and an init, or load_state_dict) before syncing it.")
    structure = [(kind, name, tuple(t.shape), str(t.dtype)) for kind, name, t in tensors]
    vals = [int(meta is not None), _SYNC_MODES.index(mode), len(tensors), _hash64(repr(structure).encode())]
    headers = _exchange_header(cp, vals, msg, _comm_device(cp, tensors))
    failed = [(r, m) for r, (v, m) in enumerate(headers) if v[0]]
    if failed:
        r, m = failed[0]
        raise ContextParallelError(f"context parallel model sync: rank {_who(cp, r)} cannot take part: {m}"
                                   + (f" (and ranks {[f[0] for f in failed[1:]]} too)" if len(failed) > 1 else ""))
    modes = {r: _SYNC_MODES[v[1]] for r, (v, _) in enumerate(headers)}
    if len(set(modes.values())) > 1:
        r = next(r for r, m in modes.items() if m != modes[0])
        raise ContextParallelError(f"context parallel model sync: ranks disagree on the mode: rank 0 has "
                                   f"{modes[0]!r}, rank {_who(cp, r)} has {modes[r]!r}. Pass the same sync= on "
                                   "every rank.")
    if any(v[2:] != headers[0][0][2:] for v, _ in headers):
        _raise_structure(cp, structure)
    if mode == "broadcast":
        _broadcast(cp, [t for _, _, t in tensors])
    else:
        _verify(cp, tensors)
    return model


def _state_tensors(model) -> list[tuple[str, str, torch.Tensor]]:
    """(kind, name, tensor) of every parameter, then every buffer; a tensor shared by several modules
    (tied embeddings) once, under its first name."""
    out, seen = [], set()
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            out.append((kind, name, t))
    return out


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _tensor_hash(t: torch.Tensor) -> int:
    """A 64-bit hash of a tensor's dtype, shape and bytes (exact: any changed bit changes it)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    c = t.detach().to("cpu").contiguous()
    if c.numel():
        # its bytes at its data pointer (c is contiguous), not through .numpy(): that would leave t unable to resize_
        h.update(ctypes.string_at(c.data_ptr(), c.numel() * c.element_size()))
    return int.from_bytes(h.digest(), "little", signed=True)


def _who(cp, r: int) -> str:
    """Rank ``r`` of the group, with its global rank when the group is not the whole world."""
    if getattr(cp, "group", None) is None:
        return str(r)
    return f"{r} (global rank {cp._g(r)})"


def _comm_device(cp, tensors) -> torch.device:
    """Where the small messages live: the CPU for gloo, the model's device otherwise (NCCL)."""
    if "gloo" in str(cp.dist.get_backend(cp.group)):
        return torch.device("cpu")
    return next((t.device for _, _, t in tensors if not t.is_meta), torch.device("cpu"))


def _collective(cp, op, what: str):
    """Run one collective with the ContextParallel's timeout (a peer that never comes: an error)."""
    if hasattr(cp, "_issue"):
        cp._wait(cp._issue(lambda: op(True), what), None, what)
    else:
        op(False)


def _exchange_header(cp, vals: list[int], msg: str, dev) -> list[tuple[list[int], str]]:
    """All-gather (vals, msg) over ``cp``'s group: every rank gets every rank's, in rank order."""
    raw = struct.pack(f"<{len(vals)}q", *vals) + msg.encode()[:_SYNC_MSG].ljust(_SYNC_MSG, b"\0")
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone().to(dev)
    bufs = [torch.empty_like(mine) for _ in range(cp.W)]
    _collective(cp, lambda a: cp.dist.all_gather(bufs, mine, group=cp.group, async_op=a), "model sync (header)")
    out = []
    for b in bufs:
        raw = bytes(b.cpu().numpy().tobytes())
        n = 8 * len(vals)
        out.append((list(struct.unpack(f"<{len(vals)}q", raw[:n])), raw[n:].rstrip(b"\0").decode(errors="replace")))
    return out


def _raise_structure(cp, structure):
    """The ranks hold different architectures: find the first tensor that differs from rank 0's, on every rank."""
    lists: list = [None] * cp.W
    cp.dist.all_gather_object(lists, structure, group=cp.group)
    for r in range(1, cp.W):
        a, b = lists[0], lists[r]
        for i in range(max(len(a), len(b))):
            x = a[i] if i < len(a) else None
            y = b[i] if i < len(b) else None
            if x != y:
                def show(e):
                    return "nothing" if e is None else f"{e[0]} {e[1]!r} {e[2]} {e[3]}"
                raise ContextParallelError(
                    f"context parallel model sync: the ranks hold different models: tensor #{i} is {show(x)} on "
                    f"rank 0 and {show(y)} on rank {_who(cp, r)} (rank 0 has {len(a)} parameters and buffers, rank "
                    f"{r} {len(b)}). Build the same architecture (the same config) on every rank.")
    raise ContextParallelError("context parallel model sync: the ranks hold different models (their tensor lists "
                               "differ). Build the same architecture (the same config) on every rank.")


def _broadcast(cp, tensors: list[torch.Tensor]) -> None:
    """Rank 0's values into every rank's tensors, in messages of at most ``_BUCKET`` bytes per
    (device, dtype) — coalesced, as DDP does."""
    groups: dict = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    src = cp._g(0) if hasattr(cp, "_g") else 0
    for ts in groups.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in [*ts, None]:
            if t is not None and (not bucket or size + t.numel() * t.element_size() <= _BUCKET):
                bucket.append(t)
                size += t.numel() * t.element_size()
                continue
            alone = len(bucket) == 1 and bucket[0].is_contiguous()  # a big tensor: received in place
            flat = bucket[0].detach().view(-1) if alone else torch.cat([b.detach().reshape(-1) for b in bucket])
            _collective(cp, lambda a, flat=flat: cp.dist.broadcast(flat, src=src, group=cp.group, async_op=a),
                        "model sync (broadcast)")
            if cp.rank != 0 and not alone:
                i = 0
                with torch.no_grad():
                    for b in bucket:
                        b.copy_(flat[i:i + b.numel()].view_as(b))
                        i += b.numel()
            bucket, size = ([t], t.numel() * t.element_size()) if t is not None else ([], 0)


def _verify(cp, tensors) -> None:
    """Compare every tensor's content hash with rank 0's; raise naming the first that differs."""
    mine = torch.tensor([_tensor_hash(t) for _, _, t in tensors] or [0], dtype=torch.int64)
    dev = _comm_device(cp, tensors)
    mine = mine.to(dev)
    bufs = [torch.empty_like(mine) for _ in range(cp.W)]
    _collective(cp, lambda a: cp.dist.all_gather(bufs, mine, group=cp.group, async_op=a), "model sync (verify)")
    hashes = torch.stack([b.cpu() for b in bufs])  # (W, number of tensors)
    differ = (hashes != hashes[0]).any(0).nonzero().flatten().tolist()
    if not differ or not tensors:
        return
    i = differ[0]
    kind, name, t = tensors[i]
    ranks = [r for r in range(cp.W) if hashes[r, i] != hashes[0, i]]
    more = f"; {len(differ) - 1} more of the {len(tensors)} tensors differ too" if len(differ) > 1 else ""
    raise ContextParallelError(
        f"context parallel model sync (verify): the ranks hold different weights: {kind} {name!r} "
        f"{tuple(t.shape)} {t.dtype} differs from rank 0's on rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(_who(cp, r) for r in ranks)}{more}. Build the model the same way on every rank (one seed, "
        "or the same checkpoint), or let prepare() broadcast rank 0's (sync='broadcast', the default).")


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
    from .transformers._refusals import UnsupportedModelError, check_kwargs  # loaded by prepare(): a lookup

    check_kwargs(module, kwargs)  # an argument nobody here knows stops the call, never silently dropped
    for name in ("s_aux", "sinks", "position_bias", "cu_seq_lens_q", "cu_seq_lens_k"):
        if kwargs.get(name) is not None:  # known to the one-process integration, not implemented across ranks
            raise UnsupportedModelError(
                f"{where}: {name} (attention sinks, a position bias or packed sequence boundaries) is not "
                "implemented by context parallelism, and dropping it would change every attention weight. Run this "
                "model without context parallelism (attn_implementation='attnkit' on one process).")
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
    cap = kwargs.get("softcap")  # Gemma 2: cap · tanh(score / cap) on the scaled scores, as in one process
    score_mod = None if cap is None else _score_mods.softcap(cap)
    out = cp.attention(query, key, value, causal=True, scale=scaling, score_mod=score_mod)  # type: ignore[attr-defined]
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
