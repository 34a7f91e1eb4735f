"""Tiny Hugging Face models on ``attn_implementation="attnkit"`` agree with transformers' own "eager".

Every model here is built from a small config with random weights (no download);
the attnkit copy is a deepcopy of the eager one with ``set_attn_implementation``,
so both hold the same weights. Tolerances are fp32 round-off on logits of size
~1 (``TOL``), relative for gradients (``GRAD_RTOL``).

What the model passes to its attention function is honoured or refused, never
dropped: softcap (Gemma 2), position_bias (T5, with its gradient), attention sinks
(GPT-OSS ``s_aux``), sparse ``indices``/``block_indices`` (refused), any unknown
keyword (refused, named).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from conftest import ROOT

T = pytest.importorskip("transformers", reason="needs transformers (`make test` installs it)")

from attnkit import masks  # noqa: E402
from attnkit.integrations import transformers as ak_hf  # noqa: E402
from attnkit.integrations.transformers import _mask_translation as hf_masks  # noqa: E402

pytestmark = pytest.mark.model

TOL = 2e-5  # fp32 logits of magnitude ~1 after a few layers
GRAD_RTOL = 1e-4  # gradients: max |a - b| <= GRAD_RTOL * max |b|


@pytest.fixture(scope="module", autouse=True)
def _registered():
    ak_hf.register()


def _pair(model):
    """(eager, attnkit) copies of one model with the same weights, in eval mode."""
    model.eval()
    ak = copy.deepcopy(model)
    ak.set_attn_implementation(ak_hf.NAME)
    assert model.config._attn_implementation == "eager" and ak.config._attn_implementation == ak_hf.NAME
    return model, ak


def _build(cls, cfg, seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls._from_config(cfg, attn_implementation="eager")


def _maxdiff(a, b, where=None):
    d = (a - b).abs()
    return (d[where] if where is not None else d).max().item()


def _rel(a, b):
    return (a - b).abs().max().item() / b.abs().max().item()


class _Attn(torch.nn.Module):
    """A stand-in attention module, as transformers passes it to the attention function."""

    def __init__(self, layer_idx=0):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_causal = False


def _qkv(B=2, H=4, Hkv=2, L=5, S=5, D=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g, dtype=dtype), torch.randn(B, Hkv, S, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, S, D, generator=g, dtype=dtype))


# ----------------------------------------------------------------------------------------------
# 1. keyword arguments: handled, harmless, or refused by name


@pytest.mark.parametrize("name", ["indices", "block_indices"])
def test_sparse_selection_keywords_raise_naming_them(name):
    q, k, v = _qkv()
    sel = torch.zeros(2, 5, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"^{name}: attn_implementation='attnkit' expected {name}=None, got a "
                                         r"tensor of shape \(2, 5, 3\) from _Attn .*sparse.*eager"):
        ak_hf.attnkit_attention_forward(_Attn(), q, k, v, None, scaling=0.3, **{name: sel})
    # None (a layer without an indexer, e.g. MiniMax-M3's full layers) is not a selection: runs
    out, _ = ak_hf.attnkit_attention_forward(_Attn(), q, k, v, None, scaling=0.3, **{name: None})
    assert out.shape == (2, 5, 4, 8)


def test_unknown_keyword_raises_naming_it_even_when_none():
    q, k, v = _qkv()
    for val in (torch.ones(3), None, False):
        with pytest.raises(ValueError, match=r"^block_mask: attn_implementation='attnkit' got the keyword argument "
                                             r"block_mask=.* which it does not know.*attn_implementation='eager'"):
            ak_hf.attnkit_attention_forward(_Attn(), q, k, v, None, block_mask=val)


def test_harmless_keywords_transformers_passes_do_not_change_the_result():
    q, k, v = _qkv()
    ref, _ = ak_hf.attnkit_attention_forward(_Attn(), q, k, v, None, scaling=0.3)
    harmless = dict(position_ids=torch.arange(5)[None], use_cache=True, output_hidden_states=True,
                    output_router_logits=False, encoder_hidden_states=None, encoder_attention_mask=None,
                    past_key_values=None, sliding_window=None, max_length_q=5, max_length_k=5, deterministic=True)
    out, w = ak_hf.attnkit_attention_forward(_Attn(), q, k, v, None, scaling=0.3, **harmless)
    assert torch.equal(out, ref) and w is None


def _tiny_dsa(cls_name, cfg_name, **extra):
    cfg = getattr(T, cfg_name)(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, index_head_dim=16, index_n_heads=2, index_topk=3, **extra)
    return _build(getattr(T, cls_name), cfg)


@pytest.mark.parametrize("cls_name,cfg_name,extra", [
    ("DeepseekV32ForCausalLM", "DeepseekV32Config", {}),
    ("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig", {"indexer_types": ["full"], "head_dim": 16}),
], ids=["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_models_refuse_instead_of_running_dense(cls_name, cfg_name, extra):
    if not hasattr(T, cls_name):
        pytest.skip(f"transformers {T.__version__} has no {cls_name}")
    eager, ak = _pair(_tiny_dsa(cls_name, cfg_name, **extra))
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager(input_ids=ids)  # the eager model runs: it folds its top-3 keys into the mask
        with pytest.raises(ValueError, match=r"^indices: .*got a tensor of shape \(1, 8, 3\) from \w+Attention"):
            ak(input_ids=ids)


# ----------------------------------------------------------------------------------------------
# 2. Gemma 2: attention logit softcapping


def _gemma2(cap=50.0):
    cfg = T.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                         attn_logit_softcapping=cap, final_logit_softcapping=None, query_pre_attn_scalar=8)
    model = _build(T.Gemma2ForCausalLM, cfg)
    with torch.no_grad():  # raw scores in the hundreds, so that the cap of 50 bites
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(100)
            layer.self_attn.k_proj.weight.mul_(100)
    return model


def test_gemma2_softcap_logits_equal_eager():
    eager, ak = _pair(_gemma2())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, 6:] = 0  # right padding
    with torch.no_grad():
        a = ak(input_ids=ids, attention_mask=am).logits
        b = eager(input_ids=ids, attention_mask=am).logits
        uncapped = copy.deepcopy(eager)
        for layer in uncapped.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        c = uncapped(input_ids=ids, attention_mask=am).logits
    valid = am.bool()
    assert _maxdiff(a, b, valid) <= TOL
    assert _maxdiff(c, b, valid) > 100 * TOL  # the cap really changes this model: dropping it would be caught


def test_gemma2_softcap_gradients_equal_eager():
    eager, ak = _pair(_gemma2())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    grads = []
    for model in (eager, ak):
        model.zero_grad()
        (model(input_ids=ids).logits ** 2).mean().backward()
        grads.append([layer.self_attn.q_proj.weight.grad for layer in model.model.layers])
    for ga, gb in zip(*reversed(grads), strict=True):
        assert gb.abs().max() > 0 and _rel(ga, gb) <= GRAD_RTOL


# ----------------------------------------------------------------------------------------------
# 3. T5: position_bias, and its gradient into the relative-bias table


def _t5():
    cfg = T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                     decoder_start_token_id=0, pad_token_id=0)
    model = _build(T.T5ForConditionalGeneration, cfg)
    with torch.no_grad():  # a bias large enough to matter
        for stack in (model.encoder, model.decoder):
            stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 2.0)
    return model


def test_t5_position_bias_logits_and_bias_table_gradient_equal_eager():
    eager, ak = _pair(_t5())
    assert eager.encoder.block[0].layer[0].SelfAttention.scaling == 1.0  # T5 does not scale scores
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (2, 9), generator=g)
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, 6:] = 0
    dec = torch.randint(1, 64, (2, 5), generator=g)
    res = []
    for model in (eager, ak):
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=am, decoder_input_ids=dec).logits
        (logits ** 2).mean().backward()
        res.append((logits.detach(), [s.block[0].layer[0].SelfAttention.relative_attention_bias.weight.grad
                                      for s in (model.encoder, model.decoder)]))
    (b, grads_b), (a, grads_a) = res
    assert _maxdiff(a, b) <= TOL
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert gb.abs().max() > 0 and _rel(ga, gb) <= GRAD_RTOL


def test_position_bias_with_fully_masked_row_gives_zero_and_a_gradient_no_nan():
    q, k, v = _qkv(B=1, H=2, Hkv=2, L=3, S=4)
    bias = torch.randn(1, 2, 3, 4, requires_grad=True)
    mask = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    mask[..., 1, :] = False  # query 1 sees nothing
    out, _ = ak_hf.attnkit_attention_forward(_Attn(), q, k, v, mask, scaling=1.0, position_bias=bias)
    out.sum().backward()
    assert torch.isfinite(out).all() and (out[:, 1] == 0).all()
    assert torch.isfinite(bias.grad).all() and (bias.grad[..., 1, :] == 0).all()
    # against float64 softmax(q kᵀ + bias) v on the other rows
    s = q.double() @ k.double().transpose(-1, -2) + bias.detach().double()
    ref = (s.softmax(-1) @ v.double()).transpose(1, 2)
    assert _maxdiff(out.double(), ref, torch.tensor([True, False, True]).view(1, 3, 1, 1).expand_as(ref)) <= 1e-6


# ----------------------------------------------------------------------------------------------
# 4. GPT-OSS: attention sinks (s_aux)


def _gpt_oss():
    cfg = T.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                         num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    model = _build(T.GptOssForCausalLM, cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2.0)  # sinks that take a real share of the softmax
    return model


def test_gpt_oss_sinks_logits_and_sink_gradient_equal_eager():
    eager, ak = _pair(_gpt_oss())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, :3] = 0  # left padding, as in generation: padded query rows are fully masked
    valid = am.bool()
    res = []
    for model in (eager, ak):
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=am).logits
        (logits[valid] ** 2).mean().backward()
        res.append((logits.detach(), torch.stack([layer.self_attn.sinks.grad for layer in model.model.layers])))
    (b, gb), (a, ga) = res
    assert torch.isfinite(a).all()
    assert _maxdiff(a, b, valid) <= TOL
    assert gb.abs().max() > 0 and _rel(ga, gb) <= GRAD_RTOL
    # output_attentions: the eager weights without the sink column (rows sum to less than 1)
    with torch.no_grad():
        wa = ak(input_ids=ids, attention_mask=am, output_attentions=True).attentions
        wb = eager(input_ids=ids, attention_mask=am, output_attentions=True).attentions
    rows = valid[:, None, :, None].expand_as(wb[0])
    assert all(_maxdiff(x, y, rows) <= 1e-6 for x, y in zip(wa, wb, strict=True))
    assert (wa[0].sum(-1)[valid[:, None].expand(-1, 4, -1)] < 1 - 1e-3).any()
    # the sinks matter in this model: without them the logits move
    no_sink = copy.deepcopy(ak)
    with torch.no_grad():
        for layer in no_sink.model.layers:
            layer.self_attn.sinks.fill_(-1e9)
        c = no_sink(input_ids=ids, attention_mask=am).logits
    assert _maxdiff(c, b, valid) > 100 * TOL


def test_sink_on_a_fully_masked_row_is_zero_not_nan_and_matches_float64():
    q, k, v = _qkv(B=1, H=4, Hkv=2, L=3, S=4)
    sinks = torch.tensor([0.5, -1.0, 2.0, float("-inf")], requires_grad=True)
    mask = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    mask[..., 0, :] = False  # query 0 sees nothing
    mod = _Attn()
    out, w = ak_hf.attnkit_attention_forward(mod, q, k, v, mask, scaling=0.3, s_aux=sinks, output_attentions=True)
    out.sum().backward()
    assert torch.isfinite(out).all() and (out[:, 0] == 0).all() and torch.isfinite(sinks.grad).all()
    # float64: softmax over [scores, sink], sink column dropped
    g = 2
    s = q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2) * 0.3
    s = s.masked_fill(~mask, float("-inf"))
    full = torch.cat([s, sinks.detach().double().view(1, 4, 1, 1).expand(1, 4, 3, 1)], -1)
    p = torch.where(torch.isneginf(full).all(-1, keepdim=True), 0.0, full.softmax(-1))[..., :-1]
    p = torch.nan_to_num(p)
    ref = (p @ v.double().repeat_interleave(g, 1)).transpose(1, 2)
    assert _maxdiff(out.double(), ref) <= 1e-6
    assert _maxdiff(w.double(), p) <= 1e-6  # output_attentions: the weights without the sink column


def test_per_query_sinks_keyword_matches_float64():
    q, k, v = _qkv(B=2, H=2, Hkv=2, L=3, S=4)
    sinks = torch.randn(2, 2, 3, 1)
    out, _ = ak_hf.attnkit_attention_forward(_Attn(), q, k, v, None, scaling=0.5, sinks=sinks)
    s = q.double() @ k.double().transpose(-1, -2) * 0.5
    p = torch.cat([s, sinks.double()], -1).softmax(-1)[..., :-1]
    assert _maxdiff(out.double(), (p @ v.double()).transpose(1, 2)) <= 1e-6
    with pytest.raises(ValueError, match=r"^sinks: expected one sink logit per query, shape \(2, 2, 3, 1\)"):
        ak_hf.attnkit_attention_forward(_Attn(), q, k, v, None, sinks=torch.randn(2))
    with pytest.raises(ValueError, match=r"^s_aux: expected one sink logit per query head, shape \(2,\)"):
        ak_hf.attnkit_attention_forward(_Attn(), q, k, v, None, s_aux=torch.randn(3))


# ----------------------------------------------------------------------------------------------
# 5. errors recommend sdpa only where transformers allows it


def test_errors_recommend_sdpa_only_for_models_that_support_it():
    q, k, v = _qkv(H=4, Hkv=2)
    for model, sdpa in ((_gpt_oss(), False), (_gemma2(), False), (_build(T.LlamaForCausalLM, _llama_cfg()), True)):
        attn = model.model.layers[0].self_attn
        assert type(model)._supports_sdpa is sdpa
        with pytest.raises(ValueError) as e:
            ak_hf.attnkit_attention_forward(attn, q, k, v, None, indices=torch.zeros(2, 5, 1, dtype=torch.long))
        msg = str(e.value)
        assert "attn_implementation='eager'" in msg
        assert ("sdpa" in msg) is sdpa, msg


# ----------------------------------------------------------------------------------------------
# 6. GPT-2: output_attentions goes through transformers' output recorder


def test_gpt2_output_attentions_returns_weights_equal_eager():
    cfg = T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    eager, ak = _pair(_build(T.GPT2LMHeadModel, cfg))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, 6:] = 0
    with torch.no_grad():
        a = ak(input_ids=ids, attention_mask=am, output_attentions=True)
        b = eager(input_ids=ids, attention_mask=am, output_attentions=True)
        plain = ak(input_ids=ids, attention_mask=am)
    assert len(a.attentions) == len(b.attentions) == 2
    for x, y in zip(a.attentions, b.attentions, strict=True):
        assert x.shape == y.shape == (2, 4, 9, 9)
        assert _maxdiff(x, y) <= 1e-6
    assert _maxdiff(a.logits, b.logits) <= TOL
    assert plain.attentions is None  # not asked: no weights computed


# ----------------------------------------------------------------------------------------------
# 7. capture_attention with text instead of tokenized inputs


def test_capture_attention_with_a_list_of_strings_is_a_short_type_error():
    cfg = T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=32)
    _, ak = _pair(_build(T.BertModel, cfg))
    with pytest.raises(TypeError, match=r"^inputs: expected the model inputs as a mapping of tensors \(a tokenizer's "
                                        r"output.*got a list of text\. Tokenize the text first") as e:
        ak_hf.capture_attention(ak, ["The river bank."])
    assert len(str(e.value)) < 400 and "Linear(" not in str(e.value)  # no model repr
    with pytest.raises(TypeError, match=r"^inputs: .*got a Tensor\. For a tensor of token ids pass "
                                        r"\{.input_ids.: ids\}"):
        ak_hf.capture_attention(ak, torch.zeros(1, 6, dtype=torch.long))
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    got = ak_hf.capture_attention(ak, {"input_ids": ids}, layers=[1], heads=[2])
    assert got[1].shape == (1, 1, 6, 6)


# ----------------------------------------------------------------------------------------------
# other families the reviewers named: padded batch, then one cached decoding step


def _llama_cfg(**kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    return T.LlamaConfig(**{**base, **kw})


def _cache_arg(model, out) -> dict:
    """The cache of ``out`` as the next forward's keyword: ``cache`` from transformers 5.24 (which
    deprecates ``past_key_values``), ``past_key_values`` before."""
    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


def _decoder(family):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    if family == "llama":
        return _build(T.LlamaForCausalLM, _llama_cfg())
    if family == "mistral":  # window 4 < 11 tokens: the sliding window binds
        return _build(T.MistralForCausalLM, T.MistralConfig(**base, sliding_window=4))
    if family == "qwen2":
        return _build(T.Qwen2ForCausalLM, T.Qwen2Config(**base))
    if family == "gemma3":  # sliding + full layers, window 4
        cfg = T.Gemma3TextConfig(**base, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                 query_pre_attn_scalar=8)
        return _build(T.Gemma3ForCausalLM, cfg)
    raise AssertionError(family)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma3"])
def test_decoder_families_padded_batch_and_cached_step_equal_eager(family):
    eager, ak = _pair(_decoder(family))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 11), generator=g)
    am = torch.ones(2, 11, dtype=torch.long)
    am[1, :4] = 0  # left padding, as for generation
    nxt = torch.randint(0, 64, (2, 1), generator=g)
    am2 = torch.cat([am, torch.ones(2, 1, dtype=torch.long)], 1)
    res = []
    with torch.no_grad():
        for model in (eager, ak):
            out = model(input_ids=ids, attention_mask=am, use_cache=True)
            step = model(input_ids=nxt, attention_mask=am2, use_cache=True, **_cache_arg(model, out))
            res.append((out.logits, step.logits))
        unpadded = [model(input_ids=ids).logits for model in (eager, ak)]  # no mask: window must still bind
    (b, bs), (a, as_) = res
    assert _maxdiff(a, b, am.bool()) <= TOL
    assert _maxdiff(as_, bs) <= TOL
    assert _maxdiff(unpadded[1], unpadded[0]) <= TOL


def test_sliding_window_missing_from_the_mask_raises():
    q, k, v = _qkv(L=5, S=5)
    with pytest.raises(ValueError, match=r"^sliding_window: expected the window to be in attention_mask.*"
                                         r"sliding_window=2 with no attention_mask and 5 keys"):
        ak_hf.attnkit_attention_forward(_Attn(), q, k, v, None, sliding_window=2)
    out, _ = ak_hf.attnkit_attention_forward(_Attn(), q, k, v, None, sliding_window=5)  # window covers all keys
    assert out.shape == (2, 5, 4, 8)


def test_packed_sequences_equal_eager_and_refuse_when_the_mask_does_not_separate_them():
    eager, ak = _pair(_decoder("llama"))
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])  # two sequences of 5 packed in one row
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    packed = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    with torch.no_grad():
        b = eager(input_ids=ids, position_ids=pos, use_cache=False, **packed).logits
        a = ak(input_ids=ids, position_ids=pos, use_cache=False, **packed).logits
        alone = eager(input_ids=ids[:, 5:], use_cache=False).logits
        assert _maxdiff(a, b) <= TOL and _maxdiff(a[:, 5:], alone) <= TOL  # the sequences are kept apart
        # with a cache transformers builds no packed mask (eager then mixes the sequences): attnkit refuses
        mixed = eager(input_ids=ids, position_ids=pos, use_cache=True, **packed).logits
        assert _maxdiff(mixed[:, 5:], alone) > 100 * TOL
        with pytest.raises(ValueError, match=r"^cu_seq_lens_q/k: expected the attention mask to keep the 2 packed "
                                             r"sequences apart.*use_cache=False"):
            ak(input_ids=ids, position_ids=pos, use_cache=True, **packed)


@contextlib.contextmanager
def _recording_mask_hook(monkeypatch):
    """Yields the list of every mask attnkit's hook returns, with transformers' dense ``sdpa_mask``
    made to fail."""
    from transformers import masking_utils as mu

    returned: list = []
    hook = mu.ALL_MASK_ATTENTION_FUNCTIONS[ak_hf.NAME]

    def recording(*a, **kw):
        out = hook(*a, **kw)
        returned.append(out)
        return out

    def dense_built(*a, **kw):
        raise AssertionError("attnkit's mask hook built transformers' dense sdpa mask")

    ak_hf.checked_kinds()  # the once-per-process self-check compares with sdpa_mask: run it before the patch
    monkeypatch.setattr(mu, "sdpa_mask", dense_built)
    mu.AttentionMaskInterface.register(ak_hf.NAME, recording)
    try:
        yield returned
    finally:
        mu.AttentionMaskInterface.register(ak_hf.NAME, hook)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_packed_sequences_get_a_structured_mask_on_this_transformers(family, monkeypatch):
    """transformers 5.24 composes the packed-sequence mask function differently from 5.23 (5.23:
    packed_sequence_compatibility_function(mask, positions, documents); 5.24: the remapped mask ANDed
    with the documents, that helper gone). Both are read as document(ids) & the model's mask: no dense
    mask is built, the self-check agrees, and the logits equal eager's."""
    eager, ak = _pair(_decoder(family))
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])  # sequences of 7 and 5 packed in one row
    assert ak_hf.checked_kinds()["packed"], ak_hf.checked_kinds()
    with torch.no_grad():
        b = eager(input_ids=ids, position_ids=pos, use_cache=False).logits
    with _recording_mask_hook(monkeypatch) as returned, torch.no_grad():
        a = ak(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert _maxdiff(a, b) <= TOL
    assert returned and all(isinstance(m, masks.Mask) for m in returned), [type(m) for m in returned]
    assert all("document(" in repr(m) for m in returned), [repr(m) for m in returned]
    if family == "mistral":  # window 4 < 7: the window is read through the packing too
        assert any("sliding_window(4" in repr(m) for m in returned), [repr(m) for m in returned]


def test_registering_warns_nothing_on_this_transformers(monkeypatch):
    """register() and the self-check it leads to (each kind of transformers mask function read by
    attnkit compared with transformers' own dense mask) give no warning on the installed
    transformers: every kind is read exactly (issue 27: 5.24's packed masks warned on every install)."""
    monkeypatch.setattr(hf_masks, "_CHECKED", None)  # run the once-per-process self-check again, here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ak_hf.register() == ak_hf.NAME
        checked = ak_hf.checked_kinds()
    assert [str(w.message) for w in caught] == []
    assert checked == {"causal": True, "all": True, "window": True, "chunk": True, "packed": True}


def test_a_packed_composition_attnkit_does_not_know_is_built_densely_with_a_warning(monkeypatch):
    """The self-check asks transformers' own create_causal_mask how it composes packed masks, so a
    future transformers that composes them in a way attnkit does not read turns the packed kind off
    (dense masks, exact) with the warning, instead of going unnoticed."""
    from transformers import masking_utils as mu

    def remap_elsewhere(mask_function, position_ids):  # stands for a new helper in a future release
        def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
            return mask_function(batch_idx, head_idx, position_ids[batch_idx, q_idx], position_ids[batch_idx, kv_idx])
        return inner_mask

    monkeypatch.setattr(mu, "remap_positions_for_packed_sequence", remap_elsewhere)
    monkeypatch.setattr(hf_masks, "_CHECKED", None)
    with pytest.warns(RuntimeWarning, match=r"'packed' mask functions do not mean what attnkit reads"):
        checked = ak_hf.checked_kinds()
    assert checked == {"causal": True, "all": True, "window": True, "chunk": True, "packed": False}
    monkeypatch.setattr(hf_masks, "_CHECKED", None)  # the next user of the check sees the real transformers


def test_importing_the_integration_registers_attnkit_without_a_warning():
    """A fresh interpreter that only imports the integration (no register() call) loads a model with
    attn_implementation="attnkit" and runs it, padded and packed, with no warning from attnkit. Without
    the import, transformers' own error (quoted in docs/compatibility.md) never names attnkit."""
    code = textwrap.dedent("""
        import json, warnings
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig
        cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2)
        try:
            AutoModelForCausalLM.from_config(LlamaConfig(**cfg), attn_implementation="attnkit")
            before = "loaded"
        except ValueError as e:
            before = str(e)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import attnkit.integrations.transformers as ak_hf
            model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), attn_implementation="attnkit").eval()
            with torch.no_grad():
                model(input_ids=torch.tensor([[5, 6, 7, 8]]), attention_mask=torch.tensor([[1, 1, 1, 0]]))
                model(input_ids=torch.tensor([[5, 6, 7, 8]]), position_ids=torch.tensor([[0, 1, 0, 1]]),
                      use_cache=False)
        print(json.dumps(dict(before=before, impl=model.config._attn_implementation,
                              checked=ak_hf.checked_kinds(),
                              warnings=[f"{w.category.__name__}: {w.message}" for w in caught
                                        if "attnkit" in str(w.message) or "attnkit" in w.filename])))
    """)
    root = ROOT
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["before"].startswith('Specified `attn_implementation="attnkit"` is not supported.'), got["before"]
    assert got["impl"] == "attnkit"
    assert got["warnings"] == []
    assert all(got["checked"].values()), got["checked"]


def test_bart_cross_attention_with_padding_equals_eager():
    cfg = T.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                       dropout=0.0, attention_dropout=0.0)
    eager, ak = _pair(_build(T.BartForConditionalGeneration, cfg))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, 9), generator=g)
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, 5:] = 0  # right padding of the encoder input: cross-attention must skip it too
    dec = torch.randint(3, 64, (2, 6), generator=g)
    dam = torch.ones(2, 6, dtype=torch.long)
    dam[0, 4:] = 0
    with torch.no_grad():
        a = ak(input_ids=ids, attention_mask=am, decoder_input_ids=dec, decoder_attention_mask=dam,
               output_attentions=True)
        b = eager(input_ids=ids, attention_mask=am, decoder_input_ids=dec, decoder_attention_mask=dam,
                  output_attentions=True)
    assert _maxdiff(a.logits, b.logits, dam.bool()) <= TOL
    for x, y in zip(a.cross_attentions, b.cross_attentions, strict=True):
        assert _maxdiff(x, y, dam.bool()[:, None, :, None].expand_as(y)) <= 1e-6



@pytest.mark.parametrize("family", ["mistral", "gemma3", "llama"])
def test_generating_builds_no_dense_mask_and_equals_eager(family, monkeypatch):
    """Prefill and every cached decoding step (left-padded batch, sliding-window layers) get
    structured attnkit masks from the mask hook: transformers' dense sdpa_mask is never called,
    no (B, 1, L, S) tensor reaches attention, and the greedy tokens equal the eager model's."""
    eager, ak = _pair(_decoder(family))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 64, (2, 9), generator=g)
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, :3] = 0  # left padding, as batched generation pads
    with torch.no_grad():
        want = eager.generate(input_ids=ids, attention_mask=am, max_new_tokens=8, min_new_tokens=8,
                              do_sample=False, pad_token_id=0)
    with _recording_mask_hook(monkeypatch) as returned, torch.no_grad():
        got = ak.generate(input_ids=ids, attention_mask=am, max_new_tokens=8, min_new_tokens=8,
                          do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    assert len(returned) >= 8  # the prefill and every step asked for a mask
    assert all(isinstance(m, masks.Mask) for m in returned), [type(m).__name__ for m in returned]
    if family != "llama":  # the sliding layers' masks carry the window
        assert any("sliding_window(4" in repr(m) for m in returned), [repr(m) for m in returned]
