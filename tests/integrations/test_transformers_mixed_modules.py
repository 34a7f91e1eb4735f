"""Modeling modules that mix both kinds of attention layer: BigBird-Pegasus (an encoder that computes attention
itself, a decoder that calls transformers' attention interface), Informer (ProbSparse layers of its own, or interface
ones, by ``attention_type``), Gemma 4 (an audio encoder of its own beside the text model). The module-wide test
passed them, and the layers of their own added attnkit's bool mask to their scores as a number: BigBird-Pegasus's
encoder 0.038 off eager with right padding, Informer's decoder 0.003 (future positions seen), Gemma 4's audio model
a TypeError deep inside. The model asking for a mask is now judged by the layers it holds; a model of the same module
whose layers call the interface runs and matches eager."""

from __future__ import annotations

import copy

import pytest
import torch

T = pytest.importorskip("transformers", reason="needs transformers (`make test` installs it)")
from attnkit.integrations import transformers as ak_hf  # noqa: E402  (registers "attnkit")

UnsupportedModelError = ak_hf.UnsupportedModelError


def _pair(cls, cfg):
    torch.manual_seed(0)
    eager = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    ak = cls._from_config(copy.deepcopy(cfg), attn_implementation="attnkit").eval()
    ak.load_state_dict(eager.state_dict())
    return eager, ak


def test_bigbird_pegasus_is_refused_by_the_encoder_that_computes_attention_itself():
    cfg = T.BigBirdPegasusConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1,
                                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                 decoder_ffn_dim=64, max_position_embeddings=64, attention_type="original_full")
    _, ak = _pair(T.BigBirdPegasusModel, cfg)
    ids = torch.randint(3, 100, (2, 12))
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, -4:] = 0
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match=r"BigBirdPegasusEncoder is not supported.*"
                                                                     r"BigBirdPegasusSelfAttention.*'eager'"):
        ak(input_ids=ids, attention_mask=am, decoder_input_ids=ids[:, :5])


def _informer(attention_type):
    cfg = T.InformerConfig(prediction_length=4, context_length=8, lags_sequence=[1, 2], input_size=1,
                           num_time_features=1, d_model=16, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                           attention_type=attention_type, distil=False)
    g = torch.Generator().manual_seed(1)
    kw = dict(past_values=torch.randn(2, 10, generator=g), past_time_features=torch.randn(2, 10, 1, generator=g),
              past_observed_mask=torch.ones(2, 10), future_values=torch.randn(2, 4, generator=g),
              future_time_features=torch.randn(2, 4, 1, generator=g))
    return _pair(T.InformerModel, cfg), kw


def test_informer_is_refused_with_probsparse_layers_and_matches_eager_with_full_ones():
    (_, ak), kw = _informer("prob")
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="InformerProbSparseAttention"):
        ak(**kw)
    (eager, ak), kw = _informer("full")
    with torch.no_grad():
        torch.testing.assert_close(ak(**kw).last_hidden_state, eager(**kw).last_hidden_state, rtol=0, atol=1e-5)


def test_gemma4_audio_model_is_refused_before_it_runs():
    cfg = T.Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                              subsampling_conv_channels=(16, 8), attention_chunk_size=4, attention_context_left=5,
                              attention_context_right=0, output_proj_dims=16)
    _, ak = _pair(T.Gemma4AudioModel, cfg)
    x = torch.randn(2, 48, 16)
    m = torch.ones(2, 48, dtype=torch.bool)
    m[1, 30:] = False
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="Gemma4AudioAttention"):
        ak(input_features=x, attention_mask=m)
