"""The asynchronous parameter-server mode of data-parallel training (``data_parallel.sync: asp``):
the workers' loop (pull, compute, push), the server's loop around the
:class:`~fedweave.data_parallel.parameter_server.ParameterServer`, their messages, and
the launcher. The weighting, the update rates and the sampler ranges are described
in :mod:`fedweave.data_parallel.parameter_server`.

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
  with a :class:`~fedweave.data_parallel.group.DataParallelError` (the last checkpoint
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
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fedweave.data_parallel.controller import BatchController
from fedweave.data_parallel.sampler import GlobalSampler
from fedweave.data_parallel.gradients import copy_flat, float_buffers, local_contribution, trainable
from fedweave.data_parallel.group import DataParallelError, Stopped, launcher_store, worker_store
from fedweave.data_parallel.parameter_server import Arrival, Assignment, ParameterServer, Ranges
from fedweave.data_parallel.records import (
    PLOT_FILE,
    DataParallelRun,
    Record,
    evaluation,
    save_checkpoint,
    save_model,
)
from fedweave.data_parallel.workers import (
    Shared,
    load_data,
    make_model,
    make_optimizer,
    release_workers,
    resolve_backend,
    spawn_workers,
    worker_process,
    worker_setup,
)
from fedweave.errors import first_line
from fedweave.observe.metrics import MetricsWriter
from fedweave.rundir import METRICS_FILE
from fedweave.seeding import derive_seed
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


# --------------------------------------------------------------------------- messages


def header_slots(count: int, dtype: torch.dtype) -> int:
    """Slots of a message of ``dtype`` that hold ``count`` float64 header values."""
    return count * 8 // dtype.itemsize


def pack_header(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """Header values as float64, viewed bit for bit as ``dtype`` slots."""
    return torch.tensor(values, dtype=torch.float64).view(dtype)


def unpack_header(message: torch.Tensor, count: int) -> list[float]:
    """The ``count`` header values at the start of ``message``."""
    return message[: header_slots(count, message.dtype)].view(torch.float64).tolist()


def _group(store: dist.Store, rank: int, size: int, timeout: float) -> dist.ProcessGroupGloo:
    """The run's gloo group of W + 1 ranks on 127.0.0.1 (standalone: no global state)."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # in torch at runtime, not in its stub
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = datetime.timedelta(seconds=group_timeout(timeout))
    return dist.ProcessGroupGloo(dist.PrefixStore("asp/", store), rank, size, options)


# --------------------------------------------------------------------------- the worker


class ServerGone(Stopped):
    """The server stopped answering (it finished and left, failed, or hung)."""


class Worker:
    """One worker: pull, compute, push, until the server says stop."""

    def __init__(self, worker: int, shared: Shared):
        cfg = shared.config
        self.id = worker
        self.config = cfg
        self.emulator, self.device, self.dataset = worker_setup(worker, shared)
        self.model = make_model(cfg, self.dataset).to(self.device)  # its values come with each task
        self.loss_fn = make_loss(cfg.task.loss, cfg.task.kind, cfg.task.metrics)
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
            raise ServerGone(f"joining the parameter server failed: {first_line(exc)}") from exc
        size = sum(t.numel() for t in (*self.params, *self.buffers))
        task = torch.empty(header_slots(TASK_HEADER, self.dtype) + size, dtype=self.dtype)
        pushed: float | None = None
        while True:
            _complete(group.recv([task], SERVER, TAG), "waiting for a task")  # type: ignore[attr-defined]  # in torch at runtime, not in its stub
            received = time.perf_counter()
            kind, version, epoch, start, count = (int(v) for v in unpack_header(task, TASK_HEADER))
            if kind == STOP:
                return
            waited = received - pushed if pushed is not None else math.nan
            message = self.compute(task, version, epoch, start, count, waited)
            pushed = time.perf_counter()
            _complete(group.send([message], SERVER, TAG), "pushing a gradient")  # type: ignore[attr-defined]  # in torch at runtime, not in its stub

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
        header = pack_header([version, compute, waited, loss], self.dtype)
        return torch.cat([header, gradient.cpu(), *deltas])


def _complete(work: Any, what: str) -> None:
    """Wait for a worker's send or receive (bounded by the group's timeout)."""
    try:
        work.wait()
    except Exception as exc:
        raise ServerGone(f"{what}: {first_line(exc)}") from exc


def worker_main(worker: int, shared: Shared, port_conn: Any) -> None:
    """Entry point of a worker process."""
    worker_process(worker, shared, port_conn, lambda address: Worker(worker, shared).run(address), log)


# --------------------------------------------------------------------------- the server


@dataclass
class PushWindow:
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


class Server:
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
        model = make_model(cfg, dataset)
        self.ps = ParameterServer(model, make_optimizer(model, dp), dp.global_batch, dp, dp.buffer)
        self.loss_fn = make_loss(cfg.task.loss, cfg.task.kind, cfg.task.metrics)
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
        self.window = PushWindow(self.ps.version)

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
        self.group.recv([self.inbox[worker]], worker + 1, TAG).wait()  # type: ignore[attr-defined]  # in torch at runtime, not in its stub
        return worker

    def _send(self, worker: int, message: torch.Tensor) -> None:
        previous = self.sends.pop(worker, None)
        if previous is not None:
            previous.wait()  # already complete: the worker pushed after receiving it
        self.sends[worker] = self.group.send([message], worker + 1, TAG)  # type: ignore[attr-defined]  # in torch at runtime, not in its stub

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
        header = pack_header([WORK, self.ps.version, a.epoch, a.start, a.count], self.ps.dtype)
        self._send(worker, torch.cat([header, self._params()]))
        self.deadlines[worker] = time.monotonic() + self.config.data_parallel.timeout
        self.futures[self.pool.submit(self._receive, worker)] = worker

    def _arrive(self, worker: int) -> None:
        began = time.perf_counter()
        message = self.inbox[worker]
        a = self.outstanding.pop(worker)
        version, compute, waited, loss = unpack_header(message, PUSH_HEADER)
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
        why = f"no push within {self.config.data_parallel.timeout:g} s" if worker in self.expired else first_line(exc)
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
        stop[: header_slots(TASK_HEADER, self.ps.dtype)] = pack_header([STOP, self.ps.version, 0, 0, 0], self.ps.dtype)
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
        self.window = PushWindow(self.ps.version)
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
    dataset = load_data(cfg)
    workers = list(range(dp.workers))
    shared = Shared(
        config=cfg, run_dir=r.run_dir, members=workers, backend=backend, dataset=dataset if method == "fork" else None,
    )
    procs, conns = spawn_workers(ctx, workers, worker_main, lambda w, pipe: (w, shared, pipe), "fedweave-asp-worker")
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
            raise DataParallelError(f"the asp workers did not all start: {first_line(exc)}") from exc
        log.info("asp: parameter server in the launcher, %d workers, buffer %d", dp.workers, dp.buffer)
        Server(r, group, pool, procs, dataset, on_record).run()
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
