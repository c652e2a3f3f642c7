"""Build a run from its config, execute it, and resume it.

``prepare`` turns a validated :class:`~fedweave.config.Config` into the parts of a
round (task, strategy, chains, controller, and the topology :mod:`fedweave.reach` decides) and a
run directory;
``execute`` drives :func:`fedweave.federated.rounds.run` and records every round (a metrics line;
an atomic checkpoint every ``checkpoint.every`` rounds, at most one per
``checkpoint.min_interval`` seconds, and always of the last round run, also when the
run stops early) and writes its model (:mod:`fedweave.result`); ``resume`` rebuilds the same
parts from a run directory and continues after its last checkpoint. The process entry points
that drive a run from a node of a deployment are :mod:`fedweave.nodes`.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedweave import result, rundir
from fedweave.federated.buffered import BufferedServer, run_buffered, run_deployed
from fedweave.federated.selection import sample_clients
from fedweave.build import (
    build_chains,
    build_client_runtime,
    build_controller,
    build_deadlines,
    build_strategy,
    build_task,
    federated_eval_every,
    global_evaluator,
    initial_params,
    update_checks,
)
from fedweave.checkpoint import CHECKPOINT, CheckpointWriter, check_params, load_checkpoint
from fedweave.federated.evaluation import hooks_of
from fedweave.files import atomic_write_text
from fedweave.federated.client import ClientStateStore
from fedweave.config import Config, emulates_clients
from fedweave.errors import ConfigError, NothingTrained
from fedweave.federated.records import Record
from fedweave.federated.rounds import RoundParts, run
from fedweave.observe.figures import elapsed
from fedweave.observe.loggers import open_loggers
from fedweave.observe.metrics import MetricsWriter
from fedweave.plugins import PLUGINS
from fedweave.plugins.compose import fresh_draws
from fedweave.reach import clients_topology
from fedweave.seeding import numpy_rng
from fedweave.task import format_summary
from fedweave.topologies.base import Topology
from fedweave.topologies.star import Star
from fedweave.transports.base import PostsJobs
from fedweave.types import Params

log = logging.getLogger(__name__)

CLIENTS_PLOT = "clients.png"


@dataclass
class Run:
    """A prepared run: its config, directory, round parts and where it starts."""

    config: Config
    run_dir: Path
    parts: RoundParts
    params: Params
    first_round: int
    partition_summary: str
    store: ClientStateStore
    records: list[Record] = field(default_factory=list)
    buffered: BufferedServer | None = None  # the state of asynchronous aggregation, when enabled
    began: float = field(default_factory=time.monotonic)  # when this process began building the run
    elapsed_before: float = 0.0  # a resumed run's seconds before its interruption

    def elapsed(self) -> float:
        """A record's ``elapsed``: seconds since the run began, its start-up (data, model, clients) included."""
        return self.elapsed_before + time.monotonic() - self.began


def prepare(config: Config, run_dir: Path | None = None, topology: Topology | None = None) -> Run:
    """Build every part of a new run and its directory (config and partition saved).

    A directory that already holds a run (metrics or a checkpoint) is refused rather
    than mixed with the new run's records.
    """
    began = time.monotonic()
    if config.mode != "federated":
        raise ConfigError(
            f"config key 'mode': {config.mode!r} runs through fedweave.data_parallel, not the federated runner"
        )
    run_dir, fresh = rundir.create(config, run_dir)
    try:
        built = _build(config, run_dir, topology)
    except BaseException:
        if fresh:  # a run that could not even be built leaves no directory behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    atomic_write_text(json.dumps(built.summary), run_dir / "partition.json")
    built.run.began = began
    return built.run


def resume(run_dir: str | Path, topology: Topology | None = None) -> Run:
    """Rebuild the run saved in ``run_dir`` and continue after its last checkpoint (begun again
    when it died before its first: :func:`reopen`)."""
    began = time.monotonic()
    run_dir = Path(run_dir)
    rundir.lock(run_dir)
    config = rundir.saved_config(run_dir)
    if rundir.died_unsaved(run_dir):
        return reopen(config, run_dir, topology)
    state = load_checkpoint(run_dir)
    built = _build(config, run_dir, topology)
    r = built.run
    check_params(state["params"], r.params, f"checkpoint in {str(run_dir)!r}")
    r.params = state["params"]
    r.first_round = state["round"] + 1
    r.parts.strategy.load_state_dict(state["strategy"])
    r.parts.controller.load_state_dict(state["controller"])
    r.store.load_state_dict(state["client_states"])
    r.store.load_pending_state_dict(state.get("client_pending", {}))  # absent in checkpoints of older versions
    r.parts.accepted.load_state_dict(state.get("accepted", {}))
    r.parts.chains.load_state_dict(state.get("plugins", {}))
    if r.buffered is not None:
        r.buffered.load_state_dict(state["asynchronous"])
    r.records = rundir.records_until(run_dir, "round", state["round"])
    r.began, r.elapsed_before = began, (elapsed(r.records, False) or [0.0])[-1]
    log.info("resuming %s after round %d", run_dir, state["round"])
    return r


def reopen(config: Config, run_dir: Path, topology: Topology | None = None) -> Run:
    """The run of ``config`` in ``run_dir``, whatever a restart finds there: a new run in a directory
    without one; the run resumed after its checkpoint; begun again when it never wrote one (its
    metrics lines, which the new run writes again, are dropped). A run of another config is refused.
    """
    run_dir = Path(run_dir)
    rundir.lock(run_dir)
    if not rundir.holds_run(run_dir):
        return prepare(config, run_dir, topology)
    rundir.check_same_config(config, run_dir)
    if (run_dir / CHECKPOINT).is_file():
        return resume(run_dir, topology)
    rundir.begin_again(run_dir)
    return prepare(config, run_dir, topology)


def execute(r: Run, on_record: Callable[[Record], None] | None = None) -> list[Record]:
    """Run the remaining rounds where the config's launcher puts the nodes; then the run directory
    is free for another writer."""
    try:
        if r.config.launcher.kind == "process":
            from fedweave.launchers.process import launch_processes

            return launch_processes(r, on_record)
        return run_rounds(r, on_record)
    finally:
        rundir.release(r.run_dir)


def run_rounds(r: Run, on_record: Callable[[Record], None] | None = None) -> list[Record]:
    """Run the remaining rounds; write metrics, checkpoints and the final model."""
    cfg = r.config
    metrics = MetricsWriter(r.run_dir / rundir.METRICS_FILE)
    loggers = open_loggers(cfg, r.run_dir, r.parts.topology)  # observe: TensorBoard, MLflow, Prometheus
    # In simulation the clients live and die with the server, so a checkpoint may land while the
    # next round trains. Deployed clients keep the state the next round's instruction accepts:
    # that instruction must not leave before the checkpoint it follows is on disk.
    checkpoints = CheckpointWriter(r.run_dir, background=cfg.transport.kind == "inmemory", covers=[metrics.path])
    every = cfg.checkpoint.every
    interval = cfg.checkpoint.interval(cfg.transport.kind, bool(fresh_draws(cfg, PLUGINS)))
    last_saved = time.monotonic()
    recorded = saved = r.first_round - 1  # the last round recorded, and checkpointed, by this process
    # The state this process began in, its params untouched by a run that applies no update: the
    # checkpoint such a run leaves (its skipped rounds' lines dropped), from which it resumes as if it
    # had never run, and which no reader takes for a finished run.
    begun = {**copy.deepcopy(_state(r, r.first_round - 1, {})), "params": r.params} if every else None

    def on_round(rnd: int, params: Params, record: Record) -> None:
        nonlocal last_saved, recorded, saved
        record["elapsed"] = r.elapsed()
        due = bool(every) and (rnd == cfg.rounds or (rnd % every == 0 and time.monotonic() - last_saved >= interval))
        metrics.append(record, sync=rnd == cfg.rounds and not due)  # else synced by the checkpoint that covers it
        loggers.record(record)
        r.records.append(record)
        recorded = rnd
        if due:
            _checkpoint(r, checkpoints, rnd, params)
            last_saved, saved = time.monotonic(), rnd
        if on_record is not None:
            on_record(record)

    try:
        try:
            if r.buffered is None:
                r.params = run(r.parts, r.params, r.first_round, cfg.rounds, on_round)
            elif (jobs := _posts_jobs(r.parts.topology)) is not None:  # deployed: the real clock
                r.params = run_deployed(
                    r.parts, r.buffered, jobs, r.params, r.first_round, cfg.rounds, on_round, cfg.grpc.join_timeout
                )
            else:
                r.params = run_buffered(r.parts, r.buffered, r.params, r.first_round, cfg.rounds, on_round)
            trained = any(record.get("skipped") is False for record in r.records)
            if begun is not None and not trained:  # the directory as the run began: nothing in it done
                metrics.truncate_after(r.first_round - 1)
                checkpoints.save(begun)
            elif every and saved < recorded:  # a run stopped early (privacy budget spent, no client left)
                _checkpoint(r, checkpoints, recorded, r.params)
        finally:
            try:
                r.parts.topology.close()
            finally:
                checkpoints.close()  # the last checkpoint is on disk when the run returns
        if not trained:  # its model would be w_0 written as the result of a run that reached no client
            raise NothingTrained(_untrained(r))
        # Only now, the clients told to stop: a restarted server that finds the model (nodes.server._finished)
        # stops none.
        r.params = save_result(r)
    except BaseException:
        loggers.close(r.run_dir, finished=False)  # an MLflow run marked failed, the endpoint's port freed
        raise
    if r.records and (cfg.controller.kind != "static" or emulates_clients(cfg)):
        from fedweave.observe.plots import plot_clients

        plot_clients(r.records, r.run_dir / CLIENTS_PLOT)
    loggers.close(r.run_dir)
    return r.records


def _checkpoint(r: Run, checkpoints: CheckpointWriter, rnd: int, params: Params) -> None:
    """Save the run's state after round ``rnd``, whose global model is ``params``.

    Each spine returns in such a state, also when it stops early: :func:`~fedweave.federated.rounds.run` before
    a round's set-up (the controller's plan undone); the asynchronous spines with nothing in flight,
    their state (clock, buffer) a later point of the same model version, from which a resumed run
    goes on as this one would have."""
    checkpoints.save(_state(r, rnd, params))


def _state(r: Run, rnd: int, params: Params) -> dict[str, Any]:
    """What a checkpoint of the run after round ``rnd`` holds, its global model ``params``."""
    return {
        "round": rnd,
        "params": params,
        "strategy": r.parts.strategy.state_dict(),
        "controller": r.parts.controller.state_dict(),
        "client_states": r.store.state_dict(),
        "client_pending": r.store.pending_state_dict(),
        "accepted": r.parts.accepted.state_dict(),
        "plugins": r.parts.chains.state_dict(),
        "asynchronous": None if r.buffered is None else r.buffered.state_dict(),
    }


def _untrained(r: Run) -> str:
    """The one line of a run that applied no update: why, and how it resumes."""
    cfg = r.config
    why = (
        f"each of the {len(r.records)} rounds it ran was skipped (too few clients answered)" if r.records
        else "it stopped before it applied any client's update"
    )
    if not cfg.checkpoint.every:
        return f"the run trained nothing: {why}; no model was written (checkpoint.every is 0: start it again)"
    command = "server" if cfg.transport.kind == "grpc" and cfg.launcher.kind == "local" else "run"
    return (
        f"the run trained nothing: {why}; no model was written, and the run resumes from its start: "
        f"fedweave {command} --resume {r.run_dir}"
    )


def save_result(r: Run) -> Params:
    """The run's model written to its run directory (:mod:`fedweave.result`), with LoRA its adapter in
    peft's layout (:func:`fedweave.task.lora.save_adapter`); the params it ends with."""
    params = result.save_result(r.params, r.run_dir, r.parts.chains.sealer, simulated=r.config.transport.kind == "inmemory")
    if r.config.task.peft.method is not None:
        from fedweave.task.lora import save_adapter

        save_adapter(r.config.task, params, r.run_dir)
    return params


def _posts_jobs(topology: Topology) -> PostsJobs | None:
    """The network transport of a deployed star that gives clients one job at a time, else None."""
    if isinstance(topology, Star) and isinstance(topology.transport, PostsJobs):
        return topology.transport
    return None


@dataclass
class _Built:
    run: Run
    summary: dict[str, Any]


def _build(config: Config, run_dir: Path, topology: Topology | None = None) -> _Built:
    task = build_task(config)
    params = initial_params(config, task)
    chains = build_chains(config)
    if chains.sealer is not None and config.transport.kind == "grpc":
        result.check_sealed_size(chains.sealer, params, config.grpc.max_message_mb, result.updates_a_message(config))
    store = ClientStateStore()
    runtime = build_client_runtime(config, task, chains, store)
    fed_count = max(1, round(config.eval.federated_fraction * config.clients))
    round_parts = RoundParts(
        strategy=build_strategy(config),
        controller=build_controller(config),
        topology=topology if topology is not None else clients_topology(config, runtime),
        chains=chains,
        min_clients=config.min_clients,
        timeout=config.round_timeout,
        evaluate_global=global_evaluator(config, task) if chains.sealer is None else _no_plaintext_model,
        eval_every=config.eval.every,
        federated_eval_every=federated_eval_every(config, task),
        federated_eval_clients=lambda rnd, absent: sample_clients(
            numpy_rng(config.seed, "federated-eval", rnd), config.clients, fed_count, absent
        ),
        eval_batch_size=config.eval.batch_size,
        checks=update_checks(config, task, params),
        deadlines=build_deadlines(config),
        hooks=hooks_of(config),
    )
    run_ = Run(
        config=config,
        run_dir=run_dir,
        parts=round_parts,
        params=params,
        first_round=1,
        partition_summary=format_summary(task.partition_summary),
        store=store,
        buffered=BufferedServer.from_config(config) if config.asynchronous.enabled else None,
    )
    return _Built(run_, task.partition_summary)


def _no_plaintext_model(params: Params) -> dict[str, float]:
    """The server's evaluation of a model it keeps encrypted (plugin he): none (clients evaluate it)."""
    return {}


def run_config(config: Config, run_dir: Path | None = None) -> Run:
    """Prepare and execute a new run; returns it with its records (library entry point)."""
    r = prepare(config, run_dir)
    started = time.perf_counter()
    execute(r)
    log.info("run %s finished in %.1f s", r.run_dir, time.perf_counter() - started)
    return r
