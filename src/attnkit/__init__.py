"""attnkit: exact Transformer attention, from the textbook formula to fused kernels.

Shape legend (used in every docstring):
    B batch · H query heads · Hkv key/value heads · L query length · S key length ·
    D head dim · Dv value head dim.  q (B, H, L, D), k (B, Hkv, S, D),
    v (B, Hkv, S, Dv) → out (B, H, L, Dv), lse (B, H, L).

Conventions: bool masks are True = attend; float masks are additive biases;
causal with L ≠ S is bottom-right aligned; a fully masked row gives 0 (lse -inf).
"""

from . import masks, nn, plans, positional, score_mods
from ._dispatch import Decision
from ._flex_api import flex_attention
from .api import attention, dispatch
from .backends.reference import Trace
from .explain import explain
from .plans import BlockPlan, create_block_mask, plan

__all__ = ["attention", "flex_attention", "dispatch", "explain", "plan", "create_block_mask", "BlockPlan", "Decision",
           "Trace", "masks", "plans", "score_mods", "positional", "nn"]
__version__ = "0.1.0"
