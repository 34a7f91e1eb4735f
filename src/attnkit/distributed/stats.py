"""What one rank did in its last call: bytes, peers, pairs, tiles, received shards held."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Stats:
    """This rank's last forward (``stats``) or backward (``backward_stats``) call.

    ``steps``: partial results computed and merged (pairs, the local one included);
    ``bytes_sent`` / ``bytes_received``: K/V (forward) or K/V + dK/dV (backward) payload bytes of this
    rank (all_gather/all_reduce: the bytes this rank's shard contributes to / receives from the others);
    ``tiles_computed`` / ``tiles_skipped``: non-empty / empty tiles (the layout's ``block`` grid) of this
    rank's query rows; ``pairs_computed`` / ``pairs_skipped``: key ranks computed / skipped;
    ``peers_sent`` / ``peers_received``: ranks this one sent to / received from;
    ``kv_held_max``: the most received K/V shards this rank held at once (counted where they are
    allocated and freed: ≤ 2 under ``comm="p2p"`` unless K/V are kept for the backward)."""
    steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    tiles_computed: int = 0
    tiles_skipped: int = 0
    pairs_computed: int = 0
    pairs_skipped: int = 0
    peers_sent: tuple = ()
    peers_received: tuple = ()
    kv_held_max: int = 0
