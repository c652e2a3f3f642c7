"""Top-k's 2-byte positions: packed per block, unpacked for several tensors at once, checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _alone(parts: dict[str, torch.Tensor], numel: int) -> np.ndarray | None:
    """The positions one tensor's fields name, by the definition (None unless increasing and below ``numel``)."""
    low = parts["indices"].numpy().astype(np.int64) + BLOCK // 2
    if "blocks" in parts:
        low += np.repeat(np.arange(parts["blocks"].numel(), dtype=np.int64) * BLOCK, parts["blocks"].numpy())
    return low if not low.size or (low[-1] < numel and bool(np.all(low[1:] > low[:-1]))) else None


@settings(max_examples=300, deadline=None)
@given(numels=st.lists(st.sampled_from([1, 3, 40, BLOCK, BLOCK + 1, 2 * BLOCK + 7]), min_size=1, max_size=4),
       seed=st.integers(0, 2**32 - 1), edits=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**6),
                                                                 st.sampled_from([-2, -1, 1, 2, 40_000, -40_000])), max_size=3))
def test_forged_offsets_and_counts_of_several_tensors_unpack_as_each_alone_or_are_refused(
    numels: list[int], seed: int, edits: list[tuple[int, int, int]]
) -> None:
    """Offsets moved a little or past their block, counts moved between blocks: each tensor's
    positions come out as its own fields name them, offset by the tensors before it, or the
    payload is refused; none lands in another tensor's entries."""
    rng = np.random.default_rng(seed)
    fields = []
    for n in numels:
        chosen = np.sort(rng.choice(n, size=int(rng.integers(1, min(n, 30) + 1)), replace=False))
        fields.append({k: v.clone() for k, v in pack_indices(torch.from_numpy(chosen), n).items()})
    for which, where, by in edits:
        parts = fields[which % len(fields)]
        if "blocks" in parts and by in (-1, 1):  # a count moved to the next or previous block
            counts = parts["blocks"]
            at = where % counts.numel()
            if counts[at] > 0:
                counts[at] -= 1
                counts[(at + by) % counts.numel()] += 1
            continue
        offsets = parts["indices"]
        at = where % offsets.numel()
        offsets[at] = int(np.clip(int(offsets[at]) + by, -(BLOCK // 2), BLOCK // 2 - 1))
    alone = [_alone(parts, n) for parts, n in zip(fields, numels)]
    if any(a is None for a in alone):
        with pytest.raises(ValueError, match="not increasing positions below"):
            unpack_indices(fields, numels)
        return
    starts = np.cumsum([0, *numels[:-1]])
    assert np.array_equal(unpack_indices(fields, numels), np.concatenate([a + s for a, s in zip(alone, starts)]))
