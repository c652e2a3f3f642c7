"""What a client's update may hold, checked before any strategy sees it.

Nothing a peer sends is trusted. The server knows what an update of its run must look
like, an :class:`UpdateSchema`: the tensors the strategy's clients send (names, shapes,
dtypes of the model's entries; every entry unless the strategy keeps some on the
clients) and the ``extras`` the strategy declares (SCAFFOLD's control-variate delta,
FedNova's a_i). :func:`check_update` refuses, with a :class:`Rejected` naming the
reason, an update that

- claims no examples, not a whole number of them, or more than 2^53 (``examples``);
- misses a tensor or holds one the schema does not name (``names``), has another shape
  (``shape``) or dtype (``dtype``: a float64 or int8 or bool tensor where the model's is
  float32), or is not a plain dense tensor (``malformed``);
- holds NaN or infinite values (``non_finite``), or metrics that are not numbers (``malformed``);
- carries an ``extras`` tensor the strategy did not declare, or of another shape or
  dtype (``extras``): a 1 GiB extras tensor for a three-entry model is refused here;
- speaks for clients it may not (``senders``, :func:`check_senders`).

The server applies these checks, and those of a still-encoded update's layouts and sums, as the
steps of one pipeline in one documented order (:mod:`fedweave.federated.receive`): senders, then
(once decoded) the schema (:func:`check_schema`), finiteness (:func:`check_update_finite`), the
example bounds (:func:`bounded_examples`).

An update still encoded for a plugin that combines updates while encoded (secure
aggregation, homomorphic encryption) is checked as far as it can be: its claims and
extras, not its encoded tensors; the combined update is checked in full once decoded.
Ciphertexts are checked before any parser sees them (:func:`check_ciphertexts`: the
expected names, uint8, bounded in size), in an update and in a broadcast alike.

Claimed example counts are bounded (:class:`ExampleLimits`): a claim above what the
server knows a client holds (in simulation, the partition's sizes) or above
``aggregation.max_examples`` is lowered to it, or refused when the update is encoded
(its weight is inside the encoding). :func:`capped_weights` keeps any one update's
weight at most ``aggregation.max_weight_share`` of a round's total.

A server that knows no sizes (a deployment) still bounds every claim, by default, relative
to the cohort it is aggregated with (:class:`WeightPolicy`, ``aggregation.weight_policy``):
no update may claim more than ``aggregation.max_ratio_to_median`` times the lower median
of the cohort's claims per client, times the clients it stands for (:func:`claim_ceilings`);
a claim above it is lowered to it (``cap``), or the update refused (``refuse``, and always
for an encoded one); ``trust`` takes every claim as it is. A client that declared its
training-set size when it registered (a site that reads its own data) is also held to that
count: a later claim above it is lowered to it or refused, by the same policy.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch

from fedweave.errors import FedweaveError
from fedweave.types import Evaluation, Params, Update, UpdateKind

REASONS = ("malformed", "senders", "examples", "names", "shape", "dtype", "non_finite", "extras")
"""Why an update is rejected; the keys of a round record's ``rejected`` counts."""


MAX_EXAMPLES = 2**53
"""The most examples any update may claim: weights are summed as floats, exact up to here."""


class Rejected(FedweaveError):
    """An update that may not reach the strategy; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype a tensor must have."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)


Specs = Mapping[str, TensorSpec]


def specs_of(params: Params) -> dict[str, TensorSpec]:
    """The spec of every tensor of ``params``."""
    return {name: TensorSpec.of(t) for name, t in params.items()}


@dataclass(frozen=True)
class UpdateSchema:
    """What every update of a run must hold: its ``tensors`` and the ``extras`` its strategy
    declares; ``kind`` the strategy's update kind (None: any)."""

    tensors: Specs
    extras: Specs = field(default_factory=dict)
    kind: UpdateKind | None = None

    @classmethod
    def of(cls, params: Params) -> UpdateSchema:
        """Every entry of ``params``, no extras, any kind: the default of a strategy that declares nothing."""
        return cls(specs_of(params))


def finite(tensor: torch.Tensor) -> bool:
    """False when a floating ``tensor`` holds a NaN or an infinity. Their sum is then not finite
    (NaN and infinities propagate through every partial sum), so a finite sum, one pass, clears
    the tensor; a sum that is not finite may also be an overflow of finite entries, which the
    minimum and the maximum decide (NaN propagates through both)."""
    if not tensor.numel() or math.isfinite(tensor.sum().item()):
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(low.item()) and math.isfinite(high.item())


def check_specs(tensors: Params, expected: Specs, what: str, reason: str | None = None) -> None:
    """Raise :class:`Rejected` unless ``tensors`` are named and shaped as ``expected``: the same
    names, each a dense tensor of its shape and dtype. ``reason`` overrides the reason of a wrong
    name, shape or dtype (``extras`` for an extras tensor)."""
    if not is_mapping(tensors):
        raise Rejected("malformed", f"its {what}s are a {type(tensors).__name__}, not named tensors")
    if tensors.keys() != expected.keys():  # sets compared; the names told only when they differ
        missing = sorted(set(expected) - set(tensors))
        unknown = sorted(set(tensors) - set(expected), key=str)
        parts = [f"lacks {what}s {missing}" if missing else "", f"holds undeclared {what}s {unknown}" if unknown else ""]
        raise Rejected(reason or "names", "; ".join(p for p in parts if p)[:300])
    for name, spec in expected.items():
        tensor = tensors[name]
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise Rejected("malformed", f"{what} {name!r} is not a dense tensor")
        if tensor.shape != spec.shape:  # a torch.Size equals the tuple of its sizes
            raise Rejected(reason or "shape", f"{what} {name!r} has shape {tuple(tensor.shape)}, expected {spec.shape}")
        if tensor.dtype != spec.dtype:
            raise Rejected(reason or "dtype", f"{what} {name!r} is {tensor.dtype}, expected {spec.dtype}")


def check_finite(tensors: Params, what: str, cleared: Mapping[tuple[int, int], torch.Tensor] | None = None) -> None:
    """Raise :class:`Rejected` (``non_finite``) when a floating tensor of ``tensors``, which
    :func:`check_specs` passed, holds NaN or infinite values; those ``cleared`` (by ``(id, version)``,
    the very tensor: :func:`fedweave.stacked.finite_rows`, read together and found finite) are not
    read again."""
    cleared = cleared or {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and cleared.get((id(tensor), tensor._version)) is not tensor and not finite(tensor):
            raise Rejected("non_finite", f"{what} {name!r} holds NaN or infinite values")


def check_tensors(tensors: Params, expected: Specs, what: str, reason: str | None = None) -> None:
    """Raise :class:`Rejected` unless ``tensors`` are exactly ``expected`` (:func:`check_specs`),
    their floating values finite (:func:`check_finite`)."""
    check_specs(tensors, expected, what, reason)
    check_finite(tensors, what)


def check_schema(update: Update, schema: UpdateSchema, encoded: bool = False) -> None:
    """Raise :class:`Rejected` unless ``update``'s claims and the names, shapes and dtypes of its
    tensors and extras fit ``schema`` (module doc); an ``encoded`` update's tensors are not checked."""
    n = update.num_examples
    if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= MAX_EXAMPLES:
        raise Rejected("examples", f"it claims {n!r} examples, not a whole number in 1..2^53")
    if not is_metrics(update.metrics):
        raise Rejected("malformed", "its metrics are not a mapping of names to numbers")
    if schema.kind is not None and update.kind != schema.kind:
        raise Rejected("malformed", f"it is a {getattr(update.kind, 'value', update.kind)!r} update, "
                                    f"the strategy's clients send {schema.kind.value!r}")
    if not encoded:
        check_specs(update.tensors, schema.tensors, "tensor")
    check_specs(update.extras, schema.extras, "extras tensor", reason="extras")


def check_update_finite(
    update: Update, encoded: bool = False, cleared: Mapping[tuple[int, int], torch.Tensor] | None = None
) -> None:
    """Raise :class:`Rejected` (``non_finite``) when the tensors (not those of an ``encoded``
    update) or the extras of ``update``, which :func:`check_schema` passed, hold NaN or infinite
    values (``cleared``: tensors found finite already, :func:`check_finite`)."""
    if not encoded:
        check_finite(update.tensors, "tensor", cleared)
    check_finite(update.extras, "extras tensor", cleared)


def check_update(update: Update, schema: UpdateSchema, encoded: bool = False) -> None:
    """Raise :class:`Rejected` unless ``update`` fits ``schema`` (:func:`check_schema`) and holds
    finite values (:func:`check_update_finite`); an ``encoded`` update's tensors are not checked,
    only its claims and extras."""
    check_schema(update, schema, encoded)
    check_update_finite(update, encoded)


def check_ciphertexts(ciphertexts: Mapping[str, object], names: Sequence[str], max_bytes: int) -> None:
    """Raise :class:`Rejected` (``malformed``) unless ``ciphertexts`` are exactly ``names``, each a
    1-D uint8 tensor of 1..``max_bytes`` bytes: what may be handed to a ciphertext parser (HE's,
    in a client's update on the server and in the broadcast on a client)."""
    if set(ciphertexts) != set(names):
        missing, extra = sorted(set(names) - set(ciphertexts)), sorted(set(ciphertexts) - set(names))
        raise Rejected("malformed", f"it holds ciphertexts {extra[:3]} and lacks {missing[:3]} "
                                    f"(expected {len(names)} ciphertexts)")
    for name in names:
        tensor = ciphertexts[name]
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise Rejected("malformed", f"ciphertext {name!r} is not a 1-D uint8 tensor")
        if not 0 < tensor.numel() <= max_bytes:
            raise Rejected("malformed", f"ciphertext {name!r} has {tensor.numel()} bytes, not 1..{max_bytes}")


def is_mapping(value: object) -> TypeGuard[Mapping[Any, Any]]:
    """Whether ``value`` is a :class:`~collections.abc.Mapping`, a plain dict first (an ABC's
    ``isinstance`` costs ~10x a type's, and every update is checked several times)."""
    return type(value) is dict or isinstance(value, Mapping)


def is_metrics(metrics: object) -> bool:
    """Whether ``metrics`` maps names to real numbers (NaN and infinity allowed: a diverged loss)."""
    return is_mapping(metrics) and all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in metrics.items()
    )


def valid_evaluation(evaluation: Evaluation) -> bool:
    """Whether a client's evaluation can be averaged: a whole, positive example count and
    finite numbers as metrics."""
    n = evaluation.num_examples
    return (
        isinstance(n, int) and not isinstance(n, bool) and n > 0
        and is_metrics(evaluation.metrics)
        and all(math.isfinite(v) for v in evaluation.metrics.values())
    )


def check_senders(update: Update, sender: int, may_stand_for: Collection[int], counted: Collection[int]) -> list[int]:
    """The clients ``update``, sent by ``sender``, counts for; :class:`Rejected` (``senders``)
    when it claims more than it may.

    A client speaks for itself: ``clients`` 1, no ``members``. Only a site leader's
    pre-aggregated update names ``members``: each once, its sender among them, all in
    ``may_stand_for`` (the sender's site, in the round), ``clients`` their number. No
    client counts twice in a round: none of them may be in ``counted`` already.
    """
    members = update.members
    if not isinstance(members, list) or not all(isinstance(m, int) and not isinstance(m, bool) for m in members):
        raise Rejected("malformed", "its members are not a list of client ids")
    if not members:  # a client speaking for itself (nearly every update): the checks below, for [sender]
        if update.clients != 1:
            raise Rejected("senders", f"it claims to stand for {update.clients!r} clients but names 1")
        if sender in counted:
            raise Rejected("senders", f"clients {[sender]} were counted already this round")
        return [sender]
    ids = members
    if len(set(ids)) != len(ids):
        raise Rejected("senders", f"it names clients {members} more than once")
    if update.clients != len(ids):
        raise Rejected("senders", f"it claims to stand for {update.clients!r} clients but names {len(ids)}")
    if sender not in ids:
        raise Rejected("senders", f"it stands for clients {members}, which do not include its sender")
    strangers = sorted(i for i in ids if i != sender and i not in may_stand_for)
    if strangers:
        raise Rejected("senders", f"it claims to stand for clients {strangers}, for whom its sender may not speak")
    again = sorted(i for i in ids if i in counted)  # not set(counted): a copy per update, quadratic in a round
    if again:
        raise Rejected("senders", f"clients {again} were counted already this round")
    return ids


@dataclass(frozen=True)
class ExampleLimits:
    """How many examples an update may claim: at most ``max_examples`` (config
    ``aggregation.max_examples``) and, where the server knows them (simulation), at most the
    sizes of the clients it stands for (``size_of``: a client id's training examples).
    None: no bound of that kind."""

    max_examples: int | None = None
    size_of: Callable[[int], int] | None = None

    def limit(self, ids: Sequence[int]) -> int | None:
        """The most examples an update standing for clients ``ids`` may claim."""
        bounds = []
        if self.max_examples is not None:
            bounds.append(self.max_examples)
        if self.size_of is not None:
            bounds.append(sum(map(self.size_of, ids)))
        return min(bounds) if bounds else None


def bounded_examples(update: Update, limit: int | None, encoded: bool = False) -> Update:
    """``update`` with its claim lowered to ``limit``; an ``encoded`` update's claim weighs its
    encoding, so it cannot be lowered: :class:`Rejected` (``examples``) instead."""
    if limit is None or update.num_examples <= limit:
        return update
    if encoded:
        raise Rejected("examples", f"it claims {update.num_examples} examples, more than the {limit} it may")
    return dataclasses.replace(update, num_examples=limit)


def capped_weights(weights: Sequence[float], max_share: float) -> list[float]:
    """``weights`` with none above ``max_share`` of their total: the largest are lowered to one
    common cap c = max_share · Σ min(w_i, c), the others kept. When no cap can reach the
    share (fewer than 1 / max_share weights), all become equal, the smallest largest share."""
    if not 0 < max_share <= 1:
        raise ValueError(f"max_share must lie in (0, 1], got {max_share}")
    if any(w <= 0 for w in weights):
        raise ValueError(f"weights must be positive, got {list(weights)}")
    ordered = sorted(weights, reverse=True)
    rest = float(sum(ordered))
    for k, largest in enumerate(ordered):  # k weights capped, the rest kept
        if max_share * k >= 1:
            break
        cap = max_share * rest / (1 - max_share * k)
        if largest <= cap:
            return [min(float(w), cap) for w in weights]
        rest -= largest
    return [float(min(weights))] * len(weights)


WEIGHT_POLICIES = ("cap", "refuse", "trust")
"""What the server does with a claim above its cohort's bound (``aggregation.weight_policy``)."""


def lower_median(values: Sequence[float]) -> float:
    """The lower median of ``values``: the middle one, or the smaller of the two middle ones, so
    that values above it can only be as many as the others, never move it up."""
    if not values:
        raise ValueError("the median of no values")
    return sorted(values)[(len(values) - 1) // 2]


def claim_ceilings(claims: Sequence[tuple[int, int]], ratio: float, reference: Sequence[float] = ()) -> list[int]:
    """For each ``(examples, clients)`` claim of a cohort, the most examples it may count:
    ⌊ratio · m · clients⌋ (at least 1), with m the lower median of the claims per client, each
    claim's examples / clients entered once per client it stands for (a site leader's sum weighs
    as its members), together with ``reference``: per-client claims of clients outside the cohort
    (FedBuff's latest of the others). A claim within ``ratio`` of the median keeps its count."""
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1, got {ratio}")
    per_client = [n / c for n, c in claims for _ in range(c)] + list(reference)
    if not per_client:
        return []
    m = lower_median(per_client)
    return [max(1, math.floor(ratio * m * c + 1e-9)) for _, c in claims]


@dataclass(frozen=True)
class Bounded:
    """A cohort's updates after :meth:`WeightPolicy.bound`: those ``kept`` (claims capped where
    needed), the ids of the senders whose claim was ``capped``, and those ``refused``, each with why."""

    kept: list[Update]
    capped: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightPolicy:
    """What the server does with a claim above its cohort's bound (module doc): ``policy`` one of
    :data:`WEIGHT_POLICIES` (``aggregation.weight_policy``), ``ratio`` the bound's multiple of the
    cohort's median claim per client (``aggregation.max_ratio_to_median``)."""

    policy: str = "cap"
    ratio: float = 3.0

    @classmethod
    def of(cls, aggregation: Any) -> WeightPolicy:
        """The policy of a run's ``aggregation`` config section."""
        return cls(aggregation.weight_policy, aggregation.max_ratio_to_median)

    def bound(
        self, updates: Sequence[Update], reference: Sequence[float] = (), declared: Mapping[int, int] | None = None
    ) -> Bounded:
        """``updates`` of one cohort with every claim within its ceiling: :func:`claim_ceilings`
        and, for a client that declared its examples at registration (``declared``, by id), that
        count; lowered to it (``cap``; an encoded update, whose weight is inside its encoding, is
        refused), or refused (``refuse``); unchanged with ``trust``."""
        if self.policy == "trust" or not updates:
            return Bounded(list(updates))
        own = [(declared or {}).get(u.client_id) if u.clients == 1 else None for u in updates]
        claims = [(u.num_examples if d is None else min(u.num_examples, max(1, d)), u.clients)
                  for u, d in zip(updates, own)]
        ceilings = claim_ceilings(claims, self.ratio, reference)
        kept, capped, refused = [], [], {}
        for update, cohort, d in zip(updates, ceilings, own):
            ceiling = cohort if d is None else min(cohort, max(1, d))
            if update.num_examples <= ceiling:
                kept.append(update)
            elif self.policy == "cap" and not update.applied:
                kept.append(dataclasses.replace(update, num_examples=ceiling))
                capped.append(update.client_id)
            elif ceiling < cohort:
                refused[update.client_id] = (
                    f"it claims {update.num_examples} examples, more than the {d} it declared at registration "
                    f"(weight_policy {self.policy})"
                )
            else:
                refused[update.client_id] = (
                    f"it claims {update.num_examples} examples, more than the {ceiling} its cohort allows "
                    f"({self.ratio:g} x the median per client, weight_policy {self.policy})"
                )
        return Bounded(kept, capped, refused)


def rejection_counts(counter: Counter[str]) -> dict[str, int]:
    """A round record's ``rejected``: updates rejected per reason, in :data:`REASONS` order."""
    return {reason: counter[reason] for reason in REASONS if counter[reason]}


def whole_examples(n: float) -> int:
    """A capped weight as a whole example count (never 0), for ``Update.num_examples``."""
    return max(1, math.floor(n + 1e-9))


@dataclass(frozen=True)
class UpdateChecks:
    """What a run's server checks each update against, built from its config: the
    ``schema`` (None: every entry of the round's global parameters, no extras), the
    claims' ``limits``, the largest share of a round's total weight one update may
    have (None: no cap), and the bound of each claim relative to its cohort (``weights``)."""

    schema: UpdateSchema | None = None
    limits: ExampleLimits = ExampleLimits()
    max_weight_share: float | None = None
    weights: WeightPolicy = WeightPolicy()


def cap_weight_share(updates: Sequence[Update], max_share: float | None) -> list[Update]:
    """``updates`` whose claimed examples give none more than ``max_share`` of their total
    weight (:func:`capped_weights`, rounded down to whole examples); unchanged for None."""
    if max_share is None or not updates:
        return list(updates)
    weights = capped_weights([u.num_examples for u in updates], max_share)
    return [
        u if whole_examples(w) >= u.num_examples else dataclasses.replace(u, num_examples=whole_examples(w))
        for u, w in zip(updates, weights)
    ]
