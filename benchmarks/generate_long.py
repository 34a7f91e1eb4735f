"""``generate`` with a long prompt: tokens per second with ``attn_implementation="attnkit"`` against ``"sdpa"``.

    OMP_NUM_THREADS=2 python benchmarks/generate_long.py [--prompt 8192] [--new 16] [--layers 2] [--rounds 2]

Config-built models (random weights, no download): a Llama (MHA: 8 heads of 64) and a Mistral (GQA: 8 query
heads over 2 kv heads, sliding window off), hidden 512, ``--layers`` layers, vocabulary 1000; one prompt of
``--prompt`` random tokens, greedy ``generate`` of ``--new`` tokens (``min_new_tokens`` = ``max_new_tokens``: no
early stop). The same model object runs both implementations (``model.set_attn_implementation``), in turns, one
call each per round; the fastest round of each is kept.

Printed per model: the whole ``generate`` (prefill + decode) in seconds and as new tokens per second, the
prefill alone (one forward of the prompt, ``use_cache=True``), the decode steps alone (the whole time minus the
prefill's, per new token after the first), the ratio attnkit / sdpa of tokens per second, and whether both
generated the same tokens. FLOPs of attention in the prefill: 4 · L² / 2 · D · H per layer (causal: half of
the L × L scores, QKᵀ and PV two multiply-adds each).
"""

from __future__ import annotations

import argparse
import time

import torch

import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")


def _models(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    common = dict(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                  num_attention_heads=8, max_position_embeddings=65536, rope_theta=10000.0)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(num_key_value_heads=8, **common)).eval()
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(num_key_value_heads=2, sliding_window=None, **common)).eval()
    return (("Llama (MHA 8/8)", llama), ("Mistral (GQA 8/2)", mistral))


def _time(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    print(f"prompt {a.prompt} tokens, {a.new} new tokens, {a.layers} layers, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    ids = torch.randint(0, 1000, (1, a.prompt), generator=torch.Generator().manual_seed(1))
    impls = ("sdpa", "attnkit")
    for name, model in _models(a.layers):
        best = {i: [float("inf"), float("inf")] for i in impls}
        toks = {}
        with torch.inference_mode():
            for _ in range(a.rounds):
                for impl in impls:
                    model.set_attn_implementation(impl)
                    out = None

                    def gen(model=model):
                        nonlocal out
                        out = model.generate(ids, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False,
                                             pad_token_id=0)

                    t_gen = _time(gen)
                    t_pre = _time(lambda model=model: model(ids, use_cache=True))
                    best[impl][0] = min(best[impl][0], t_gen)
                    best[impl][1] = min(best[impl][1], t_pre)
                    toks[impl] = out[0, a.prompt:].tolist()
        rows = []
        for impl in impls:
            g, p = best[impl]
            step = (g - p) / max(1, a.new - 1)
            rows.append((impl, g, a.new / g, p, step))
            print(f"  {name:18s} {impl:8s} generate {g:7.2f} s = {a.new / g:6.2f} new tokens/s; prefill {p:7.2f} s; "
                  f"decode {step * 1e3:7.1f} ms/token")
        ratio = rows[1][2] / rows[0][2]
        print(f"  {name:18s} attnkit / sdpa tokens per second: {ratio:.2f}x (prefill {rows[0][3] / rows[1][3]:.2f}x, "
              f"decode step {rows[0][4] / rows[1][4]:.2f}x); same tokens: {toks['sdpa'] == toks['attnkit']}")


if __name__ == "__main__":
    main()
