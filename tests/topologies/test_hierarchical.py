"""Hierarchical topology: sites of any depth give the flat weighted average (exactly when pre-aggregated)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fedweave.errors import ConfigError
from fedweave.strategies.aggregate import weighted_average
from fedweave.topologies.hierarchical import (
    Hierarchical,
    Site,
    combinable,
    combine,
    exact_pre_aggregation,
    leaves,
    site_tree,
)
from fedweave.transports.base import Exchange
from fedweave.types import Instruction, Message, TaskKind, Update, UpdateKind, Work
from conftest import run_to_end, small_config

SIX = [
    "clients=6",
    "task.partition={scheme: dirichlet, alpha: 0.5}",
]  # unequal client sizes


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.parametrize(
    "sites",
    [
        "2",  # the shorthand: [[0, 1, 2], [3, 4, 5]]
        "[[0, 1], [2, 3, 4], [5]]",
        "[[[0, 1], [2]], [[3], [4, 5]]]",  # three levels: server, regions, sites
    ],
)
def test_hierarchical_fedavg_equals_flat(tmp_path: Path, sites: str) -> None:
    flat, _ = run_to_end(tmp_path / "flat", *SIX)
    tree, records = run_to_end(
        tmp_path / "tree", *SIX, f"topology={{kind: hierarchical, sites: {sites}}}"
    )
    assert max_diff(flat, tree) <= 1e-6
    assert all(not r["skipped"] for r in records)


def test_pre_aggregation_sends_one_update_per_site(tmp_path: Path) -> None:
    _, star = run_to_end(tmp_path / "star", *SIX)
    _, tree = run_to_end(
        tmp_path / "tree", *SIX, "topology={kind: hierarchical, sites: 2}"
    )
    # the server receives one update per site instead of one per client
    assert tree[0]["bytes_received"] * 3 == star[0]["bytes_received"]
    # ...but each stands for its site's three clients: completed counts clients, not sites
    assert tree[0]["clients_completed"] == star[0]["clients_completed"] == 6


def test_min_clients_counts_the_clients_behind_a_site_update(tmp_path: Path) -> None:
    _, tree = run_to_end(tmp_path / "tree", *SIX, "min_clients=5", "topology={kind: hierarchical, sites: 2}")
    assert all(not r["skipped"] for r in tree)


@pytest.mark.parametrize("strategy", ["scaffold", "fednova"])
def test_stateful_strategies_are_relayed_and_equal_flat(
    tmp_path: Path, strategy: str
) -> None:
    flat, _ = run_to_end(tmp_path / "flat", *SIX, f"strategy={strategy}")
    tree, records = run_to_end(
        tmp_path / "tree",
        *SIX,
        f"strategy={strategy}",
        "topology={kind: hierarchical, sites: [[[0, 1], [2]], [[3], [4, 5]]]}",
    )
    assert max_diff(flat, tree) <= 1e-6
    assert (
        records[0]["clients_completed"] == 6
    )  # relayed: every update reaches the server


def test_robust_rule_and_plugins_disable_pre_aggregation() -> None:
    from fedweave.build import strategy_class

    def exact(*overrides: str) -> bool:
        cfg = small_config("topology={kind: hierarchical, sites: 2}", *overrides)
        return exact_pre_aggregation(cfg, strategy_class(cfg))

    assert exact()
    assert not exact("aggregation.rule=median")
    assert not exact("strategy=scaffold")
    assert not exact("topology.pre_aggregate=never")
    assert not exact("plugins.client_receive=[dpsgd]")  # its ledger observes each client's report
    assert exact("plugins.client_receive=[identity]")


def test_site_tree_and_validation() -> None:
    assert site_tree(2, 5) == [[0, 1], [2, 3, 4]]
    assert leaves([[[0, 1], [2]], [3]]) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="exactly one site"):
        small_config("topology={kind: hierarchical, sites: [[0, 1], [1, 2, 3]]}")
    with pytest.raises(ConfigError, match="not a client id"):
        small_config("topology={kind: hierarchical, sites: [[0, 1], [2, 3, 9]]}")
    with pytest.raises(ConfigError, match="needs sites"):
        small_config("topology=hierarchical")


def _update(
    cid: int, value: float, n: int, kind: UpdateKind = UpdateKind.DELTA
) -> Update:
    return Update(
        kind,
        {"w": torch.full((3,), value), "c": torch.tensor([cid])},
        n,
        {"train_loss": value},
        client_id=cid,
    )


def test_combine_is_the_weighted_mean() -> None:
    ups = [_update(0, 1.0, 1), _update(1, 4.0, 3)]
    assert combinable(ups)
    out = combine(ups, 0)
    assert out.num_examples == 4
    assert out.clients == 2
    assert torch.allclose(out.tensors["w"], torch.full((3,), 3.25))
    assert int(out.tensors["c"]) == 1  # counters take the maximum
    assert out.metrics["train_loss"] == pytest.approx(3.25)
    assert not combinable([_update(0, 1.0, 1), _update(1, 1.0, 1, UpdateKind.WEIGHTS)])


class Echo:
    """A link whose clients answer a fixed update; client 2 fails."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        self.calls.append([m.client_id for m in messages])
        out = Exchange()
        for m in messages:
            if m.client_id == 2:
                out.failures[2] = "boom"
            else:
                out.replies.append(
                    Message(
                        m.round,
                        m.client_id,
                        _update(m.client_id, float(m.client_id), m.client_id + 1),
                    )
                )
        return out

    def close(self) -> None:
        pass


def test_site_failures_reach_the_server_and_weights_stay_exact() -> None:
    link = Echo()
    topo = Hierarchical([[0, 1, 2], [[3], [4]]], link, pre_aggregate=True)
    msgs = [
        Message(1, c, Instruction(1, TaskKind.TRAIN, Work(c, 4), {})) for c in range(5)
    ]
    ex = topo.exchange(msgs, None)
    assert ex.failures == {2: "boom"}
    got = weighted_average(
        [r.body.tensors for r in ex.replies], [r.body.num_examples for r in ex.replies]
    )
    flat = weighted_average(
        [_update(c, float(c), c + 1).tensors for c in (0, 1, 3, 4)], [1, 2, 4, 5]
    )
    assert torch.allclose(got["w"], flat["w"])
    assert isinstance(topo.root.members[1], Site)


def test_deployment_combinations_are_checked() -> None:
    with pytest.raises(ConfigError, match="topology.inner"):
        small_config("topology={kind: hierarchical, sites: 2}", "transport=grpc")
    with pytest.raises(ConfigError, match="ring gossip runs in simulation"):
        small_config("topology=ring", "transport=grpc")
    with pytest.raises(ConfigError, match="topology.outer"):
        small_config("topology={kind: hierarchical, sites: 2, outer: grpc}")
    cfg = small_config(
        "topology={kind: hierarchical, sites: 2, inner: torchdist, outer: grpc}",
        "transport=grpc",
        "launcher=process",
    )
    assert cfg.topology.inner == "torchdist"


class Claims(Echo):
    """Echo, but client 1 claims to stand for clients 0, 1 and 3."""

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        out = super().exchange(messages, timeout)
        for reply in out.replies:
            if reply.client_id == 1:
                reply.body = dataclasses.replace(reply.body, clients=3, members=[0, 1, 3])
        return out


def test_a_member_speaks_for_itself_and_a_site_for_its_members_only() -> None:
    topo = Hierarchical([[0, 1, 2], [[3], [4]]], Claims(), pre_aggregate=True)
    msgs = [Message(1, c, Instruction(1, TaskKind.TRAIN, Work(c, 4), {})) for c in range(5)]
    ex = topo.exchange(msgs, None)
    assert ex.failures == {2: "boom", 1: "rejected: it claims to stand for clients [0, 3], for whom its sender may not speak"}
    assert [(r.client_id, r.body.members) for r in ex.replies] == [(0, []), (3, [3, 4])]  # site 0: only client 0 left
    assert topo.site_members(1) == {0, 1, 2} and topo.site_members(4) == {3, 4}
    assert not combinable([_update(0, 1.0, 1), dataclasses.replace(_update(1, 1.0, 1), tensors={
        "w": torch.ones(3, dtype=torch.float64), "c": torch.tensor(1)})])  # another dtype: relayed, not averaged


class Leader(Echo):
    """A link that pre-aggregates, as a torch.distributed site leader does: one update for ``members``."""

    def __init__(self, members: list[int]) -> None:
        super().__init__()
        self.members = members

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        first = messages[0]
        combined = dataclasses.replace(_update(first.client_id, 1.0, 3), clients=len(self.members),
                                       members=self.members)
        return Exchange(replies=[Message(first.round, first.client_id, combined)])


@pytest.mark.parametrize(("members", "accepted"), [([0, 1], True), ([0, 1, 1], False), ([0, 3], False)])
def test_a_pre_aggregating_link_stands_for_the_sites_members_only(members: list[int], accepted: bool) -> None:
    site = Site([0, 1, 2], Leader(members), pre_aggregate=False, link_aggregates=True)
    msgs = [Message(1, c, Instruction(1, TaskKind.TRAIN, Work(c, 4), {})) for c in range(3)]
    ex = site.exchange(msgs, None)
    assert [r.body.members for r in ex.replies] == ([members] if accepted else [])
    assert (0 in ex.failures) != accepted
