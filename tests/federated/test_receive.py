"""The receive pipeline (fedweave.federated.receive): one bad update per step, rejected for that step's
reason while the others of the round are accepted; an update bad in two ways is rejected by the earlier step."""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fedweave.federated import receive as receive_module
from fedweave.federated.checks import ExampleLimits, UpdateChecks
from fedweave.federated.receive import STEPS, accept_updates
from fedweave.plugins.chain import Chain, Chains
from fedweave.plugins.contracts import PluginContext
from fedweave.plugins.packing import FLAT, field, layout
from fedweave.types import Message, Params, Update, UpdateKind

MODEL = {"w": torch.zeros(4), "n": torch.tensor(0)}
FORGED_SUM = "w.__forged"


class Summed:
    """A plugin before the combiner that checks, on receipt, the fields it left to be summed."""

    name = "summed"
    accepts = frozenset(UpdateKind)
    combines_encoded = False

    def encode(self, payload: Update, ctx: PluginContext) -> Update:
        return replace(payload)

    def decode(self, payload: Update, ctx: PluginContext) -> Update:
        return replace(payload)

    def check_summed(self, tensors: Params, expected: object) -> None:
        if FORGED_SUM in tensors:
            raise ValueError("summed: a field it never sends")


class Summer(Summed):
    """A combining plugin (its updates are summed while encoded)."""

    name = "summer"
    combines_encoded = True


LIMITED = UpdateChecks(limits=ExampleLimits(max_examples=20))
PLAIN = Chains()
COMBINING = Chains(client_send=Chain([Summed(), Summer()]))  # type: ignore[list-item]


def update(cid: int, combining: bool = False, examples: int = 10, **fields: object) -> Update:
    tensors = {"w": torch.ones(4), "n": torch.tensor(1)}
    fields.setdefault("applied", ["summed", "summer"] if combining else [])
    return Update(UpdateKind.DELTA, tensors, examples, client_id=cid, **fields)  # type: ignore[arg-type]


def with_tensors(u: Update, **tensors: torch.Tensor) -> Update:
    return replace(u, tensors={**u.tensors, **tensors})


def forged_layout(u: Update) -> Update:
    return replace(u, tensors={**u.tensors, field("w", FLAT): layout(torch.zeros(1 << 10))})


def forged_sum(u: Update) -> Update:
    return replace(u, tensors={**u.tensors, FORGED_SUM: torch.zeros(1)})


def received(chains: Chains, bad: Update, checks: UpdateChecks) -> tuple[list[int], dict, Counter]:
    """Clients 0 and 2 send good updates, client 1 ``bad``: the accepted senders, failures, rejections."""
    combining = chains is COMBINING
    replies = [Message(1, 0, update(0, combining)), Message(1, 1, bad), Message(1, 2, update(2, combining))]
    failures: dict[int, str] = {}
    rejected: Counter[str] = Counter()
    accepted = accept_updates(chains, replies, failures, MODEL, checks, rejected=rejected)
    return [u.client_id for u in accepted], failures, rejected


BAD = {
    "senders": (PLAIN, update(1, members=[1, 7], clients=2), UpdateChecks(), "senders",
                "it claims to stand for clients [7]"),
    "decode": (PLAIN, update(1, applied=["secret"]), UpdateChecks(), "malformed",
               "payload was encoded by plugin 'secret'"),
    "schema": (PLAIN, with_tensors(update(1), w=torch.ones(5)), UpdateChecks(), "shape",
               "tensor 'w' has shape (5,), expected (4,)"),
    "finite": (PLAIN, with_tensors(update(1), w=torch.tensor([1.0, float("nan"), 0.0, 0.0])), UpdateChecks(),
               "non_finite", "tensor 'w' holds NaN or infinite values"),
    "examples": (COMBINING, update(1, combining=True, examples=50), LIMITED, "examples",
                 "it claims 50 examples, more than the 20 it may"),
    "layouts": (COMBINING, forged_layout(update(1, combining=True)), UpdateChecks(), "malformed",
                "the layout of 'w' is torch.float32 (1024,)"),
    "sums": (COMBINING, forged_sum(update(1, combining=True)), UpdateChecks(), "malformed",
             "summed: a field it never sends"),
}


def test_every_step_has_its_bad_update() -> None:
    assert tuple(BAD) == STEPS


@pytest.mark.parametrize("step", STEPS)
def test_a_bad_update_is_rejected_by_its_step_the_others_accepted(step: str, caplog: pytest.LogCaptureFixture) -> None:
    chains, bad, checks, reason, detail = BAD[step]
    with caplog.at_level(logging.WARNING, logger="fedweave.federated.receive"):
        accepted, failures, rejected = received(chains, bad, checks)
    assert accepted == [0, 2]
    assert list(failures) == [1] and detail in failures[1]
    assert rejected == Counter({reason: 1})
    assert f"update of client 1 rejected: {detail}" in caplog.text and f"({reason})" in caplog.text


def test_a_decoded_claim_above_its_bound_is_lowered_not_rejected() -> None:
    failures: dict[int, str] = {}
    accepted = accept_updates(PLAIN, [Message(1, 0, update(0, examples=50))], failures, MODEL, LIMITED)
    assert [u.num_examples for u in accepted] == [20] and failures == {}


@pytest.mark.parametrize(("chains", "bad", "checks", "first"), [
    (PLAIN, with_tensors(update(1, members=[1, 7], clients=2), w=torch.ones(5)), UpdateChecks(), "senders"),
    (PLAIN, with_tensors(update(1, applied=["secret"]), w=torch.ones(5)), UpdateChecks(), "decode"),
    (PLAIN, with_tensors(update(1), w=torch.tensor([float("nan")] * 4), n=torch.tensor([1, 2])), UpdateChecks(),
     "schema"),
    (COMBINING, replace(update(1, combining=True, examples=50), extras={"c": torch.ones(1)}), LIMITED, "schema"),
    (COMBINING, forged_layout(update(1, combining=True, examples=50)), LIMITED, "examples"),
    (COMBINING, forged_sum(forged_layout(update(1, combining=True))), UpdateChecks(), "layouts"),
], ids=["senders-before-schema", "decode-before-schema", "schema-before-finite", "schema-before-examples",
        "examples-before-layouts", "layouts-before-sums"])
def test_an_update_bad_in_two_ways_is_rejected_by_the_earlier_step(
    chains: Chains, bad: Update, checks: UpdateChecks, first: str
) -> None:
    accepted, failures, rejected = received(chains, bad, checks)
    expected = {"schema": "shape" if chains is PLAIN else "extras"}.get(first, BAD[first][3])
    assert accepted == [0, 2] and rejected == Counter({expected: 1})
    if first in BAD and first != "schema":
        assert BAD[first][4] in failures[1]


def test_the_documented_order_is_the_pipeline_s() -> None:
    """The module docstring and docs/architecture.md list the steps in :data:`STEPS` order."""
    doc = receive_module.__doc__ or ""
    assert tuple(re.findall(r"^\d\. ``(\w+)``", doc, re.M)) == STEPS
    page = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    section = page[page.index("## The receive pipeline"):]
    assert tuple(re.findall(r"^\d\. `(\w+)`", section, re.M)) == STEPS


class Scaling:
    """A decoder that halves the tensors it receives in place (its output the same tensors, edited)."""

    name = "scaling"
    accepts = frozenset(UpdateKind)
    combines_encoded = False

    def encode(self, payload: Update, ctx: PluginContext) -> Update:
        return replace(payload, applied=[*payload.applied, self.name])

    def decode(self, payload: Update, ctx: PluginContext) -> Update:
        for tensor in payload.tensors.values():
            if tensor.is_floating_point():
                tensor.mul_(float("inf") if ctx.client_id == 1 else 0.5)
        return replace(payload, applied=payload.applied[:-1])


def stacked_updates(stack: torch.Tensor, applied: list[str] | None = None) -> list[Message]:
    """One update per row of ``stack`` (a cohort's: each client's tensor a row of one stacked change)."""
    return [
        Message(1, cid, Update(UpdateKind.DELTA, {"w": row, "n": torch.tensor(1)}, 10, client_id=cid, applied=list(applied or [])))
        for cid, row in enumerate(stack.unbind(0))
    ]


def test_rows_of_a_stack_are_checked_together_and_a_non_finite_row_still_rejected() -> None:
    stack = torch.ones(4, 4)
    stack[2, 1] = float("nan")
    failures: dict[int, str] = {}
    rejected: Counter[str] = Counter()
    accepted = accept_updates(PLAIN, stacked_updates(stack), failures, MODEL, UpdateChecks(), rejected=rejected)
    assert [u.client_id for u in accepted] == [0, 1, 3]
    assert list(failures) == [2] and "tensor 'w' holds NaN or infinite values" in failures[2]
    assert rejected == Counter({"non_finite": 1})


def test_a_row_edited_in_place_after_the_stack_was_read_is_read_again() -> None:
    chains = Chains(client_send=Chain([Scaling()]))  # type: ignore[list-item]
    failures: dict[int, str] = {}
    accepted = accept_updates(chains, stacked_updates(torch.ones(3, 4), ["scaling"]), failures, MODEL, UpdateChecks())
    assert [u.client_id for u in accepted] == [0, 2]  # client 1's row became infinite in decoding: caught
    assert list(failures) == [1] and "holds NaN or infinite values" in failures[1]


def test_an_update_whose_applied_is_no_list_is_still_malformed() -> None:
    """Decoding is skipped only for an update no plugin encoded (``applied`` an empty list); any
    other ``applied`` goes through decoding as before, which refuses what is no list of names."""
    failures: dict[int, str] = {}
    rejected: Counter[str] = Counter()
    bad = Message(1, 0, Update(UpdateKind.DELTA, {"w": torch.ones(4), "n": torch.tensor(1)}, 10, client_id=0,
                               applied=None))  # type: ignore[arg-type]
    accepted = accept_updates(PLAIN, [bad], failures, MODEL, UpdateChecks(), rejected=rejected)
    assert accepted == [] and rejected == Counter({"malformed": 1})


def test_a_row_whose_stack_was_pointed_at_other_memory_is_read_on_its_own() -> None:
    stack = torch.ones(3, 4)
    replies = stacked_updates(stack)
    stack[1, 0] = float("nan")
    stack.set_(torch.ones(3, 4))  # the views keep the NaN; the stack now reads finite
    failures: dict[int, str] = {}
    accepted = accept_updates(PLAIN, replies, failures, MODEL, UpdateChecks())
    assert [u.client_id for u in accepted] == [0, 2] and list(failures) == [1]
