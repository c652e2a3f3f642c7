"""The asynchronous parameter-server mode of data-parallel training (``data_parallel.sync: asp``).

OmniLearn's ASP: Tyagi & Sharma, "OmniLearn: A Framework for Distributed Deep Learning
over Heterogeneous Clusters", IEEE TPDS 2025, https://arxiv.org/abs/2503.17469.
Staleness weights as in FedAsync (Xie et al., https://arxiv.org/abs/1903.03934) and
FedBuff (Nguyen et al., AISTATS 2022, https://arxiv.org/abs/2106.06639).

No worker waits for another. The server holds the model, its optimiser and a version
(server steps taken); each worker loops::

    receive  the params of version v and a range of the global sampler: b_i samples
    compute  g = ∇ mean loss over its b_i samples          timed: compute time t_i
    push     [header: v, t_i, wait, loss | g | Δ float buffers]     one flat message

and the server, for each push in the order they arrive::

    τ    = version − v                                     staleness, in server steps
    drop   the push when τ > max_staleness
    acc += (b_i / B) · s(τ) · g                            s: FedBuff's, e.g. polynomial (1+τ)^-½
    every K (``buffer``) kept pushes: p.grad = acc; optimizer.step(); version += 1
    controller.observe({i: b_i}, {i: t_i}); reply to i: current params, its next range

- **Weights.** B is ``global_batch`` and the controller's b_i sum to it, so one fresh
  push from each worker moves the model as one synchronous step of B samples would
  (the gradient is weighted by b_i / B there too): ``lr`` means the same in bsp and
  asp. With one worker, asp *is* single-process SGD (tested). The weights scale the
  gradient, not the learning rate, so SGD's momentum sees weighted gradients; Adam,
  which normalises the scale away, is refused with asp when the config is loaded.
- **Even update rates (OmniLearn).** The dynamic controller gives b_i = B · X_i / Σ X_j
  (X_i: measured throughput, each push one measurement), so every worker's update
  takes B / Σ X_j and the workers push at the same rate. With static equal batches a
  worker pushes in proportion to its speed, and the slow worker's gradients are
  always the stalest: at speeds 1:2:4 its updates are ~6 server steps old against
  ~0.75 for the fast one. (The mean over *all* updates is W − 1 in both cases: each
  update is as old as the number of updates the others applied while it computed.
  Balancing evens staleness out across workers; it does not lower its mean.)
- **The sampler.** The server hands out consecutive ranges of the epoch's seeded
  permutation (:class:`~fedweave.batching.sampler.GlobalSampler`), so an epoch covers
  each sample once; a worker computes the permutation of the range's epoch itself.
  An epoch is complete when all its samples' pushes have arrived (applied or
  dropped); evaluation and checkpoints happen then. A range held by a worker that is
  lost is handed out again, first thing, to the next worker that asks.

Design choices:

- **The server runs in the launcher's process**, not in a worker: all W workers are
  alike (``heterogeneity.speeds`` has one entry per worker as in bsp); the launcher
  holds the store and is already the run's single point of failure, so the server
  adds none; and it sees a worker's death directly.
- **Transport: gloo point-to-point**, one process group of W + 1 ranks (server rank 0)
  bound to 127.0.0.1, created as a standalone ``ProcessGroupGloo`` (no global
  ``init_process_group`` in the launcher's process). One flat tensor per message, its
  header packed bit-exactly as float64 in its first slots. The server posts one
  receive per worker that owes a push, each waited on in a thread of a small pool,
  and takes whichever completes first: a receive from any source, but a failure
  stays with its worker (a dead worker's closed connection fails only its own
  receive). A worker that has not pushed within ``data_parallel.timeout`` of its task
  is killed by the server, which fails its receive the same way: gloo's own timeout
  would close every connection of the group, so it is only a last resort, set to
  2 · timeout + 10 s (:func:`group_timeout`). The run's TCP store would also carry
  messages, but its libuv server refuses values over 8 MiB and a 4 MB round trip
  through it took ~60 ms on loopback against ~12 ms with gloo.
- **Bounded.** A push is awaited at most ``timeout``, then its worker is killed; a
  lost worker's range goes to another; fewer than ``min_workers`` left stops the run
  with a :class:`~fedweave.data_parallel.DataParallelError` (the last checkpoint
  intact); at the end the server answers each outstanding push with a stop, within
  ``timeout``, and the launcher kills what is left.

The emulated heterogeneity (``heterogeneity``) uses the model version a worker
computes on as its step: a speed change applies from that version on, and a crash
scheduled at step k kills the worker in the first update it computes on a version
>= k, before the push.
"""

from __future__ import annotations

import datetime
import logging
import math
import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fedweave.asynchronous import staleness_weight
from fedweave.batching.dynamic import BatchController
from fedweave.batching.sampler import GlobalSampler
from fedweave.config import StalenessOptions
from fedweave.data_parallel import (
    METRICS_FILE,
    PLOT_FILE,
    DataParallelError,
    DataParallelRun,
    Record,
    _first_line,
    _load,
    _make_model,
    _Shared,
    _Stopped,
    assign_gradient,
    copy_flat,
    evaluation,
    float_buffers,
    launcher_store,
    load_optimizer_state,
    local_contribution,
    make_optimizer,
    optimizer_state,
    release_workers,
    resolve_backend,
    save_checkpoint,
    save_model,
    spawn_workers,
    trainable,
    worker_process,
    worker_setup,
    worker_store,
)
from fedweave.observe.metrics import MetricsWriter
from fedweave.seeding import derive_seed
from fedweave.strategies.training import LocalOptimizer
from fedweave.task import make_loss

log = logging.getLogger(__name__)

SERVER = 0  # the server's rank; worker w has rank w + 1
TAG = 0
WORK, STOP = 0, 1
TASK_HEADER = 5  # kind, version, epoch, start, count
PUSH_HEADER = 4  # version pulled, compute time, wait, loss
POLL = 0.5
"""Seconds the server waits for a push before looking again (it wakes at once on one)."""


def group_timeout(timeout: float) -> float:
    """gloo's own timeout, a last resort: when it fires, gloo closes every connection of
    the group, so the server enforces ``timeout`` itself (killing a silent worker)."""
    return 2 * timeout + 10


# --------------------------------------------------------------------------- the maths


def update_weight(batch: int, global_batch: int, staleness: int, settings: StalenessOptions) -> float:
    """(b_i / B) · s(τ): the weight of a pushed mean gradient over ``batch`` samples, with
    FedBuff's staleness functions (:func:`fedweave.asynchronous.staleness_weight`)."""
    return batch / global_batch * staleness_weight(staleness, settings)


@dataclass(frozen=True)
class Arrival:
    """What the server did with one push."""

    staleness: int
    weight: float | None  # None: dropped, older than max_staleness
    stepped: bool  # the push filled the buffer: the server took a step


class ParameterServer:
    """The model, its optimiser and version: pushed gradients in, steps out (no I/O, no clocks)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: LocalOptimizer,
        global_batch: int,
        staleness: StalenessOptions | None = None,
        buffer: int = 1,
    ):
        self.model = model
        self.optimizer = optimizer
        self.params = trainable(model)
        self.buffers = float_buffers(model)
        self.global_batch = global_batch
        self.staleness = staleness or StalenessOptions()
        self.buffer = buffer
        self.dtype = self.params[0].dtype
        self.num_params = sum(p.numel() for p in self.params)
        self.num_buffers = sum(b.numel() for b in self.buffers)
        self.version = 0  # server steps taken
        self.pending = 0  # pushes summed into the buffer since the last step
        self._grad = torch.zeros(self.num_params, dtype=self.dtype)
        self._delta = torch.zeros(self.num_buffers, dtype=self.dtype)

    def receive(self, gradient: torch.Tensor, buffer_delta: torch.Tensor, batch: int, pulled: int) -> Arrival:
        """One push: the mean gradient over ``batch`` samples (and the change of the float
        buffers) computed on version ``pulled``. Steps when the buffer is full."""
        tau = self.version - pulled
        if tau < 0:
            raise ValueError(f"a push computed on version {pulled}, ahead of the server's {self.version}")
        limit = self.staleness.max_staleness
        if limit is not None and tau > limit:
            return Arrival(tau, None, False)
        weight = update_weight(batch, self.global_batch, tau, self.staleness)
        self._grad.add_(gradient.to(self.dtype), alpha=weight)
        if self.num_buffers:
            self._delta.add_(buffer_delta.to(self.dtype), alpha=weight)
        self.pending += 1
        if self.pending < self.buffer:
            return Arrival(tau, weight, False)
        self.step()
        return Arrival(tau, weight, True)

    def step(self) -> bool:
        """Apply the buffered sum (also a partly filled buffer, at the end); False if empty."""
        if not self.pending:
            return False
        assign_gradient(self.model, self._grad)
        self.optimizer.step()
        copy_flat(self.buffers, self._delta, add=True)
        self._grad.zero_()
        self._delta.zero_()
        self.pending = 0
        self.version += 1
        return True

    def flat(self) -> torch.Tensor:
        """Trainable params, then float buffers, as one flat vector: what a worker pulls."""
        return torch.cat([t.detach().reshape(-1).to(self.dtype) for t in (*self.params, *self.buffers)])

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "pending": self.pending,
            "grad": self._grad.clone(),
            "delta": self._delta.clone(),
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": optimizer_state(self.optimizer),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.pending = int(state["pending"])
        self._grad.copy_(state["grad"])
        self._delta.copy_(state["delta"])
        self.model.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"], self.params[0].device)


# --------------------------------------------------------------------------- messages


def header_slots(count: int, dtype: torch.dtype) -> int:
    """Slots of a message of ``dtype`` that hold ``count`` float64 header values."""
    return count * 8 // dtype.itemsize


def pack(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """Header values as float64, viewed bit for bit as ``dtype`` slots."""
    return torch.tensor(values, dtype=torch.float64).view(dtype)


def unpack(message: torch.Tensor, count: int) -> list[float]:
    """The ``count`` header values at the start of ``message``."""
    return message[: header_slots(count, message.dtype)].view(torch.float64).tolist()


def _group(store: dist.Store, rank: int, size: int, timeout: float) -> dist.ProcessGroupGloo:
    """The run's gloo group of W + 1 ranks on 127.0.0.1 (standalone: no global state)."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = datetime.timedelta(seconds=group_timeout(timeout))
    return dist.ProcessGroupGloo(dist.PrefixStore("asp/", store), rank, size, options)


# --------------------------------------------------------------------------- the worker


class _ServerGone(_Stopped):
    """The server stopped answering (it finished and left, failed, or hung)."""


class _AspWorker:
    """One worker: pull, compute, push, until the server says stop."""

    def __init__(self, worker: int, shared: _Shared):
        cfg = shared.config
        self.id = worker
        self.config = cfg
        self.emulator, self.device, self.dataset = worker_setup(worker, shared)
        self.model = _make_model(cfg, self.dataset).to(self.device)  # its values come with each task
        self.loss_fn = make_loss(cfg.task.loss)
        self.params = trainable(self.model)
        self.buffers = float_buffers(self.model)
        self.dtype = self.params[0].dtype
        self.sampler = GlobalSampler(len(self.dataset.y_train), cfg.seed)
        self.updates = 0
        self.last_version = -1

    def run(self, address: tuple[str, int]) -> None:
        dp = self.config.data_parallel
        store = worker_store(address, dp.timeout)
        try:
            group = _group(store, self.id + 1, dp.workers + 1, dp.timeout)
        except Exception as exc:
            raise _ServerGone(f"joining the parameter server failed: {_first_line(exc)}") from exc
        size = sum(t.numel() for t in (*self.params, *self.buffers))
        task = torch.empty(header_slots(TASK_HEADER, self.dtype) + size, dtype=self.dtype)
        pushed: float | None = None
        while True:
            _complete(group.recv([task], SERVER, TAG), "waiting for a task")
            received = time.perf_counter()
            kind, version, epoch, start, count = (int(v) for v in unpack(task, TASK_HEADER))
            if kind == STOP:
                return
            waited = received - pushed if pushed is not None else math.nan
            message = self.compute(task, version, epoch, start, count, waited)
            pushed = time.perf_counter()
            _complete(group.send([message], SERVER, TAG), "pushing a gradient")

    def compute(
        self, task: torch.Tensor, version: int, epoch: int, start: int, count: int, waited: float
    ) -> torch.Tensor:
        """Load the task's params, compute the mean gradient over its range; the push message."""
        copy_flat((*self.params, *self.buffers), task[header_slots(TASK_HEADER, self.dtype) :])
        pulled = [b.detach().clone() for b in self.buffers]
        if self.sampler.epoch != epoch:
            self.sampler = GlobalSampler(self.sampler.num_samples, self.config.seed, epoch=epoch)
        index = torch.from_numpy(self.sampler.order()[start : start + count])
        step_start = time.perf_counter()
        cpu_start = time.process_time()
        torch.manual_seed(derive_seed(self.config.seed, "asp-update", self.id, self.updates))
        x, y = self.dataset.x_train[index].to(self.device), self.dataset.y_train[index].to(self.device)
        self.model.train()
        gradient, loss = local_contribution(self.model, self.loss_fn, x, y, 1.0)
        deltas = [(b.detach() - p).reshape(-1).to(self.dtype).cpu() for b, p in zip(self.buffers, pulled)]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.emulator.pad(version, count, time.process_time() - cpu_start, time.perf_counter() - step_start)
        compute = time.perf_counter() - step_start
        first = self.last_version + 1 if self.updates else version  # a resumed run starts past old crashes
        for step in range(first, version + 1):  # a crash due at a version skipped over
            self.emulator.maybe_crash(step)
        self.last_version = max(self.last_version, version)
        self.updates += 1
        header = pack([version, compute, waited, loss], self.dtype)
        return torch.cat([header, gradient.cpu(), *deltas])


def _complete(work: Any, what: str) -> None:
    """Wait for a worker's send or receive (bounded by the group's timeout)."""
    try:
        work.wait()
    except Exception as exc:
        raise _ServerGone(f"{what}: {_first_line(exc)}") from exc


def _worker_main(worker: int, shared: _Shared, port_conn: Any) -> None:
    """Entry point of a worker process."""
    worker_process(worker, shared, port_conn, lambda address: _AspWorker(worker, shared).run(address), log)


# --------------------------------------------------------------------------- the server


@dataclass(frozen=True)
class Assignment:
    """A range of the sampler: ``count`` positions from ``start`` of epoch ``epoch``'s permutation."""

    epoch: int
    start: int
    count: int


class Ranges:
    """Hands out disjoint ranges of the global sampler; lost ranges are handed out again first.

    ``epochs`` None: endless (a run bounded by steps).
    """

    def __init__(self, sampler: GlobalSampler, epochs: int | None):
        self.sampler = sampler
        self.epochs = epochs
        self.orphans: deque[Assignment] = deque()
        self.completed = 0  # epochs whose every sample was resolved
        self.partial: dict[int, int] = {}  # epoch -> samples resolved, for epochs not complete

    @property
    def exhausted(self) -> bool:
        """Every range of the run was handed out (and none is waiting to be handed out again)."""
        return self.epochs is not None and self.sampler.epoch >= self.epochs and not self.orphans

    def next(self, size: int) -> Assignment | None:
        """The next range of at most ``size`` positions (None: nothing left to hand out)."""
        if self.orphans:
            a = self.orphans.popleft()
            if a.count > size:
                self.orphans.appendleft(Assignment(a.epoch, a.start + size, a.count - size))
                a = Assignment(a.epoch, a.start, size)
            return a
        if self.epochs is not None and self.sampler.epoch >= self.epochs:
            return None
        a = Assignment(self.sampler.epoch, self.sampler.offset, self.sampler.step_size(size))
        self.sampler.advance(a.count)
        return a

    def resolve(self, a: Assignment) -> bool:
        """``a``'s push arrived; True when that completes its epoch."""
        done = self.partial.get(a.epoch, 0) + a.count
        if done < self.sampler.num_samples:
            self.partial[a.epoch] = done
            return False
        self.partial.pop(a.epoch, None)
        self.completed += 1
        return True

    @property
    def progress(self) -> float:
        """Epochs of samples resolved (fractional)."""
        return self.completed + sum(self.partial.values()) / self.sampler.num_samples

    def state_dict(self, outstanding: Sequence[Assignment]) -> dict[str, Any]:
        """The state, with the ranges in flight (``outstanding``) to be handed out again on resume."""
        return {
            "sampler": self.sampler.state_dict(),
            "orphans": [(a.epoch, a.start, a.count) for a in [*outstanding, *self.orphans]],
            "completed": self.completed,
            "partial": dict(self.partial),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.orphans = deque(Assignment(*map(int, a)) for a in state["orphans"])
        self.completed = int(state["completed"])
        self.partial = {int(e): int(c) for e, c in state["partial"].items()}


@dataclass
class _Window:
    """Per-worker sums over the pushes since the last metrics line."""

    version: int
    started: float = field(default_factory=time.perf_counter)
    samples: int = 0
    loss: float = 0.0
    updates: dict[int, int] = field(default_factory=dict)
    batch: dict[int, float] = field(default_factory=dict)
    compute: dict[int, float] = field(default_factory=dict)
    wait: dict[int, list[float]] = field(default_factory=dict)  # [Σ wait, pushes with a wait]
    staleness: dict[int, float] = field(default_factory=dict)
    max_staleness: int = 0
    dropped: int = 0
    server_time: float = 0.0
    controller_time: float = 0.0

    def add(self, worker: int, count: int, compute: float, waited: float, loss: float, arrival: Arrival) -> None:
        self.samples += count
        self.loss += loss * count
        self.updates[worker] = self.updates.get(worker, 0) + 1
        self.batch[worker] = self.batch.get(worker, 0.0) + count
        self.compute[worker] = self.compute.get(worker, 0.0) + compute
        self.staleness[worker] = self.staleness.get(worker, 0.0) + arrival.staleness
        self.max_staleness = max(self.max_staleness, arrival.staleness)
        self.dropped += arrival.weight is None
        if math.isfinite(waited):
            acc = self.wait.setdefault(worker, [0.0, 0])
            acc[0] += waited
            acc[1] += 1

    def record(self, version: int) -> Record:
        workers = sorted(self.updates)
        elapsed = time.perf_counter() - self.started
        waits = [self.wait.get(w, [0.0, 0]) for w in workers]
        return {
            "step": version,
            "samples": self.samples,
            "train_loss": self.loss / max(self.samples, 1),
            "workers": workers,
            "updates": [self.updates[w] for w in workers],
            "batch": [self.batch[w] / self.updates[w] for w in workers],
            "compute_time": [self.compute[w] / self.updates[w] for w in workers],
            "idle_time": [s / n if n else None for s, n in waits],
            "staleness": [self.staleness[w] / self.updates[w] for w in workers],
            "max_staleness": self.max_staleness,
            "dropped": self.dropped,
            "step_time": elapsed / max(version - self.version, 1),
            "window_time": elapsed,
            "server_time": self.server_time,
            "controller_time": self.controller_time,
        }


class _Server:
    """The launcher's side of an asp run: the parameter server, the ranges, the controller,
    the messages to and from the workers, metrics and checkpoints."""

    def __init__(
        self,
        r: DataParallelRun,
        group: dist.ProcessGroupGloo,
        pool: ThreadPoolExecutor,
        procs: dict[int, Any],
        dataset: Any,
        on_record: Callable[[Record], None] | None,
    ):
        cfg = r.config
        dp = cfg.data_parallel
        self.run_state = r
        self.config = cfg
        self.group = group
        self.pool = pool
        self.procs = procs
        self.dataset = dataset
        self.on_record = on_record
        self.workers = sorted(procs)
        torch.manual_seed(derive_seed(cfg.seed, "init"))
        model = _make_model(cfg, dataset)
        self.ps = ParameterServer(model, make_optimizer(model, dp), dp.global_batch, dp, dp.buffer)
        self.loss_fn = make_loss(cfg.task.loss)
        self.controller = BatchController(dp.global_batch, self.workers, dp.controller)
        self.ranges = Ranges(GlobalSampler(len(dataset.y_train), cfg.seed), None if dp.steps else dp.epochs)
        self.outstanding: dict[int, Assignment] = {}
        self.parked: set[int] = set()  # asked for work when none was left; may get a lost worker's range
        self.lost: set[int] = set()
        self.deadlines: dict[int, float] = {}  # worker -> when its push is due at the latest
        self.expired: set[int] = set()  # killed for not pushing in time
        self.futures: dict[Future[int], int] = {}
        self.sends: dict[int, Any] = {}
        size = self.ps.num_params + self.ps.num_buffers
        self.task_size = header_slots(TASK_HEADER, self.ps.dtype) + size
        self.inbox = {w: torch.empty(header_slots(PUSH_HEADER, self.ps.dtype) + size, dtype=self.ps.dtype)
                      for w in self.workers}
        self._flat: tuple[int, torch.Tensor] | None = None
        self.metrics = MetricsWriter(r.run_dir / METRICS_FILE)
        self.started = time.perf_counter()
        if r.resume_state is not None:
            self.load_state_dict(r.resume_state)
        self.window = _Window(self.ps.version)

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {
            "sync": "asp",
            "step": self.ps.version,
            "server": self.ps.state_dict(),
            **self.ranges.state_dict(list(self.outstanding.values())),
            "controller": self.controller.state_dict(),
            "elapsed": time.perf_counter() - self.started,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("sync") != "asp":
            raise DataParallelError("the checkpoint is of a bsp run; it cannot continue with sync: asp")
        self.ps.load_state_dict(state["server"])
        self.ranges.load_state_dict(state)
        self.controller.load_state_dict(state["controller"])
        self.started = time.perf_counter() - float(state["elapsed"])

    # ---------------------------------------------------------------- the loop

    def done(self) -> bool:
        steps = self.config.data_parallel.steps
        if steps is not None:
            return self.ps.version >= steps
        return self.ranges.exhausted and not self.outstanding

    def run(self) -> None:
        """Serve pushes until the run is done, then stop the workers."""
        for w in self.workers:
            self._dispatch(w)
        while not self.done():
            if not self.futures:
                raise DataParallelError("no worker has work left, yet the run is not done")
            ready, _ = wait(list(self.futures), timeout=self._until_deadline(), return_when=FIRST_COMPLETED)
            for future in ready:
                w = self.futures.pop(future)
                try:
                    future.result()
                except Exception as exc:
                    self._lose(w, exc)
                    continue
                self._arrive(w)
                if self.done():
                    break
            self._expire()
        self._stop_workers()

    def _until_deadline(self) -> float:
        """Seconds to wait for a push: at most POLL, at most until the first deadline."""
        pending = [self.deadlines[w] for w in self.outstanding if w not in self.expired]
        return max(0.0, min([POLL, *(d - time.monotonic() for d in pending)]))

    def _expire(self) -> None:
        """Kill each worker that has not pushed within the timeout of its task: its receive
        fails (a closed connection), and it is lost like a dead one."""
        now = time.monotonic()
        for w in self.outstanding:
            if w not in self.expired and now > self.deadlines[w]:
                self.expired.add(w)
                if self.procs[w].is_alive():
                    self.procs[w].kill()

    def _receive(self, worker: int) -> int:
        """(In a pool thread.) Wait for ``worker``'s push (bounded: see :meth:`_expire`)."""
        self.group.recv([self.inbox[worker]], worker + 1, TAG).wait()
        return worker

    def _send(self, worker: int, message: torch.Tensor) -> None:
        previous = self.sends.pop(worker, None)
        if previous is not None:
            previous.wait()  # already complete: the worker pushed after receiving it
        self.sends[worker] = self.group.send([message], worker + 1, TAG)

    def _params(self) -> torch.Tensor:
        """The current flat params, built once per version (a message in flight keeps its own)."""
        if self._flat is None or self._flat[0] != self.ps.version:
            self._flat = (self.ps.version, self.ps.flat())
        return self._flat[1]

    def _dispatch(self, worker: int) -> None:
        """Send ``worker`` the current params and its next range, and wait for its push;
        park it when there is no range left."""
        a = self.ranges.next(max(1, self.controller.batches[worker]))
        if a is None:
            self.parked.add(worker)
            return
        self.outstanding[worker] = a
        header = pack([WORK, self.ps.version, a.epoch, a.start, a.count], self.ps.dtype)
        self._send(worker, torch.cat([header, self._params()]))
        self.deadlines[worker] = time.monotonic() + self.config.data_parallel.timeout
        self.futures[self.pool.submit(self._receive, worker)] = worker

    def _arrive(self, worker: int) -> None:
        began = time.perf_counter()
        message = self.inbox[worker]
        a = self.outstanding.pop(worker)
        version, compute, waited, loss = unpack(message, PUSH_HEADER)
        h = header_slots(PUSH_HEADER, self.ps.dtype)
        n = self.ps.num_params
        arrival = self.ps.receive(message[h : h + n], message[h + n :], a.count, int(version))
        self.window.add(worker, a.count, compute, waited, loss, arrival)
        control = time.perf_counter()
        self.controller.observe({worker: a.count}, {worker: compute})
        epoch_end = self.ranges.resolve(a)
        if epoch_end:
            self.controller.end_epoch()
        self.window.controller_time += time.perf_counter() - control
        done = self.done()
        if done:
            self.ps.step()  # what is left in the buffer (a run bounded by epochs)
        self.window.server_time += time.perf_counter() - began
        log_every = self.config.data_parallel.log_every
        if epoch_end or done or (arrival.stepped and self.ps.version % log_every == 0):
            self._record(epoch_end, done)
        if done:
            self.parked.add(worker)  # it waits for its answer: a stop
        else:
            self._dispatch(worker)

    def _lose(self, worker: int, exc: BaseException) -> None:
        """``worker``'s push failed (it died, or hung past the timeout): its range goes to another."""
        self.lost.add(worker)
        proc = self.procs[worker]
        if proc.is_alive():
            proc.kill()
        a = self.outstanding.pop(worker, None)
        if a is not None:
            self.ranges.orphans.append(a)
        left = len(self.workers) - len(self.lost)
        why = f"no push within {self.config.data_parallel.timeout:g} s" if worker in self.expired else _first_line(exc)
        log.warning("worker %d lost at server step %d (%s); %d left", worker, self.ps.version, why, left)
        if left < self.config.data_parallel.min_workers:
            raise DataParallelError(
                f"asp run stopped at server step {self.ps.version}: workers {sorted(self.lost)} lost, {left} left, "
                f"min_workers is {self.config.data_parallel.min_workers}; the last checkpoint is intact: "
                f"fedweave run --resume {self.run_state.run_dir}"
            )
        while self.parked and self.ranges.orphans:
            parked = min(self.parked)
            self.parked.discard(parked)
            self._dispatch(parked)

    def _stop_workers(self) -> None:
        """Answer every outstanding push with a stop (gradients discarded), within the timeout.
        A live worker exits on its stop; the launcher waits for that, and kills the rest."""
        stop = torch.zeros(self.task_size, dtype=self.ps.dtype)
        stop[: header_slots(TASK_HEADER, self.ps.dtype)] = pack([STOP, self.ps.version, 0, 0, 0], self.ps.dtype)
        for w in sorted(self.parked):
            self._send(w, stop)
        deadline = time.monotonic() + self.config.data_parallel.timeout
        while self.futures and time.monotonic() < deadline:
            ready, _ = wait(list(self.futures), timeout=deadline - time.monotonic(), return_when=FIRST_COMPLETED)
            for future in ready:
                w = self.futures.pop(future)
                if future.exception() is None:
                    self._send(w, stop)

    # ---------------------------------------------------------------- records

    def _record(self, epoch_end: bool, done: bool) -> None:
        """Close the metrics window (evaluate at epoch ends and at the end), checkpoint at epoch
        ends, save the model at the end."""
        cfg = self.config
        record = self.window.record(self.ps.version)
        self.window = _Window(self.ps.version)
        record["epoch"] = self.ranges.progress
        record["adjustments"] = self.controller.adjustments
        record["lost"] = sorted(self.lost)
        completed = self.ranges.completed
        if done or (epoch_end and cfg.eval.every and completed % cfg.eval.every == 0):
            record.update(evaluation(cfg, self.ps.model, self.dataset, self.loss_fn))
        record["wall_time"] = time.perf_counter() - self.started
        self.metrics.append(record)
        self.run_state.records.append(record)
        if self.on_record is not None:
            self.on_record(record)
        run_dir = self.run_state.run_dir
        every = cfg.checkpoint.every
        if every and ((epoch_end and completed % every == 0) or done):
            save_checkpoint(run_dir, self.ps.version, self.state_dict())
        if done:
            save_model(self.ps.model, run_dir)


# --------------------------------------------------------------------------- the launcher


def execute(
    r: DataParallelRun,
    on_record: Callable[[Record], None] | None = None,
    on_start: Callable[[dict[int, int]], None] | None = None,
) -> list[Record]:
    """Run ``r`` (not finished: :func:`fedweave.data_parallel.execute` checks) with the
    parameter server in this process; the metrics records.

    The same contract as :func:`fedweave.data_parallel.execute`: ``on_record`` gets each
    metrics line, ``on_start`` the worker pids; :class:`DataParallelError` when the run
    could not finish (the last checkpoint stays intact).
    """
    cfg = r.config
    dp = cfg.data_parallel
    backend, method = resolve_backend(cfg)
    ctx = multiprocessing.get_context(method)
    dataset = _load(cfg)
    workers = list(range(dp.workers))
    shared = _Shared(
        config=cfg, run_dir=r.run_dir, members=workers, backend=backend, dataset=dataset if method == "fork" else None,
    )
    procs, conns = spawn_workers(ctx, workers, _worker_main, lambda w, pipe: (w, shared, pipe), "fedweave-asp-worker")
    store = launcher_store(dp.timeout)
    release_workers(conns, workers, store.port)
    if on_start is not None:
        on_start({w: p.pid for w, p in procs.items()})
    pool = ThreadPoolExecutor(max_workers=dp.workers, thread_name_prefix="fedweave-asp-receive")
    threads = torch.get_num_threads()
    if cfg.threads:  # the server computes here: spinning intra-op threads on busy cores cost it 10-100x
        torch.set_num_threads(cfg.threads)
    finished = False
    try:
        try:
            group = _group(store, SERVER, dp.workers + 1, dp.timeout)
        except Exception as exc:
            raise DataParallelError(f"the asp workers did not all start: {_first_line(exc)}") from exc
        log.info("asp: parameter server in the launcher, %d workers, buffer %d", dp.workers, dp.buffer)
        _Server(r, group, pool, procs, dataset, on_record).run()
        finished = True
    finally:
        deadline = time.monotonic() + (dp.timeout if finished else 0.0)
        for p in procs.values():
            p.join(max(0.0, deadline - time.monotonic()))  # stopped workers exit at once
            if p.is_alive():
                p.kill()
            p.join(5)
        pool.shutdown(wait=True)  # the workers are gone: receives still posted fail at once
        torch.set_num_threads(threads)
    if r.records:
        from fedweave.observe.plots import plot_workers

        plot_workers(r.records, r.run_dir / PLOT_FILE)
    return r.records
