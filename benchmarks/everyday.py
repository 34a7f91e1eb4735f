"""Everyday speed: the shapes real models run at every step, each against its peer in the same run.

    python benchmarks/everyday.py [--threads 2] [--repeats 400] [--only SUBSTRING] [--no-big]

The table of issue 10 ("everyday speed"), re-measurable before and after a change: run it
once with each source tree on ``PYTHONPATH`` (e.g. ``PYTHONPATH=/tmp/before/src``); only the
ratios of one run mean anything, absolute times swing between runs and machines.

Rows (attnkit vs its peer, interleaved: one call of each in turn, medians; ratio = peer /
attnkit, so > 1 means attnkit is faster):

* decode / prefill calls: ``attnkit.attention(..., causal=True)`` vs torch SDPA called
  directly with the equivalent arguments (no mask for a one-query decode step, whose
  bottom-right causal mask lets every key through; ``is_causal=True`` for L = S);
* ``MultiHeadAttention`` decode step vs a plain-torch layer doing the same work
  (projections, RoPE from a table, cache write, SDPA with ``enable_gqa``);
* transformers ``generate`` (greedy, 20 new tokens, prompt 200) on tiny randomly initialised
  models, ``attn_implementation="attnkit"`` vs ``"sdpa"``; tokens/s and the bytes of dense
  masks attnkit's mask hook built during the whole generation;
* ``backend="tiled"`` alone on causal L = 4096 vs SDPA ``is_causal=True``;
* window-256 at L = 16384 (``--no-big`` skips it): GFLOP/s of ``tiled`` on the useful work
  vs SDPA's dense GFLOP/s. FLOPs: forward ``4·B·H·D·n`` with ``n`` the number of (query,
  key) pairs attended: ``L·S`` for dense, ``Σ_i min(i + 1, 256)`` for the window.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode  # the same plain-torch layer and decoding step as benchmarks/decode.py


def _interleaved(fns: dict, repeats: int, warmup: int = 20) -> dict:
    """Median seconds of each callable, timed in turns (decode.interleaved)."""
    return {n: t / 1e6 for n, t in decode.interleaved(fns, repeats, warmup).items()}


def _row(name, ours, peer, unit="µs", extra=""):
    scale = 1e6 if unit == "µs" else 1e3
    print(f"| {name} | {ours * scale:.{0 if unit == 'µs' and ours * scale >= 100 else 1}f} {unit} | "
          f"{peer * scale:.{0 if unit == 'µs' and peer * scale >= 100 else 1}f} {unit} | {peer / ours:.2f}× |{extra}",
          flush=True)


def calls(repeats: int):
    cases = [  # name, B, H, Hkv, L, S, D, SDPA's equivalent keyword arguments
        ("decode L=1, S=128, H=8, Hkv=2, D=64, causal=True", 1, 8, 2, 1, 128, 64, {}),
        ("decode L=1, S=2048, same", 1, 8, 2, 1, 2048, 64, {}),
        ("prefill L=S=64, B=2, H=4, D=16, causal", 2, 4, 4, 64, 64, 16, dict(is_causal=True)),
        ("prefill L=S=200, GQA 4/2, D=64, causal", 1, 4, 2, 200, 200, 64, dict(is_causal=True)),
        ("prefill L=S=512, H=8, D=64, causal", 1, 8, 8, 512, 512, 64, dict(is_causal=True)),
    ]
    for name, B, H, Hkv, L, S, D, skw in cases:
        q, k, v = torch.randn(B, H, L, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
        with torch.no_grad():
            t = _interleaved({
                "attnkit": lambda: attnkit.attention(q, k, v, causal=True),
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hkv, **skw),
            }, repeats if L * S < 100_000 else max(50, repeats // 4))
        _row(name, t["attnkit"], t["sdpa"])


def mha_step(repeats: int):
    for cached in (256, 2048):
        t = decode.mha_step(cached, repeats)  # µs
        _row(f"`MultiHeadAttention` decode step (E=512, H=8, Hkv=2, RoPE, cache {cached})", t["attnkit"] / 1e6,
             t["plain"] / 1e6)


def _tiny(family: str):
    import transformers as T

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    if family == "Llama":
        return T.LlamaForCausalLM, T.LlamaConfig(**base)
    if family == "Mistral (window 4)":
        return T.MistralForCausalLM, T.MistralConfig(**base, sliding_window=4)
    if family == "Qwen2":
        return T.Qwen2ForCausalLM, T.Qwen2Config(**base)
    if family == "Gemma3 (window 4)":
        return T.Gemma3ForCausalLM, T.Gemma3TextConfig(**base, sliding_window=4, query_pre_attn_scalar=16,
                                                       layer_types=["sliding_attention", "full_attention"])
    raise ValueError(family)


def generate(repeats: int, new_tokens: int = 20, prompt: int = 200):
    from transformers import masking_utils

    from attnkit.integrations import transformers as ak_hf

    ak_hf.register()
    built = []  # bytes of every dense mask tensor the attnkit mask hook returned
    hook = masking_utils.AttentionMaskInterface._global_mapping[ak_hf.NAME]

    def counting(*a, **kw):
        out = hook(*a, **kw)
        if isinstance(out, torch.Tensor):
            built.append(out.numel() * out.element_size())
        return out

    masking_utils.AttentionMaskInterface.register(ak_hf.NAME, counting)
    try:
        for family in ("Llama", "Mistral (window 4)", "Qwen2", "Gemma3 (window 4)"):
            cls, cfg = _tiny(family)
            torch.manual_seed(0)
            models = {}
            for impl in ("attnkit", "sdpa"):
                torch.manual_seed(0)
                # a config of its own: _from_config writes the implementation into the config it is given
                models[impl] = cls._from_config(copy.deepcopy(cfg), attn_implementation=impl).eval()
                assert models[impl].config._attn_implementation == impl
            ids = torch.randint(0, 256, (1, prompt), generator=torch.Generator().manual_seed(1))
            outs = {}

            def gen(impl):
                def f():
                    outs[impl] = models[impl].generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                       do_sample=False, pad_token_id=0)
                return f

            with torch.no_grad():
                built.clear()
                gen("attnkit")()
                mask_bytes = sum(built)
                t = _interleaved({"attnkit": gen("attnkit"), "sdpa": gen("sdpa")}, repeats, warmup=2)
            same = torch.equal(outs["attnkit"], outs["sdpa"])
            _row(f"transformers `generate`, tiny {family} ({new_tokens} tokens, prompt {prompt})", t["attnkit"],
                 t["sdpa"], unit="ms",
                 extra=f" {new_tokens / t['attnkit']:.0f} vs {new_tokens / t['sdpa']:.0f} tok/s; dense masks built by "
                       f"the attnkit hook: {mask_bytes} B; same tokens: {same} |")
    finally:
        masking_utils.AttentionMaskInterface.register(ak_hf.NAME, hook)


def tiled_causal(repeats: int):
    q, k, v = (torch.randn(1, 8, 4096, 64) for _ in range(3))
    with torch.no_grad():
        t = _interleaved({
            "attnkit": lambda: attnkit.attention(q, k, v, causal=True, backend="tiled"),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        }, repeats, warmup=1)
    _row("causal L=4096 (B=1, H=8, D=64), `tiled` alone vs SDPA is_causal", t["attnkit"], t["sdpa"], unit="ms")


def window_gflops(repeats: int, L: int = 16384, W: int = 256, H: int = 2, D: int = 64):
    q, k, v = (torch.randn(1, H, L, D) for _ in range(3))
    pairs = sum(min(i + 1, W) for i in range(L))
    with torch.no_grad():
        t = _interleaved({
            "attnkit": lambda: attnkit.attention(q, k, v, mask=masks.sliding_window(W), backend="tiled"),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        }, repeats, warmup=1)
    ours = 4 * H * D * pairs / t["attnkit"] / 1e9
    dense = 4 * H * D * L * L / t["sdpa"] / 1e9
    print(f"| window-{W} L={L} (B=1, H={H}, D={D}): `tiled` GFLOP/s on the window vs SDPA dense GFLOP/s | "
          f"{ours:.1f} | {dense:.1f} | {ours / dense:.2f} (fraction) |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--only", default="", help="run only the groups whose name contains this (calls, mha, "
                                               "generate, tiled, window)")
    ap.add_argument("--no-big", action="store_true", help="skip the window-256 L=16384 row")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(f"attnkit from {Path(attnkit.__file__).parent}; torch {torch.__version__}, {a.threads} threads\n")
    print("| case | attnkit | peer | peer / attnkit |")
    print("|---|---|---|---|")
    groups = [("calls", lambda: calls(a.repeats)), ("mha", lambda: mha_step(a.repeats)),
              ("generate", lambda: generate(max(3, a.repeats // 80))),
              ("tiled", lambda: tiled_causal(max(3, a.repeats // 100)))]
    if not a.no_big:
        groups.append(("window", lambda: window_gflops(3)))
    for name, fn in groups:
        if a.only in name:
            fn()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
