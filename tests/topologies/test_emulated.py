"""Tests of fedweave.topologies.emulated: the log line of emulated speeds stays short for many clients."""

from __future__ import annotations

import logging

import pytest

from conftest import small_config
from fedweave.topologies.emulated import LOGGED_SPEEDS, client_speeds, emulated_clients
from fedweave.types import Message


def handler(msg: Message) -> Message:
    return msg


def test_the_speeds_of_many_clients_are_logged_as_a_summary(caplog: pytest.LogCaptureFixture) -> None:
    config = small_config("clients=100000", "heterogeneity.speed_range=[1, 8]")
    speeds = client_speeds(config)
    with caplog.at_level(logging.INFO, logger="fedweave.topologies.emulated"):
        assert emulated_clients(config, handler) is not None
    (line,) = [r.getMessage() for r in caplog.records if "emulated client speeds" in r.getMessage()]
    assert line.endswith(f" ... (100000 clients, {min(speeds):.2f} to {max(speeds):.2f})")
    assert str([round(s, 2) for s in speeds[:LOGGED_SPEEDS]]) in line and len(line) < 400


def test_a_few_speeds_are_listed_in_full(caplog: pytest.LogCaptureFixture) -> None:
    config = small_config("clients=4", "heterogeneity.speeds=[1, 2, 4, 8]")
    with caplog.at_level(logging.INFO, logger="fedweave.topologies.emulated"):
        emulated_clients(config, handler)
    assert "emulated client speeds (real clock): [1.0, 2.0, 4.0, 8.0]\n" in caplog.text
