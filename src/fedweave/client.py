"""What a client does with a message: decode, train or evaluate, encode, reply.

:class:`ClientRuntime` serves any number of clients with one model instance: for
each message it loads the received parameters into that model, restores the
client's own state from a :class:`ClientStateStore`, runs the strategy's client
half and keeps the new state. Memory therefore grows with the clients that keep
state, never with one model per client.

A :class:`~fedweave.types.Control` message is a step of a plugin's own protocol
(secure aggregation's key set-up and unmasking): the runtime hands it to that
plugin's client half with the client's private plugin state, which it keeps per
client id in this process (never checkpointed, never sent: keys and shares).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedweave.plugins.chain import Chains, PluginContext
from fedweave.seeding import derive_seed, torch_generator
from fedweave.strategies.base import ClientAlgorithm
from fedweave.strategies.training import ClientJob, LocalSettings, LossFn
from fedweave.types import Control, Evaluation, Instruction, Message, TaskKind, Update


@dataclass
class ClientData:
    """The training tensors and each client's index arrays into them (no copies)."""

    x: torch.Tensor
    y: torch.Tensor
    train_idx: list[torch.Tensor]
    test_idx: list[torch.Tensor]

    def __len__(self) -> int:
        return len(self.train_idx)


class ClientStateStore:
    """Per-client state kept between rounds.

    Only clients that have state take memory; tensors are stored as compact,
    contiguous detached copies so a client's later edits never alias the store.
    """

    def __init__(self) -> None:
        self._states: dict[int, dict[str, Any]] = {}

    def get(self, client_id: int) -> dict[str, Any]:
        return {k: _copy(v) for k, v in self._states.get(client_id, {}).items()}

    def put(self, client_id: int, state: dict[str, Any]) -> None:
        if state:
            self._states[client_id] = {k: _copy(v) for k, v in state.items()}
        else:
            self._states.pop(client_id, None)

    def __len__(self) -> int:
        return len(self._states)

    def state_dict(self) -> dict[int, dict[str, Any]]:
        return self._states

    def load_state_dict(self, state: dict[int, dict[str, Any]]) -> None:
        self._states = {int(k): dict(v) for k, v in state.items()}


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone(memory_format=torch.contiguous_format)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


class ClientRuntime:
    """Handles train and evaluate messages for every client of this process."""

    def __init__(
        self,
        algorithm: ClientAlgorithm,
        data: ClientData,
        model: nn.Module,
        loss_fn: LossFn,
        settings: LocalSettings,
        chains: Chains,
        store: ClientStateStore,
        seed: int,
    ):
        self.algorithm = algorithm
        self.data = data
        self.model = model
        self.loss_fn = loss_fn
        self.settings = settings
        self.chains = chains
        self.store = store
        self.seed = seed
        self.plugin_state: dict[int, dict[str, Any]] = {}  # client id -> its plugins' private state

    def handle(self, msg: Message) -> Message:
        cid = msg.client_id
        if not isinstance(msg.body, (Instruction, Control)):
            raise TypeError(f"client {cid} expected an instruction, got {type(msg.body).__name__}")
        if not 0 <= cid < len(self.data):
            raise ValueError(f"client id {cid} is outside 0..{len(self.data) - 1}")
        state = self.plugin_state.setdefault(cid, {})
        ctx = PluginContext(round=msg.round, client_id=cid, side="client", state=state)
        try:
            if isinstance(msg.body, Control):
                return Message(msg.round, cid, self.chains.answer(msg.body, ctx))
            return Message(msg.round, cid, self._work(cid, self.chains.to_client(msg.body, ctx), ctx))
        finally:
            if not state:
                self.plugin_state.pop(cid, None)

    def _work(self, cid: int, instruction: Instruction, ctx: PluginContext) -> Update | Evaluation:
        job = self._job(cid, instruction)
        if instruction.task is TaskKind.EVALUATE:
            return dataclasses.replace(self.algorithm.evaluate(job), client_id=cid)
        start = time.perf_counter()
        update = self.algorithm.train(job)
        update = dataclasses.replace(update, client_id=cid, compute_time=time.perf_counter() - start)
        if job.settings.privacy is not None:  # DP-SGD reports what it spent, for the server's ledger
            update.metrics = {**update.metrics, **job.settings.privacy.report()}
        self.store.put(cid, job.state)
        return self.chains.client_send.encode(update, dataclasses.replace(ctx, config=instruction.config))

    def _job(self, cid: int, instruction: Instruction) -> ClientJob:
        self.model.load_state_dict(instruction.params)
        settings = self.settings
        overrides = {k: v for k, v in instruction.config.items() if hasattr(settings, k)}
        if overrides:
            settings = dataclasses.replace(settings, **overrides)
        # Dropout and other in-model randomness draw from torch's global generator.
        torch.default_generator.manual_seed(derive_seed(self.seed, "client-torch", instruction.round, cid))
        train, test = self.data.train_idx[cid], self.data.test_idx[cid]
        return ClientJob(
            client_id=cid,
            instruction=instruction,
            model=self.model,
            x_train=self.data.x[train],
            y_train=self.data.y[train],
            x_test=self.data.x[test],
            y_test=self.data.y[test],
            loss_fn=self.loss_fn,
            settings=settings,
            generator=torch_generator(self.seed, "client", instruction.round, cid),
            state=self.store.get(cid),
        )

