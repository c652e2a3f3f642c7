"""SiteBatches: one job per top-level site, whose answer stands for its members (or fails them all);
the members of a site whose leader is gone, or whose group broke, are not sampled."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import free_port, poll, small_config
from fedweave import config as config_mod
from fedweave import runner
from fedweave.federated.selection import sample_clients
from fedweave.build import build_chains, build_client_runtime, build_task, strategy_class
from fedweave.federated.client import ClientStateStore
from fedweave.reach import server_topology
from fedweave.seeding import numpy_rng
from fedweave.topologies.deploy import SiteBatches, TorchDistHierarchy, site_handler
from fedweave.topologies.hierarchical import combine
from fedweave.transports.base import Exchange
from fedweave.transports.inmemory import InMemoryTransport
from fedweave.transports.serialization import SiteJob, SiteReply
from fedweave.types import Instruction, Message, TaskKind, Update, UpdateKind, Work

PARAMS = {"w": torch.zeros(3)}


def leader(msg: Message) -> Message:
    """Site 0 pre-aggregates its members' updates (w + id, id + 1 examples); site 1 is down."""
    job = msg.body
    assert isinstance(job, SiteJob) and job.timeout == 9.0
    if msg.client_id == 1:
        raise ConnectionError("site 1 is down")
    updates = [Update(UpdateKind.WEIGHTS, {"w": m.body.params["w"] + m.client_id}, m.client_id + 1) for m in job.messages]
    first = job.messages[0].client_id
    return Message(msg.round, msg.client_id, SiteReply([Message(msg.round, first, combine(updates, first))], {}))


class Link:
    """Site leaders in this process: a leader that raises fails its site; counts one byte per job."""

    def __init__(self) -> None:
        self.jobs: list[Message] = []

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        out = Exchange(bytes_sent=len(messages))
        for m in messages:
            self.jobs.append(m)
            try:
                out.replies.append(leader(m))
            except ConnectionError as exc:
                out.failures[m.client_id] = f"{type(exc).__name__}: {exc}"
        return out

    def close(self) -> None:
        """Nothing to release."""


def test_each_site_gets_one_job_and_its_answer_stands_for_its_members() -> None:
    link = Link()
    topology = SiteBatches([[0, [1, 2]], [3]], link)
    messages = [Message(4, c, Instruction(4, TaskKind.TRAIN, Work(c, 8), PARAMS)) for c in (3, 2, 0, 1, 9)]
    ex = topology.exchange(messages, 9.0)
    # one job per site, holding its members' messages (a nested site is part of its top-level site)
    assert [(j.client_id, [m.client_id for m in j.body.messages]) for j in link.jobs] == [(0, [2, 0, 1]), (1, [3])]
    (reply,) = ex.replies
    assert reply.client_id == 2 and reply.body.clients == 3 and reply.body.num_examples == 3 + 1 + 2
    assert torch.allclose(reply.body.tensors["w"], torch.full((3,), (3 * 2 + 1 * 0 + 2 * 1) / 6))
    assert ex.failures == {
        3: "site 1: ConnectionError: site 1 is down",
        9: "the client is in no site of topology.sites",
    }
    assert ex.bytes_sent == 2  # the link's traffic is the topology's


class Gone(Link):
    """A link that knows site 1 is gone (and names a site that does not exist)."""

    def __init__(self) -> None:
        super().__init__()
        self.waited_for: list[int] = []

    def absent(self, wait_for: int = 0) -> frozenset[int]:
        self.waited_for.append(wait_for)
        return frozenset({1, 7})


def test_the_members_of_a_gone_site_are_gone() -> None:
    link = Gone()
    sites = SiteBatches([[0, [1, 2]], [3, 4], [5]], link)  # sites of 3, 2 and 1 members
    assert sites.absent() == frozenset({3, 4})
    # 3 clients asked for: the 2 smallest sites hold 1 + 2, so the link waits for 2 sites; 4 need all 3
    assert sites.absent(3) == sites.absent(4) == sites.absent(9) == frozenset({3, 4})
    assert link.waited_for == [0, 2, 3, 3]
    assert SiteBatches([[0, 1], [3]], Link()).absent() == frozenset()  # a link that cannot tell


class OneWorld:
    """A torch.distributed world that never runs a collective: its site groups are placeholders."""

    def site_groups(self, ranks: list[list[int]]) -> list[tuple[None, None]]:
        return [(None, None) for _ in ranks]

    def close(self) -> None:
        """Nothing to release."""


def test_in_one_world_the_members_of_a_site_whose_group_broke_are_gone() -> None:
    """Rank 0 leads every site of one torch.distributed world: a site's broken group (a collective
    failed, :class:`TorchDistLeader` tells why) takes its members out of the draw, the others stay."""
    config = small_config("clients=6", "topology={kind: hierarchical, sites: 3}", "topology.inner=torchdist")
    topology = TorchDistHierarchy(config, OneWorld(), strategy_class(config))  # type: ignore[arg-type]
    assert topology.absent() == frozenset()
    topology.links[2].broken = "RuntimeError: not every rank of [0, 5, 6] took part in a gather within 6 s"
    assert topology.absent(4) == frozenset(topology.links[2].members) == frozenset({4, 5})
    assert {4, 5} & set(sample_clients(numpy_rng(1, "sample", 2), 6, 3))  # the seeded draw takes one of them
    cohort = sample_clients(numpy_rng(1, "sample", 2), 6, 3, topology.absent())
    assert len(cohort) == 3 and not {4, 5} & set(cohort)


SITE_LEADER = textwrap.dedent(
    """
    import os
    import sys
    import torch
    from fedweave import config
    from fedweave.build import build_chains, build_client_runtime, build_task
    from fedweave.federated.client import ClientStateStore
    from fedweave.topologies.deploy import site_handler
    from fedweave.transports.grpc.client import GrpcClient
    from fedweave.transports.inmemory import InMemoryTransport

    torch.set_num_threads(1)
    path, site, address = sys.argv[1:]
    cfg = config.load(path)
    runtime = build_client_runtime(cfg, build_task(cfg), build_chains(cfg), ClientStateStore())
    handle = site_handler(InMemoryTransport(runtime.handle), int(site))
    GrpcClient(cfg.grpc, int(site), handle, role="site", address=address).run()
    os._exit(0)
    """
)
"""A site leader process whose members train in it (in a deployment they are torch.distributed
ranks of the site's own world: the server sees the same gRPC node)."""


def test_the_members_of_a_killed_site_leader_are_not_sampled_until_it_registers_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 14 item 16 behind site leaders: sites [[0, 1], [2, 3], [4, 5]], 3 of 6 clients a round.
    Site 2's leader, a process, is killed after round 1; once silent past heartbeat_timeout its
    members 4 and 5 are gone, so rounds 2 and 3 sample 3 of clients 0-3 (the seeded draw would
    pick 4 or 5 in both) and lose nobody. Site 2 registering again after round 3, rounds 4 and 5
    sample as the seeded draw does."""
    from fedweave.transports.grpc.client import GrpcClient

    port = free_port()
    config = small_config(
        "clients=6", "topology={kind: hierarchical, sites: 3}", "topology.inner=torchdist", "sample_fraction=0.5",
        "min_clients=1", "rounds=5", "seed=1", "checkpoint.every=0", "transport=grpc", f"grpc.listen=127.0.0.1:{port}",
        "grpc.heartbeat_interval=0.1", "grpc.heartbeat_timeout=1.0", "grpc.poll_timeout=0.5", "grpc.rpc_timeout=2",
        "grpc.connect_timeout=3", "grpc.join_timeout=60", "grpc.backoff_initial=0.05", "grpc.backoff_max=0.5",
    )
    seeded = {rnd: sample_clients(numpy_rng(1, "sample", rnd), 6, 3) for rnd in range(1, 6)}
    around = {rnd: sample_clients(numpy_rng(1, "sample", rnd), 6, 3, {4, 5}) for rnd in (2, 3)}
    assert all({4, 5} & set(seeded[rnd]) for rnd in (2, 3, 4))  # without the fix rounds 2 and 3 lose a client
    path = tmp_path / "config.yaml"
    path.write_text(config_mod.to_yaml(config))
    topology = server_topology(config)
    r = runner.prepare(config, tmp_path / "run", topology=topology)
    transport = topology.transport
    task = build_task(config)
    trained: dict[int, list[int]] = {}  # round -> the members the sites in this process trained

    def leader(site: int) -> GrpcClient:
        runtime = build_client_runtime(config, task, build_chains(config), ClientStateStore())

        def member(msg: Any) -> Any:
            trained.setdefault(msg.round, []).append(msg.client_id)
            return runtime.handle(msg)

        handle = site_handler(InMemoryTransport(member), site)
        return GrpcClient(config.grpc, site, handle, role="site", address=transport.address)

    leaders = [leader(0), leader(1), leader(2)]
    threads = [threading.Thread(target=node.run, daemon=True) for node in leaders]
    for thread in threads[:2]:
        thread.start()
    proc = subprocess.Popen(
        [sys.executable, "-c", SITE_LEADER, str(path), "2", transport.address],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )

    def between_rounds(record: dict[str, Any]) -> None:
        if record["round"] == 1:
            proc.send_signal(signal.SIGKILL)
            proc.wait(5)
            poll(lambda: 2 in transport.absent(), 5, 0.02)
        elif record["round"] == 3:
            threads[2].start()
            poll(lambda: 2 not in transport.absent(), 10, 0.02)

    caplog.set_level(logging.INFO, logger="fedweave")
    try:
        records = runner.run_rounds(r, between_rounds)  # closes the topology at the end
    finally:
        proc.kill()
        proc.wait(5)
        for node, thread in zip(leaders, threads):
            node.stop()
            if thread.is_alive():
                thread.join(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert [(x["clients_sampled"], x["clients_completed"]) for x in records] == [(3, 3)] * 5
    assert sorted(trained[1]) == [c for c in seeded[1] if c < 4]  # site 2's members trained in its process
    assert {rnd: sorted(trained[rnd]) for rnd in (2, 3, 4, 5)} == {**around, 4: seeded[4], 5: seeded[5]}
    assert "round 2: 2 clients [4, 5] gone (silent past the heartbeat timeout, or in a broken site); sampling the others" in caplog.text


class BreakingGroup:
    """A site's group in its leader's process: the members train until ``breaks`` is set, then the
    group is broken for good and fails every member at once, as a TorchDistLeader whose collective failed."""

    def __init__(self, members: InMemoryTransport) -> None:
        self.members = members
        self.breaks = False
        self.broken: str | None = None

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        if self.breaks and self.broken is None:
            self.broken = "RuntimeError: not every rank of [0, 1, 2] took part in a gather within 6 s"
        if self.broken is not None:
            return Exchange(failures={m.client_id: f"site group broken: {self.broken}" for m in messages})
        return self.members.exchange(messages, timeout)

    def close(self) -> None:
        """Nothing to release."""


def test_the_members_of_a_site_whose_group_broke_are_not_sampled_until_it_is_restarted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Sites [[0, 1], [2, 3], [4, 5]], 3 of 6 clients a round. Site 2's group breaks in round 2 (a
    member died; its leader stays heard from): the members of it drawn that round fail, and the
    server logs why once. Round 3 samples 3 of clients 0-3 (the seeded draw would take 4 or 5)
    and loses nobody. Site 2 restarted after round 3 (a fresh group, its leader registered
    again), rounds 4 and 5 sample as the seeded draw does."""
    from fedweave.transports.grpc.client import GrpcClient

    config = small_config(
        "clients=6", "topology={kind: hierarchical, sites: 3}", "topology.inner=torchdist", "sample_fraction=0.5",
        "min_clients=1", "rounds=5", "seed=1", "checkpoint.every=0", "transport=grpc", "grpc.listen=127.0.0.1:0",
        "grpc.heartbeat_interval=0.1", "grpc.heartbeat_timeout=1.0", "grpc.poll_timeout=0.5", "grpc.rpc_timeout=2",
        "grpc.connect_timeout=3", "grpc.join_timeout=60", "grpc.backoff_initial=0.05", "grpc.backoff_max=0.5",
    )
    seeded = {rnd: sample_clients(numpy_rng(1, "sample", rnd), 6, 3) for rnd in range(1, 6)}
    around = sample_clients(numpy_rng(1, "sample", 3), 6, 3, {4, 5})
    assert all({4, 5} & set(seeded[rnd]) for rnd in (2, 3))
    topology = server_topology(config)
    r = runner.prepare(config, tmp_path / "run", topology=topology)
    transport = topology.transport
    task = build_task(config)
    trained: dict[int, list[int]] = {}  # round -> the members that trained

    def members() -> InMemoryTransport:
        runtime = build_client_runtime(config, task, build_chains(config), ClientStateStore())

        def member(msg: Any) -> Any:
            trained.setdefault(msg.round, []).append(msg.client_id)
            return runtime.handle(msg)

        return InMemoryTransport(member)

    group = BreakingGroup(members())
    inner = [members(), members(), group, members()]  # site 2 restarted: a fresh group
    leaders = [
        GrpcClient(config.grpc, site, site_handler(inner[i], site), role="site", address=transport.address)
        for i, site in enumerate((0, 1, 2, 2))
    ]
    threads = [threading.Thread(target=node.run, daemon=True) for node in leaders]
    for thread in threads[:3]:
        thread.start()

    def between_rounds(record: dict[str, Any]) -> None:
        if record["round"] == 1:
            group.breaks = True
        elif record["round"] == 2:  # exactly site 2's members are gone, site 2 still heard from
            assert topology.absent() == frozenset({4, 5}) and transport.absent() == frozenset({2})
        elif record["round"] == 3:
            leaders[2].stop()
            threads[2].join(10)
            threads[3].start()
            assert poll(lambda: 2 not in transport.absent(), 10, 0.02)

    caplog.set_level(logging.INFO, logger="fedweave")
    try:
        records = runner.run_rounds(r, between_rounds)  # closes the topology at the end
    finally:
        for node, thread in zip(leaders, threads):
            node.stop()
            if thread.is_alive():
                thread.join(timeout=10)
    lost = len({4, 5} & set(seeded[2]))
    assert [(x["clients_sampled"], x["clients_completed"]) for x in records] == [(3, 3), (3, 3 - lost), (3, 3), (3, 3), (3, 3)]
    assert {rnd: sorted(trained[rnd]) for rnd in range(1, 6)} == {
        1: seeded[1], 2: [c for c in seeded[2] if c < 4], 3: around, 4: seeded[4], 5: seeded[5]
    }
    why = "RuntimeError: not every rank of [0, 1, 2] took part in a gather within 6 s"
    assert caplog.text.count(f"site 2 reports its group broken ({why})") == 1
    assert "round 3: 2 clients [4, 5] gone (silent past the heartbeat timeout, or in a broken site)" in caplog.text
    assert "round 4: 2 clients" not in caplog.text

