"""``torch.jit.trace`` of ``attnkit.attention`` and the ``attnkit.nn`` modules: the call is one op of attnkit's
(``attnkit.ops``), as under ``torch.compile`` and ``torch.export``, so the traced program follows new shapes and
values. It used to fail inside the eager path (sizes traced as tensors), and RoPE's cached table of 256 rows would
have been recorded as a constant. A saved program (``torch.jit.save``, ``torch.export.save``) loads in a new process
once ``attnkit.ops`` is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import attnkit
from attnkit import masks as M
from attnkit.nn import MultiHeadAttention


class _Call(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v):
        return attnkit.attention(q, k, v, **self.kw)


class _Causal(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x, causal=True)


def _trace(mod, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return torch.jit.trace(mod, args)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(mask=M.sliding_window(5)),
                                dict(score_mod=lambda s, b, h, i, j: s * 0.5)], ids=["none", "causal", "window",
                                                                                     "score_mod"])
def test_a_traced_call_follows_new_shapes_and_values_with_gradients(kw):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 8, 16, generator=g)
    traced = _trace(_Call(**kw), (q, q, q))
    for shape, kv_shape in [((1, 2, 8, 16), (1, 2, 8, 16)), ((2, 4, 13, 16), (2, 2, 40, 16)), ((1, 2, 1, 16),
                                                                                               (1, 2, 9, 16))]:
        q = torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
        k, v = (torch.randn(*kv_shape, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
        got = traced(q, k, v)
        want = attnkit.attention(q, k, v, backend="eager", **kw)  # float64: the textbook formula
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        dq, dk = torch.autograd.grad(got.sum(), (q, k))
        wq, wk = torch.autograd.grad(want.sum(), (q, k))
        torch.testing.assert_close(dq, wq, rtol=0, atol=1e-12)
        torch.testing.assert_close(dk, wk, rtol=0, atol=1e-12)


@pytest.mark.parametrize("positional", [None, "rope", "alibi"])
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_a_traced_module_matches_its_eager_self_at_other_lengths(positional, num_kv_heads):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, positional=positional).eval()
    x = torch.randn(2, 5, 32)
    traced, traced_causal = _trace(m, (x,)), _trace(_Causal(m), (x,))
    for shape in [(3, 7, 32), (1, 300, 32), (2, 1, 32)]:  # 300 rows: past RoPE's first cached table (256)
        x = torch.randn(*shape)
        torch.testing.assert_close(traced(x), m(x), rtol=0, atol=1e-6)
        torch.testing.assert_close(traced_causal(x), m(x, causal=True), rtol=0, atol=1e-6)


def test_saved_programs_load_in_a_new_process_that_imports_attnkit_ops(tmp_path):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=2, positional="rope").eval()
    x = torch.randn(2, 5, 32)
    _trace(_Causal(m), (x,)).save(str(tmp_path / "traced.pt"))
    q = torch.randn(1, 2, 8, 16)
    torch.export.save(torch.export.export(_Call(causal=True), (q, q, q)), str(tmp_path / "exported.pt2"))
    torch.save(m.state_dict(), tmp_path / "weights.pt")
    code = textwrap.dedent(f"""
        import torch
        import attnkit.ops  # registers torch.ops.attnkit.*
        import attnkit
        from attnkit.nn import MultiHeadAttention
        m = MultiHeadAttention(32, 4, num_kv_heads=2, positional="rope").eval()
        m.load_state_dict(torch.load({str(tmp_path / "weights.pt")!r}))
        x = torch.randn(2, 9, 32)
        traced = torch.jit.load({str(tmp_path / "traced.pt")!r})
        assert (traced(x) - m(x, causal=True)).abs().max() < 1e-6
        q = torch.randn(1, 2, 8, 16)
        program = torch.export.load({str(tmp_path / "exported.pt2")!r}).module()
        assert (program(q, q, q) - attnkit.attention(q, q, q, causal=True)).abs().max() < 1e-6
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


class _Two(torch.nn.Module):
    def forward(self, q, k, v, bias):
        return (attnkit.attention(q, k, v, mask=M.sliding_window(3), score_mod=lambda s, b, h, i, j: s * 0.5)
                + attnkit.attention(q, k, v, mask=bias))


def test_torch_fx_traces_attention_as_one_node_that_follows_new_inputs():
    """``torch.fx.symbolic_trace`` failed with "q: expected a torch.Tensor or numpy.ndarray, got Proxy. Convert it
    first, e.g. np.asarray(q ...)" (a fix that cannot work on a Proxy). attention is now one node of the graph; a
    mask that is an input of the traced function stays an input of the node."""
    gm = torch.fx.symbolic_trace(_Two())
    assert gm.code.count("attention") >= 2 and "(q, k, v, mask = bias)" in gm.code
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 2, 9, 8), (2, 4, 13, 8)]:
        q = torch.randn(*shape, generator=g, requires_grad=True)
        bias = torch.randn(shape[2], shape[2], generator=g)
        got, want = gm(q, q, q, bias), _Two()(q, q, q, bias)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), q)[0], torch.autograd.grad(want.sum(), q)[0],
                                   rtol=0, atol=0)


def test_torch_fx_refuses_to_trace_into_multihead_attention_and_takes_it_as_a_leaf():
    with pytest.raises(TypeError, match=r"torch.fx.symbolic_trace cannot trace MultiHeadAttention\.forward.*leaf"):
        torch.fx.symbolic_trace(MultiHeadAttention(16, 4))

    class Leaf(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, MultiHeadAttention) or super().is_leaf_module(m, name)

    torch.manual_seed(0)
    net = _Causal(MultiHeadAttention(16, 4))
    gm = torch.fx.GraphModule(net, Leaf().trace(net))
    x = torch.randn(2, 7, 16)
    torch.testing.assert_close(gm(x), net(x), rtol=0, atol=0)
