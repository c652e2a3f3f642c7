"""The layout of a synchronous step's tail: the scalars that ride after the gradient in the
one all-reduce (the real multi-process runs are in tests/test_data_parallel.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fedweave.data_parallel.bsp import PER_MEMBER, StepTail, pack_tail, tail_size, tail_slot, unpack_tail

CPU = torch.device("cpu")


def test_the_tail_is_the_loss_then_one_block_of_slots_per_value() -> None:
    assert PER_MEMBER == ("compute", "wait", "oom", "seen", "norm")
    assert tail_size(3) == 16  # loss + 5 blocks of 3
    assert [tail_slot(3, name, 0) for name in PER_MEMBER] == [1, 4, 7, 10, 13]
    assert tail_slot(3, "norm", 2) == 15  # the last slot
    assert tail_size(1) == 6 and [tail_slot(1, name, 0) for name in PER_MEMBER] == [1, 2, 3, 4, 5]


def test_a_member_writes_its_own_slots_and_zeros_elsewhere() -> None:
    tail = pack_tail(3, 1, 0.25, compute=1.5, wait=0.5, oom=1.0, seen=2, norm=3.0, dtype=torch.float64, device=CPU)
    expected = [0.25, 0, 1.5, 0, 0, 0.5, 0, 0, 1.0, 0, 0, 2.0, 0, 0, 3.0, 0]
    assert tail.dtype == torch.float64 and tail.tolist() == expected


def test_the_summed_tails_give_every_member_all_values_by_name() -> None:
    members = [  # (loss share, compute, wait, oom, seen, norm) of ranks 0, 1, 2
        (0.125, 1.0, 0.0, 0.0, 1, 0.5),
        (0.25, 2.0, 0.5, 1.0, 1, float("nan")),  # a NaN share stays in its own slot
        (0.5, 4.0, 0.75, 0.0, 2, 0.25),
    ]
    tails = [
        pack_tail(3, rank, loss, compute=c, wait=w, oom=o, seen=s, norm=g, dtype=torch.float32, device=CPU)
        for rank, (loss, c, w, o, s, g) in enumerate(members)
    ]
    summed = unpack_tail(3, torch.stack(tails).sum(0).double().tolist())  # what the SUM all-reduce gives
    assert summed.norm[0] == 0.5 and math.isnan(summed.norm[1]) and summed.norm[2] == 0.25
    assert dataclasses.replace(summed, norm=[]) == StepTail(
        loss=0.875, compute=[1.0, 2.0, 4.0], wait=[0.0, 0.5, 0.75], oom=[0.0, 1.0, 0.0], seen=[1.0, 1.0, 2.0], norm=[]
    )


@pytest.mark.parametrize("members", [1, 2, 5])
def test_pack_then_unpack_of_one_member_is_that_member_alone(members: int) -> None:
    rank = members - 1
    tail = pack_tail(members, rank, 0.5, compute=3.0, wait=0.25, oom=0.0, seen=7, norm=1.5, dtype=torch.float64,
                     device=CPU)
    unpacked = unpack_tail(members, tail.tolist())
    zeros = [0.0] * (members - 1)
    assert unpacked == StepTail(
        loss=0.5, compute=[*zeros, 3.0], wait=[*zeros, 0.25], oom=[0.0] * members, seen=[*zeros, 7.0],
        norm=[*zeros, 1.5],
    )
