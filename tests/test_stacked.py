"""Rows of one stacked tensor (fedweave.stacked): found only where they are whole rows, their
finiteness read per row, their weighted sum one product equal to the sum of the rows."""

from __future__ import annotations

import pytest
import torch

from fedweave.federated.checks import Rejected, check_finite
from fedweave.stacked import finite_rows, rows_in


def row_of(tensor: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The stack ``tensor`` is a row of (its ``_base``) and the row, by :func:`rows_in` of one tensor."""
    base = tensor._base
    if base is None:
        return None
    row = rows_in(base, [tensor])[0]
    return None if row is None else (base, row)


def at(found: tuple[torch.Tensor, int] | None) -> tuple[int, int] | None:
    """Where a found row lies: its stack's first element's address and the row."""
    return None if found is None else (found[0].data_ptr(), found[1])


def test_a_row_of_a_stack_is_found_with_its_index_and_nothing_else_is() -> None:
    stack = torch.arange(24.0).reshape(4, 2, 3)  # itself a view of the arange: rows of its storage
    rows = stack.unbind(0)
    assert at(row_of(rows[2])) == (stack.data_ptr(), 2)
    assert at(row_of(stack[3])) == (stack.data_ptr(), 3)
    assert row_of(torch.zeros(2, 3)) is None  # a tensor of its own
    assert row_of(stack[1, :, :2]) is None  # part of a row: not contiguous
    assert row_of(stack[:, 0]) is None  # a column: not contiguous
    assert row_of(stack.view(-1)[1:7].view(2, 3)) is None  # as many elements, not at a row's start
    assert row_of(stack.transpose(1, 2)[0]) is None  # a row of the transposed stack: not contiguous
    assert row_of(torch.zeros(26)[2:].view(4, 6)[1]) is None  # its storage is no whole number of such rows
    inner = torch.zeros(4, 6)
    assert at(row_of(inner[1:][0])) == (inner.data_ptr(), 1)  # a row of a view of a stack: counted in the stack


def test_finite_rows_clears_the_finite_rows_only_and_an_edit_undoes_it() -> None:
    stack = torch.ones(4, 3)
    stack[1, 2] = float("nan")
    stack[3, 0] = float("inf")
    rows = stack.unbind(0)
    alone = torch.ones(3)
    cleared = finite_rows([*rows, alone])
    assert cleared.keys() == {(id(rows[0]), rows[0]._version), (id(rows[2]), rows[2]._version)}
    rows[0].add_(1)  # edited since: its version moved, the clearance no longer holds for it
    assert (id(rows[0]), rows[0]._version) not in cleared


def test_finite_rows_leaves_an_overflowing_row_to_the_exact_check() -> None:
    big = torch.finfo(torch.float32).max
    stack = torch.tensor([[big, big], [1.0, 2.0]])
    rows = stack.unbind(0)
    assert finite_rows(list(rows)).keys() == {(id(rows[1]), rows[1]._version)}  # row 0 is finite, but its sum is not


@pytest.mark.parametrize("repoint", ["set_", "data"])
def test_a_view_whose_base_now_holds_other_memory_is_no_row(repoint: str) -> None:
    """A view keeps the storage it was made of when its base is pointed at other memory: its
    storage offset still names a row of the base, whose values are no longer the view's."""
    stack = torch.zeros(3, 4)
    rows = stack.unbind(0)
    stack[1, 2] = float("nan")
    if repoint == "set_":
        stack.set_(torch.ones(3, 4))
    else:
        stack.data = torch.ones(3, 4)
    assert rows[0]._base is stack and not torch.isfinite(rows[1]).all()
    assert row_of(rows[1]) is None
    cleared = finite_rows(list(rows))
    assert (id(rows[1]), rows[1]._version) not in cleared
    with pytest.raises(Rejected, match="NaN or infinite"):
        check_finite({"w": rows[1]}, "tensor", cleared)


def test_a_lazily_negated_view_is_no_row() -> None:
    stack = torch.arange(12.0).view(3, 4).clone()
    rows = [torch._neg_view(row) for row in stack.unbind(0)]
    assert rows[0]._base is stack and rows[0].is_neg()
    assert rows_in(stack, rows) == [None, None, None]  # its values are -stack's: a sum over stack would flip its sign


def test_a_lazily_conjugated_view_of_a_complex_stack_is_no_row() -> None:
    stack = torch.arange(12.0).view(3, 4).to(torch.complex64) * (1 + 1j)
    rows = [row.conj() for row in stack.unbind(0)]
    assert rows[0]._base is stack and rows[0].is_conj()
    assert rows_in(stack, rows) == [None, None, None]  # their values are stack's conjugates
    assert rows_in(stack, list(stack.unbind(0))) == [0, 1, 2]


def test_a_clearance_holds_for_its_tensor_only_not_another_with_its_id() -> None:
    """A tensor freed after it was cleared may leave its id to a new one (with the same version):
    the clearance names the very tensor, and the new one is read."""
    stack = torch.ones(2, 3)
    rows = stack.unbind(0)
    cleared = finite_rows(list(rows))
    impostor = torch.full((3,), float("nan"))
    forged = {(id(impostor), impostor._version): rows[0], **cleared}  # what an id reused would look like
    with pytest.raises(Rejected, match="NaN or infinite"):
        check_finite({"w": impostor}, "tensor", forged)
    check_finite({"w": rows[0], "v": rows[1]}, "tensor", cleared)
