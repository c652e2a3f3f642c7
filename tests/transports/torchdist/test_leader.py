"""The torch.distributed site exchange: this process as the leader (rank 0,
:class:`~fedweave.transports.torchdist.leader.TorchDistLeader`) and members
(:class:`~fedweave.transports.torchdist.member.TorchDistMember`) as subprocesses on
127.0.0.1, every collective bounded by ``torchdist.timeout``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port

from fedweave.config import TorchDistConfig
from fedweave.errors import TransportError
from fedweave.topologies.deploy import site_handler
from fedweave.topologies.hierarchical import combine
from fedweave.transports import serialization
from fedweave.transports.torchdist import leader as leader_mod
from fedweave.transports.torchdist.leader import TorchDistLeader
from fedweave.transports.torchdist.world import Rendezvous, World
from fedweave.types import Control, Instruction, Message, TaskKind, Update, UpdateKind, Work

TENSORS = 40

MEMBER = textwrap.dedent(
    """
    import os
    import sys
    import time
    import torch
    from fedweave.config import TorchDistConfig
    from fedweave.transports.torchdist import Rendezvous, TorchDistMember, World
    from fedweave.types import Control, Message, Update, UpdateKind

    rank, size, port, bucket = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    torch.set_num_threads(1)
    world = World(TorchDistConfig(timeout=30, bucket_mb=bucket), Rendezvous("127.0.0.1", port, rank, size))
    (group,) = world.site_groups([list(range(size))])

    def handler(msg):
        ins = msg.body
        c = msg.client_id
        if isinstance(ins, Control):  # answers its own tensor times ten plus its id, and the shared one
            if ins.step == "fail" and c == 1:
                raise ValueError("client 1 refuses the step")
            answer = {"seen": ins.tensors["mine"] * 10 + c, "keys": ins.tensors["keys"]}
            return Message(msg.round, c, Control(ins.plugin, ins.step, answer))
        time.sleep(ins.config.get("sleep", {}).get(str(c), 0))
        held = ins.config.get("hold", {}).get(str(c))  # trains until this file exists, at most 30 s
        for _ in range(600 if held else 0):
            if os.path.exists(held):
                break
            time.sleep(0.05)
        extras = {"c": torch.full((2,), float(c))} if ins.config.get("extras") else {}
        tensors = {k: v + c if v.is_floating_point() else v + c for k, v in ins.params.items()}
        return Message(msg.round, c, Update(UpdateKind.DELTA, tensors, c + 1, {"train_loss": float(c)}, extras=extras))

    TorchDistMember(world, group, list(range(size)), handler).serve()
    world.close()
    os._exit(0)  # skip torch's slow interpreter teardown
    """
)


def params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {f"layer{i}.weight": torch.randn(16, generator=gen) for i in range(TENSORS)}
    out["half"] = torch.randn(8, generator=gen).to(torch.bfloat16)
    out["steps"] = torch.tensor(7)
    return out


def expected(cid: int, p: dict[str, torch.Tensor], extras: bool = False) -> Update:
    return Update(
        UpdateKind.DELTA,
        {k: v + cid for k, v in p.items()},
        cid + 1,
        {"train_loss": float(cid)},
        extras={"c": torch.full((2,), float(cid))} if extras else {},
    )


class Site:
    """This process as rank 0 (leader), two member processes; member rank 2 serves clients 1 and 2."""

    def __init__(self, bucket_mb: float):
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", MEMBER, str(r), "3", str(port), str(bucket_mb)],
                env=env,
            )
            for r in (1, 2)
        ]
        self.world = World(
            TorchDistConfig(timeout=30, bucket_mb=bucket_mb),
            Rendezvous("127.0.0.1", port, 0, 3),
        )
        (group,) = self.world.site_groups([[0, 1, 2]])
        self.leader = TorchDistLeader(self.world, group, [0, 1, 2], {0: 1, 1: 2, 2: 2})

    def close(self) -> None:
        try:
            self.leader.close()
            self.world.close()
        finally:
            for p in self.procs:
                try:
                    assert p.wait(timeout=20) == 0
                finally:
                    p.kill()


def messages(rnd: int, p: dict[str, torch.Tensor], **config: object) -> list[Message]:
    return [
        Message(
            rnd, c, Instruction(rnd, TaskKind.TRAIN, Work(c, 8), p, config=dict(config))
        )
        for c in range(3)
    ]


def close_to(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float
) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and torch.allclose(a[k].double(), b[k].double(), atol=atol)
        for k in a
    )


def test_site_relays_and_pre_aggregates_with_one_collective_per_bucket() -> None:
    site = Site(bucket_mb=25.0)
    try:
        p = params()
        # relay: every update arrives whole, in the order of the messages
        site.leader.calls.clear()
        ex = site.leader.exchange(messages(1, p), timeout=30)
        assert not ex.failures
        assert [r.client_id for r in ex.replies] == [0, 1, 2]
        for r in ex.replies:
            assert close_to(r.body.tensors, expected(r.client_id, p).tensors, 0)
            assert r.body.num_examples == r.client_id + 1
        # 42 tensors, 3 clients, one bucket each way: header (length, bytes), payload (length, bucket),
        # reply headers (length, longest, bucket), mode (length, bytes), replies (length, longest, bucket)
        assert site.leader.calls == {"broadcast": 8, "gather": 4}
        # pre-aggregation by reduce: one update, the exact weighted mean
        site.leader.pre_aggregate = True
        site.leader.calls.clear()
        ex = site.leader.exchange(messages(2, p), timeout=30)
        (reply,) = ex.replies
        want = combine([expected(c, p) for c in range(3)], 0)
        assert reply.body.num_examples == 6 and reply.client_id == 0
        assert close_to(
            reply.body.tensors, want.tensors, 1e-2
        )  # bf16 rounding of the mean
        assert close_to(
            {k: v for k, v in reply.body.tensors.items() if k != "half"},
            {k: v for k, v in want.tensors.items() if k != "half"},
            1e-6,
        )
        assert reply.body.metrics["train_loss"] == pytest.approx(
            want.metrics["train_loss"]
        )
        assert (
            site.leader.calls["reduce"] == 2
        )  # one fp32 bucket (bf16 accumulates in fp32), one int64 max
        # extras (e.g. control variates) cannot be summed blindly: relayed even when pre-aggregating
        ex = site.leader.exchange(messages(3, p, extras=True), timeout=30)
        assert len(ex.replies) == 3
        assert all(
            torch.equal(r.body.extras["c"], torch.full((2,), float(r.client_id)))
            for r in ex.replies
        )
        # the leader's bucket size rules: 1 KiB buckets split the ~5 KiB payloads into several collectives
        site.world.bucket_bytes = 1024
        for pre in (False, True):
            site.leader.pre_aggregate = pre
            site.leader.calls.clear()
            ex = site.leader.exchange(messages(4, p), timeout=30)
            assert not ex.failures
            if pre:
                assert (
                    site.leader.calls["reduce"] == 4
                )  # 2576 fp32 bytes in 1 KiB buckets (3) + the counter
                assert close_to(ex.replies[0].body.tensors, want.tensors, 1e-2)
            else:
                assert (
                    site.leader.calls["broadcast"] > 10
                    and site.leader.calls["gather"] > 6
                )
                assert close_to(ex.replies[2].body.tensors, expected(2, p).tensors, 0)
    finally:
        site.close()


def controls(rnd: int, step: str = "share", ids: tuple[int, ...] = (0, 1, 2), size: int = 3) -> list[Message]:
    """Each client's own control step (its tensor ``mine`` = its id) with a key list they all receive."""
    keys = torch.arange(4, dtype=torch.int64)
    return [
        Message(rnd, c, Control("secagg", step, {"mine": torch.full((size,), float(c)), "keys": keys})) for c in ids
    ]


def test_site_relays_each_members_control_steps_and_never_reduces_the_answers() -> None:
    site = Site(bucket_mb=25.0)
    try:
        site.leader.pre_aggregate = True  # control answers are relayed all the same
        site.leader.calls.clear()
        sent = controls(1)
        ex = site.leader.exchange(sent, timeout=30)
        assert not ex.failures and [r.client_id for r in ex.replies] == [0, 1, 2]
        for r in ex.replies:
            c = r.client_id
            assert isinstance(r.body, Control) and (r.body.plugin, r.body.step) == ("secagg", "share")
            assert torch.equal(r.body.tensors["seen"], torch.full((3,), 11.0 * c))  # its own step reached it
            assert torch.equal(r.body.tensors["keys"], torch.arange(4))
        # each step encoded on its own and scattered (one bucket): member rank 2 gets clients 1 and 2's only
        assert ex.bytes_sent == sum(len(serialization.encode(m)) for m in sent)
        assert site.leader.calls["scatter"] == 1 and site.leader.calls["reduce"] == 0
        # small buckets: the scattered steps travel in several pieces
        site.world.bucket_bytes = 1024
        site.leader.calls.clear()
        sent = controls(2, size=600)  # 2.4 kB each
        ex = site.leader.exchange(sent, timeout=30)
        rank_two = sum(len(serialization.encode(m)) for m in sent[1:])  # the longest share, padded for all
        assert not ex.failures and site.leader.calls["scatter"] == -(-rank_two // 1024) > 1
        assert [r.body.tensors["seen"][-1].item() for r in ex.replies] == [0.0, 11.0, 22.0]
        # a client failing its step fails alone; instructions and control steps share an exchange
        ex = site.leader.exchange(controls(3, "fail", ids=(1, 2)) + messages(3, params())[:1], timeout=30)
        assert list(ex.failures) == [1] and ex.failures[1] == "ValueError: client 1 refuses the step"
        assert [(r.client_id, type(r.body).__name__) for r in ex.replies] == [(2, "Control"), (0, "Update")]
        # anything else is refused before the site's group is touched
        with pytest.raises(TransportError, match="instructions and control steps, not Update"):
            site.leader.exchange([Message(4, 0, expected(0, params()))], timeout=30)
        assert site.leader.broken is None
        assert not site.leader.exchange(controls(4), timeout=30).failures
    finally:
        site.close()


def test_a_member_past_the_timeout_fails_its_client_alone_and_a_stopped_one_fails_the_site_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """Client 0 trains until the test lets it (after the exchange returned): an exchange that waited
    for its training would hold it 30 s and then carry its update, not its failure. A stopped
    member fails the site after timeout + grace (2 s), well before the group's 30 s timeout."""
    monkeypatch.setattr(leader_mod, "ANSWER_GRACE", 1.0)
    site = Site(bucket_mb=25.0)
    release = tmp_path / "release"
    try:
        p = params()
        ex = site.leader.exchange(messages(1, p, hold={"0": str(release)}), timeout=1.0)
        release.touch()
        assert list(ex.failures) == [0] and ex.failures[0].startswith("missed the round deadline (")
        assert [r.client_id for r in ex.replies] == [1, 2]  # rank 2's clients are unaffected
        # the site is whole: client 0's late job finishes (its result dropped), then it trains again
        ex = site.leader.exchange(messages(2, p), timeout=30)
        assert not ex.failures and [r.client_id for r in ex.replies] == [0, 1, 2]
        assert close_to(ex.replies[0].body.tensors, expected(0, p).tensors, 0)
        # a member that cannot answer at all (its process stopped) fails the site after timeout + grace
        os.kill(site.procs[1].pid, signal.SIGSTOP)
        started = time.monotonic()
        ex = site.leader.exchange(messages(3, p), timeout=1.0)
        # the deadline and the grace (less a millisecond: torch truncates a wait to whole ms); not
        # the group's 30 s
        assert 1.99 <= time.monotonic() - started < 15
        assert sorted(ex.failures) == [0, 1, 2] and not ex.replies
        assert "site group broken: RuntimeError: not every rank of [0, 1, 2] took part in a" in ex.failures[2]
        # a gRPC site leader's reply says so, for the server to sample around the site's members
        reply = site_handler(site.leader, 0)(Message(4, 0, serialization.SiteJob(messages(4, p), timeout=1.0))).body
        assert isinstance(reply, serialization.SiteReply) and not reply.messages and sorted(reply.failures) == [0, 1, 2]
        assert reply.broken == site.leader.broken and reply.broken.startswith("RuntimeError: not every rank of [0, 1, 2]")
    finally:
        for proc in site.procs:
            proc.kill()
            proc.wait(timeout=10)
        site.world.close()

