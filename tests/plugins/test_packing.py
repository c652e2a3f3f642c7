"""packing.flatten / unflatten: the whole-update vector of secure aggregation and HE."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from fedweave.plugins.packing import decode_all, encode_fields, flatten, layout, read_layout, unflatten


def payload() -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "steps": torch.tensor(7),  # not floating: travels as it is
        "h": torch.tensor([0.5, -1.5], dtype=torch.float16),
        "b": torch.tensor([2.25], dtype=torch.float64),
    }


def test_flatten_concatenates_the_floating_tensors_in_order_and_unflatten_restores_them() -> None:
    vector, rest = flatten(payload())
    assert vector.dtype == torch.float64 and vector.tolist() == [0, 1, 2, 3, 4, 5, 0.5, -1.5, 2.25]
    assert rest["steps"].item() == 7
    back = unflatten(vector, rest)
    for name, tensor in payload().items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)


def test_flatten_writes_into_an_out_vector_of_any_real_dtype() -> None:
    out = np.full(9, np.nan, dtype=np.float32)
    vector, rest = flatten(payload(), out=out)
    assert out.tolist() == [0, 1, 2, 3, 4, 5, 0.5, -1.5, 2.25]
    assert vector.data_ptr() == torch.from_numpy(out).data_ptr()  # shares out's memory
    assert torch.equal(unflatten(vector, rest)["w"], payload()["w"])


@pytest.mark.parametrize("size", [8, 10])
def test_an_out_vector_of_the_wrong_size_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match=rf"out has shape \({size},\), the floating tensors hold 9 values"):
        flatten(payload(), out=np.zeros(size, dtype=np.float32))


def test_a_layout_reads_back_and_a_dtype_code_out_of_range_is_refused() -> None:
    assert read_layout(layout(torch.zeros(2, 3, dtype=torch.bfloat16))) == (torch.bfloat16, (2, 3))
    for code in (-1, 4, 2**31 - 1):
        with pytest.raises(ValueError, match=f"dtype code {code},"):
            read_layout(torch.tensor([code, 2, 3], dtype=torch.int32))


@pytest.mark.parametrize("value,reason", [
    (torch.zeros(10_000_000, dtype=torch.int64), r"not torch.int64 of shape \(10000000,\)"),
    (torch.zeros(0, dtype=torch.int32), r"not torch.int32 of shape \(0,\)"),
    (torch.tensor([True, False]), "not torch.bool"),
    (torch.tensor([0.0, 3.0]), "not torch.float32"),
    (torch.zeros(2, 2, dtype=torch.int32), r"of shape \(2, 2\)"),
    (torch.tensor([0, 4, -3], dtype=torch.int32), r"shape \(4, -3\), with a negative size"),
])
def test_a_layout_that_no_tensor_has_is_refused_before_it_is_read(value: torch.Tensor, reason: str) -> None:
    """A peer's layout is 1 + at most 64 integers: ten million of them are not turned into
    Python ints (hundreds of MB) to be refused afterwards."""
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=reason):
            read_layout(value)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # bytes of Python objects: ten million ints would be hundreds of MB


def test_a_tensor_without_fields_travels_dense_and_the_others_decode_to_their_layout() -> None:
    tensors = {"a": torch.ones(3), "b": torch.arange(4.0).reshape(2, 2)}
    encoded = encode_fields(tensors, {"a": None, "b": {"v": tensors["b"].reshape(-1) * 2}})
    assert list(encoded) == ["a", "b.__layout", "b.__v"]
    decoded = decode_all(encoded, lambda names, fields, shapes: [f["v"] / 2 for f in fields])
    assert list(decoded) == ["a", "b"] and decoded["a"] is tensors["a"] and torch.equal(decoded["b"], tensors["b"])
