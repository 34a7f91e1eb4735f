r"""Context parallelism: one exact attention over a sequence sharded across processes.

Shape legend: B batch, H query heads, Hkv key/value heads, L = S = ``seq_len`` (self-attention),
D head dim, Dv value head dim, W world size (ranks of the group), L_r rows owned by rank r::

    q (B, H, L_r, D)   k (B, Hkv, L_r, D)   v (B, Hkv, L_r, Dv)   →   out (B, H, L_r, Dv),  lse (B, H, L_r)

Usage (``torchrun --nproc-per-node 4 train.py``)::

    import torch.distributed as dist, attnkit.distributed as akd
    from attnkit import masks
    dist.init_process_group("gloo")
    cp = akd.ContextParallel(seq_len=L, mask=masks.sliding_window(4096), layout="balanced")
    q, k, v = cp.shard(q), cp.shard(k), cp.shard(v)   # this rank's rows (dim 2)
    out = cp.attention(q, k, v)                       # autograd works; return_lse=True for lse
    full = cp.gather(out)                             # every rank gets (B, H, L, Dv) in global order
    cp.stats                                          # this rank, last forward: bytes, pairs, tiles

**Layouts.** The sequence is cut into *units* of ``block`` positions (the last may be shorter);
a layout gives each rank a sorted set of units, the same for q and k/v. W = 2, L = 16, block = 2
(8 units, ``0``/``1`` = owning rank)::

    contiguous   0 0 0 0 1 1 1 1      rank 0 owns positions 0-7, rank 1 owns 8-15
    zigzag       0 0 1 1 1 1 0 0      2W chunks: rank r holds chunks r and 2W-1-r
    balanced     tokens AND work even: every per-token layer (MLP, projections, loss) waits on
                 the rank with the most positions, attention on the one with the most work.
                 From the plan's per-unit cost (non-empty tiles × their size, partial = ½) the
                 candidates are contiguous cuts (by work; and capped at ⌈n/W⌉ units: equal
                 tokens), zigzag, free greedy, and chunked greedy — chunks of 1-32 consecutive
                 units that see each other (never across a document break), costliest first to
                 the least-loaded rank with room (equal tokens). Of those within 5% of even
                 tokens and 10% of even work, the one whose busiest rank sends least (else the
                 most even work). Causal gets zigzag; a window capped contiguous cuts
                 (neighbours only); packed documents chunks of one document kept together.

**Which pairs are exchanged.** The mask's :class:`attnkit.plans.BlockPlan` at ``block`` tiles
says, for each (query rank r, key rank s), whether r's queries see at least one of s's keys.
Only those pairs are sent and computed. Sliding window under a contiguous layout, W = 4
(``#`` computed, ``.`` neither sent nor computed; the diagonal never travels)::

               keys of rank  0 1 2 3
    queries of rank 0        # . . .
                    1        # # . .        rank 1 receives K/V from rank 0 only,
                    2        . # # .        rank 2 from rank 1 only, ...
                    3        . . # #

Each pair's partial result (out, lse) comes from :func:`attnkit.attention` on the local rows,
with the mask and score_mod evaluated at the **global** positions of those rows; the partial
results of rank r are merged in fp32 (fp64 for fp64 inputs) in ascending key-rank order
(deterministic; independent of W up to rounding), and cast once at the end. The merge carries each
row's lse in two parts, ``lse = c + r`` (``c`` the lse, ``r`` 0 on ordinary rows): on a row whose
every score is a huge finite negative (``finfo.min``, -1e9 padding) the lse rounds to the row max,
so such rows are recomputed with their scores shifted by ``c`` and ``r`` is the exact lse of the
shifted scores — the weights of the merge, and the backward's ``p = exp(s − lse)``, stay exact::

    a row of 16 keys all at finfo.min, W = 4 (4 keys a rank)
    by lse alone:   every lse = finfo.min → weights 1, 1, 1, 1 → out = 4 × mean(V)      (wrong)
    two parts:      c = finfo.min, r = log 4 on each → weights ¼, ¼, ¼, ¼ → out = mean(V)

**Blocks.** Within a pair, each (query run, key run) of consecutive units is one block
(:meth:`Schedule.blocks`): a block whose tiles are all full gets no mask, a run against itself
under a causal mask is plain ``causal=True`` (the fused kernels), the rest evaluates the global
mask at the block's positions. Zigzag under causal has no masked block at all::

    zigzag W = 2, chunks c0..c3; rank 0 owns c0 c3, rank 1 owns c1 c2 (one run)
    pair (0, 0):  c0×c0 causal   c3×c0 full   c3×c3 causal      (c0×c3: empty, skipped)
    pair (0, 1):  c3×(c1 c2) full                               (c0×(c1 c2): empty)
    pair (1, 0):  (c1 c2)×c0 full                               ((c1 c2)×c3: empty)
    pair (1, 1):  (c1 c2)×(c1 c2) causal

**Backward** (an autograd.Function), block by block with the rows' *global* out and lse
(FlashAttention-2's decomposition, ``p = exp(s − lse)``, ``D = rowsum(dout·out)``): full and
causal blocks run torch's fused CPU flash backward directly (no score_mod, D == Dv, fp32/fp64, lse
unused); other blocks are recomputed with autograd and weighted by ``w = exp(lse_block − lse)``.
dq stays local; the dK/dV partials (fp32) go back to the rank that owns those keys, which sums
them in ascending rank order. Only the pairs that were computed travel.

**Modes.** ``comm="p2p"`` (default): point-to-point isend/irecv of exactly the needed K/V
shards (K and V packed in one message, the real Hkv heads only; gloo has no all_to_all); the
local pair is computed while the messages travel. ``comm="allgather"``: every rank all-gathers
all K/V (shards padded to the longest) and all-reduces dK/dV; for short sequences; the compute
still skips invisible pairs. ``comm="heads"`` (Ulysses): an all-to-all over heads (p2p) gives
rank p the whole sequence for query heads ``[p·H/W, (p+1)·H/W)`` (and the kv heads they read),
one :func:`attnkit.attention` runs there, and the output goes back by rows; needs
``H % W == 0``; every rank computes every non-empty tile of its heads::

    before (rows)        after (heads)             W = 2, H = 4
    rank 0: rows 0-7     rank 0: heads 0-1, rows 0-15
    rank 1: rows 8-15    rank 1: heads 2-3, rows 0-15

**Gradients.** q, k, v get exact gradients on their owners. Tensors a score_mod captures (a
learnable ALiBi slope) get this rank's share: sum them over ranks as for any replicated
parameter (DDP does). ``keep_kv=True`` keeps the received K/V for backward (memory: the visible
K/V); ``keep_kv=False`` exchanges them again (traffic ×2, memory: the local shard).

**Faults.** Every call first exchanges a small signature with every peer (shapes, dtypes,
options, layout, call counter), and a status after the local compute. A mismatch, an exception
raised on one rank before or during the compute, or a peer that does not arrive within
``timeout`` seconds gives every participating rank a :class:`ContextParallelError` naming the
rank and what went wrong — never a hang. (A signature costs W − 1 tiny messages per rank.)
The mask, the score_mod and the scale enter the signature by *content* — tensors by their bytes,
functions by their code and every value they capture (closure cells, defaults, the globals they
read), objects by their public attributes — so ranks whose document ids differ by one moved
boundary, whose ALiBi slopes or captured values differ, are refused, not run; ``keep_kv`` and
``seq_len`` are in it too. A timeout or a lost peer leaves the group unusable (messages of that
call stay unmatched): that call and every later one on the group raise a ContextParallelError
saying the group must be rebuilt (``destroy_process_group`` / ``init_process_group``).

**Modules.** ``mha(x, context_parallel=cp)`` / :func:`block_forward` run an
:class:`attnkit.nn.MultiHeadAttention` / :class:`attnkit.nn.TransformerBlock` on a shard ``(B, L_r, E)`` with its
own weights, RoPE at the layout's global positions (:func:`rope_at`) and ALiBi at global positions.
``examples/train_context_parallel.py`` trains a tiny model both ways and prints both loss curves.

**Stats.** ``cp.stats`` (last forward) and ``cp.backward_stats`` (last backward): see :class:`Stats`.
:meth:`ContextParallel.schedule` and :func:`schedule` say which pairs travel, before any call;
``benchmarks/context_parallel.py`` tabulates bytes and balance on paper for W up to 64.

Not supported: ``dropout_p``, ``sinks``, ``return_weights``, bias/tensor masks (give the mask
as an :mod:`attnkit.masks` object at construction), cross-attention (L ≠ S).
"""

from __future__ import annotations

import torch.distributed as _dist

from .context_parallel import ContextParallel
from .guard import ContextParallelError
from .guard import _digest as _digest  # the content signature (tests pin it)
from .layouts import Layout, default_block, imbalance, layout, token_imbalance, unit_costs
from .layouts import _runs as _runs
from .modules import block_forward, rope_at
from .pairs import _check_unsupported as _check_unsupported
from .schedules import Schedule, schedule
from .simulator import simulate
from .stats import Stats

# torch.distributed.nn.functional gives its functions ``group=group.WORLD`` as a default argument, read when it
# is imported. Imported after init_process_group (torch.optim imports it lazily, through torch._dynamo, when the
# first optimizer is built), those defaults hold the group past destroy_process_group: its threads and sockets
# live on until interpreter exit, and a group rebuilt after a failure leaves the old one open. Torn down during
# interpreter finalization, a rank of examples/train_context_parallel.py was seen to abort, rarely (SIGABRT,
# "terminate called without an active exception", after its work was done). Imported here, before the caller's
# init_process_group, the defaults are None (~60 ms, once); imported after it, this import would itself hold the
# group, so it is skipped then.
if _dist.is_available() and not _dist.is_initialized():
    import torch.distributed.nn.functional  # noqa: F401  (for the defaults above)
del _dist


__all__ = ["ContextParallel", "ContextParallelError", "Layout", "Schedule", "Stats", "layout", "schedule",
           "simulate", "rope_at", "block_forward", "unit_costs", "imbalance", "token_imbalance", "default_block"]
