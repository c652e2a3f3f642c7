"""What a run's processes hand each other: tensors back with their values, dtypes, shapes and
strides; a stack's rows sent once and back as rows of one tensor; large storages through shared
memory, small ones by value (the sender's left where they are)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
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
    assert back[2]._base is back[1]._base  # one flat: the storage known after its move as before


def _echo(inbox, outbox) -> None:  # another process: what it gets, unpacked, packed again, sent back
    outbox.put(pack(unpack(inbox.get())))
    inbox.get()  # alive until told: a shared storage's descriptor is handed over by this process on request


def test_a_parcel_crosses_to_another_process_and_back() -> None:
    context = mp.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    process = context.Process(target=_echo, args=(inbox, outbox), daemon=True)
    process.start()
    try:
        large, small = torch.randn(100, 4096), torch.randn(100, 64)  # 1.6 MB through shared memory, 25.6 KB by value
        sent = {"large": list(large.unbind(0)), "small": list(small.unbind(0)), "n": 7}
        inbox.put(pack(sent))
        back = unpack(outbox.get(timeout=120))
    finally:
        inbox.put(None)
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    assert back["n"] == 7
    for name in ("large", "small"):
        assert all(_same(b, r) for b, r in zip(back[name], sent[name]))
        assert len({id(b._base) for b in back[name]}) == 1  # rows of one tensor again
    assert back["large"][0].is_shared() and not back["small"][0].is_shared()


def test_tensors_of_two_storages_that_start_at_one_address_each_come_back_as_they_were() -> None:
    """A storage is known by itself, not by its address: one of part of an array, then one of all of it."""
    array = np.arange(10.0)
    part, whole = torch.from_numpy(array[:2]), torch.from_numpy(array)
    assert part.data_ptr() == whole.data_ptr()
    back = unpack(pack([part, whole]))
    assert _same(back[0], part) and _same(back[1], whole)


def test_negated_views_of_storages_moved_to_shared_memory_each_come_back_with_their_own_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each view's values are a storage made while pickling, moved to shared memory, its old memory
    freed for the next one's: known by its address, the next came back with the values of the last."""
    monkeypatch.setattr(parcel, "SHARE_BYTES", 1024)
    for _ in range(10):
        views = [torch.randn(300)._neg_view() for _ in range(4)]  # 1.2 KB each: shared
        back = unpack(pack(views))
        assert all(torch.equal(b, v.resolve_neg()) for b, v in zip(back, views))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_tensor_goes_torch_s_way() -> None:
    tensor = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)])
    back = unpack(pack(tensor))
    assert back.is_nested and all(torch.equal(b, t) for b, t in zip(back.unbind(), tensor.unbind()))


@pytest.mark.parametrize("share_bytes", [parcel.SHARE_BYTES, 1024], ids=["by-value", "shared"])
def test_a_row_with_a_nan_is_not_cleared_when_back(monkeypatch: pytest.MonkeyPatch, share_bytes: int) -> None:
    monkeypatch.setattr(parcel, "SHARE_BYTES", share_bytes)
    stack = torch.randn(10, 64)
    stack[7, 3] = float("nan")
    back = unpack(pack(list(stack.unbind(0))))
    cleared = finite_rows(back)
    assert [cleared.get((id(b), b._version)) is b for b in back] == [i != 7 for i in range(10)]
