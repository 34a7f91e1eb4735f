"""attnkit reads a user's tensors without changing them: never through ``Tensor.numpy()``, which marks a tensor's
storage non-resizable for good (a mask a user later grows with ``resize_``, an FSDP parameter freed with
``resize_(0)`` would fail after attnkit read it). ``_tiling.host_array`` is the one way in: a copy of a small
contiguous tensor's bytes, a DLPack view of anything else.

Each user path that reads a tensor on the host is called, then every tensor the user handed over is resized (grown,
so that the storage must really resize); the results are checked against the float64 reference as well.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import budget, golden

import attnkit
from attnkit import masks
from attnkit._tiling import _COPY_MAX, host_array


def _grows(*ts: torch.Tensor) -> None:
    """Each tensor's storage can still be resized (grown by a page): raises where NumPy was handed it."""
    for t in ts:
        n = t.numel()
        t.resize_(n + 1024)
        t.resize_(n)


# ---------------------------------------------------------------------------------------------------- the helper


@pytest.mark.parametrize("make", [
    lambda: torch.rand(3, 5) > 0.5,                                    # small contiguous: copied
    lambda: torch.arange(_COPY_MAX // 4 + 7, dtype=torch.int32),        # large: a DLPack view
    lambda: torch.randn(6, 9, dtype=torch.float64)[:, ::2],            # strided
    lambda: (torch.rand(1, 1, 1, 7) > 0.5).expand(2, 3, 4, 7),         # expanded (stride 0)
    lambda: torch.tensor(2.5),                                         # 0-d
    lambda: torch.zeros(0, 4),                                         # empty
    lambda: torch.randn(4, 4, requires_grad=True),                     # read detached
    lambda: torch.randint(0, 200, (5,), dtype=torch.uint8).view(torch.bool),  # bytes other than 0 / 1
    lambda: torch.randn(4, dtype=torch.complex64).conj().imag,         # a negated view: values, not bytes
    lambda: torch.randn(70000, dtype=torch.complex64).conj().imag,     # the same, large
])
def test_host_array_is_the_tensors_elements_read_only(make):
    t = make()
    x = host_array(t)
    bits = t.detach().view(torch.uint8) if t.dtype == torch.bool else t.detach()  # (bool: its bytes as they are)
    ref = bits.resolve_neg().clone().numpy()  # (a clone's .numpy(): the clone is ours)
    assert x.shape == tuple(t.shape) and x.dtype == (np.bool_ if t.dtype == torch.bool else ref.dtype)
    np.testing.assert_array_equal(x.view(np.uint8) if x.dtype == np.bool_ else x, ref)
    assert not x.flags.writeable
    base = t if t._base is None else t._base
    if base.is_leaf and not base.requires_grad:
        _grows(base)


def test_host_array_keeps_a_viewed_tensor_alive():
    x = host_array(torch.arange(_COPY_MAX, dtype=torch.int64)[::2])  # (the view's tensor is dropped here)
    assert x[-1] == _COPY_MAX - 2 and x.sum() == (_COPY_MAX // 2) * (_COPY_MAX - 2) // 2


# ----------------------------------------------------------------------------------------------- the user's paths


def _qkv(L, S, D=16, H=4, Hkv=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H, L, D, generator=g, dtype=dtype), torch.randn(1, Hkv, S, D, generator=g, dtype=dtype),
            torch.randn(1, Hkv, S, D, generator=g, dtype=dtype))


@pytest.mark.parametrize("L, S, rows", [
    (1, 300, "window"),        # a decode step's one stretch
    (1, 5000, "sinks"),        # sinks + window: the stretches reader
    (64, 64, "window"),        # a short prompt's own mask
    (8, 40, "random"),         # rows of many stretches: the general reader
])
def test_a_users_bool_mask_and_inputs_stay_resizable(L, S, rows):
    q, k, v = _qkv(L, S)
    j, i = torch.arange(S), torch.arange(L)[:, None] + (S - L)
    if rows == "window":
        m = (j <= i) & (j > i - 32)
    elif rows == "sinks":
        m = ((j <= i) & (j > i - 256)) | (j < 4)
    else:
        m = torch.rand(L, S, generator=torch.Generator().manual_seed(1)) > 0.3
    mask = m.reshape(1, 1, L, S).contiguous()
    for _ in range(2):  # (the second call: what a replay reads)
        out = attnkit.attention(q, k, v, mask=mask)
    ref, _ = golden(q, k, v, mask=mask)
    assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S)
    _grows(mask, q, k, v)


def test_the_reference_backend_leaves_float64_inputs_resizable():
    q, k, v = _qkv(5, 9, dtype=torch.float64)
    bias = torch.randn(1, 1, 5, 9, dtype=torch.float64)
    mask = torch.rand(1, 1, 5, 9) > 0.2
    for m in (mask, bias):  # (a bool mask; a float mask, added to the scores)
        out = attnkit.attention(q, k, v, mask=m, backend="reference")
        want = torch.softmax((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 16 ** -0.5 +
                             (m if m.is_floating_point() else torch.zeros_like(bias).masked_fill(~m, -torch.inf)),
                             -1) @ v.repeat_interleave(2, 1)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    _grows(q, k, v, bias, mask)


def test_a_mod_handing_back_a_captured_tensor_leaves_it_resizable():
    S = 300
    keep = (torch.arange(S) % 3 != 1).view(1, 1, 1, S).contiguous()
    bm = attnkit.create_block_mask(lambda b, h, qi, kv: keep, 1, 1, 1, S)  # (the mod's answer is `keep` itself)
    q, k, v = _qkv(1, S, H=2, Hkv=2)
    out = attnkit.flex_attention(q, k, v, block_mask=bm)
    ref, _ = golden(q, k, v, mask=keep)
    assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S)
    _grows(keep)


def test_a_mod_of_a_users_tensor_on_the_tiled_path_leaves_it_resizable():
    """A larger call: the mod's answers on stacked tiles are packed into bit words (``_tilebits``)."""
    L = S = 200
    doc = torch.arange(S) // 50
    allowed = doc.view(-1, 1) == doc.view(1, -1)
    mask = masks.from_mod(lambda b, h, qi, kv: allowed[qi, kv])
    q, k, v = _qkv(L, S)
    out = attnkit.attention(q, k, v, mask=mask)
    ref, _ = golden(q, k, v, mask=allowed.view(1, 1, L, S))
    assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S)
    _grows(allowed, doc)


def test_a_models_digest_leaves_its_parameters_resizable():
    """The cross-rank model check hashes parameters by their bytes; FSDP frees a parameter with ``resize_(0)``."""
    from attnkit.distributed.guard import _digest

    model = torch.nn.Linear(8, 4)
    d = _digest(model)
    assert d == _digest(model)
    for p in model.parameters():
        p.data.untyped_storage().resize_(0)  # (what FSDP does to a sharded parameter's full storage)


def test_the_transformers_context_parallel_hash_leaves_a_tensor_resizable():
    from attnkit.integrations.context_parallel import _tensor_hash

    w = torch.randn(16, 8)
    h = _tensor_hash(w)
    assert h == _tensor_hash(w.clone()) and h != _tensor_hash(w + 1)
    w.untyped_storage().resize_(0)
