"""A vectorised cohort trains the model the sequential loop trains, for every eligible strategy."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.federated import rounds as loop
from fedweave.cohort.transport import CohortTransport
from fedweave.cohort.workers import WorkerPool
from fedweave.transports.inmemory import InMemoryTransport

BASE = [
    "clients=6",
    "rounds=5",
    "task.dataset=digits",
    "task.model_options={hidden: [16]}",
    "task.partition={scheme: dirichlet, alpha: 0.5}",  # unequal client sizes: unequal steps, masked
    "local={epochs: 1, batch_size: 16, lr: 0.1}",
    "eval.every=0",
    "eval.federated_every=0",
    "checkpoint.every=0",
    "seed=3",
]


def trained(tmp_path: Path, cohort: str, overrides: list[str]) -> tuple[dict[str, torch.Tensor], list, object]:
    r = runner.prepare(config_mod.load(None, [*BASE, *overrides, f"simulation.cohort={cohort}"]), tmp_path / cohort)
    params, records = r.params, []
    for rnd in range(1, 6):
        params, record = loop.train_round(r.parts, rnd, params)
        records.append(record)
    return params, records, r.parts.topology.transport


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(
        float((a[k].double() - b[k].double()).abs().max() / a[k].double().abs().max().clamp_min(1e-12))
        for k in a
        if a[k].is_floating_point()
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["strategy=fedavg"],
        ["strategy=fedavg", "local.momentum=0.9", "local.weight_decay=0.01"],
        ["strategy=fedavg", "local.optimizer=adam", "local.lr=0.01"],
        ["strategy={name: fedprox, mu: 0.1}"],
        ["strategy=fedavgm"],
        ["strategy=fedadam"],
        ["strategy=fednova", "local.momentum=0.5"],
        ["strategy=scaffold"],
        ["strategy={name: scaffold, option: I}"],
        ["strategy=fedavg", "aggregation.rule=median"],
        ["strategy=fedavg", "local.steps=4", "local.batch_size=64"],  # more steps than a small client's data: passes wrap
        ["strategy=fedavg", "task.model=cnn", "task.model_options={channels: [4], hidden: 8, batch_norm: true}"],
    ],
    ids=["fedavg", "momentum-wd", "adam", "fedprox", "fedavgm", "fedadam", "fednova", "scaffold", "scaffold-I",
         "median", "steps", "cnn-bn"],
)
def test_cohort_and_sequential_train_the_same_model(tmp_path: Path, overrides: list[str]) -> None:
    off, off_records, off_link = trained(tmp_path, "off", overrides)
    cnn = "task.model=cnn" in overrides  # auto leaves convolutions on a CPU to the sequential loop: a group size
    on, on_records, on_link = trained(tmp_path, "64" if cnn else "auto", overrides)
    assert isinstance(off_link, InMemoryTransport) and isinstance(on_link, CohortTransport)
    assert on_link.reason is None  # it did train in cohorts
    assert relative_difference(off, on) < 1e-5
    for a, b in zip(off_records, on_records):
        assert a["clients_completed"] == b["clients_completed"] == 6
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    start = runner.prepare(config_mod.load(None, [*BASE, *overrides]), tmp_path / "start").params
    assert relative_difference(start, on) > 1e-3  # the rounds did move the model


def test_a_frozen_parameter_trains_with_the_value_the_client_received(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parameter without gradient stays as the broadcast has it, and the client's forward uses that
    value, not whatever the runtime's own copy of the model holds (its initial draw: another one)."""
    (tmp_path / "frozen_first.py").write_text(textwrap.dedent("""
        from torch import nn

        def model(input_shape, num_classes, hidden):
            m = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, num_classes))
            m[1].weight.requires_grad_(False)
            return m
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = ["task.model=frozen_first:model"]
    off, _, _ = trained(tmp_path, "off", overrides)
    on, _, link = trained(tmp_path, "auto", overrides)
    assert link.reason is None  # it did train in cohorts (through vmap: a frozen parameter is off the fast path)
    assert relative_difference(off, on) < 1e-5


@pytest.mark.parametrize(
    "overrides",
    [
        ["strategy=fedavg"],
        ["strategy=fedavg", "local.optimizer=adam", "local.lr=0.01"],
        ["strategy={name: fedprox, mu: 0.1}"],
        ["strategy=scaffold"],
        ["strategy=fedavg", "aggregation.rule=median"],
        ["strategy=fedavg", "local.batch_size=2048"],  # every client smaller than a batch: padded to the largest client
        ["strategy=fedavg", "local.batch_size=7"],  # an odd batch: padded to 8 (MKL sums some odd widths by place)
        ["strategy=scaffold", "local.batch_size=10", "task.model_options={hidden: [24, 8]}"],
        ["task.dataset=diabetes", "task.kind=regression", "task.partition={scheme: quantity}", "local.batch_size=32"],
    ],
    ids=["fedavg", "adam", "fedprox", "scaffold", "median", "small-clients", "batch-7", "batch-10-two-hidden",
         "regression-one-output"],
)
@pytest.mark.parametrize("cohort", ["1", "3"])
def test_other_groupings_train_the_model_of_one_group_bit_for_bit(
    tmp_path: Path, overrides: list[str], cohort: str
) -> None:
    """A client's update does not depend on the other clients of its group nor on its place there
    (its batches padded to a width of its own, each product and reduction its own), nor the average
    on how the updates lie: groups of one and of three (odd places) against one group."""
    one, one_records, _ = trained(tmp_path / "all", "auto", overrides)
    other, other_records, _ = trained(tmp_path / cohort, cohort, overrides)
    assert all(torch.equal(one[k], other[k]) for k in one)
    assert [r["train_loss"] for r in one_records] == [r["train_loss"] for r in other_records]


def test_two_threads_and_groups_of_two_train_the_model_of_one_thread_and_one_group(tmp_path: Path) -> None:
    """Wide enough layers for the products to run on both threads: each client's still computed on
    one, a client that steps alone at the end of a group too (MKL would split a lone product)."""
    wide = ["task.model_options={hidden: [256]}", "clients=12"]
    before = torch.get_num_threads()
    try:  # the run sets the process's threads
        one, _, _ = trained(tmp_path / "one", "auto", [*wide, "threads=1"])
        two, _, _ = trained(tmp_path / "two", "2", [*wide, "threads=2"])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_groups_through_vmap_train_the_model_of_one_group_to_rounding(tmp_path: Path) -> None:
    """Convolutions with per-client weights run as one grouped convolution, whose sums depend on
    the group: the same model to float rounding, not bit for bit."""
    overrides = ["task.model=cnn", "task.model_options={channels: [4], hidden: 8}"]
    one, _, _ = trained(tmp_path / "all", "6", overrides)
    pairs, _, _ = trained(tmp_path / "pairs", "2", overrides)
    assert relative_difference(one, pairs) < 1e-5


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (["strategy=moon", "task.model_options={hidden: [16]}"], "runs its own training loop"),
        (["strategy=ditto"], "runs its own training loop"),
        (["task.model_options={hidden: [16], dropout: 0.2}"], "dropout"),
        (["plugins.client_receive=[{name: dpsgd, noise_multiplier: 0.5, seeded_noise: true}]"], "taken over by a plugin"),
        (["task.model=cnn", "task.model_options={channels: [4], hidden: 8}"], "cohort auto on a CPU: the model's convolutions"),
        (["task.loss=torch.nn.functional:cross_entropy"], "the loss is not a built-in mean over examples"),
    ],
    ids=["moon", "ditto", "dropout", "dpsgd", "auto-cnn-cpu", "user-loss"],
)
def test_an_ineligible_run_trains_sequentially_and_says_why_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, overrides: list[str], why: str
) -> None:
    off, _, _ = trained(tmp_path, "off", overrides)
    with caplog.at_level(logging.INFO, logger="fedweave.cohort.trainer"):
        on, _, _ = trained(tmp_path, "auto", overrides)
    lines = [r.getMessage() for r in caplog.records if r.name == "fedweave.cohort.trainer"]
    assert len(lines) == 1 and why in lines[0]
    assert all(torch.equal(off[k], on[k]) for k in off)  # the same sequential loop, bit for bit


@pytest.mark.parametrize("cohort", ["off", "auto"])
def test_two_workers_train_the_model_of_one_bit_for_bit(tmp_path: Path, cohort: str) -> None:
    """Each client's work is its own (its seeds are its round's and its id's; in a cohort, its
    products its own): the same bits in whichever process, in whichever group."""
    one, _, _ = trained(tmp_path / "one", cohort, ["strategy=scaffold"])
    r = runner.prepare(
        config_mod.load(None, [*BASE, "strategy=scaffold", f"simulation.cohort={cohort}", "simulation.workers=2"]),
        tmp_path / "two",
    )
    try:
        assert isinstance(r.parts.topology.transport.trainer, WorkerPool)
        params = r.params
        for rnd in range(1, 6):
            params, record = loop.train_round(r.parts, rnd, params)
            assert record["clients_completed"] == 6
    finally:
        r.parts.topology.close()
    assert all(torch.equal(one[k], params[k]) for k in one)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["simulation.cohort=0"], "config key 'simulation.cohort': must be auto, off or a group size >= 1"),
        (["simulation.cohort=some"], "config key 'simulation.cohort': expected an integer or one of"),
        (["simulation.cohort_memory=0"], "config key 'simulation.cohort_memory': must be >= 1"),
        (["simulation.workers=0"], "config key 'simulation.workers': must be >= 1"),
        (["simulation.workers=2", "launcher=ray"], "config key 'simulation.workers': worker processes train"),
        (["simulation.workers=2", "heterogeneity.slowdown=2.0"], "config key 'simulation.workers': emulated"),
        (["simulation.workers=7"], "config key 'simulation.workers': 7 worker processes for clients=6; at most one"),
        (["simulation.cohort=3", "heterogeneity.slowdown=2.0"], "config key 'simulation.cohort': emulated"),
    ],
)
def test_the_simulation_keys_are_checked_at_load(overrides: list[str], message: str) -> None:
    with pytest.raises(config_mod.ConfigError, match="^" + message.replace("(", r"\(")):
        config_mod.load(None, [*BASE, *overrides])


def test_a_bare_off_in_yaml_is_off() -> None:
    assert config_mod.load(None, ["simulation.cohort=off"]).simulation.cohort == "off"
    assert config_mod.load(None, ["simulation.cohort=12"]).simulation.cohort == 12
