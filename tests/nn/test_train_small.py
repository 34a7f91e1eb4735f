"""The building blocks learn: a tiny 2-layer Transformer learns to reverse sequences on the CPU."""

import importlib.util
import sys
import time

import pytest
import torch
from conftest import ROOT

EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))  # the toy task is example code (examples/reverse_task.py), not the library

from reverse_task import TinyTransformer, accuracy, reverse_batch, train_reverse  # noqa: E402


@pytest.fixture
def one_thread():
    # a model this small trains fastest on one thread, and does not stall when the cores are shared
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_tiny_transformer_learns_to_reverse(one_thread):
    t0 = time.perf_counter()
    res = train_reverse(seq_len=6, vocab_size=8, embed_dim=32, num_heads=2, num_layers=2, batch_size=64,
                        steps=800, lr=3e-3, eval_every=50, target=0.995, seed=0)
    x, y = reverse_batch(2048, 6, 8, torch.Generator().manual_seed(123))
    acc = accuracy(res.model, x, y)
    assert acc >= 0.99, f"token accuracy {acc:.4f} after {res.steps} steps ({res.seconds:.1f} s): {res.history}"
    # chance is 1/8: it is the attention that learned the reversal, visible as an anti-diagonal
    res.model.eval()
    with torch.no_grad():
        _, maps = res.model(x[:256], need_weights=True)
    anti = torch.stack([m.mean(0).flip(-1).diagonal(dim1=-2, dim2=-1).mean() for m in maps])  # per layer
    assert anti.max() > 0.3, f"mean anti-diagonal attention per layer {anti.tolist()}"
    # "learns in seconds on a CPU": a generous bound that still catches a slow path (seconds, 1 thread)
    wall = time.perf_counter() - t0
    assert res.seconds < 60 and wall < 90, f"training took {res.seconds:.1f} s ({wall:.1f} s with evaluation)"


def test_tiny_transformer_shapes():
    model = TinyTransformer(5, 4, embed_dim=16, num_heads=2, num_layers=2)
    logits, maps = model(torch.randint(0, 5, (3, 4)), need_weights=True)
    assert logits.shape == (3, 4, 5) and len(maps) == 2 and maps[0].shape == (3, 2, 4, 4)


def test_example_sequence_accuracy_is_eval_mode_without_grad():
    pytest.importorskip("matplotlib", reason="saving attention maps needs matplotlib: pip install 'attnkit[viz]'")
    path = EXAMPLES / "train_reverse.py"
    spec = importlib.util.spec_from_file_location("train_reverse_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = TinyTransformer(5, 4, embed_dim=16, num_heads=2, num_layers=1, dropout=0.5).train()
    seen = []
    model.register_forward_hook(lambda mod, args, out: seen.append((mod.training, torch.is_grad_enabled())))
    x, y = reverse_batch(8, 4, 5, torch.Generator().manual_seed(0))
    acc = example.sequence_accuracy(model, x, y)
    assert seen == [(False, False)] and model.training  # evaluated in eval mode, no graph; mode restored
    with torch.no_grad():  # the value is the eval-mode whole-sequence accuracy (dropout off: deterministic)
        want = (model.eval()(x).argmax(-1) == y).all(-1).float().mean().item()
    assert isinstance(acc, float) and acc == want
