"""Simulation workers: this process trains its share of a round while the spawned ones train
theirs; a worker that dies fails the round with its name instead of leaving it waiting, and the
process still exits; a batch that cannot be packed for one worker is sent to none."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
import time
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
        with pytest.raises(FedweaveError, match=r"^simulation\.workers: fedweave-worker-1 \(exit code -9\) stopped before "
                           r"it had finished doing its clients' work$"):
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


def _script(tmp_path: Path, body: str) -> tuple[int, str, str]:
    """``body`` run in a fresh interpreter after ``r``, a prepared run of BASE (two workers), is made: its
    exit code, stdout and stderr (through files: a worker left behind would keep a pipe open)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, tempfile, time
        from pathlib import Path
        from fedweave import config as config_mod, runner
        from fedweave.federated import rounds as loop

        if __name__ == "__main__":
            r = runner.prepare(config_mod.load(None, {base!r}), Path(tempfile.mkdtemp(dir={tmp!r})))
            worker = r.parts.topology.transport.trainer.processes[0]
    """).format(base=BASE, tmp=str(tmp_path)) + textwrap.indent(textwrap.dedent(body), " " * 4))
    src = str(Path(fedweave.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
        code = subprocess.run([sys.executable, str(script)], stdout=out, stderr=err, timeout=120, env=env).returncode
        out.seek(0), err.seek(0)
        return code, out.read(), err.read()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"  # a zombie left to a parent that does not reap
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_whose_run_process_was_killed_ends(tmp_path: Path) -> None:
    """kill -9 of the run's process (or the OOM killer) leaves its worker no one to tell it to stop:
    it must not wait for ever for work, holding its task's memory."""
    code, out, err = _script(tmp_path, """
        print(worker.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert code == -9, err[-2000:]
    pid = int(out.split()[0])
    deadline = time.monotonic() + 30
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    ended = _gone(pid)
    if not ended:
        os.kill(pid, 9)  # the orphan this test made
    assert ended, "the worker outlived its run's process"


def test_ctrl_c_stops_a_run_with_workers_without_their_tracebacks(tmp_path: Path) -> None:
    """Ctrl-C signals the terminal's whole process group: the run's process handles it (and stops its
    workers), a worker prints no KeyboardInterrupt traceback of its own and is not gone before it."""
    code, out, err = _script(tmp_path, """
        os.kill(worker.pid, signal.SIGINT)
        time.sleep(1)
        print("alive" if worker.is_alive() else "gone", flush=True)
        try:
            _, record = loop.train_round(r.parts, 1, r.params)
            print("completed", record["clients_completed"])
        finally:
            r.parts.topology.close()
    """)
    assert code == 0, err[-2000:]
    assert out.split() == ["alive", "completed", "6"]
    assert "Traceback" not in err, err[-2000:]


def test_a_worker_that_cannot_build_its_task_says_why_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's error in a spawned worker only (its GPU without room for the model, say) reaches the
    run as its one line, not as the worker's traceback and an exit code."""
    (tmp_path / "worker_only.py").write_text(textwrap.dedent("""
        import multiprocessing
        from torch import nn
        from fedweave.errors import TaskError

        def model(input_shape, num_classes, hidden):
            if multiprocessing.parent_process() is not None:
                raise TaskError("task.model: no room for it on this worker's device")
            return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[-1], num_classes))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))  # a spawned worker starts with this process's sys.path
    with pytest.raises(FedweaveError, match=r"^simulation\.workers: fedweave-worker-1 could not build its task: "
                       r"task\.model: no room for it on this worker's device$"):
        runner.prepare(config_mod.load(None, [*BASE, "task.model=worker_only:model"]), tmp_path / "run")
