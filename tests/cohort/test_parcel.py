"""What a run's processes hand each other: tensors back with their values, dtypes, shapes and
strides; a stack's rows sent once and back as rows of one tensor; large storages through shared
memory, small ones by value (the sender's left where they are)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedweave.cohort import parcel
from fedweave.cohort.parcel import pack, unpack
from fedweave.stacked import finite_rows


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.float32).view(3, 4),
        torch.arange(12, dtype=torch.float64).view(3, 4).t(),  # not contiguous
        torch.arange(20, dtype=torch.int64)[5:11],  # an offset into its storage
        torch.tensor(2.5, dtype=torch.bfloat16),  # 0-dim
        torch.tensor([True, False, True]),
        torch.arange(6, dtype=torch.float16)[::2],
        torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
    ],
    ids=["float32", "transposed", "offset", "bfloat16-0d", "bool", "strided-half", "complex"],
)
def test_a_plain_tensor_comes_back_as_it_was_sent(tensor: torch.Tensor) -> None:
    back = unpack(pack({"t": tensor, "n": 3}))
    assert back["n"] == 3 and _same(back["t"], tensor)
    assert back["t"].storage_offset() == tensor.storage_offset()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(3, requires_grad=True),
        lambda: nn.Parameter(torch.arange(4.0)),
        lambda: torch.zeros(0),
        lambda: torch.eye(3).to_sparse(),
    ],
    ids=["requires-grad", "parameter", "empty", "sparse"],
)
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's rebuild of a sparse tensor
def test_any_other_tensor_goes_torch_s_way_with_its_values(make) -> None:
    tensor = make()
    back = unpack(pack([tensor]))[0]
    assert type(back) is type(tensor) and back.requires_grad == tensor.requires_grad
    if tensor.layout is torch.strided:
        assert torch.equal(back.detach(), tensor.detach())
    else:
        assert torch.equal(back.to_dense(), tensor.to_dense())


@pytest.mark.parametrize(
    "tensor", [torch.arange(4.0)._neg_view(), torch.tensor([1 + 2j, 3 - 4j]).conj()], ids=["negated", "conjugated"]
)
def test_a_lazy_view_comes_back_with_its_values(tensor: torch.Tensor) -> None:
    """torch's own reduction drops the lazy bit (the values come back negated): sent as its values."""
    back = unpack(pack(tensor))
    assert torch.equal(back, tensor.resolve_conj().resolve_neg()) and not back.is_neg() and not back.is_conj()


def test_a_stack_s_rows_travel_once_and_come_back_rows_of_one_tensor() -> None:
    stack = torch.randn(100, 64)  # 25.6 KB: by value
    rows = list(stack.unbind(0))
    data = pack(rows)
    assert stack.nbytes < len(data) < stack.nbytes + 100 * 120  # one copy of the stack, a few bytes a row
    back = unpack(data)
    assert all(_same(b, r) for b, r in zip(back, rows))
    assert len({b.untyped_storage().data_ptr() for b in back}) == 1 and back[0]._base is not None
    cleared = finite_rows(back)  # read at once, as the rows of the stack the cohort trained
    assert all(cleared.get((id(b), b._version)) is b for b in back)


def test_two_dtypes_viewing_one_storage_each_come_back_as_they_were() -> None:
    base = torch.arange(8, dtype=torch.int32)
    as_float = base.view(torch.float32)
    back = unpack(pack([base, as_float]))
    assert _same(back[0], base) and _same(back[1], as_float)


def test_what_comes_back_by_value_is_its_own_and_writable() -> None:
    sent = torch.zeros(4)
    back = unpack(pack(sent))
    back += 1
    assert torch.equal(sent, torch.zeros(4)) and torch.equal(back, torch.ones(4))
    assert not sent.is_shared() and not back.is_shared()


def test_a_large_storage_goes_through_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parcel, "SHARE_BYTES", 1024)
    small, large = torch.arange(16.0), torch.arange(1024.0)  # 64 B by value; 4 KB shared
    data = pack([small, large, large[10:20]])
    assert len(data) < 1024  # the large storage is not in the pickle
    back = unpack(data)
    assert large.is_shared() and back[1].is_shared() and not small.is_shared() and not back[0].is_shared()
    assert _same(back[0], small) and _same(back[1], large) and _same(back[2], large[10:20])
    assert back[2].untyped_storage().data_ptr() == back[1].untyped_storage().data_ptr()
