"""Simulation workers: this process trains its share of a round while the spawned ones train
theirs; a worker that dies fails the round with its name instead of leaving it waiting, and the
process still exits; a batch that cannot be packed for one worker is sent to none."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import fedweave
from fedweave import config as config_mod
from fedweave import runner
from fedweave.cohort.workers import WorkerPool, assign
from fedweave.errors import FedweaveError
from fedweave.federated import rounds as loop

BASE = [
    "clients=6",
    "task.dataset=digits",
    "task.model_options={hidden: [16]}",
    "task.partition={scheme: dirichlet, alpha: 0.5}",
    "local={epochs: 1, batch_size: 16, lr: 0.1}",
    "eval.every=0",
    "eval.federated_every=0",
    "checkpoint.every=0",
    "seed=3",
    "simulation.workers=2",
]


def pool_of(r) -> WorkerPool:
    pool = r.parts.topology.transport.trainer
    assert isinstance(pool, WorkerPool)
    return pool


def test_this_process_trains_the_share_assign_gives_worker_0(tmp_path: Path) -> None:
    r = runner.prepare(config_mod.load(None, BASE), tmp_path)
    try:
        pool = pool_of(r)
        assert len(pool.processes) == 1  # two workers: this process and one spawned
        here: list[int] = []
        work = pool.local.work
        pool.local.work = lambda batch: here.extend(cid for cid, _, _ in batch) or work(batch)  # type: ignore[method-assign]
        loads: dict[int, int] = {}  # each client's load, in the order of the batch
        load = pool._load
        pool._load = lambda cid, ins: loads.setdefault(cid, load(cid, ins))  # type: ignore[method-assign]
        _, record = loop.train_round(r.parts, 1, r.params)
    finally:
        r.parts.topology.close()
    where = assign(list(loads.values()), 2)
    assert record["clients_completed"] == 6
    assert sorted(here) == sorted(c for c, w in zip(loads, where) if w == 0) and 0 < len(here) < 6


def test_a_worker_that_dies_fails_the_round_with_its_name(tmp_path: Path) -> None:
    r = runner.prepare(config_mod.load(None, BASE), tmp_path)
    try:
        worker = pool_of(r).processes[0]
        worker.kill()
        worker.join(timeout=10)
        with pytest.raises(FedweaveError, match=r"^simulation\.workers: fedweave-worker-1 \(exit code -9\) stopped before"):
            loop.train_round(r.parts, 1, r.params)
    finally:
        r.parts.topology.close()


def test_a_process_whose_worker_died_with_a_share_left_in_its_queue_still_exits(tmp_path: Path) -> None:
    """The dead worker's share (the model of a hidden layer of 1,024, ~300 KB by value) is more than
    its queue's pipe holds: the queue's feeder thread would wait at exit to write it, for ever."""
    script = tmp_path / "died.py"
    script.write_text(textwrap.dedent(f"""
        import tempfile
        from pathlib import Path
        from fedweave import config as config_mod, runner
        from fedweave.errors import FedweaveError
        from fedweave.federated import rounds as loop

        if __name__ == "__main__":
            given = {[*BASE, "task.model_options={hidden: [1024]}"]!r}
            r = runner.prepare(config_mod.load(None, given), Path(tempfile.mkdtemp(dir={str(tmp_path)!r})))
            try:
                worker = r.parts.topology.transport.trainer.processes[0]
                worker.kill()
                worker.join(timeout=10)
                try:
                    loop.train_round(r.parts, 1, r.params)
                except FedweaveError as exc:
                    print("failed:", exc)
            finally:
                r.parts.topology.close()
    """))
    src = str(Path(fedweave.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "failed: simulation.workers: fedweave-worker-1 (exit code -9) stopped before" in done.stdout


def test_a_batch_that_cannot_be_packed_sends_no_worker_anything() -> None:
    """Were worker 1's share sent before worker 2's failed to pickle, the answer to it would be
    taken by the next call for one of its own jobs; nor does this process start on its share."""
    pool = WorkerPool.__new__(WorkerPool)
    pool.runtime = SimpleNamespace(data=SimpleNamespace(train_size=lambda cid: 10))
    pool.processes, pool.inboxes = [None, None], [queue.SimpleQueue(), queue.SimpleQueue()]
    trained: list = []
    pool.local = SimpleNamespace(work=trained.extend)
    work = SimpleNamespace(batch_size=10, local_steps=1, epochs=1)
    batch = [(c, SimpleNamespace(work=work), {"state": lambda: 0} if c == 2 else {}) for c in range(3)]
    assert assign([10, 10, 10], 3) == [0, 1, 2]  # one job each: worker 2's cannot be pickled
    with pytest.raises(Exception, match="pickle"):
        pool.work(batch)
    assert all(inbox.empty() for inbox in pool.inboxes) and not trained
