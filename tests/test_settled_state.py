"""A client keeps the state it trained in a round only when the server applied that round's
update (fedweave.federated.client's two phases, fedweave.federated.rounds.AcceptedRounds): rejected, skipped and
stale updates leave the client as if it had not trained, in simulation, in FedBuff, after a
resume, and for gRPC clients that keep their own state."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import assert_same_params, comparable, run_interrupted, run_to_end, small_config
from fedweave import runner
from fedweave.build import build_chains, build_client_runtime, build_task
from fedweave.federated.client import ClientRuntime, ClientStateStore
from fedweave.federated.rounds import AcceptedRounds
from fedweave.strategies.feddyn import LINEAR, FedDynClient
from fedweave.strategies.scaffold import CONTROL, ScaffoldClient
from fedweave.training import ClientJob
from fedweave.types import Update

CLIENT = {"scaffold": ScaffoldClient, "feddyn": FedDynClient}
KEY = {"scaffold": CONTROL, "feddyn": LINEAR}
SERVER_STATE = {"scaffold": "control", "feddyn": "h"}
TRAIN = {name: cls.train for name, cls in CLIENT.items()}
"""The unpatched client halves: each :class:`Script` wraps these, never an earlier script."""


class Script:
    """Patches a strategy's client half: the listed (round, client) pairs train and send a
    NaN update ("nan") or a valid one far from everybody's ("outlier"), or fail before
    training ("crash"); it records the state each client
    trained from and the state it left, per (round, client)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, strategy: str, faults: dict[tuple[int, int], str]):
        self.key = KEY[strategy]
        self.faults = faults
        self.before: dict[tuple[int, int], dict[str, torch.Tensor] | None] = {}
        self.after: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        original = TRAIN[strategy]

        def train(client: Any, job: ClientJob) -> Update:
            at = (job.instruction.round, job.client_id)
            fault = self.faults.get(at)
            if fault == "crash":
                raise RuntimeError("scripted crash before training")
            self.before[at] = _clone(job.state.get(self.key))
            update = original(client, job)
            self.after[at] = _clone(job.state[self.key])
            if fault == "nan":
                update = poison(update)
            elif fault == "outlier":
                update = dataclasses.replace(update, tensors={k: 50 * v for k, v in update.tensors.items()})
            return update

        monkeypatch.setattr(CLIENT[strategy], "train", train)


def poison(update: Update) -> Update:
    """``update`` with every tensor NaN: the server rejects it as non-finite."""
    return dataclasses.replace(update, tensors={k: torch.full_like(v, float("nan")) for k, v in update.tensors.items()})


def _clone(state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    return None if state is None else {k: v.clone() for k, v in state.items()}


def settled(store: ClientStateStore, accepted: AcceptedRounds) -> dict[int, dict[str, Any]]:
    """Each client's state as the server sees it: its pending state where the server applied that round."""
    states = dict(store.state_dict())
    for cid, (rnd, state) in store.pending_state_dict().items():
        if accepted.rounds.get(cid) == rnd:
            states[cid] = state
    return states


def assert_control_is_the_mean_of_the_clients(r: runner.Run) -> None:
    """SCAFFOLD's invariant c = (1/N) Σ_i c_i (all start at zero; c moves by (1/N) Σ_{i∈S} Δc_i)."""
    states = settled(r.store, r.parts.accepted)
    n = r.config.clients
    for name, c in r.parts.strategy.control.items():
        mean = sum(s[CONTROL][name] for s in states.values()) / n
        torch.testing.assert_close(c, mean, rtol=0, atol=1e-6)


def run(tmp_path: Path, *overrides: str) -> tuple[runner.Run, list[dict[str, Any]]]:
    r = runner.prepare(small_config(*overrides), tmp_path)
    return r, runner.execute(r)


def assert_later_rounds_start_alike(faulty: Script, absent: Script) -> None:
    """Every client trained every round after the first from the same state in both runs."""
    later = sorted(at for at in faulty.before if at[0] > 1)
    assert later == sorted(at for at in absent.before if at[0] > 1) and len(later) == 8
    for at in later:
        assert (absent.before[at] is None) == (faulty.before[at] is None), at
        if faulty.before[at] is not None:
            assert_same_params(absent.before[at], faulty.before[at])


@pytest.mark.parametrize("strategy", ["scaffold", "feddyn"])
def test_a_rejected_update_leaves_the_client_as_if_it_had_not_trained(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, strategy: str
) -> None:
    poisoned = Script(monkeypatch, strategy, {(1, 1): "nan"})
    r, records = run(tmp_path / "nan", f"strategy={strategy}")
    assert records[0]["clients_completed"] == 3
    assert poisoned.after[(1, 1)] is not None  # client 1 did train in round 1 ...
    assert poisoned.before[(2, 1)] is None  # ... and trains round 2 from its round-0 (initial, empty) state
    for cid in (0, 2, 3):  # the others from the state their applied round-1 update left
        assert_same_params(poisoned.before[(2, cid)], poisoned.after[(1, cid)])
    if strategy == "scaffold":
        assert_control_is_the_mean_of_the_clients(r)

    absent = Script(monkeypatch, strategy, {(1, 1): "crash"})
    r_absent, records_absent = run(tmp_path / "absent", f"strategy={strategy}")
    assert records_absent[0]["clients_completed"] == 3
    assert_same_params(r.params, r_absent.params)
    server_state = SERVER_STATE[strategy]
    assert_same_params(r.parts.strategy.state_dict()[server_state], r_absent.parts.strategy.state_dict()[server_state])
    assert [x["train_loss"] for x in records] == [x["train_loss"] for x in records_absent]
    assert_later_rounds_start_alike(poisoned, absent)


KRUM = ["strategy=scaffold", "aggregation={rule: multi_krum, byzantine: 0, multi_krum_m: 3}"]


def test_an_update_krum_discards_leaves_the_client_as_if_it_had_not_trained(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SCAFFOLD with Multi-Krum keeping 3 of the 4 updates: in round 1 it discards client 1's
    outlier, later the honest update farthest from the others. Each discarded client keeps
    its old c_i and c stays the mean of all c_i; the run equals the one in which client 1
    never sent its round-1 update (Krum keeps all three there)."""
    caplog.set_level(logging.INFO, logger="fedweave.federated.rounds")
    outlying = Script(monkeypatch, "scaffold", {(1, 1): "outlier"})
    r, records = run(tmp_path / "outlier", *KRUM)
    assert records[0]["clients_completed"] == 4
    assert "round 1: the aggregation rule discarded the updates of clients [1]" in caplog.text
    assert caplog.text.count("the aggregation rule discarded") == 3  # one client each round
    assert outlying.before[(2, 1)] is None  # client 1 trains round 2 from its initial state
    for cid in (0, 2, 3):  # the others from the state their kept round-1 update left
        assert_same_params(outlying.before[(2, cid)], outlying.after[(1, cid)])
    assert_control_is_the_mean_of_the_clients(r)

    absent = Script(monkeypatch, "scaffold", {(1, 1): "crash"})
    r_absent, records_absent = run(tmp_path / "absent", *KRUM)
    assert records_absent[0]["clients_completed"] == 3
    assert_same_params(r.params, r_absent.params)
    assert_same_params(r.parts.strategy.control, r_absent.parts.strategy.control)
    assert r.parts.accepted.rounds == r_absent.parts.accepted.rounds
    assert_later_rounds_start_alike(outlying, absent)


FAULTS = {(1, 1): "nan", (2, 0): "nan", (2, 1): "nan", (2, 2): "nan"}
"""Round 1: client 1's update is non-finite. Round 2: only client 3's is finite, below min_clients=2."""
SKIP = ["strategy=scaffold", "min_clients=2", "eval.federated_every=2"]


def test_a_skipped_round_commits_nobody(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = Script(monkeypatch, "scaffold", FAULTS)
    r, records = run(tmp_path / "skip", *SKIP)
    assert [x["skipped"] for x in records] == [False, True, False]
    assert records[1]["clients_completed"] == 1
    assert_same_params(script.before[(3, 3)], script.after[(1, 3)])  # client 3's applied round-1 state,
    assert any(not torch.equal(v, script.after[(1, 3)][k]) for k, v in script.after[(2, 3)].items())  # not round 2's
    assert script.before[(3, 1)] is None  # client 1: rejected in round 1, skipped in round 2
    assert_control_is_the_mean_of_the_clients(r)

    nobody = Script(monkeypatch, "scaffold", {(1, 1): "nan", **{(2, c): "crash" for c in range(4)}})
    r_nobody, _ = run(tmp_path / "nobody", *SKIP)
    assert_same_params(r.params, r_nobody.params)
    assert nobody.before[(3, 3)] is not None
    assert_same_params(nobody.before[(3, 3)], script.before[(3, 3)])


@pytest.mark.parametrize("stop_after", [1, 2])
def test_resume_after_rejected_and_skipped_rounds_is_bit_identical(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, stop_after: int
) -> None:
    Script(monkeypatch, "scaffold", FAULTS)
    whole, whole_records = run_to_end(tmp_path / "whole", *SKIP)
    resumed, resumed_records = run_interrupted(tmp_path / "resumed", stop_after, *SKIP)
    assert_same_params(whole, resumed)
    assert comparable(resumed_records) == comparable(whole_records)


@pytest.mark.parametrize(
    "buffer",
    [
        ["asynchronous.buffer_size=2", "asynchronous.max_staleness=1"],  # stale updates dropped
        ["asynchronous.buffer_size=3"],  # stale updates wait in the buffer while others arrive
        ["asynchronous.buffer_size=3", "asynchronous.server_lr=0.5",
         "aggregation={rule: multi_krum, byzantine: 0, multi_krum_m: 2}"],
    ],
    ids=["dropped", "waiting", "krum"],
)
def test_fedbuff_clients_keep_the_state_of_applied_updates_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, buffer: list[str]
) -> None:
    caplog.set_level(logging.INFO, logger="fedweave.federated.buffered")
    r, records = run(
        tmp_path,
        "strategy=scaffold", "heterogeneity.clock=virtual", "asynchronous.enabled=true", "local.steps=10",
        "heterogeneity.speeds=[1, 2, 4, 8]", "rounds=6", *buffer,
    )
    dropped = sum(x["clients_sampled"] - x["clients_completed"] for x in records)
    stale = sum(c["staleness"] > 0 for x in records for c in x["clients"])
    assert dropped >= 2 if "asynchronous.max_staleness=1" in buffer else (dropped == 0 and stale >= 4)
    krum = any("multi_krum" in b for b in buffer)  # Multi-Krum discards one update of each step's three
    assert caplog.text.count("the aggregation rule discarded") == (len(records) if krum else 0)
    assert_control_is_the_mean_of_the_clients(r)


FAST_GRPC = [
    "transport=grpc",
    "grpc.listen=127.0.0.1:0",
    "grpc.heartbeat_interval=0.1",
    "grpc.heartbeat_timeout=5.0",
    "grpc.poll_timeout=0.5",
    "grpc.rpc_timeout=5",
    "grpc.connect_timeout=5",
    "grpc.join_timeout=20",
    "grpc.backoff_initial=0.05",
    "grpc.backoff_max=0.5",
]


@contextmanager
def grpc_clients(config: Any, address: str) -> Iterator[list[ClientRuntime]]:
    """One gRPC client thread per client id, each with its own runtime and state store (as a
    client process has); they stop when the server ends the run."""
    from fedweave.transports.grpc.client import GrpcClient

    task = build_task(config)
    runtimes = [
        build_client_runtime(config, task, build_chains(config), ClientStateStore()) for _ in range(config.clients)
    ]
    nodes = [GrpcClient(config.grpc, cid, rt.handle, address=address) for cid, rt in enumerate(runtimes)]
    threads = [threading.Thread(target=node.run, daemon=True) for node in nodes]
    for t in threads:
        t.start()
    try:
        yield runtimes
    finally:
        for node, t in zip(nodes, threads):
            node.stop()
            t.join(timeout=15)
            assert not t.is_alive(), "a gRPC client did not stop"


def test_grpc_clients_keep_their_own_state_two_phase(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Over gRPC each client's own store commits only applied rounds: the run equals the in-memory run
    without client 1 in round 1, and every client process holds the in-memory run's states."""
    from fedweave.reach import server_topology

    overrides = ["strategy=scaffold", "rounds=3", "eval.federated_every=3"]
    Script(monkeypatch, "scaffold", {(1, 1): "crash"})
    absent, _ = run(tmp_path / "absent", *overrides)
    Script(monkeypatch, "scaffold", {(1, 1): "nan"})
    memory, _ = run(tmp_path / "memory", *overrides)
    config = small_config(*overrides, *FAST_GRPC)
    topology = server_topology(config)
    r = runner.prepare(config, tmp_path / "grpc", topology=topology)
    with grpc_clients(config, topology.transport.address) as runtimes:
        records = runner.run_rounds(r)  # closes the topology: the clients leave
    assert [x["clients_completed"] for x in records] == [3, 4, 4]
    assert_same_params(r.params, absent.params, atol=1e-6)
    assert_same_params(r.parts.strategy.control, absent.parts.strategy.control, atol=1e-6)
    assert r.parts.accepted.rounds == memory.parts.accepted.rounds == {0: 3, 1: 3, 2: 3, 3: 3}
    for cid, rt in enumerate(runtimes):  # the last round's evaluation committed every client's state
        assert not rt.store.pending_state_dict()
        assert_same_params(rt.store.get(cid)[CONTROL], memory.store.get(cid)[CONTROL], atol=1e-6)


def test_a_pre_aggregated_site_settles_each_of_its_members(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """FedPer keeps personal layers and is pre-aggregated by site leaders: the site's one update
    names its members, so a NaN member spoils (and settles) its whole site, and only that site."""
    from fedweave.strategies.fedper import FedPerClient

    original = FedPerClient.train
    kept: dict[tuple[int, int], bool] = {}  # (round, client) -> it trained from a personal state

    def train(client: Any, job: ClientJob) -> Update:
        kept[(job.instruction.round, job.client_id)] = "local" in job.state
        update = original(client, job)
        if (job.instruction.round, job.client_id) == (1, 0):
            update = poison(update)
        return update

    monkeypatch.setattr(FedPerClient, "train", train)
    r, records = run(tmp_path, "strategy.name=fedper", "topology={kind: hierarchical, sites: 2}", "rounds=2")
    assert [x["clients_completed"] for x in records] == [2, 4]  # round 1: site [0, 1] rejected as one update
    assert [kept[(2, c)] for c in range(4)] == [False, False, True, True]
    assert r.parts.accepted.rounds == {0: 2, 1: 2, 2: 2, 3: 2}
    assert sorted(r.store.pending_state_dict()) == [0, 1, 2, 3] and sorted(r.store.state_dict()) == [2, 3]
