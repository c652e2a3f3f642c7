"""What a client does with a message: decode, train or evaluate, encode, reply.

:class:`ClientRuntime` serves any number of clients with one model instance: for
each message it loads the received parameters into that model, restores the
client's own state from a :class:`ClientStateStore`, runs the strategy's client
half and keeps the new state. Memory therefore grows with the clients that keep
state, never with one model per client.

The new state is kept in two phases, so that a client's state never runs ahead of the
server's view of it (SCAFFOLD's c_i against the server's c, FedDyn's gradient term
against h): after training it is *pending* for that round, and the client goes on
training from its *committed* state. Every instruction carries, under
:data:`~fedweave.types.ACCEPTED_ROUND`, the last round whose update of this client the
server applied. On receipt the client commits its pending state when that is its
round; a training instruction otherwise drops it (the server trains a client only once
its previous update is settled: applied, rejected, late or dropped), an evaluation
keeps it (the update may still be waiting in an asynchronous buffer). A client whose
update the server rejected therefore continues exactly as if it had not trained that
round. An instruction without the key (a caller that does not track acceptance)
commits at once. At most one pending state is kept per client.

A :class:`~fedweave.types.Control` message is a step of a plugin's own protocol
(secure aggregation's key set-up and unmasking): the runtime hands it to that
plugin's client half with the client's private plugin state, which it keeps per
client id in this process (never checkpointed, never sent: keys and shares).

What an instruction's ``config`` may hold is checked before any work: the keys that change
local training (:data:`fedweave.training.INSTRUCTED`, each checked as the ``local`` key of
that name), :data:`~fedweave.types.ACCEPTED_ROUND`, keys ``<plugin>.<name>`` of this client's
plugins (which those plugins read), and the keys the strategy's client half declares it reads
(:class:`~fedweave.strategies.base.ReadsInstruction`). Any other key is refused, the work not
done, with one line naming it. Likewise the metrics a client's training returns: ``train_loss``
and those the client half declares (:class:`~fedweave.strategies.base.ReportsTraining`) are
sent, and recorded by the server; another is refused with one logged line naming it, once.

The runtime computes on ``local.device``: its model lives there, and each job's data, received
parameters, extras and state are moved there; the update, its extras and the new state come
back on the CPU, so nothing of one client stays on the device while the next one trains.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn

from fedweave.device import CPU, moved
from fedweave.errors import ConfigError
from fedweave.plugins.attacks.poison import Attacker
from fedweave.plugins.chain import Chains
from fedweave.plugins.contracts import POINTS, PluginContext
from fedweave.seeding import derive_seed, torch_generator, torch_generators
from fedweave.strategies.base import ClientAlgorithm, ReadsInstruction, training_metrics
from fedweave.training import INSTRUCTED, SGD_LOOP, ClientJob, LocalSettings, LossFn, instructed, rows
from fedweave.types import ACCEPTED_ROUND, Control, Evaluation, Instruction, Message, Params, TaskKind, Update, Work
from fedweave.federated.checks import specs_of

log = logging.getLogger(__name__)


@dataclass
class ClientData:
    """The training tensors and each client's index arrays into them.

    A client's local test rows are gathered once and kept (at most ``task.local_test_fraction``
    of the partitioned rows in all, e.g. 2.5 MB for mnist5k): every training job hands them to
    its strategy, which rarely reads them, and gathering them anew cost ~30 µs a job. A job
    that edits them in place gets them gathered anew the next time (their version counter moved).
    """

    x: torch.Tensor
    y: torch.Tensor
    train_idx: list[torch.Tensor]
    test_idx: list[torch.Tensor]
    _tests: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # the last splits' training rows: (client ids, their index tensors, their rows, versions)
    _trains: tuple[tuple[int, ...], list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]], tuple[int, ...]] | None = (
        field(default=None, init=False, repr=False, compare=False)
    )

    def __len__(self) -> int:
        return len(self.train_idx)

    def train_size(self, client_id: int) -> int:
        return self.train_idx[client_id].shape[0]  # not len(): Tensor.__len__ is Python, ~1.5 µs (every update's limit)

    def split(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x_train, y_train, x_test, y_test`` of one client."""
        train = self.train_idx[client_id]
        return rows(self.x, train), rows(self.y, train), *self._test_rows(client_id)

    def splits(self, client_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """:meth:`split` of each of ``client_ids``, their training rows gathered in one pass (each
        client's are rows of one tensor of all of theirs) and kept for the same clients' next call
        (a round of a cohort that samples everyone asks for the same, ~10 µs a client to gather),
        until something edits the dataset, an index or the rows given out (a version counter moves;
        the rows given out are views of one tensor each, sharing its counter)."""
        index = [self.train_idx[c] for c in client_ids]
        ids = tuple(client_ids)
        kept = self._trains
        if (kept is None or kept[0] != ids or any(a is not b for a, b in zip(kept[1], index))
                or kept[3] != self._train_versions(index, kept[2])):
            if not all(i.dtype == torch.int64 and i.dim() == 1 and i.device == self.x.device for i in index):
                return [self.split(c) for c in client_ids]
            sizes = [i.shape[0] for i in index]
            together = torch.cat(index) if index else torch.zeros(0, dtype=torch.int64)
            trains = list(zip(rows(self.x, together).split(sizes), rows(self.y, together).split(sizes)))
            kept = self._trains = (ids, index, trains, self._train_versions(index, trains))
        return [(x, y, *self._test_rows(c)) for (x, y), c in zip(kept[2], client_ids)]

    def _train_versions(self, index: list[torch.Tensor], trains: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, ...]:
        """In-place edits so far of the dataset, of the clients' training indices and of their rows
        (one counter for all clients' rows of each tensor: views share their base's)."""
        shared = (trains[0][0]._version, trains[0][1]._version) if trains else ()
        return self.x._version, self.y._version, *shared, *(i._version for i in index)

    def _test_rows(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        test = self.test_idx[client_id]
        kept = self._tests.get(client_id)
        if kept is not None and kept[0] is test and kept[3] == self._versions(test, kept[1], kept[2]):
            return kept[1], kept[2]
        x, y = rows(self.x, test), rows(self.y, test)
        self._tests[client_id] = (test, x, y, self._versions(test, x, y))
        return x, y

    def _versions(self, test: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        """In-place edits so far of the dataset, of a client's test indices and of its gathered rows."""
        return self.x._version, self.y._version, test._version, x._version, y._version


class ClientSplits(Protocol):
    """Where a client runtime finds each client's data: :class:`ClientData` (index arrays
    into one dataset) or :class:`fedweave.task.generated.GeneratedClients` (made on demand)."""

    def __len__(self) -> int: ...

    def train_size(self, client_id: int) -> int: ...

    def split(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...


class ClientStateStore:
    """Per-client state kept between rounds: the committed state a client trains from,
    and at most one pending state per client, trained in a round whose update the
    server has not yet confirmed (see the module doc).

    Only clients that have state take memory; tensors are stored as compact,
    contiguous detached copies so a client's later edits never alias the store.
    """

    def __init__(self) -> None:
        self._states: dict[int, dict[str, Any]] = {}
        self._pending: dict[int, tuple[int, dict[str, Any]]] = {}  # client id -> (round, state)
        self._committed_round: dict[int, int] = {}  # client id -> the round of its committed state, in this process

    def get(self, client_id: int) -> dict[str, Any]:
        """A copy of the client's committed state."""
        return {k: _copy(v) for k, v in self._states.get(client_id, {}).items()}

    def put(self, client_id: int, state: dict[str, Any]) -> None:
        """Commit ``state`` (empty: the client keeps none)."""
        if state:
            self._states[client_id] = {k: _copy(v) for k, v in state.items()}
        else:
            self._states.pop(client_id, None)

    def stage(self, client_id: int, rnd: int, state: dict[str, Any]) -> None:
        """Keep ``state``, trained in round ``rnd``, pending until the server settles that round."""
        if state or client_id in self._states:
            self._pending[client_id] = (rnd, {k: _copy(v) for k, v in state.items()})
        else:
            self._pending.pop(client_id, None)

    def settle(self, client_id: int, accepted_round: int | None, training: bool) -> None:
        """Commit the pending state if its round is ``accepted_round`` (None: commit in any case);
        otherwise drop it before ``training``, or keep it waiting."""
        committed = self._committed_round.get(client_id, 0)
        if accepted_round is not None and accepted_round < committed:
            log.warning(
                "client %d: its state is of round %d, but the server applied its updates only up to round %d "
                "(a server restarted from a checkpoint older than its last round: checkpoint.every > 1 or "
                "checkpoint.min_interval > 0); the run goes on with "
                "the newer state, so it is not the same as an uninterrupted run", client_id, committed, accepted_round,
            )
            self._committed_round[client_id] = accepted_round  # warned once
        if client_id not in self._pending:
            return
        rnd, state = self._pending[client_id]
        if accepted_round is None or rnd == accepted_round:
            del self._pending[client_id]
            self.put(client_id, state)
            self._committed_round[client_id] = rnd
        elif training:
            del self._pending[client_id]
            log.info("client %d: the server did not apply its round %d update; that round's state is dropped",
                     client_id, rnd)

    def __len__(self) -> int:
        return len(self._states.keys() | self._pending.keys())

    def state_dict(self) -> dict[int, dict[str, Any]]:
        """The committed states, by client id."""
        return self._states

    def load_state_dict(self, state: dict[int, dict[str, Any]]) -> None:
        self._states = {int(k): dict(v) for k, v in state.items()}

    def pending_state_dict(self) -> dict[int, tuple[int, dict[str, Any]]]:
        """The pending states, by client id: (round, state)."""
        return self._pending

    def load_pending_state_dict(self, pending: dict[int, tuple[int, dict[str, Any]]]) -> None:
        self._pending = {int(k): (int(rnd), dict(state)) for k, (rnd, state) in pending.items()}


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone(memory_format=torch.contiguous_format)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


@dataclass
class Opened:
    """An instruction the client side has received (see :meth:`ClientRuntime.open`)."""

    round: int
    client_id: int
    instruction: Instruction
    ctx: PluginContext | None  # None: this client has no plugin, no context was made


class ClientRuntime:
    """Handles train and evaluate messages for every client of this process."""

    def __init__(
        self,
        algorithm: ClientAlgorithm,
        data: ClientSplits,
        model: nn.Module,
        loss_fn: LossFn,
        settings: LocalSettings,
        chains: Chains,
        store: ClientStateStore,
        seed: int,
        attacker: Attacker | None = None,
        device: torch.device = CPU,
    ):
        self.algorithm = algorithm
        self.attacker = attacker  # simulated attacking clients (config ``attacks``), for experiments
        self.data = data
        self.device = device
        self.model = model.to(device)
        self._parameters = list(self.model.parameters())  # listed once: model.parameters() costs ~25 µs a call
        self.loss_fn = loss_fn
        self.settings = settings
        self.chains = chains
        self.store = store
        self.seed = seed
        # What a broadcast may decode to: this client's model, whose entries never change shape or
        # dtype (load_state_dict copies into them); read once, not per message (~40 µs each).
        self._expected = specs_of(model.state_dict())
        self.plugin_state: dict[int, dict[str, Any]] = {}  # client id -> its plugins' private state
        self._own_keys = {ACCEPTED_ROUND, *INSTRUCTED}
        if isinstance(algorithm, ReadsInstruction):
            self._own_keys.update(algorithm.instruction_keys)
        self._plugins = {p.name for point in POINTS for p in getattr(chains, point).plugins}
        self._plain = not self._plugins  # no plugin at any point: nothing to decode or encode, no context to make
        self._metrics = training_metrics(algorithm)
        self._refused: set[str] = set()  # metric names refused so far (each logged once)

    def handle(self, msg: Message) -> Message:
        try:
            opened = self.open(msg)
            if isinstance(opened, Message):
                return opened
            body, state = self.work(msg.client_id, opened.instruction, self.store.get(msg.client_id))
            return self.close(opened, body, state)
        finally:
            self.release(msg.client_id)

    def open(self, msg: Message) -> Message | Opened:
        """The first half of handling ``msg``: a control step's answer, or the instruction as the
        client_receive chain decodes it, the client's pending state settled. A launcher that runs
        :meth:`work` elsewhere (Ray actors) calls :meth:`open`, :meth:`close`, :meth:`release` here."""
        cid = msg.client_id
        if not isinstance(msg.body, (Instruction, Control)):
            raise TypeError(f"client {cid} expected an instruction, got {type(msg.body).__name__}")
        if not 0 <= cid < len(self.data):
            raise ValueError(f"client id {cid} is outside 0..{len(self.data) - 1}")
        ctx = None
        if self._plain and isinstance(msg.body, Instruction) and not msg.body.applied:
            instruction = msg.body  # what to_client gives back without a plugin (~4 us a client less)
        else:  # an instruction that names plugins is decoded by the chain, which refuses those it lacks
            state = self.plugin_state.setdefault(cid, {})
            ctx = PluginContext(round=msg.round, client_id=cid, side="client", state=state, expected=self._expected)
            if isinstance(msg.body, Control):
                return Message(msg.round, cid, self.chains.answer(msg.body, ctx))
            instruction = self.chains.to_client(msg.body, ctx)
        accepted = instruction.config.get(ACCEPTED_ROUND)
        if accepted is not None and (not isinstance(accepted, int) or isinstance(accepted, bool) or accepted < 0):
            raise ValueError(f"client {cid}: instruction config {ACCEPTED_ROUND!r} is {accepted!r}, not a round >= 0")
        self.store.settle(cid, accepted, training=instruction.task is TaskKind.TRAIN)
        return Opened(msg.round, cid, instruction, ctx)

    def work(
        self, cid: int, instruction: Instruction, state: dict[str, Any]
    ) -> tuple[Update | Evaluation, dict[str, Any]]:
        """Client ``cid``'s local work on ``instruction`` from its committed ``state``: the update
        (before the client_send chain) or evaluation, and the client's new state, on the CPU."""
        job = self.job(cid, instruction, state)
        if instruction.task is TaskKind.EVALUATE:
            return dataclasses.replace(self.algorithm.evaluate(job), client_id=cid), moved(job.state, CPU)
        start = time.perf_counter()
        update = self.algorithm.train(job)
        return self.trained(job, instruction, update, time.perf_counter() - start)

    def trained(
        self, job: ClientJob, instruction: Instruction, update: Update, compute_time: float
    ) -> tuple[Update, dict[str, Any]]:
        """What leaves the client of ``job``'s training (``update``, from ``instruction`` as received,
        in ``compute_time`` seconds): the update on the CPU with the metrics it may send, as an
        attacking client changes it, and the client's new state on the CPU."""
        cid = job.client_id
        away = self.device != CPU  # on the CPU, what training made is there already
        update = Update(  # every field (built, not dataclasses.replace: ~4x faster, a cohort makes 100 a round)
            kind=update.kind,
            tensors=moved(update.tensors, CPU) if away else update.tensors,
            num_examples=update.num_examples,
            metrics={**self._sent_metrics(cid, update.metrics), **job.training.report()},
            extras=moved(update.extras, CPU) if away else update.extras,
            applied=update.applied,
            client_id=cid,
            local_steps=update.local_steps,
            compute_time=compute_time,
            clients=update.clients,
            members=update.members,
        )
        for p in self._parameters:  # the device keeps nothing of this client but the model's values
            p.grad = None
        if self.attacker is not None:  # after training, before any plugin: what a poisoning client sends
            update = self.attacker.update(update, instruction.params, instruction.round, cid)
        return update, moved(job.state, CPU) if away else job.state

    def close(self, opened: Opened, body: Update | Evaluation, state: dict[str, Any]) -> Message:
        """The second half: keep a trained state pending, encode the update, the reply."""
        instruction = opened.instruction
        if instruction.task is TaskKind.TRAIN:
            self.store.stage(opened.client_id, instruction.round, state)
            if self.chains.client_send.plugins:  # none: nothing to encode, no context to build (~15 µs)
                ctx = cast(PluginContext, opened.ctx)  # made: this client has plugins
                body = self.chains.client_send.encode(cast(Update, body), dataclasses.replace(ctx, config=instruction.config))
        return Message(opened.round, opened.client_id, body)

    def release(self, cid: int) -> None:
        """Forget the client's plugin state once it holds nothing."""
        if not self.plugin_state.get(cid, True):
            del self.plugin_state[cid]

    def job(self, cid: int, instruction: Instruction, state: dict[str, Any]) -> ClientJob:
        """Client ``cid``'s job for ``instruction`` from its committed ``state``, on this runtime's
        device, the model holding the received parameters."""
        settings, work = self._instructed(cid, instruction)
        self.model.load_state_dict(instruction.params)
        # Dropout and other in-model randomness draw from torch's global generator.
        torch.default_generator.manual_seed(derive_seed(self.seed, "client-torch", instruction.round, cid))
        generator = torch_generator(self.seed, "client", instruction.round, cid)
        return self._job(cid, instruction, state, settings, work, self.data.split(cid), generator, {})

    def cohort_jobs(self, batch: list[tuple[int, Instruction, dict[str, Any]]]) -> list[ClientJob | Exception]:
        """The jobs of ``batch`` (each client id, instruction as received, committed state), each as
        :meth:`job` makes it, or the exception that refused it, for a vectorised cohort
        (:mod:`fedweave.cohort`): the model is not loaded (the cohort trains stacked copies of the
        received parameters) and torch's global generator not seeded (a cohort's model draws nothing
        from it: :mod:`fedweave.cohort.eligibility`); the clients' generators are seeded together,
        their training rows gathered in one pass, and a broadcast shared by several of them moved
        to the device once (the cohort then stacks one copy of it, not one per client)."""
        out: list[ClientJob | Exception | None] = [None] * len(batch)
        ready: list[tuple[int, LocalSettings, Work]] = []  # index into batch, the round's settings and work
        for i, (cid, instruction, _) in enumerate(batch):
            try:
                ready.append((i, *self._instructed(cid, instruction)))
            except Exception as exc:  # one client's bad instruction must not stop the others
                out[i] = exc
        ids = [batch[i][0] for i, _, _ in ready]
        splits: list[Any] = [None] * len(ids)  # None: each client's own split, its failure its own
        if isinstance(self.data, ClientData):
            try:
                splits = list(self.data.splits(ids))
            except Exception:  # some client's rows cannot be gathered: each is split alone below
                pass
        by_round: dict[int, list[int]] = {}
        for i, _, _ in ready:
            by_round.setdefault(batch[i][1].round, []).append(i)
        generators = {
            i: g for rnd, items in by_round.items()
            for i, g in zip(items, torch_generators(self.seed, ("client", rnd), [batch[i][0] for i in items]))
        }
        shared: dict[int, Params] = {}
        for (i, settings, work), split in zip(ready, splits):
            cid, instruction, state = batch[i]
            try:
                split = self.data.split(cid) if split is None else split
                out[i] = self._job(cid, instruction, state, settings, work, split, generators[i], shared)
            except Exception as exc:
                out[i] = exc
        return cast(list[ClientJob | Exception], out)

    def _job(
        self, cid: int, instruction: Instruction, state: dict[str, Any], settings: LocalSettings, work: Work,
        split: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], generator: torch.Generator,
        shared: dict[int, Params],
    ) -> ClientJob:
        """The job of client ``cid`` from its parts, its tensors on this runtime's device (``shared``:
        the received tensors moved so far, by the identity of the mapping they came in)."""
        x_train, y_train, x_test, y_test = split
        if self.attacker is not None:
            y_train = self.attacker.labels(cid, y_train)
        training = None
        if instruction.task is TaskKind.TRAIN and self.chains.takes_training:
            training = self.chains.training(PluginContext(round=instruction.round, client_id=cid, side="client"))
        device = self.device
        return ClientJob(
            client_id=cid,
            instruction=Instruction(  # every field, as in trained
                round=instruction.round, task=instruction.task, work=work,
                params=self._moved(instruction.params, shared), config=instruction.config,
                extras=self._moved(instruction.extras, shared), applied=instruction.applied,
            ),
            model=self.model,
            x_train=x_train.to(device),
            y_train=y_train.to(device),
            x_test=x_test.to(device),
            y_test=y_test.to(device),
            loss_fn=self.loss_fn,
            settings=settings,
            generator=generator,
            state=moved(state, device),
            training=SGD_LOOP if training is None else training,
        )

    def _moved(self, tensors: Params, shared: dict[int, Params]) -> Params:
        """``tensors`` on this runtime's device, moved once for all jobs that received the same mapping."""
        if not tensors:  # none (most instructions' extras, each a mapping of its own): nothing to move or remember
            return {}
        known = shared.get(id(tensors))
        if known is None:
            known = shared[id(tensors)] = moved(tensors, self.device)
        return known

    def _instructed(self, cid: int, instruction: Instruction) -> tuple[LocalSettings, Work]:
        """The round's local settings and work, as the instruction's config changes them; a key
        that no part of this client reads is refused (see the module doc)."""
        config = instruction.config
        for key in config:
            plugin, dot, _ = key.partition(".")
            if key not in self._own_keys and not (dot and plugin in self._plugins):
                raise ValueError(
                    f"client {cid}: instruction config key {key!r} is unknown; an instruction may set "
                    f"{', '.join(INSTRUCTED)}, {ACCEPTED_ROUND}, the keys its strategy's client half reads "
                    f"(instruction_keys) and '<plugin>.<key>' of this client's plugins"
                )
        try:
            return instructed(self.settings, instruction.work, config)
        except ConfigError as exc:
            raise ValueError(f"client {cid}: instruction {exc}") from None

    def _sent_metrics(self, cid: int, metrics: dict[str, float]) -> dict[str, float]:
        """The training metrics sent with an update: none when the chains withhold them (privacy,
        a sealed model), else those the strategy declares; another is refused, logged once."""
        if self.chains.withholds_metrics:
            return {}
        for name in metrics.keys() - self._metrics - self._refused:
            self._refused.add(name)
            log.warning(
                "client %d: training metric %r is refused: its strategy's client half does not declare it "
                "(train_metrics; declared: %s), so no record would hold it", cid, name, ", ".join(sorted(self._metrics)),
            )
        return {k: v for k, v in metrics.items() if k in self._metrics}
