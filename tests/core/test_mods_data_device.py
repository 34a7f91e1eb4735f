"""Where a user's mod keeps its data (attnkit._mods.data_device, _mods.call): a GPU user's mask_mod reads its
document ids on the GPU while attnkit builds plans on the CPU. The GPU half (CUDA ids, a CUDA bias table, every
backend, gradients) is tests/backends/test_gpu.py, run on a GPU machine by tools/gpu_check.sh; here the search for
the data's device (a "meta" tensor stands in for a GPU one) and the CPU calls it must leave alone."""

from __future__ import annotations

import functools

import torch

from attnkit import _mods


def test_data_device_finds_a_tensor_wherever_a_mod_reads_it():
    far = torch.zeros(4, device="meta")

    def inner(b, h, q, kv):
        return far[q] == far[kv]

    def outer(b, h, q, kv):  # reads it through a function it calls
        return inner(b, h, q, kv) & (q >= kv)

    box = {"ids": far}
    in_dict = lambda b, h, q, kv: box["ids"][q] == 0  # noqa: E731

    def with_default(b, h, q, kv, t=far):
        return t[q] == 0

    part = functools.partial(lambda t, b, h, q, kv: t[q] == 0, far)
    from torch.nn.attention.flex_attention import and_masks

    combined = and_masks(lambda b, h, q, kv: q >= kv, inner)  # its parts kept in a tuple
    for fn in (inner, outer, in_dict, with_default, part, combined):
        assert _mods.data_device(fn) == torch.device("meta"), fn


def test_cpu_mods_are_called_as_they_are():
    near = torch.arange(8) // 3
    seen = []

    def mod(b, h, q, kv):
        seen.append(q.device)
        return near[q] == near[kv]

    assert _mods.data_device(mod) is None and _mods.data_device(lambda b, h, q, kv: q >= kv) is None
    q, kv = torch.arange(8).view(8, 1), torch.arange(8).view(1, 8)
    out = _mods.call(mod, 0, 0, q, kv)
    assert torch.equal(out, near[q] == near[kv]) and seen == [torch.device("cpu")]


def test_an_error_that_is_not_about_devices_is_the_users():
    def bad(b, h, q, kv):
        raise RuntimeError("the user's own bug")

    try:
        _mods.call(bad, 0, 0, torch.arange(2), torch.arange(2))
    except RuntimeError as e:
        assert "the user's own bug" in str(e)
    else:  # pragma: no cover
        raise AssertionError("the error was swallowed")


def test_only_a_device_clash_is_retried():
    """A RuntimeError of the user's own (a bad view), an out-of-memory error, a mod whose sources fail when looked at
    (a mock): raised as they are, never run again elsewhere."""
    from unittest import mock

    calls = []
    helper = mock.Mock()  # a global the mod names: looking into it must not replace the user's error

    def bad(b, h, q, kv):
        calls.append(1)
        helper.touch()
        return torch.arange(6).view(7)  # the user's bug

    try:
        _mods.call(bad, 0, 0, torch.arange(2), torch.arange(2))
    except RuntimeError as e:
        assert "shape '[7]'" in str(e) and calls == [1]
    else:  # pragma: no cover
        raise AssertionError("the error was swallowed")


def test_data_device_reads_only_the_first_items_of_a_big_container():
    import time

    big = list(range(1_000_000))

    def mod(b, h, q, kv):
        return kv < len(big)

    t = time.perf_counter()
    assert _mods.data_device(mod) is None
    assert time.perf_counter() - t < 0.05


def test_a_subclass_of_a_built_in_score_mod_keeps_its_own_call_on_a_device():
    from attnkit import score_mods as SM

    class Clipped(SM.RelativeBias):
        def __call__(self, score, b, h, q_idx, kv_idx):
            return super().__call__(score, b, h, q_idx, kv_idx).clamp(max=0)

    class Scaled(SM.Alibi):
        def __call__(self, score, b, h, q_idx, kv_idx):
            return 2 * super().__call__(score, b, h, q_idx, kv_idx)

    for m in (Clipped(torch.randn(2, 5)), Scaled(torch.tensor([0.5, 0.25]))):
        assert m.on_device(torch.device("cpu")) is m
