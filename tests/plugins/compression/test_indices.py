"""Top-k's 2-byte positions: packed per block, unpacked for several tensors at once, checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedweave.plugins.compression.indices import BLOCK, check_packed, pack_indices, unpack_indices


def _packed(*positions: int, numel: int) -> dict[str, torch.Tensor]:
    return pack_indices(torch.tensor(positions, dtype=torch.int64), numel)


def test_positions_travel_as_offsets_in_their_block_with_a_count_per_block() -> None:
    fields = _packed(3, 65_535, 65_536, 70_000, numel=2 * BLOCK + 5)
    assert fields["indices"].tolist() == [3 - 32_768, 65_535 - 32_768, -32_768, 70_000 - 65_536 - 32_768]
    assert fields["indices"].dtype == torch.int16
    assert fields["blocks"].tolist() == [2, 2, 0]
    assert "blocks" not in _packed(0, 9, numel=BLOCK)  # one block: no counts


def test_several_tensors_unpack_laid_end_to_end() -> None:
    """Tensor i's positions come offset by the entries of the tensors before it: 10, then
    2 * BLOCK + 5 (two counts), then 1."""
    numels = [10, 2 * BLOCK + 5, 1]
    fields = [_packed(0, 9, numel=10), _packed(3, 65_536, 131_076, numel=numels[1]), _packed(0, numel=1)]
    got = unpack_indices(fields, numels)
    assert got.tolist() == [0, 9, 10 + 3, 10 + 65_536, 10 + 131_076, 10 + 2 * BLOCK + 5]
    assert got.dtype == np.int64


def test_random_sorted_positions_round_trip() -> None:
    rng = np.random.default_rng(0)
    numels = [300_000, 7, 65_536, 65_537]
    chosen = [np.sort(rng.choice(n, size=max(1, n // 50), replace=False)) for n in numels]
    fields = [pack_indices(torch.from_numpy(c), n) for c, n in zip(chosen, numels)]
    offsets = np.cumsum([0, *numels[:-1]])
    assert np.array_equal(unpack_indices(fields, numels), np.concatenate([c + o for c, o in zip(chosen, offsets)]))


@pytest.mark.parametrize("positions,numel", [((5, 5), 10), ((6, 2), 10), ((70_000,), 70_000)])
def test_positions_not_increasing_or_past_the_end_are_refused(positions: tuple[int, ...], numel: int) -> None:
    good = _packed(1, numel=4)
    bad = pack_indices(torch.tensor(sorted(positions)), numel)
    bad["indices"] = pack_indices(torch.tensor(positions), numel)["indices"]
    with pytest.raises(ValueError, match=f"not increasing positions below {numel}"):
        unpack_indices([good, bad], [4, numel])


def test_an_offset_past_a_short_tensor_is_refused_not_read_as_the_next_tensor_s() -> None:
    """Tensor 0 has 4 entries; an offset of 6 would land on tensor 1's third entry."""
    fields = [{"indices": torch.tensor([6 - 32_768], dtype=torch.int16)}, _packed(5, numel=8)]
    with pytest.raises(ValueError, match="below 4"):
        unpack_indices(fields, [4, 8])


def test_counts_are_checked_before_unpacking() -> None:
    fields = _packed(1, 70_000, numel=70_001)
    check_packed(fields, 70_001, 2)
    with pytest.raises(ValueError, match="do not sum"):
        check_packed({**fields, "blocks": torch.tensor([2, 1], dtype=torch.int32)}, 70_001, 2)
    with pytest.raises(ValueError, match="sends 3"):
        check_packed(fields, 70_001, 3)
    with pytest.raises(ValueError, match="one block"):
        check_packed(fields, 100, 2)
