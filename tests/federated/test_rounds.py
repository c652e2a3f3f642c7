"""Tests of fedweave.federated.rounds with scripted clients: sampling, failures, rejection, skipped rounds, evaluation,
a plugin's own protocol steps."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from conftest import LargestTensor
from fedweave.federated.controller import StaticController
from fedweave.config import AggregationConfig
from fedweave.federated.selection import sample_clients
from fedweave.federated.records import RECORD_KEYS, Record, add_evaluation_traffic, traffic_counts
from fedweave.federated.rounds import (
    AcceptedRounds,
    RoundParts,
    federated_evaluate,
    listed,
    run,
    train_round,
)
from fedweave.errors import RoundError
from fedweave.plugins.chain import Chain, Chains
from fedweave.plugins.contracts import PluginContext
from fedweave.plugins.compression.topk import TopK, TopKHParams
from fedweave.seeding import numpy_rng
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvg, FedAvgHParams
from fedweave.strategies.robust import averager
from fedweave.topologies.star import Star
from fedweave.transports.base import Exchange
from fedweave.transports.inmemory import InMemoryTransport
from fedweave.types import (
    ACCEPTED_ROUND,
    Control,
    Evaluation,
    Instruction,
    Message,
    Params,
    TaskKind,
    Update,
    UpdateKind,
    Work,
)
from fedweave.federated.checks import ExampleLimits, UpdateChecks, WeightPolicy

Handler = Callable[[Message], Message]


def start() -> Params:
    return {"w": torch.zeros(2, dtype=torch.float64)}


def scripted(cid: int, value: float | None = None, num_examples: int | None = None) -> Update:
    """Client ``cid``'s update: delta (cid + 1)·1, weight cid + 1, train loss cid / 10."""
    value = float(cid + 1) if value is None else value
    return Update(
        UpdateKind.DELTA,
        {"w": torch.full((2,), value, dtype=torch.float64)},
        num_examples=cid + 1 if num_examples is None else num_examples,
        metrics={"train_loss": cid / 10},
    )


def clients(overrides: dict[int, Callable[[int], Any]] | None = None) -> tuple[Handler, list[int]]:
    """A handler answering with :func:`scripted` updates, or ``overrides[cid](cid)``; and the ids it saw."""
    seen: list[int] = []

    def handle(msg: Message) -> Message:
        seen.append(msg.client_id)
        body = (overrides or {}).get(msg.client_id, scripted)(msg.client_id)
        return Message(msg.round, msg.client_id, body)

    return handle, seen


class RecordingController(StaticController):
    def __init__(self, num_clients: int, per_round: int, seed: int = 0):
        super().__init__(num_clients, per_round, batch_size=8, epochs=1, local_steps=None, seed=seed)
        self.observed: list[tuple[int, list[int]]] = []

    def observe(self, rnd: int, updates: list[Update]) -> None:
        self.observed.append((rnd, [u.num_examples for u in updates]))


def make_parts(
    handler: Handler,
    *,
    num_clients: int = 4,
    per_round: int = 4,
    min_clients: int = 1,
    eval_every: int = 1,
    federated_every: int = 0,
    evaluate_global: Callable[[Params], dict[str, float]] | None = None,
    topology: Any = None,
    seed: int = 0,
) -> RoundParts:
    return RoundParts(
        strategy=FedAvg(FedAvgHParams(), StrategyContext(num_clients=num_clients)),
        controller=RecordingController(num_clients, per_round, seed),
        topology=topology if topology is not None else Star(InMemoryTransport(handler)),
        chains=Chains(),
        min_clients=min_clients,
        timeout=None,
        evaluate_global=evaluate_global or (lambda p: {"accuracy": float(p["w"][0]), "loss": 1.0}),
        eval_every=eval_every,
        federated_eval_every=federated_every,
        federated_eval_clients=lambda rnd, absent: [0, 1, 2],
        eval_batch_size=64,
    )


def assert_w(params: Params, value: float) -> None:
    torch.testing.assert_close(params["w"], torch.full((2,), value, dtype=torch.float64), rtol=0, atol=1e-12)


def test_round_aggregates_every_answer_weighted_by_examples() -> None:
    handler, seen = clients()
    parts = make_parts(handler)
    params, record = train_round(parts, 1, start())
    assert seen == [0, 1, 2, 3]
    assert_w(params, (1 * 1 + 2 * 2 + 3 * 3 + 4 * 4) / 10)  # deltas 1..4, weights 1..4
    assert record == {
        "round": 1,
        "clients_sampled": 4,
        "clients_completed": 4,
        "bytes_sent": 4 * 16,
        "bytes_received": 4 * 16,
        "skipped": False,
        "train_loss": pytest.approx((1 * 0.0 + 2 * 0.1 + 3 * 0.2 + 4 * 0.3) / 10, abs=1e-12),
        "round_time": 0.0,  # scripted updates report no compute time and claim no client id:
        # each counts for its sender, with the batch the plan gave it
        "clients": [{"id": i, "steps": 0, "batch": i + 1, "compute": 0.0, "idle": 0.0} for i in range(4)],
        "rejected": {},
        "capped": 0,
    }
    assert parts.controller.observed == [(1, [1, 2, 3, 4])]


def test_sampling_follows_the_seeded_controller() -> None:
    for seed in (0, 1):
        handler, seen = clients()
        parts = make_parts(handler, num_clients=10, per_round=3, seed=seed)
        for rnd in (1, 2, 3):
            seen.clear()
            _, record = train_round(parts, rnd, start())
            assert seen == sample_clients(numpy_rng(seed, "sample", rnd), 10, 3)
            assert record["clients_sampled"] == record["clients_completed"] == 3


def test_a_client_that_raises_is_counted_failed_and_the_rest_aggregate(caplog: pytest.LogCaptureFixture) -> None:
    def crash(cid: int) -> Update:
        raise RuntimeError("disk full")

    handler, _ = clients({1: crash})
    with caplog.at_level(logging.WARNING):
        params, record = train_round(make_parts(handler), 1, start())
    assert (record["clients_sampled"], record["clients_completed"]) == (4, 3)
    assert_w(params, (1 * 1 + 3 * 3 + 4 * 4) / 8)
    assert "client 1 failed in round 1: disk full" in caplog.text
    assert record["bytes_received"] == 3 * 16


@pytest.mark.parametrize(
    ("bad", "reason", "why"),
    [
        (lambda cid: scripted(cid, value=float("nan")), "tensor 'w' holds NaN or infinite values", "non_finite"),
        (lambda cid: scripted(cid, value=float("inf")), "tensor 'w' holds NaN or infinite values", "non_finite"),
        (lambda cid: scripted(cid, num_examples=0), "it claims 0 examples, not a whole number in 1..2^53", "examples"),
        (
            lambda cid: Update(UpdateKind.DELTA, {"w": torch.ones(3, dtype=torch.float64)}, 3),
            "tensor 'w' has shape (3,), expected (2,)",
            "shape",
        ),
        (
            lambda cid: Update(UpdateKind.DELTA, {"w": torch.ones(2, dtype=torch.float64), "v": torch.ones(1)}, 3),
            "holds undeclared tensors ['v']",
            "names",
        ),
        (lambda cid: Update(UpdateKind.DELTA, {}, 3), "lacks tensors ['w']", "names"),
        (lambda cid: Update(UpdateKind.DELTA, {"w": torch.ones(2)}, 3), "tensor 'w' is torch.float32, expected torch.float64", "dtype"),
        (
            lambda cid: Update(UpdateKind.DELTA, {"w": torch.ones(2, dtype=torch.int8)}, 3),
            "tensor 'w' is torch.int8, expected torch.float64",
            "dtype",
        ),
        (
            lambda cid: Update(UpdateKind.DELTA, scripted(cid).tensors, 3, extras={"c": torch.tensor([float("nan")])}),
            "holds undeclared extras tensors ['c']",
            "extras",
        ),
        (lambda cid: Evaluation(3, {"accuracy": 1.0}), "expected an update, got Evaluation", "malformed"),
    ],
)
def test_a_bad_update_is_rejected_logged_and_leaves_the_model_alone(
    bad: Callable[[int], Any], reason: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    handler, _ = clients({2: bad})
    with caplog.at_level(logging.WARNING, logger="fedweave.federated.rounds"):
        params, record = train_round(make_parts(handler), 1, start())
    assert f"round 1: update of client 2 rejected: {reason} ({why})" in caplog.text
    assert record["clients_completed"] == 3 and record["rejected"] == {why: 1}
    assert_w(params, (1 * 1 + 2 * 2 + 4 * 4) / 7)  # as if client 2 had not answered


def test_too_few_answers_skip_the_round_and_keep_the_model(caplog: pytest.LogCaptureFixture) -> None:
    def crash(cid: int) -> Update:
        raise RuntimeError("gone")

    handler, _ = clients({0: crash, 3: crash})
    parts = make_parts(handler, min_clients=3)
    params = start()
    with caplog.at_level(logging.ERROR, logger="fedweave.federated.rounds"):
        kept, record = train_round(parts, 2, params)
    assert kept is params and torch.equal(kept["w"], torch.zeros(2, dtype=torch.float64))
    assert record["skipped"] is True and record["train_loss"] is None
    assert (record["clients_sampled"], record["clients_completed"]) == (4, 2)
    assert "round 2 skipped: 2 of 4 clients answered, min_clients is 3" in caplog.text
    assert "client 0: RuntimeError: gone" in caplog.text
    assert parts.controller.observed == []


def test_each_instruction_tells_its_client_the_last_round_the_server_applied() -> None:
    """Round 1: client 2 sends NaN (rejected). Round 2: only client 3 answers, min_clients=2 (skipped).
    Round 3: everybody. Federated evaluation afterwards."""
    told: dict[int, dict[int, int]] = {}  # round -> client -> accepted_round in its instruction
    bad = {1: {2: "nan"}, 2: {0: "crash", 1: "crash", 2: "crash"}}

    def handle(msg: Message) -> Message:
        ins = msg.body
        assert isinstance(ins, Instruction)
        told.setdefault(msg.round if ins.task is TaskKind.TRAIN else -1, {})[msg.client_id] = ins.config[ACCEPTED_ROUND]
        if ins.task is TaskKind.EVALUATE:
            return Message(msg.round, msg.client_id, Evaluation(1, {"accuracy": 1.0}))
        fault = bad.get(msg.round, {}).get(msg.client_id)
        if fault == "crash":
            raise RuntimeError("gone")
        update = scripted(msg.client_id, float("nan") if fault == "nan" else None)
        return Message(msg.round, msg.client_id, dataclasses.replace(update, client_id=msg.client_id))

    parts = make_parts(handle, min_clients=2, federated_every=3)
    run(parts, start(), 1, 3, lambda rnd, params, record: None)
    assert told == {
        1: {0: 0, 1: 0, 2: 0, 3: 0},
        2: {0: 1, 1: 1, 2: 0, 3: 1},  # client 2's round-1 update was rejected
        3: {0: 1, 1: 1, 2: 0, 3: 1},  # round 2 was skipped: client 3's update there was not applied either
        -1: {0: 3, 1: 3, 2: 3},  # the evaluation after round 3 (clients 0, 1, 2)
    }
    assert parts.accepted.rounds == {0: 3, 1: 3, 2: 3, 3: 3}


def test_a_pre_aggregated_update_counts_for_each_member() -> None:
    accepted = AcceptedRounds()
    site = Update(UpdateKind.DELTA, {}, 10, client_id=4, clients=3, members=[4, 5, 7])
    accepted.applied(2, [site, Update(UpdateKind.DELTA, {}, 1, client_id=1)])
    assert accepted.rounds == {4: 2, 5: 2, 7: 2, 1: 2}
    stamped = accepted.stamp(Instruction(3, TaskKind.TRAIN, Work(5, 8), start(), config={"lr": 0.1}))
    assert stamped.config == {"lr": 0.1, ACCEPTED_ROUND: 2}
    assert accepted.stamp(Instruction(3, TaskKind.TRAIN, Work(6, 8), start())).config == {ACCEPTED_ROUND: 0}
    for f in dataclasses.fields(Instruction):  # built field by field: every other field the very object given
        if f.name != "config":
            given = Instruction(3, TaskKind.TRAIN, Work(5, 8), start(), config={}, extras={}, applied=[])
            assert getattr(accepted.stamp(given), f.name) is getattr(given, f.name), f.name


def site(cid: int, value: float, members: list[int]) -> Update:
    """A pre-aggregated update from client ``cid``, standing for ``members``."""
    return dataclasses.replace(scripted(cid, value), clients=len(members), members=members)


ALL = {c: 1 for c in (0, 1, 2, 5, 6, 3, 7, 4)}


class TwoSites:
    """Clients 0..7, of which 2, 5, 6 answer through their site leader 2 and 3, 7 through 3:
    one (pre-aggregated) update per site; a :class:`~fedweave.topologies.base.Relaying` topology."""

    SITES = {2: frozenset({2, 5, 6}), 3: frozenset({3, 7})}

    def __init__(self, handler: Handler):
        self.star = Star(InMemoryTransport(handler))

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        return self.star.exchange([m for m in messages if m.client_id < 5], timeout)

    def site_members(self, client_id: int) -> frozenset[int]:
        return self.SITES.get(client_id, frozenset({client_id}))

    def close(self) -> None:
        self.star.close()


@pytest.mark.parametrize(
    ("aggregation", "w", "accepted"),
    [
        # Krum scores, f = 1 (the 2 nearest others; squared distances summed over the 2 coordinates):
        # 0: 2·(1 + 9) = 20, 1: 2·(1 + 4) = 10, 2: 2·(92² + 96²), 3: 2·(4 + 9) = 26, 4: 2·(16 + 36) = 104
        (AggregationConfig("krum"), 2.0, {1: 1}),
        (AggregationConfig("multi_krum"), (1 * 1 + 2 * 2 + 4 * 4 + 5 * 8) / 12, {0: 1, 1: 1, 3: 1, 7: 1, 4: 1}),
        (AggregationConfig("median"), 4.0, ALL),  # every update moves some coordinate: all count
        (AggregationConfig("trimmed_mean", trim_fraction=0.2), (2 + 4 + 8) / 3, ALL),
        (AggregationConfig("mean"), (1 * 1 + 2 * 2 + 3 * 100 + 4 * 4 + 5 * 8) / 15, ALL),
    ],
    ids=["krum", "multi_krum", "median", "trimmed_mean", "mean"],
)
def test_updates_the_rule_discards_do_not_count_as_applied(
    caplog: pytest.LogCaptureFixture, aggregation: AggregationConfig, w: float, accepted: dict[int, int]
) -> None:
    """Deltas 1, 2, 100, 4, 8 (weights 1..5); client 2's update, the outlier, is a site's for
    clients 2, 5, 6 and client 3's one for 3, 7: a discarded site update counts for none of
    its members, a kept one for all of them."""
    caplog.set_level(logging.INFO, logger="fedweave.federated.rounds")
    handler, _ = clients({
        0: lambda cid: scripted(cid, 1.0),
        1: lambda cid: scripted(cid, 2.0),
        2: lambda cid: site(cid, 100.0, [2, 5, 6]),
        3: lambda cid: site(cid, 4.0, [3, 7]),
        4: lambda cid: scripted(cid, 8.0),
    })
    parts = make_parts(handler, num_clients=8, per_round=8, topology=TwoSites(handler))
    parts.strategy = FedAvg(FedAvgHParams(), StrategyContext(num_clients=8, average=averager(aggregation)))
    parts.checks = UpdateChecks(weights=WeightPolicy("trust"))  # client 4's 5 is above 3 x the median 1 per client
    params, record = train_round(parts, 1, start())
    assert_w(params, w)
    assert type(params) is dict  # what the step kept is the loop's business; the model is plain Params
    assert record["clients_completed"] == 8 and not record["skipped"]
    assert parts.accepted.rounds == accepted
    discarded = sorted(set(ALL) - set(accepted))
    assert ("the aggregation rule discarded" in caplog.text) == bool(discarded)
    if aggregation.rule == "multi_krum":
        assert "round 1: the aggregation rule discarded the updates of clients [2, 5, 6]" in caplog.text
    stamped = parts.accepted.stamp(Instruction(2, TaskKind.TRAIN, Work(2, 8), start()))
    assert stamped.config[ACCEPTED_ROUND] == (1 if 2 in accepted else 0)  # so client 2 keeps or drops its state


def test_evaluation_every_n_rounds_and_on_the_last() -> None:
    for every, expected in ((2, [2, 4, 5]), (0, [5]), (1, [1, 2, 3, 4, 5])):
        evaluated: list[float] = []

        def evaluate_global(p: Params) -> dict[str, float]:
            evaluated.append(float(p["w"][0]))
            return {"accuracy": 0.5, "loss": 2.0}

        records: list[Record] = []
        handler, _ = clients()
        run(make_parts(handler, eval_every=every, evaluate_global=evaluate_global), start(), 1, 5,
            lambda rnd, p, rec: records.append(rec))
        rounds_evaluated = [r["round"] for r in records if r["test_accuracy"] is not None]
        assert rounds_evaluated == expected
        assert evaluated == [3.0 * r for r in expected]  # each round adds 3 to w: the model after the round
        assert all(tuple(r) == RECORD_KEYS for r in records)
        assert all(r["test_loss"] is None for r in records if r["round"] not in expected)


def test_run_reports_every_round_with_wall_time() -> None:
    calls: list[tuple[int, float]] = []
    handler, _ = clients()
    final = run(make_parts(handler), start(), 3, 4, lambda rnd, p, rec: calls.append((rnd, rec["wall_time"])))
    assert [rnd for rnd, _ in calls] == [3, 4]
    assert all(t >= 0 for _, t in calls)
    assert_w(final, 6.0)


def test_round_time_is_the_measured_wait_for_a_lost_client_not_the_deadline() -> None:
    """Over a network a lost client is given up after heartbeat_timeout (6 s here), well before
    the round's 120 s deadline: the record shows the 6 s the server waited."""
    handler, _ = clients()
    inner = Star(InMemoryTransport(handler))

    class LosesClient3:
        def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
            result = inner.exchange([m for m in messages if m.client_id != 3], timeout)
            result.failures[3], result.waited = "lost: it has not sent a heartbeat for 6.0 s", 6.0
            return result

        def close(self) -> None:
            """Nothing to release."""

    parts = dataclasses.replace(make_parts(handler, topology=LosesClient3()), timeout=120.0)
    _, record = train_round(parts, 1, start())
    assert record["clients_completed"] == 3 and record["round_time"] == 6.0
    simulated = dataclasses.replace(parts, topology=Star(InMemoryTransport(clients({3: lambda c: 1 / 0})[0])))
    assert train_round(simulated, 1, start())[1]["round_time"] == 120.0  # no measured wait: the deadline


class EvaluationTopology:
    """A fake topology that answers evaluation instructions with scripted results."""

    def __init__(self, results: dict[int, Evaluation]):
        self.results = results
        self.received: list[Instruction] = []

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        self.received.extend(m.body for m in messages)
        return Exchange(replies=[Message(m.round, m.client_id, self.results[m.client_id]) for m in messages])

    def close(self) -> None:
        """Nothing to release."""


def test_federated_evaluation_is_weighted_by_test_examples() -> None:
    topology = EvaluationTopology(
        {
            0: Evaluation(10, {"accuracy": 0.5, "loss": 1.0}),
            1: Evaluation(30, {"accuracy": 0.9, "loss": 0.2, "f1": 0.3}),
            2: Evaluation(0, {}),  # no local test split: not counted
        }
    )
    parts = make_parts(lambda m: m, topology=topology)
    params = start()
    record = federated_evaluate(parts, 4, params)
    assert record == {
        "eval_bytes_sent": 0,
        "eval_bytes_received": 0,
        "eval_wire_bytes_sent": 0,
        "eval_wire_bytes_received": 0,
        "federated_accuracy": pytest.approx((10 * 0.5 + 30 * 0.9) / 40, abs=1e-12),
        "federated_loss": pytest.approx((10 * 1.0 + 30 * 0.2) / 40, abs=1e-12),
    }
    assert [(i.round, i.task, i.work.client_id, i.work.batch_size) for i in topology.received] == [
        (4, TaskKind.EVALUATE, c, 64) for c in (0, 1, 2)
    ]
    assert all(i.params is params for i in topology.received)


def test_federated_evaluation_schedule() -> None:
    def handle(msg: Message) -> Message:
        if msg.body.task is TaskKind.EVALUATE:
            return Message(msg.round, msg.client_id, Evaluation(1, {"accuracy": 1.0}))
        return Message(msg.round, msg.client_id, scripted(msg.client_id))

    records: list[Record] = []
    run(make_parts(handle, federated_every=2), start(), 1, 5, lambda rnd, p, rec: records.append(rec))
    assert [r["round"] for r in records if "federated_accuracy" in r] == [2, 4, 5]
    assert all(r["federated_accuracy"] == 1.0 for r in records if "federated_accuracy" in r)


class Roll:
    """A combining plugin with a protocol of its own: ``setup`` asks each client for a number
    and keeps those that answer an odd one; ``combine`` asks the trained clients again and
    returns their plain weighted mean. Tensors of its messages: one int64 each (8 bytes)."""

    name = "roll"
    accepts = frozenset(UpdateKind)
    combines_encoded = True

    def __init__(self) -> None:
        self.asked: list[tuple[str, list[int]]] = []

    def setup(self, rnd: int, cohort: list[int], exchange: Any) -> list[int]:
        answers = exchange({c: Control("roll", "draw", {"n": torch.tensor([c])}) for c in cohort})
        self.asked.append(("draw", sorted(answers)))
        if not answers:
            raise RoundError("roll: nobody answered the draw")
        return [c for c, a in answers.items() if int(a.tensors["n"]) % 2 == 1]

    def combine(self, updates: list[Update], ctx: Any, exchange: Any) -> Update:
        answers = exchange({u.client_id: Control("roll", "check") for u in updates})
        self.asked.append(("check", sorted(answers)))
        total = sum(u.num_examples for u in updates)
        mean = sum(u.tensors["w"] * u.num_examples for u in updates) / total
        return Update(UpdateKind.DELTA, {"w": mean}, total, applied=["roll"])

    def encode(self, payload: Any, ctx: Any) -> Any:
        return payload

    def decode(self, payload: Any, ctx: Any) -> Any:
        return payload


def roll_clients(numbers: dict[int, int], wrong_step: set[int] = frozenset()) -> tuple[Handler, list[tuple[str, int]]]:
    """Clients that answer a draw with ``numbers[cid]``, a check with nothing, and train as scripted."""
    seen: list[tuple[str, int]] = []

    def handle(msg: Message) -> Message:
        body = msg.body
        if isinstance(body, Control):
            seen.append((body.step, msg.client_id))
            step = "other" if msg.client_id in wrong_step else body.step
            tensors = {"n": torch.tensor([numbers[msg.client_id]])} if body.step == "draw" else {}
            return Message(msg.round, msg.client_id, Control("roll", step, tensors))
        seen.append(("train", msg.client_id))
        update = scripted(msg.client_id)
        update.applied, update.client_id = ["roll"], msg.client_id
        return Message(msg.round, msg.client_id, update)

    return handle, seen


def test_a_plugin_protocol_runs_its_steps_through_the_topology_and_its_bytes_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plugin = Roll()
    handler, seen = roll_clients({0: 1, 1: 4, 2: 7, 3: 9}, wrong_step={3})
    parts = make_parts(handler)
    parts.chains = Chains(client_send=Chain([plugin]))
    with caplog.at_level(logging.WARNING, logger="fedweave.federated.rounds"):
        params, record = train_round(parts, 1, start())
    # 3 answered the draw with the wrong step: ignored; 1 drew an even number: not set up
    assert seen == [("draw", 0), ("draw", 1), ("draw", 2), ("draw", 3), ("train", 0), ("train", 2), ("check", 0), ("check", 2)]
    assert plugin.asked == [("draw", [0, 1, 2]), ("check", [0, 2])]
    assert "round 1: client 3's answer is not a draw step of roll" in caplog.text
    assert_w(params, (1 * 1 + 3 * 3) / 4)
    assert record["clients_sampled"] == 4 and record["clients_completed"] == 2
    assert record["bytes_sent"] == 4 * 8 + 2 * 16  # four draws (one int64), two instructions (w: 2 float64)
    assert record["bytes_received"] == 4 * 8 + 2 * 16  # four drawn numbers, two updates


def test_a_protocol_set_up_that_fails_skips_the_round_before_training(caplog: pytest.LogCaptureFixture) -> None:
    def silent(cid: int) -> Update:
        raise ConnectionError("gone")

    handler, seen = clients({c: silent for c in range(4)})
    parts = make_parts(handler)
    parts.chains = Chains(client_send=Chain([Roll()]))
    with caplog.at_level(logging.ERROR, logger="fedweave.federated.rounds"):
        kept, record = train_round(parts, 2, start())
    assert seen == [0, 1, 2, 3]  # the draws only: nobody was asked to train
    assert record["skipped"] is True and record["train_loss"] is None and record["clients_completed"] == 0
    assert "round 2 skipped: roll: nobody answered the draw; global model kept" in caplog.text
    assert_w(kept, 0.0)


def test_an_update_counts_for_its_sender_whatever_id_it_claims(caplog: pytest.LogCaptureFixture) -> None:
    """Client 1 claims to be client 3; a 'site' update from client 2 names members without it."""
    claims_three = lambda cid: dataclasses.replace(scripted(cid), client_id=3)  # noqa: E731
    foreign_site = lambda cid: dataclasses.replace(scripted(cid), clients=2, members=[0, 3])  # noqa: E731
    handler, _ = clients({1: claims_three, 2: foreign_site})
    parts = make_parts(handler)
    params, record = train_round(parts, 1, start())
    assert record["clients_completed"] == 3  # 0, 1 (as itself) and 3; client 2's update is refused
    assert_w(params, (1 * 1 + 2 * 2 + 4 * 4) / 7)
    assert parts.accepted.state_dict() == {0: 1, 1: 1, 3: 1}
    assert "update of client 2 rejected: it stands for clients [0, 3], which do not include its sender" in caplog.text


def test_a_plain_client_claiming_to_be_five_counts_for_nobody(caplog: pytest.LogCaptureFixture) -> None:
    """Client 0 alone answers with ``clients: 5, members: [0, 1, 2, 3, 3]`` (then without the
    duplicate): it must not satisfy min_clients nor mark the others' rounds applied."""

    def crash(cid: int) -> Update:
        raise RuntimeError("gone")

    for members in ([0, 1, 2, 3, 3], [0, 1, 2, 3]):
        crafted = lambda cid, m=members: dataclasses.replace(scripted(cid), clients=len(m), members=m)  # noqa: E731
        handler, _ = clients({0: crafted, 1: crash, 2: crash, 3: crash})
        parts = make_parts(handler, min_clients=2)
        with caplog.at_level(logging.WARNING, logger="fedweave.federated.rounds"):
            params, record = train_round(parts, 1, start())
        assert record["skipped"] and record["clients_completed"] == 0 and record["rejected"] == {"senders": 1}
        assert parts.accepted.state_dict() == {}
        assert_w(params, 0.0)
    assert "update of client 0 rejected: it names clients [0, 1, 2, 3, 3] more than once (senders)" in caplog.text
    assert "it claims to stand for clients [1, 2, 3], for whom its sender may not speak (senders)" in caplog.text


def test_a_site_may_not_stand_for_a_client_twice_or_outside_the_round() -> None:
    handler, _ = clients({
        2: lambda cid: site(cid, 2.0, [2, 5, 6]),
        3: lambda cid: site(cid, 4.0, [3, 5]),  # 5 is site 2's, and counted already
    })
    parts = make_parts(handler, num_clients=8, per_round=8, topology=TwoSites(handler))
    params, record = train_round(parts, 1, start())
    assert record["clients_completed"] == 1 + 1 + 3 + 1 and record["rejected"] == {"senders": 1}
    assert parts.accepted.state_dict() == {0: 1, 1: 1, 2: 1, 5: 1, 6: 1, 4: 1}


def test_an_inflated_example_count_is_capped() -> None:
    """Client 3 claims 10^6 examples for its delta of 4: the server knows it holds 4 (simulation),
    or caps every claim at aggregation.max_examples, or every weight at a share of the total; and by
    default, knowing no size, at 3 x the cohort's lower median claim (2 of claims 1, 2, 3, 10^6): 6."""
    inflated = {3: lambda cid: scripted(cid, num_examples=1_000_000)}
    for checks, w in (
        (UpdateChecks(weights=WeightPolicy("trust")), (1 * 1 + 2 * 2 + 3 * 3 + 4 * 1_000_000) / 1_000_006),
        (UpdateChecks(), (1 * 1 + 2 * 2 + 3 * 3 + 4 * 6) / 12),
        (UpdateChecks(limits=ExampleLimits(size_of={0: 1, 1: 2, 2: 3, 3: 4}.__getitem__)), 30 / 10),
        (UpdateChecks(limits=ExampleLimits(max_examples=6)), (1 + 4 + 9 + 4 * 6) / 12),
        # c = 0.4 · (1 + 2 + 3) / (1 − 0.4) = 4: weights 1, 2, 3, 4
        (UpdateChecks(max_weight_share=0.4), 30 / 10),
    ):
        handler, _ = clients(inflated)
        parts = make_parts(handler)
        parts.checks = checks
        params, record = train_round(parts, 1, start())
        assert_w(params, w)
        assert record["rejected"] == {}
        assert record["capped"] == (checks.weights.policy == "cap" and checks.limits == ExampleLimits())


def test_a_claim_above_the_cohort_bound_is_refused_with_weight_policy_refuse(caplog: pytest.LogCaptureFixture) -> None:
    """weight_policy refuse, ratio 2: client 3's claim of 9 is above 2 x the lower median 2 of
    claims 1, 2, 3, 9: its update is dropped (rejected, not completed), the others' mean is 14 / 6."""
    handler, _ = clients({3: lambda cid: scripted(cid, num_examples=9)})
    parts = make_parts(handler)
    parts.checks = UpdateChecks(weights=WeightPolicy("refuse", ratio=2.0))
    with caplog.at_level(logging.WARNING, logger="fedweave.federated.rounds"):
        params, record = train_round(parts, 1, start())
    assert_w(params, (1 + 4 + 9) / 6)
    assert record["rejected"] == {"examples": 1} and record["capped"] == 0 and record["clients_completed"] == 3
    assert 3 not in parts.accepted.state_dict()
    assert "update of client 3 rejected: it claims 9 examples, more than the 4 its cohort allows" in caplog.text


def test_a_site_claim_is_bounded_by_its_members() -> None:
    """Site 2 stands for 3 clients; clients 0, 1 and 4 claim 1, 2 and 5 examples, site 3 (for 3 and
    7) 8. Site 2 claiming 30 (10 per member): claims per client 1, 2, 4, 4, 5, 10, 10, 10, lower
    median 4, so it may claim 3 x 4 x 3 = 36: kept. Claiming 3000 (1000 per member) leaves the median
    at 4: capped at 36; site 3's 8 is within its 3 x 4 x 2 = 24, client 4's 5 within 12."""
    for claim, weights, capped in ((30, (1, 2, 30, 8, 5), 0), (3000, (1, 2, 36, 8, 5), 1)):
        handler, _ = clients({
            2: lambda cid, n=claim: dataclasses.replace(site(cid, 3.0, [2, 5, 6]), num_examples=n),
            3: lambda cid: dataclasses.replace(site(cid, 4.0, [3, 7]), num_examples=8),
        })
        parts = make_parts(handler, num_clients=8, per_round=8, topology=TwoSites(handler))
        params, record = train_round(parts, 1, start())
        deltas = (1, 2, 3, 4, 5)
        assert_w(params, sum(d * n for d, n in zip(deltas, weights)) / sum(weights))
        assert record["capped"] == capped and record["clients_completed"] == 8


def test_bad_updates_every_round_do_not_stop_the_run() -> None:
    """Client 1 sends a float32 tensor, client 2 none at all, client 3 an undeclared 1 GiB extras tensor."""
    handler, _ = clients({
        1: lambda cid: Update(UpdateKind.DELTA, {"w": torch.ones(2)}, 3),
        2: lambda cid: Update(UpdateKind.DELTA, {}, 3),
        3: lambda cid: Update(UpdateKind.DELTA, scripted(cid).tensors, 3, extras={"c": torch.zeros(1).expand(2**28)}),
    })
    records: list[Record] = []
    final = run(make_parts(handler), start(), 1, 3, lambda rnd, p, rec: records.append(rec))
    assert [r["rejected"] for r in records] == [{"names": 1, "dtype": 1, "extras": 1}] * 3
    assert [r["clients_completed"] for r in records] == [1, 1, 1]
    assert_w(final, 3.0)  # client 0's delta of 1, three times


class GoneStar(Star):
    """A star whose transport knows clients ``gone`` are silent; it records what each round asked for."""

    def __init__(self, handler: Handler, gone: frozenset[int]):
        super().__init__(InMemoryTransport(handler))
        self.gone = gone
        self.asked: list[int] = []

    def absent(self, wait_for: int = 0) -> frozenset[int]:
        self.asked.append(wait_for)
        return self.gone


def test_a_round_whose_present_clients_are_fewer_than_min_clients_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """Every client gone (a deployment's outage): the round asks the transport to wait for min_clients of them
    (a bounded wait, :meth:`GrpcServerTransport.absent`), then is skipped naming the gone clients; it was
    skipped at once as '0 of 0 clients answered ... (no failures reported)'. With 2 of 4 gone and
    min_clients 3 the same; with min_clients 2 the round trains the two present."""
    handler, seen = clients()
    for gone, min_clients, skipped in [({0, 1, 2, 3}, 1, True), ({1, 2}, 3, True), ({1, 2}, 2, False)]:
        topology = GoneStar(handler, frozenset(gone))
        parts = make_parts(handler, min_clients=min_clients, topology=topology)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="fedweave"):
            params, record = train_round(parts, 1, start())
        assert topology.asked == [min_clients] and record["skipped"] is skipped
        if skipped:
            present = 4 - len(gone)
            assert (f"round 1 skipped: {len(gone)} clients {sorted(gone)} gone (silent past the heartbeat timeout, or in a broken site), the "
                    f"{present} present are fewer than min_clients {min_clients}") in caplog.text
            assert_w(params, 0.0)
        else:
            assert record["clients_completed"] == 2 and seen[-2:] == [0, 3]


def test_listed_names_at_most_ten_clients_and_counts_the_rest() -> None:
    assert listed({3}) == "1 client [3]"
    assert listed([5, 1]) == "2 clients [1, 5]"
    assert listed(range(25, 0, -1)) == "25 clients [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] and 15 more"


def test_a_compressed_update_whose_layout_is_not_the_model_s_is_refused_before_it_is_decoded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Client 2's top-k payload (18 bytes) claims 'w' is 2^26 float64 entries: the server refuses
    the layout against the model's before building anything (before, it built 768 MB and only
    then refused the shape), and the honest compressed updates of the round count."""
    plugin = TopK(TopKHParams(ratio=1.0, error_feedback=False))
    big = 1 << 26

    def honest(cid: int) -> Update:
        encoded = plugin.encode(scripted(cid), PluginContext(1, cid, "client"))
        return dataclasses.replace(encoded, applied=["topk"])

    def forged(cid: int) -> Update:
        tensors = {"w.__layout": torch.tensor([1, big], dtype=torch.int32), "w.__values": torch.ones(1),
                   "w.__indices": torch.tensor([-32768], dtype=torch.int16)}
        return Update(UpdateKind.DELTA, tensors, 3, applied=["topk"])

    handler, _ = clients({0: honest, 1: honest, 2: forged, 3: honest})
    parts = make_parts(handler)
    parts.chains = Chains(client_send=Chain([plugin]))
    with LargestTensor() as built, caplog.at_level(logging.WARNING, logger="fedweave.federated.rounds"):
        params, record = train_round(parts, 1, start())
    assert 0 < built.entries < 1 << 20  # the honest updates were decoded here; nothing of 2^26 entries was built
    assert record["clients_completed"] == 3 and record["rejected"] == {"malformed": 1}
    assert (f"update of client 2 rejected: the layout of 'w' is torch.float64 ({big},), the model's torch.float64 (2,)"
            in caplog.text)
    assert_w(params, (1 * 1 + 2 * 2 + 4 * 4) / 7)


def test_wire_bytes_are_recorded_only_where_a_network_carried_them() -> None:
    simulated = {"bytes_sent": 10, "bytes_received": 4, "wire_bytes_sent": 0, "wire_bytes_received": 0}
    assert traffic_counts(simulated) == {"bytes_sent": 10, "bytes_received": 4}
    deployed = {"bytes_sent": 10, "bytes_received": 4, "wire_bytes_sent": 25, "wire_bytes_received": 9}
    assert traffic_counts(deployed) == deployed
    record = {"bytes_sent": 10, "bytes_received": 4, "eval_bytes_sent": 3, "eval_bytes_received": 1,
              "eval_wire_bytes_sent": 7, "eval_wire_bytes_received": 2}
    add_evaluation_traffic(record)
    assert record == {"bytes_sent": 13, "bytes_received": 5, "wire_bytes_sent": 7, "wire_bytes_received": 2}
