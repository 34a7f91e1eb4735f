"""``generate`` on attnkit gives exactly the greedy tokens and logits of transformers' "eager",
with a static cache (issue 18, item 3) as with the default dynamic one, on a left-padded batch,
for the families reported: Llama, Qwen3, Mixtral, OLMo2, Gemma3 and Cohere2 (sliding-window
layers), Llama4 (chunked attention), Whisper and T5Gemma (encoder-decoder).

Every model is built from a tiny config with random weights (no download); the attnkit copy is a
deepcopy of the eager one with ``set_attn_implementation``, so both hold the same weights.

Error budget: logits are fp32 of magnitude ~1 after two layers; the two implementations differ
only in summation order inside attention (~1e-7 measured), so ``TOL = 1e-5`` leaves a 100× margin
and still catches any wrong mask (a masked or unmasked key moves a logit by ~1e-2 or more).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

T = pytest.importorskip("transformers", reason="needs transformers (`make test` installs it)")

from attnkit import masks  # noqa: E402
from attnkit.integrations import transformers as ak_hf  # noqa: E402
from attnkit.integrations.transformers import _mask_translation as hf_masks  # noqa: E402

pytestmark = pytest.mark.model

TOL = 1e-5
NEW = 6  # generated tokens: prefill + 5 cached steps, past the window (4) and chunk (4) of the hybrid models


@pytest.fixture(scope="module", autouse=True)
def _registered():
    ak_hf.register()


_BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
_HYBRID = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])


def _config(family):
    if family == "llama":
        return T.LlamaForCausalLM, T.LlamaConfig(**_BASE)
    if family == "qwen3":
        return T.Qwen3ForCausalLM, T.Qwen3Config(**_BASE)
    if family == "mixtral":
        return T.MixtralForCausalLM, T.MixtralConfig(**_BASE, num_local_experts=2, num_experts_per_tok=1)
    if family == "olmo2":
        return T.Olmo2ForCausalLM, T.Olmo2Config(**{k: v for k, v in _BASE.items() if k != "head_dim"},
                                                 eos_token_id=None)
    if family == "gemma3":
        return T.Gemma3ForCausalLM, T.Gemma3TextConfig(**_BASE, **_HYBRID, query_pre_attn_scalar=8)
    if family == "cohere2":
        return T.Cohere2ForCausalLM, T.Cohere2Config(**_BASE, **_HYBRID, eos_token_id=None)
    if family == "llama4":  # layer 0 chunked (chunks of 4), layer 1 global
        return T.Llama4ForCausalLM, T.Llama4TextConfig(**_BASE, intermediate_size_mlp=64, num_local_experts=2,
                                                       attention_chunk_size=4, no_rope_layers=[0, 1],
                                                       moe_layers=[1])
    if family == "whisper":
        return T.WhisperForConditionalGeneration, T.WhisperConfig(
            vocab_size=64, num_mel_bins=8, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8,
            max_target_positions=32, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=None,
            suppress_tokens=None, begin_suppress_tokens=None)
    if family == "t5gemma":
        sub = dict(_BASE, **_HYBRID, query_pre_attn_scalar=8)
        return T.T5GemmaForConditionalGeneration, T.T5GemmaConfig(
            encoder=T.T5GemmaModuleConfig(**sub), decoder=T.T5GemmaModuleConfig(**sub), vocab_size=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=None, decoder_start_token_id=1)
    raise AssertionError(family)


def _pair(family):
    cls, cfg = _config(family)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = cls._from_config(cfg, attn_implementation="eager").eval()
    ak = copy.deepcopy(eager)
    ak.set_attn_implementation(ak_hf.NAME)
    assert ak.config._attn_implementation == ak_hf.NAME
    return eager, ak


def _inputs(family):
    g = torch.Generator().manual_seed(2)
    if family == "whisper":  # (B, mel bins, 2 × max_source_positions) audio features
        return dict(input_features=torch.randn(2, 8, 16, generator=g))
    ids = torch.randint(2, 64, (2, 9), generator=g)
    am = torch.ones(2, 9, dtype=torch.long)
    if family == "t5gemma":
        am[1, 6:] = 0  # an encoder input: right padding
    else:
        am[1, :3] = 0  # left padding, as batched generation pads
    return dict(input_ids=ids, attention_mask=am)


FAMILIES = ["llama", "qwen3", "mixtral", "olmo2", "gemma3", "cohere2", "llama4", "whisper", "t5gemma"]


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_equals_eager_tokens_and_logits(family, cache):
    eager, ak = _pair(family)
    kw = dict(_inputs(family), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = eager.generate(**kw)
        got = ak.generate(**kw)  # before the fix, static: "'And' object has no attribute 'contiguous'"
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits) == NEW
    err = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True))
    assert err <= TOL, f"{family}, {cache} cache: logits differ from eager by {err:.3g} > {TOL}"


def test_a_mask_built_ahead_of_the_forward_is_a_tensor_and_the_forward_still_gets_structured_masks(monkeypatch):
    """What transformers builds in prepare_inputs_for_generation (static cache) is a tensor, since
    it is handed on through tensor-only code; a mask built inside the forward stays structured."""
    from transformers import masking_utils as mu

    _, ak = _pair("llama")
    hook = mu.ALL_MASK_ATTENTION_FUNCTIONS[ak_hf.NAME]
    seen = []

    def recording(*a, **kw):
        out = hook(*a, **kw)
        seen.append((hf_masks._built_ahead_of_the_forward(), out))
        return out

    mu.AttentionMaskInterface.register(ak_hf.NAME, recording)
    try:
        ids, am = _inputs("llama").values()
        with torch.no_grad():
            ak.generate(input_ids=ids, attention_mask=am, max_new_tokens=3, do_sample=False, pad_token_id=0,
                        cache_implementation="static")
            ak(input_ids=ids, attention_mask=am)  # a plain forward: the padded causal mask, structured
    finally:
        mu.AttentionMaskInterface.register(ak_hf.NAME, hook)
    ahead = [out for before, out in seen if before]
    assert ahead and all(isinstance(m, torch.Tensor) for m in ahead), [type(m).__name__ for m in ahead]
    assert isinstance(seen[-1][1], masks.Mask) and not seen[-1][0]
