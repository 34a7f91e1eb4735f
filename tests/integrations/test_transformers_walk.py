"""The walk over transformers' installed model families (issue 18): on ``attn_implementation="attnkit"``
every family is either exact against ``"eager"`` (forward logits; for causal LMs also greedy
``generate`` with a dynamic and a static cache) or refuses with a clear error — never a wrong
answer, never a crash from deep inside transformers.

The walk itself is ``tools/walk_transformers.py``, a test harness kept out of the wheel (``python
tools/walk_transformers.py`` prints the whole table of ~600 families in a few minutes); this test walks every
second family (every ``ATTNKIT_WALK_SAMPLE``-th) plus every family the issues name: ~300 families, about 70 s of
one core. It runs on the pinned transformers and, in ``make test``'s second pass, on the newest one.
Error budget (float32): ``|attnkit − eager| ≤ 2e-5 · max(1, max |eager|)`` on every unpadded position.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
import time

import pytest
import torch
from conftest import ROOT

T = pytest.importorskip("transformers", reason="needs transformers (`make test` installs it)")

from attnkit.integrations import transformers as ak_hf  # noqa: E402
from attnkit.integrations.transformers import _refusals  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
import walk_transformers as _walk  # noqa: E402

pytestmark = pytest.mark.model

# issue 18, item 2: compute attention themselves in transformers 5.23 (Falcon, GPT-J, GPT-Neo died in their
# constructor with KeyError: 'attnkit'; the others ran with attnkit's mask and gave logits off by 1-8).
# transformers 5.24 moved GPT-J and CodeGen onto its attention interface: there they must be exact.
REFUSED = ["bloom", "mpt", "codegen", "xglm", "mpnet", "roformer", "falcon", "gptj", "gpt_neo"]
# item 3's families, plus those the walk found wrong or crashing before this change: NLLB-MoE and
# PEGASUS-X (decoders whose modules say is_causal=False), Doge (reads the mask tensor itself),
# Qwen2-MoE (an unused sliding_window=0 mask)
EXACT = ["llama", "gemma3_text", "qwen3", "mixtral", "olmo2", "cohere2", "whisper", "t5", "bart", "bert", "gpt2",
         "nllb-moe", "pegasus_x", "doge", "qwen2_moe", "mistral", "gemma2", "gpt_oss", "modernbert"]


# every SAMPLE-th family besides the named ones; `make test`'s second pass, on the newest transformers, walks
# a sparser sample (ATTNKIT_WALK_SAMPLE=6) to keep its time small: the whole walk is `python
# tools/walk_transformers.py`, and its results for both versions are in docs/compatibility.md
SAMPLE = int(os.environ.get("ATTNKIT_WALK_SAMPLE", "2"))


@pytest.fixture(scope="module")
def walked():
    fams = _walk.families()
    picked = {mt for mt, _ in fams[::SAMPLE]} | set(REFUSED) | set(EXACT)
    t = time.perf_counter()
    res = _walk.walk(sorted(picked))
    secs = time.perf_counter() - t
    print(f"\n{_walk.table(res)}\nwalk of {len(res)} of {len(fams)} families: {secs:.1f}s")
    return {r.family: r for r in res}


def test_every_family_walked_is_exact_or_refuses(walked):
    bad = [f"{r.family} ({r.cls}): {r.verdict}: {r.detail}" for r in walked.values() if r.verdict in ("WRONG", "CRASH")]
    assert not bad, "\n".join(bad)
    counts = {}
    for r in walked.values():
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    # the walk must really run models, not skip its way to green
    assert counts.get("exact", 0) >= 120 // SAMPLE, counts  # ~144 of all families are exact
    assert counts.get("refused", 0) >= sum(not _dispatches_through_the_interface(f) for f in REFUSED), counts


def _dispatches_through_the_interface(family: str) -> bool:
    """Whether the installed transformers' modeling module of ``family`` calls its attention interface."""
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return "ALL_ATTENTION_FUNCTIONS" in pathlib.Path(mod.__file__).read_text(encoding="utf-8")


@pytest.mark.parametrize("family", REFUSED)
def test_models_with_their_own_attention_refuse_naming_the_model_and_eager(walked, family):
    r = walked[family]
    if _dispatches_through_the_interface(family):  # ported by a newer transformers: attnkit runs it, exactly
        assert r.verdict == "exact", (T.__version__, r.verdict, r.detail)
        return
    assert r.verdict == "refused", (r.verdict, r.detail)
    assert "UnsupportedModelError: attn_implementation='attnkit': " in r.detail, r.detail
    if family in ("falcon", "gptj", "gpt_neo"):  # before: KeyError: 'attnkit' in their constructor
        assert r.detail.startswith("at construction"), r.detail


@pytest.mark.parametrize("family", EXACT)
def test_named_families_are_exact(walked, family):
    r = walked[family]
    assert r.verdict == "exact", (r.verdict, r.detail)
    if r.cls.endswith("ForCausalLM") or r.cls == "GPT2LMHeadModel":  # greedy generate checked too, both caches
        assert "generate equal (dynamic and static cache)" in r.detail, r.detail


def test_refusal_message_names_model_what_and_fix():
    ak_hf.register()
    cfg = T.BloomConfig(vocab_size=100, hidden_size=32, n_layer=1, n_head=4)
    model = T.BloomForCausalLM._from_config(cfg, attn_implementation=ak_hf.NAME)
    with pytest.raises(ak_hf.UnsupportedModelError,
                       match=r"^attn_implementation='attnkit': Bloom is not supported: its attention layers "
                             r"\(transformers\.models\.bloom\.modeling_bloom\) compute attention themselves .*"
                             r"Load this model with attn_implementation='eager'\.$"):
        model(input_ids=torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"Falcon is not supported.*FALCON_ATTENTION_CLASSES.*"
                                         r"attn_implementation='eager' \(or 'sdpa'\)\.$"):
        T.FalconForCausalLM._from_config(T.FalconConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                                        num_attention_heads=4), attn_implementation=ak_hf.NAME)


def test_every_attention_class_dict_in_transformers_refuses_attnkit():
    """register() puts a refusing entry in every ``*_ATTENTION_CLASSES`` dict that transformers
    indexes with the implementation name; a transformers that adds one fails this test."""
    root = pathlib.Path(T.__file__).parent / "models"
    found = set()
    for path in root.glob("*/modeling_*.py"):
        if re.search(r"_ATTENTION_CLASSES\[", path.read_text(encoding="utf-8", errors="replace")):
            found.add(f"{path.parent.name}.{path.stem}")
    assert found, "the scan found no attention-class dict at all: the pattern is stale"
    assert found <= set(_refusals._CLASS_DICT_MODULES), sorted(found - set(_refusals._CLASS_DICT_MODULES))
