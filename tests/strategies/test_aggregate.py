"""Tests of fedweave.strategies.aggregate against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from fedweave.strategies.aggregate import apply_delta, weighted_average


def test_weighted_mean_by_hand() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(0.0)}
    b = {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor(4.0)}
    out = weighted_average([a, b], [1, 3])
    # (1·1 + 3·3)/4 = 2.5, (1·2 + 3·6)/4 = 5, (0 + 3·4)/4 = 3
    torch.testing.assert_close(out["w"], torch.tensor([2.5, 5.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(out["b"], torch.tensor(3.0), rtol=0, atol=1e-6)


def test_weights_need_not_sum_to_one() -> None:
    a = {"w": torch.tensor([1.0, -1.0], dtype=torch.float64)}
    b = {"w": torch.tensor([4.0, 2.0], dtype=torch.float64)}
    c = {"w": torch.tensor([0.0, 8.0], dtype=torch.float64)}
    expected = torch.tensor([(10 * 1 + 20 * 4 + 70 * 0) / 100, (10 * -1 + 20 * 2 + 70 * 8) / 100], dtype=torch.float64)
    for weights in ([10, 20, 70], [0.1, 0.2, 0.7], [1.0, 2.0, 7.0]):
        out = weighted_average([a, b, c], weights)
        assert out["w"].dtype == torch.float64
        torch.testing.assert_close(out["w"], expected, rtol=0, atol=1e-12)


def test_one_update_is_returned_as_is() -> None:
    a = {"w": torch.tensor([1.5, -2.0])}
    out = weighted_average([a], [37])
    torch.testing.assert_close(out["w"], a["w"], rtol=0, atol=0)
    assert out["w"] is not a["w"]


def test_integer_buffers_take_the_maximum_not_the_sum() -> None:
    a = {"num_batches_tracked": torch.tensor(5), "counts": torch.tensor([1, 9], dtype=torch.int32)}
    b = {"num_batches_tracked": torch.tensor(7), "counts": torch.tensor([4, 2], dtype=torch.int32)}
    c = {"num_batches_tracked": torch.tensor(6), "counts": torch.tensor([3, 3], dtype=torch.int32)}
    out = weighted_average([a, b, c], [100, 1, 1])
    assert out["num_batches_tracked"].item() == 7  # not 18 (sum) nor ~5 (weighted mean)
    assert out["num_batches_tracked"].dtype == torch.int64
    assert out["counts"].tolist() == [4, 9] and out["counts"].dtype == torch.int32


def test_float16_is_accumulated_in_float32_and_returned_as_float16() -> None:
    a = {"w": torch.tensor([1.5, 2.0, 60000.0], dtype=torch.float16)}
    b = {"w": torch.tensor([0.5, 1.0, 60000.0], dtype=torch.float16)}
    out = weighted_average([a, b], [1, 3])
    assert out["w"].dtype == torch.float16
    # (1.5 + 3·0.5)/4 = 0.75, (2 + 3)/4 = 1.25; 60000 stays finite although 4·60000 overflows float16
    torch.testing.assert_close(out["w"], torch.tensor([0.75, 1.25, 60000.0], dtype=torch.float16), rtol=0, atol=0)


def test_bad_inputs() -> None:
    a = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="at least one"):
        weighted_average([], [])
    with pytest.raises(ValueError, match="2 tensor sets but 1 weights"):
        weighted_average([a, a], [1])
    with pytest.raises(ValueError, match="must sum to a positive number, got 0"):
        weighted_average([a, a], [0, 0])


def test_apply_delta_by_hand() -> None:
    params = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    delta = {"w": torch.tensor([0.5, -1.0]), "n": torch.tensor(9)}
    out = apply_delta(params, delta)
    torch.testing.assert_close(out["w"], torch.tensor([1.5, 1.0]), rtol=0, atol=0)
    assert out["n"].item() == 9  # integer values replace, they are not added
    scaled = apply_delta(params, delta, scale=-2.0)
    torch.testing.assert_close(scaled["w"], torch.tensor([0.0, 4.0]), rtol=0, atol=0)
    assert params["w"].tolist() == [1.0, 2.0] and params["n"].item() == 3


def test_the_average_of_rows_of_one_stack_has_the_bits_of_the_same_values_apart() -> None:
    """A cohort's updates are rows of one stacked tensor; the same clients trained in other groups
    or worker processes send tensors of their own: the average must not tell them apart."""
    torch.manual_seed(0)
    stack = {"w": torch.randn(50, 33, 7), "b": torch.randn(50, 7)}
    rows = [{name: t[k] for name, t in stack.items()} for k in range(50)]
    apart = [{name: t.clone() for name, t in r.items()} for r in rows]
    weights = [float(1 + (7 * k) % 13) for k in range(50)]
    order = list(range(49, -1, -1))
    for tensors in ([rows[k] for k in order], [apart[k] for k in order]):
        out = weighted_average(tensors, [weights[k] for k in order])
        expected = {name: torch.zeros_like(t[0]) for name, t in stack.items()}
        for k in order:  # one input after another, in the order given
            for name in expected:
                expected[name].add_(apart[k][name], alpha=weights[k] / sum(weights))
        assert all(torch.equal(out[name], expected[name]) for name in expected)


def test_the_average_of_some_rows_reads_those_rows_alone() -> None:
    stack = torch.ones(3, 5)
    stack[0] = float("nan")  # a row left out (rejected): never read, not weighted 0
    rows = stack.unbind(0)
    out = weighted_average([{"w": rows[1]}, {"w": rows[2]}], [1.0, 3.0])
    assert torch.equal(out["w"], torch.ones(5))
