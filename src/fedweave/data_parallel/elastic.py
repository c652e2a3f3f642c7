"""Membership changes of a synchronous run: workers that leave, workers that join.

A worker that dies breaks the collective on the others (gloo reports the closed
connection at once; a hung worker is caught by the collective timeout). The survivors
report to the launcher, which holds a TCP store for the whole run and names the
members of the next generation (:func:`supervise`); they form a new process group
under a new store prefix, take the state of the most advanced survivor (a worker may
have completed the failed step), the controller replans over the survivors and the
step is taken again from the same sampler position, so no progress beyond the current
step is lost and the epoch still covers every sample once.

A worker that joins announces itself in the same store (:func:`announce`): it claims
the next slot ``join/<i>`` (worker id and the first step it may take part in) and
counts itself in ``joins``. The members read that counter at most every ``JOIN_POLL``
seconds, not every step (one store round trip, ~0.1 ms on loopback), and carry what
they read in the step's all-reduce, so all of them learn of the newcomer at the same
step boundary (:class:`Joins`). They close the metrics window, name the newcomer to
the launcher and report as after a failure; the launcher names the next generation,
members and newcomer, and tells the newcomer which one (:func:`admission`); a newcomer
announced after the last step boundary is told the run has ended (:func:`turn_away`). The
newcomer takes the state (model, optimiser, sampler position, controller) from the
most advanced member, the controller replans with it counted as the mean throughput
of the others until its first measured steps, and training goes on from the same
sampler position. A newcomer that does not arrive is dropped like a worker that
hangs, within the timeouts. Emulated joins (``heterogeneity.joins``) are started with
the others and announce themselves before the others start, so each is admitted
exactly at its step; :func:`fedweave.data_parallel.launch.join` (``fedweave join
RUN_DIR``) adds a worker to a running job from another process of this host.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from fedweave.data_parallel.group import DataParallelError, Stopped
from fedweave.data_parallel.records import Record
from fedweave.rundir import MetricsTail

log = logging.getLogger(__name__)


JOINS_KEY = "joins"  # store counter: joiners announced (slots join/1 .. join/<count> are filled)
WORKER_IDS_KEY = "worker-ids"  # store counter: the next worker id (for workers joined by hand)
MAX_JOIN_SLOTS = 100_000
ENDED = "end"  # the value of ``admitted/<worker>`` for a joiner the run ended before admitting

JOIN_POLL = 0.1
"""Seconds between two reads of the join counter by a worker (a joiner waits at most
this long, plus a step, to be noticed; the reads cost ~0.1 ms each)."""


class Joins:
    """What a member knows of the workers that join: the store's count of announcements
    (read at most every ``JOIN_POLL`` seconds), the announcements read so far, and the
    joiners already taken in."""

    def __init__(self) -> None:
        self.store: dist.Store | None = None
        self.seen = 0  # announcements of joiners counted in the store at the last read
        self.last_poll = -float("inf")
        self.announced: list[tuple[int, int]] = []  # (worker, first step) of join/1, join/2, ...
        self.admitted: set[int] = set()  # joiners already taken in (or dropped): never again

    def state_dict(self) -> dict[str, Any]:
        """What the members know of joiners (not checkpointed: a resumed run has a new store)."""
        return {"announced": list(self.announced), "admitted": sorted(self.admitted)}

    def load_state_dict(self, joins: Mapping[str, Any]) -> None:
        self.announced = [tuple(a) for a in joins["announced"]]
        self.admitted = set(joins["admitted"])

    def poll(self, force: bool = False) -> None:
        """Read the store's count of announced joiners, at most every ``JOIN_POLL`` seconds."""
        now = time.monotonic()
        if self.store is None or (not force and now - self.last_poll < JOIN_POLL):
            return  # no store: torchrun's rendezvous admits joiners (the group is formed anew)
        try:
            self.seen = int(self.store.add(JOINS_KEY, 0))
        except Exception as exc:
            raise Stopped(f"the launcher's store is gone: {exc}") from exc
        self.last_poll = now

    def due(self, announced: int, step: int, members: list[int]) -> list[int]:
        """Joiners to admit after ``step``: announced (``announced`` is the largest count any
        member read, the same on every member), due by their first step, not yet admitted."""
        for i in range(len(self.announced) + 1, announced + 1):  # slots up to the count are filled
            assert self.store is not None
            self.announced.append(_parse_announcement(self.store.get(f"join/{i}").decode()))
        due = sorted({w for w, first in self.announced if first <= step} - self.admitted - set(members))
        self.admitted.update(due)
        return due


def admission(store: dist.Store, worker: int, first_step: int) -> tuple[int, list[int]]:
    """Announce ``worker`` and wait for the generation that takes it in; its number and members.

    Each wait is bounded; the whole is bounded by the run: the launcher sets ``end``
    when it finishes, and its store vanishes with it.
    """
    announce(store, worker, first_step)
    key = f"admitted/{worker}"
    while not store.check([key]):
        if store.check(["end"]):
            raise Stopped("the run ended before this worker was admitted")
        try:
            store.wait([key], datetime.timedelta(seconds=1))
        except Exception as exc:  # the wait timed out: look again (a vanished store fails the check)
            log.debug("worker %d: waiting to be admitted: %s", worker, exc)
    value = store.get(key).decode()
    if value == ENDED:
        raise Stopped("the run ended before this worker was admitted")
    if not value:
        raise Stopped("not admitted: the launcher dropped this worker")
    gen = int(value)
    members = member_ids(store.get(f"members/{gen}").decode())
    log.info("worker %d: admitted to generation %d with workers %s", worker, gen, members)
    return gen, members


def turn_away(store: dist.Store) -> None:
    """Tell every joiner announced but not admitted that the run has ended: one waiting in
    :func:`admission` wakes at once and reads that, rather than finding the store gone."""
    for i in range(1, int(store.add(JOINS_KEY, 0)) + 1):
        worker, _ = _parse_announcement(store.get(f"join/{i}").decode())
        if not store.check([f"admitted/{worker}"]):
            store.set(f"admitted/{worker}", ENDED)


def next_members(store: dist.Store, gen: int, worker: int, step: int, timeout: float) -> list[int]:
    """Report the failure of generation ``gen`` and wait (bounded) for the launcher's next members."""
    store.set(f"report/{gen}/{worker}", str(step))
    key = f"members/{gen + 1}"
    try:
        store.wait([key], datetime.timedelta(seconds=2 * timeout + 10))
    except Exception as exc:
        raise Stopped(f"no new generation after {2 * timeout + 10:.0f} s: {exc}") from exc
    members = member_ids(store.get(key).decode())
    if worker not in members:
        raise Stopped("the run stopped: too few workers left" if not members else "excluded from the run")
    return members


def member_ids(value: str) -> list[int]:
    """Worker ids from their comma-separated form in the store."""
    return [int(v) for v in value.split(",")] if value else []


def announce(store: dist.Store, worker: int, first_step: int) -> int:
    """Claim the next free slot ``join/<i>`` for ``worker`` (atomically: compare-and-set on a
    missing key), then count it; the slot's number.

    Slots are claimed in order from the count + 1, so whoever reads a count c finds
    join/1 .. join/c filled, however many joiners announce at once.
    """
    record = f"{worker},{first_step}"
    slot = int(store.add(JOINS_KEY, 0)) + 1
    while slot <= MAX_JOIN_SLOTS:
        if store.compare_set(f"join/{slot}", "", record).decode() == record:
            store.add(JOINS_KEY, 1)
            log.info("worker %d: announced in slot %d (from step %d)", worker, slot, first_step)
            return slot
        slot += 1
    raise DataParallelError(f"no free join slot among the first {MAX_JOIN_SLOTS}")


def _parse_announcement(value: str) -> tuple[int, int]:
    worker, first_step = value.split(",")
    return int(worker), int(first_step)


def await_announcements(store: dist.Store, count: int, procs: Mapping[int, Any], timeout: float) -> None:
    """Wait (bounded) until ``count`` joiners have announced themselves."""
    deadline = time.monotonic() + timeout
    while int(store.add(JOINS_KEY, 0)) < count:
        if time.monotonic() > deadline or not all(p.is_alive() for p in procs.values()):
            log.warning("the joining workers did not all announce themselves: they join when they do")
            return
        time.sleep(0.01)


def supervise(
    store: dist.Store,
    procs: dict[int, Any],
    members: list[int],
    timeout: float,
    min_workers: int,
    tail: MetricsTail,
    records: list[Record],
    on_record: Callable[[Record], None] | None,
) -> str | None:
    """Follow the workers until all have exited; name each new generation after a failure
    or when the members ask to admit joiners (``grow/<gen>``).

    ``procs`` are the processes this launcher started; a member without one joined by
    hand (:func:`~fedweave.data_parallel.launch.join`): it counts as alive until it fails to report. Returns None when
    the run finished, else why it stopped.
    """
    gen = 0
    poll = 0.05

    def alive(w: int) -> bool:
        return w not in procs or procs[w].is_alive()

    while True:
        for record in tail.read():
            records.append(record)
            if on_record is not None:
                on_record(record)
        codes = {w: procs[w].exitcode for w in members if w in procs}
        if not codes:
            store.set(f"members/{gen + 1}", "")
            return f"data-parallel run stopped at generation {gen}: no worker started by this launcher is left"
        if all(c is not None for c in codes.values()) and any(c == 0 for c in codes.values()):
            failed = {w: c for w, c in codes.items() if c != 0}
            if failed:
                log.warning("workers %s exited with %s after the others finished the run", list(failed), failed)
            return None
        dead = [w for w, c in codes.items() if c is not None and c != 0]
        reported = [w for w in members if store.check([f"report/{gen}/{w}"])]
        if not dead and not reported:
            time.sleep(poll)
            continue
        # A failure or a join in generation ``gen``: wait (bounded) for every live member to report.
        deadline = time.monotonic() + timeout + 5.0
        while time.monotonic() < deadline:
            if all(store.check([f"report/{gen}/{w}"]) for w in members if alive(w)):
                break
            time.sleep(poll)
        survivors = [w for w in members if alive(w) and store.check([f"report/{gen}/{w}"])]
        for w in members:
            if alive(w) and w not in survivors:
                log.warning("worker %d did not report within %.0f s after a failure: dropped", w, timeout + 5)
                if w in procs:
                    procs[w].kill()
        lost = [w for w in members if w not in survivors]
        codes_lost = {w: procs[w].exitcode if w in procs else None for w in lost}
        grow = member_ids(store.get(f"grow/{gen}").decode()) if store.check([f"grow/{gen}"]) else []
        joiners = [w for w in grow if alive(w)]  # one that died while waiting is not admitted
        if len(survivors) + len(joiners) < min_workers:
            store.set(f"members/{gen + 1}", "")
            for w in grow:
                store.set(f"admitted/{w}", "")
            return (
                f"data-parallel run stopped at generation {gen}: workers {lost} lost "
                f"(exit codes {codes_lost}), {len(survivors)} left, min_workers is {min_workers}"
            )
        if lost:
            log.warning("workers %s lost (exit codes %s); continuing with %s", lost, codes_lost, survivors)
        if grow:
            log.info("workers %s join (%s admitted)", grow, joiners)
        members = sorted(survivors + joiners)
        gen += 1
        store.set(f"members/{gen}", ",".join(map(str, members)))
        for w in grow:  # after the members: a joiner reads them once admitted
            store.set(f"admitted/{w}", str(gen) if w in joiners else "")
