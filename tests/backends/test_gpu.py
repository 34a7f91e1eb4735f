"""The GPU path (skipped without CUDA; never a CI dependency): sdpa, flex and the tiled plain
worker on CUDA tensors against the float64 reference, fp32/bf16/fp16, forward and backward."""

from __future__ import annotations

import pytest
import torch
from conftest import EPS

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

L, S, D = 257, 385, 64
CASES = {
    "dense": dict(),
    "causal bottom-right": dict(causal=True),
    "window": dict(mask=M.sliding_window(100)),
    "document": dict(mask=M.document(torch.arange(S) // 97)),
    "prefix": dict(mask=M.prefix_lm(50)),
    "softcap causal": dict(causal=True, score_mod=SM.softcap(20.0)),
    "fully masked rows": dict(mask=M.padding([0, 200])),
    "alibi causal": dict(causal=True, score_mod=SM.alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625]))),
    "relative bias window": dict(mask=M.sliding_window(100), score_mod=SM.relative_bias(0.1 * torch.randn(4, 65))),
    "document & key padding": dict(mask=M.document(torch.arange(S) // 97) & M.padding([385, 150])),
}


def _ref(q, k, v, kw):
    up = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    out = attnkit.attention(*up, backend="eager", **kw)
    return up, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "flex", "tiled"])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_conformance(name, backend, dtype):
    kw = CASES[name]
    torch.manual_seed(0)
    q = torch.randn(2, 4, L, D, device="cuda").to(dtype).requires_grad_()
    k = torch.randn(2, 2, S, D, device="cuda").to(dtype).requires_grad_()
    v = torch.randn(2, 2, S, D, device="cuda").to(dtype).requires_grad_()
    try:
        out = attnkit.attention(q, k, v, backend=backend, **kw)
    except ValueError as e:
        assert backend != "auto" and "cannot honour" in str(e)
        return
    assert out.device.type == "cuda" and out.dtype == dtype and not out.isnan().any()
    up, ref = _ref(q, k, v, kw)
    tol = 4 * EPS[dtype] ** 0.5 if dtype != torch.float32 else 1e-4
    assert (out.double().cpu() - ref).abs().max() <= tol * (1 + ref.abs().max())
    g = torch.randn_like(ref)
    out.backward(g.to(device="cuda", dtype=dtype))
    ref.backward(g)
    for got, want in zip((q, k, v), up, strict=True):
        assert got.grad is not None and not got.grad.isnan().any()
        assert (got.grad.double().cpu() - want.grad).abs().max() <= 10 * tol * (1 + want.grad.abs().max())


def test_cuda_auto_table():
    q = torch.randn(1, 4, 256, 64, device="cuda")
    assert attnkit.dispatch(q, q, q, causal=True).backend == "sdpa"
    assert attnkit.dispatch(q, q, q, mask=M.sliding_window(64)).backend == "flex"


# ---------------------------------------------------------------------------------------------------------------
# What a GPU user does with attnkit beyond attention(): torch's FlexAttention kernels fed attnkit's BlockMask, the
# FlexAttention drop-in, masks as CUDA tensors, strided views, the nn module with its KV cache, transformers.

def _cuda_mods():
    doc = torch.repeat_interleave(torch.arange(7), torch.tensor([40, 1, 90, 128, 17, 200, 124])).cuda()  # 600 ids
    lengths = torch.tensor([300, 77], device="cuda")
    return {
        "causal": lambda b, h, q, kv: q >= kv,
        "document (ids on the GPU)": lambda b, h, q, kv: doc[q] == doc[kv],
        "causal & document": lambda b, h, q, kv: (q >= kv) & (doc[q] == doc[kv]),
        "sliding window": lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 100),
        "per-batch lengths (on the GPU)": lambda b, h, q, kv: kv < lengths[b],
        "per-head": lambda b, h, q, kv: kv <= q - 64 * h,
    }


_BM_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


_CUDA_MODS = ("causal", "document (ids on the GPU)", "causal & document", "sliding window",
              "per-batch lengths (on the GPU)", "per-head")


@pytest.mark.parametrize("name", _CUDA_MODS)
@pytest.mark.parametrize("L, block", [(600, 128), (257, 64), (1, 128)])
def test_create_block_mask_on_cuda_is_torchs_and_runs_torchs_kernel(name, L, block):
    """attnkit.create_block_mask(device="cuda") of a mask_mod whose captured tensors live on the GPU: torch's
    BlockMask field for field, and torch's own compiled flex_attention over it equals the float64 golden."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    mod, S = _cuda_mods()[name], 600
    B, H = 2, 3
    ours = attnkit.create_block_mask(mod, B, H, L, S, device="cuda", BLOCK_SIZE=block)
    theirs = torch_cbm(mod, B, H, L, S, device="cuda", BLOCK_SIZE=block)
    assert ours.seq_lengths == theirs.seq_lengths and ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    for f in _BM_FIELDS:
        a, b = getattr(ours, f), getattr(theirs, f)
        assert a.device.type == "cuda" and a.dtype == b.dtype and a.shape == b.shape, f
        assert torch.equal(a, b), f
    if block != 128:  # torch's GPU kernel wants blocks that its own tile (128 on this GPU) divides
        return
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, n, 64, device="cuda") for n in (L, S, S))
    out = torch.compile(torch_flex)(q, k, v, block_mask=ours)
    b_, h_, i_, j_ = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(L), torch.arange(S), indexing="ij")
    dense = mod(b_.cuda(), h_.cuda(), i_.cuda(), j_.cuda()).cpu()
    ref = attnkit.attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask=dense, backend="eager")
    assert (out.double().cpu() - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_dropin_on_cuda_matches_golden_with_grads(dtype):
    """`from attnkit import flex_attention` on CUDA tensors with a CUDA BlockMask and a score_mod capturing a
    learnable CUDA bias: forward and every gradient (the captured bias's too) against float64."""
    L = S = 384
    bias = (0.1 * torch.randn(2 * S, device="cuda")).requires_grad_()

    def score_mod(s, b, h, q, kv):
        return s + bias[q - kv + S]

    bm = attnkit.create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv < 200), None, None, L, S, device="cuda")
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 4, n, 64, device="cuda").to(dtype).requires_grad_() for n in (L, S, S))
    out = attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    assert out.device.type == "cuda" and out.dtype == dtype
    up = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    bias64 = bias.detach().double().cpu().requires_grad_()
    i, j = torch.arange(L)[:, None], torch.arange(S)[None]
    keep = (i >= j) & (i - j < 200)
    s = up[0] @ up[1].transpose(-1, -2) / 8 + bias64[i - j + S]
    ref = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ up[2]
    tol = 1e-4 if dtype == torch.float32 else 4 * EPS[dtype] ** 0.5
    assert (out.double().cpu() - ref).abs().max() <= tol * (1 + ref.abs().max())
    g = torch.randn_like(ref)
    out.backward(g.to("cuda", dtype))
    ref.backward(g)
    for got, want in zip((q, k, v, bias), (*up, bias64), strict=True):
        assert got.grad is not None and got.grad.device.type == "cuda"
        assert (got.grad.double().cpu() - want.grad).abs().max() <= 10 * tol * (1 + want.grad.abs().max())


@pytest.mark.parametrize("backend", ["auto", "sdpa", "tiled"])
@pytest.mark.parametrize("kind", ["bool", "float with finfo.min rows"])
def test_cuda_tensor_masks_dead_rows_and_strided_views(backend, kind):
    """A CUDA mask tensor (bool, or a float bias whose dead rows are finfo.min), fully masked rows, inputs that are
    transposed views of (B, L, H, D) projections: output 0 on dead rows, the golden elsewhere, gradients too."""
    torch.manual_seed(2)
    B, H, L, S, D = 2, 4, 130, 200, 32
    q = torch.randn(B, L, H, D, device="cuda").transpose(1, 2).requires_grad_()
    kv = torch.randn(B, S, 2, H, D, device="cuda")
    k, v = kv[:, :, 0].transpose(1, 2).requires_grad_(), kv[:, :, 1].transpose(1, 2).requires_grad_()
    keep = torch.rand(B, 1, L, S, device="cuda") > 0.3
    keep[0, :, 5] = False
    keep[1, :, 100:] = False
    if kind == "bool":
        mask = keep
    else:
        mask = torch.zeros(B, 1, L, S, device="cuda").masked_fill(~keep, torch.finfo(torch.float32).min)
    try:
        out = attnkit.attention(q, k, v, mask=mask, backend=backend)
    except ValueError as e:
        assert backend != "auto" and "cannot honour" in str(e)
        return
    up = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    # a bool mask's dead rows give 0; a float bias's finfo.min rows are a bias like any other: every score of such a
    # row rounds to the same number, so its weights are 1/S (the mean of V, as in SDPA's math and eager attention)
    ref = attnkit.attention(*up, mask=mask.cpu() if kind == "bool" else mask.double().cpu(), backend="eager")
    assert (out.double().cpu() - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())
    if kind == "bool":
        assert out[0, :, 5].abs().max() == 0 and out[1, :, 100:].abs().max() == 0
    g = torch.randn_like(ref)
    out.backward(g.cuda().float())
    ref.backward(g)
    for got, want in zip((q, k, v), up, strict=True):
        assert got.grad is not None and not got.grad.isnan().any()
        assert (got.grad.double().cpu() - want.grad).abs().max() <= 1e-3 * (1 + want.grad.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mha_module_and_kv_cache_decode_on_cuda(dtype):
    """attnkit.nn.MultiHeadAttention moved to CUDA: a causal forward equals the same module in float64 on the CPU,
    and KV-cache decoding (prefill, then one token at a time) equals the full causal forward."""
    from attnkit.nn import MultiHeadAttention
    from attnkit.positional import RotaryEmbedding

    torch.manual_seed(3)
    cpu = MultiHeadAttention(128, 8, num_kv_heads=2, positional=RotaryEmbedding(16)).double()
    gpu = MultiHeadAttention(128, 8, num_kv_heads=2, positional=RotaryEmbedding(16))
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.to("cuda", dtype)
    x = torch.randn(2, 40, 128, dtype=torch.float64)
    with torch.no_grad():
        want = cpu(x, causal=True)
        got = gpu(x.to("cuda", dtype), causal=True)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert got.device.type == "cuda" and (got.double().cpu() - want).abs().max() <= tol * (1 + want.abs().max())
        cache = gpu.new_cache(batch_size=2, max_length=64)
        steps = [gpu(x[:, :32].to("cuda", dtype), kv_cache=cache)]
        steps += [gpu(x[:, t:t + 1].to("cuda", dtype), kv_cache=cache) for t in range(32, 40)]
        dec = torch.cat(steps, 1)
        assert (dec.double().cpu() - want).abs().max() <= tol * (1 + want.abs().max())


def test_transformers_llama_on_cuda_equals_sdpa():
    """A config-built GQA Llama on CUDA with attn_implementation="attnkit": logits of a left-padded batch and a
    greedy generate equal transformers' "sdpa" on the same GPU."""
    import transformers  # installed with the test tooling (the "transformers" extra), as on the GPU machines' image

    from attnkit.integrations import transformers as ak_tf

    ak_tf.register()
    torch.manual_seed(4)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    models = {}
    for impl in ("attnkit", "sdpa"):
        torch.manual_seed(4)
        cfg._attn_implementation = impl
        models[impl] = transformers.LlamaForCausalLM(cfg).cuda().eval()
    ids = torch.randint(3, 128, (2, 24), device="cuda")
    am = torch.ones_like(ids)
    am[1, :7] = 0  # left padding
    with torch.no_grad():
        a = models["attnkit"](input_ids=ids, attention_mask=am).logits
        b = models["sdpa"](input_ids=ids, attention_mask=am).logits
        keep = am.bool()
        assert (a[keep] - b[keep]).abs().max() <= 1e-4
        ga = models["attnkit"].generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False)
        gb = models["sdpa"].generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False)
    assert torch.equal(ga, gb)


@pytest.mark.parametrize("backend", ["auto", "tiled", "flex"])
def test_users_mods_reading_gpu_tensors(backend):
    """attnkit.attention on CUDA tensors with a user's mask_mod and score_mod that read tensors on the GPU (document
    ids, a bias table): attnkit's plan is built on the CPU, so the mods are called there on CPU indices first."""
    torch.manual_seed(5)
    L = S = 300
    doc = (torch.arange(S) // 70).cuda()
    table = (0.1 * torch.randn(2 * S)).cuda()

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (doc[q] == doc[kv])

    def score_mod(s, b, h, q, kv):
        return s + table[q - kv + S]

    q, k, v = (torch.randn(1, 4, n, 32, device="cuda").requires_grad_() for n in (L, S, S))
    try:
        out = attnkit.attention(q, k, v, mask=mask_mod, score_mod=score_mod, backend=backend)
    except ValueError as e:
        assert backend != "auto" and "cannot honour" in str(e)
        return
    up = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    i, j = torch.arange(L)[:, None], torch.arange(S)[None]
    keep = (i >= j) & (doc.cpu()[i] == doc.cpu()[j])
    sc = up[0] @ up[1].transpose(-1, -2) / 32 ** 0.5 + table.double().cpu()[i - j + S]
    ref = torch.softmax(sc.masked_fill(~keep, float("-inf")), -1) @ up[2]
    assert (out.double().cpu() - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())
    g = torch.randn_like(ref)
    out.backward(g.cuda().float())
    ref.backward(g)
    for got, want in zip((q, k, v), up, strict=True):
        assert (got.grad.double().cpu() - want.grad).abs().max() <= 1e-3 * (1 + want.grad.abs().max())


def test_flex_path_keeps_its_compiled_kernel_past_torchs_recompile_limit():
    """Nine mask_mods of distinct code, then a call whose unfused path would need 512 GiB: every one on
    FlexAttention's compiled kernel (past torch.compile's default of 8 recompiles torch runs flex_attention unfused,
    materialising every score; benchmarks/gpu.py hit it). Between them a decode loop whose key count grows every
    step, on SDPA (FlexAttention would compile a kernel a step)."""
    torch.manual_seed(6)

    def golden(q, k, v, mask):
        return attnkit.attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask=mask, backend="eager")

    for w in range(20, 29):  # nine code objects (eval compiles each afresh)
        mod = eval(f"lambda b, h, q, kv: (q - kv >= 0) & (q - kv < {w})")
        q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        out = attnkit.attention(q, k, v, mask=mod, backend="flex")
        assert (out.double().cpu() - golden(q, k, v, mod)).abs().max() <= 4e-3
    cache_k, cache_v = (torch.randn(1, 2, 320, 64, device="cuda") for _ in range(2))
    for S in range(300, 312):  # decode steps: one query over a cache one key longer each step
        q = torch.randn(1, 8, 1, 64, device="cuda")
        k, v = cache_k[:, :, :S], cache_v[:, :, :S]
        out = attnkit.attention(q, k, v, mask=M.sliding_window(128))
        assert attnkit.dispatch(q, k, v, mask=M.sliding_window(128)).backend == "sdpa"  # no kernel compiled a step
        assert (out.double().cpu() - golden(q, k, v, M.sliding_window(128))).abs().max() <= 1e-4
    B, H, L, D = 8, 16, 32768, 64
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16) for _ in range(3))
    out = attnkit.attention(q, k, v, mask=M.sliding_window(256), backend="flex")
    part = golden(q[:1, :1, :300], k[:1, :1, :300], v[:1, :1, :300], M.sliding_window(256))
    assert (out[:1, :1, :300].double().cpu() - part).abs().max() <= 4e-3 and not out.isnan().any()


@pytest.mark.parametrize("block", [128, 64])
def test_flex_dropin_on_cuda_inference_runs_flexattention_with_the_users_blockmask(block):
    """`from attnkit import flex_attention` on CUDA tensors without gradients: attnkit's flex backend rebuilds the
    user's BlockMask from its plan (its own blocks, or 128-tiles over 64-blocks) and torch's compiled kernel runs it;
    the answer is the golden's, score_mod included."""
    L, S = 333, 500
    doc = (torch.arange(S) // 120).cuda()
    bm = attnkit.create_block_mask(lambda b, h, q, kv: (doc[q] == doc[kv]) & (q + S - L >= kv), None, None, L, S,
                                   device="cuda", BLOCK_SIZE=block)
    torch.manual_seed(7)
    q, k, v = (torch.randn(2, 4, n, 64, device="cuda") for n in (L, S, S))
    with torch.no_grad():
        out = attnkit.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + 0.01 * (i - j), block_mask=bm)
    i, j = torch.arange(L)[:, None], torch.arange(S)[None]
    keep = (doc.cpu()[i] == doc.cpu()[j]) & (i + S - L >= j)
    sc = q.double().cpu() @ k.double().cpu().transpose(-1, -2) / 8 + 0.01 * (i - j)
    ref = torch.softmax(sc.masked_fill(~keep, float("-inf")), -1) @ v.double().cpu()
    assert (out.double().cpu() - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())
