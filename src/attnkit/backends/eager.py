"""``backend="eager"``: the math path in torch ops. Materialises the (B, H, L, S)
scores, so memory is O(L·S); supports everything (score_mod, any mask, dropout,
GQA without copying K/V) and autograd through torch."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import _softmax
from ._base import Request
from ._kernel import Kernel
from ._tiles import allowed_tile, modify_scores

__all__ = ["NAME", "EAGER", "unsupported", "run", "weights"]

NAME = "eager"


def unsupported(req: Request) -> str | None:
    return None


class Eager(Kernel):
    """Dense scores in torch ops: runs every call (the last row of every table)."""

    name = "eager"
    backend = "eager"
    worker = "math"
    title = "the eager math path"
    reads_memory = False  # torch ops only: runs under torch.func's grad / vmap / jacrev
    measured = "O(L·S) memory and the slowest at length; the only path with dropout under auto"

    def why(self, req: Request) -> str:
        return "dense (B, H, L, S) scores in torch ops, autograd through everything"

    def auto_reason(self, req: Request, passed) -> str:
        if req.dropout_p > 0:
            return "dropout_p > 0: only the eager path implements dropout under auto"
        tiled_no = [r for k, rs, _ in passed if k.backend == "tiled" for r in rs]
        flex_no = [r for k, rs, _ in passed if k.backend == "flex" for r in rs]
        if req.device_type != "cpu":
            return (f"neither FlexAttention ({'; '.join(flex_no)}) nor tiled ({tiled_no[-1] if tiled_no else '-'}) "
                    "can honour this: eager math path")
        return f"tiled backend unavailable ({tiled_no[-1] if tiled_no else '-'}); eager math path"

    def run(self, req: Request):
        return run(req)


EAGER = Eager()


def _probs(req: Request):
    B, H, L, S, D, Dv, Hkv = req.shape
    g = H // Hkv
    cd = req.compute_dtype()
    # GQA: view q as (B, Hkv, g, L, D) and broadcast k over g -- no copy of K/V.
    qg = req.q.to(cd).reshape(B, Hkv, g, L, D)
    s = torch.matmul(qg, req.k.to(cd).unsqueeze(2).transpose(-1, -2)) * req.scale  # (B, Hkv, g, L, S)
    s = modify_scores(req, s.reshape(B, H, L, S), 0, 0)
    return _softmax.softmax_lse(s)  # weights (B, H, L, S), lse (B, H, L); dead rows 0 / -inf


def weights(req: Request) -> torch.Tensor:
    """Attention weights ``(B, H, L, S)`` (rows sum to 1; fully masked rows are 0)."""
    return _probs(req)[0]


def run(req: Request, worker: str | None = None):
    B, H, L, S, D, Dv, Hkv = req.shape
    g = H // Hkv
    w, lse = _probs(req)
    if req.dropout_p > 0.0:
        w = F.dropout(w, p=req.dropout_p, training=True)
    # a NaN / inf in V at a key the mask hides from a row is not read (_softmax.weigh_values); not under a torch.func
    # transform (vmap's tensors cannot decide a branch: there the matmul reads every value, as torch's kernels do)
    hidden = None
    masked = req.mask is not None or req.dense_mask is not None
    if masked and not torch._C._functorch.is_functorch_wrapped_tensor(req.v) and not bool(torch.isfinite(req.v).all()):
        allowed = allowed_tile(req, 0, L, 0, S)
        if allowed is not None:
            hidden = (~allowed).expand(B, H, L, S).reshape(B, Hkv, g, L, S)
    out = _softmax.weigh_values(w.reshape(B, Hkv, g, L, S), req.v.to(w.dtype).unsqueeze(2), hidden)
    return out.reshape(B, H, L, Dv).to(req.q.dtype), lse  # (B, Hkv, g, L, Dv) above


def graph_backward(req: Request, q, k, v, bias, captured, dout, dlse):
    """The gradients as a graph of torch ops, for a backward run with ``create_graph=True`` (a double backward: a
    gradient penalty, a Hessian-vector product). The compiled kernel's and the tiled engine's gradients are
    numbers, not a graph: differentiated again they would add nothing, silently. Here the eager path's forward is
    rebuilt on the saved ``q, k, v`` (and the float mask ``bias`` and the ``captured`` tensors the request reads,
    the same objects) and differentiated by autograd with ``create_graph``, so the gradients carry their own graph
    back to the inputs. O(L · S) memory, as the eager path. Returns ``(dq, dk, dv, dbias, dcap)``; None where an
    input wants no gradient."""
    inputs = [q, k, v, bias, *captured]
    wanted = [i for i, t in enumerate(inputs) if t is not None and t.requires_grad]
    grads: list = [None] * len(inputs)
    if not wanted:
        return None, None, None, None, []
    with torch.enable_grad():
        out, lse = run(dataclasses.replace(req, q=q, k=k, v=v, bias=bias, need_lse=True))
        outs, gos = [out], [torch.zeros_like(out) if dout is None else dout.to(out.dtype)]
        if dlse is not None:
            outs.append(lse)
            gos.append(dlse.to(lse.dtype))
        got = torch.autograd.grad(outs, [inputs[i] for i in wanted], gos, create_graph=True, allow_unused=True)
    for i, g in zip(wanted, got, strict=True):
        grads[i] = g
    return grads[0], grads[1], grads[2], grads[3], grads[4:]
