"""Heterogeneity-aware federated learning end to end: emulated client speeds (virtual and
real clock), round deadlines, the adaptive controller with FedNova, per-client metrics
and their plot."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.topologies.emulated import EmulatedClients, client_speeds
from fedweave.errors import ConfigError, NothingTrained

from conftest import assert_same_params, comparable, run_interrupted, run_to_end, small_config

VIRTUAL = "heterogeneity.clock=virtual"
SPEEDS = "heterogeneity.speeds=[1, 1, 8, 8]"  # 10 steps x 16 samples x 1 ms / speed: 0.16, 0.16, 0.02, 0.02 s


def emulation_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The sleeps the client emulation asks for from now on (its own ``time`` module patched): what
    the code decided, which no load on the host changes."""
    from fedweave.topologies import emulated

    slept: list[float] = []
    clock = SimpleNamespace(process_time=time.process_time, perf_counter=time.perf_counter,
                            sleep=lambda s: (slept.append(s), time.sleep(s)))
    monkeypatch.setattr(emulated, "time", clock)
    return slept


def test_virtual_clock_times_follow_work_and_speed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slept = emulation_sleeps(monkeypatch)
    _, records = run_to_end(tmp_path, VIRTUAL, SPEEDS, "local.steps=10", "rounds=1")
    (record,) = records
    assert [(c["id"], c["steps"], c["batch"]) for c in record["clients"]] == [(i, 10, 16) for i in range(4)]
    assert [c["compute"] for c in record["clients"]] == pytest.approx([0.16, 0.16, 0.02, 0.02])
    assert [c["idle"] for c in record["clients"]] == pytest.approx([0.0, 0.0, 0.14, 0.14])
    assert record["round_time"] == pytest.approx(0.16)
    assert slept == []  # the virtual clock never sleeps


def test_speeds_drawn_from_a_range_are_seeded() -> None:
    config = small_config("clients=10", "heterogeneity.speed_range=[1, 8]")
    speeds = client_speeds(config)
    assert speeds == client_speeds(small_config("clients=10", "heterogeneity.speed_range=[1, 8]"))
    assert speeds != client_speeds(small_config("clients=10", "heterogeneity.speed_range=[1, 8]", "seed=1"))
    assert len(speeds) == 10 and all(1 <= s <= 8 for s in speeds)


def test_real_clock_slows_a_client_by_sleeping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Speeds [1, 10, 10, 10]: client 0's compute time is at least 10 x its training's CPU time and it
    sleeps to it; the others report their own time and never sleep. Checked against the CPU times
    the emulation measured and lower bounds of the wall time, which no load can break."""
    measured: dict[int, tuple[float, float]] = {}
    duration = EmulatedClients.duration

    def spy(self: EmulatedClients, client_id: int, rnd: int, samples: int, cpu: float, wall: float) -> float:
        measured[client_id] = (cpu / self.emulator(client_id).threads, wall)
        return duration(self, client_id, rnd, samples, cpu, wall)

    monkeypatch.setattr(EmulatedClients, "duration", spy)
    _, records = run_to_end(tmp_path, "heterogeneity.speeds=[1, 10, 10, 10]", "local.steps=20", "rounds=1")
    compute = {c["id"]: c["compute"] for c in records[-1]["clients"]}
    assert compute[0] >= 10 * measured[0][0] > 0  # 10x its CPU time
    for cid in (1, 2, 3):  # the fastest: their own time, the longer of CPU and wall
        assert compute[cid] == pytest.approx(max(measured[cid][1], measured[cid][0]))
    assert records[-1]["wall_time"] > compute[0]  # the sleep really happened


def test_the_deadline_drops_emulated_stragglers_and_aggregates_the_rest(tmp_path: Path) -> None:
    start = runner.prepare(small_config(VIRTUAL, SPEEDS), tmp_path / "start").params
    params, records = run_to_end(tmp_path / "drop", VIRTUAL, SPEEDS, "local.steps=10", "round_timeout=0.1", "rounds=2")
    for record in records:
        assert record["skipped"] is False
        assert (record["clients_sampled"], record["clients_completed"]) == (4, 2)
        assert [c["id"] for c in record["clients"]] == [2, 3]
        assert record["round_time"] == 0.1  # the server waited for the stragglers until the deadline
    assert any(not torch.equal(params[k], start[k]) for k in params)
    kept = runner.prepare(
        small_config(VIRTUAL, SPEEDS, "local.steps=10", "round_timeout=0.1", "min_clients=3", "rounds=2"), tmp_path / "skip"
    )
    with pytest.raises(NothingTrained):  # every round skipped: the run fails, and writes no model
        runner.execute(kept)
    assert len(kept.records) == 2 and all(r["skipped"] and r["clients_completed"] == 2 for r in kept.records)
    assert_same_params(kept.params, start)


def test_the_real_clock_deadline_cuts_a_straggler_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slept = emulation_sleeps(monkeypatch)
    _, records = run_to_end(
        tmp_path, "heterogeneity.speeds=[0.001, 1, 1, 1]", "local.steps=10", "round_timeout=0.25", "rounds=1"
    )
    (record,) = records
    assert [c["id"] for c in record["clients"]] == [1, 2, 3]
    assert slept and max(slept) < 0.25  # client 0 would take over 1000 x its native time; it sleeps until 0.25 s


def test_adaptive_steps_with_fednova_even_out_the_round(tmp_path: Path) -> None:
    speeds = "heterogeneity.speeds=[1, 2, 4, 8]"
    overrides = [VIRTUAL, speeds, "controller=adaptive", "strategy=fednova", "local.steps=40"]
    _, records = run_to_end(tmp_path, *overrides)
    first = [c["compute"] for c in records[0]["clients"]]
    target = sorted(first)[1:3]
    assert max(first) / min(first) == pytest.approx(8)
    for record in records[1:]:
        times = [c["compute"] for c in record["clients"]]
        assert max(times) / min(times) < 1.1
        assert record["round_time"] == pytest.approx(sum(target) / 2, rel=0.06)
        assert len({c["steps"] for c in record["clients"]}) > 1
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(set(c) == {"id", "steps", "batch", "compute", "idle"} for line in lines for c in line["clients"])
    assert (tmp_path / "clients.png").stat().st_size > 10_000


def test_adaptive_resume_equals_uninterrupted(tmp_path: Path) -> None:
    overrides = [VIRTUAL, SPEEDS, "controller=adaptive", "strategy=fednova", "local.steps=10", "rounds=4"]
    whole, whole_records = run_to_end(tmp_path / "whole", *overrides)
    resumed, resumed_records = run_interrupted(tmp_path / "resumed", 2, *overrides)
    assert_same_params(whole, resumed)
    assert comparable(resumed_records) == comparable(whole_records)
    assert [r["round_time"] for r in resumed_records] == [r["round_time"] for r in whole_records]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["heterogeneity.speeds=[1, 2]"], "2 values for clients=10"),
        (["heterogeneity.speed_range=[1]"], r"expected \[low, high\]"),
        (["heterogeneity.speeds=[1]", "clients=1", "heterogeneity.speed_range=[1, 2]"], "not both"),
        (["heterogeneity.crashes=[{step: 1, worker: 0}]"], "data_parallel only"),
        (["heterogeneity.schedule=[{step: 3, worker: 10, speed: 1}]"], "is not a client"),
        (["heterogeneity.speeds=[1]", "clients=1", "transport=grpc", "heterogeneity.clock=virtual"],
         "virtual is a simulation"),
    ],
)
def test_config_errors_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_mod.load(None, overrides)
