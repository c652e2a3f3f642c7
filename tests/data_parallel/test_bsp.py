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


def test_batch_norm_statistics_are_the_b_i_weighted_mean_of_the_workers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 26 item 12: running statistics are averaged with the gradients, each worker's weighted by
    b_i / B. Inputs normalised first, the statistics follow from the samples each worker took at
    each step (unequal, speeds 1:2:4): r ← (1 − m) r + m Σ_i (b_i / B) stat(chunk_i), the variance
    unbiased per chunk, as BatchNorm keeps it. Equal weights, or no averaging (each worker its own,
    rank 0's model saved), give other statistics."""
    from fedweave import config as config_mod
    from fedweave import data_parallel
    from fedweave.data_parallel.sampler import GlobalSampler
    from fedweave.task import load_dataset

    config = config_mod.load(None, [
        "mode=data_parallel", "task.dataset=synthetic", "task.dataset_options={samples: 300, features: 4, classes: 3}",
        "task.model=data_parallel.models:input_bn_mlp64", "task.model_options={hidden: [8]}",
        "data_parallel.workers=3", "data_parallel.global_batch=60", "data_parallel.epochs=2", "data_parallel.log_every=1",
        "data_parallel.timeout=10", "data_parallel.controller.every=2", "heterogeneity.speeds=[1, 2, 4]",
    ])
    records = data_parallel.execute(data_parallel.prepare(config, tmp_path / "run"))
    ds = load_dataset(config.task.dataset, seed=config.seed, test_fraction=config.task.test_fraction,
                      options=config.task.dataset_options)
    x = ds.x_train.double()
    sampler = GlobalSampler(len(ds.y_train), config.seed)
    mean, var, m = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 0.1
    sizes_seen = set()
    for record in records:
        sizes = [round(b) for b in record["batch"]]
        sizes_seen.add(tuple(sizes))
        total = sum(sizes)
        chunks = [x[torch.from_numpy(i)] for i in sampler.take(sizes)]
        mean = (1 - m) * mean + m * sum(len(c) / total * c.mean(0) for c in chunks)
        var = (1 - m) * var + m * sum(len(c) / total * c.var(0, unbiased=True) for c in chunks)
        sampler.advance(total)
    assert [r["step"] for r in records] == list(range(1, 9))  # every step (240 samples, 60 a step, 2 epochs)
    assert any(len(set(s)) > 1 for s in sizes_seen)  # unequal b_i
    saved = torch.load(tmp_path / "run" / "model.pt")
    torch.testing.assert_close(saved["inner.0.running_mean"], mean, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(saved["inner.0.running_var"], var, rtol=1e-9, atol=1e-12)
