"""Buffered asynchronous aggregation: FedBuff.

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
AISTATS 2022. https://arxiv.org/abs/2106.06639

No client waits for a round. ``concurrency`` clients train at once; each takes the
current global model and, when it finishes, its update goes into a buffer. Every K
(``buffer_size``) arrivals the server takes one step, a *round* of this mode:

    dispatch  each free slot gets an idle client drawn uniformly (seeded) among those that
              have not trained the current model version and whose last update is settled
              (not waiting in the buffer); it trains now and arrives at now + its compute
              time on the virtual clock
    arrive    the in-flight work that finishes first (ties: the one dispatched first);
              staleness τ = server steps taken since it got its model
    buffer    kept unless τ > max_staleness, or it failed, or it missed the deadline
              (round_timeout: the server gives up on it at start + round_timeout)
    step      when K updates are buffered: each claim bounded (aggregation.weight_policy; the
              cohort: the buffer and the latest counted claim of every other client), then
              x ← x + η_g · (A(x, {s(τ_i) · Δ_i}) − x)
              A = the strategy's aggregate (FedAvg: x + Σ n_i s(τ_i) Δ_i / Σ n_i),
              s(τ) = (1 + τ)^-½ by default, η_g = ``server_lr``;
              accepted.applied(the buffer's updates that A kept: Krum discards some);
              controller.observe(buffer); evaluate; on_round(record)

With FedAvg, all updates fresh (τ = 0), η_g = 1 and K = concurrency = clients, each
step is exactly a synchronous FedAvg round. A client trains each model version at most
once: trained again from the same model and state it would repeat its update. A client
keeps the state it trained (SCAFFOLD's c_i) only when its update is applied in a step
(:class:`~fedweave.federated.rounds.AcceptedRounds`): dropped ones are forgotten on both sides. So
that the client knows which state to train from, it is not dispatched again while its
update waits in the buffer.

The simulation runs on the virtual clock of :mod:`fedweave.topologies.emulated`
(``heterogeneity.clock: virtual``): a client's compute time is a function of its work
and speed, so the order of arrivals, and the whole run, is deterministic. Its state
(the clock, the work in flight with its computed updates, the buffer, who trained
which version) is checkpointed, so a resumed run continues exactly as an
uninterrupted one. Each record also has ``clock`` (virtual seconds at the step),
``round_time`` (since the previous step) and per client in the buffer
``{id, steps, batch, compute, staleness}``.

Deployed over gRPC (:func:`run_deployed`), the same server state runs on the real clock: a
drawn client gets its job at once, its answer arrives when it comes (checked, as every
update), and ``max_staleness``, the buffer and the accepted-round bookkeeping work as above.
Clients emulate their speeds by sleeping (``heterogeneity.clock: real``). No client the
transport knows is gone (silent past its heartbeat timeout) is drawn, until it is heard from
again; a simulation has none gone, so its draws are unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from fedweave.topologies.emulated import DEADLINE
from fedweave.checkpoint import checkpoint_type
from fedweave.config import AsynchronousConfig, Config, StalenessOptions
from fedweave.errors import RoundError
from fedweave.federated.receive import accept_updates, bound_weights, declared_examples, stand_for
from fedweave.federated.records import Record, finish_record, train_metrics
from fedweave.federated.rounds import (
    RoundParts,
    absent_clients,
    encode_instructions,
    evaluate_round,
    missed_deadline,
)
from fedweave.seeding import numpy_rng
from fedweave.strategies.aggregate import discarded_clients, kept_indices, with_selection
from fedweave.strategies.base import Strategy
from fedweave.transports.base import Exchange, PostsJobs
from fedweave.types import Message, Params, Update, Work
from fedweave.federated.checks import cap_weight_share, rejection_counts

log = logging.getLogger(__name__)


def staleness_weight(staleness: int, settings: StalenessOptions) -> float:
    """s(τ): the weight of an update τ server steps old (FedBuff's and the parameter server's)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if settings.staleness == "constant":
        return 1.0
    if settings.staleness == "polynomial":
        return float((1 + staleness) ** -settings.exponent)
    if staleness <= settings.hinge_b:
        return 1.0
    return 1.0 / (settings.hinge_a * (staleness - settings.hinge_b) + 1)


def buffered_step(
    strategy: Strategy,
    rnd: int,
    params: Params,
    updates: Sequence[Update],
    staleness: Sequence[int],
    settings: AsynchronousConfig,
) -> Params:
    """One server step on a full buffer: the strategy aggregates the staleness-scaled
    deltas, the server moves ``server_lr`` of the way there. Integer tensors (counters)
    and the strategy's extras are not scaled. Names the updates the strategy kept, as its
    ``aggregate`` does (:class:`~fedweave.strategies.aggregate.Selected`)."""
    scaled = []
    for update, tau in zip(updates, staleness):
        weight = staleness_weight(tau, settings)
        tensors = {k: v * weight if v.is_floating_point() else v for k, v in update.tensors.items()}
        scaled.append(dataclasses.replace(update, tensors=tensors))
    target: Params = strategy.aggregate(rnd, params, scaled)
    lr = settings.server_lr
    if lr == 1.0:
        return target
    moved = {k: p + lr * (target[k] - p) if p.is_floating_point() else target[k] for k, p in params.items()}
    return with_selection(target, moved)


@checkpoint_type
@dataclass
class Flight:
    """One client's work: dispatched at ``start`` on model version ``version``, arriving at ``finish``."""

    finish: float
    seq: int  # dispatch number: orders arrivals at the same instant
    client_id: int
    version: int
    start: float
    batch: int
    update: Update | None  # None: it failed or missed the deadline
    reason: str = ""


class BufferedServer:
    """The state of a buffered asynchronous run; :func:`run_buffered` drives it."""

    def __init__(self, settings: AsynchronousConfig, num_clients: int, buffer_size: int, concurrency: int, seed: int):
        self.settings = settings
        self.num_clients = num_clients
        self.buffer_size = buffer_size
        self.concurrency = concurrency
        self.seed = seed
        self.clock = 0.0
        self.version = 0  # server steps taken
        self.flights: list[Flight] = []
        self.buffer: list[Flight] = []
        self.dispatches = 0
        self.trained_on: dict[int, int] = {}  # client -> the model version it last started from
        self.last_step = 0.0  # the clock at the previous server step
        self.arrived = 0  # arrivals since the previous server step, dropped ones included
        self.bytes_sent = 0
        self.bytes_received = 0
        self.claims: dict[int, float] = {}  # client -> its latest counted claim per client it stood for

    @classmethod
    def from_config(cls, config: Config) -> BufferedServer:
        asy = config.asynchronous
        return cls(
            asy,
            config.clients,
            buffer_size=asy.buffer_size or config.clients_per_round,
            concurrency=asy.concurrency or config.clients,
            seed=config.seed,
        )

    # ------------------------------------------------------------------ events

    def dispatch(self, parts: RoundParts, params: Params) -> None:
        """Fill the free slots: each drawn client trains now on ``params``."""
        while (job := self.next_job(parts, params)) is not None:
            cid, work, messages = job
            exchange = parts.topology.exchange(messages, parts.timeout)
            self.bytes_sent += exchange.bytes_sent
            self.bytes_received += exchange.bytes_received
            accepted = accept_updates(
                parts.chains, exchange.replies, exchange.failures, params, parts.checks,
                stand_for(parts.topology, {cid}), parts.rejected,
            )
            update = accepted[0] if accepted else None
            reason = exchange.failures.get(cid, "")
            if update is not None:
                duration = update.compute_time
            else:  # the server notices a missed deadline at the deadline, any other failure at once
                duration = parts.timeout if reason == DEADLINE and parts.timeout is not None else 0.0
            finish = self.clock + duration
            self.flights.append(
                Flight(finish, self.dispatches, cid, self.version, self.clock, work.batch_size, update, reason)
            )

    def next_job(
        self, parts: RoundParts, params: Params, absent: Collection[int] = ()
    ) -> tuple[int, Work, list[Message]] | None:
        """A free slot's next job: the drawn client (none ``absent``), its work and its encoded
        instruction on ``params``; None when every slot is taken or no client is idle."""
        if len(self.flights) >= self.concurrency:
            return None
        cid = self.draw(absent)
        if cid is None:
            return None
        work = parts.controller.work(cid)
        instructions = parts.strategy.configure(self.version + 1, params, [work])
        return cid, work, encode_instructions(parts.chains, instructions, parts.accepted)

    def idle(self) -> list[int]:
        """The clients free to train the current model version: none of their work in flight or
        in the buffer, and not started on this version yet."""
        busy = {f.client_id for f in self.flights} | {f.client_id for f in self.buffer}
        return [c for c in range(self.num_clients) if c not in busy and self.trained_on.get(c) != self.version]

    def draw(self, absent: Collection[int] = ()) -> int | None:
        """The next client to train (seeded, uniform among the idle ones not ``absent``: known
        gone), counted as dispatched on the current model version; None when no client is idle."""
        idle = [c for c in self.idle() if c not in absent]
        if not idle:
            return None
        cid = idle[int(numpy_rng(self.seed, "async-sample", self.dispatches).integers(len(idle)))]
        self.dispatches += 1
        self.trained_on[cid] = self.version
        return cid

    def arrive(self) -> bool:
        """The next arrival advances the clock; True when it went into the buffer."""
        flight = min(self.flights, key=lambda f: (f.finish, f.seq))
        self.flights.remove(flight)
        self.clock = flight.finish
        return self.land(flight)

    def land(self, flight: Flight) -> bool:
        """``flight`` has arrived (no longer in flight): True when it went into the buffer."""
        self.arrived += 1
        staleness = self.version - flight.version
        if flight.update is None:
            log.warning("client %d sent no update at %.4g s (%s)", flight.client_id, self.clock, flight.reason)
            return False
        limit = self.settings.max_staleness
        if limit is not None and staleness > limit:
            log.info(
                "update of client %d dropped: %d server steps old, max_staleness is %d",
                flight.client_id, staleness, limit,
            )
            return False
        self.buffer.append(flight)
        return True

    def step(self, parts: RoundParts, params: Params) -> tuple[Params, Record]:
        """Aggregate the full buffer: the next model version and its record."""
        flights = sorted(self.buffer, key=lambda f: (f.client_id, f.seq))  # summed in a fixed order
        self.buffer = []
        rnd = self.version + 1
        flights, updates, capped = self.bounded(parts, rnd, flights)
        updates = cap_weight_share(updates, parts.checks.max_weight_share)
        staleness = [self.version - f.version for f in flights]
        record: Record = {  # finished with every key a round writes by records.finish_record
            "round": rnd,
            "clients_sampled": self.arrived,
            "clients_completed": sum(u.clients for u in updates),
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "skipped": False,
            "round_time": self.clock - self.last_step,
            "rejected": rejection_counts(parts.rejected),  # since the previous step
            "capped": capped,
            "clock": self.clock,
            "clients": [
                {"id": f.client_id, "steps": u.local_steps, "batch": min(f.batch, u.num_examples),
                 "compute": u.compute_time, "staleness": tau}
                for f, u, tau in zip(flights, updates, staleness)
            ],
        }
        try:
            if not updates:
                raise RoundError("every buffered update was refused for its claimed examples")
            params = buffered_step(parts.strategy, rnd, params, updates, staleness, self.settings)
        except RoundError as exc:
            log.error("server step %d skipped: %s; global model kept", rnd, exc)
            record["skipped"] = True
        else:
            kept = kept_indices(params, len(updates))
            if discarded := discarded_clients(updates, kept):
                log.info("server step %d: the aggregation rule discarded the updates of clients %s", rnd, discarded)
            for i in kept:  # applied in the round of the instruction it trained on
                parts.accepted.applied(flights[i].version + 1, [updates[i]])
            params = dict(params)
            parts.controller.observe(rnd, updates)
            record.update(train_metrics(parts.strategy, updates))
        self.version = rnd
        self.last_step = self.clock
        self.arrived = self.bytes_sent = self.bytes_received = 0
        parts.rejected.clear()
        return params, record

    def bounded(self, parts: RoundParts, rnd: int, flights: list[Flight]) -> tuple[list[Flight], list[Update], int]:
        """The buffer's ``flights`` and their updates with each claim within its bound
        (:func:`~fedweave.federated.receive.bound_weights`): the cohort is the buffer with the latest counted
        claim per client of every other client (``claims``), so that a small buffer is bounded
        by the federation, not by itself; the refused ones dropped; how many were capped."""
        arrived = [f for f in flights if f.update is not None]
        inside = {f.client_id for f in arrived}
        reference = [v for cid, v in sorted(self.claims.items()) if cid not in inside]
        updates, capped = bound_weights(
            rnd, [f.update for f in arrived if f.update is not None], parts.checks, {}, parts.rejected, reference,
            declared_examples(parts.topology),
        )
        kept = {u.client_id for u in updates}
        for update in updates:
            self.claims[update.client_id] = update.num_examples / update.clients
        return [f for f in arrived if f.client_id in kept], updates, capped

    # ------------------------------------------------------------------ deployed: the real clock

    def post(self, parts: RoundParts, params: Params, jobs: PostsJobs, absent: Collection[int] = ()) -> None:
        """Fill the free slots: each drawn client (none ``absent``) gets its job on ``params`` now,
        with the run's job deadline (:mod:`fedweave.deadlines`; else round_timeout); it arrives
        when it answers."""
        timeout = parts.timeout if parts.deadlines is None else parts.deadlines.deadline(parts.timeout)
        while (job := self.next_job(parts, params, absent)) is not None:
            cid, work, messages = job
            jobs.post(messages, timeout)
            self.flights.append(Flight(0.0, self.dispatches, cid, self.version, self.clock, work.batch_size, None))

    def received(self, parts: RoundParts, params: Params, exchange: Exchange) -> list[Flight]:
        """The flights that ``exchange`` ended, in order of dispatch, each with its checked update
        (None: failed or rejected, with the reason); they are no longer in flight."""
        self.bytes_sent += exchange.bytes_sent
        self.bytes_received += exchange.bytes_received
        if parts.deadlines is not None:
            parts.deadlines.observe(self.version + 1, exchange.elapsed, missed_deadline(exchange))
        ended = {m.client_id for m in exchange.replies} | set(exchange.failures)
        landed = [f for f in self.flights if f.client_id in ended]
        self.flights = [f for f in self.flights if f.client_id not in ended]
        accepted = accept_updates(
            parts.chains, exchange.replies, exchange.failures, params, parts.checks,
            stand_for(parts.topology, ended), parts.rejected,
        )
        updates = {u.client_id: u for u in accepted}
        for flight in landed:
            flight.finish = self.clock
            flight.update = updates.get(flight.client_id)
            flight.reason = exchange.failures.get(flight.client_id, "")
        return landed

    def forget_flights(self) -> None:
        """Work in flight under a previous server is lost: its clients are idle, free to train again."""
        for flight in self.flights:
            if self.trained_on.get(flight.client_id) == flight.version:
                del self.trained_on[flight.client_id]
        self.flights = []

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "clock": self.clock,
            "version": self.version,
            "flights": list(self.flights),
            "buffer": list(self.buffer),
            "dispatches": self.dispatches,
            "trained_on": dict(self.trained_on),
            "last_step": self.last_step,
            "arrived": self.arrived,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "claims": dict(self.claims),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock = float(state["clock"])
        self.version = int(state["version"])
        self.flights = list(state["flights"])
        self.buffer = list(state["buffer"])
        self.dispatches = int(state["dispatches"])
        self.trained_on = {int(c): int(v) for c, v in state["trained_on"].items()}
        self.last_step = float(state["last_step"])
        self.arrived = int(state["arrived"])
        self.bytes_sent = int(state["bytes_sent"])
        self.bytes_received = int(state["bytes_received"])
        self.claims = {int(c): float(v) for c, v in state.get("claims", {}).items()}  # absent before weight bounds


def run_buffered(
    parts: RoundParts,
    server: BufferedServer,
    params: Params,
    first_round: int,
    last_round: int,
    on_round: Callable[[int, Params, Record], None],
) -> Params:
    """Server steps ``first_round..last_round``; ``on_round`` records, checkpoints, reports."""
    if server.version != first_round - 1:
        raise ValueError(f"the asynchronous state has taken {server.version} server steps, not {first_round - 1}")
    started = time.perf_counter()
    while server.version < last_round:
        server.dispatch(parts, params)
        if not server.flights:
            log.error(
                "asynchronous run stopped after %d server steps: no client is left to train model version %d",
                server.version, server.version,
            )
            break
        if not server.arrive() or len(server.buffer) < server.buffer_size:
            continue
        params = _step(parts, server, params, last_round, on_round, started)
        started = time.perf_counter()
    return params


def _step(
    parts: RoundParts,
    server: BufferedServer,
    params: Params,
    last_round: int,
    on_round: Callable[[int, Params, Record], None],
    started: float,
) -> Params:
    """A server step on the full buffer, evaluated, recorded with ``wall_time`` since ``started``."""
    params, record = server.step(parts, params)
    evaluated = evaluate_round(parts, server.version, params, last_round)
    on_round(server.version, params, finish_record(record, parts.chains, parts.strategy, evaluated, started))
    return params


COLLECT_WAIT = 0.25
"""Seconds a deployed server waits for an answer before it looks for idle clients again."""


def run_deployed(
    parts: RoundParts,
    server: BufferedServer,
    jobs: PostsJobs,
    params: Params,
    first_round: int,
    last_round: int,
    on_round: Callable[[int, Params, Record], None],
    rejoin_timeout: float,
) -> Params:
    """Server steps ``first_round..last_round`` over a network, on the real clock.

    Each idle client drawn as in simulation gets its job at once (``jobs.post``), the answers
    are taken as they come (``jobs.collect``), each checked by :func:`~fedweave.federated.receive.accept_updates`
    (a rejected, failed, lost or late one is not buffered and its client may train the next
    model version), and every K buffered updates the server steps as in simulation. ``clock``
    is the real seconds since the run began, continued across a resume. Work in flight when a
    previous server died is lost with it: its clients may train the same version again.

    A client the topology knows is gone (:func:`~fedweave.federated.rounds.absent_clients`) gets no job
    until it is heard from again. When nothing is in flight and every client free to train is
    gone, the server waits up to ``rejoin_timeout`` s for one to come back (one log line), then
    stops as when no client is left.
    """
    if server.version != first_round - 1:
        raise ValueError(f"the asynchronous state has taken {server.version} server steps, not {first_round - 1}")
    server.forget_flights()
    origin = time.monotonic() - server.clock
    started = time.perf_counter()
    gone: frozenset[int] = frozenset()
    waiting_since: float | None = None
    while server.version < last_round:
        server.clock = time.monotonic() - origin
        absent = absent_clients(parts.topology)
        _log_absent(gone, absent)
        gone = absent
        server.post(parts, params, jobs, absent | _backing_off(parts, server, absent))
        if not server.flights:
            waiting_since = _await_return(server, waiting_since, rejoin_timeout)
            if waiting_since is None:
                break
            continue
        waiting_since = None
        exchange = jobs.collect(COLLECT_WAIT)
        server.clock = time.monotonic() - origin
        for flight in server.received(parts, params, exchange):
            if server.land(flight) and len(server.buffer) >= server.buffer_size and server.version < last_round:
                params = _step(parts, server, params, last_round, on_round, started)
                started = time.perf_counter()
    return params


def _backing_off(parts: RoundParts, server: BufferedServer, absent: frozenset[int]) -> frozenset[int]:
    """The clients that missed their deadlines and get no job before server step ``version + 1``
    (:mod:`fedweave.deadlines`), none when no other idle client is present to train instead."""
    if parts.deadlines is None:
        return frozenset()
    out = parts.deadlines.excluded(server.version + 1) - absent
    return out if set(server.idle()) - absent - out else frozenset()


def _log_absent(before: frozenset[int], now: frozenset[int]) -> None:
    """Say which clients are newly gone (no jobs for them) and which are back."""
    if now - before:
        log.info("clients %s are gone (silent past the heartbeat timeout): no new jobs for them", sorted(now - before))
    if before - now:
        log.info("clients %s are back: they may get jobs again", sorted(before - now))


def _await_return(server: BufferedServer, since: float | None, rejoin_timeout: float) -> float | None:
    """Nothing is in flight: when some idle client may still train the current version, all of
    them gone, wait a moment (from ``since``, up to ``rejoin_timeout`` s) for one to come back and
    return when the wait began; None when the run must stop (logged)."""
    now = time.monotonic()
    idle = server.idle()
    if not idle:
        log.error(
            "asynchronous run stopped after %d server steps: no client is left to train model version %d",
            server.version, server.version,
        )
        return None
    if since is None:
        log.warning(
            "server step %d waits: the %d clients free to train model version %d are all gone (silent past the "
            "heartbeat timeout); waiting up to %g s (grpc.join_timeout) for one to come back",
            server.version + 1, len(idle), server.version, rejoin_timeout,
        )
        since = now
    elif now - since >= rejoin_timeout:
        log.error(
            "asynchronous run stopped after %d server steps: no client free to train model version %d came "
            "back within %g s (grpc.join_timeout)",
            server.version, server.version, rejoin_timeout,
        )
        return None
    time.sleep(COLLECT_WAIT)
    return since
