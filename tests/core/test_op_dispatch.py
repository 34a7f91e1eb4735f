"""The op's lighter AutogradCPU kernel (attnkit._op._register_no_grad_kernel): which calls take it, and that every
call answers as the op's full path does — no graph recorded where none is wanted, a gradient wherever one is (into
q, k, v and into a captured tensor), traces and tensor subclasses on the full path."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, budget, rand_qkv

import attnkit
from attnkit import _op

B, H, L, S, D = 1, 2, 5, 40, 16
KEY = _op._register(True, None, None)
OP = torch.ops.attnkit.attention.default


@pytest.fixture
def seen(monkeypatch):
    """Records, at each run of the op's implementation, whether it runs below autograd (the full path: torch's
    wrapper redispatches with autograd excluded) or straight from the lighter kernel."""
    got: list[str] = []
    real = _op._step_signature

    def spy(*a, **kw):
        below = torch._C._dispatch_tls_local_exclude_set().has(torch._C.DispatchKey.AutogradFunctionality)
        got.append("full" if below else "direct")
        return real(*a, **kw)

    monkeypatch.setattr(_op, "_step_signature", spy)
    return got


def test_the_lighter_kernel_is_registered_on_the_pinned_torch():
    """On a torch without ``torch._library.autograd.make_autograd_impl`` attnkit registers none (every call takes
    torch.library's wrapper, correct and slower); the pinned torch has it, and a torch upgrade that drops it
    should be seen here, not as a silent slowdown."""
    assert _op.NO_GRAD_KERNEL


def _call(q, k, v, tensors=(), key=KEY, learn=""):
    return OP(q, k, v, list(tensors), [], [], key, None, learn)


def _reference(q, k, v):
    return attnkit.attention(q.double(), k.double(), v.double(), causal=True, backend="eager")


def test_a_call_that_wants_no_gradient_runs_directly_and_answers_as_the_full_path(seen):
    q, k, v = rand_qkv(B, H, H, L, S, D)
    with torch.no_grad():
        out, lse, _ = _call(q, k, v)
    assert seen == ["direct"]
    assert not out.requires_grad and out.grad_fn is None
    assert_close(out, _reference(q, k, v), budget(torch.float32, D, S), "no_grad")
    # grad mode on, but no input requires grad: no graph to record either
    out2, lse2, _ = _call(q, k, v)
    assert seen == ["direct", "direct"] and out2.grad_fn is None
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_a_call_that_wants_a_gradient_takes_the_full_path_and_gets_it(seen):
    q, k, v = rand_qkv(B, H, H, L, S, D, requires_grad=True)
    out, _, _ = _call(q, k, v)
    assert seen == ["full"] and out.grad_fn is not None
    go = torch.randn_like(out)
    got = torch.autograd.grad((out * go).sum(), (q, k, v))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad((_reference(qd, kd, vd) * go.double()).sum(), (qd, kd, vd))
    for g, w, n in zip(got, want, "qkv", strict=True):
        assert_close(g, w, budget(torch.float32, D, S), f"d{n}")


def test_a_captured_tensor_that_requires_grad_takes_the_full_path(seen):
    """Only the tensors list requires grad (a learnable bias a score_mod captures): the wrapper records the graph
    and the gradient reaches the tensor."""
    q, k, v = rand_qkv(B, H, H, L, S, D)
    table = torch.randn(H, L + S, requires_grad=True)

    def rel(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + S]

    acc = _op._Acc()
    key = _op._register(True, None, _op._score_spec(rel, acc))
    assert any(t is table for t in acc.tensors)
    learn = "".join("1" if t.requires_grad else "0" for t in acc.tensors)
    out, _, _ = _call(q, k, v, acc.tensors, key, learn)
    assert seen == ["full"]
    (g,) = torch.autograd.grad(out.sum(), (table,))
    assert g.abs().sum() > 0
    with torch.no_grad():  # the same call wanting no gradient: direct
        _call(q, k, v, acc.tensors, key, learn)
    assert seen == ["full", "direct"]


def test_traces_and_other_devices_keys_take_the_full_path(seen):
    """A fake tensor (torch.compile's tracing) carries keys below autograd: the full path, which reaches the op's
    fake implementation."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, torch.no_grad():
        q, k, v = (mode.from_tensor(t) for t in rand_qkv(B, H, H, L, S, D))
        out, lse, _ = _call(q, k, v)
    assert out.shape == (B, H, L, D) and lse.shape == (B, H, L)
    assert seen == []  # the fake implementation ran, never the real one


def test_under_inference_mode_the_op_answers_the_same():
    q, k, v = rand_qkv(B, H, H, L, S, D)
    with torch.no_grad():
        want = _call(q, k, v)[0]
    with torch.inference_mode():
        got = _call(q, k, v)[0]
    assert torch.equal(got, want)


def test_a_compiled_call_without_gradients_runs_directly(seen):
    """What the kernel is for: a compiled model's attention under no_grad reaches the implementation directly."""
    torch._dynamo.reset()
    q, k, v = rand_qkv(B, H, H, 1, S, D)
    f = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, causal=True), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        f(q, k, v)  # (compiling)
        seen.clear()
        got = f(q, k, v)
    assert seen == ["direct"]
    assert_close(got, _reference(q, k, v), budget(torch.float32, D, S), "compiled, no_grad")
