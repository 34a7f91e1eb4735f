"""Walk transformers' installed model families on ``attn_implementation="attnkit"``.

Each family (a ``model_type`` of transformers' auto mappings with a causal-LM or base-model
class) is built from a tiny random config (2 layers, hidden 32, 4 heads, vocabulary 100), once
on ``"eager"`` and once on ``"attnkit"`` with the same weights, and run on a padded batch of
token ids. The verdict is one of:

* ``exact``: logits (or last hidden states) within the float32 budget of eager's, on every
  unpadded position, and for a causal LM the greedy tokens and logits of ``generate`` (4 new
  tokens, dynamic and static cache) equal to eager's, with attnkit's attention function called
  (``exact*``: attnkit was never called — the model computes its own attention and asks neither
  hook, or the tiny model's two layers are all recurrent/linear ones — so eager's code ran twice,
  equal by construction);
* ``refused``: a clear attnkit error (``UnsupportedModelError``, or a ``ValueError`` /
  ``TypeError`` raised by attnkit naming what it will not run) at construction or first forward;
* ``skipped``: cannot be built tiny and offline here (composite vision/audio config, inputs other
  than token ids, a config the tiny sizes do not satisfy, a missing optional dependency),
  with the reason;
* ``WRONG`` / ``CRASH``: not exact, or an error from outside attnkit's checks — what must never
  happen (the walk test fails on them).

Float32 budget: ``|attnkit − eager| ≤ 2e-5 · max(1, max |eager|)``. The two differ only in the
summation order inside attention (~1e-7 relative measured); any mask error moves an output by
far more (~1e-2).

Run ``python tools/walk_transformers.py`` for the whole table (a few minutes), or
``--sample N`` for every N-th family (what the test does).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import io
import logging
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from attnkit.integrations import transformers as ak_hf

__all__ = ["Result", "families", "walk_one", "walk", "table"]

RTOL = 2e-5
B, N = 2, 11  # batch of two rows of 11 tokens, the second padded by 3

# Tiny sizes, set on a config only where it has the attribute (through its attribute_map, so
# GPT-2's n_embd is hidden_size): small enough that building and running a model costs
# milliseconds, large enough that windows (4) and chunks (4) bind on 11 tokens.
TINY = dict(
    vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, head_dim=8, max_position_embeddings=128, d_model=32, d_ff=64, d_kv=8,
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=64, decoder_ffn_dim=64, num_layers=2, num_decoder_layers=2, num_heads=4,
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
    # multi-latent attention
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
    # embeddings that default to large tables
    type_vocab_size=2, rotary_dim=4, n_positions=128,
)
BINDING = dict(sliding_window=4, attention_chunk_size=4)  # set only where the default is not None


@dataclass
class Result:
    family: str
    cls: str
    verdict: str  # exact | exact* | refused | skipped | WRONG | CRASH
    detail: str = ""
    seconds: float = 0.0


def families() -> list[tuple[str, str]]:
    """``[(model_type, class name)]``: the causal-LM class of each family that has one, else its base model."""
    from transformers.models.auto import modeling_auto as ma

    out = dict(ma.MODEL_MAPPING_NAMES)
    out.update(ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return sorted((k, v if isinstance(v, str) else v[0]) for k, v in out.items())


# A few families whose defaults tie a list to the layer count: the tiny value, by model type.
EXTRA = {"gpt_neo": dict(attention_types=[[["global", "local"], 1]])}
# Sub-configs that are options of one model, not models of their own (MPT's attention options).
_OPTION_SUBCONFIGS = ("attn_config",)


def _tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    cfg_cls = CONFIG_MAPPING[model_type]
    try:
        default = cfg_cls()
    except Exception as e:  # reported as the reason for skipping
        raise _Skip(f"default config rejected ({type(e).__name__}: {_first_line(e)})") from None
    subs = [k for k in (getattr(default, "sub_configs", None) or {})
            if _plain_attr(default, k) is not None and k not in _OPTION_SUBCONFIGS]
    if subs:  # its default sub-models are full size: not tiny, and not what this walk is about
        raise _Skip(f"composite config ({', '.join(subs)})")
    kw: dict[str, Any] = {k: v for k, v in TINY.items() if _has(default, k)}  # config keyword -> value
    kw.update({k: v for k, v in BINDING.items() if _plain_attr(default, k) is not None})
    for k, v in dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, decoder_start_token_id=1).items():
        if _plain_attr(default, k) is not None:
            kw[k] = v
    if "qk_rope_head_dim" in kw and "head_dim" in kw:  # multi-latent attention: head_dim is the rotary part
        kw["head_dim"] = kw["qk_rope_head_dim"]
    kw.update(EXTRA.get(model_type, {}))
    err = None
    for _ in range(6):  # drop what this config will not take (a read-only property, a field it validates)
        try:
            return cfg_cls(**kw)
        except Exception as e:  # reported as the reason for skipping
            err = e
            bad = re.search(r"property '(\w+)'|field '(\w+)'", str(e))
            name = bad and (bad.group(1) or bad.group(2))
            if not name or name not in kw:
                break
            kw.pop(name)
    raise _Skip(f"tiny config rejected ({type(err).__name__}: {_first_line(err)})")


def _has(cfg, name) -> bool:
    try:
        getattr(cfg, name)
        return True
    except Exception:  # missing, or a per-layer attribute transformers refuses to read globally
        return False


def _plain_attr(cfg, name):
    try:
        return getattr(cfg, name, None)
    except Exception:  # a per-layer attribute transformers refuses to read globally
        return None


class _Skip(Exception):
    pass


def _first_line(e, n=90) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return s if len(s) <= n else s[:n - 1] + "…"


def _from_attnkit(e: BaseException) -> bool:
    """Whether ``e`` was raised by attnkit's own code (a deliberate, clear refusal), not deeper."""
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and "/attnkit/" in last.replace("\\", "/")


def _inputs(cfg, forward_params):
    vocab = getattr(cfg, "vocab_size", None)
    if not isinstance(vocab, int):
        raise _Skip("takes no token ids (no vocab_size)")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3 if vocab > 3 else 0, vocab, (B, N), generator=g)
    am = torch.ones(B, N, dtype=torch.long)
    kw: dict[str, Any] = dict(input_ids=ids, attention_mask=am)  # forward's keyword arguments
    if "use_cache" in forward_params:  # one forward, no cache (hybrid caches refuse some inputs without one)
        kw["use_cache"] = False
    if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in forward_params:
        am[1, -3:] = 0  # an encoder input: right padding
        kw["decoder_input_ids"] = ids[:, :7]
    else:
        am[1, :3] = 0  # left padding, as batched generation pads (an encoder reads it as padding all the same)
    return kw, am


_CALLS = [0]


def _counting(*args, **kwargs):
    _CALLS[0] += 1
    return ak_hf.attnkit_attention_forward(*args, **kwargs)


@contextlib.contextmanager
def _quiet():
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def _main_output(out):
    for name in ("logits", "last_hidden_state", "prediction_logits"):
        t = getattr(out, name, None)
        if isinstance(t, torch.Tensor):
            return t
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def walk_one(model_type: str, cls_name: str, *, generate: bool = True) -> Result:
    """The verdict for one family (see the module docstring)."""
    import transformers

    t0 = time.perf_counter()
    res = Result(model_type, cls_name, "skipped")
    try:
        with _quiet():
            res.verdict, res.detail = _walk_one(transformers, model_type, cls_name, generate)
    except _Skip as e:
        res.verdict, res.detail = "skipped", str(e)
    except Exception as e:  # the walk itself tripped: reported, never hidden
        res.verdict, res.detail = "CRASH", f"walk: {type(e).__name__}: {_first_line(e)}"
    res.seconds = time.perf_counter() - t0
    return res


def _walk_one(transformers, model_type, cls_name, generate):
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        raise _Skip("class not importable here (optional dependency missing)")
    cfg = _tiny_config(model_type)
    torch.manual_seed(0)
    try:
        eager = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    except Exception as e:
        raise _Skip(f"cannot build tiny ({type(e).__name__}: {_first_line(e)})") from None
    kw, am = _inputs(cfg, inspect.signature(cls.forward).parameters)
    try:
        with torch.no_grad():
            want = _main_output(eager(**kw))
    except Exception as e:
        raise _Skip(f"eager forward on token ids failed ({type(e).__name__}: {_first_line(e)})") from None
    if want is None or not want.is_floating_point():
        raise _Skip("no logits or hidden states to compare")
    try:
        ak = cls._from_config(copy.deepcopy(cfg), attn_implementation=ak_hf.NAME).eval()
    except Exception as e:
        if _from_attnkit(e):
            return "refused", f"at construction: {type(e).__name__}: {_first_line(e, 140)}"
        return "CRASH", f"construction on attnkit: {type(e).__name__}: {_first_line(e)}"
    if ak.config._attn_implementation != ak_hf.NAME:
        raise _Skip(f"transformers did not set attnkit (kept {ak.config._attn_implementation!r})")
    ak.load_state_dict(eager.state_dict())
    _CALLS[0] = 0
    try:
        with torch.no_grad():
            got = _main_output(ak(**kw))
    except Exception as e:
        if _from_attnkit(e) and isinstance(e, (ValueError, TypeError)):
            return "refused", f"first forward: {type(e).__name__}: {_first_line(e, 140)}"
        return "CRASH", f"forward on attnkit: {type(e).__name__}: {_first_line(e)}\n{traceback.format_exc(limit=-3)}"
    if got.shape != want.shape:
        return "WRONG", f"output shape {tuple(got.shape)} vs eager {tuple(want.shape)}"
    valid = am.bool() if got.dim() >= 2 and got.shape[:2] == am.shape else torch.ones(got.shape[:2], dtype=torch.bool)
    err = (got - want).abs()[valid].max().item()
    budget = RTOL * max(1.0, want.abs()[valid].max().item())
    if not err <= budget:
        return "WRONG", f"max |attnkit - eager| = {err:.3g} > budget {budget:.3g}"
    if _CALLS[0] == 0:
        return "exact*", f"attnkit never called: own attention, or no attention layer among 2 (err {err:.1e})"
    calls = _CALLS[0]
    gen = ""
    if generate and _generates(ak, cls):
        compared = []
        for cache in ("dynamic", "static"):
            verdict = _check_generate(eager, ak, kw, cache)
            if verdict is False:
                continue
            if verdict is not None:
                return verdict
            compared.append(cache)
        gen = f", generate equal ({' and '.join(compared)} cache)" if compared else ""
    return "exact", f"err {err:.1e} (budget {budget:.1e}), {calls} attention calls{gen}"


GEN_NEW = 4  # greedy tokens generated per check: the prefill and three cached steps


def _generates(model, cls) -> bool:
    """Whether the family's class generates text from token ids (a causal LM of the auto mapping)."""
    from transformers.models.auto import modeling_auto as ma

    names = {v if isinstance(v, str) else v[0] for v in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()}
    return cls.__name__ in names and hasattr(model, "generate") and not getattr(model.config, "is_encoder_decoder",
                                                                                  False)


def _check_generate(eager, ak, kw, cache):
    """None when greedy generation (left-padded batch) gives eager's tokens and logits, False when eager
    itself cannot generate so (nothing to compare), else a ``(verdict, detail)``."""
    args = dict(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"], max_new_tokens=GEN_NEW,
                min_new_tokens=GEN_NEW, do_sample=False, pad_token_id=0, output_logits=True,
                return_dict_in_generate=True)
    if cache == "static":
        args["cache_implementation"] = "static"
    try:
        with torch.no_grad():
            want = eager.generate(**args)
    except Exception:  # eager cannot generate this way (no static cache for it): nothing to compare
        return False
    try:
        with torch.no_grad():
            got = ak.generate(**args)
    except Exception as e:
        if _from_attnkit(e) and isinstance(e, (ValueError, TypeError)):
            return "refused", f"generate ({cache} cache): {type(e).__name__}: {_first_line(e, 140)}"
        return "CRASH", f"generate ({cache} cache) on attnkit: {type(e).__name__}: {_first_line(e)}"
    if not torch.equal(got.sequences, want.sequences):
        return "WRONG", f"generate ({cache} cache): tokens differ from eager's"
    # equal sequences: as many steps' logits on both sides
    err = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True))
    budget = RTOL * max(1.0, max(b.abs().max().item() for b in want.logits))
    if not err <= budget:
        return "WRONG", f"generate ({cache} cache): logits differ by {err:.3g} > budget {budget:.3g}"
    return None


def walk(selected=None, *, sample: int = 1, generate: bool = True, progress=None) -> list[Result]:
    """Walk ``selected`` families (default: all of :func:`families`, every ``sample``-th)."""
    import transformers

    ak_hf.register()
    fams = families()
    fams = [f for f in fams if f[0] in set(selected)] if selected is not None else fams[::sample]
    transformers.AttentionInterface.register(ak_hf.NAME, _counting)
    out = []
    try:
        for mt, cls in fams:
            r = walk_one(mt, cls, generate=generate)
            out.append(r)
            if progress is not None:
                progress(r)
    finally:
        transformers.AttentionInterface.register(ak_hf.NAME, ak_hf.attnkit_attention_forward)
    return out


def table(results: list[Result]) -> str:
    """A markdown table (family | class | verdict | detail) and the counts."""
    rows = ["| family | class | verdict | detail |", "|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.family} | {r.cls} | {r.verdict} | {r.detail.splitlines()[0] if r.detail else ''} |")
    counts: dict = {}
    for r in results:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    skips: dict = {}
    for r in results:
        if r.verdict == "skipped":
            why = r.detail.split(" (")[0]
            skips[why] = skips.get(why, 0) + 1
    rows.append("")
    rows.append(f"{len(results)} families: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    if skips:
        rows.append("skipped because: " + "; ".join(f"{k}: {v}" for k, v in sorted(skips.items(), key=lambda x: -x[1])))
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python tools/walk_transformers.py", description=__doc__.splitlines()[0])
    p.add_argument("--sample", type=int, default=1, help="walk every N-th family (default: all)")
    p.add_argument("families", nargs="*", help="model types to walk (default: all)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    t = time.perf_counter()

    def progress(r):
        first = r.detail.splitlines()[0] if r.detail else ""
        print(f"{r.family:32s} {r.verdict:8s} {r.seconds:5.2f}s {first}", file=sys.stderr)

    res = walk(a.families or None, sample=a.sample, progress=progress)
    print(table(res))
    print(f"\nwalk time: {time.perf_counter() - t:.1f}s")
    return 1 if any(r.verdict in ("WRONG", "CRASH") for r in res) else 0


if __name__ == "__main__":
    sys.exit(main())
