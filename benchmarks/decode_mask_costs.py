"""What a decode step's mask costs in Python, apart from the kernel: the pieces a decode loop with a user's
``mask_mod`` (new every step) or a FlexAttention ``BlockMask`` pays at every step.

    OMP_NUM_THREADS=2 python benchmarks/decode_mask_costs.py [--rounds 300] [--torch]

One query row (L = 1, B = 1, H = 8) over S keys; ``kv <= q + S - 1`` (causal as a decode loop writes it). Each
callable below is timed in turns with the others (``_interleave.best_ms``: the best of ``--rounds``), in µs:

* a mod's row intervals read off its points (the decode entry's way at decode sizes) against the same read off a
  tile map (range analysis, stacked partial tiles: its way for bigger calls, and every call's before) — a new mod
  every call, so no cache helps either;
* the check that a mod left its index tensors intact: the C library's ``memcmp`` of the used prefix against NumPy's
  compare;
* ``attnkit.create_block_mask`` for (1, S) against torch's (``--torch``; it runs its own evaluation per call);
* reading a new ``BlockMask`` of that mod into a plan (what ``flex_attention`` does first, its content key
  included: a new BlockMask every step, so the key never hits) and the plan's row intervals at the row's points.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from _interleave import best_ms, cpu_name

import attnkit
from attnkit import _blockmask, masks
from attnkit.backends import _tilebits, native


def _mod(S: int):
    off = S - 1
    return lambda b, h, q, kv: kv <= q + off


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--lengths", default="1200,65536")
    ap.add_argument("--torch", action="store_true", help="also torch's create_block_mask")
    a = ap.parse_args(argv)
    B, H, L = 1, 8, 1
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; L = {L}, B = {B}, H = {H}; "
          f"best of {a.rounds}, µs\n")
    print("| S | call | µs |\n|---|---|---|")
    for S in (int(x) for x in a.lengths.split(",")):
        def dense(S=S):
            return native._dense_row_intervals(masks.from_mod(_mod(S)), B, H, L, S)

        def tile_map(S=S):
            _tilebits._CACHE.clear()  # a new mod every step: its content is new, no map is reused
            return _tilebits.row_intervals(_tilebits.tile_bits(masks.from_mod(_mod(S)), B, H, L, S), L, S)

        assert all(torch.equal(x, y) for x, y in zip(dense(), tile_map(), strict=True))
        x, y = np.arange(S, dtype=np.int64), np.arange(S, dtype=np.int64)
        px, py = x.ctypes.data, y.ctypes.data
        fns = {"row intervals: the mod at every point": dense,
               "row intervals: off the mod's tile map": tile_map,
               "index check: memcmp": lambda px=px, py=py, S=S: native._same_bytes(px, py, 8 * S),
               "index check: NumPy compare": lambda x=x, y=y: np.array_equal(x, y),
               "attnkit.create_block_mask (1, S)": lambda S=S: attnkit.create_block_mask(_mod(S), 1, None, 1, S)}
        bm = attnkit.create_block_mask(_mod(S), 1, None, 1, S)

        def read_block_mask(S=S, bm=bm):
            _blockmask._PLANS.clear()  # a new BlockMask every step: its content key never hits
            return _blockmask.block_mask_plan(bm, B, H, L, S, torch.device("cpu"), "block_mask")

        plan = read_block_mask()
        fns["a BlockMask read into a plan (flex_attention's first step)"] = read_block_mask
        fns["its row intervals at the row's points"] = lambda S=S, plan=plan: native._dense_row_intervals(
            plan.mask, B, H, L, S)
        if a.torch:
            from torch.nn.attention.flex_attention import create_block_mask

            fns["torch create_block_mask (1, S)"] = lambda S=S: create_block_mask(_mod(S), 1, None, 1, S,
                                                                                  device="cpu")
        for name, ms in best_ms(fns, a.rounds).items():
            print(f"| {S} | {name} | {ms * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
