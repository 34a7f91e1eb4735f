"""Gemma 2's decode steps (soft-capped scores) inside transformers ``generate``: attnkit against ``"eager"``.

    OMP_NUM_THREADS=2 python benchmarks/gemma2_decode.py [--prompt 2048] [--new 33] [--rounds 2]

A config-built Gemma 2 (random weights, no download): hidden 512, 2 layers, 8 query heads over 4 kv heads of 64,
``attn_logit_softcapping=50`` (every attention call applies ``50 · tanh(s / 50)`` to its scores: SDPA cannot, so
transformers runs such models on ``"eager"``), sliding window 4096 (wider than the cache: every layer causal). One
prompt of ``--prompt`` tokens (no pad token in it: ``generate`` would mask it), greedy ``generate`` of ``--new``
tokens with each implementation in turn, ``--rounds`` times. Timed: each attention call of a decode step (one
query row over the cache), at the attention function transformers calls (``eager_attention_forward`` / attnkit's
registered function), medians over all rounds. attnkit runs the soft cap as a ``score_mod`` on its compiled
kernel's decode entry. Also printed: whether both generated the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Gemma2Config, Gemma2ForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma2 import modeling_gemma2

import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=33)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64, sliding_window=4096,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=16384)
    model = Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(1, cfg.vocab_size, (1, a.prompt))  # token 0 is the pad token
    times: dict[str, list[float]] = {"eager": [], "attnkit": []}

    def timed(fn, tag):
        def wrapper(module, query, *args, **kw):
            t = time.perf_counter()
            out = fn(module, query, *args, **kw)
            if query.shape[2] == 1:
                times[tag].append(time.perf_counter() - t)
            return out
        return wrapper

    modeling_gemma2.eager_attention_forward = timed(modeling_gemma2.eager_attention_forward, "eager")
    ALL_ATTENTION_FUNCTIONS["attnkit"] = timed(ALL_ATTENTION_FUNCTIONS["attnkit"], "attnkit")
    tokens = {}
    for _ in range(a.rounds):
        for impl in ("eager", "attnkit"):
            model.set_attn_implementation(impl)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new,
                                     min_new_tokens=a.new, do_sample=False)
            tokens[impl] = out[0, a.prompt:].tolist()
    e, k = statistics.median(times["eager"]), statistics.median(times["attnkit"])
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; Gemma 2 (2 layers, 8 / 4 heads of 64, "
          f"soft cap 50), prompt {a.prompt}, {a.new} new tokens, {a.rounds} rounds\n")
    print("| attention call of a decode step | median ms | calls |\n|---|---|---|")
    print(f"| eager | {e * 1e3:.3f} | {len(times['eager'])} |")
    print(f"| attnkit | {k * 1e3:.3f} | {len(times['attnkit'])} |")
    print(f"\neager / attnkit: {e / k:.2f}x; same tokens: {tokens['eager'] == tokens['attnkit']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
