"""The synchronous step of data-parallel training (``data_parallel.sync: bsp``).

N worker processes train one model on one dataset. Each step::

    sizes   = controller.batches                    # b_i, Σ b_i = B (identical on every worker)
    mine    = sampler.take(sizes)[rank]             # disjoint index ranges of one global batch
    g_i     = ∇ (b_i / B) · mean loss on mine        # timed: compute time t_i (+ emulated slowness)
    buffer  = [g_i, buffers · b_i / B, tail]        # tail: loss share, then t_i, ‖g_i‖ (and more) in slot i
    all_reduce(buffer, SUM)                         # ONE collective: Σ_i g_i is the gradient of the
                                                    # whole batch, and every t_j reaches every worker
    check   Σ_i g_i finite, each ‖g_i‖ finite and within its bounds, else skip the step (no update)
    optimizer.step()                                # the same step on every worker
    controller.observe(sizes, t)                    # the same decision on every worker
    sampler.advance(B)

A world-size mean (what DDP does) would weight a worker's samples by 1/n instead of
b_i / B, which is wrong as soon as the b_i differ; the weighting here makes the step
exactly that of one process on the concatenated batch
(:mod:`fedweave.data_parallel.gradients`).

One worker's NaN or huge gradient would end in a NaN model: every worker reads each
member's contribution norm in the tail and checks the summed gradient before stepping
(:func:`~fedweave.data_parallel.gradients.refused_shares`: ``data_parallel.max_grad_norm``,
``max_norm_ratio``); a bad step is skipped on every worker alike (sampler and controller move
on, the model and buffers do not), the worker named in an error line, and after
``data_parallel.max_bad_steps`` skipped steps every worker stops (:class:`BadSteps`), so the run
exits non-zero with its last checkpoint intact. Workers that leave or join between steps:
:mod:`fedweave.data_parallel.elastic`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedweave.data_parallel.controller import BatchController
from fedweave.data_parallel.sampler import GlobalSampler
from fedweave.data_parallel.elastic import Joins, admission, next_members
from fedweave.data_parallel.gradients import (
    assign_gradient,
    copy_flat,
    float_buffers,
    local_contribution,
    refused_shares,
    trainable,
)
from fedweave.data_parallel.group import BadSteps, Group, PeerFailure, Stopped, worker_store
from fedweave.data_parallel.records import (
    Record,
    Window,
    evaluation,
    last_logged_step,
    load_optimizer_state,
    optimizer_state,
    save_checkpoint,
    save_model,
)
from fedweave.data_parallel.workers import Shared, make_model, make_optimizer, worker_process, worker_setup
from fedweave.observe.metrics import MetricsWriter
from fedweave.rundir import METRICS_FILE
from fedweave.seeding import derive_seed
from fedweave.task import make_loss
from fedweave.federated.checks import finite

log = logging.getLogger(__name__)


PER_MEMBER = ("compute", "wait", "oom", "seen", "norm")
"""The values of a step's tail that each member has one of, in the order of their blocks."""


@dataclass(frozen=True)
class StepTail:
    """The scalars that ride after the gradient and the buffers in a step's all-reduce.

    Laid out as ``[loss | compute × n | wait × n | oom × n | seen × n | norm × n]`` for n members:
    each member writes its share of the loss and, in the slot of its rank in each block,
    its own values, zeros elsewhere, so the sum hands every member the batch's loss and
    all members' values (an all-gather at no extra cost).
    """

    loss: float  # the batch's mean loss (the sum of the shares weighted by b_i / B)
    compute: list[float]  # by rank: seconds computing the step (with the emulated slowness)
    wait: list[float]  # by rank: seconds the previous step's all-reduce waited
    oom: list[float]  # by rank: 1.0 when its batch did not fit in memory
    seen: list[float]  # by rank: the count of announced joiners it last read in the store
    norm: list[float]  # by rank: the L2 norm of its share of the gradient


def tail_size(members: int) -> int:
    """Slots of the tail of a step with ``members`` members."""
    return 1 + len(PER_MEMBER) * members


def tail_slot(members: int, name: str, rank: int) -> int:
    """The slot of member ``rank``'s value ``name`` (one of :data:`PER_MEMBER`)."""
    return 1 + PER_MEMBER.index(name) * members + rank


def pack_tail(
    members: int, rank: int, loss: float, *, compute: float, wait: float, oom: float, seen: int, norm: float,
    dtype: torch.dtype, device: torch.device,
) -> torch.Tensor:
    """Member ``rank``'s tail: its loss share and its own values in its slots, zeros elsewhere."""
    tail = torch.zeros(tail_size(members), dtype=dtype, device=device)
    tail[0] = loss
    for name, value in zip(PER_MEMBER, (compute, wait, oom, seen, norm)):
        tail[tail_slot(members, name, rank)] = value
    return tail


def unpack_tail(members: int, values: Sequence[float]) -> StepTail:
    """The summed tail of a step with ``members`` members, by name."""
    starts = {name: tail_slot(members, name, 0) for name in PER_MEMBER}
    return StepTail(loss=values[0], **{name: list(values[i : i + members]) for name, i in starts.items()})


class Worker:
    """One worker of a synchronous run: its model, optimiser, sampler and controller (the same
    on every member), through the generations of the process group it takes part in."""

    def __init__(self, worker: int, shared: Shared):
        cfg = shared.config
        dp = cfg.data_parallel
        self.id = worker
        self.shared = shared
        self.config = cfg
        self.emulator, self.device, self.dataset = worker_setup(worker, shared)
        torch.manual_seed(derive_seed(cfg.seed, "init"))
        self.model = make_model(cfg, self.dataset).to(self.device)
        self.buffers = float_buffers(self.model)  # loading a state copies into these tensors: they stay
        self.num_params = sum(p.numel() for p in trainable(self.model))
        self.num_buffers = sum(b.numel() for b in self.buffers)
        self.dtype = trainable(self.model)[0].dtype
        self.loss_fn = make_loss(cfg.task.loss, cfg.task.kind, cfg.task.metrics)
        self.optimizer = make_optimizer(self.model, dp)
        self.sampler = GlobalSampler(len(self.dataset.y_train), cfg.seed)
        self.controller = BatchController(dp.global_batch, shared.members, dp.controller)
        self.step = 0
        self.bad_steps = 0  # steps skipped for a refused gradient
        self.window = Window()
        self.prev_wait = 0.0
        self.members = list(shared.members)
        self.fresh = False  # a newcomer until it has the run's state
        self.joins = Joins()
        self.metrics = MetricsWriter(shared.run_dir / METRICS_FILE)
        self.logged_step = -1
        self.stop_requested = False  # set (by a signal handler) to stop at the next step boundary
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
            "bad_steps": self.bad_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.model.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"], self.device)
        self.sampler.load_state_dict(state["sampler"])
        self.controller.load_state_dict(state["controller"])
        self.window = state["window"]
        self.bad_steps = int(state.get("bad_steps", 0))  # absent in checkpoints older than the check
        self.started = time.perf_counter() - float(state["elapsed"])

    # ---------------------------------------------------------------- the run

    def run(self, address: tuple[str, int], join_step: int | None = None) -> None:
        """Train until the run is done; with ``join_step``, first join the running job
        (taking part from that step at the earliest)."""
        dp = self.config.data_parallel
        store = worker_store(address, dp.timeout)
        self.joins.store = store
        gen = 0
        if join_step is not None:
            gen, self.members = admission(store, self.id, join_step)
            self.fresh = True
        while True:
            group = None
            try:
                group = Group(store, gen, self.members, self.id, self.shared.backend, dp.timeout, self.device)
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
            self.members = next_members(store, gen, self.id, self.step, dp.timeout)
            gen += 1
            log.info("worker %d: generation %d at step %d with workers %s", self.id, gen, self.step, self.members)
        group.close()

    def adopt(self, group: Group) -> None:
        """Take part in ``group``, formed elsewhere (torchrun's rendezvous): every member takes
        the state of the most advanced one, and the controller replans over the members."""
        self._sync(group)
        if self.controller.workers != self.members:
            self.controller.set_workers(self.members)

    def train(self, group: Group) -> None:
        """Take steps in ``group`` until the run is done or a stop is requested."""
        self._train(group)

    def _sync(self, group: Group) -> None:
        """Every member takes the state of the most advanced one (lowest rank among equals):
        a member may have completed the step that failed on the others; a newcomer has none."""
        steps = torch.zeros(group.size, dtype=torch.float64, device=self.device)
        steps[group.rank] = -1 if self.fresh else self.step
        group.all_reduce(steps)
        src = int(torch.argmax(steps).item())  # the first maximum
        if steps[src] < 0:
            raise Stopped(f"no member of generation {group.gen} holds the run's state (only newcomers are left)")
        mine = (self.state_dict(), self.joins.state_dict()) if group.rank == src else None
        state, joins = group.broadcast_object(mine, src)
        if group.rank != src:
            self.load_state_dict(state)
            self.joins.load_state_dict(joins)
        self.fresh = False

    def _done(self) -> bool:
        dp = self.config.data_parallel
        if dp.steps is not None:
            return self.step >= dp.steps
        return self.sampler.epoch >= dp.epochs

    def _train(self, group: Group) -> list[int]:
        """Take steps until the run is done (returns []) or joiners are due (returns them,
        after closing the metrics window so that the next one starts with them)."""
        if group.rank == 0:
            self.logged_step = last_logged_step(self.metrics.path)
        self.joins.poll(force=True)
        while not self._done() and not self.stop_requested:
            tail = self._step(group)
            if tail is None:
                continue  # the step is taken again with the lowered batches
            if not self._done():
                joiners = self.joins.due(int(max(tail.seen)), self.step, self.members)
                if joiners:
                    if self.window.steps:
                        self._record(group, False)
                    return joiners
        return []

    def _step(self, group: Group) -> StepTail | None:
        """One step over the global batch: this worker's share of the gradient, the one
        all-reduce, the optimiser's step and the bookkeeping after it; the step's tail.
        None when a member ran out of memory: its batch is capped and nothing else moved."""
        dp = self.config.data_parallel
        members = self.members
        total = self.sampler.step_size(dp.global_batch)
        sizes = self.controller.allocation(total)
        index = self.sampler.take([sizes[w] for w in members])[group.rank]
        mine = sizes[self.id]
        step_start = time.perf_counter()
        flat, loss, oom = self._contribution(index, mine, total, step_start)
        compute = time.perf_counter() - step_start
        self.emulator.maybe_crash(self.step)
        self.joins.poll()

        n = group.size
        tail = pack_tail(
            n, group.rank, loss, compute=compute, wait=self.prev_wait, oom=oom, seen=self.joins.seen,
            norm=float(torch.linalg.vector_norm(flat, dtype=torch.float64)), dtype=self.dtype, device=self.device,
        )
        weight = mine / total
        parts = [flat, *(b.detach().reshape(-1).to(self.dtype) * weight for b in self.buffers), tail]
        buffer = torch.cat(parts)
        wait_start = time.perf_counter()
        group.all_reduce(buffer)
        self.prev_wait = time.perf_counter() - wait_start

        summed = unpack_tail(n, buffer[self.num_params + self.num_buffers :].cpu().double().tolist())
        ooms = [members[j] for j in range(n) if summed.oom[j] > 0]
        if ooms:
            for w in ooms:
                self.controller.report_oom(w)
            return None
        refused = refused_shares(summed.norm, [sizes[w] / total for w in members], dp.max_grad_norm, dp.max_norm_ratio)
        gradient = buffer[: self.num_params]
        if not refused and not finite(gradient):  # finite shares whose sum overflows
            refused = {int(np.argmax(summed.norm)): "the summed gradient is not finite (the largest share is its)"}
        if refused:
            self._skip({members[r]: why for r, why in refused.items()})
        else:
            assign_gradient(self.model, gradient)
            self.optimizer.step()
            copy_flat(self.buffers, buffer[self.num_params : self.num_params + self.num_buffers])
        self._advance(group, sizes, total, summed, step_start, skipped=bool(refused))
        return summed

    def _skip(self, refused: dict[int, str]) -> None:
        """Step ``self.step + 1`` applies nothing: ``refused`` names each worker whose gradient was
        refused, and why; the run stops (:class:`BadSteps`) at data_parallel.max_bad_steps of them."""
        limit = self.config.data_parallel.max_bad_steps
        self.bad_steps += 1
        named = "; ".join(f"worker {w}: {why}" for w, why in refused.items())
        log.error("worker %d: step %d skipped (%d of max_bad_steps %d): %s", self.id, self.step + 1,
                  self.bad_steps, limit, named)
        if self.bad_steps >= limit:
            raise BadSteps(f"{self.bad_steps} steps skipped for refused gradients (data_parallel.max_bad_steps "
                           f"{limit}), the last at step {self.step + 1}: {named}")

    def _contribution(
        self, index: np.ndarray, mine: int, total: int, step_start: float
    ) -> tuple[torch.Tensor, float, float]:
        """This worker's share of the step's gradient over the samples ``index`` (``mine`` of
        the step's ``total``), its weighted loss, and 1.0 when they did not fit in memory
        (with ``controller.memory_guard``: a zero share then); padded to the emulated speed."""
        cpu_start = time.process_time()
        torch.manual_seed(derive_seed(self.config.seed, "data-parallel-step", self.step, self.id))
        oom = 0.0
        try:
            idx = torch.from_numpy(index)
            x, y = self.dataset.x_train[idx].to(self.device), self.dataset.y_train[idx].to(self.device)
            self.model.train()
            flat, loss = local_contribution(self.model, self.loss_fn, x, y, mine / total)
        except torch.OutOfMemoryError:
            if not self.controller.settings.memory_guard or mine <= self.controller.settings.min_batch:
                raise
            flat, loss, oom = torch.zeros(self.num_params, dtype=self.dtype, device=self.device), 0.0, 1.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.emulator.pad(self.step, mine, time.process_time() - cpu_start, time.perf_counter() - step_start)
        return flat, loss, oom

    def _advance(
        self, group: Group, sizes: dict[int, int], total: int, summed: StepTail, step_start: float,
        skipped: bool = False,
    ) -> None:
        """After the optimiser's step: the controller observes every member's compute time,
        the sampler moves on, and the metrics window takes the step (written when due)."""
        dp = self.config.data_parallel
        times = dict(zip(self.members, summed.compute))
        control_start = time.perf_counter()
        self.controller.observe(sizes, times)
        epoch = self.sampler.epoch
        self.sampler.advance(total)
        epoch_end = self.sampler.epoch != epoch
        if epoch_end:
            self.controller.end_epoch()
        control = time.perf_counter() - control_start
        self.step += 1
        waits = summed.wait
        self.window.add(sizes, times, summed.loss, min(waits) if self.step > 1 and all(waits) else None, skipped)
        self.window.controller_time += control
        self.window.step_time += time.perf_counter() - step_start
        if epoch_end or self.step % dp.log_every == 0 or self._done():
            self._record(group, epoch_end)
        if group.rank == 0 and dp.checkpoint_every and self.step % dp.checkpoint_every == 0 and not self._done():
            save_checkpoint(self.shared.run_dir, self.step, self.state_dict())

    def _record(self, group: Group, epoch_end: bool) -> None:
        """Close the metrics window; rank 0 writes it (with an evaluation at epoch ends or the
        last step), checkpoints at epoch ends, and saves the model after the last step."""
        w, self.window = self.window, Window()
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

    def _write_record(self, w: Window, gen: int, epoch_end: bool, done: bool) -> None:
        """Append the metrics line of window ``w`` (evaluated on the test set when due)."""
        cfg = self.config
        k = max(w.steps, 1)
        workers = sorted(w.batch)
        record: Record = {
            "step": self.step,
            "epoch": self.sampler.epoch + self.sampler.offset / self.sampler.num_samples,
            "samples": w.samples,
            "train_loss": w.loss / (w.samples - w.skipped_samples) if w.samples > w.skipped_samples else None,
            "skipped_steps": w.skipped,
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


def worker_main(worker: int, shared: Shared, port_conn: Any, join_step: int | None = None) -> None:
    """Entry point of a worker process (of a joining one with ``join_step``)."""
    worker_process(worker, shared, port_conn, lambda address: Worker(worker, shared).run(address, join_step), log)
