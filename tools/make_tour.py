"""Build examples/tour.ipynb from the cells below and execute it, keeping its outputs (stderr
progress bars left out), so that it reads with its results on a code host.

    PYTHONPATH=src python tools/make_tour.py

tests/docs/test_tour_notebook.py executes it again in a fresh kernel and checks its numbers.
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = []


def md(text):
    CELLS.append(new_markdown_cell(text.strip()))


def code(text):
    CELLS.append(new_code_cell(text.strip()))


md(r"""
# A tour of attention with attnkit

This notebook walks the usual path of an attention tutorial — on attnkit, so that every number
is computed, not copied:

1. Q, K, V from word vectors
2. scores, scaling (why √d_k), softmax, the weighted sum
3. the worked examples, with their corrected numbers
4. padding and look-ahead masks
5. multi-head attention (`attnkit.nn.MultiHeadAttention`)
6. sinusoidal positional encoding (and the doubled-exponent pitfall)
7. a real model's attention on *"The river bank was eroding."* (offline)
8. the speed of the tiled backend on a long sequence

Shapes follow attnkit's conventions: `q (B, H, L, D)`, `k (B, Hkv, S, D)`, `v (B, Hkv, S, Dv)`;
unbatched `(L, D)` works too. Bool masks mean **True = attend**.
""")

code(r"""
import math

import numpy as np
import torch

import attnkit
from attnkit import masks

np.set_printoptions(precision=4, suppress=True)
torch.manual_seed(0)
print("attnkit", attnkit.__version__, "· torch", torch.__version__)
""")

md(r"""
## 1. Q, K, V from word vectors

Each token has a vector (an embedding). Attention does not compare the embeddings directly:
it projects each one three times, with three learned matrices, into a **query** (what this token
looks for), a **key** (what it offers to be found by) and a **value** (what it passes on).
""")

code(r"""
words = ["The", "cat", "chased", "the", "mouse"]
rng = np.random.default_rng(0)
X = rng.standard_normal((len(words), 4))          # (L, d_model): one 4-d vector per word
W_q, W_k, W_v = (rng.standard_normal((4, 2)) for _ in range(3))   # d_model = 4 → d_k = d_v = 2
Q, K, V = X @ W_q, X @ W_k, X @ W_v               # (L, d_k), (S, d_k), (S, d_v)
print("X", X.shape, "→ Q", Q.shape, "K", K.shape, "V", V.shape)
""")

md(r"""
## 2. Scores, scaling, softmax, weighted sum

* **scores** `Q·Kᵀ`: row *i* says how well query *i* matches every key;
* **scale** by `1/√d_k`;
* **softmax** per row: each row becomes weights that sum to 1;
* **weighted sum** `weights·V`: each output row is a blend of the value rows.

`attnkit.explain` runs the float64 reference and keeps every step. In Jupyter a trace displays
itself as tables, with the weights as a heatmap:
""")

code(r"""
t = attnkit.explain(Q, K, V)
t
""")

code(r"""
assert np.allclose(t.weights.sum(-1), 1.0)
print("each row of the weights sums to", t.weights.sum(-1))
""")

md(r"""
### Why divide by √d_k? The variance argument, numerically

If the components of q and k are independent with mean 0 and variance 1, then
`q·k = Σ q_a k_a` is a sum of d_k terms of variance 1: **its variance is d_k**. For d_k = 512 the
scores spread over ±50, and softmax of such scores is almost one-hot: the gradients through it
vanish. Dividing by √d_k brings the variance back to 1 whatever d_k is.
""")

code(r"""
g = np.random.default_rng(1)
for d_k in (2, 64, 512):
    q, k = g.standard_normal((20000, d_k)), g.standard_normal((20000, d_k))
    s = (q * k).sum(1)
    print(f"d_k = {d_k:3d}: var(q·k) = {s.var():7.1f}   var(q·k / √d_k) = {(s / math.sqrt(d_k)).var():.3f}")

# what it does to softmax: the largest weight of a row of 10 scores, on average
d_k = 512
qs, ks = g.standard_normal((1000, 1, d_k)), g.standard_normal((1000, 10, d_k))
raw = (qs * ks).sum(-1)

def top(s):  # the largest softmax weight of each row, averaged over the rows
    w = np.exp(s - s.max(1, keepdims=True))
    return (w / w.sum(1, keepdims=True)).max(1).mean()

print(f"mean largest weight over 10 keys, d_k = 512: unscaled {top(raw):.3f}, scaled {top(raw / math.sqrt(d_k)):.3f}")
""")

md(r"""
## 3. The worked examples, with their corrected numbers

### The 3-token example

Q = [[1,0],[0,1],[1,1]], K = [[1,1],[1,0],[0,1]], V = [[10,0],[0,10],[5,5]], d_k = 2.
The first query scores k0 and k1 equally (1 each) and k2 with 0, so after scaling and softmax its
weights are **0.4011, 0.4011, 0.1978** and its output row is exactly **[5.0, 5.0]**
(a known misprint gives [5.3, 4.2]).
""")

code(r"""
t3 = attnkit.explain(np.array([[1., 0], [0, 1], [1, 1]]),
                     np.array([[1., 1], [1, 0], [0, 1]]),
                     np.array([[10., 0], [0, 10], [5, 5]]))
print("weights of the first query:", t3.weights[0].round(4))
print("first output row:          ", t3.output[0])
t3
""")

md(r"""
### The cat/mouse example

In *"The cat chased the mouse"*, the query "chased" = [5, 1] meets the keys The = [1, 0],
cat = [2, 3], mouse = [4, 4] (Q = K = V = the word vectors, d_k = 2). The scores are 5, 13, 24, so
the scaled scores are 5/√2, 13/√2, 24/√2 and the weights ≈ **[0.000001, 0.000419, 0.999580]**:
"chased" looks almost only at "mouse".
""")

code(r"""
chased = np.array([[5., 1]])
keys = np.array([[1., 0], [2, 3], [4, 4]])       # The, cat, mouse
tc = attnkit.explain(chased, keys, keys)
print("scores       ", tc.scores[0], "  scaled", tc.scaled[0].round(4), " = [5, 13, 24] / √2")
print("weights      ", "[" + ", ".join(f"{w:.6f}" for w in tc.weights[0]) + "]")
print("output       ", tc.output[0].round(4))
""")

md(r"""
The third worked example, the sinusoidal encoding with d_model = 4, is in section 6.

## 4. Masks: padding and look-ahead

A **padding** mask hides the keys that are padding (here: a batch whose second sequence has only
2 real tokens). A **look-ahead** (causal) mask lets query *i* see keys *j ≤ i* only. In Jupyter a
mask draws itself (filled = attend):
""")

code(r"""
masks.causal()
""")

code(r"""
x = torch.randn(2, 1, 4, 8, dtype=torch.float64)          # B=2 sequences, H=1, L=S=4, D=8
pad = masks.padding([4, 2])                               # keys j < length[b] are real
tp = attnkit.explain(x, x, x, mask=pad)
print("padding, sequence 1 (2 real tokens): weights\n", tp.weights[1, 0].round(4))
tc = attnkit.explain(x, x, x, causal=True)
print("look-ahead (causal), sequence 0: weights\n", tc.weights[0, 0].round(4))
assert (tp.weights[1, 0][:, 2:] == 0).all() and (np.triu(tc.weights[0, 0], 1) == 0).all()
""")

md(r"""
Both combine (`pad & masks.causal()`), and the same masks go to the fast path,
`attnkit.attention`, which asks the dispatcher which backend to run — it explains itself too:
""")

code(r"""
attnkit.dispatch(x, x, x, mask=pad & masks.causal())
""")

md(r"""
## 5. Multi-head attention

`attnkit.nn.MultiHeadAttention` projects the input into H heads of size E/H, attends in each
head independently, and merges them. `need_weights=True` returns the exact per-head weights.
""")

code(r"""
mha = attnkit.nn.MultiHeadAttention(embed_dim=16, num_heads=4)
xs = torch.randn(1, 5, 16)                                # (B, L, E)
with torch.no_grad():
    out, w = mha(xs, causal=True, need_weights=True)
print("output", tuple(out.shape), " weights", tuple(w.shape), " (B, H, L, S)")
print("head 0, causal weights of the last token:", w[0, 0, -1].numpy().round(4))
print("every row sums to 1:", bool(torch.allclose(w.sum(-1), torch.ones(1, 4, 5))))
""")

md(r"""
## 6. Sinusoidal positional encoding

PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)),
where **i counts dimension pairs**. With d_model = 4, PE(1, 2) = sin(1/10000^(2/4)) = sin(0.01) ≈ **0.0100**.

The pitfall: code that loops `for i in range(0, d_model, 2)` and raises 10000 to `2*i/d_model`
doubles the exponent — it computes sin(1/10000^(4/4)) = sin(0.0001) for PE(1, 2).
""")

code(r"""
pe = attnkit.positional.sinusoidal(5, 4, dtype=torch.float64).numpy()
print(pe.round(4))
print(f"PE(1, 2) = {pe[1, 2]:.4f} = sin(0.01) = {math.sin(0.01):.4f}")

def buggy(length, d_model):                # the doubled exponent
    P = np.zeros((length, d_model))
    for pos in range(length):
        for i in range(0, d_model, 2):
            P[pos, i] = math.sin(pos / 10000 ** (2 * i / d_model))
            P[pos, i + 1] = math.cos(pos / 10000 ** (2 * i / d_model))
    return P
print(f"buggy PE(1, 2) = {buggy(5, 4)[1, 2]:.4f} = sin(0.0001)  ← wrong")
""")

md(r"""
## 7. A real model: all-MiniLM-L6-v2 on "The river bank was eroding."

The bundled sentence-transformer runs offline, on attnkit's attention.
`capture_attention` returns the exact weights `{layer: (B, H, L, S)}`. Which tokens does "bank"
look at, averaged over the heads of each layer?
""")

code(r"""
from attnkit.integrations import minilm
from attnkit.integrations.transformers import capture_attention

tok, model = minilm.load()
enc = tok(["The river bank was eroding."], return_tensors="pt")
tokens = tok.convert_ids_to_tokens(enc["input_ids"][0])
weights = capture_attention(model, enc)                  # {layer: (1, 12, L, L)}
i = tokens.index("bank")
print("tokens:", tokens)
for layer in (0, 2, 5):
    w = weights[layer][0, :, i].mean(0).numpy()          # mean of heads
    top = np.argsort(-w)[:3]
    print(f"layer {layer}, mean of heads: 'bank' →", ", ".join(f"{tokens[j]} {w[j]:.2f}" for j in top))
""")

code(r"""
# one head of one layer, as the explain heatmap: the weights of "bank" in layer 2, head 11
w = weights[2][0, 11].numpy()
print("layer 2, head 11: 'bank' →", ", ".join(f"{tokens[j]} {w[i, j]:.2f}" for j in np.argsort(-w[i])[:3]))
""")

md(r"""
## 8. Speed: the tiled backend on a long sequence

For a sliding-window mask of 256 over 4096 tokens, most (query, key) tiles are empty. The tiled
backend skips them and never builds the 4096 × 4096 mask; torch's SDPA needs the mask as a dense
tensor and computes every score. A plan shows the tiles:
""")

code(r"""
L = 4096
window = masks.sliding_window(256)
attnkit.plan(window, L=1024, block=(128, 128))            # the tile map at a size that fits on screen
""")

code(r"""
import time

torch.set_num_threads(1)
q, k, v = (torch.randn(1, 4, L, 64) for _ in range(3))

def best(f, n=3):
    f()  # warm-up
    times = []
    for _ in range(n):
        s = time.perf_counter()
        f()
        times.append(time.perf_counter() - s)
    return min(times)

dense = window.materialize(1, 1, L, L)
t_tiled = best(lambda: attnkit.attention(q, k, v, mask=window, backend="tiled"))
t_sdpa = best(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense))
same = torch.allclose(attnkit.attention(q, k, v, mask=window, backend="tiled"),
                      torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense), atol=1e-5)
print(f"L = {L}, window 256, 4 heads, D = 64, one thread:")
print(f"  tiled {1e3 * t_tiled:.1f} ms   SDPA with a dense mask {1e3 * t_sdpa:.1f} ms   "
      f"→ {t_sdpa / t_tiled:.1f}× faster, same output: {same}")
print("auto chooses:", attnkit.dispatch(q, k, v, mask=window).backend)
""")

md(r"""
## Where next

* `attnkit explain --html page.html` writes one offline page for your own Q, K, V: hover a score
  to see the query and key that made it, hover an output to see the values it blends.
* `attnkit show "your sentence"` draws a real model's attention (PNG and an offline page).
* `attnkit bench` times the backends on your machine.
""")

nb = new_notebook(cells=CELLS, metadata={
    "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
    "language_info": {"name": "python"}})
out = Path(__file__).resolve().parent.parent / "examples" / "tour.ipynb"
import nbclient  # noqa: E402

nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                        resources={"metadata": {"path": str(out.parent)}}).execute()
for cell in nb.cells:
    if cell.cell_type == "code":
        cell.outputs = [o for o in cell.outputs if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
nbformat.write(nb, str(out))
print("wrote", out)
