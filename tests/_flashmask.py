"""FlashMask's twelve benchmark mask families (FlashMask, ICLR 2025, appendix), each written as the
FlexAttention ``mask_mod`` a user would write, reading captured tensors where the family needs data.

``families(L, H, seed)`` -> ``{name: (mask_mod, built_in)}``: ``built_in`` is the same mask as attnkit's
own mask object where one exists, else None. Shared by the tests and ``benchmarks/flashmask.py``.
"""

from __future__ import annotations

import torch

from attnkit import masks as M

__all__ = ["families", "NAMES"]

NAMES = ("full", "causal", "sliding_window", "causal_document", "document", "share_question",
         "global_sliding_window", "causal_blockwise", "prefix_lm_document", "prefix_lm_causal", "qk_sparse",
         "random_eviction")


def _doc_ids(L: int, n: int, g: torch.Generator) -> torch.Tensor:
    """Document ids of n documents of random lengths covering L positions, in order."""
    cuts = torch.sort(torch.randperm(L - 1, generator=g)[: n - 1] + 1).values
    ids = torch.zeros(L, dtype=torch.long)
    for c in cuts.tolist():
        ids[c:] += 1
    return ids


def families(L: int, H: int = 1, seed: int = 0, window: int | None = None):
    g = torch.Generator().manual_seed(seed)
    w = window or max(2, L // 8)
    docs = _doc_ids(L, 4, g)
    starts = torch.zeros(L, dtype=torch.long)  # each position's document start
    for d in range(int(docs.max()) + 1):
        idx = (docs == d).nonzero().flatten()
        starts[idx] = idx[0]
    prefix_of_doc = torch.tensor([max(1, int((docs == d).sum()) // 3) for d in range(int(docs.max()) + 1)])
    seg = _doc_ids(L, 4, g)  # share question: segment 0 is the question, 1.. the answers
    blocks = _doc_ids(L, 4, g)  # causal blockwise: the last block sees every earlier block
    last_block = int(blocks.max())
    glob = max(1, L // 16)
    prefix = max(1, L // 4)
    keep_q = torch.rand(L, generator=g) > 0.1
    keep_k = torch.rand(L, generator=g) > 0.1
    # (H, S): the first row that no longer sees key kv, per head
    evict = torch.arange(L).expand(H, L) + (torch.rand(H, L, generator=g) * L).long() + 1

    def full(b, h, q, kv):
        return (q >= 0) & (kv >= 0)

    def causal(b, h, q, kv):
        return q >= kv

    def sliding_window(b, h, q, kv):
        return (q >= kv) & (q - kv < w)

    def causal_document(b, h, q, kv):
        return (docs[q] == docs[kv]) & (q >= kv)

    def document(b, h, q, kv):
        return docs[q] == docs[kv]

    def share_question(b, h, q, kv):
        return (q >= kv) & ((seg[q] == seg[kv]) | (seg[kv] == 0))

    def global_sliding_window(b, h, q, kv):
        return (q >= kv) & ((q - kv < w) | (kv < glob) | (q < glob))

    def causal_blockwise(b, h, q, kv):
        return (q >= kv) & ((blocks[q] == blocks[kv]) | (blocks[q] == last_block))

    def prefix_lm_document(b, h, q, kv):
        return (docs[q] == docs[kv]) & ((kv <= q) | (kv < starts[kv] + prefix_of_doc[docs[kv]]))

    def prefix_lm_causal(b, h, q, kv):
        return (kv <= q) | (kv < prefix)

    def qk_sparse(b, h, q, kv):
        return (q >= kv) & keep_q[q] & keep_k[kv]

    def random_eviction(b, h, q, kv):
        return (q >= kv) & (q < evict[h, kv])

    built = {
        "full": M.full(), "causal": M.causal(), "sliding_window": M.sliding_window(w),
        "causal_document": M.document(docs) & M.causal(), "document": M.document(docs),
        "prefix_lm_causal": M.prefix_lm(prefix),
    }
    mods = {f.__name__: f for f in (full, causal, sliding_window, causal_document, document, share_question,
                                    global_sliding_window, causal_blockwise, prefix_lm_document, prefix_lm_causal,
                                    qk_sparse, random_eviction)}
    return {n: (mods[n], built.get(n)) for n in NAMES}
