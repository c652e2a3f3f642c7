"""The synchronous data-parallel spine (``mode: data_parallel``).

N worker processes train one model on one dataset. Each step::

    sizes   = controller.batches                    # b_i, Σ b_i = B (identical on every worker)
    mine    = sampler.take(sizes)[rank]             # disjoint index ranges of one global batch
    g_i     = ∇ (b_i / B) · mean loss on mine        # timed: compute time t_i (+ emulated slowness)
    buffer  = [g_i, buffers · b_i / B, loss, t_i in slot i, ...]
    all_reduce(buffer, SUM)                         # ONE collective: Σ_i g_i is the gradient of the
                                                    # whole batch, and every t_j reaches every worker
    optimizer.step()                                # the same step on every worker
    controller.observe(sizes, t)                    # the same decision on every worker
    sampler.advance(B)

A world-size mean (what DDP does) would weight a worker's samples by 1/n instead of
b_i / B, which is wrong as soon as the b_i differ; the weighting here makes the step
exactly that of one process on the concatenated batch.

World changes: a worker that dies breaks the collective on the others (gloo reports
the closed connection at once; a hung worker is caught by the collective timeout).
The survivors report to the launcher, which holds a TCP store for the whole run and
names the members of the next generation; they form a new process group under a new
store prefix, take the state of the most advanced survivor (a worker may have
completed the failed step), the controller replans over the survivors and the step is
taken again from the same sampler position, so no progress beyond the current step is
lost and the epoch still covers every sample once.

A worker that joins announces itself in the same store: it claims the next slot
``join/<i>`` (worker id and the first step it may take part in) and counts itself in
``joins``. The members read that counter at most every ``JOIN_POLL`` seconds, not
every step (one store round trip, ~0.1 ms on loopback), and carry what they read in
the step's all-reduce, so all of them learn of the newcomer at the same step
boundary. They close the metrics window, name the newcomer to the launcher and report
as after a failure; the launcher names the next generation, members and newcomer, and
tells the newcomer which one. The newcomer takes the state (model, optimiser,
sampler position, controller) from the most advanced member, the controller replans
with it counted as the mean throughput of the others until its first measured
steps, and training goes on from the same sampler position. A newcomer that does not
arrive is dropped like a worker that hangs, within the timeouts. Emulated joins
(``heterogeneity.joins``) are started with the others and announce themselves before
the others start, so each is admitted exactly at its step; :func:`join` (``fedweave
join RUN_DIR``) adds a worker to a running job from another process of this host.

The launcher (:func:`execute`) runs in the calling process: it forks the workers
(spawns them when CUDA is present, see :func:`resolve_backend`), tails
``metrics.jsonl`` for progress, and writes the plot of per-worker batch size, compute
and idle time at the end.
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fedweave import config as config_mod
from fedweave.batching.dynamic import BatchController
from fedweave.batching.heterogeneity import Emulator, worker_threads
from fedweave.batching.sampler import GlobalSampler
from fedweave.checkpoint import CHECKPOINT, atomic_save, atomic_write_text, checkpoint_type, load_checkpoint
from fedweave.config import Config
from fedweave.errors import CheckpointError, ConfigError, FedweaveError
from fedweave.observe.metrics import MetricsWriter, read_metrics
from fedweave.seeding import derive_seed
from fedweave.strategies.training import LocalOptimizer, LocalSettings, LossFn
from fedweave.task import Dataset, build_model, evaluate, load_dataset, make_loss

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
MODEL_FILE = "model.pt"
PLOT_FILE = "workers.png"
RENDEZVOUS_FILE = "rendezvous.json"  # where a running job's store listens, for :func:`join`

JOINS_KEY = "joins"  # store counter: joiners announced (slots join/1 .. join/<count> are filled)
WORKER_IDS_KEY = "worker-ids"  # store counter: the next worker id (for workers joined by hand)
MAX_JOIN_SLOTS = 100_000

JOIN_POLL = 0.1
"""Seconds between two reads of the join counter by a worker (a joiner waits at most
this long, plus a step, to be noticed; the reads cost ~0.1 ms each)."""

Record = dict[str, Any]


class DataParallelError(FedweaveError):
    """A data-parallel run could not continue (too few workers left, a worker failed to start)."""


# --------------------------------------------------------------------------- gradient maths


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def float_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Floating buffers (BatchNorm running statistics): averaged like the gradients."""
    return [b for b in model.buffers() if b.is_floating_point()]


def local_contribution(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, weight: float
) -> tuple[torch.Tensor, float]:
    """This worker's share of the global-batch gradient: ∇ (weight · mean loss on (x, y)),
    flattened; ``weight`` = b_i / B. Also the weighted loss (its share of the batch mean).

    Summed over workers these shares are exactly the gradient of the mean loss over
    the concatenated batch.
    """
    params = trainable(model)
    for p in params:
        p.grad = None
    if len(y) == 0:
        return torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device), 0.0
    loss = loss_fn(model(x), y) * weight
    loss.backward()
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    return flat, float(loss.detach())


def _pieces(tensors: Iterable[torch.Tensor], flat: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor with its consecutive slice of ``flat``, shaped like it (a view)."""
    offset = 0
    for t in tensors:
        yield t, flat[offset : offset + t.numel()].view_as(t)
        offset += t.numel()


def assign_gradient(model: nn.Module, flat: torch.Tensor) -> None:
    """Set each parameter's ``grad`` from one flat vector (the summed contributions)."""
    for p, piece in _pieces(trainable(model), flat):
        p.grad = piece.clone()


def copy_flat(tensors: Iterable[torch.Tensor], flat: torch.Tensor, add: bool = False) -> None:
    """Copy (``add``: add) consecutive slices of one flat vector into ``tensors``, in place."""
    with torch.no_grad():
        for t, piece in _pieces(tensors, flat):
            if add:
                t.add_(piece.to(t.dtype))
            else:
                t.copy_(piece)


def summed_gradient(
    model: nn.Module, loss_fn: LossFn, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Σ_i ∇ (b_i / B) · mean loss of chunk i: what the all-reduce computes, in one process."""
    total = sum(len(y) for y in ys)
    return torch.stack([local_contribution(model, loss_fn, x, y, len(y) / total)[0] for x, y in zip(xs, ys)]).sum(0)


# --------------------------------------------------------------------------- process group


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when the message is empty)."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]


class PeerFailure(Exception):
    """A collective failed: a peer died, hung past the timeout, or left."""


class _Stopped(Exception):
    """The launcher ended this worker's part in the run (too few survivors, or excluded)."""


class _Group:
    """One generation of the process group: ``members`` (worker ids, sorted) joined under
    the store prefix of generation ``gen``; rank = position of this worker in ``members``."""

    def __init__(
        self, store: dist.Store, gen: int, members: list[int], worker: int, backend: str, timeout: float,
        device: torch.device,
    ):
        self.gen = gen
        self.members = members
        self.rank = members.index(worker)
        self.size = len(members)
        self.device = device
        try:
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(f"gen{gen}/", store),
                rank=self.rank,
                world_size=self.size,
                timeout=datetime.timedelta(seconds=timeout),
            )
        except Exception as exc:  # a member that never arrives times the rendezvous out
            raise PeerFailure(f"forming generation {gen} failed: {exc}") from exc

    def all_reduce(self, tensor: torch.Tensor) -> None:
        try:
            dist.all_reduce(tensor)
        except Exception as exc:
            raise PeerFailure(_first_line(exc)) from exc

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=src, device=self.device if self.device.type == "cuda" else None)
        except Exception as exc:
            raise PeerFailure(_first_line(exc)) from exc
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a broken group may not tear down cleanly; it is dropped anyway
                log.debug("destroying generation %d: %s", self.gen, exc)


# --------------------------------------------------------------------------- the worker


@checkpoint_type
@dataclass
class _Window:
    """Per-worker sums over the steps since the last metrics line (identical on every worker)."""

    steps: int = 0
    samples: int = 0
    loss: float = 0.0
    taken: dict[int, int] = field(default_factory=dict)  # steps each worker took part in
    batch: dict[int, float] = field(default_factory=dict)
    compute: dict[int, float] = field(default_factory=dict)
    idle: dict[int, float] = field(default_factory=dict)
    comm: float = 0.0
    comm_steps: int = 0
    step_time: float = 0.0  # this worker's wall time per step (rank 0's is what is logged)
    controller_time: float = 0.0

    def add(self, sizes: Mapping[int, int], times: Mapping[int, float], loss: float, comm: float | None) -> None:
        self.steps += 1
        total = sum(sizes.values())
        self.samples += total
        self.loss += loss * total
        slowest = max(times.values())
        for w in sizes:
            self.taken[w] = self.taken.get(w, 0) + 1
            self.batch[w] = self.batch.get(w, 0.0) + sizes[w]
            self.compute[w] = self.compute.get(w, 0.0) + times[w]
            self.idle[w] = self.idle.get(w, 0.0) + slowest - times[w]
        if comm is not None:
            self.comm += comm
            self.comm_steps += 1


@dataclass
class _Shared:
    """What every worker gets from the launcher."""

    config: Config
    run_dir: Path
    members: list[int]
    backend: str
    resume: dict[str, Any] | None = None
    dataset: Dataset | None = None  # preloaded by the launcher when the workers are forked


def resolve_backend(config: Config) -> tuple[str, str]:
    """(backend, start method): NCCL when CUDA has a GPU per worker, else gloo.

    Workers are forked (instant: torch is not imported again, the dataset is shared)
    unless CUDA is present: a CUDA build's autograd engine starts device threads at
    the caller's first backward pass, after which a forked child cannot run autograd,
    so with CUDA the workers are spawned.
    """
    backend = config.data_parallel.backend
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    workers = config.data_parallel_workers
    if backend == "nccl" and gpus < workers:
        raise ConfigError(
            f"config key 'data_parallel.backend': nccl needs a GPU per worker; {workers} workers, {gpus} GPUs"
        )
    if backend == "auto":
        backend = "nccl" if gpus >= workers else "gloo"
    return backend, ("spawn" if cuda else "fork")


def make_optimizer(model: nn.Module, dp: config_mod.DataParallelConfig) -> LocalOptimizer:
    """The optimiser of ``data_parallel`` (the same step on every worker, or on the parameter server)."""
    return LocalOptimizer(
        model.parameters(),
        LocalSettings(optimizer=dp.optimizer, lr=dp.lr, momentum=dp.momentum, weight_decay=dp.weight_decay),
    )


def optimizer_state(optimizer: LocalOptimizer) -> dict[str, Any]:
    """The optimiser's state for a checkpoint (its tensors copied to the CPU)."""
    return {"steps": optimizer.steps, "state": _to(optimizer.state, torch.device("cpu"))}


def load_optimizer_state(optimizer: LocalOptimizer, saved: Mapping[str, Any], device: torch.device) -> None:
    """Restore what :func:`optimizer_state` saved, its tensors on ``device``."""
    optimizer.steps = int(saved["steps"])
    optimizer.state = _to(saved["state"], device)


def worker_setup(worker: int, shared: _Shared) -> tuple[Emulator, torch.device, Dataset]:
    """What every worker process starts with: its threads, its emulated speed, its device
    (its own GPU with NCCL) and the dataset (inherited when forked, else loaded)."""
    cfg = shared.config
    threads = worker_threads(cfg.heterogeneity, worker, cfg.threads)
    if threads:
        torch.set_num_threads(threads)
    emulator = Emulator(cfg.heterogeneity, worker, threads or torch.get_num_threads())
    device = torch.device(f"cuda:{worker}") if shared.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return emulator, device, shared.dataset or _load(cfg)


class _Worker:
    def __init__(self, worker: int, shared: _Shared):
        cfg = shared.config
        dp = cfg.data_parallel
        self.id = worker
        self.shared = shared
        self.config = cfg
        self.emulator, self.device, self.dataset = worker_setup(worker, shared)
        torch.manual_seed(derive_seed(cfg.seed, "init"))
        self.model = _make_model(cfg, self.dataset).to(self.device)
        self.loss_fn = make_loss(cfg.task.loss)
        self.optimizer = make_optimizer(self.model, dp)
        self.sampler = GlobalSampler(len(self.dataset.y_train), cfg.seed)
        self.controller = BatchController(dp.global_batch, shared.members, dp.controller)
        self.step = 0
        self.window = _Window()
        self.prev_wait = 0.0
        self.members = list(shared.members)
        self.fresh = False  # a newcomer until it has the run's state
        self.store: dist.Store | None = None
        self.seen = 0  # announcements of joiners counted in the store at the last read
        self.last_poll = -float("inf")
        self.announced: list[tuple[int, int]] = []  # (worker, first step) of join/1, join/2, ...
        self.admitted: set[int] = set()  # joiners already taken in (or dropped): never again
        self.metrics = MetricsWriter(shared.run_dir / METRICS_FILE)
        self.logged_step = -1
        self.started = time.perf_counter()
        if shared.resume is not None:
            self.load_state_dict(shared.resume)

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "optimizer": optimizer_state(self.optimizer),
            "sampler": self.sampler.state_dict(),
            "controller": self.controller.state_dict(),
            "window": self.window,
            "elapsed": time.perf_counter() - self.started,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.model.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"], self.device)
        self.sampler.load_state_dict(state["sampler"])
        self.controller.load_state_dict(state["controller"])
        self.window = state["window"]
        self.started = time.perf_counter() - float(state["elapsed"])

    # ---------------------------------------------------------------- the run

    def run(self, address: tuple[str, int], join_step: int | None = None) -> None:
        """Train until the run is done; with ``join_step``, first join the running job
        (taking part from that step at the earliest)."""
        dp = self.config.data_parallel
        store = worker_store(address, dp.timeout)
        self.store = store
        gen = 0 if join_step is None else self._admission(store, join_step)
        while True:
            group = None
            try:
                group = _Group(store, gen, self.members, self.id, self.shared.backend, dp.timeout, self.device)
                if gen > 0:
                    self._sync(group)
                if self.controller.workers != self.members:
                    self.controller.set_workers(self.members)
                joiners = self._train(group)
                if not joiners:
                    break
                store.set(f"grow/{gen}", ",".join(map(str, joiners)))  # before the report: the launcher reads it
                log.info("worker %d: admitting workers %s after step %d", self.id, joiners, self.step)
            except PeerFailure as exc:
                log.warning("worker %d: generation %d failed at step %d: %s", self.id, gen, self.step, exc)
            if group is not None:
                group.close()
            self.members = _next_members(store, gen, self.id, self.step, dp.timeout)
            gen += 1
            log.info("worker %d: generation %d at step %d with workers %s", self.id, gen, self.step, self.members)
        group.close()

    def _admission(self, store: dist.Store, first_step: int) -> int:
        """Announce this worker and wait for the generation that takes it in; its number.

        Each wait is bounded; the whole is bounded by the run: the launcher sets ``end``
        when it finishes, and its store vanishes with it.
        """
        _announce(store, self.id, first_step)
        key = f"admitted/{self.id}"
        while not store.check([key]):
            if store.check(["end"]):
                raise _Stopped("the run ended before this worker was admitted")
            try:
                store.wait([key], datetime.timedelta(seconds=1))
            except Exception as exc:  # the wait timed out: look again (a vanished store fails the check)
                log.debug("worker %d: waiting to be admitted: %s", self.id, exc)
        value = store.get(key).decode()
        if not value:
            raise _Stopped("not admitted: the launcher dropped this worker")
        gen = int(value)
        self.members = _ids(store.get(f"members/{gen}").decode())
        self.fresh = True
        log.info("worker %d: admitted to generation %d with workers %s", self.id, gen, self.members)
        return gen

    def _sync(self, group: _Group) -> None:
        """Every member takes the state of the most advanced one (lowest rank among equals):
        a member may have completed the step that failed on the others; a newcomer has none."""
        steps = torch.zeros(group.size, dtype=torch.float64, device=self.device)
        steps[group.rank] = -1 if self.fresh else self.step
        group.all_reduce(steps)
        src = int(torch.argmax(steps).item())  # the first maximum
        if steps[src] < 0:
            raise _Stopped(f"no member of generation {group.gen} holds the run's state (only newcomers are left)")
        mine = (self.state_dict(), self._join_state()) if group.rank == src else None
        state, joins = group.broadcast_object(mine, src)
        if group.rank != src:
            self.load_state_dict(state)
            self.announced = [tuple(a) for a in joins["announced"]]
            self.admitted = set(joins["admitted"])
        self.fresh = False

    def _join_state(self) -> dict[str, Any]:
        """What the members know of joiners (not checkpointed: a resumed run has a new store)."""
        return {"announced": list(self.announced), "admitted": sorted(self.admitted)}

    def _poll_joins(self, force: bool = False) -> None:
        """Read the store's count of announced joiners, at most every ``JOIN_POLL`` seconds."""
        now = time.monotonic()
        if not force and now - self.last_poll < JOIN_POLL:
            return
        assert self.store is not None
        try:
            self.seen = int(self.store.add(JOINS_KEY, 0))
        except Exception as exc:
            raise _Stopped(f"the launcher's store is gone: {exc}") from exc
        self.last_poll = now

    def _due_joiners(self, announced: int) -> list[int]:
        """Joiners to admit after this step: announced (``announced`` is the largest count any
        member read, the same on every member), due by their first step, not yet admitted."""
        assert self.store is not None
        for i in range(len(self.announced) + 1, announced + 1):  # slots up to the count are filled
            self.announced.append(_parse_announcement(self.store.get(f"join/{i}").decode()))
        due = sorted({w for w, first in self.announced if first <= self.step} - self.admitted - set(self.members))
        self.admitted.update(due)
        return due

    def _done(self) -> bool:
        dp = self.config.data_parallel
        if dp.steps is not None:
            return self.step >= dp.steps
        return self.sampler.epoch >= dp.epochs

    def _train(self, group: _Group) -> list[int]:
        """Take steps until the run is done (returns []) or joiners are due (returns them,
        after closing the metrics window so that the next one starts with them)."""
        dp = self.config.data_parallel
        data = self.dataset
        members = self.members
        n_params = sum(p.numel() for p in trainable(self.model))
        buffers = float_buffers(self.model)
        n_buf = sum(b.numel() for b in buffers)
        dtype = trainable(self.model)[0].dtype
        if group.rank == 0:
            self.logged_step = _last_logged_step(self.metrics.path)
        self._poll_joins(force=True)
        while not self._done():
            total = self.sampler.step_size(dp.global_batch)
            sizes = self.controller.allocation(total)
            index = self.sampler.take([sizes[w] for w in members])[group.rank]
            mine = sizes[self.id]
            step_start = time.perf_counter()
            cpu_start = time.process_time()
            torch.manual_seed(derive_seed(self.config.seed, "data-parallel-step", self.step, self.id))
            oom = 0.0
            try:
                idx = torch.from_numpy(index)
                x, y = data.x_train[idx].to(self.device), data.y_train[idx].to(self.device)
                self.model.train()
                flat, loss = local_contribution(self.model, self.loss_fn, x, y, mine / total)
            except torch.OutOfMemoryError:
                if not self.controller.settings.memory_guard or mine <= self.controller.settings.min_batch:
                    raise
                flat, loss, oom = torch.zeros(n_params, dtype=dtype, device=self.device), 0.0, 1.0
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.emulator.pad(self.step, mine, time.process_time() - cpu_start, time.perf_counter() - step_start)
            compute = time.perf_counter() - step_start
            self.emulator.maybe_crash(self.step)
            self._poll_joins()

            n = group.size
            tail = torch.zeros(1 + 4 * n, dtype=dtype, device=self.device)
            tail[0] = loss
            tail[1 + group.rank] = compute
            tail[1 + n + group.rank] = self.prev_wait
            tail[1 + 2 * n + group.rank] = oom
            tail[1 + 3 * n + group.rank] = self.seen
            weight = mine / total
            parts = [flat, *(b.detach().reshape(-1).to(dtype) * weight for b in buffers), tail]
            buffer = torch.cat(parts)
            wait_start = time.perf_counter()
            group.all_reduce(buffer)
            self.prev_wait = time.perf_counter() - wait_start

            tail = buffer[n_params + n_buf :].cpu().double().tolist()
            ooms = [members[j] for j in range(n) if tail[1 + 2 * n + j] > 0]
            if ooms:
                for w in ooms:
                    self.controller.report_oom(w)
                continue  # the step is taken again with the lowered batches
            assign_gradient(self.model, buffer[:n_params])
            self.optimizer.step()
            copy_flat(buffers, buffer[n_params : n_params + n_buf])
            times = {members[j]: tail[1 + j] for j in range(n)}
            waits = [tail[1 + n + j] for j in range(n)]
            control_start = time.perf_counter()
            self.controller.observe(sizes, times)
            epoch = self.sampler.epoch
            self.sampler.advance(total)
            epoch_end = self.sampler.epoch != epoch
            if epoch_end:
                self.controller.end_epoch()
            control = time.perf_counter() - control_start
            self.step += 1
            self.window.add(sizes, times, tail[0], min(waits) if self.step > 1 and all(waits) else None)
            self.window.controller_time += control
            self.window.step_time += time.perf_counter() - step_start
            if epoch_end or self.step % dp.log_every == 0 or self._done():
                self._record(group, epoch_end)
            if not self._done():
                joiners = self._due_joiners(int(max(tail[1 + 3 * n :])))
                if joiners:
                    if self.window.steps:
                        self._record(group, False)
                    return joiners
        return []

    def _record(self, group: _Group, epoch_end: bool) -> None:
        """Close the metrics window; rank 0 writes it (with an evaluation at epoch ends or the
        last step), checkpoints at epoch ends, and saves the model after the last step."""
        w, self.window = self.window, _Window()
        if group.rank != 0:
            return
        cfg = self.config
        done = self._done()
        if self.step > self.logged_step:  # not already written by a rank 0 lost after writing it
            self._write_record(w, group.gen, epoch_end, done)
        if (epoch_end and cfg.checkpoint.every and self.sampler.epoch % cfg.checkpoint.every == 0) or (
            done and cfg.checkpoint.every
        ):
            save_checkpoint(self.shared.run_dir, self.step, self.state_dict())
        if done:
            save_model(self.model, self.shared.run_dir)

    def _write_record(self, w: _Window, gen: int, epoch_end: bool, done: bool) -> None:
        """Append the metrics line of window ``w`` (evaluated on the test set when due)."""
        cfg = self.config
        k = max(w.steps, 1)
        workers = sorted(w.batch)
        record: Record = {
            "step": self.step,
            "epoch": self.sampler.epoch + self.sampler.offset / self.sampler.num_samples,
            "samples": w.samples,
            "train_loss": w.loss / max(w.samples, 1),
            "workers": workers,
            "batch": [w.batch[i] / w.taken[i] for i in workers],
            "compute_time": [w.compute[i] / w.taken[i] for i in workers],
            "idle_time": [w.idle[i] / w.taken[i] for i in workers],
            "comm_time": w.comm / w.comm_steps if w.comm_steps else None,
            "step_time": w.step_time / k,
            "controller_time": w.controller_time,
            "window_time": w.step_time,
            "adjustments": self.controller.adjustments,
            "generation": gen,
        }
        evaluate_now = done or (epoch_end and cfg.eval.every and self.sampler.epoch % cfg.eval.every == 0)
        if evaluate_now:
            record.update(evaluation(cfg, self.model, self.dataset, self.loss_fn))
        record["wall_time"] = time.perf_counter() - self.started
        self.metrics.append(record)
        self.logged_step = self.step


def evaluation(config: Config, model: nn.Module, dataset: Dataset, loss_fn: LossFn) -> Record:
    """``model``'s metrics on the test set, each named ``test_<metric>`` as in a metrics line."""
    metrics = evaluate(model, dataset.x_test, dataset.y_test, loss_fn, batch_size=config.eval.batch_size)
    return {f"test_{name}": value for name, value in metrics.items()}


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any]) -> None:
    """The run's checkpoint after ``step``: ``state`` is what the run resumes from."""
    atomic_save({"mode": "data_parallel", "round": step, "state": state}, run_dir / CHECKPOINT)


def save_model(model: nn.Module, run_dir: Path) -> None:
    """The trained model's state (on the CPU) in ``run_dir``."""
    atomic_save({k: v.detach().cpu() for k, v in model.state_dict().items()}, run_dir / MODEL_FILE)


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device).clone()
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    return obj


def _last_logged_step(path: Path) -> int:
    records = read_metrics(path)
    return int(records[-1]["step"]) if records else -1


def _next_members(store: dist.Store, gen: int, worker: int, step: int, timeout: float) -> list[int]:
    """Report the failure of generation ``gen`` and wait (bounded) for the launcher's next members."""
    store.set(f"report/{gen}/{worker}", str(step))
    key = f"members/{gen + 1}"
    try:
        store.wait([key], datetime.timedelta(seconds=2 * timeout + 10))
    except Exception as exc:
        raise _Stopped(f"no new generation after {2 * timeout + 10:.0f} s: {exc}") from exc
    members = _ids(store.get(key).decode())
    if worker not in members:
        raise _Stopped("the run stopped: too few workers left" if not members else "excluded from the run")
    return members


def _ids(value: str) -> list[int]:
    """Worker ids from their comma-separated form in the store."""
    return [int(v) for v in value.split(",")] if value else []


def _announce(store: dist.Store, worker: int, first_step: int) -> int:
    """Claim the next free slot ``join/<i>`` for ``worker`` (atomically: compare-and-set on a
    missing key), then count it; the slot's number.

    Slots are claimed in order from the count + 1, so whoever reads a count c finds
    join/1 .. join/c filled, however many joiners announce at once.
    """
    record = f"{worker},{first_step}"
    slot = int(store.add(JOINS_KEY, 0)) + 1
    while slot <= MAX_JOIN_SLOTS:
        if store.compare_set(f"join/{slot}", "", record).decode() == record:
            store.add(JOINS_KEY, 1)
            log.info("worker %d: announced in slot %d (from step %d)", worker, slot, first_step)
            return slot
        slot += 1
    raise DataParallelError(f"no free join slot among the first {MAX_JOIN_SLOTS}")


def _parse_announcement(value: str) -> tuple[int, int]:
    worker, first_step = value.split(",")
    return int(worker), int(first_step)


def _load(config: Config) -> Dataset:
    task = config.task
    return load_dataset(
        task.dataset, seed=config.seed, test_fraction=task.test_fraction, root=task.data_root,
        options=task.dataset_options,
    )


def _make_model(config: Config, dataset: Dataset) -> nn.Module:
    return build_model(
        config.task.model, input_shape=dataset.input_shape, num_classes=dataset.num_classes,
        options=config.task.model_options,
    )


def worker_process(
    worker: int, shared: _Shared, port_conn: Any, run: Callable[[tuple[str, int]], None], logger: logging.Logger
) -> None:
    """The body of a worker process: wait (bounded) for the store's address on ``port_conn``,
    then ``run(address)``. Exits with 4 when no address comes, 3 when the run stopped it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher, which stops the workers
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not port_conn.poll(shared.config.data_parallel.timeout):
        raise SystemExit(4)
    address = port_conn.recv()
    try:
        run(address)
    except _Stopped as exc:
        logger.error("worker %d: %s", worker, exc)
        raise SystemExit(3) from None


def _worker_main(worker: int, shared: _Shared, port_conn: Any, join_step: int | None = None) -> None:
    """Entry point of a worker process (of a joining one with ``join_step``)."""
    worker_process(worker, shared, port_conn, lambda address: _Worker(worker, shared).run(address, join_step), log)


def join(run_dir: str | Path, wait: float = 0.0) -> int:
    """Add a worker, in this process, to the data-parallel run going on in ``run_dir``;
    return its worker id once the run is done.

    The run's launcher must be on this host (its store listens on 127.0.0.1; the
    address is in ``run_dir/rendezvous.json`` while the run goes on). The worker gets
    the next free id, announces itself, is admitted at the next step boundary the
    members notice it (within ``JOIN_POLL`` seconds and a step), and trains to the end.
    ``wait``: seconds to wait for the run to start (its rendezvous file to appear).
    Raises :class:`DataParallelError` when no run is going on there or the worker was
    not admitted or dropped out.
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
        raise DataParallelError(f"no data-parallel run is going on in {str(run_dir)!r}: {exc.filename} is missing")
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
    shared = _Shared(config=config, run_dir=run_dir, members=list(range(dp.workers)), backend=backend)
    log.info("joining the run in %s as worker %d", run_dir, worker)
    try:
        _Worker(worker, shared).run(address, join_step=0)
    except (_Stopped, dist.DistError) as exc:
        raise DataParallelError(f"worker {worker}: {_first_line(exc)}") from None
    return worker


# --------------------------------------------------------------------------- the launcher


@dataclass
class DataParallelRun:
    """A prepared data-parallel run: its config, directory and where it starts."""

    config: Config
    run_dir: Path
    resume_state: dict[str, Any] | None = None
    records: list[Record] = field(default_factory=list)

    @property
    def start_step(self) -> int:
        return 0 if self.resume_state is None else int(self.resume_state["step"])

    @property
    def finished(self) -> bool:
        """Whether the saved state already completed the configured steps or epochs. An asp
        state counts the epochs whose every sample was resolved: its sampler may be past
        the last epoch while ranges handed out earlier are still to be trained."""
        if self.resume_state is None:
            return False
        dp = self.config.data_parallel
        if dp.steps is not None:
            return self.start_step >= dp.steps
        if self.resume_state.get("sync") == "asp":
            return int(self.resume_state["completed"]) >= dp.epochs
        return int(self.resume_state["sampler"]["epoch"]) >= dp.epochs


def prepare(config: Config, run_dir: Path | None = None) -> DataParallelRun:
    """A new run directory (config saved) for ``config`` (``mode: data_parallel``)."""
    from fedweave.runner import new_run_dir

    if config.mode != "data_parallel":
        raise ConfigError(f"config key 'mode': data-parallel runs need mode data_parallel, got {config.mode!r}")
    run_dir = new_run_dir(config) if run_dir is None else Path(run_dir)
    if (run_dir / METRICS_FILE).exists() or (run_dir / CHECKPOINT).exists():
        raise ConfigError(
            f"run directory {str(run_dir)!r} already holds a run; continue it with "
            "`fedweave run --resume` or choose another directory"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(config_mod.to_yaml(config), run_dir / CONFIG_FILE)
    return DataParallelRun(config, run_dir)


def resume(run_dir: str | Path) -> DataParallelRun:
    """Continue the data-parallel run in ``run_dir`` from its last checkpoint (an epoch's end)."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise CheckpointError(f"{str(run_dir)!r} is not a run directory: it has no {CONFIG_FILE}")
    config = config_mod.load(run_dir / CONFIG_FILE)
    saved = load_checkpoint(run_dir)
    if saved.get("mode") != "data_parallel":
        raise CheckpointError(f"checkpoint in {str(run_dir)!r} is not of a data-parallel run")
    state = saved["state"]
    kept = [r for r in read_metrics(run_dir / METRICS_FILE) if r["step"] <= state["step"]]
    atomic_write_text("".join(json.dumps(r) + "\n" for r in kept), run_dir / METRICS_FILE)
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
    (the last checkpoint stays intact: continue with :func:`resume`).
    """
    if r.finished:
        log.info("%s already finished", r.run_dir)
        return r.records
    if r.config.data_parallel.sync == "asp":
        from fedweave import parameter_server

        return parameter_server.execute(r, on_record, on_start)
    cfg = r.config
    dp = cfg.data_parallel
    backend, method = resolve_backend(cfg)
    # emulated joiners whose step a resumed run has passed start with the others
    joins = {j.worker: j.step for j in cfg.heterogeneity.joins if j.step > r.start_step}
    members = [w for w in range(cfg.data_parallel_workers) if w not in joins]
    ctx = multiprocessing.get_context(method)
    shared = _Shared(
        config=cfg, run_dir=r.run_dir, members=members, backend=backend, resume=r.resume_state,
        dataset=_load(cfg) if method == "fork" else None,
    )
    procs, conns = spawn_workers(
        ctx, [*members, *joins], _worker_main, lambda w, pipe: (w, shared, pipe, joins.get(w)), "fedweave-worker"
    )
    store = launcher_store(dp.timeout)
    store.set("members/0", ",".join(map(str, members)))
    store.add(WORKER_IDS_KEY, cfg.data_parallel_workers)  # the next id joins by hand get
    release_workers(conns, joins, store.port)  # joiners announce themselves first: each is admitted at its step
    _await_announcements(store, len(joins), procs, dp.timeout)
    release_workers(conns, members, store.port)
    rendezvous = r.run_dir / RENDEZVOUS_FILE
    atomic_write_text(json.dumps({"host": "127.0.0.1", "port": store.port, "backend": backend}), rendezvous)
    if on_start is not None:
        on_start({w: p.pid for w, p in procs.items()})
    tail = _Tail(r.run_dir / METRICS_FILE)
    failure = None
    try:
        failure = _supervise(store, procs, members, dp.timeout, dp.min_workers, tail, r.records, on_record)
    finally:
        rendezvous.unlink(missing_ok=True)
        store.set("end", "1")  # joiners still waiting to be admitted stop
        for w in joins:
            if not store.check([f"admitted/{w}"]):
                log.info("worker %d was never admitted: the run ended before step %d", w, joins[w])
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


def _await_announcements(store: dist.Store, count: int, procs: Mapping[int, Any], timeout: float) -> None:
    """Wait (bounded) until ``count`` joiners have announced themselves."""
    deadline = time.monotonic() + timeout
    while int(store.add(JOINS_KEY, 0)) < count:
        if time.monotonic() > deadline or not all(p.is_alive() for p in procs.values()):
            log.warning("the joining workers did not all announce themselves: they join when they do")
            return
        time.sleep(0.01)


def spawn_workers(
    ctx: Any, ids: Sequence[int], target: Callable[..., None], args: Callable[[int, Any], tuple], name: str
) -> tuple[dict[int, Any], dict[int, Any]]:
    """One process per worker id, each waiting on its pipe for the store's address
    (:func:`release_workers`); ``args(id, pipe)`` are the target's arguments."""
    procs: dict[int, Any] = {}
    conns: dict[int, Any] = {}
    for w in ids:
        receive, send = ctx.Pipe(duplex=False)
        procs[w] = ctx.Process(target=target, args=args(w, receive), name=f"{name}-{w}")
        procs[w].start()
        conns[w] = send
    return procs, conns


def launcher_store(timeout: float) -> dist.TCPStore:
    """The run's TCP store, held by the launcher on a free loopback port."""
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
    )


def worker_store(address: tuple[str, int], timeout: float) -> dist.TCPStore:
    """A worker's client of the run's TCP store at ``address``."""
    return dist.TCPStore(*address, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def release_workers(conns: Mapping[int, Any], ids: Sequence[int], port: int) -> None:
    """Send the store's address to the workers ``ids``: they start."""
    for w in ids:
        conns[w].send(("127.0.0.1", port))
        conns[w].close()


class _Tail:
    """Complete new lines of a growing ``metrics.jsonl``."""

    def __init__(self, path: Path):
        self.path = path
        self.position = path.stat().st_size if path.exists() else 0

    def read(self) -> list[Record]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.position)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self.position += end
        return [json.loads(line) for line in chunk[:end].decode().splitlines() if line.strip()]


def _supervise(
    store: dist.Store,
    procs: dict[int, Any],
    members: list[int],
    timeout: float,
    min_workers: int,
    tail: _Tail,
    records: list[Record],
    on_record: Callable[[Record], None] | None,
) -> str | None:
    """Follow the workers until all have exited; name each new generation after a failure
    or when the members ask to admit joiners (``grow/<gen>``).

    ``procs`` are the processes this launcher started; a member without one joined by
    hand (:func:`join`): it counts as alive until it fails to report. Returns None when
    the run finished, else why it stopped.
    """
    gen = 0
    poll = 0.05

    def alive(w: int) -> bool:
        return w not in procs or procs[w].is_alive()

    while True:
        for record in tail.read():
            records.append(record)
            if on_record is not None:
                on_record(record)
        codes = {w: procs[w].exitcode for w in members if w in procs}
        if not codes:
            store.set(f"members/{gen + 1}", "")
            return f"data-parallel run stopped at generation {gen}: no worker started by this launcher is left"
        if all(c is not None for c in codes.values()) and any(c == 0 for c in codes.values()):
            failed = {w: c for w, c in codes.items() if c != 0}
            if failed:
                log.warning("workers %s exited with %s after the others finished the run", list(failed), failed)
            return None
        dead = [w for w, c in codes.items() if c is not None and c != 0]
        reported = [w for w in members if store.check([f"report/{gen}/{w}"])]
        if not dead and not reported:
            time.sleep(poll)
            continue
        # A failure or a join in generation ``gen``: wait (bounded) for every live member to report.
        deadline = time.monotonic() + timeout + 5.0
        while time.monotonic() < deadline:
            if all(store.check([f"report/{gen}/{w}"]) for w in members if alive(w)):
                break
            time.sleep(poll)
        survivors = [w for w in members if alive(w) and store.check([f"report/{gen}/{w}"])]
        for w in members:
            if alive(w) and w not in survivors:
                log.warning("worker %d did not report within %.0f s after a failure: dropped", w, timeout + 5)
                if w in procs:
                    procs[w].kill()
        lost = [w for w in members if w not in survivors]
        codes_lost = {w: procs[w].exitcode if w in procs else None for w in lost}
        grow = _ids(store.get(f"grow/{gen}").decode()) if store.check([f"grow/{gen}"]) else []
        joiners = [w for w in grow if alive(w)]  # one that died while waiting is not admitted
        if len(survivors) + len(joiners) < min_workers:
            store.set(f"members/{gen + 1}", "")
            for w in grow:
                store.set(f"admitted/{w}", "")
            return (
                f"data-parallel run stopped at generation {gen}: workers {lost} lost "
                f"(exit codes {codes_lost}), {len(survivors)} left, min_workers is {min_workers}"
            )
        if lost:
            log.warning("workers %s lost (exit codes %s); continuing with %s", lost, codes_lost, survivors)
        if grow:
            log.info("workers %s join (%s admitted)", grow, joiners)
        members = sorted(survivors + joiners)
        gen += 1
        store.set(f"members/{gen}", ",".join(map(str, members)))
        for w in grow:  # after the members: a joiner reads them once admitted
            store.set(f"admitted/{w}", str(gen) if w in joiners else "")


def run_config(config: Config, run_dir: Path | None = None) -> DataParallelRun:
    """Prepare and execute a new data-parallel run (library entry point)."""
    r = prepare(config, run_dir)
    execute(r)
    return r
