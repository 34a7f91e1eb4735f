"""The shared core: the backend layer's interface, the decision that names the worker, the
private-op probe and its fallback, the shared softmax math, and the import structure."""

from __future__ import annotations

import ast
import pathlib
import re
import warnings

import pytest
import torch
from conftest import assert_close, budget, golden, rand_qkv

import attnkit
from attnkit import masks as M
from attnkit.backends import NAMES, _flash_cpu, _native, _softmax, _table, get, tiled

SRC = pathlib.Path(attnkit.__file__).parent


def test_every_kernel_is_declared_once_in_its_devices_table():
    """Every compute path is a Kernel in one row of each device table it serves; a named backend runs the first
    of its kernels that can run the call, and each kernel's run gives out (and lse where asked)."""
    assert set(NAMES) == {"reference", "eager", "sdpa", "tiled", "flex"}
    for device, table in _table.TABLES.items():
        names = [r.kernel.name for r in table]
        assert len(names) == len(set(names)), (device, names)
        for r in table:
            k = r.kernel
            assert k.backend in NAMES and k.worker and k.title and k.name, k
    q, k, v = rand_qkv(1, 2, 2, 8, 8, 4)
    req = attnkit._request.make_request(q, k, v, mask=None, causal=False, scale=None, score_mod=None,
                                        dropout_p=0.0, return_lse=True, backend="auto")
    for name in NAMES:
        mod = get(name)
        assert mod.NAME == name
        why = mod.unsupported(req)
        if name == "flex":  # on a CPU FlexAttention compiles without lse: it says so, in words
            assert "no lse" in why
            continue
        assert why is None
        d = attnkit._dispatch.decide(req, name)
        assert d.backend == name and d.kernel is not None and d.worker == d.kernel.worker and d.worker_reason
        assert [v for _, v in d.verdicts].count("runs") == 1
        out, lse = d.kernel.run(req)
        assert out.shape == (1, 2, 8, 4) and lse.shape == (1, 2, 8)


def test_dispatch_reports_backend_worker_and_why():
    q, k, v = rand_qkv(1, 2, 2, 128, 128, 16)
    d = attnkit.dispatch(q, k, v, mask=M.sliding_window(16))
    built = _native.available()  # attnkit's compiled kernel (a machine without a compiler: torch's kernel)
    assert (d.backend, d.worker) == ("tiled", "native" if built else "fused") and "compiled kernel" in d.worker_reason
    d = attnkit.dispatch(q.double(), k.double(), v.double(), mask=M.sliding_window(16))
    assert (d.backend, d.worker) == ("tiled", "fused") and "flash kernel" in d.worker_reason
    assert "float64" in d.worker_reason  # why not the compiled kernel
    d = attnkit.dispatch(q, k, v, mask=M.sliding_window(16), score_mod=lambda s, b, h, i, j: s * 0.5)
    assert (d.backend, d.worker) == ("tiled", "native" if built else "plain") and "score_mod" in d.worker_reason
    d = attnkit.dispatch(q, k, v, mask=M.sliding_window(16), score_mod=lambda s, b, h, i, j: s * torch.sin(s))
    assert (d.backend, d.worker) == ("tiled", "plain") and "score_mod" in d.worker_reason
    d = attnkit.dispatch(q, k, v, causal=True)  # causal from L = 64 on the kernel (the defaults' crossover)
    assert (d.backend, d.worker) == (("tiled", "native") if built else ("sdpa", "fused"))
    d = attnkit.dispatch(q[:, :, :32], k[:, :, :32], v[:, :, :32], causal=True)  # below it: torch's kernel
    assert (d.backend, d.worker) == ("sdpa", "fused")
    qn = q.clone()
    qn[0, 0, 3, 0] = float("nan")
    rand = torch.rand(128, 128, generator=torch.Generator().manual_seed(0)) > 0.5
    rand[5] = False  # a fully masked row: output 0 there, told apart from a hidden NaN by the mask
    # the NaN check comes after the kernel (causal below the defaults' crossover, where SDPA runs it)
    short = (qn[:, :, :32], k[:, :, :32], v[:, :, :32])
    for (a, b, c), kw in (((qn, k, v), dict(mask=rand)), (short, dict(causal=True))):
        d = attnkit.dispatch(a, b, c, **kw)
        assert (d.backend, d.worker) == ("sdpa", "fused") and "re-checked for NaN" in d.worker_reason
        out = attnkit.attention(a, b, c, **kw)
        ref = attnkit.attention(a, b, c, backend="eager", **kw)
        assert out[0, 0, 3].isnan().all() and torch.equal(out.isnan(), ref.isnan())
        assert (out.nan_to_num() - ref.nan_to_num()).abs().max().item() <= 1e-5
    worker = "[native:" if _native.available() else "[fused:"
    assert worker in str(attnkit.dispatch(q, k, v, mask=M.sliding_window(16)))
    # the compiled kernel propagates NaN like the eager path (no scan needed: it never hides one)
    out = attnkit.attention(qn, k, v, mask=M.sliding_window(16))
    ref = attnkit.attention(qn, k, v, backend="eager", mask=M.sliding_window(16))
    assert out[0, 0, 3].isnan().all() and torch.equal(out.isnan(), ref.isnan())
    assert (out.nan_to_num() - ref.nan_to_num()).abs().max().item() <= 1e-5


def test_probe_failure_disables_the_fused_worker_with_one_warning(monkeypatch):
    """torch renames its private op: everything still runs, exactly, on the plain paths."""
    monkeypatch.setattr(_flash_cpu, "_FWD_NAME", "_no_such_op_in_this_torch")
    monkeypatch.setattr(_flash_cpu, "_state", {})
    monkeypatch.setattr(tiled, "NATIVE", False)  # this is about torch's kernel: keep attnkit's own out of it
    q, k, v = rand_qkv(1, 4, 2, 150, 150, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = attnkit.dispatch(q, k, v, mask=M.sliding_window(20))
        ref, ref_lse = golden(q, k, v, mask=M.sliding_window(20))
        out, lse = attnkit.attention(q, k, v, mask=M.sliding_window(20), return_lse=True)
        out2, lse2 = attnkit.attention(q, k, v, causal=True, return_lse=True)  # sdpa can't give lse now
    ours = [w for w in caught if "private CPU flash kernel is unavailable" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert (d.backend, d.worker) == ("tiled", "plain") and "unavailable" in d.worker_reason
    assert_close(out, ref, budget(torch.float32, 16, 150), "window without the op")
    assert_close(lse, ref_lse, budget(torch.float32, 16, 150), "lse without the op")
    ref2, ref2_lse = golden(q, k, v, causal=True)
    assert_close(out2, ref2, budget(torch.float32, 16, 150), "causal lse without the op")
    assert_close(lse2, ref2_lse, budget(torch.float32, 16, 150), "causal lse without the op: lse")
    with pytest.raises(ValueError, match="unavailable"):
        attnkit.attention(q, k, v, causal=True, return_lse=True, backend="sdpa")


def test_probe_checks_values_not_just_presence(monkeypatch):
    real = _flash_cpu._ops

    def wrong():
        fwd, bwd = real()
        return (lambda *a, **kw: tuple(t * 2 for t in fwd(*a, **kw))), bwd

    monkeypatch.setattr(_flash_cpu, "_ops", wrong)
    monkeypatch.setattr(_flash_cpu, "_state", {})
    with pytest.warns(RuntimeWarning, match="disagrees"):
        assert not _flash_cpu.available()


def test_merge_of_two_halves_equals_the_whole():
    torch.manual_seed(0)
    s = torch.randn(2, 3, 5, 40, dtype=torch.float64)
    s[0, 0, 1, :25] = float("-inf")  # dead on the first half only
    s[0, 0, 2] = float("-inf")  # dead on both
    v = torch.randn(2, 3, 40, 6, dtype=torch.float64)
    w, lse = _softmax.softmax_lse(s)
    whole = w @ v
    halves = []
    for sl in (slice(0, 25), slice(25, 40)):
        m_i, l_i, acc = _softmax.online_step(None, None, None, s[..., sl].clone(), v[:, :, sl])
        halves.append(_softmax.online_finish(m_i, l_i, acc))
    out, lse_m = _softmax.merge(*halves[0], *halves[1])
    assert torch.allclose(out, whole, atol=1e-14) and not out.isnan().any()
    assert torch.equal(torch.isneginf(lse_m), torch.isneginf(lse))
    fin = torch.isfinite(lse)
    assert torch.allclose(lse_m[fin], lse[fin], atol=1e-14)
    assert (out[0, 0, 2] == 0).all()


def test_sinks_match_a_float64_formula_and_give_gradients():
    q, k, v = rand_qkv(1, 2, 1, 6, 7, 4, dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.3, -1.0], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 1, 6, 7, dtype=torch.bool)
    mask[..., 2, :] = False  # a dead row: stays 0, no NaN
    out, lse, w = attnkit.attention(q, k, v, sinks=sinks, mask=mask, return_lse=True, return_weights=True,
                                    backend="tiled")
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.5
    s = s.masked_fill(~mask, float("-inf"))
    logits = torch.cat([s, sinks.view(1, 2, 1, 1).expand(1, 2, 6, 1)], -1)
    full = logits.softmax(-1)
    want = full[..., :7] @ v.repeat_interleave(2, 1)
    assert torch.allclose(out, want, atol=1e-12)
    assert torch.allclose(lse, logits.logsumexp(-1), atol=1e-12)  # lse = log(e^sink + Σ_j e^(s_j))
    assert torch.allclose(w, full[..., :7], atol=1e-12)
    out.sum().backward()
    assert sinks.grad is not None and torch.isfinite(sinks.grad).all()
    assert not q.grad.isnan().any()


def test_return_weights_on_every_backend():
    q, k, v = rand_qkv(2, 4, 2, 33, 40, 8)
    ref_out, ref = attnkit.attention(q.double(), k.double(), v.double(), causal=True, return_weights=True,
                                     backend="eager")
    for backend in ("auto", "tiled", "eager", "sdpa", "reference"):
        out, w = attnkit.attention(q, k, v, causal=True, return_weights=[1, 3], backend=backend)
        assert torch.allclose(out.double(), ref_out, atol=1e-5), backend
        assert w.shape == (2, 2, 33, 40)
        assert torch.allclose(w.double(), ref[:, [1, 3]], atol=1e-5), backend
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        attnkit.attention(q, k, v, return_weights=[4])


# --- structure: no import cycles, nothing imports upward (every import, lazy ones included) ---------
#
# The layer order, lowest first (docs/architecture.md draws the same): a module may import its own
# layer or a lower one, never a higher one. A package (backends, viz, ...) is one layer with all its
# modules; ``attnkit`` alone is the package's own face (attnkit/__init__.py). Every module of
# src/attnkit must stand in a layer, so a new one is placed here on purpose.
LAYERS = [
    ("leaves: index and number helpers, bounded caches, the display registry, the machine's memory",
     {"attnkit._tiling", "attnkit._mods", "attnkit._ranges", "attnkit._format", "attnkit._display", "attnkit._lru",
      "attnkit._args", "attnkit._machine", "attnkit.score_mods", "attnkit.positional"}),
    ("masks and the score-mod compiler", {"attnkit.masks", "attnkit._scoreprog"}),
    ("plans (and a FlexAttention BlockMask read as one)", {"attnkit.plans", "attnkit._blockmask"}),
    ("engines: the backends, the tile-mass engine, the measured table they read",
     {"attnkit.backends", "attnkit._calibrate"}),
    ("the one validation point and the dispatch decision", {"attnkit._request", "attnkit._dispatch"}),
    ("the fast path of a common call, the torch op behind torch.compile", {"attnkit._fast", "attnkit._op",
                                                                          "attnkit.ops"}),
    ("the front door", {"attnkit.api"}),
    ("built on the front door", {"attnkit.explain", "attnkit.tilemass", "attnkit._flex_api", "attnkit.nn",
                                 "attnkit.distributed"}),
    ("other libraries on attnkit", {"attnkit.integrations"}),
    ("pictures: renders only", {"attnkit.viz"}),
    ("applications: load a model, compute, draw", {"attnkit.apps"}),
    ("the package face", {"attnkit"}),
    ("the benchmark harness", {"attnkit.bench"}),
    ("the command line", {"attnkit._cli", "attnkit.cli", "attnkit.__main__"}),
]


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package, by dotted name (a package by its own name: attnkit.viz)."""
    out = {}
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC.parent).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    return out


MODULES = _modules()


def _module_imports(path: pathlib.Path, *, lazy: bool = True) -> set[str]:
    """The attnkit modules ``path`` imports: at module level, and (``lazy``) inside functions,
    classes and ``if TYPE_CHECKING`` blocks too. ``from pkg import name`` counts as importing
    ``pkg.name`` when that is a module, else ``pkg``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    rel = path.relative_to(SRC.parent).with_suffix("")
    pkg = list(rel.parts[:-1])  # "." is the same package from a module and from its package's __init__
    out = set()
    for node in (ast.walk(tree) if lazy else tree.body):
        if isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - (node.level - 1)] if node.level else []
            mod = ".".join(base + (node.module.split(".") if node.module else []))
            if mod.split(".")[0] != "attnkit":
                continue
            out |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "attnkit"}
    return out


def _graph() -> dict[str, set[str]]:
    return {name: {m for m in _module_imports(p) if m != name} for name, p in MODULES.items()}


def test_the_import_scan_sees_lazy_imports():
    # a function-level import is an import: masks.Mask._repr_html_ asks the display registry
    assert "attnkit._display" in _module_imports(MODULES["attnkit.masks"])
    assert "attnkit._display" not in _module_imports(MODULES["attnkit.masks"], lazy=False)
    assert all(m in MODULES for deps in _graph().values() for m in deps), "an import names no module of attnkit"


def test_no_import_cycles():
    g = _graph()
    state: dict[str, int] = {}

    def visit(n, stack):
        state[n] = 1
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack, n, m]))
            if not state.get(m):
                visit(m, [*stack, n])
        state[n] = 2

    for n in sorted(g):
        if not state.get(n):
            visit(n, [])


def _layer(name: str) -> int | None:
    """The layer of a module: its own entry, or its package's (``attnkit`` names the face alone)."""
    for i, (_, names) in enumerate(LAYERS):
        if any(name == x or (x != "attnkit" and name.startswith(x + ".")) for x in names):
            return i
    return None


def test_every_module_stands_in_a_layer():
    assert not [m for m in MODULES if _layer(m) is None], "place these in LAYERS (and docs/architecture.md)"


def test_nothing_imports_upward():
    up = [f"{mod} ({LAYERS[_layer(mod)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
          for mod, deps in sorted(_graph().items()) for d in sorted(deps) if _layer(d) > _layer(mod)]
    assert not up, "\n".join(up)


def test_the_docs_draw_the_same_layers():
    page = (SRC.parent.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = [line for line in page.splitlines() if line.startswith("| ") and line[2:4].strip().isdigit()]
    assert len(rows) == len(LAYERS), rows
    for row, (title, names) in zip(reversed(rows), LAYERS, strict=True):  # the page lists the top first
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == title, (cells[1], title)
        assert set(re.findall(r"`([\w.]+)`", cells[2])) == names, (cells[2], names)


def test_nn_and_integrations_use_only_public_names():
    for sub in ("nn", "integrations"):
        for p in (SRC / sub).rglob("*.py"):
            for d in _module_imports(p):
                parts = d.split(".")
                private = [x for x in parts[1:] if x.startswith("_") and x != "__init__"]
                own = parts[1] == sub
                assert own or not private, f"{p.name} imports private {d}"


def test_the_private_torch_op_is_named_in_one_module_only():
    for p in SRC.rglob("*.py"):
        if p.name == "_flash_cpu.py":
            continue
        text = p.read_text()
        assert "_scaled_dot_product_flash_attention_for_cpu" not in text, p
        assert "_flash_cpu._ops" not in text, p


@pytest.mark.parametrize("where", ["q", "k", "bias"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("L", [1, 64])
def test_sdpa_float_bias_nan_and_inf_follow_eager_without_an_upfront_scan(where, value, L):
    """With a float bias, sdpa no longer scans q, k, v before the kernel; an output row the
    kernel zeroed is still told apart from a row the bias masks (-inf everywhere), and NaN/inf
    in q, k or the bias itself gives eager's NaN pattern."""
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (L, 64, 64))
    bias = torch.randn(1, 1, L, 64, generator=g)
    bias[..., L - 1, :] = float("-inf")  # the last row is fully masked: output 0, not NaN
    t = dict(q=q, k=k, bias=bias)[where]
    t[0, 0, 0, 5] = value
    d = attnkit.dispatch(q, k, v, mask=bias)
    assert d.backend == "sdpa" and d.worker == "fused"
    out = attnkit.attention(q, k, v, mask=bias)
    ref = attnkit.attention(q.double(), k.double(), v.double(), mask=bias.double(), backend="eager")
    assert torch.equal(out.isnan(), ref.isnan()), (out.isnan().sum(), ref.isnan().sum())
    fin = ~ref.isnan()
    assert fin.any() or L == 1
    if fin.any():
        assert (out.double()[fin] - ref[fin]).abs().max().item() <= 1e-5
