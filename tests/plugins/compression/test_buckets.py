"""The bucket layout: the matrix, the draws, and reading fields that share one buffer."""

from __future__ import annotations

import time

import pytest
import torch

from fedweave.plugins.compression.buckets import Buckets, layout, nonzero, products, stochastic_round


def test_matrix_lays_tensors_out_as_zero_padded_rows_and_refuses_a_wrong_size() -> None:
    b = Buckets([5, 3], 4)
    assert (b.rows, b.total, b.padding_rows.tolist()) == ([2, 1], 3, [1, 2])
    rows, entries = b.matrix([torch.arange(1.0, 6.0), -torch.ones(3)], magnitudes=True)
    assert torch.equal(rows, torch.tensor([[1.0, 2, 3, 4], [5, 0, 0, 0], [1, 1, 1, 0]]))
    assert [e.tolist() for e in entries] == [[1.0, 2, 3, 4, 5], [1.0, 1, 1]]
    assert all(e.data_ptr() >= rows.data_ptr() for e in entries)  # views of the matrix
    rows, entries = Buckets([6, 4], 2).matrix([-torch.arange(6.0).view(2, 3), torch.ones(2, 2)])
    assert torch.equal(rows, torch.tensor([[-0.0, -1], [-2, -3], [-4, -5], [1, 1], [1, 1]]))
    assert [e.shape for e in entries] == [(2, 3), (2, 2)] and Buckets([6, 4], 2).padding_rows is None
    with pytest.raises(ValueError, match="hold 4 entries, the layout 3"):
        b.matrix([torch.zeros(5), torch.zeros(4)])


def test_where_each_tensor_starts_and_a_layout_of_many_tensors_built_in_one_pass() -> None:
    """A peer picks which of the model's tensors it encodes, and each new pick builds a layout:
    the starts were each a sum over every earlier tensor, 1.7 s for 20,000 tensors (12 s of CPU for
    these 50,004). Timed in this thread's CPU time, which other processes' load does not add to."""
    b = Buckets([5, 3, 9], 4)
    assert (b.row_starts, b.starts) == ([0, 2, 3], [0, 8, 12])
    numels = [1 + i % 9 for i in range(9 * 5_556)]  # buckets of 4: 1, 1, 1, 1, 2, 2, 2, 2, 3 rows
    begin = time.thread_time()
    many = Buckets(numels, 4)
    assert time.thread_time() - begin < 1.0
    assert many.row_starts[9 * 1000 + 5] == 15 * 1000 + 6 and many.starts[-1] == 4 * many.row_starts[-1]
    assert many.total == many.row_starts[-1] + 3


def test_layouts_are_built_once() -> None:
    assert layout((5, 3), 4) is layout((5, 3), 4) and layout((5, 3), 4) is not layout((5, 3), 2)


def test_draws_are_torch_rand_of_each_tensors_rows_from_a_generator_of_its_seed() -> None:
    b = Buckets([5, 3, 9], 4)
    seeds = [7, 2**62 + 5, 7]
    noise = b.draws(seeds)
    want = [torch.rand((rows, 4), generator=torch.Generator().manual_seed(seed)) for seed, rows in zip(seeds, b.rows)]
    assert torch.equal(noise, torch.cat(want))
    out = torch.empty(6, 4)
    assert b.draws(seeds, out=out) is out and torch.equal(out, noise)


def test_joined_is_a_view_of_the_buffer_only_when_the_fields_lie_where_the_layout_puts_them() -> None:
    b = Buckets([5, 3], 4)
    buffer = torch.arange(12, dtype=torch.int8)
    fields = b.entries(buffer)
    joined = b.joined(fields)
    assert joined is not None and joined.data_ptr() == buffer.data_ptr() and torch.equal(joined, buffer.view(3, 4))
    column = b.joined(b.per_bucket(torch.arange(3.0)), per_bucket=True)
    assert column is not None and torch.equal(column, torch.arange(3.0).view(3, 1))
    assert b.joined([f.clone() for f in fields]) is None  # separate tensors
    assert b.joined(fields[::-1]) is None  # in another order
    assert b.joined([fields[0], buffer[9:12]]) is None  # one starts elsewhere
    assert b.joined([fields[0], buffer[8:10]]) is None  # one of another size
    short = torch.arange(11, dtype=torch.int8)  # the last tensor's padding past the buffer's end
    assert b.joined([short[0:5], short[8:11]]) is None and b.joined([buffer[0:5], buffer[8:11]]) is not None


def test_products_are_the_same_one_rounding_whether_or_not_the_fields_share_a_buffer() -> None:
    b = Buckets([5, 3], 4)
    codes = torch.tensor([3, -7, 127, 0, -128, 5, 9, -1, 0, 0, 0, 0], dtype=torch.int8)
    per = torch.tensor([0.1, 1e-30, 3.3])
    want = codes.to(torch.float32).view(3, 4) * per.view(3, 1)
    shared = products(b, b.entries(codes), b.per_bucket(per), "levels", "norms")
    copied = products(b, [c.clone() for c in b.entries(codes)], [p.clone() for p in b.per_bucket(per)], "levels", "norms")
    for got in (shared, copied):
        assert got.dtype == torch.float32
        assert all(torch.equal(g, w) for g, w in zip(b.entries(got.view(-1)), b.entries(want.view(-1))))
    with pytest.raises(ValueError, match="norms hold 2 entries, the layout's buckets are 1"):
        products(b, b.entries(codes), [per[:2], per[:2]], "levels", "norms")


def test_nonzero_and_stochastic_round() -> None:
    assert torch.equal(nonzero(torch.tensor([0.0, 2.5, float("nan")])), torch.tensor([1.0, 2.5, 1.0]))
    scaled = torch.tensor([0.25, 1.75, 3.0, 2.5])
    noise = torch.tensor([0.2, 0.8, 0.0, 0.5])  # up where below the fraction: 0.2 < 0.25, 0.8 > 0.75, 0 = 0, 0.5 = 0.5
    assert torch.equal(stochastic_round(scaled.clone(), noise.clone()), torch.tensor([1.0, 1.0, 3.0, 2.0]))
    out = torch.empty(4)
    assert stochastic_round(scaled, noise, out=out) is out and torch.equal(out, torch.tensor([1.0, 1.0, 3.0, 2.0]))


def test_products_of_float32_fields_sharing_a_buffer_leave_the_fields_as_they_were() -> None:
    """Joined float32 fields would be their own float32 copy: the product must not land in them."""
    b = Buckets([5, 3], 4)
    buffer = torch.arange(12.0)
    per = torch.tensor([2.0, 3.0, 0.5])
    got = products(b, b.entries(buffer), b.per_bucket(per), "values", "scales")
    assert torch.equal(buffer, torch.arange(12.0)) and torch.equal(per, torch.tensor([2.0, 3.0, 0.5]))
    assert [e.tolist() for e in b.entries(got.view(-1))] == [[0.0, 2, 4, 6, 12], [4.0, 4.5, 5]]
