"""The federated spine: one function per round, taking its parts.

    plan    = controller.plan(r); chains.begin_round(r, cohort)   (may end the run: BudgetSpent)
    send    = chains.server_send.encode(strategy.configure(r, global, plan))
    replies = topology.exchange(send, timeout)
    updates = chains.to_server(replies)          (malformed / non-finite ones rejected)
    updates = [chains.combine(updates)]          (only with secure aggregation / HE plugins)
    global  = strategy.aggregate(r, global, updates)
    controller.observe(r, updates); evaluate; on_round(record + client timings + chains.metrics())

:mod:`fedweave.asynchronous` is the other spine: buffered asynchronous aggregation.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedweave.batching.controller import Controller
from fedweave.batching.federated import client_timings
from fedweave.errors import BudgetSpent, RoundError
from fedweave.plugins.chain import Chains, PluginContext
from fedweave.strategies.aggregate import all_finite
from fedweave.strategies.base import Strategy
from fedweave.topologies.base import Topology
from fedweave.types import Evaluation, Instruction, Message, Params, TaskKind, Update, Work

log = logging.getLogger(__name__)

Record = dict[str, Any]

RECORD_KEYS = (
    "round",
    "wall_time",
    "train_loss",
    "test_accuracy",
    "test_loss",
    "clients_sampled",
    "clients_completed",
    "bytes_sent",
    "bytes_received",
    "skipped",
    "round_time",
    "clients",
)
"""Keys every round's record has (None where a round has no value, e.g. no evaluation)."""


@dataclass
class RoundParts:
    """What a round needs. Built from the config by :mod:`fedweave.runner`."""

    strategy: Strategy
    controller: Controller
    topology: Topology
    chains: Chains
    min_clients: int
    timeout: float | None
    evaluate_global: Callable[[Params], dict[str, float]]
    eval_every: int
    federated_eval_every: int
    federated_eval_clients: Callable[[int], list[int]]  # round -> client ids
    eval_batch_size: int


def run(
    parts: RoundParts,
    params: Params,
    first_round: int,
    last_round: int,
    on_round: Callable[[int, Params, Record], None],
) -> Params:
    """Rounds ``first_round..last_round``; ``on_round`` records, checkpoints, reports."""
    for rnd in range(first_round, last_round + 1):
        start = time.perf_counter()
        try:
            params, trained = train_round(parts, rnd, params)
        except BudgetSpent as exc:
            log.warning("run stopped before round %d: %s", rnd, exc)
            break
        trained.update(parts.chains.metrics())
        record = {**dict.fromkeys(RECORD_KEYS), **trained, **evaluate_round(parts, rnd, params, last_round)}
        # Traffic of a federated evaluation counts in the round's bytes.
        record["bytes_sent"] += record.pop("eval_bytes_sent", 0)
        record["bytes_received"] += record.pop("eval_bytes_received", 0)
        record["wall_time"] = time.perf_counter() - start
        on_round(rnd, params, record)
    return params


def train_round(parts: RoundParts, rnd: int, params: Params) -> tuple[Params, Record]:
    plan = parts.controller.plan(rnd)
    parts.chains.begin_round(rnd, [w.client_id for w in plan])
    instructions = parts.strategy.configure(rnd, params, plan)
    exchange = parts.topology.exchange(encode_instructions(parts.chains, instructions), parts.timeout)
    updates = accept_updates(parts.chains, exchange.replies, exchange.failures, params)
    record: Record = {
        "round": rnd,
        "clients_sampled": len(plan),
        "clients_completed": sum(u.clients for u in updates),
        "bytes_sent": exchange.bytes_sent,
        "bytes_received": exchange.bytes_received,
        "skipped": False,
    }
    if record["clients_completed"] < parts.min_clients:
        reasons = "; ".join(f"client {c}: {why}" for c, why in sorted(exchange.failures.items())[:3])
        log.error(
            "round %d skipped: %d of %d clients answered, min_clients is %d (%s); global model kept",
            rnd, record["clients_completed"], len(plan), parts.min_clients, reasons or "no failures reported",
        )
        record.update(skipped=True, train_loss=None)
        return params, record
    try:
        aggregated = updates
        if parts.chains.client_send.combiner is not None:
            aggregated = [parts.chains.combine(updates, PluginContext(rnd, -1, "server"))]
        params = parts.strategy.aggregate(rnd, params, aggregated)
    except RoundError as exc:  # e.g. too few SecAgg survivors, too few clients for Krum
        log.error("round %d skipped: %s; global model kept", rnd, exc)
        record.update(skipped=True, train_loss=None)
        return params, record
    parts.controller.observe(rnd, updates)
    record["train_loss"] = weighted_metric(updates, "train_loss")
    record.update(client_timings(plan, updates, parts.timeout))
    return params, record


def evaluate_round(parts: RoundParts, rnd: int, params: Params, last_round: int) -> Record:
    record: Record = {}
    due = rnd == last_round or (parts.eval_every and rnd % parts.eval_every == 0)
    if due:
        metrics = parts.evaluate_global(params)
        record.update({f"test_{k}": v for k, v in metrics.items()})
    if parts.federated_eval_every and (rnd % parts.federated_eval_every == 0 or rnd == last_round):
        record.update(federated_evaluate(parts, rnd, params))
    return record


def federated_evaluate(parts: RoundParts, rnd: int, params: Params) -> Record:
    """Evaluate on clients' local test splits; metrics weighted by their test examples."""
    ids = parts.federated_eval_clients(rnd)
    instructions = [
        Instruction(rnd, TaskKind.EVALUATE, Work(cid, parts.eval_batch_size), params) for cid in ids
    ]
    exchange = parts.topology.exchange(encode_instructions(parts.chains, instructions), parts.timeout)
    results = [r.body for r in exchange.replies if isinstance(r.body, Evaluation) and r.body.num_examples > 0]
    traffic = {"eval_bytes_sent": exchange.bytes_sent, "eval_bytes_received": exchange.bytes_received}
    if not results:
        return traffic
    total = sum(e.num_examples for e in results)
    names = set.intersection(*(set(e.metrics) for e in results))
    return traffic | {
        f"federated_{name}": sum(e.metrics[name] * e.num_examples for e in results) / total
        for name in sorted(names)
    }


def encode_instructions(chains: Chains, instructions: list[Instruction]) -> list[Message]:
    out = []
    for ins in instructions:
        cid = ins.work.client_id
        out.append(Message(ins.round, cid, chains.server_send.encode(ins, PluginContext(ins.round, cid, "server"))))
    return out


def accept_updates(chains: Chains, replies: list[Message], failures: dict[int, str], params: Params) -> list[Update]:
    """Decode replies; reject (log, count as failed) anything malformed or non-finite.

    A fully decoded update must name only tensors of ``params``, each of its shape; one
    still encoded for a combining plugin (``applied`` not empty) is checked after combining.
    """
    updates = []
    for reply in replies:
        cid = reply.client_id
        try:
            if not isinstance(reply.body, Update):
                raise ValueError(f"expected an update, got {type(reply.body).__name__}")
            update = chains.to_server(reply.body, PluginContext(reply.round, cid, "server"))
        except Exception as exc:
            log.warning("round %d: update of client %d rejected: %s", reply.round, cid, exc)
            failures[cid] = f"rejected: {exc}"
            continue
        if not all_finite(update.tensors) or not all_finite(update.extras):
            log.warning("round %d: update of client %d rejected: it holds NaN or infinite values", reply.round, cid)
            failures[cid] = "rejected: non-finite values"
            continue
        if update.num_examples <= 0:
            log.warning("round %d: update of client %d rejected: num_examples=%d", reply.round, cid, update.num_examples)
            failures[cid] = "rejected: no examples"
            continue
        mismatch = None if update.applied else _mismatch(update.tensors, params)
        if mismatch is not None:
            log.warning("round %d: update of client %d rejected: %s", reply.round, cid, mismatch)
            failures[cid] = f"rejected: {mismatch}"
            continue
        updates.append(update)
    return updates


def _mismatch(tensors: Params, params: Params) -> str | None:
    """Why ``tensors`` do not fit the model's ``params``; None when they do."""
    for name, tensor in tensors.items():
        if name not in params:
            return f"tensor {name!r} is not a parameter of the model"
        if tensor.shape != params[name].shape:
            return f"tensor {name!r} has shape {tuple(tensor.shape)}, the model's is {tuple(params[name].shape)}"
    return None


def weighted_metric(updates: list[Update], name: str) -> float | None:
    pairs = [(u.metrics[name], u.num_examples) for u in updates if name in u.metrics]
    pairs = [(v, n) for v, n in pairs if math.isfinite(v)]
    if not pairs:
        return None
    return sum(v * n for v, n in pairs) / sum(n for _, n in pairs)
