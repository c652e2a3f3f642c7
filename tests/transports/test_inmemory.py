"""Tests of the in-memory transport and the star topology over it."""

from __future__ import annotations

import logging

import pytest
import torch

from fedweave.topologies.star import Star
from fedweave.transports import inmemory
from fedweave.transports.inmemory import InMemoryTransport
from fedweave.types import Evaluation, Instruction, Message, TaskKind, Update, UpdateKind, Work

PARAMS = {"w": torch.zeros(3), "b": torch.zeros(1, dtype=torch.float64)}  # 3·4 + 8 = 20 bytes


def instruction(cid: int) -> Message:
    return Message(1, cid, Instruction(1, TaskKind.TRAIN, Work(cid, 8), PARAMS, extras={"c": torch.zeros(2)}))


def echo(msg: Message) -> Message:
    update = Update(UpdateKind.DELTA, {"w": torch.ones(3)}, num_examples=msg.client_id + 1)
    return Message(msg.round, msg.client_id, update)


def test_replies_in_order_and_bytes_counted() -> None:
    exchange = InMemoryTransport(echo).exchange([instruction(0), instruction(2)], None)
    assert [r.client_id for r in exchange.replies] == [0, 2]
    assert [r.body.num_examples for r in exchange.replies] == [1, 3]
    assert exchange.failures == {}
    assert exchange.bytes_sent == 2 * (20 + 8)  # params and extras of each instruction
    assert exchange.bytes_received == 2 * 12


def test_a_failing_client_is_reported_and_the_others_answer(caplog: pytest.LogCaptureFixture) -> None:
    def handler(msg: Message) -> Message:
        if msg.client_id == 1:
            raise RuntimeError("out of memory")
        return echo(msg)

    with caplog.at_level(logging.WARNING, logger="fedweave.transports.inmemory"):
        exchange = InMemoryTransport(handler).exchange([instruction(0), instruction(1), instruction(2)], None)
    assert [r.client_id for r in exchange.replies] == [0, 2]
    assert exchange.failures == {1: "RuntimeError: out of memory"}
    assert exchange.bytes_sent == 3 * 28 and exchange.bytes_received == 2 * 12
    assert "client 1 failed in round 1: out of memory" in caplog.text


def test_replies_after_the_deadline_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([100.0, 100.5, 102.0])  # start, reply of client 0, reply of client 1
    monkeypatch.setattr(inmemory.time, "monotonic", lambda: next(clock))
    exchange = InMemoryTransport(echo).exchange([instruction(0), instruction(1)], timeout=1.0)
    assert [r.client_id for r in exchange.replies] == [0]
    assert exchange.failures == {1: "missed the round deadline"}
    assert exchange.bytes_received == 12


def test_evaluations_carry_no_tensor_bytes() -> None:
    def evaluate(msg: Message) -> Message:
        return Message(msg.round, msg.client_id, Evaluation(5, {"accuracy": 1.0}))

    exchange = InMemoryTransport(evaluate).exchange([instruction(0)], None)
    assert exchange.bytes_received == 0 and exchange.replies[0].body.num_examples == 5


def test_star_forwards_to_its_transport() -> None:
    closed = []

    class Recording(InMemoryTransport):
        def close(self) -> None:
            closed.append(True)

    star = Star(Recording(echo))
    assert [r.client_id for r in star.exchange([instruction(3)], None).replies] == [3]
    star.close()
    assert closed == [True]
