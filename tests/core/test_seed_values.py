"""Hand-checked values of the worked examples (the 3-token and cat/mouse examples, the
sinusoidal encoding, a stable softmax), with the errata that circulate for them corrected.

explain() on (L, D) inputs gives (L, S) scores/weights and (L, Dv) output (the rank rule).
"""

import math

import numpy as np
import pytest
import torch

import attnkit
from attnkit.cli import main

Q = np.array([[1.0, 0], [0, 1], [1, 1]])
K = np.array([[1.0, 1], [1, 0], [0, 1]])
V = np.array([[10.0, 0], [0, 10], [5, 5]])


def test_three_token_example():
    t = attnkit.explain(Q, K, V)
    np.testing.assert_array_equal(t.scores, [[1, 1, 0], [1, 0, 1], [2, 1, 1]])
    np.testing.assert_allclose(t.scaled, t.scores / math.sqrt(2))
    # By hand: e = exp(1/√2) = 2.02811, weights = [e, e, 1] / (2e + 1)
    e = math.exp(1 / math.sqrt(2))
    w = np.array([e, e, 1]) / (2 * e + 1)
    np.testing.assert_allclose(t.weights[0], w, rtol=1e-14)
    np.testing.assert_allclose(t.weights[0], [0.4011, 0.4011, 0.1978], atol=5e-5)
    # First row: 10w0 + 5w2 = 10w1 + 5w2 = 5(2e + 1)/(2e + 1) = 5 exactly
    np.testing.assert_allclose(t.output[0], [5.0, 5.0], rtol=1e-14)
    np.testing.assert_allclose(t.weights.sum(-1), 1.0, rtol=1e-14)
    np.testing.assert_allclose(attnkit.attention(Q, K, V)[0], [5.0, 5.0], rtol=1e-6)


def test_cat_mouse_example_chased():
    q = np.array([[5.0, 1]])
    kv = np.array([[1.0, 0], [2, 3], [4, 4]])
    t = attnkit.explain(q, kv, kv)
    np.testing.assert_array_equal(t.scores[0], [5, 13, 24])
    np.testing.assert_allclose(t.scaled[0], np.array([5, 13, 24]) / math.sqrt(2))
    np.testing.assert_allclose(t.weights[0], [0.000001, 0.000419, 0.999580], atol=1e-6)


def test_sinusoidal_positional_d4():
    pe = attnkit.positional.sinusoidal(2, 4, dtype=torch.float64)
    np.testing.assert_allclose(pe[0].numpy(), [0, 1, 0, 1])
    np.testing.assert_allclose(pe[1].numpy(), [math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)], rtol=1e-14)
    assert round(pe[1, 2].item(), 4) == 0.0100 and round(pe[1, 3].item(), 5) == 0.99995


def test_softmax_is_stable_for_huge_scores():
    # A softmax without max subtraction overflows here; ours must not.
    q = np.full((3, 4), 300.0)
    k = np.full((3, 4), 300.0)
    k[1] = -300
    v = np.eye(3, 4)
    for backend in ("reference", "eager", "sdpa"):
        out = attnkit.attention(q, k, v, backend=backend)
        assert np.isfinite(out).all(), backend
        np.testing.assert_allclose(out[0], (v[0] + v[2]) / 2, atol=1e-12)


def test_cli_explain_default_prints_corrected_numbers(capsys):
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    steps = out[out.index("1. Raw scores"):]  # after the inputs (step 0)
    q0_rows = [line.split("│")[1].split() for line in steps.splitlines() if line.strip().startswith("q0 │")]
    # raw scores, scaled scores, weights, output: the 3-token example's first row at every step
    assert q0_rows == [["1.0000", "1.0000", "0.0000"], ["0.7071", "0.7071", "0.0000"],
                       ["0.4011", "0.4011", "0.1978"], ["5.0000", "5.0000"]]


@pytest.mark.parametrize("example, needle", [("cat", ["chased", "0.000001", "0.000419", "0.999580"]),
                                             ("positional", ["pos1", "0.841471", "0.540302", "0.010000", "0.999950"])])
def test_cli_explain_examples(capsys, example, needle):
    assert main(["explain", "--example", example, "--precision", "6"]) == 0
    rows = [ln.replace("│", " ").split() for ln in capsys.readouterr().out.splitlines()]
    assert needle in rows


def test_cli_explain_random_matches_a_naive_softmax(capsys):
    assert main(["explain", "--example", "random", "--seed", "3", "--precision", "6"]) == 0
    out = capsys.readouterr().out
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((3, 4)) for _ in range(3))
    s = q @ k.T / 2.0  # 1/sqrt(4)
    w = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
    printed = out.split("Output  weights · V", 1)[1].splitlines()[3:6]
    np.testing.assert_allclose([[float(x) for x in ln.split("│")[1].split()] for ln in printed], w @ v, atol=5e-7)


def test_cli_explain_own_files_and_mask(tmp_path, capsys):
    np.save(tmp_path / "q.npy", Q)
    (tmp_path / "k.csv").write_text("\n".join(",".join(map(str, r)) for r in K))
    (tmp_path / "v.json").write_text("[[10, 0], [0, 10], [5, 5]]")
    assert main(["explain", "--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "k.csv"),
                 "--v", str(tmp_path / "v.json"), "--causal"]) == 0
    out = capsys.readouterr().out
    masked_q0 = out.split("3. Masked", 1)[1].splitlines()[3]
    assert masked_q0.split("│")[1].split() == ["0.7071", "-inf", "-inf"]
    # causal: q0 sees only k0 -> output row 0 = V[0]
    last_q0 = [line for line in out.splitlines() if line.strip().startswith("q0 │")][-1]
    assert last_q0.split("│")[1].split() == ["10.0000", "0.0000"]


def test_cli_explain_bad_input(tmp_path, capsys):
    assert main(["explain", "--q", str(tmp_path / "missing.npy"), "--k", "x.npy", "--v", "y.npy"]) == 2
    err = capsys.readouterr().err
    assert "--q" in err and "not found" in err
    assert main(["explain", "--mask", "window:-1"]) == 2
    assert "--mask 'window:-1': size: expected an int >= 1, got -1" in capsys.readouterr().err


def test_cli_masks_draws(capsys):
    assert main(["masks", "causal", "-L", "3", "-S", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == ["q0 # # # . .", "q1 # # # # .", "q2 # # # # #"]
