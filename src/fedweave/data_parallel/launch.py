"""Starting a data-parallel run: prepare a new one, resume a saved one, execute it, join it.

The launcher (:func:`execute`) runs in the calling process: it forks the workers
(spawns them when CUDA is present, see
:func:`~fedweave.data_parallel.workers.resolve_backend`), holds the run's store and
names each generation (:func:`~fedweave.data_parallel.elastic.supervise`), tails
``metrics.jsonl`` for progress, and writes the plot of per-worker batch size, compute
and idle time at the end. With ``sync: asp`` the parameter server runs here instead
(:mod:`fedweave.data_parallel.asp`).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fedweave import config as config_mod
from fedweave import rundir
from fedweave.checkpoint import check_params, load_checkpoint
from fedweave.files import atomic_write_text
from fedweave.config import Config
from fedweave.data_parallel import asp
from fedweave.data_parallel.bsp import Worker, worker_main
from fedweave.data_parallel.elastic import WORKER_IDS_KEY, await_announcements, supervise, turn_away
from fedweave.data_parallel.group import DataParallelError, Stopped, launcher_store, worker_store
from fedweave.data_parallel.records import PLOT_FILE, DataParallelRun, Record
from fedweave.data_parallel.workers import (
    Shared, load_data, make_model, release_workers, resolve_backend, spawn_workers,
)
from fedweave.errors import CheckpointError, ConfigError, first_line
from fedweave.rundir import CONFIG_FILE, METRICS_FILE, MetricsTail

log = logging.getLogger(__name__)

RENDEZVOUS_FILE = "rendezvous.json"  # where a running job's store listens, for :func:`join`


def prepare(config: Config, run_dir: Path | None = None) -> DataParallelRun:
    """A new run directory (config saved) for ``config`` (``mode: data_parallel``)."""
    if config.mode != "data_parallel":
        raise ConfigError(f"config key 'mode': data-parallel runs need mode data_parallel, got {config.mode!r}")
    run_dir, _ = rundir.create(config, run_dir)
    return DataParallelRun(config, run_dir)


def resume(run_dir: str | Path) -> DataParallelRun:
    """Continue the data-parallel run in ``run_dir`` from its last checkpoint (an epoch's end).

    Raises :class:`CheckpointError` naming the first tensor whose shape differs between the
    checkpoint and the model of the saved config (a config edited since), before any worker starts.
    """
    run_dir = Path(run_dir)
    rundir.lock(run_dir)
    config = rundir.saved_config(run_dir)
    if rundir.died_unsaved(run_dir):  # killed before its first checkpoint: begun again
        rundir.begin_again(run_dir)
        return prepare(config, run_dir)
    saved = load_checkpoint(run_dir)
    if saved.get("mode") != "data_parallel":
        raise CheckpointError(f"checkpoint in {str(run_dir)!r} is not of a data-parallel run")
    state = saved["state"]
    model = state["server"]["model"] if state.get("sync") == "asp" else state.get("model")
    expected = make_model(config, load_data(config)).state_dict()
    check_params(model, expected, f"checkpoint in {str(run_dir)!r}")  # before any worker starts
    kept = rundir.records_until(run_dir, "step", state["step"])
    log.info("resuming %s after step %d", run_dir, state["step"])
    return DataParallelRun(config, run_dir, resume_state=state, records=kept)


def execute(
    r: DataParallelRun,
    on_record: Callable[[Record], None] | None = None,
    on_start: Callable[[dict[int, int]], None] | None = None,
) -> list[Record]:
    """Start the workers, follow them until they finish, write the plot; the metrics records.

    ``on_record`` gets each metrics line as it appears; ``on_start`` the worker pids
    (worker id -> pid). Raises :class:`DataParallelError` when the run could not finish
    (the last checkpoint stays intact: continue with :func:`resume`). Then the run directory is
    free for another writer.
    """
    try:
        return _execute(r, on_record, on_start)
    finally:
        rundir.release(r.run_dir)


def _execute(
    r: DataParallelRun,
    on_record: Callable[[Record], None] | None,
    on_start: Callable[[dict[int, int]], None] | None,
) -> list[Record]:
    if r.finished:
        log.info("%s already finished", r.run_dir)
        return r.records
    if r.config.data_parallel.sync == "asp":
        return asp.execute(r, on_record, on_start)
    cfg = r.config
    dp = cfg.data_parallel
    backend, method = resolve_backend(cfg)
    # emulated joiners whose step a resumed run has passed start with the others
    joins = {j.worker: j.step for j in cfg.heterogeneity.joins if j.step > r.start_step}
    members = [w for w in range(cfg.data_parallel_workers) if w not in joins]
    ctx = multiprocessing.get_context(method)
    shared = Shared(
        config=cfg, run_dir=r.run_dir, members=members, backend=backend, resume=r.resume_state,
        dataset=load_data(cfg) if method == "fork" else None,
    )
    procs, conns = spawn_workers(
        ctx, [*members, *joins], worker_main, lambda w, pipe: (w, shared, pipe, joins.get(w)), "fedweave-worker"
    )
    store = launcher_store(dp.timeout)
    store.set("members/0", ",".join(map(str, members)))
    store.add(WORKER_IDS_KEY, cfg.data_parallel_workers)  # the next id joins by hand get
    release_workers(conns, list(joins), store.port)  # joiners announce themselves first: each is admitted at its step
    await_announcements(store, len(joins), procs, dp.timeout)
    release_workers(conns, members, store.port)
    rendezvous = r.run_dir / RENDEZVOUS_FILE
    atomic_write_text(json.dumps({"host": "127.0.0.1", "port": store.port, "backend": backend}), rendezvous)
    if on_start is not None:
        on_start({w: p.pid for w, p in procs.items()})
    tail = MetricsTail(r.run_dir / METRICS_FILE, skip=len(r.records))
    failure = None
    try:
        failure = supervise(store, procs, members, dp.timeout, dp.min_workers, tail, r.records, on_record)
    finally:
        rendezvous.unlink(missing_ok=True)
        store.set("end", "1")  # joiners still waiting to be admitted stop
        for w in joins:
            if not store.check([f"admitted/{w}"]):
                log.info("worker %d was never admitted: the run ended before step %d", w, joins[w])
        turn_away(store)
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)
        for record in tail.read():
            r.records.append(record)
            if on_record is not None:
                on_record(record)
    if r.records:
        from fedweave.observe.plots import plot_workers

        plot_workers(r.records, r.run_dir / PLOT_FILE)
    if failure is not None:
        raise DataParallelError(f"{failure}; the last checkpoint is intact: fedweave run --resume {r.run_dir}")
    return r.records


@dataclass(frozen=True)
class Joined:
    """What a worker started by :func:`join` did: its id, and whether it was admitted and trained
    (False: the run finished before the members reached a step boundary that admits it)."""

    worker: int
    trained: bool


def finished(run_dir: Path, config: Config) -> bool:
    """Whether the checkpoint in ``run_dir`` completed the run ``config`` configures."""
    try:
        state = load_checkpoint(run_dir)["state"]
    except CheckpointError:
        return False
    return DataParallelRun(config, run_dir, resume_state=state).finished


def join(run_dir: str | Path, wait: float = 0.0) -> Joined:
    """Add a worker, in this process, to the data-parallel run going on in ``run_dir``;
    return what it did once the run is done.

    The run's launcher must be on this host (its store listens on 127.0.0.1; the
    address is in ``run_dir/rendezvous.json`` while the run goes on). The worker gets
    the next free id, announces itself, is admitted at the next step boundary the
    members notice it (within ``JOIN_POLL`` seconds and a step), and trains to the end.
    ``wait``: seconds to wait for the run to start (its rendezvous file to appear).
    A worker announced too late (the run took its last step first, and its launcher, with
    its store, is gone) is no failure: the run is done, and it returns ``trained=False``.
    Raises :class:`DataParallelError` when no run is going on there, the launcher dropped
    the worker, or the worker dropped out or lost the run before it finished.
    """
    run_dir = Path(run_dir)
    path = run_dir / RENDEZVOUS_FILE
    deadline = time.monotonic() + wait
    if not path.exists():
        log.info("waiting up to %.0f s for a run in %s", wait, run_dir)
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        rendezvous = json.loads(path.read_text())
        config = config_mod.load(run_dir / CONFIG_FILE)
    except FileNotFoundError as exc:
        raise DataParallelError(f"no data-parallel run is going on in {str(run_dir)!r}: {exc.filename} is missing") from None
    if config.mode != "data_parallel":
        raise DataParallelError(f"{str(run_dir)!r} holds a {config.mode} run, not a data-parallel one")
    dp = config.data_parallel
    address = (rendezvous["host"], int(rendezvous["port"]))
    try:
        store = worker_store(address, dp.timeout)
        worker = int(store.add(WORKER_IDS_KEY, 1)) - 1
    except Exception as exc:  # a stale rendezvous file: the launcher is gone
        raise DataParallelError(f"the run in {str(run_dir)!r} does not answer at {address}: {exc}") from exc
    backend = rendezvous["backend"]
    gpus = torch.cuda.device_count()
    if backend == "nccl" and worker >= gpus:
        raise DataParallelError(f"worker {worker} needs GPU {worker} for nccl; this host has {gpus}")
    shared = Shared(config=config, run_dir=run_dir, members=list(range(dp.workers)), backend=backend)
    log.info("joining the run in %s as worker %d", run_dir, worker)
    member = Worker(worker, shared)
    try:
        member.run(address, join_step=0)
    except (Stopped, dist.DistError) as exc:
        if worker not in member.members and finished(run_dir, config):  # never admitted; the run is done
            log.info("worker %d: the run finished before it was admitted (%s)", worker, first_line(exc))
            return Joined(worker, trained=False)
        raise DataParallelError(f"worker {worker}: {first_line(exc)}") from None
    return Joined(worker, trained=True)


def run_config(config: Config, run_dir: Path | None = None) -> DataParallelRun:
    """Prepare and execute a new data-parallel run (library entry point)."""
    r = prepare(config, run_dir)
    execute(r)
    return r
