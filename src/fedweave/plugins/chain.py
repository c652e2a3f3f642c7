"""Plugin chains at the four attachment points of a round.

=================  ==========================  ==========================
point              where ``encode`` runs       where ``decode`` runs
=================  ==========================  ==========================
``server_send``    server, on instructions     client, on receipt
``client_receive`` —                           client, on receipt (a filter)
``client_send``    client, on updates          server, on receipt
``server_receive`` —                           server, on receipt (a filter)
=================  ==========================  ==========================

A *send* chain encodes at one end and is decoded at the other, in reverse order, by
the same plugins configured there; each payload lists the plugins applied to it
(``applied``), so the receiver decodes exactly what was encoded. A *receive* chain is
a filter the receiving side applies after the send chain's decode.

A plugin is a small object with:

- ``name``; ``accepts``: the update kinds it can transform;
- ``combines_encoded``: the server must combine the updates while still encoded
  (secure aggregation, homomorphic encryption); only strategies whose server step is a
  weighted sum accept such a plugin;
- ``encode(payload, ctx)`` and ``decode(payload, ctx)``, each returning a new payload
  (never mutating the one given: in simulation it may be shared);
- a combining plugin also has ``combine(updates, ctx) -> Update``: the server calls it
  on the round's still-encoded updates and decodes the one update it returns, whose
  tensors are the example-weighted mean (the plugin sees each update's
  ``num_examples``) and whose ``num_examples`` is their total. The strategy then
  aggregates that single update.

A combining plugin may run a protocol of its own messages (secure aggregation's key
set-up and unmasking). It then has ``setup(rnd, cohort, exchange) -> ready``: the loop
calls it before the training exchange with the round's cohort and takes only the
clients it returns (those that completed the set-up); its ``combine`` takes the
``exchange`` too; and its client half is ``answer(control, ctx) -> Control``, which a
client runtime calls with each :class:`~fedweave.types.Control` addressed to the
plugin. ``exchange`` sends one control message per client through the round's
topology and returns the answers of those that answered (a :data:`ControlExchange`).
On the client, ``ctx.state`` is that client's private plugin state, kept by its
runtime in its own process (keys, shares); on the server it is None, so a server half
cannot reach a client's secrets even in a simulation that runs both in one process.

A combining plugin may keep the global model encoded on the server (homomorphic
encryption, :class:`~fedweave.plugins.contracts.SealsModel`): then every instruction
leaves with the plugin's ``seal(params)`` in place of its params, before the
server_send chain (:meth:`Chains.to_clients`), and a client reads them back with
``unseal`` after that chain's decode (:meth:`Chains.to_client`); each still-encoded
update passes the plugin's ``check_encoded`` before it is accepted.

Optional hooks, each called on every plugin of the four chains that has it (each
capability is a typed protocol of :mod:`fedweave.plugins.contracts`, checked when the
config loads):

- ``bind(config)``: once, when the run is built (the run seed, the number of clients);
- ``begin_round(rnd, client_ids)``: before a round's set-up and broadcast, with its
  cohort (a privacy ledger); raising :class:`~fedweave.errors.BudgetSpent` ends the run
  before the round (a privacy budget would be exceeded);
- ``instruct(ctx) -> dict``: server side, for each instruction, settings of the plugin's
  client half for that client (adaptive DP's current clip norm); merged into the
  instruction's ``config``, which the client half reads as ``ctx.config`` when it encodes;
- ``training(ctx)``: client side, for each training instruction, the local training that takes
  the plain loop's place for that client and round (DP-SGD); at most one plugin of a run has it;
- ``failed(failures)``: server side, the clients whose job failed (no reply), with the
  reasons, before the round's updates are received (a compressor's downlink goes dense
  for them);
- ``observe(updates)``: server side, every update received, before any is decoded or
  rejected (a privacy ledger counts what each client released);
- ``metrics() -> dict[str, float]``: after each round, merged into its record (``epsilon``);
- ``state_dict()`` / ``load_state_dict(state)``: per-client state kept in checkpoints
  (error-feedback residuals, privacy ledgers).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from fedweave.plugins.contracts import (
    POINTS,
    Answers,
    BeginsRound,
    Binds,
    ChecksSummed,
    Combines,
    ControlExchange,
    Instructs,
    HearsFailures,
    Observes,
    Payload,
    Plugin,
    PluginContext,
    ReportsMetrics,
    RunsProtocol,
    SealsModel,
    Stateful,
    TakesOverTraining,
    declaration,
)
from fedweave.types import Control, Instruction, Update

if TYPE_CHECKING:
    from fedweave.training import LocalTraining



@dataclass
class Chain:
    """Plugins in order at one attachment point."""

    plugins: list[Plugin] = field(default_factory=list)

    def encode(self, payload: Payload, ctx: PluginContext) -> Payload:
        for plugin in self.plugins:
            payload = plugin.encode(payload, ctx)
            payload.applied = [*payload.applied, plugin.name]
        return payload

    def decode(self, payload: Payload, ctx: PluginContext) -> Payload:
        """Undo what the sender's chain applied (``payload.applied``), last first."""
        by_name = {p.name: p for p in self.plugins}
        for name in reversed(payload.applied):
            if name not in by_name:
                raise ValueError(
                    f"payload was encoded by plugin {name!r}, which this side's chain lacks"
                )
            payload = by_name[name].decode(payload, ctx)
        payload.applied = []
        return payload

    def filter(self, payload: Payload, ctx: PluginContext) -> Payload:
        """Apply a receive-side chain: each plugin's ``decode``, in order."""
        for plugin in self.plugins:
            payload = plugin.decode(payload, ctx)
        return payload

    @property
    def combiner(self) -> Plugin | None:
        """The plugin that makes the server combine updates while encoded, if any."""
        return next((p for p in self.plugins if p.combines_encoded), None)


@dataclass
class Chains:
    """The four chains of a run."""

    server_send: Chain = field(default_factory=Chain)
    client_receive: Chain = field(default_factory=Chain)
    client_send: Chain = field(default_factory=Chain)
    server_receive: Chain = field(default_factory=Chain)

    @cached_property  # read for every instruction and update; a runtime protocol check costs ~30 µs
    def sealer(self) -> SealsModel | None:
        """The combining plugin that keeps the global model encoded on the server, if any."""
        combiner = self.client_send.combiner
        return combiner if isinstance(combiner, SealsModel) else None

    @cached_property
    def sends_as_is(self) -> bool:
        """Whether :meth:`to_clients` gives every instruction back as it is (no plugin instructs,
        seals or encodes it), so that a caller need not make a context for it."""
        return not self._instructing and self.sealer is None and not self.server_send.plugins

    def to_clients(self, instruction: Instruction, ctx: PluginContext) -> Instruction:
        """Server side of the downlink: the plugins' per-client settings, the sealed model, the encoding."""
        instruction = self.instruct(instruction, ctx)
        if (sealer := self.sealer) is not None:
            instruction = replace(instruction, params=sealer.seal(instruction.params))
        return self.server_send.encode(instruction, ctx)

    @cached_property
    def summed_checkers(self) -> list[ChecksSummed]:
        """The plugins before the combiner that check, on receipt, the fields they left in an update to be summed."""
        plugins = self.client_send.plugins
        combiner = self.client_send.combiner
        before = plugins[: plugins.index(combiner)] if combiner is not None else []
        return [p for p in before if isinstance(p, ChecksSummed)]

    @cached_property
    def withholds_metrics(self) -> bool:
        """Whether a client's update carries no metric computed from its data: under differential
        privacy (``dp_local``, ``dp_central``, ``dpsgd``: a plugin that declares ``protects``, as the
        rules of :mod:`fedweave.plugins.compose` read it), which no clip or noise of a loss would
        cover, and under a sealed model (HE), where a loss is that of whatever model the server
        encrypted, an oracle on ciphertexts it chose."""
        return self.sealer is not None or any(
            declaration(p).protects for point in POINTS for p in getattr(self, point).plugins
        )

    def to_client(self, instruction: Instruction, ctx: PluginContext) -> Instruction:
        """Client side of the downlink: decode the server's encoding, unseal the model, then filter."""
        instruction = self.server_send.decode(instruction, ctx)
        if (sealer := self.sealer) is not None:
            instruction = replace(instruction, params=sealer.unseal(instruction.params))
        return self.client_receive.filter(instruction, ctx)

    def to_server(self, update: Update, ctx: PluginContext) -> Update:
        """Server side of the uplink for one update: decode the client's encoding, then filter.

        With a combining plugin in ``client_send``, only the plugins applied after it are
        decoded here; :meth:`combine` finishes the job on the round's updates together. The
        still-encoded update's checks (its layouts, its fields to be summed, a sealer's
        ciphertexts) are steps of the receive pipeline (:mod:`fedweave.federated.receive`).
        """
        combiner = self.client_send.combiner
        if combiner is None:
            return self.server_receive.filter(self.client_send.decode(update, ctx), ctx)
        sent = [p.name for p in self.client_send.plugins]
        if update.applied != sent:  # the sum is decoded as the round's first update says it was encoded
            raise ValueError(f"update was encoded by {update.applied}, not by this run's client_send chain {sent}")
        cut = update.applied.index(combiner.name) + 1
        partial = self.client_send.decode(replace(update, applied=update.applied[cut:]), ctx)
        return replace(partial, applied=update.applied[:cut])

    def combine(self, updates: list[Update], ctx: PluginContext, exchange: ControlExchange) -> Update:
        """Combine still-encoded updates into one (with the plugin's own exchange when it runs
        a protocol), decode it, then filter it."""
        combiner = self.client_send.combiner
        if combiner is None:
            raise ValueError("no combining plugin in client_send")
        if isinstance(combiner, RunsProtocol):
            combined = combiner.combine(updates, ctx, exchange)
        elif isinstance(combiner, Combines):
            combined = combiner.combine(updates, ctx)
        else:
            raise ValueError(f"plugin {combiner.name!r} declares combines_encoded but has no combine()")
        return self.server_receive.filter(self.client_send.decode(combined, ctx), ctx)

    def setup(self, rnd: int, cohort: list[int], exchange: ControlExchange) -> list[int]:
        """The combining plugin's set-up steps, if it runs a protocol; the clients ready to train."""
        combiner = self.client_send.combiner
        if combiner is None or not isinstance(combiner, RunsProtocol):  # None: no protocol check (~30 µs)
            return cohort
        return combiner.setup(rnd, cohort, exchange)

    def answer(self, control: Control, ctx: PluginContext) -> Control:
        """Client side: the answer of the plugin ``control`` is addressed to."""
        for name, plugin in self._answering:
            if name == control.plugin:
                return plugin.answer(control, ctx)
        raise ValueError(f"no plugin of this client answers control messages of {control.plugin!r}")

    def _each(self) -> list[tuple[str, Plugin]]:
        """``(point[index], plugin)`` of every plugin of the four chains, in chain order."""
        chains: list[tuple[str, Chain]] = [(point, getattr(self, point)) for point in POINTS]
        return [(f"{point}[{i}]", plugin) for point, chain in chains for i, plugin in enumerate(chain.plugins)]

    # The plugins of each capability, found once (asked per round and per instruction; a runtime
    # protocol check costs µs a plugin), in chain order.
    @cached_property
    def _answering(self) -> list[tuple[str, Answers]]:
        return [(p.name, p) for _, p in self._each() if isinstance(p, Answers)]

    @cached_property
    def _binding(self) -> list[Binds]:
        return [p for _, p in self._each() if isinstance(p, Binds)]

    @cached_property
    def _beginning(self) -> list[BeginsRound]:
        return [p for _, p in self._each() if isinstance(p, BeginsRound)]

    @cached_property
    def _instructing(self) -> list[Instructs]:
        return [p for _, p in self._each() if isinstance(p, Instructs)]

    @cached_property
    def _training(self) -> list[TakesOverTraining]:
        return [p for _, p in self._each() if isinstance(p, TakesOverTraining)]

    @cached_property
    def _hearing_failures(self) -> list[HearsFailures]:
        return [p for _, p in self._each() if isinstance(p, HearsFailures)]

    @cached_property
    def _observing(self) -> list[Observes]:
        return [p for _, p in self._each() if isinstance(p, Observes)]

    @cached_property
    def _reporting(self) -> list[tuple[str, ReportsMetrics]]:
        return [(p.name, p) for _, p in self._each() if isinstance(p, ReportsMetrics)]

    @cached_property
    def _stateful(self) -> list[tuple[str, Stateful]]:
        return [(where, p) for where, p in self._each() if isinstance(p, Stateful)]

    def bind(self, config: Any) -> None:
        for plugin in self._binding:
            plugin.bind(config)

    def begin_round(self, rnd: int, client_ids: list[int]) -> None:
        for plugin in self._beginning:
            plugin.begin_round(rnd, client_ids)

    def instruct(self, instruction: Instruction, ctx: PluginContext) -> Instruction:
        """Server side: the instruction with its plugins' per-client settings in ``config``."""
        instructing = self._instructing
        if not instructing:
            return instruction
        config = dict(instruction.config)
        for plugin in instructing:
            config.update(plugin.instruct(ctx))
        return replace(instruction, config=config)

    @cached_property
    def takes_training(self) -> bool:
        """Whether a plugin takes the clients' training loop over (:meth:`training` may be other than None)."""
        return bool(self._training)

    @cached_property
    def reads_updates(self) -> bool:
        """Whether :meth:`to_server` does anything to an update that no plugin encoded (a server_receive
        filter, a client_send decoder): without one, such an update is received as it came."""
        return bool(self.client_send.plugins or self.server_receive.plugins)

    def training(self, ctx: PluginContext) -> LocalTraining | None:
        """Client side: the local training of ``ctx``'s client and round of the plugin that takes
        the loop over (:mod:`.compose` allows one), or None: the plain loop."""
        for plugin in self._training:
            return plugin.training(ctx)
        return None

    def failed(self, failures: dict[int, str]) -> None:
        if failures:
            for plugin in self._hearing_failures:
                plugin.failed(dict(failures))

    def observe(self, updates: list[Update]) -> None:
        for plugin in self._observing:
            plugin.observe(updates)

    def metrics(self) -> dict[str, float]:
        """Every plugin's metrics; a name two plugins report (both DP plugins' ``epsilon``)
        becomes ``<plugin>.<name>`` for each, so neither hides the other."""
        reports = [(name, plugin.metrics()) for name, plugin in self._reporting]
        seen: dict[str, int] = {}
        for _, report in reports:
            for key in report:
                seen[key] = seen.get(key, 0) + 1
        return {
            (key if seen[key] == 1 else f"{name}.{key}"): value
            for name, report in reports
            for key, value in report.items()
        }

    def state_dict(self) -> dict[str, Any]:
        return {where: plugin.state_dict() for where, plugin in self._stateful}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for where, plugin in self._stateful:
            if where in state:
                plugin.load_state_dict(state[where])
