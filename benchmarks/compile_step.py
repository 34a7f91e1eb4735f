"""A compiled training step against the eager one, and graph breaks / export of the five calls (issue 26, item 2).

    OMP_NUM_THREADS=2 python benchmarks/compile_step.py            # step times, explain counts, export
    OMP_NUM_THREADS=2 python benchmarks/compile_step.py --rounds 20

The model: an embedding, two attention layers (q, k, v and output projections; causal mask and a softcap
score_mod, ``cap · tanh(s / cap)``), a tied output head; L = 512, B = 2, H = 4, D = 64, fp32. One step is
forward, cross-entropy loss, backward and an SGD update. ``eager`` runs the model as it is;
``compiled`` runs ``torch.compile(model, fullgraph=True)`` (inductor), compiled once before timing. The two are
interleaved round by round; the median of ``--rounds`` is reported, and the ratio eager / compiled (goal >= 1.0).

Then, for each of the five calls of the issue (causal, sliding_window(256), document(ids), a user mask_mod, a
score_mod reading a learnable relative-position table), ``torch._dynamo.explain``'s graph and graph-break
counts, and whether ``torch.export.export`` runs and equals eager.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import attnkit

B, L, H, D = 2, 512, 4, 64
V = 256  # vocabulary
CAP = 30.0


def softcap(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(H * D, 3 * H * D, bias=False)
        self.o = torch.nn.Linear(H * D, H * D, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        a = attnkit.attention(q, k, v, causal=True, score_mod=softcap)
        return x + self.o(a.transpose(1, 2).reshape(B, L, H * D))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H * D)
        self.layers = torch.nn.ModuleList([Layer(), Layer()])

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return x @ self.emb.weight.t()


def step_fn(model, opt):
    def step(tokens, target):
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def steps(rounds: int):
    torch.manual_seed(0)
    eager_m = Model()
    comp_m = Model()
    comp_m.load_state_dict(eager_m.state_dict())
    eager = step_fn(eager_m, torch.optim.SGD(eager_m.parameters(), lr=1e-3))
    compiled_model = torch.compile(comp_m, fullgraph=True)
    comp = step_fn(compiled_model, torch.optim.SGD(comp_m.parameters(), lr=1e-3))
    tokens = torch.randint(0, V, (B, L))
    target = torch.randint(0, V, (B, L))
    t0 = time.perf_counter()
    le, lc = eager(tokens, target), comp(tokens, target)  # the compile happens here
    print(f"first compiled step (compile included): {time.perf_counter() - t0:.1f} s; "
          f"first losses eager {le.item():.6f} compiled {lc.item():.6f}")
    for _ in range(2):
        eager(tokens, target), comp(tokens, target)
    te, tc = [], []
    for _ in range(rounds):
        te.append(timed(eager, tokens, target))
        tc.append(timed(comp, tokens, target))
    me, mc = statistics.median(te), statistics.median(tc)
    print(f"training step, median of {rounds}: eager {me * 1e3:.1f} ms, compiled {mc * 1e3:.1f} ms, "
          f"eager / compiled = {me / mc:.2f}x")


def five_calls():
    q, k, v = (torch.randn(1, H, L, D) for _ in range(3))
    ids = torch.arange(L) // 100
    table = torch.nn.Parameter(torch.randn(H, 2 * L - 1) * 0.1)

    def make_rel(t):
        def rel(score, b, h, q_idx, kv_idx):
            return score + t[h, q_idx - kv_idx + L - 1]

        return rel

    rel = make_rel(table)

    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 64

    calls = {
        "causal": dict(causal=True),
        "sliding_window(256)": dict(mask=attnkit.masks.sliding_window(256)),
        "document(ids)": dict(mask=attnkit.masks.document(ids)),
        "mask_mod": dict(mask=band),
        "score_mod (learnable table)": dict(causal=True, score_mod=rel),
    }
    for name, kw in calls.items():
        fn = lambda q, k, v, kw=kw: attnkit.attention(q, k, v, **kw)  # noqa: E731
        torch._dynamo.reset()
        e = torch._dynamo.explain(fn)(q, k, v)

        class M(torch.nn.Module):
            def forward(self, q, k, v, fn=fn):
                return fn(q, k, v)

        try:
            ep = torch.export.export(M(), (q, k, v))
            err = (ep.module()(q, k, v) - fn(q, k, v)).abs().max().item()
            exported = f"export ok, max |exported - eager| = {err:.1e}"
        except Exception as ex:  # reported, not hidden
            exported = f"export FAILED: {type(ex).__name__}: {ex}"
        print(f"{name:30s} graphs {e.graph_count}, graph breaks {e.graph_break_count}; {exported}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--skip-steps", action="store_true")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; attnkit kernel: "
          f"{attnkit.backends._native.status()}")
    five_calls()
    if not a.skip_steps:
        steps(a.rounds)


if __name__ == "__main__":
    main()
