"""The federated spine: one function per round, taking its parts.

    plan    = controller.plan(r, topology.absent())   (none of the clients a networked transport knows are gone)
    chains.begin_round(r, cohort)                  (may end the run: BudgetSpent)
    plan    = chains.setup(r, plan, control)    (a plugin's own steps, e.g. SecAgg's key set-up)
    send    = chains.to_clients(strategy.configure(r, global, plan))   (server_send chain; HE: the encrypted model)
    replies = topology.exchange(send, timeout)
    updates = accept_updates(replies)            (the receive pipeline, fedweave.federated.receive: each update
                                                  decoded and checked in its documented order; bad ones rejected)
    updates = bound_weights(updates)             (aggregation.weight_policy: each claim within its cohort's bound)
    updates = cap_weight_share(updates)          (aggregation.max_weight_share)
          or [chains.combine(updates, control)]  (only with secure aggregation / HE plugins)
    global  = strategy.aggregate(r, global, updates)
    accepted.applied(r, kept updates)            (each client hears it in its next instruction)
    controller.observe(r, updates); evaluate; on_round(record + client timings + plugins' and strategy's metrics())

``control`` sends a plugin's control messages through the round's topology with the
round's timeout; their bytes count in the round's. Too few answers, too few survivors
to unmask (:class:`~fedweave.errors.RoundError`) skip the round and keep the model;
then no client's update counts as applied, so every client of the round drops the
state it trained (:class:`AcceptedRounds`).

:mod:`fedweave.federated.buffered` is the other spine: buffered asynchronous aggregation.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import cast

from fedweave.federated.controller import Controller
from fedweave.federated.adaptive import client_timings
from fedweave.conforms import Conforms
from fedweave.deadlines import Deadlines
from fedweave.errors import BudgetSpent, RoundError
from fedweave.federated.evaluation import EvaluationHooks
from fedweave.plugins.chain import Chains
from fedweave.plugins.contracts import PluginContext
from fedweave.strategies.aggregate import discarded_clients, kept_indices
from fedweave.strategies.base import Strategy
from fedweave.topologies.base import Topology
from fedweave.topologies.emulated import DEADLINE
from fedweave.transports.base import Exchange, KnowsAbsent
from fedweave.types import (
    ACCEPTED_ROUND,
    Control,
    Evaluation,
    Instruction,
    Message,
    Params,
    TaskKind,
    Update,
    Work,
)
from fedweave.federated.checks import UpdateChecks, cap_weight_share, rejection_counts, valid_evaluation
from fedweave.federated.records import TRAFFIC, Record, finish_record, traffic_counts, train_metrics
from fedweave.federated.receive import accept_updates, bound_weights, combine_checked, declared_examples, stand_for

log = logging.getLogger(__name__)

_knows_absent = Conforms(KnowsAbsent)

class AcceptedRounds:
    """Per client, the last round whose update the server applied to the model.

    Every instruction tells its client (``config[ACCEPTED_ROUND]``, 0 for none), so that
    the client keeps the state it trained in that round and drops the state of a round
    whose update was rejected (malformed, non-finite, late), skipped with its round,
    dropped as too stale, or discarded by the aggregation rule (:mod:`fedweave.federated.client`).
    A rule such as Krum discards updates inside the strategy's ``aggregate``, which then
    returns a :class:`~fedweave.strategies.aggregate.Selected` naming those it kept; only
    they are recorded here. A pre-aggregated update counts for each of its ``members``,
    kept or discarded together. Checkpointed with the run, so a resumed run tells the
    clients the same.
    """

    def __init__(self) -> None:
        self.rounds: dict[int, int] = {}

    def applied(self, rnd: int, updates: Iterable[Update]) -> None:
        """The server folded ``updates``, trained in round ``rnd``, into the model."""
        for update in updates:
            for cid in update.senders:
                self.rounds[cid] = rnd

    def stamp(self, instruction: Instruction) -> Instruction:
        cid = instruction.work.client_id
        return Instruction(  # every field (built, not replace: ~4x faster, a round stamps every client's)
            round=instruction.round, task=instruction.task, work=instruction.work, params=instruction.params,
            config={**instruction.config, ACCEPTED_ROUND: self.rounds.get(cid, 0)}, extras=instruction.extras,
            applied=instruction.applied,
        )

    def state_dict(self) -> dict[int, int]:
        return dict(self.rounds)

    def load_state_dict(self, state: dict[int, int]) -> None:
        self.rounds = {int(c): int(r) for c, r in state.items()}


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
    federated_eval_clients: Callable[[int, Collection[int]], list[int]]  # round, absent clients -> client ids
    eval_batch_size: int
    accepted: AcceptedRounds = field(default_factory=AcceptedRounds)
    checks: UpdateChecks = field(default_factory=UpdateChecks)
    rejected: Counter[str] = field(default_factory=Counter)  # updates rejected since the last record, by reason
    deadlines: Deadlines | None = None  # a networked run's job deadlines and back-off
    hooks: EvaluationHooks = field(default_factory=EvaluationHooks)  # eval.*_aggregation, server_function, per_client


def run(
    parts: RoundParts,
    params: Params,
    first_round: int,
    last_round: int,
    on_round: Callable[[int, Params, Record], None],
) -> Params:
    """Rounds ``first_round..last_round``; ``on_round`` records, checkpoints, reports.

    A run stopped by a spent privacy budget returns in the state of its last recorded round."""
    for rnd in range(first_round, last_round + 1):
        start = time.perf_counter()
        planned = parts.controller.state_dict()  # plan() moves it before the budget is checked
        try:
            params, trained = train_round(parts, rnd, params)
        except BudgetSpent as exc:
            parts.controller.load_state_dict(planned)
            log.warning("run stopped before round %d: %s", rnd, exc)
            break
        evaluated = evaluate_round(parts, rnd, params, last_round)
        on_round(rnd, params, finish_record(trained, parts.chains, parts.strategy, evaluated, start))
    return params


def train_round(parts: RoundParts, rnd: int, params: Params) -> tuple[Params, Record]:
    absent = absent_clients(parts.topology, parts.min_clients)
    if absent:
        log.info(
            "round %d: %s gone (silent past the heartbeat timeout, or in a broken site); sampling the others",
            rnd, listed(absent),
        )
    backing_off = backing_off_clients(parts, rnd, absent)
    plan = parts.controller.plan(rnd, absent | backing_off)
    parts.chains.begin_round(rnd, [w.client_id for w in plan])
    timeout = parts.timeout if parts.deadlines is None else parts.deadlines.deadline(parts.timeout)
    traffic = RoundTraffic(parts.topology, rnd, timeout)
    record: Record = {"round": rnd, "clients_sampled": len(plan), "clients_completed": 0, "skipped": False}
    if parts.deadlines is not None:
        record.update(deadline=timeout, backing_off=sorted(backing_off))
    parts.rejected.clear()
    try:
        if absent and len(plan) < parts.min_clients:
            raise RoundError(
                f"{listed(absent)} gone (silent past the heartbeat timeout, or in a broken site), the {len(plan)} present "
                f"are fewer than min_clients {parts.min_clients}"
            )
        ready = set(parts.chains.setup(rnd, [w.client_id for w in plan], traffic.control))  # e.g. SecAgg's keys
        plan = [w for w in plan if w.client_id in ready]
        instructions = parts.strategy.configure(rnd, params, plan)
        exchange = traffic.exchange(encode_instructions(parts.chains, instructions, parts.accepted))
        if parts.deadlines is not None:
            parts.deadlines.observe(rnd, exchange.elapsed, missed_deadline(exchange))
        updates = accept_updates(
            parts.chains, exchange.replies, exchange.failures, params, parts.checks,
            stand_for(parts.topology, {w.client_id for w in plan}), parts.rejected,
        )
        updates, record["capped"] = bound_weights(
            rnd, updates, parts.checks, exchange.failures, parts.rejected, declared=declared_examples(parts.topology)
        )
        record["clients_completed"] = sum(u.clients for u in updates)
        if record["clients_completed"] < parts.min_clients:
            reasons = "; ".join(f"client {c}: {why}" for c, why in sorted(exchange.failures.items())[:3])
            raise RoundError(
                f"{record['clients_completed']} of {record['clients_sampled']} clients answered, min_clients is "
                f"{parts.min_clients} ({reasons or 'no failures reported'})"
            )
        combining = parts.chains.client_send.combiner is not None
        if combining:
            aggregated = [
                combine_checked(parts.chains, rnd, params, updates, parts.checks, parts.rejected, traffic.control)
            ]
        else:
            aggregated = cap_weight_share(updates, parts.checks.max_weight_share)
        result = parts.strategy.aggregate(rnd, params, aggregated)
        params = dict(result)  # plain Params, whether or not the step names the updates it kept
        kept = kept_indices(result, len(aggregated))
        if discarded := discarded_clients(aggregated, kept):
            log.info("round %d: the aggregation rule discarded the updates of clients %s", rnd, discarded)
        applied = [aggregated[i] for i in kept]
        if combining:  # the combined update stands for all of them
            applied = updates if applied else []
        parts.accepted.applied(rnd, applied)
    except RoundError as exc:  # too few answers, too few SecAgg survivors, too few clients for Krum
        log.error("round %d skipped: %s; global model kept", rnd, exc)
        record.update(skipped=True, train_loss=None, rejected=rejection_counts(parts.rejected))
        return params, record | traffic.counts()
    parts.controller.observe(rnd, updates)
    record.update(train_metrics(parts.strategy, updates))
    record.update(parts.hooks.fit_metrics([(u.num_examples, u.metrics) for u in updates]))
    record["rejected"] = rejection_counts(parts.rejected)
    record.update(client_timings(plan, updates, timeout if exchange.waited is None else exchange.waited))
    return params, record | traffic.counts()


def backing_off_clients(parts: RoundParts, rnd: int, absent: Collection[int]) -> frozenset[int]:
    """The clients that missed their deadlines and sit round ``rnd`` out (:mod:`fedweave.deadlines`),
    none while leaving them out would leave fewer than min_clients of those not ``absent``."""
    if parts.deadlines is None:
        return frozenset()
    out = parts.deadlines.excluded(rnd) - set(absent)
    if out and parts.deadlines.num_clients - len(set(absent) | out) < parts.min_clients:
        log.info("round %d: clients %s back off, but without them fewer than min_clients %d are left: "
                 "sampling them too", rnd, sorted(out), parts.min_clients)
        return frozenset()
    if out:
        log.info("round %d: clients %s back off after missing their deadlines: not sampled", rnd, sorted(out))
    return out


def missed_deadline(exchange: Exchange) -> list[int]:
    """The nodes whose job in ``exchange`` failed for its deadline."""
    return [cid for cid, why in exchange.failures.items() if why.startswith(DEADLINE)]


def listed(ids: Collection[int], most: int = 10) -> str:
    """``ids`` for a log line: all of them, or the first ``most`` and how many more."""
    first = sorted(ids)[:most]
    more = f" and {len(ids) - most} more" if len(ids) > most else ""
    return f"{len(ids)} client{'s' * (len(ids) != 1)} {first}{more}"


def absent_clients(topology: Topology, wait_for: int = 0) -> frozenset[int]:
    """The clients the topology's transport knows are gone (none in simulation): no round samples them.
    With fewer than ``wait_for`` present, the transport first waits a bounded time for them to come back."""
    return cast(KnowsAbsent, topology).absent(wait_for) if _knows_absent(topology) else frozenset()


class RoundTraffic:
    """A round's exchanges through its topology, with their bytes counted: the training
    exchange and the control steps of a plugin's own protocol (:meth:`control`)."""

    def __init__(self, topology: Topology, rnd: int, timeout: float | None):
        self.topology = topology
        self.round = rnd
        self.timeout = timeout
        self.bytes = dict.fromkeys(TRAFFIC, 0)

    def exchange(self, messages: list[Message]) -> Exchange:
        result = self.topology.exchange(messages, self.timeout)
        for key in TRAFFIC:
            self.bytes[key] += getattr(result, key)
        return result

    def control(self, bodies: dict[int, Control]) -> dict[int, Control]:
        """Send each client its control message; the answers of those that answered in kind."""
        result = self.exchange([Message(self.round, cid, body) for cid, body in bodies.items()])
        answers = {}
        for reply in result.replies:
            sent, body = bodies.get(reply.client_id), reply.body
            if sent is None or not isinstance(body, Control) or (body.plugin, body.step) != (sent.plugin, sent.step):
                log.warning("round %d: client %d's answer is not a %s step of %s", self.round, reply.client_id,
                            getattr(sent, "step", "?"), getattr(sent, "plugin", "?"))
                continue
            answers[reply.client_id] = body
        for cid, why in sorted(result.failures.items()):
            log.info("round %d: client %d dropped at step %s: %s", self.round, cid, bodies[cid].step, why)
        return answers

    def counts(self) -> Record:
        return traffic_counts(self.bytes)


def evaluate_round(parts: RoundParts, rnd: int, params: Params, last_round: int) -> Record:
    record: Record = {}
    due = rnd == last_round or (parts.eval_every and rnd % parts.eval_every == 0)
    if due:
        metrics = parts.evaluate_global(params)
        record.update({f"test_{k}": v for k, v in metrics.items()})
        record.update(parts.hooks.server_metrics(params))
    if parts.federated_eval_every and (rnd % parts.federated_eval_every == 0 or rnd == last_round):
        record.update(federated_evaluate(parts, rnd, params))
    return record


def federated_evaluate(parts: RoundParts, rnd: int, params: Params) -> Record:
    """Evaluate on clients' local test splits; metrics aggregated by ``parts.hooks`` (default: weighted by
    the clients' test examples)."""
    ids = parts.federated_eval_clients(rnd, absent_clients(parts.topology))
    instructions = [
        Instruction(rnd, TaskKind.EVALUATE, Work(cid, parts.eval_batch_size), params) for cid in ids
    ]
    exchange = parts.topology.exchange(encode_instructions(parts.chains, instructions, parts.accepted), parts.timeout)
    results = [
        (r.client_id, r.body.num_examples, r.body.metrics)
        for r in exchange.replies if isinstance(r.body, Evaluation) and valid_evaluation(r.body)
    ]
    traffic = {f"eval_{key}": getattr(exchange, key) for key in TRAFFIC}
    return traffic | parts.hooks.federated_metrics(results) if results else traffic


def encode_instructions(chains: Chains, instructions: list[Instruction], accepted: AcceptedRounds) -> list[Message]:
    """Each instruction told its client's last applied round, through the server's side of the downlink
    (:meth:`~fedweave.plugins.chain.Chains.to_clients`: the server_send chain, an encrypted model)."""
    as_is = chains.sends_as_is  # no plugin on the downlink: no context made per instruction
    out = []
    for ins in map(accepted.stamp, instructions):
        cid = ins.work.client_id
        out.append(Message(ins.round, cid, ins if as_is else chains.to_clients(ins, PluginContext(ins.round, cid, "server"))))
    return out
