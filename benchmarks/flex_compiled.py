"""A FlexAttention model under ``torch.compile``: attnkit.flex_attention as one op in the graph, against the graph
break it used to be, and against the eager model.

    OMP_NUM_THREADS=2 python benchmarks/flex_compiled.py                 # L = 64 and 1024
    OMP_NUM_THREADS=2 python benchmarks/flex_compiled.py --score-mod softcap   # a user's score_mod in every call
    OMP_NUM_THREADS=2 python benchmarks/flex_compiled.py --lengths 256 --rounds 40

The model: ``--layers`` (4) pre-norm transformer blocks of width H · D = 4 · 64 (q, k, v and output projections,
``attnkit.flex_attention`` with a packed-documents causal ``BlockMask`` built once outside from a user's mask_mod,
and with ``--score-mod softcap`` a user's score_mod too; a 4× GELU MLP), B = 1,
fp32. Three peers, one call of each per round (interleaved), the median of ``--rounds`` and the median of the
per-round ratios:

* ``eager``: the model as it is;
* ``one op``: ``torch.compile(model)`` (inductor) where attnkit.flex_attention on the CPU traces to one call of
  attnkit's torch op (the block mask's tensors among its inputs): one graph, ``fullgraph=True`` works;
* ``break``: the same compiled model with flex_attention opaque to TorchDynamo (what attnkit did before): each
  call a graph break, run eagerly between compiled pieces.

Forward only (``torch.no_grad``) and forward + backward (the sum of the output). FLOPs are the same for every peer,
so only times and ratios are printed; the CPU's name heads the output.
"""

from __future__ import annotations

import argparse
import statistics
import types

import torch
from _interleave import cpu_name, paired_ratio, rounds_ms

import attnkit
from attnkit import _flex_api, _mods

H, D = 4, 64


def _opaque_copy(fn):
    """``fn`` with a code object of its own marked opaque to TorchDynamo: the graph-break behaviour, while ``fn``
    itself stays traceable (the two peers can then run in one process)."""
    code = fn.__code__.replace()
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    _mods.opaque_to_torch_compile(copy, "the old behaviour: a graph break")
    return copy


def softcap(score, b, h, q_idx, kv_idx):  # --score-mod softcap: Gemma 2's soft cap, a user's score_mod
    return 30.0 * torch.tanh(score / 30.0)


class Block(torch.nn.Module):
    def __init__(self, flex, score_mod=None):
        super().__init__()
        self.score_mod = score_mod
        w = H * D
        self.n1, self.n2 = torch.nn.LayerNorm(w), torch.nn.LayerNorm(w)
        self.qkv, self.o = torch.nn.Linear(w, 3 * w), torch.nn.Linear(w, w)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(w, 4 * w), torch.nn.GELU(), torch.nn.Linear(4 * w, w))
        self.flex = flex

    def forward(self, x, bm):
        B, L, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        a = self.flex(q, k, v, score_mod=self.score_mod, block_mask=bm).transpose(1, 2).reshape(B, L, H * D)
        x = x + self.o(a)
        return x + self.mlp(self.n2(x))


class DecodeBlock(Block):
    """One new token over ``S`` cached keys (the cache fixed: one decode step's shapes)."""

    def __init__(self, flex, S, score_mod=None):
        super().__init__(flex, score_mod)
        self.register_buffer("k_cache", torch.randn(1, H, S, D))
        self.register_buffer("v_cache", torch.randn(1, H, S, D))

    def forward(self, x, bm):
        B, L, _ = x.shape
        q = self.qkv(self.n1(x))[..., :H * D].view(B, L, H, D).transpose(1, 2)
        a = self.flex(q, self.k_cache, self.v_cache, score_mod=self.score_mod, block_mask=bm)
        a = a.transpose(1, 2).reshape(B, L, H * D)
        x = x + self.o(a)
        return x + self.mlp(self.n2(x))


class Model(torch.nn.Module):
    def __init__(self, layers, flex, decode_S=None, score_mod=None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(flex, score_mod) if decode_S is None
                                          else DecodeBlock(flex, decode_S, score_mod) for _ in range(layers))

    def forward(self, x, bm):
        for b in self.blocks:
            x = b(x, bm)
        return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,1024")
    ap.add_argument("--decode", default="1024,4096",
                    help="cache lengths S for the decode step (one new token over S cached keys, a sliding window "
                         "of 1024 as the BlockMask; forward only); 'none' to skip")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--score-mod", choices=("none", "softcap"), default="none",
                    help="a score_mod in every attention call: none, or softcap (30 · tanh(s / 30), a user function)")
    a = ap.parse_args()
    # the blocks share one forward's code, and each model instance, grad mode and length is another guard: room for
    # all of them, so no peer falls back to eager past TorchDynamo's default limit of 8
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    sm = softcap if a.score_mod == "softcap" else None
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; {torch.get_num_threads()} threads; {a.layers} layers, "
          f"H={H}, D={D}, B=1, fp32; score_mod {a.score_mod}; median of {a.rounds} interleaved rounds")
    print(f"{'L':>6} {'mode':>7} {'eager ms':>9} {'one op ms':>10} {'break ms':>9} {'eager/one op':>13} "
          f"{'break/one op':>13}")
    for L in (int(x) for x in a.lengths.split(",")):
        torch.manual_seed(0)
        ids = torch.arange(L) * 5 // L  # 5 packed documents

        def doc_causal(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

        bm = attnkit.create_block_mask(doc_causal, None, None, L, L)
        model = Model(a.layers, attnkit.flex_attention, score_mod=sm)
        old = Model(a.layers, _opaque_copy(_flex_api.flex_attention), score_mod=sm)
        old.load_state_dict(model.state_dict())
        one_op, brk = torch.compile(model), torch.compile(old)
        x = torch.randn(1, L, H * D)
        xg = x.clone().requires_grad_(True)
        torch.testing.assert_close(one_op(x, bm), model(x, bm), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(brk(x, bm), model(x, bm), atol=1e-4, rtol=1e-4)
        for mode in ("fwd", "fwdbwd"):
            def run(m, mode=mode):
                if mode == "fwd":
                    def f():
                        with torch.no_grad():
                            m(x, bm)
                    return f
                return lambda: m(xg, bm).sum().backward()

            fns = {"eager": run(model), "one op": run(one_op), "break": run(brk)}
            for f in fns.values():  # compile (and warm) each before timing
                f()
                f()
            _row(str(L), mode, rounds_ms(fns, a.rounds))
    for S in ([] if a.decode == "none" else [int(x) for x in a.decode.split(",")]):
        torch.manual_seed(0)

        def window(b, h, q_idx, kv_idx, S=S):
            return (kv_idx <= q_idx + S - 1) & (q_idx + S - 1 - kv_idx < 1024)

        bm = attnkit.create_block_mask(window, None, None, 1, S)
        model = Model(a.layers, attnkit.flex_attention, decode_S=S, score_mod=sm)
        old = Model(a.layers, _opaque_copy(_flex_api.flex_attention), decode_S=S, score_mod=sm)
        old.load_state_dict(model.state_dict())
        one_op, brk = torch.compile(model), torch.compile(old)
        x = torch.randn(1, 1, H * D)

        def step(m):
            def f():
                with torch.no_grad():
                    m(x, bm)
            return f

        fns = {"eager": step(model), "one op": step(one_op), "break": step(brk)}
        for f in fns.values():
            f()
            f()
        _row(f"S={S}", "decode", rounds_ms(fns, a.rounds))


def _row(what: str, mode: str, t: dict) -> None:
    med = {n: statistics.median(v) for n, v in t.items()}
    print(f"{what:>6} {mode:>7} {med['eager']:>9.2f} {med['one op']:>10.2f} {med['break']:>9.2f} "
          f"{paired_ratio(t['eager'], t['one op']):>13.2f} {paired_ratio(t['break'], t['one op']):>13.2f}")


if __name__ == "__main__":
    main()
