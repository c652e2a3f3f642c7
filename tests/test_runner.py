"""Tests of fedweave.runner: the run directory, resume == uninterrupted, determinism."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conftest import assert_same_params, comparable, run_interrupted, run_to_end, small_config
from fedweave import config as config_mod
from fedweave import rundir, runner
from fedweave.checkpoint import load_checkpoint
from fedweave.config.sections import SIMULATION_CHECKPOINT_INTERVAL
from fedweave.errors import CheckpointError, ConfigError, NothingTrained
from fedweave.plugins.privacy.accountant import epsilon
from fedweave.strategies.aggregate import apply_delta
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvg, FedAvgClient, FedAvgHParams
from fedweave.training import ClientJob
from fedweave.types import Params, Update, UpdateKind

METRIC_KEYS = {
    "round",
    "wall_time",
    "train_loss",
    "test_accuracy",
    "test_loss",
    "clients_sampled",
    "clients_completed",
    "bytes_sent",
    "bytes_received",
}


class CarryingClient(FedAvgClient):
    """Adds a tenth of its previous delta (kept in its client state) to each new one."""

    def train(self, job: ClientJob) -> Update:
        update = super().train(job)
        previous = job.state.get("previous")
        job.state["previous"] = update.tensors
        if previous is None:
            return update
        return dataclasses.replace(update, tensors={k: v + 0.1 * previous[k] for k, v in update.tensors.items()})


class ServerMomentum(FedAvg):
    """FedAvg with a server velocity (server state) and carrying clients (client state)."""

    Client = CarryingClient

    def __init__(self, hp: FedAvgHParams, ctx: StrategyContext):
        super().__init__(hp, ctx)
        self.velocity: Params = {}

    def aggregate(self, rnd: int, params: Params, updates: list[Update]) -> Params:
        delta = self.ctx.average([u.tensors for u in updates], [u.num_examples for u in updates])
        self.velocity = {k: 0.5 * self.velocity.get(k, torch.zeros_like(v)) + v for k, v in delta.items()}
        return apply_delta(params, self.velocity)

    def state_dict(self) -> dict[str, Any]:
        return {"velocity": {k: v.clone() for k, v in self.velocity.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.velocity = dict(state["velocity"])


STATEFUL = f"strategy={__name__}:ServerMomentum"


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_directory_layout(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    params, records = run_to_end(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoint.pt",
        "config.yaml",
        "metrics.jsonl",
        "model.pt",
        "partition.json",
        "run.json",
        "run.lock",
    ]
    assert config_mod.load(run_dir / "config.yaml") == small_config()

    lines = read_lines(run_dir / "metrics.jsonl")
    assert [line["round"] for line in lines] == [1, 2, 3]
    assert all(METRIC_KEYS <= set(line) for line in lines)
    assert all(line["clients_sampled"] == line["clients_completed"] == 4 for line in lines)
    assert all(line["bytes_sent"] == line["bytes_received"] > 0 for line in lines)
    assert all(0.0 <= line["test_accuracy"] <= 1.0 and line["train_loss"] > 0 for line in lines)
    assert comparable(lines) == comparable(records)

    partition = json.loads((run_dir / "partition.json").read_text())
    assert partition["clients"] == 4 and len(partition["counts"]) == 4
    assert sum(partition["counts"]) == partition["samples"] == sum(map(sum, partition["histograms"]))

    saved = load_checkpoint(run_dir)
    assert saved["round"] == 3 and saved["client_states"] == {} and saved["strategy"] == {}
    assert_same_params(saved["params"], params)
    assert_same_params(torch.load(run_dir / "model.pt"), params)


def test_every_metrics_line_has_every_key(tmp_path: Path) -> None:
    run_to_end(tmp_path, "eval.every=2", "rounds=3")
    lines = read_lines(tmp_path / "metrics.jsonl")
    assert all(METRIC_KEYS <= set(line) for line in lines)
    assert [line["test_accuracy"] is not None for line in lines] == [False, True, True]


@pytest.mark.parametrize("stop_after", [1, 2])
@pytest.mark.parametrize("strategy", ["strategy=fedavg", STATEFUL], ids=["fedavg", "stateful"])
def test_resume_equals_uninterrupted(tmp_path: Path, stop_after: int, strategy: str) -> None:
    overrides = (strategy, "local.momentum=0.5", "eval.federated_every=2")
    whole, whole_records = run_to_end(tmp_path / "whole", *overrides)
    resumed, resumed_records = run_interrupted(tmp_path / "resumed", stop_after, *overrides)
    assert_same_params(whole, resumed)
    assert comparable(whole_records) == comparable(resumed_records)
    assert comparable(read_lines(tmp_path / "resumed" / "metrics.jsonl")) == comparable(whole_records)
    assert_same_params(torch.load(tmp_path / "resumed" / "model.pt"), whole)


def test_stateful_strategy_state_is_checkpointed(tmp_path: Path) -> None:
    run_to_end(tmp_path, STATEFUL)
    saved = load_checkpoint(tmp_path)
    assert set(saved["strategy"]["velocity"]) == set(saved["params"])
    assert set(saved["client_states"]) == {0, 1, 2, 3}  # round 2's, committed when round 3 began
    # round 3's, pending until a later instruction tells each client the server applied it
    assert {cid: rnd for cid, (rnd, _) in saved["client_pending"].items()} == dict.fromkeys(range(4), 3)
    assert saved["accepted"] == dict.fromkeys(range(4), 3)


def test_resume_from_an_older_checkpoint_redoes_the_later_rounds(tmp_path: Path) -> None:
    """Checkpoints every 2 rounds, stopped after round 3: resume continues from round 2."""
    overrides = ("rounds=4", "checkpoint.every=2")
    whole, whole_records = run_to_end(tmp_path / "whole", *overrides)
    r = runner.prepare(small_config(*overrides), tmp_path / "resumed")

    def stop_after_three(record: dict[str, Any]) -> None:
        if record["round"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.execute(r, stop_after_three)
    assert len(read_lines(tmp_path / "resumed" / "metrics.jsonl")) == 3
    resumed = runner.resume(tmp_path / "resumed")
    assert resumed.first_round == 3 and [rec["round"] for rec in resumed.records] == [1, 2]
    records = runner.execute(resumed)
    assert_same_params(whole, resumed.params)
    assert comparable(records) == comparable(whole_records)


class RoundClock:
    """``time.monotonic`` for the runner: 10 s per round recorded so far."""

    def __init__(self) -> None:
        self.rounds = 0

    def monotonic(self) -> float:
        return 10.0 * self.rounds

    def record(self, record: dict[str, Any]) -> None:
        self.rounds = record["round"]


def checkpointed_rounds(monkeypatch: pytest.MonkeyPatch, clock: RoundClock) -> list[int]:
    """The rounds the runner checkpoints from now on, timed by ``clock``."""
    saved: list[int] = []
    save = runner.CheckpointWriter.save
    monkeypatch.setattr(runner, "time", SimpleNamespace(monotonic=clock.monotonic, perf_counter=time.perf_counter))
    monkeypatch.setattr(runner.CheckpointWriter, "save", lambda self, state: (saved.append(state["round"]), save(self, state)))
    return saved


def test_a_simulation_checkpoints_at_most_every_30_seconds_and_its_last_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = RoundClock()
    saved = checkpointed_rounds(monkeypatch, clock)
    r = runner.prepare(small_config("rounds=6", "checkpoint.min_interval=null", STATEFUL), tmp_path / "timed")
    runner.execute(r, clock.record)
    assert saved == [4, 6]  # 30 s after the start, 10 s after round 4's, then the last round
    clock.rounds, saved[:] = 0, []
    r = runner.prepare(small_config("rounds=6", "checkpoint.min_interval=20", "checkpoint.every=2"), tmp_path / "every")
    runner.execute(r, clock.record)
    assert saved == [4, 6]  # round 2 begins 10 s in, round 3 (20 s) is not one of every 2, round 4 30 s


def test_checkpoint_interval_defaults_by_transport() -> None:
    assert config_mod.load(None, []).checkpoint.interval("inmemory", False) == SIMULATION_CHECKPOINT_INTERVAL == 30
    assert config_mod.load(None, []).checkpoint.interval("grpc", False) == 0
    assert config_mod.load(None, ["checkpoint.min_interval=5"]).checkpoint.interval("grpc", False) == 5
    # a chain drawing from the OS each round: every round checkpointed, also in simulation
    assert config_mod.load(None, []).checkpoint.interval("inmemory", True) == 0


def test_resume_after_a_timed_checkpoint_equals_uninterrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default cadence checkpoints round 4 of 6; a run stopped after round 5 resumes after
    round 4 and ends as the uninterrupted run, to the bit, client and server state included."""
    overrides = ("rounds=6", "checkpoint.min_interval=null", STATEFUL, "local.momentum=0.5")
    whole, whole_records = run_to_end(tmp_path / "whole", *overrides)
    clock = RoundClock()
    saved = checkpointed_rounds(monkeypatch, clock)
    r = runner.prepare(small_config(*overrides), tmp_path / "resumed")

    def stop_after_five(record: dict[str, Any]) -> None:
        clock.record(record)
        if record["round"] == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.execute(r, stop_after_five)
    assert saved == [4]
    resumed = runner.resume(tmp_path / "resumed")
    assert resumed.first_round == 5
    records = runner.execute(resumed)
    assert_same_params(whole, resumed.params)
    assert comparable(records) == comparable(whole_records)
    assert comparable(read_lines(tmp_path / "resumed" / "metrics.jsonl")) == comparable(whole_records)


def dp_central(target: float, seeded: bool) -> str:
    return (f"plugins.client_send=[{{name: dp_central, noise_multiplier: 1.0, target_epsilon: {target}, "
            f"seeded_noise: {str(seeded).lower()}}}]")


def test_a_run_its_privacy_budget_stops_checkpoints_its_last_round_and_resumes_to_nothing(tmp_path: Path) -> None:
    """Stopped before round 4 by target_epsilon (all 4 clients a round: sampling rate 1), with no timed
    checkpoint due: round 3 is checkpointed, the adaptive controller as round 3 left it (not as round
    4's plan moved it); resumed, it stops again at once: no round redone, no noise drawn again."""
    target = (epsilon([(1.0, 1.0, 3)], 1e-5) + epsilon([(1.0, 1.0, 4)], 1e-5)) / 2
    overrides = ("rounds=8", "checkpoint.min_interval=1000", "controller=adaptive", dp_central(target, seeded=True))
    r = runner.prepare(small_config(*overrides), tmp_path)
    after: dict[int, Any] = {}
    records = runner.execute(r, lambda record: after.update({record["round"]: r.parts.controller.state_dict()}))
    assert [rec["round"] for rec in records] == [1, 2, 3]
    state = load_checkpoint(tmp_path)
    assert state["round"] == 3 and state["controller"] == after[3] and after[3]["pending"] == []
    assert_same_params(state["params"], r.params)
    resumed = runner.resume(tmp_path)
    assert resumed.first_round == 4
    assert runner.execute(resumed) == records[:3]  # the records restored, none added
    assert_same_params(resumed.params, r.params)
    assert read_lines(tmp_path / "metrics.jsonl") == records
    assert load_checkpoint(tmp_path)["round"] == 3


def test_a_chain_drawing_privacy_noise_from_the_os_is_checkpointed_every_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redoing a round of OS noise would release it twice: the default cadence is every round
    (10 s a round would give round 4 only), and the run its budget stops keeps its last round."""
    clock = RoundClock()
    saved = checkpointed_rounds(monkeypatch, clock)
    target = (epsilon([(1.0, 1.0, 4)], 1e-5) + epsilon([(1.0, 1.0, 5)], 1e-5)) / 2
    r = runner.prepare(small_config("rounds=6", "checkpoint.min_interval=null", dp_central(target, seeded=False)), tmp_path)
    runner.execute(r, clock.record)
    assert saved == [1, 2, 3, 4]


def test_the_model_is_written_after_the_clients_are_told_to_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server killed between the two must find no model when restarted, or it stops no client (node._finished)."""
    r = runner.prepare(small_config(), tmp_path)
    events: list[str] = []
    close, save_result = r.parts.topology.close, runner.save_result
    monkeypatch.setattr(r.parts.topology, "close", lambda: (events.append("close"), close())[1])
    monkeypatch.setattr(runner, "save_result", lambda run: (events.append("model"), save_result(run))[1])
    runner.execute(r)
    assert events == ["close", "model"] and (tmp_path / rundir.MODEL_FILE).is_file()


KILLED_RUN = """
import os, signal, sys, time, types
sys.path[:0] = [sys.argv[1], os.path.join(os.path.dirname(sys.argv[1]), "src")]  # tests/, then this checkout's src/
import torch
torch.set_num_threads(1)
from conftest import small_config
from fedweave import runner
run_dir, overrides = sys.argv[2], sys.argv[3:]
done = types.SimpleNamespace(rounds=0)
runner.time = types.SimpleNamespace(monotonic=lambda: 10.0 * done.rounds, perf_counter=time.perf_counter)

def on_record(record):
    done.rounds = record["round"]
    if record["round"] == 6:
        while not os.path.exists(os.path.join(run_dir, "checkpoint.pt")):  # round 4's, written in the background
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

runner.execute(runner.prepare(small_config(*overrides), run_dir), on_record)
"""


def test_kill_9_after_a_timed_checkpoint_then_the_same_run_ends_as_uninterrupted(tmp_path: Path) -> None:
    """A simulation killed with SIGKILL after round 6 of 8 (the default cadence, 10 s a round, wrote
    round 4's checkpoint; rounds 5 and 6 are only metrics lines, never synced): reopened, it redoes
    rounds 5 and 6 and ends bit-identical to the uninterrupted run, SCAFFOLD's client state included."""
    overrides = ("rounds=8", "checkpoint.min_interval=null", "strategy=scaffold")
    whole, whole_records = run_to_end(tmp_path / "whole", *overrides)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, str(Path(__file__).parent), str(tmp_path / "killed"), *overrides],
        capture_output=True, text=True, timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert len(read_lines(tmp_path / "killed" / "metrics.jsonl")) == 6
    r = runner.reopen(small_config(*overrides), tmp_path / "killed")
    assert r.first_round == 5
    records = runner.execute(r)
    assert_same_params(whole, r.params)
    assert comparable(records) == comparable(whole_records)
    assert comparable(read_lines(tmp_path / "killed" / "metrics.jsonl")) == comparable(whole_records)


def test_same_seed_same_run_other_seed_other_run(tmp_path: Path) -> None:
    first, first_records = run_to_end(tmp_path / "a", "local.momentum=0.9")
    second, second_records = run_to_end(tmp_path / "b", "local.momentum=0.9")
    assert_same_params(first, second)
    assert comparable(first_records) == comparable(second_records)
    other, other_records = run_to_end(tmp_path / "c", "local.momentum=0.9", "seed=1")
    assert any(not torch.equal(first[k], other[k]) for k in first)
    assert comparable(first_records) != comparable(other_records)


def test_resume_of_a_finished_run_changes_nothing(tmp_path: Path) -> None:
    params, records = run_to_end(tmp_path)
    resumed = runner.resume(tmp_path)
    assert resumed.first_round == 4
    assert runner.execute(resumed) == read_lines(tmp_path / "metrics.jsonl")
    assert comparable(resumed.records) == comparable(records)
    assert_same_params(resumed.params, params)
    assert_same_params(torch.load(tmp_path / "model.pt"), params)


def test_resume_needs_a_run_directory_with_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"^'.*' is not a run directory: it has no config\.yaml$"):
        runner.resume(tmp_path)
    run_to_end(tmp_path / "unsaved", "checkpoint.every=0")
    with pytest.raises(CheckpointError, match="nothing to resume"):
        runner.resume(tmp_path / "unsaved")


def test_a_directory_holding_a_run_is_not_reused(tmp_path: Path) -> None:
    run_to_end(tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"^run directory '.*' already holds a run; continue it with"):
        runner.prepare(small_config(), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_all_rounds_skipped_keep_the_initial_model(tmp_path: Path) -> None:
    """A deadline no client can meet: every round is skipped and recorded as such; the run fails
    (it trained nothing), writes no model, and its directory is as the run began (no metrics line)."""
    r = runner.prepare(small_config("round_timeout=1e-9"), tmp_path)
    start = {k: v.clone() for k, v in r.params.items()}
    with pytest.raises(NothingTrained, match=r"^the run trained nothing: each of the 3 rounds it ran was skipped"):
        runner.execute(r)
    assert [(rec["skipped"], rec["clients_completed"], rec["train_loss"]) for rec in r.records] == [(True, 0, None)] * 3
    assert_same_params(r.params, start)
    assert read_lines(tmp_path / "metrics.jsonl") == [] and not (tmp_path / rundir.MODEL_FILE).exists()


def test_new_run_directories_are_named_and_unique(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class FrozenClock(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> FrozenClock:
            return cls(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(rundir, "datetime", FrozenClock)
    config = small_config("name=demo", output=tmp_path / "runs")
    assert rundir.new_run_dir(config) == tmp_path / "runs" / "demo-20260102-030405"
    assert rundir.new_run_dir(config) == tmp_path / "runs" / "demo-20260102-030405-2"
    assert runner.prepare(config).run_dir == tmp_path / "runs" / "demo-20260102-030405-3"


def test_reopen_begins_resumes_or_refuses_by_what_the_directory_holds(tmp_path: Path) -> None:
    """What a server started again with the same arguments finds (issue 13 item 3)."""
    fresh = runner.reopen(small_config(), tmp_path / "new")
    assert fresh.first_round == 1 and (tmp_path / "new" / "config.yaml").is_file()

    params, records = run_to_end(tmp_path / "done")
    finished = runner.reopen(small_config(), tmp_path / "done")
    assert finished.first_round == 4 and comparable(finished.records) == comparable(records)
    assert_same_params(finished.params, params)

    with pytest.raises(ConfigError, match=r"^run directory '.*' holds a run of another config \(key 'rounds' differs\)"):
        runner.reopen(small_config("rounds=5"), tmp_path / "done")
    with pytest.raises(ConfigError, match=r"\(key 'local\.lr' differs\)"):
        runner.reopen(small_config("local.lr=0.5"), tmp_path / "done")


def test_reopen_of_a_run_without_a_checkpoint_begins_it_again(tmp_path: Path) -> None:
    overrides = ("checkpoint.every=0",)
    whole, whole_records = run_to_end(tmp_path / "whole", *overrides)
    r = runner.prepare(small_config(*overrides), tmp_path / "again")

    def stop_after_two(record: dict[str, Any]) -> None:
        if record["round"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.execute(r, stop_after_two)
    again = runner.reopen(small_config(*overrides), tmp_path / "again")
    assert again.first_round == 1 and again.records == []
    records = runner.execute(again)
    assert_same_params(again.params, whole)
    assert comparable(read_lines(tmp_path / "again" / "metrics.jsonl")) == comparable(whole_records) == comparable(records)


@dataclasses.dataclass
class UnreachableHParams:
    hold_file: str = ""


class Unreachable:
    """A test plugin: while ``hold_file`` exists every client's update fails on its way out, as in a
    federation whose server no client reaches; then it lets every update pass unchanged."""

    name = "unreachable"
    HParams = UnreachableHParams
    accepts = frozenset(UpdateKind)
    combines_encoded = False

    def __init__(self, hp: UnreachableHParams):
        self.hp = hp

    def encode(self, payload: Any, ctx: Any) -> Any:
        if ctx.side == "client" and Path(self.hp.hold_file).exists():
            raise RuntimeError("the server is out of reach")
        return payload

    def decode(self, payload: Any, ctx: Any) -> Any:
        return payload


def test_a_run_that_trained_nothing_fails_writes_no_model_and_resumes_from_its_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26 item 8: every round skipped (no client's update arrived) used to end with rc 0, the run
    marked finished and w_0 written as its model.pt. Now `fedweave run` fails with one line, writes no
    model, and `--resume` trains every round from the start: the very model of a run never cut off."""
    from fedweave.cli import main

    hold = tmp_path / "hold"
    hold.touch()
    unreachable = f"plugins.client_send=[{{name: '{__name__}:Unreachable', hold_file: {hold}}}]"
    config = small_config("rounds=2", "checkpoint.every=1", unreachable)
    path = tmp_path / "run.yaml"
    path.write_text(config_mod.to_yaml(config))
    run_dir = tmp_path / "run"
    capsys.readouterr()
    assert main(["run", str(path), "-q", "--run-dir", str(run_dir)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedweave: error:")]
    assert errors == [
        "fedweave: error: the run trained nothing: each of the 2 rounds it ran was skipped (too few clients "
        f"answered); no model was written, and the run resumes from its start: fedweave run --resume {run_dir}"
    ]
    assert not (run_dir / rundir.MODEL_FILE).exists()
    assert load_checkpoint(run_dir)["round"] == 0
    hold.unlink()
    assert main(["run", "--resume", str(run_dir), "-q"]) == 0
    records = rundir.records_until(run_dir, "round", 2)
    assert [(r["round"], r["skipped"]) for r in records] == [(1, False), (2, False)]
    whole = runner.run_config(config, tmp_path / "whole")
    assert_same_params(rundir.load_model(run_dir), whole.params, atol=0)
