"""Which member's share of a synchronous step's gradient is refused (issue 26 item 6)."""

from __future__ import annotations

from fedweave.data_parallel.gradients import refused_shares


def test_a_non_finite_share_is_refused_whatever_the_bounds() -> None:
    assert refused_shares([0.5, float("nan"), 0.25], [0.25, 0.25, 0.5], None, None) == {
        1: "its gradient's norm is nan"
    }
    assert list(refused_shares([float("inf"), 1.0], [0.5, 0.5], 10.0, 100.0)) == [0]


def test_a_share_above_the_absolute_or_the_relative_bound_is_refused() -> None:
    """Shares' norms 0.5, 50, 1 of weights 0.5, 0.25, 0.25: mean gradients' norms 1, 200, 4, lower
    median 4. Ratio 10: 200 > 40 refused, 4 is not. max_grad_norm 3: 200 and 4 refused."""
    norms, weights = [0.5, 50.0, 1.0], [0.5, 0.25, 0.25]
    assert refused_shares(norms, weights, None, 10.0) == {
        1: "its mean gradient's norm 200 is above max_norm_ratio 10 x the median 4"
    }
    assert refused_shares(norms, weights, 3.0, 10.0) == {
        1: "its mean gradient's norm 200 is above max_grad_norm 3",
        2: "its mean gradient's norm 4 is above max_grad_norm 3",
    }
    assert refused_shares(norms, weights, None, 100.0) == {}  # 200 <= 100 x 4


def test_a_member_without_samples_is_judged_by_finiteness_alone() -> None:
    assert refused_shares([0.0, 1.0], [0.0, 1.0], 0.5, 2.0) == {1: "its mean gradient's norm 1 is above max_grad_norm 0.5"}
