"""Data-parallel mode: gradient weighting, real gloo runs on loopback, world changes (workers
leaving and joining), resume.

Every run here is a few seconds of real worker processes on 127.0.0.1 (forked, so
torch is not imported again); each is checked against one process replaying the same
global batches, which is what correct b_i / B weighting must reproduce.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import reference
from fedweave import cli
from fedweave import config as config_mod
from fedweave import data_parallel
from fedweave.data_parallel.controller import apportion
from fedweave.config import Config, ConfigError
from fedweave.data_parallel import bsp

DP = [
    "mode=data_parallel",
    "task.dataset=synthetic",
    "task.dataset_options={samples: 600, features: 8, classes: 4}",
    "task.model_options={hidden: [16]}",
    "data_parallel.workers=3",
    "data_parallel.global_batch=48",  # 480 training samples: 10 steps per epoch
    "data_parallel.epochs=3",
    "data_parallel.lr=0.1",
    "data_parallel.momentum=0.9",
    "data_parallel.log_every=5",
    "data_parallel.timeout=10",
    "data_parallel.controller.every=3",
    "heterogeneity.speeds=[1, 2, 4]",
]


def dp_config(*overrides: str) -> Config:
    return config_mod.load(None, [*DP, *overrides])


def assert_matches_reference(run_dir: Path, config: Config) -> dict[str, float]:
    params, metrics = reference(config)
    trained = torch.load(run_dir / "model.pt")
    assert trained.keys() == params.keys()
    for k in params:
        torch.testing.assert_close(trained[k], params[k], rtol=1e-4, atol=2e-5, msg=lambda m: f"{k}: {m}")
    return metrics


# --------------------------------------------------------------------------- gradient maths


def _model64() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).double()


@pytest.mark.parametrize("seed", range(5))
def test_weighted_all_reduce_equals_the_gradient_of_the_whole_batch(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch, workers = 97, int(rng.integers(2, 6))
    sizes = apportion(batch, rng.lognormal(0, 1, workers).tolist())
    x = torch.from_numpy(rng.normal(size=(batch, 6)))
    y = torch.from_numpy(rng.integers(0, 3, batch))
    model, loss_fn = _model64(), torch.nn.CrossEntropyLoss()
    chunks = np.split(np.arange(batch), np.cumsum(sizes)[:-1])
    xs, ys = [x[c] for c in chunks], [y[c] for c in chunks]

    summed = data_parallel.summed_gradient(model, loss_fn, xs, ys)  # what the SUM all-reduce produces
    full, _ = data_parallel.local_contribution(model, loss_fn, x, y, 1.0)  # one process, whole batch
    relative = (summed - full).norm() / full.norm()
    assert relative <= 1e-6

    # DDP's world-size mean of per-worker mean gradients is a different vector
    means = [data_parallel.local_contribution(model, loss_fn, a, b, 1.0)[0] for a, b in zip(xs, ys) if len(b)]
    ddp = torch.stack(means).mean(0)
    assert (ddp - full).norm() / full.norm() > 1e-3


def test_assign_gradient_round_trips_the_flat_vector() -> None:
    model = _model64()
    flat = torch.arange(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    data_parallel.assign_gradient(model, flat)
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), flat)


# --------------------------------------------------------------------------- real runs


def test_gloo_run_with_unequal_batches_matches_one_process(tmp_path: Path) -> None:
    config = dp_config()
    started = time.perf_counter()
    r = data_parallel.prepare(config, tmp_path / "run")
    records = data_parallel.execute(r)
    assert time.perf_counter() - started < 90  # bounded: no hang, even on a loaded machine
    metrics = assert_matches_reference(tmp_path / "run", config)
    last = records[-1]
    assert last["step"] == 30 and last["epoch"] == 3.0
    assert last["test_accuracy"] == pytest.approx(metrics["accuracy"])
    assert last["workers"] == [0, 1, 2]
    for key in ("batch", "compute_time", "idle_time"):
        assert all(len(rec[key]) == len(rec["workers"]) for rec in records)
    assert all(sum(rec["batch"]) == pytest.approx(48) for rec in records)
    assert [rec["step"] for rec in records] == [5, 10, 15, 20, 25, 30]
    assert sum("test_accuracy" in rec for rec in records) == 3  # every epoch's end
    run = tmp_path / "run"
    assert (run / "workers.png").stat().st_size > 1000
    assert torch.load(run / "checkpoint.pt", weights_only=False)["state"]["step"] == 30


def test_the_controller_follows_emulated_speeds(tmp_path: Path) -> None:
    config = dp_config(
        "data_parallel.workers=2", "heterogeneity.speeds=[1, 4]", "heterogeneity.slowdown=3",
        "task.dataset_options={samples: 600, features: 64, classes: 4}", "task.model_options={hidden: [256, 256]}",
        "data_parallel.epochs=1", "data_parallel.controller.every=2", "data_parallel.log_every=1",
    )
    records = data_parallel.execute(data_parallel.prepare(config, tmp_path / "run"))
    first, last = records[0], records[-1]
    assert first["batch"] == [24, 24]
    assert last["batch"][1] > 2 * last["batch"][0]  # the 4x faster worker takes most of the batch
    assert last["adjustments"] >= 1
    assert_matches_reference(tmp_path / "run", config)


def test_static_and_two_workers_give_the_same_model(tmp_path: Path) -> None:
    config = dp_config("data_parallel.workers=2", "heterogeneity.speeds=[]", "data_parallel.controller=static",
                       "data_parallel.epochs=1")
    records = data_parallel.execute(data_parallel.prepare(config, tmp_path / "run"))
    assert all(rec["batch"] == [24, 24] for rec in records)
    assert_matches_reference(tmp_path / "run", config)


def test_killing_one_of_three_workers_mid_epoch_the_others_finish_with_correct_weighting(tmp_path: Path) -> None:
    config = dp_config("heterogeneity.crashes=[{step: 14, worker: 2}]")
    started = time.perf_counter()
    records = data_parallel.execute(data_parallel.prepare(config, tmp_path / "run"))
    assert time.perf_counter() - started < 90  # bounded: no hang, even on a loaded machine
    assert [rec["generation"] for rec in records] == [0, 0, 1, 1, 1, 1]
    assert records[2]["workers"] == [0, 1, 2]  # steps 11-15: worker 2 took part until step 14
    assert records[3]["workers"] == [0, 1]
    assert sum(records[-1]["batch"]) == pytest.approx(48)
    # no sample lost or repeated, every step weighted by b_i / B: the same model as one process
    metrics = assert_matches_reference(tmp_path / "run", config)
    assert records[-1]["test_accuracy"] == pytest.approx(metrics["accuracy"])


def test_an_external_sigkill_is_survived(tmp_path: Path) -> None:
    config = dp_config("data_parallel.log_every=1", "heterogeneity.speeds=[1, 1, 1]", "heterogeneity.slowdown=1.5")
    pids: dict[int, int] = {}

    def kill_once(record: dict) -> None:
        if record["step"] >= 5 and 1 in pids:
            os.kill(pids.pop(1), signal.SIGKILL)

    records = data_parallel.execute(
        data_parallel.prepare(config, tmp_path / "run"), on_record=kill_once, on_start=pids.update
    )
    assert records[-1]["workers"] == [0, 2] and records[-1]["step"] == 30
    assert_matches_reference(tmp_path / "run", config)


def test_a_hung_worker_is_timed_out_and_dropped(tmp_path: Path) -> None:
    config = dp_config("data_parallel.log_every=1", "data_parallel.timeout=2", "data_parallel.epochs=2",
                       "heterogeneity.speeds=[]")
    pids: dict[int, int] = {}

    def stop_once(record: dict) -> None:
        if record["step"] >= 4 and 2 in pids:
            os.kill(pids.pop(2), signal.SIGSTOP)  # alive but silent: only the timeout can tell

    started = time.perf_counter()
    records = data_parallel.execute(
        data_parallel.prepare(config, tmp_path / "run"), on_record=stop_once, on_start=pids.update
    )
    assert time.perf_counter() - started < 90  # bounded: no hang, even on a loaded machine
    assert records[-1]["workers"] == [0, 1] and records[-1]["step"] == 20
    assert_matches_reference(tmp_path / "run", config)


def repair_the_crash(run: Path) -> None:
    """The failed machine is repaired: the run's saved config no longer crashes worker 0 at step 14."""
    text = (run / "config.yaml").read_text().replace("crashes:\n  - step: 14\n    worker: 0\n", "crashes: []\n")
    (run / "config.yaml").write_text(text)


def test_too_few_survivors_stop_cleanly_and_the_run_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = dp_config("data_parallel.min_workers=3", "heterogeneity.crashes=[{step: 14, worker: 0}]")
    started = time.perf_counter()
    with pytest.raises(data_parallel.DataParallelError, match="min_workers is 3.*--resume"):
        data_parallel.execute(data_parallel.prepare(config, run))
    assert time.perf_counter() - started < 90  # bounded: no hang, even on a loaded machine
    saved = torch.load(run / "checkpoint.pt", weights_only=False)
    assert saved["state"]["step"] == 10  # the end of epoch 1, intact
    assert not (run / "model.pt").exists()
    # the failed machine is repaired: the same run, without the crash, continues from the checkpoint
    repair_the_crash(run)
    resumed = data_parallel.resume(run)
    assert resumed.start_step == 10 and [rec["step"] for rec in resumed.records] == [5, 10]
    records = data_parallel.execute(resumed)
    assert [rec["step"] for rec in records] == [5, 10, 15, 20, 25, 30]
    assert_matches_reference(run, config)


def test_checkpoint_every_bounds_the_steps_a_stopped_run_loses(tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = dp_config(
        "data_parallel.min_workers=3", "data_parallel.checkpoint_every=4", "heterogeneity.crashes=[{step: 14, worker: 0}]"
    )
    with pytest.raises(data_parallel.DataParallelError, match="min_workers is 3"):
        data_parallel.execute(data_parallel.prepare(config, run))
    assert torch.load(run / "checkpoint.pt", weights_only=False)["state"]["step"] == 12  # 4, 8, (10: epoch), 12
    repair_the_crash(run)
    resumed = data_parallel.resume(run)
    assert resumed.start_step == 12 and [rec["step"] for rec in resumed.records] == [5, 10]
    records = data_parallel.execute(resumed)
    assert [rec["step"] for rec in records] == [5, 10, 15, 20, 25, 30]
    assert_matches_reference(run, config)


JOIN = ["data_parallel.workers=2", "heterogeneity.joins=[{step: 12, worker: 2}]"]  # speeds [1, 2, 4]


def test_a_worker_joins_at_its_step_and_the_run_still_matches_one_process(tmp_path: Path) -> None:
    config = dp_config(*JOIN)
    started = time.perf_counter()
    records = data_parallel.execute(data_parallel.prepare(config, tmp_path / "run"))
    assert time.perf_counter() - started < 90  # bounded: no hang, even on a loaded machine
    # the join closes the metrics window: steps 1-12 by workers 0 and 1, from step 13 on with worker 2
    assert [rec["step"] for rec in records] == [5, 10, 12, 15, 20, 25, 30]
    assert [rec["workers"] for rec in records] == [[0, 1]] * 3 + [[0, 1, 2]] * 4
    assert [rec["generation"] for rec in records] == [0, 0, 0, 1, 1, 1, 1]
    assert all(sum(rec["batch"]) == pytest.approx(48) for rec in records)
    # the newcomer starts with the mean throughput of the others: 48 x mean / (X_0 + X_1 + mean) = 16
    assert records[3]["batch"][2] == 16
    # no sample lost or repeated across the join, every step weighted by b_i / B: one process's model
    metrics = assert_matches_reference(tmp_path / "run", config)
    assert records[-1]["test_accuracy"] == pytest.approx(metrics["accuracy"])
    assert not (tmp_path / "run" / "rendezvous.json").exists()  # the run no longer takes workers


def test_a_joiner_that_dies_before_its_step_is_not_admitted(tmp_path: Path) -> None:
    config = dp_config(*JOIN)
    records = data_parallel.execute(
        data_parallel.prepare(config, tmp_path / "run"), on_start=lambda pids: os.kill(pids[2], signal.SIGKILL)
    )
    assert all(rec["workers"] == [0, 1] for rec in records) and records[-1]["step"] == 30
    assert_matches_reference(tmp_path / "run", config)


def test_a_joiner_that_never_arrives_is_dropped_within_the_timeouts(tmp_path: Path) -> None:
    config = dp_config(*JOIN, "data_parallel.timeout=2")
    started = time.perf_counter()
    records = data_parallel.execute(  # announced, then stopped: admitted at step 12, it never forms the group
        data_parallel.prepare(config, tmp_path / "run"), on_start=lambda pids: os.kill(pids[2], signal.SIGSTOP)
    )
    # bounded: the rendezvous times out (2 s), the launcher waits timeout + 5 s for a report, then drops it
    assert time.perf_counter() - started < 90  # bounded: no hang, even on a loaded machine
    assert all(rec["workers"] == [0, 1] for rec in records) and records[-1]["step"] == 30
    assert records[-1]["generation"] == 2  # 1: with the newcomer (never formed), 2: without it
    assert_matches_reference(tmp_path / "run", config)


def test_a_worker_started_by_hand_joins_the_running_job(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # the members are held (SIGSTOP) until the joiner has announced itself: the 40 steps take ~0.3 s, and a
    # slow machine let the run end first (timeout 60: a collective held mid-way does not time out)
    config = dp_config("data_parallel.workers=2", "heterogeneity.speeds=[]", "data_parallel.epochs=4",
                       "data_parallel.timeout=60")
    r = data_parallel.prepare(config, run)
    joiner = subprocess.Popen(
        [sys.executable, "-m", "fedweave", "join", str(run), "--wait", "60", "-v"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    lines: list[str] = []
    ready = threading.Event()
    announced = threading.Event()

    def read() -> None:
        for line in joiner.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if "waiting up to" in line:
                ready.set()
            if "announced in slot" in line:
                announced.set()

    def hold(pids: dict[int, int]) -> None:
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        announced.wait(30)  # else the asserts below say what the joiner did
        for pid in pids.values():
            os.kill(pid, signal.SIGCONT)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(60), "".join(lines)  # imports done: it joins within a poll and a step of the start
        records = data_parallel.execute(r, on_start=hold)
        assert joiner.wait(30) == 0, "".join(lines)
        reader.join(10)  # its last lines
    finally:
        joiner.kill()
    assert records[0]["workers"] == [0, 1] and records[-1]["workers"] == [0, 1, 2]
    assert all(sum(rec["batch"]) == pytest.approx(48) for rec in records)
    assert_matches_reference(run, config)
    assert any("worker 2 trained with the run" in line for line in lines)
    assert cli.main(["join", str(run)]) == 1  # the run is over: nothing to join


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patch reaches forked workers only (spawned with CUDA)")
def test_out_of_memory_caps_the_batch_and_the_step_is_taken_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = data_parallel.local_contribution

    def small_memory(model, loss_fn, x, y, weight):  # type: ignore[no-untyped-def]
        if len(y) > 30:
            raise torch.OutOfMemoryError("emulated: 30 samples fit")
        return real(model, loss_fn, x, y, weight)

    monkeypatch.setattr(bsp, "local_contribution", small_memory)  # inherited by the forked workers
    config = dp_config(
        "data_parallel.workers=2", "heterogeneity.speeds=[1, 4]", "heterogeneity.slowdown=3",
        "task.dataset_options={samples: 600, features: 64, classes: 4}", "task.model_options={hidden: [256, 256]}",
        "data_parallel.epochs=1", "data_parallel.controller.every=2", "data_parallel.controller.memory_guard=true",
    )
    records = data_parallel.execute(data_parallel.prepare(config, tmp_path / "run"))
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["state"]
    assert saved["controller"]["max_batch"] == {1: 24}  # capped at its batch before the increase
    assert all(rec["batch"][1] <= 30 for rec in records)
    assert_matches_reference(tmp_path / "run", config)  # the failed steps were taken again, none lost


def test_cli_runs_a_data_parallel_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["run", *DP, "data_parallel.workers=2", "heterogeneity.speeds=[1, 2]", "data_parallel.epochs=1",
                     "--run-dir", str(tmp_path / "run")])
    assert code == 0
    out = capsys.readouterr()
    assert "final test accuracy" in out.out and "step 10 epoch 1.00" in out.err
    assert (tmp_path / "run" / "model.pt").is_file() and (tmp_path / "run" / "workers.png").is_file()
    assert cli.main(["run", "--resume", str(tmp_path / "run"), "-q"]) == 0  # already finished: nothing to do


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("heterogeneity.speeds=[1, 2]", "2 values for data_parallel.workers=3"),
        ("heterogeneity.crashes=[{step: 1, worker: 3}]", "'heterogeneity.crashes[0].worker': 3 is not a worker"),
        ("data_parallel.global_batch=2", "cannot give 3 workers"),
        ("data_parallel.controller.max_batch=10", "exceeds 3 workers x controller.max_batch=10"),
        ("data_parallel.min_workers=4", "'data_parallel.min_workers': 4 is more than"),
        ("heterogeneity.joins=[{step: 5, worker: 4}]", "'heterogeneity.joins[0].worker': 4; .* this one is 3"),
        ("heterogeneity.joins=[{step: 0, worker: 3}]", "'heterogeneity.joins[0].step': must be >= 1"),
        ("heterogeneity.joins=[{step: 5, worker: 3}]", "3 values for data_parallel.workers=3 and 1 join;"),
        ("data_parallel.max_bad_steps=0", "'data_parallel.max_bad_steps': must be >= 1, got 0"),
        ("data_parallel.max_norm_ratio=1", "'data_parallel.max_norm_ratio': must be > 1"),
        ("data_parallel.max_grad_norm=-1", "'data_parallel.max_grad_norm': must be > 0"),
    ],
)
def test_config_errors_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        dp_config(override)


def test_only_synchronous_steps_take_a_gradient_bound() -> None:
    with pytest.raises(ConfigError, match="'data_parallel.max_grad_norm': only sync bsp checks each worker's gradient"):
        dp_config("data_parallel.sync=asp", "data_parallel.max_grad_norm=10", "heterogeneity.speeds=[1, 2]",
                  "data_parallel.workers=2")


def test_joins_are_checked_against_the_joining_workers() -> None:
    config = dp_config(*JOIN, "heterogeneity.crashes=[{step: 20, worker: 2}]", "heterogeneity.threads=[1, 1, 1]")
    assert config.heterogeneity.joins[0].worker == 2
    with pytest.raises(ConfigError, match=r"'heterogeneity.crashes\[0\].step': 11 is before worker 2 joins"):
        dp_config(*JOIN, "heterogeneity.crashes=[{step: 11, worker: 2}]")
    with pytest.raises(ConfigError, match="'heterogeneity.joins': applies to mode data_parallel only"):
        config_mod.load(None, ["heterogeneity.joins=[{step: 1, worker: 2}]"])


def poisoning(monkeypatch: pytest.MonkeyPatch, worker: int, steps: dict[int, float]) -> None:
    """Worker ``worker``'s share of the gradient at its ``steps`` (1-based calls) multiplied by their
    factor (NaN, or a huge one); inherited by the forked workers, each counting its own calls."""
    import multiprocessing

    real = data_parallel.local_contribution
    calls = [0]

    def poisoned(model, loss_fn, x, y, weight):  # type: ignore[no-untyped-def]
        flat, loss = real(model, loss_fn, x, y, weight)
        if multiprocessing.current_process().name != f"fedweave-worker-{worker}":
            return flat, loss
        calls[0] += 1
        return flat * steps.get(calls[0], 1.0), loss

    monkeypatch.setattr(bsp, "local_contribution", poisoned)


def test_a_nan_or_huge_gradient_of_one_worker_skips_its_step_and_the_model_stays_finite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker 1's share is NaN at step 3 and 10^6 times too large at step 6 (above max_grad_norm
    1000): both steps are skipped (on every worker alike), the others train; the run finishes with a
    finite model."""
    poisoning(monkeypatch, 1, {3: float("nan"), 6: 1e6})
    config = dp_config("data_parallel.epochs=1", "data_parallel.controller.every=100", "data_parallel.max_grad_norm=1000")
    records = data_parallel.execute(data_parallel.prepare(config, tmp_path / "run"))
    assert records[-1]["step"] == 10 and [rec["skipped_steps"] for rec in records] == [1, 1]  # steps 1-5, 6-10
    trained = torch.load(tmp_path / "run" / "model.pt")
    assert all(bool(torch.isfinite(v).all()) for v in trained.values())
    assert all(math.isfinite(rec["train_loss"]) for rec in records) and records[-1]["test_accuracy"] > 0.3


def test_too_many_bad_steps_stop_the_run_with_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker 2 sends NaN from its step 2 on: data_parallel.max_bad_steps 2 stops the run at step 3,
    with an error, not rc 0 and a NaN model."""
    poisoning(monkeypatch, 2, {n: float("nan") for n in range(2, 40)})
    config = dp_config("data_parallel.epochs=1", "data_parallel.max_bad_steps=2")
    with pytest.raises(data_parallel.DataParallelError, match=r"workers \[0, 1, 2\] lost \(exit codes \{0: 3, 1: 3, 2: 3\}\)"):
        data_parallel.execute(data_parallel.prepare(config, tmp_path / "run"))
    assert not (tmp_path / "run" / "model.pt").exists()
