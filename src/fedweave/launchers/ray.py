"""The Ray launcher: the server in this process (the driver), clients trained by a pool of Ray actors.

``launcher: ray`` (extra ``ray``) joins the Ray cluster at ``ray.address``, or starts a local one
that listens on 127.0.0.1 only (:data:`LOOPBACK_ENV`), and starts ``ray.actors`` actors, each reserving ``ray.num_cpus`` CPUs and ``ray.num_gpus`` GPUs.
Each actor builds the task once (the dataset and its partition, from the same config and seed,
as every fedweave process does) and then serves any client: a client's local work is one task on
whichever actor is free, so 10,000 clients need no 10,000 actors.

Everything else of a client stays in the driver, in the one
:class:`~fedweave.federated.client.ClientRuntime` the in-process launcher uses: its chains (the plugins'
client halves and their state), its plugin secrets, its committed and pending state. Per message
the driver runs :meth:`~fedweave.federated.client.ClientRuntime.open` (client_receive chain, state
settled), an actor runs :meth:`~fedweave.federated.client.ClientRuntime.work` (local training or
evaluation, seeded per round and client as in process), and the driver runs
:meth:`~fedweave.federated.client.ClientRuntime.close` (state kept pending, client_send chain) on the
replies in the order of the messages. A run therefore gives the same metrics as with
``launcher: local``; only its local work runs elsewhere and in parallel.

**Messages.** The instruction goes to an actor and the update or evaluation comes back in
fedweave's own wire format (:mod:`fedweave.transports.serialization`), decoded with its checks
(names, shapes, dtypes, sizes) and then checked to answer the client, round and kind sent. The
client's state travels beside it as a Ray object, which Ray pickles between the driver and its
own actors: the Ray cluster is a trusted boundary, like the gloo links of a site, and must be
reachable by no one else (a private network; see docs/deployment.md). A plugin that takes over
local training (DP-SGD) does so on the actor, from the actor's own chains, as in any client process.

**Failures.** An actor that dies (its process killed, its node lost) fails only the work it was
doing: that client counts as dropped for the round, like a timeout, and a new actor takes its
place in the pool. With ``round_timeout``, work not done by the deadline is dropped and the actors
still busy with it are replaced, so no straggler holds the next round.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from fedweave import config as config_mod
from fedweave.federated.client import ClientRuntime, Opened
from fedweave.config import Config, RayConfig
from fedweave.errors import FedweaveError, SerializationError
from fedweave.transports.base import Exchange
from fedweave.transports.inmemory import failed
from fedweave.transports.serialization import decode, encode
from fedweave.types import Evaluation, Instruction, Message, TaskKind, Update, body_nbytes, messages_nbytes

log = logging.getLogger(__name__)


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0 before Ray is imported (it reads it once), Ray's node address is 127.0.0.1, where its servers
(GCS, raylet, workers) listen, instead of the host's outward address on every interface: a local cluster
that no other machine can reach. Set by :func:`launch_ray` when no ``ray.address`` is given."""


def import_ray() -> Any:
    """The ``ray`` module, or an error that names the extra to install."""
    try:
        import ray
    except ImportError:
        raise FedweaveError("launcher 'ray' needs Ray: pip install 'fedweave[ray]'") from None
    return ray


class ClientWorker:
    """One actor of the pool: the task built once, the local work of any client on request."""

    def __init__(self, config_text: str):
        from fedweave.build import build_chains, build_client_runtime, build_task
        from fedweave.federated.client import ClientStateStore

        config = config_mod.from_dict(config_mod.parse_yaml(config_text))
        self.runtime = build_client_runtime(config, build_task(config), build_chains(config), ClientStateStore())

    def ready(self) -> tuple[int, str]:
        """This actor's process id and host, once its task is built."""
        return os.getpid(), os.uname().nodename

    def work(self, message: bytes, state: dict[str, Any]) -> tuple[bytes | None, dict[str, Any], str]:
        """Client work on one encoded instruction: the encoded answer and the client's new state,
        or None and why it failed."""
        try:
            msg = decode(message)
            instruction = msg.body
            if not isinstance(instruction, Instruction):
                raise SerializationError(f"expected an instruction, got a {type(instruction).__name__}")
            body, state = self.runtime.work(msg.client_id, instruction, state)
            return bytes(encode(Message(msg.round, msg.client_id, body))), state, ""
        except Exception as exc:  # one client's failure must not stop the actor
            log.warning("client work failed on a Ray actor: %s", exc, exc_info=True)
            return None, {}, f"{type(exc).__name__}: {exc}"


@dataclass
class _Slot:
    """One place in the pool: its actor, and its (pid, host) once started."""

    actor: Any
    ready: Any  # the object ref of actor.ready()
    where: tuple[int, str] | None = None


class ActorPool:
    """``size`` :class:`ClientWorker` actors; a dead or stuck one is replaced by a fresh one."""

    def __init__(self, ray: Any, config: Config, size: int):
        settings = config.ray
        self.ray = ray
        self.config_text = config_mod.to_yaml(config)
        self.actor_class = ray.remote(
            num_cpus=settings.num_cpus, num_gpus=settings.num_gpus, max_restarts=0, max_task_retries=0
        )(ClientWorker)
        self.slots = [self._start() for _ in range(size)]
        self.replaced = 0
        try:
            self._wait_ready(settings)
        except BaseException:
            self.close()
            raise
        log.info("%d Ray actors ready: %s", size, ", ".join(f"pid {p} on {h}" for p, h in self.where_all()))

    def _wait_ready(self, settings: RayConfig) -> None:
        refs = [s.ready for s in self.slots]
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=settings.start_timeout)
        if len(done) < len(refs):
            raise FedweaveError(
                f"{len(refs) - len(done)} of {len(refs)} Ray actors did not start within ray.start_timeout="
                f"{settings.start_timeout} s (each needs {settings.num_cpus} CPUs and {settings.num_gpus} GPUs; "
                f"the cluster has {self.ray.cluster_resources()})"
            )
        try:
            for slot in self.slots:
                slot.where = tuple(self.ray.get(slot.ready))
        except self.ray.exceptions.RayError as exc:
            raise FedweaveError(f"a Ray actor failed to build the task: {exc}") from None

    def _start(self) -> _Slot:
        actor = self.actor_class.options(scheduling_strategy="SPREAD").remote(self.config_text)
        return _Slot(actor, actor.ready.remote())

    def where(self, i: int) -> tuple[int, str] | None:
        """Slot ``i``'s (pid, host), once its actor is ready."""
        slot = self.slots[i]
        if slot.where is None and self.ray.wait([slot.ready], timeout=0)[0]:
            try:
                slot.where = tuple(self.ray.get(slot.ready))
            except self.ray.exceptions.RayError:
                return None
        return slot.where

    def where_all(self) -> list[tuple[int, str]]:
        return [w for w in (self.where(i) for i in range(len(self.slots))) if w is not None]

    def replace(self, i: int, why: str) -> None:
        """Put a fresh actor in slot ``i`` (the old one is killed if it still runs)."""
        where = self.where(i)
        place = "not started" if where is None else f"pid {where[0]} on {where[1]}"
        log.warning("Ray actor %d (%s) %s; starting a replacement", i, place, why)
        self.ray.kill(self.slots[i].actor, no_restart=True)
        self.slots[i] = self._start()
        self.replaced += 1

    def close(self) -> None:
        for slot in self.slots:
            self.ray.kill(slot.actor, no_restart=True)
        self.slots = []


class RayTransport:
    """Sends each client's local work to a free actor of ``pool``; the rest runs in ``runtime``."""

    def __init__(self, ray: Any, runtime: ClientRuntime, pool: ActorPool, owns_ray: bool):
        self.ray = ray
        self.runtime = runtime
        self.pool = pool
        self.owns_ray = owns_ray

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        result = Exchange()
        deadline = None if timeout is None else time.monotonic() + timeout
        opened: dict[int, Opened] = {}
        answers: dict[int, Message] = {}
        result.bytes_sent += messages_nbytes(messages)
        for i, msg in enumerate(messages):
            try:
                step = self.runtime.open(msg)
            except Exception as exc:  # one client's failure must not stop the round
                self._fail(result, msg, exc)
                continue
            if isinstance(step, Message):  # a control step of a plugin, answered here
                answers[i] = step
                self.runtime.release(msg.client_id)
            else:
                opened[i] = step
        done = self._run(opened, deadline, result)
        for i, msg in enumerate(messages):  # in message order, as the in-process transport answers
            if i in done:
                try:
                    answers[i] = self.runtime.close(opened[i], *done[i])
                except Exception as exc:
                    self._fail(result, msg, exc)
                    continue
                self.runtime.release(msg.client_id)
            if i in answers:
                result.bytes_received += body_nbytes(answers[i].body)
                result.replies.append(answers[i])
        return result

    def _run(
        self, opened: dict[int, Opened], deadline: float | None, result: Exchange
    ) -> dict[int, tuple[Update | Evaluation, dict[str, Any]]]:
        """Each opened instruction's work on a free actor; the answers (body, state) by message index."""
        queue = deque(opened)
        free = deque(range(len(self.pool.slots)))
        running: dict[Any, tuple[int, int]] = {}  # object ref -> (message index, slot)
        done: dict[int, tuple[Update | Evaluation, dict[str, Any]]] = {}
        while (queue or running) and not _passed(deadline):
            while queue and free:
                i, slot = queue.popleft(), free.popleft()
                running[self._submit(opened[i], slot)] = (i, slot)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = self.ray.wait(list(running), num_returns=1, timeout=left)
            if not ready:  # the round's deadline passed
                break
            i, slot = running.pop(ready[0])
            free.append(slot)
            answer = self._answer(ready[0], opened[i], slot)
            if isinstance(answer, str):
                self._drop(result, opened[i], answer)
            elif _passed(deadline):  # seen after the deadline: late, as the in-process transport counts it
                self._drop(result, opened[i], "missed the round deadline")
            else:
                done[i] = answer
        for i, slot in running.values():
            self._drop(result, opened[i], "missed the round deadline")
            self.pool.replace(slot, f"was still busy with client {opened[i].client_id} at the round's deadline")
        for i in queue:
            self._drop(result, opened[i], "missed the round deadline")
        return done

    def _submit(self, o: Opened, slot: int) -> Any:
        message = bytes(encode(Message(o.round, o.client_id, o.instruction)))
        ref = self.pool.slots[slot].actor.work.remote(message, self.runtime.store.get(o.client_id))
        pid, host = self.pool.where(slot) or (None, None)
        log.debug(
            "round %d: client %d sent to Ray actor %d (pid %s on %s)", o.round, o.client_id, slot, pid, host,
            extra={"ray_actor_pid": pid, "client_id": o.client_id, "round": o.round},
        )
        return ref

    def _answer(self, ref: Any, o: Opened, slot: int) -> tuple[Update | Evaluation, dict[str, Any]] | str:
        """The checked answer of one job, or why there is none (a dead actor is replaced)."""
        try:
            data, state, why = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            self.pool.replace(slot, f"died while client {o.client_id} worked on it ({type(exc).__name__})")
            return f"its Ray actor died: {type(exc).__name__}"
        if data is None:
            return why
        instruction = o.instruction
        training = instruction.task is TaskKind.TRAIN
        expected = {k: tuple(v.shape) for k, v in instruction.params.items()} if training else None
        try:
            reply = decode(data, expected=expected)
            wanted = Update if training else Evaluation
            if (reply.client_id, reply.round) != (o.client_id, o.round) or not isinstance(reply.body, wanted):
                raise SerializationError(
                    f"the answer is a {type(reply.body).__name__} of client {reply.client_id} round {reply.round}, "
                    f"expected a {wanted.__name__} of client {o.client_id} round {o.round}"
                )
        except SerializationError as exc:
            return f"rejected: {type(exc).__name__}: {exc}"
        return reply.body, state if isinstance(state, dict) else {}

    def _fail(self, result: Exchange, msg: Message, exc: Exception) -> None:
        failed(result, msg.client_id, msg.round, exc)
        self.runtime.release(msg.client_id)

    def _drop(self, result: Exchange, o: Opened, why: str) -> None:
        log.warning("client %d dropped in round %d: %s", o.client_id, o.round, why)
        result.failures[o.client_id] = why
        self.runtime.release(o.client_id)

    def close(self) -> None:
        """Stop the actors; leave a Ray this launcher started (or joined) for the next."""
        self.pool.close()
        if self.owns_ray:
            self.ray.shutdown()


def _passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _reachable(address: str, timeout: float = 10.0) -> None:
    """Fail at once, with one line, when nothing listens at ``host:port`` (Ray itself would retry for minutes)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise FedweaveError(f"config key 'ray.address': expected host:port or auto, got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise FedweaveError(f"cannot reach the Ray cluster at ray.address={address!r}: {exc}") from None


def pool_size(ray: Any, config: Config) -> int:
    """``ray.actors``, or as many actors as the cluster's CPUs (and GPUs) hold, at most one per client."""
    s: RayConfig = config.ray
    if s.actors is not None:
        return s.actors
    resources = ray.cluster_resources()
    fits = resources.get("CPU", 0.0) / s.num_cpus
    if s.num_gpus:
        fits = min(fits, resources.get("GPU", 0.0) / s.num_gpus)
    return max(1, min(config.clients, int(fits)))


def launch_ray(config: Config, runtime: ClientRuntime) -> RayTransport:
    """Join (or start) the Ray cluster and start the actor pool that serves ``runtime``'s clients."""
    ray, owns = join_ray(config)
    try:
        pool = ActorPool(ray, config, pool_size(ray, config))
    except BaseException:
        if owns:
            ray.shutdown()
        raise
    return RayTransport(ray, runtime, pool, owns)


def join_ray(config: Config) -> tuple[Any, bool]:
    """The ``ray`` module joined to the cluster at ``ray.address``, or to a new local one (on the loopback
    interface), unless this process has joined one already; and whether it started that cluster."""
    if config.ray.address is None:  # a new local cluster: on the loopback interface (inherited by its processes)
        os.environ.setdefault(LOOPBACK_ENV, "0")
    ray = import_ray()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # fedweave never reports usage anywhere
    owns = not ray.is_initialized()
    if owns:
        address = config.ray.address
        started = time.perf_counter()
        if address not in (None, "auto"):
            _reachable(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise FedweaveError(f"cannot join the Ray cluster at ray.address={address!r}: {exc}") from None
        log.info("joined Ray at %s in %.1f s", address or "a new local cluster", time.perf_counter() - started)
    return ray, owns
