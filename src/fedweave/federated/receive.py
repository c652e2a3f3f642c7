"""The receive pipeline: every acceptance check of a client's update, in one order.

Both spines hand each exchange's replies to :func:`accept_updates` (the synchronous round once a
round, FedBuff's buffered spine at each arrival). A reply goes through these steps, in this order;
the first that refuses it rejects it (:class:`~fedweave.federated.checks.Rejected`): it is logged,
counted in the round's ``rejected`` by its reason and its client as failed, and the run goes on.

1. ``senders``   who the update may count for: its sender (the transport's id, authenticated
                 over gRPC, whatever id it claims), or a site's members, each once in the round
                 (:func:`~fedweave.federated.checks.check_senders`; reasons ``senders``, ``malformed``)
2. ``decode``    the chains' decoding and filtering (:meth:`~fedweave.plugins.chain.Chains.to_server`);
                 a decoder's complaint is ``malformed``. Not a check of its own, but what the
                 checks after it read
3. ``schema``    its claim a whole number of examples, its metrics numbers, its kind the strategy's,
                 its tensors' and extras' names, shapes and dtypes those of the run's
                 :class:`~fedweave.federated.checks.UpdateSchema` (an update still encoded for a
                 combining plugin: not its tensors) (:func:`~fedweave.federated.checks.check_schema`;
                 ``examples``, ``malformed``, ``names``, ``shape``, ``dtype``, ``extras``)
4. ``finite``    no NaN or infinity in its tensors and extras (``non_finite``)
5. ``examples``  its claim within the :class:`~fedweave.federated.checks.ExampleLimits` of the
                 clients it stands for: lowered to it, refused when encoded (``examples``)
6. ``layouts``   still encoded for a combining plugin: the layouts it carries are the model's
                 (``malformed``), so that one client's forged layout cannot fail the round's combine
7. ``sums``      still encoded: the fields a plugin before the combiner left in it
                 (:class:`~fedweave.plugins.contracts.ChecksSummed`) and a sealer's ciphertexts
                 (:class:`~fedweave.plugins.contracts.SealsModel`) (``malformed``)

Then, for the updates a cohort aggregates together (a round's, FedBuff's buffer),
:func:`bound_weights` bounds each claim by the cohort's (``aggregation.weight_policy``, refused ones
counted as ``examples``); with a combining plugin, :func:`combine_checked` checks the combined
update in full once decoded (schema, finiteness: one that fails skips the round).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import NamedTuple, cast

import torch

from fedweave.conforms import Conforms
from fedweave.errors import RoundError
from fedweave.federated.checks import (
    Rejected,
    UpdateChecks,
    UpdateSchema,
    bounded_examples,
    check_schema,
    check_senders,
    check_update,
    check_update_finite,
    is_mapping,
)
from fedweave.plugins.chain import Chains
from fedweave.plugins.contracts import ControlExchange, PluginContext
from fedweave.plugins.packing import check_layouts, clear_layouts
from fedweave.stacked import finite_rows
from fedweave.topologies.base import Relaying, Topology
from fedweave.transports.base import KnowsDeclared
from fedweave.types import Message, Params, Update

log = logging.getLogger(__name__)

_relaying, _knows_declared = Conforms(Relaying), Conforms(KnowsDeclared)

STEPS = ("senders", "decode", "schema", "finite", "examples", "layouts", "sums")
"""The steps of :func:`receive`, in their order (module doc)."""


class Received(NamedTuple):
    """An update that passed :func:`receive`, the clients it counts for, and the examples it
    claimed before its claim was bounded."""

    update: Update
    ids: list[int]
    claimed: int


def receive(
    chains: Chains, reply: Message, schema: UpdateSchema, checks: UpdateChecks,
    may_stand_for: Collection[int], counted: Collection[int],
    cleared: Mapping[tuple[int, int], torch.Tensor] | None = None,
) -> Received:
    """``reply``'s update through every step, in order (module doc);
    :class:`~fedweave.federated.checks.Rejected` by the first step that refuses it. ``cleared``:
    tensors found finite already (:func:`fedweave.stacked.finite_rows`), not read again."""
    cid = reply.client_id
    if not isinstance(reply.body, Update):
        raise Rejected("malformed", f"expected an update, got {type(reply.body).__name__}")
    ids = check_senders(reply.body, cid, may_stand_for, counted)
    update = reply.body
    if not isinstance(update.applied, list) or update.applied or chains.reads_updates:  # else: as decoding leaves it
        update = decoded(chains, update, PluginContext(reply.round, cid, "server", expected=schema.tensors))
    encoded = bool(update.applied)
    check_schema(update, schema, encoded)
    check_update_finite(update, encoded, cleared)
    bounded = bounded_examples(update, checks.limits.limit(ids), encoded)
    if chains.client_send.combiner is not None:
        check_encoded_layouts(update, schema)
        check_sums(chains, update, schema)
    return Received(bounded, ids, update.num_examples)


@contextmanager
def malformed() -> Iterator[None]:
    """A plugin's or a layout's complaint about an update makes it ``malformed``."""
    try:
        yield
    except Exception as exc:
        raise Rejected("malformed", str(exc)) from None


def decoded(chains: Chains, update: Update, ctx: PluginContext) -> Update:
    """``update`` decoded and filtered by the chains; a decoder's complaint is ``malformed``."""
    with malformed():
        return chains.to_server(update, ctx)


def check_encoded_layouts(update: Update, schema: UpdateSchema) -> None:
    """A still-encoded update's layouts are those of ``schema``'s tensors, else ``malformed``."""
    with malformed():
        check_layouts(clear_layouts(update.tensors), schema.tensors)


def check_sums(chains: Chains, update: Update, schema: UpdateSchema) -> None:
    """A still-encoded update's fields to be summed are those the plugins before the combiner
    send, and its ciphertexts those a sealer can add to the model, else ``malformed``."""
    with malformed():
        for plugin in chains.summed_checkers:
            plugin.check_summed(update.tensors, schema.tensors)
        if (sealer := chains.sealer) is not None:
            sealer.check_encoded(update)


def accept_updates(
    chains: Chains,
    replies: list[Message],
    failures: dict[int, str],
    params: Params,
    checks: UpdateChecks | None = None,
    may_stand_for: Callable[[int], Collection[int]] | None = None,
    rejected: Counter[str] | None = None,
) -> list[Update]:
    """The updates of ``replies`` that pass :func:`receive`; each rejected one is logged and
    counted as failed and in ``rejected`` by reason, so that no strategy sees a malformed update.

    An update counts for the client that sent it, whatever id it claims; it may stand for other
    clients only as a site's pre-aggregated update, for clients in ``may_stand_for(sender)``
    (None: none but itself), each once in the round. A fully decoded update must fit
    ``checks.schema`` (None: exactly the tensors of ``params``); one still encoded for a
    combining plugin is checked as far as it can be, and its combination after decoding
    (:func:`combine_checked`). A claimed example count above ``checks.limits`` is lowered to it
    (refused when encoded).
    """
    checks = checks or UpdateChecks()
    # each update counts for its sender (authenticated over gRPC), never for the id it claims
    replies = [
        Message(r.round, r.client_id, replace(r.body, client_id=r.client_id))
        if isinstance(r.body, Update) and r.body.client_id != r.client_id else r
        for r in replies
    ]
    chains.failed(failures)  # before the rejections below: a rejected update's client decoded its broadcast
    chains.observe([r.body for r in replies if isinstance(r.body, Update)])
    schema = checks.schema or UpdateSchema.of(params)
    updates: list[Update] = []
    counted: set[int] = set()
    cleared = finite_rows([  # a cohort's updates, rows of its stacked change: their finiteness read at once
        t for r in replies if isinstance(r.body, Update)
        for ts in (r.body.tensors, r.body.extras) if is_mapping(ts)
        for t in ts.values() if isinstance(t, torch.Tensor)
    ])
    for reply in replies:
        cid = reply.client_id
        try:
            update, ids, claimed = receive(
                chains, reply, schema, checks, may_stand_for(cid) if may_stand_for else {cid}, counted, cleared
            )
        except Rejected as exc:
            log.warning("round %d: update of client %d rejected: %s (%s)", reply.round, cid, exc, exc.reason)
            failures[cid] = f"rejected: {exc}"
            if rejected is not None:
                rejected[exc.reason] += 1
            continue
        if update.num_examples < claimed:
            log.warning("round %d: client %d claims %d examples, counted as %d", reply.round, cid, claimed,
                        update.num_examples)
        counted.update(ids)
        updates.append(update)
    return updates


def stand_for(topology: Topology, cohort: set[int]) -> Callable[[int], Collection[int]]:
    """Sender -> the clients of ``cohort`` its update may stand for: its site's in a
    :class:`~fedweave.topologies.base.Relaying` topology, else itself alone."""
    if _relaying(topology):
        relaying = cast(Relaying, topology)
        return lambda sender: relaying.site_members(sender) & cohort
    return lambda sender: {sender}


def declared_examples(topology: Topology) -> Mapping[int, int]:
    """The training examples each client declared when it registered, by authenticated id (none in simulation)."""
    return cast(KnowsDeclared, topology).declared_examples() if _knows_declared(topology) else {}


def bound_weights(
    rnd: int,
    updates: list[Update],
    checks: UpdateChecks,
    failures: dict[int, str],
    rejected: Counter[str],
    reference: Collection[float] = (),
    declared: Mapping[int, int] | None = None,
) -> tuple[list[Update], int]:
    """``updates``, one cohort, with each claim within its bound (``checks.weights``,
    :meth:`~fedweave.federated.checks.WeightPolicy.bound`; ``reference``: other clients' latest claims
    per client; ``declared``: the examples clients declared at registration), and how many were
    capped; a refused one is logged, counted in ``rejected`` (``examples``) and in ``failures``."""
    bounded = checks.weights.bound(updates, list(reference), declared)
    claims = {u.client_id: u.num_examples for u in updates}
    counted = {u.client_id: u.num_examples for u in bounded.kept}
    for cid in bounded.capped:
        own = (declared or {}).get(cid)
        declared_bound = own is not None and counted[cid] == max(1, own)
        bound = f"the {own} it declared at registration" if declared_bound else "its cohort's bound"
        log.warning("round %d: client %d claims %d examples, above %s: counted as %d",
                    rnd, cid, claims[cid], bound, counted[cid])
    for cid, why in bounded.refused.items():
        log.warning("round %d: update of client %d rejected: %s (examples)", rnd, cid, why)
        failures[cid] = f"rejected: {why}"
        rejected["examples"] += 1
    return bounded.kept, len(bounded.capped)


def combine_checked(
    chains: Chains, rnd: int, params: Params, updates: list[Update], checks: UpdateChecks, rejected: Counter[str],
    control: ControlExchange,
) -> Update:
    """The round's encoded updates combined by their plugin (``control``: its own exchange) and
    decoded, checked in full; one that does not fit the run's schema skips the round
    (:class:`~fedweave.errors.RoundError`)."""
    schema = checks.schema or UpdateSchema.of(params)
    combined = chains.combine(updates, PluginContext(rnd, -1, "server", expected=schema.tensors), control)
    try:
        check_update(combined, schema)
    except Rejected as exc:
        rejected[exc.reason] += 1
        raise RoundError(f"the combined update is rejected ({exc.reason}): {exc}") from None
    return combined
