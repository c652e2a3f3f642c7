"""Emulated unlike clients in a federated simulation (config ``heterogeneity``).

Real heterogeneity needs none of this: clients on real machines report their own
compute times. To reproduce unlike clients in one process, each client gets a
relative speed (``speeds``, one per client, or ``speed_range: [low, high]``, drawn
uniformly and seeded) and, optionally, a ``schedule`` of changes (``step`` is a round,
``worker`` a client id). Two clocks:

- ``clock: real`` slows a client by sleeping, as :mod:`fedweave.emulation`
  slows a data-parallel worker: its training lasts ``f · c``, with
  ``f = slowdown · max speed / its speed`` and c the smoothed CPU time of that much work
  (:class:`~fedweave.emulation.Emulator`). The reported compute time is the
  emulated one, so a controller sees the slow client.
- ``clock: virtual`` sleeps never: a client's compute time *is*
  ``samples · sample_time / speed`` (samples = local steps × batch), a function of the
  work and the speed only, so a run is deterministic (the same config and seed give the
  same drops, the same plans and, asynchronously, the same order of arrivals).

A deployed gRPC client (``fedweave client``) emulates its speed the same way on the real
clock (:func:`emulated_handler`), so unlike clients can be reproduced as processes on one machine.

The simulation trains clients one after another, but judges each by its own compute
time, as if they ran in parallel: a client whose time exceeds the round's deadline
(``round_timeout``) misses it and its reply is dropped. On the real clock its sleep
ends at the deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch

from fedweave.emulation import Emulator
from fedweave.config import Config, HeterogeneityConfig, emulates_clients
from fedweave.seeding import numpy_rng
from fedweave.topologies.star import Star
from fedweave.transports.base import Exchange
from fedweave.transports.inmemory import InMemoryTransport
from fedweave.types import Instruction, Message, Update, body_nbytes

log = logging.getLogger(__name__)

DEADLINE = "missed the round deadline"


def client_speeds(config: Config) -> list[float]:
    """Each client's relative speed: ``heterogeneity.speeds``, or drawn from ``speed_range``, or 1."""
    het = config.heterogeneity
    if het.speeds:
        return [float(s) for s in het.speeds]
    if het.speed_range:
        low, high = het.speed_range
        return [float(s) for s in numpy_rng(config.seed, "client-speeds").uniform(low, high, config.clients)]
    return [1.0] * config.clients


class EmulatedClients:
    """A transport to in-process clients of unlike speeds (the handler is the client runtime)."""

    def __init__(
        self,
        handler: Callable[[Message], Message],
        config: HeterogeneityConfig,
        speeds: Sequence[float],
        threads: int = 1,
    ):
        self.handler = handler
        self.config = dataclasses.replace(config, speeds=[float(s) for s in speeds])
        self.threads = threads
        self.transport = InMemoryTransport(self.handle)
        self._emulators: dict[int, Emulator] = {}
        self._timeout: float | None = None

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        self._timeout = timeout
        result = self.transport.exchange(messages, None)  # each client is judged by its own time below
        kept = []
        for reply in result.replies:
            body = reply.body
            if timeout is not None and isinstance(body, Update) and body.compute_time > timeout:
                log.warning(
                    "client %d missed the round %d deadline (%.3g s of %.3g s); reply dropped",
                    reply.client_id, reply.round, body.compute_time, timeout,
                )
                result.failures[reply.client_id] = DEADLINE
                result.bytes_received -= body_nbytes(body)
            else:
                kept.append(reply)
        result.replies = kept
        return result

    def close(self) -> None:
        self.transport.close()

    def emulator(self, client_id: int) -> Emulator:
        if client_id not in self._emulators:
            self._emulators[client_id] = Emulator(self.config, client_id, self.threads)
        return self._emulators[client_id]

    def duration(self, client_id: int, rnd: int, samples: int, cpu_seconds: float, wall_seconds: float) -> float:
        """The emulated compute time of ``samples`` training samples of ``client_id`` in round ``rnd``."""
        emulator = self.emulator(client_id)
        if self.config.clock == "virtual":
            return samples * self.config.sample_time / emulator.speed(rnd)
        native = emulator.native_cost(samples, cpu_seconds) / emulator.threads
        return max(wall_seconds, emulator.factor(rnd) * native)

    def handle(self, msg: Message) -> Message:
        """The handler's reply, its training slowed (clock real) or timed (virtual) to the client's speed."""
        cpu, wall = time.process_time(), time.perf_counter()
        reply = self.handler(msg)
        body, instruction = reply.body, msg.body
        if not isinstance(body, Update) or not isinstance(instruction, Instruction):
            return reply  # evaluations are not part of the emulated work
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        samples = body.local_steps * min(instruction.work.batch_size, body.num_examples)
        duration = self.duration(msg.client_id, msg.round, samples, cpu, wall)
        if self.config.clock == "real":
            until = duration if self._timeout is None else min(duration, self._timeout)
            if until > wall:
                time.sleep(until - wall)
        return dataclasses.replace(reply, body=dataclasses.replace(body, compute_time=duration))


LOGGED_SPEEDS = 20
"""Client speeds listed in the log line; a million clients get a summary."""


def emulated_clients(config: Config, handler: Callable[[Message], Message]) -> Star | None:
    """A star over :class:`EmulatedClients` when the config emulates client speeds, else None."""
    if not emulates_clients(config):
        return None
    speeds = client_speeds(config)
    shown = [round(s, 2) for s in speeds[:LOGGED_SPEEDS]]
    more = f" ... ({len(speeds)} clients, {min(speeds):.2f} to {max(speeds):.2f})" if len(speeds) > LOGGED_SPEEDS else ""
    log.info("emulated client speeds (%s clock): %s%s", config.heterogeneity.clock, shown, more)
    return Star(EmulatedClients(handler, config.heterogeneity, speeds, config.threads or torch.get_num_threads()))


def emulated_handler(config: Config, handler: Callable[[Message], Message]) -> Callable[[Message], Message]:
    """A deployed client's ``handler``, sleeping to its emulated speed when the config emulates
    client speeds (gRPC clients of a star, ``clock: real``), else ``handler`` itself."""
    if not emulates_clients(config):
        return handler
    threads = config.threads or torch.get_num_threads()
    return EmulatedClients(handler, config.heterogeneity, client_speeds(config), threads).handle
