"""The run directory shared by the federated runner and the data-parallel launcher: creation,
the saved config, the metrics kept on resume, the metrics tail, the model file."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import SMALL
from fedweave import config as config_mod
from fedweave import rundir
from fedweave.checkpoint import CHECKPOINT, run_id
from fedweave.config import Config
from fedweave.errors import CheckpointError, ConfigError


def demo_config(tmp_path: Path) -> Config:
    return config_mod.load(None, ["name=demo", f"output_dir={tmp_path / 'runs'}"])


def test_a_new_run_gets_a_named_directory_with_its_config(tmp_path: Path) -> None:
    config = demo_config(tmp_path)
    path, fresh = rundir.create(config)
    assert fresh and path.parent == tmp_path / "runs" and path.name.startswith("demo-")
    assert sorted(p.name for p in path.iterdir()) == ["config.yaml", "run.json", "run.lock"]
    assert rundir.saved_config(path) == config
    assert json.loads((path / "run.json").read_text()) == {"id": run_id(path), "keys": {}}
    assert len(run_id(path) or "") == 12 and run_id(path) != run_id(rundir.create(config)[0])


def test_a_given_directory_is_fresh_only_when_absent_or_empty(tmp_path: Path) -> None:
    config = demo_config(tmp_path)
    assert rundir.create(config, tmp_path / "absent") == (tmp_path / "absent", True)
    (tmp_path / "empty").mkdir()
    assert rundir.create(config, tmp_path / "empty") == (tmp_path / "empty", True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert rundir.create(config, tmp_path / "other") == (tmp_path / "other", False)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("name", [rundir.METRICS_FILE, CHECKPOINT])
def test_a_directory_holding_a_run_is_refused(tmp_path: Path, name: str) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / name).write_text("")
    with pytest.raises(ConfigError, match="already holds a run; continue it with `fedweave run --resume`"):
        rundir.create(demo_config(tmp_path), tmp_path / "run")
    assert not (tmp_path / "run" / rundir.CONFIG_FILE).exists()


def test_a_directory_without_a_config_is_not_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is not a run directory: it has no config.yaml"):
        rundir.saved_config(tmp_path)


@pytest.mark.parametrize("key", ["round", "step"])
def test_resuming_keeps_the_metrics_up_to_the_checkpoint(tmp_path: Path, key: str) -> None:
    lines = [{key: k, "train_loss": k / 10} for k in (5, 10, 15)]
    (tmp_path / rundir.METRICS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert rundir.records_until(tmp_path, key, 10) == lines[:2]
    kept = (tmp_path / rundir.METRICS_FILE).read_text().splitlines()
    assert [json.loads(line) for line in kept] == lines[:2]
    assert rundir.records_until(tmp_path, key, 4) == []


def test_the_metrics_tail_gives_whole_new_lines_after_those_skipped(tmp_path: Path) -> None:
    path = tmp_path / rundir.METRICS_FILE
    tail = rundir.MetricsTail(path, skip=1)
    assert tail.read() == []  # no file yet
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')  # a line being written
    assert tail.read() == [{"step": 2}]
    with path.open("a") as f:
        f.write('ep": 3}\n')
    assert tail.read() == [{"step": 3}]
    assert tail.read() == []


def test_the_model_file_round_trips_its_tensors(tmp_path: Path) -> None:
    params = {"w": torch.arange(6, dtype=torch.float64).reshape(2, 3), "b": torch.tensor([0.5])}
    rundir.save_model(params, tmp_path)
    loaded = rundir.load_model(tmp_path)
    assert loaded.keys() == params.keys() and all(torch.equal(loaded[k], params[k]) for k in params)


HOLDER = """
import subprocess, sys
from pathlib import Path
from fedweave import rundir
for run_dir in sys.argv[1:]:
    rundir.lock(Path(run_dir))
child = "from pathlib import Path; import sys; from fedweave import rundir; print(rundir.lock(Path(sys.argv[1])))"
print("locked", subprocess.run([sys.executable, "-c", child, sys.argv[1]], capture_output=True, text=True).stdout.strip(), flush=True)
sys.stdin.read()
"""


@contextmanager
def held(*run_dirs: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process that writes ``run_dirs`` (holds their locks) until the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, run_dirs)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["locked", "True"]  # its own child writes under its lock
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_a_run_directory_has_one_writer_at_a_time(tmp_path: Path) -> None:
    """Issue 26 item 5: while one process writes a run directory, a second writer (a new run there,
    a resume, the data-parallel launcher's) is refused in one line naming the holder's pid; the lock
    goes with its holder, however it ends (kill -9 here)."""
    from fedweave import data_parallel, runner

    config = config_mod.load(None, [*SMALL, "rounds=1"])
    runner.execute(runner.prepare(config, tmp_path / "run"))  # its end frees the directory
    dp = config_mod.load(None, [*SMALL, "mode=data_parallel", "data_parallel.workers=1"])
    with held(tmp_path / "run", tmp_path / "new") as holder:
        why = rf"run directory '{tmp_path / 'run'}' is in use by process {holder.pid}, which holds run.lock in it"
        with pytest.raises(rundir.RunInUse, match=why):
            runner.resume(tmp_path / "run")
        with pytest.raises(rundir.RunInUse, match=why):
            runner.reopen(config, tmp_path / "run")
        for prepare in (lambda: runner.prepare(config, tmp_path / "new"), lambda: data_parallel.prepare(dp, tmp_path / "new")):
            with pytest.raises(rundir.RunInUse, match=f"in use by process {holder.pid}"):
                prepare()
        assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["run.lock"]  # nothing written
    assert runner.resume(tmp_path / "run").first_round == 2  # the holder was killed: free again
    rundir.release(tmp_path / "run")
    assert data_parallel.prepare(dp, tmp_path / "new").run_dir == tmp_path / "new"
