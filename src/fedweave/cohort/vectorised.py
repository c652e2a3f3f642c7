"""One group of clients trained as one vectorised computation (``torch.func``).

The group's trainable parameters are stacked, one client per leading index (all start from the
parameters each received), and so are its buffers (BatchNorm's running statistics: each client
keeps its own). At step t every client takes its own batch (:mod:`fedweave.cohort.schedule`):
``vmap`` over the clients of the client's objective, evaluated by ``functional_call`` on the
shared architecture, and one backward pass of their sum give each client's gradient (the clients
share no parameter; ``vmap`` of ``grad`` computes the same, slower on small models); the client's :class:`LocalStep` adds its
penalty to the objective and its correction to the gradient; :class:`StackedOptimizer` steps the
clients whose steps are not yet done. A model that is a chain of Linear layers and elementwise
activations (the MLP) takes the fast path instead (:mod:`fedweave.cohort.layered`: batched
products and a backward written out, no ``vmap``), its batches gathered for many steps at once.

Batches are padded to the width the caller gives (the run's: a client's padded products then sum
the same whatever its group; else the group's largest batch): the task loss is the mean over a client's valid
rows, computed from per-example losses. A model with batch statistics (BatchNorm in training
mode) must never see padding, so its clients step in subgroups of equal batch size, whose
batches are cut to that size, no padding at all.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.modules.batchnorm import _BatchNorm

from fedweave.cohort.layered import (
    ChainGradients, LossGrad, autograd_loss_grad, chain_of, cross_entropy_grad, task_losses,
)
from fedweave.cohort.optim import StackedOptimizer, Workspace
from fedweave.cohort.schedule import schedule
from fedweave.training import ClientJob, LocalStep, LossFn, TrainResult, round_steps
from fedweave.types import Params


@dataclass
class Trained:
    """A group's outcome: each client's :class:`TrainResult` and its change of the model (the
    state dict's entries in its order: float entries minus the received, others as they end)."""

    results: list[TrainResult]
    deltas: list[Params]


def has_batch_statistics(model: nn.Module) -> bool:
    """Whether a forward in training mode mixes a batch's rows (BatchNorm)."""
    return any(isinstance(m, _BatchNorm) for m in model.modules())


def steps_of(job: ClientJob) -> int:
    """The round's local steps of ``job`` (:func:`~fedweave.training.round_steps`)."""
    return round_steps(job.instruction.work, job.x_train.shape[0])


def _start(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The clients' received tensors, stacked: one leading row (broadcast) when all are the same tensor."""
    return tensors[0].unsqueeze(0) if _shared(tensors) else torch.stack(tensors)


def _stacked(start: torch.Tensor, k: int) -> torch.Tensor:
    """A tensor of its own with ``k`` rows, each client's start."""
    return start.expand(k, *start.shape[1:]).clone()


def _shared(tensors: list[torch.Tensor]) -> bool:
    return all(t is tensors[0] for t in tensors)


_WORKSPACES: weakref.WeakKeyDictionary[nn.Module, Workspace] = weakref.WeakKeyDictionary()


def workspace_of(model: nn.Module) -> Workspace:
    """The :class:`~fedweave.cohort.optim.Workspace` of ``model``'s cohorts (one group at a time)."""
    known = _WORKSPACES.get(model)
    if known is None:
        known = _WORKSPACES[model] = Workspace()
    return known


def train_group(
    model: nn.Module, loss_fn: LossFn, jobs: list[ClientJob], steps: list[LocalStep], width: int | None = None
) -> Trained:
    """Train ``jobs`` (one settings for all, each with training rows) with their ``steps`` at once,
    every batch padded to ``width`` rows (None: the group's largest batch)."""
    counted = [steps_of(job) for job in jobs]
    order = sorted(range(len(jobs)), key=lambda k: -counted[k])  # the clients not yet done: a prefix
    jobs, steps, counted = [jobs[k] for k in order], [steps[k] for k in order], [counted[k] for k in order]
    model.train()
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    entries = list(model.state_dict())
    others = [name for name in entries if name not in set(trainable)]
    start = {name: _start([job.instruction.params[name] for job in jobs]) for name in entries}
    workspace = workspace_of(model)
    params = {  # trainable parameters are floats: what leaves is their change, a tensor of its own
        name: workspace.take(("params", name), (len(jobs), *start[name].shape[1:]), start[name].dtype,
                             start[name].device).copy_(start[name])
        for name in trainable
    }
    buffers = {name: _stacked(start[name], len(jobs)) for name in others}  # frozen parameters too, as received
    plan = schedule(jobs, counted, width)
    x_all = torch.cat([job.x_train for job in jobs])
    y_all = torch.cat([job.y_train for job in jobs])
    device = x_all.device
    anchors, anchor_dims = _anchors(steps, trainable)
    corrections = _corrections(steps, trainable)
    optimizer = StackedOptimizer(jobs[0].settings, workspace)
    rows = plan.rows.transpose(0, 1).contiguous().to(device)  # (T, K, B)
    counts = plan.counts.transpose(0, 1).contiguous()  # (T, K), on the CPU: read per step
    running = (counts > 0).sum(dim=1).tolist()
    split = has_batch_statistics(model)
    chain = None if split else chain_of(model, x_all[0])
    if chain is not None:
        tasks = _chain_steps(chain, loss_fn, params, x_all, y_all, rows, counts, running, optimizer, steps[0],
                             anchors, anchor_dims, corrections, workspace)
    else:
        objective = _objective(model, loss_fn, steps[0])
        tasks = torch.zeros(plan.length, len(jobs), dtype=x_all.dtype, device=device)  # each step's task losses
        weights = (torch.arange(plan.batch) < counts.unsqueeze(2)).to(x_all.dtype).to(device)  # 1 on real rows
        for t in range(plan.length):
            a = running[t]
            if split:
                grads, task = _split_step(objective, params, buffers, x_all, y_all, rows[t], counts[t], a, anchors,
                                          anchor_dims)
            else:
                index = rows[t, :a].reshape(-1)
                x = x_all.index_select(0, index).view(a, plan.batch, *x_all.shape[1:])
                y = y_all.index_select(0, index).view(a, plan.batch, *y_all.shape[1:])
                active_anchors = anchors if anchor_dims is None or anchors is None else _prefix(anchors, a)
                grads, task = _gradients(objective, anchor_dims, _prefix(params, a), _prefix(buffers, a), x, y,
                                         weights[t, :a], active_anchors)
            if corrections is not None:
                grads = {name: g.add(corrections[name][:a]) for name, g in grads.items()}
            optimizer.step(t, params, grads, a)
            tasks[t, :a] = task.detach()
    loss_sum = (tasks.double() * counts.to(device).double()).sum(0)
    end = {**params, **buffers}
    changed = [(end[n] - start[n] if end[n].is_floating_point() else end[n]).unbind(0) for n in entries]
    out: list[Params] = [dict(zip(entries, rows)) for rows in zip(*changed)]  # rows of this group's own tensors, apart
    means = (loss_sum.cpu() / plan.counts.sum(dim=1).double()).tolist()
    results = [
        TrainResult(steps=s, num_examples=job.x_train.shape[0], mean_loss=m) for job, s, m in zip(jobs, plan.steps, means)
    ]
    back = sorted(range(len(jobs)), key=lambda k: order[k])
    return Trained([results[k] for k in back], [out[k] for k in back])


CHUNK_BYTES = 32 * 2**20
"""At most this many bytes of a group's batches are gathered at once (one ``index_select`` for the
steps that fit, instead of one per step)."""


def _chain_steps(chain, loss_fn, params, x_all, y_all, rows, counts, running, optimizer, step, anchors, anchor_dims,
                 corrections, workspace) -> torch.Tensor:
    """The steps of a group whose model is a chain of Linear layers (:mod:`fedweave.cohort.layered`):
    each step's task losses, (T, K). ``rows`` (T, K, B) are the batches' row numbers, ``counts``
    (T, K) their real rows, ``running[t]`` the clients that step at t (a prefix)."""
    T, K, B = rows.shape
    device, dtype = x_all.device, x_all.dtype
    gradients = ChainGradients(chain, params, _loss_grad(loss_fn), workspace)
    y_round = y_all.index_select(0, rows.reshape(-1)).view(T, K, B, *y_all.shape[1:])
    counted = (torch.arange(B) < counts.unsqueeze(2)).to(device)  # the rows a client's loss is the mean over
    plain = _plain_cross_entropy(loss_fn)
    if plain is not None:  # not the targets cross-entropy ignores
        counted &= y_round != plain.ignore_index
        y_round = y_round.clamp_min(0)
    weights = counted.to(dtype) / counted.sum(2, keepdim=True).clamp_min(1).to(dtype)
    weights = weights.unsqueeze(2)  # (T, K, 1, B): a row per client, as the loss takes it
    losses = torch.zeros_like(weights)  # each row's loss at each step; 0 where a client has stopped
    ys, ws, ls = y_round.unbind(0), weights.unbind(0), losses.unbind(0)
    penalty = None if step.penalty is None else vmap(grad(step.penalty), in_dims=(0, anchor_dims))
    features = x_all[0].numel()
    chunk = max(1, CHUNK_BYTES // max(1, K * B * features * x_all.element_size()))
    xs: tuple[torch.Tensor, ...] = ()
    for t in range(T):
        if t % chunk == 0:
            index = rows[t : t + chunk].reshape(-1)
            into = workspace.take("batches", (len(index), *x_all.shape[1:]), dtype, device)
            xs = torch.index_select(x_all, 0, index, out=into).view(-1, K, B, features).unbind(0)
        a = running[t]
        x, y, w, loss = xs[t % chunk], ys[t], ws[t], ls[t]
        if a < K:
            x, y, w, loss = x[:a], y[:a], w[:a], loss[:a]
        into = optimizer.momentum_buffers(t, params, a) if penalty is None and corrections is None else None
        grads = gradients(x, y, w, loss, into)
        if penalty is not None:
            extra = penalty(_prefix(params, a), anchors if anchor_dims is None else _prefix(anchors, a))
            torch._foreach_add_(list(grads.values()), list(extra.values()))
        if corrections is not None:
            torch._foreach_add_(list(grads.values()), [c[:a] for c in corrections.values()])
        optimizer.step(t, params, grads, a, accumulated=into is not None)
    return task_losses(losses, weights)


def _prefix(tensors: Params, a: int) -> Params:
    return {name: t[:a] for name, t in tensors.items()}


def _objective(model: nn.Module, loss_fn: LossFn, step: LocalStep):
    """One client's ``(params, buffers, x, y, weight, anchor) -> (objective, task loss)``: the mean
    of the per-example task losses over the rows of ``weight`` 1 (of cross-entropy, those whose
    target it does not ignore), plus the step's penalty."""
    penalty = step.penalty
    per_example = per_example_loss(loss_fn)
    plain = _plain_cross_entropy(loss_fn)
    ignore = None if plain is None else plain.ignore_index

    def objective(params, buffers, x, y, weight, anchor):
        out = functional_call(model, {**params, **buffers}, (x,))
        if ignore is not None:  # cross-entropy's mean is over the targets it does not ignore
            weight = weight * (y != ignore)
        task = (per_example(out, y) * weight).sum() / weight.sum().clamp_min(1)
        total = task if penalty is None else task + penalty(params, anchor)
        return total, task.detach()

    return objective


def _plain_cross_entropy(loss_fn: LossFn) -> nn.CrossEntropyLoss | None:
    inner = getattr(loss_fn, "loss", loss_fn)
    if type(inner) is nn.CrossEntropyLoss and inner.weight is None and inner.label_smoothing == 0 and inner.reduction == "mean":
        return inner
    return None


def _loss_grad(loss_fn: LossFn) -> LossGrad:
    """The fast path's loss and gradient of its outputs: cross-entropy's written out, any other by autograd."""
    plain = _plain_cross_entropy(loss_fn)
    return cross_entropy_grad() if plain is not None else autograd_loss_grad(per_example_loss(loss_fn))


def per_example_loss(loss_fn: LossFn):
    """``(outputs, targets) -> each example's loss`` of a mean-reducing ``loss_fn``: cross-entropy
    written out (log-softmax, the target's entry), any other one applied to each example alone."""
    plain = _plain_cross_entropy(loss_fn)
    if plain is not None:
        ignore = plain.ignore_index

        def cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            picked = out.log_softmax(-1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            return torch.where(target == ignore, torch.zeros_like(picked), -picked)

        return cross_entropy

    def each(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(out.unsqueeze(0), target.unsqueeze(0))

    return vmap(each)


def _anchors(steps: list[LocalStep], trainable: list[str]) -> tuple[Params | None, int | None | dict]:
    """The steps' penalty anchors: shared (not batched) when every client has the same tensors."""
    if steps[0].penalty is None:
        return None, None
    anchors = {name: [s.anchor[name] for s in steps] for name in trainable}  # type: ignore[index]
    if all(_shared(ts) for ts in anchors.values()):
        return {name: ts[0] for name, ts in anchors.items()}, None
    return {name: torch.stack(ts) for name, ts in anchors.items()}, 0


def _corrections(steps: list[LocalStep], trainable: list[str]) -> Params | None:
    if steps[0].correction is None:
        return None
    return {name: torch.stack([s.correction[name] for s in steps]) for name in trainable}  # type: ignore[index]


def _gradients(objective, anchor_dims, params, buffers, x, y, weight, anchors):
    """Each client's gradient of its objective and its task loss: ``vmap`` of the objective over
    the clients, and one backward pass of their sum (the clients share no parameter, so each
    client's slice of the gradient is its own objective's)."""
    leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
    with torch.enable_grad():
        total, task = vmap(objective, in_dims=(0, 0, 0, 0, 0, anchor_dims))(leaves, buffers, x, y, weight, anchors)
        grads = torch.autograd.grad(total.sum(), list(leaves.values()))
    return dict(zip(leaves, grads)), task


def _split_step(objective, params, buffers, x_all, y_all, rows, count, a, anchors, anchor_dims):
    """A step of the first ``a`` clients of a model with batch statistics: in subgroups of equal
    batch size, each subgroup's batches cut to its size; buffers updated in place, per client."""
    device = x_all.device
    grads = {name: torch.zeros_like(p[:a]) for name, p in params.items()}
    task = torch.zeros(a, dtype=x_all.dtype, device=device)
    sizes = count[:a]
    for size in sorted(set(sizes.tolist())):
        lanes = (sizes == size).nonzero().flatten().to(device)
        index = rows.index_select(0, lanes)[:, :size].reshape(-1)
        x = x_all.index_select(0, index).view(len(lanes), size, *x_all.shape[1:])
        y = y_all.index_select(0, index).view(len(lanes), size, *y_all.shape[1:])
        weight = torch.ones(len(lanes), size, dtype=x_all.dtype, device=device)
        sub_buffers = {name: b.index_select(0, lanes) for name, b in buffers.items()}
        sub_anchors = anchors if anchor_dims is None or anchors is None else {
            name: t.index_select(0, lanes) for name, t in anchors.items()
        }
        sub_params = {name: p.index_select(0, lanes) for name, p in params.items()}
        g, loss = _gradients(objective, anchor_dims, sub_params, sub_buffers, x, y, weight, sub_anchors)
        for name in grads:
            grads[name].index_copy_(0, lanes, g[name])
        for name, b in buffers.items():
            b.index_copy_(0, lanes, sub_buffers[name])
        task.index_copy_(0, lanes, loss)
    return grads, task


def group_bytes(model: nn.Module, example: torch.Tensor, batch: int) -> int:
    """An estimate of one client's memory in a cohort: its stacked parameters with their gradient,
    start, optimiser state and step terms (8 copies), and the activations of a batch of ``batch``
    rows like ``example`` (every module's output, kept for the backward pass, twice)."""
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    sizes: list[int] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: sizes.append(_nbytes(out))) for m in model.modules()]
    try:
        with torch.no_grad():
            was = model.training
            model.eval()
            model(example.unsqueeze(0))
            model.train(was)
    finally:
        for h in hooks:
            h.remove()
    return 8 * state + 2 * batch * (sum(sizes) + example.numel() * example.element_size())


def _nbytes(out: object) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(_nbytes(o) for o in out)
    return 0


def group_size(limit: int | None, budget_bytes: int, per_client: int) -> int:
    """Clients per group: ``limit`` (None: as many as the budget allows), at most what the budget holds."""
    fits = max(1, budget_bytes // max(per_client, 1))
    return fits if limit is None else max(1, min(limit, fits))


__all__ = ["Trained", "group_bytes", "group_size", "has_batch_statistics", "steps_of", "train_group"]
