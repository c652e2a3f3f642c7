"""A job's own deadline from the cohort's observed times, and the back-off of clients that miss it
(issue 26 item 7)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from conftest import small_config
from fedweave import runner
from fedweave.federated.buffered import _backing_off
from fedweave.build import build_chains, build_client_runtime, build_deadlines, build_task
from fedweave.federated.client import ClientStateStore
from fedweave.deadlines import Deadlines, backoff_rounds, job_deadline, quantile
from fedweave.reach import server_topology
from fedweave.transports.grpc.client import GrpcClient
from fedweave.types import Message
from test_settled_state import FAST_GRPC


def test_quantile_by_nearest_rank() -> None:
    times = [0.5, 0.1, 0.4, 0.2, 0.3]
    assert quantile(times, 1.0) == 0.5 and quantile(times, 0.5) == 0.3 and quantile(times, 0.2) == 0.1
    assert quantile(times, 0.9) == 0.5  # ⌈4.5⌉ = the 5th smallest
    assert quantile([0.1] * 20 + [9.0], 0.95) == 0.1  # ⌈19.95⌉ = 20th of 21: one outlier does not set it
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_job_deadline_is_a_multiple_of_the_quantile_between_its_floor_and_round_timeout() -> None:
    times = [0.027, 0.03, 0.025, 0.031]
    assert job_deadline(times, 1.0, 4.0, 0.05, 35.0) == pytest.approx(0.124)  # 4 x 0.031
    assert job_deadline(times, 1.0, 4.0, 1.0, 35.0) == 1.0  # the floor
    assert job_deadline([20.0], 1.0, 4.0, 1.0, 35.0) == 35.0  # never above round_timeout
    assert job_deadline([20.0], 1.0, 4.0, 1.0, None) == 80.0
    assert job_deadline([], 1.0, 4.0, 1.0, 35.0) == 35.0 and job_deadline([], 1.0, 4.0, 1.0, None) is None


def test_backoff_doubles_with_the_misses_seeded_and_bounded() -> None:
    assert [backoff_rounds(1, 0, r, 2, 8) for r in range(5)] == [1] * 5  # [1, 2): always 1
    for misses, (low, high) in ((2, (2, 3)), (3, (4, 7)), (4, (8, 15))):
        drawn = [backoff_rounds(misses, 0, r, 2, 100) for r in range(40)]
        assert low <= min(drawn) and max(drawn) <= high and len(set(drawn)) > 1
    assert backoff_rounds(3, 7, 5, 2, 100) == backoff_rounds(3, 7, 5, 2, 100)  # seeded
    assert backoff_rounds(10, 0, 1, 2, 8) == 8 and backoff_rounds(1, 0, 1, 2, 0) == 0


def test_a_client_missing_its_deadline_sits_out_and_one_answer_clears_it() -> None:
    d = Deadlines(4, factor=4.0, q=1.0, min_seconds=0.1, most_rounds=8, seed=0)
    d.observe(1, {0: 0.02, 1: 0.03}, missed=[2])
    assert d.deadline(35.0) == pytest.approx(0.12)
    assert d.excluded(2) == {2} and d.excluded(3) == set()  # one miss: one round out
    d.observe(3, {0: 0.02}, missed=[2])  # sampled again in round 3, missed again: 2 or 3 rounds out
    assert d.excluded(4) == {2} and d.excluded(5) == {2} and d.excluded(7) == set()
    d.observe(7, {2: 0.05}, missed=[])
    assert d.misses == {} and d.excluded(8) == set()


def test_deadlines_are_built_for_grpc_runs_only() -> None:
    assert build_deadlines(small_config()) is None
    assert build_deadlines(small_config("transport=grpc", "grpc.job_deadline_factor=null")) is None
    built = build_deadlines(small_config("transport=grpc", "grpc.job_deadline_min=2", "grpc.missed_deadline_backoff=3"))
    assert built is not None and (built.min_seconds, built.most_rounds, built.num_clients) == (2.0, 3, 4)


def test_a_client_that_never_answers_gets_a_short_deadline_and_is_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Client 3 heartbeats but never answers. Round 1 has no observed times: its jobs have
    round_timeout (3 s) and client 3 misses it. Each later round's jobs have the cohort's deadline
    (4 x the slowest observed answer, at least job_deadline_min 0.5 s), and client 3 is left out for
    its back-off: 1 round after one miss, 2 or 3 after two in a row."""
    config = small_config(*FAST_GRPC, "rounds=6", "round_timeout=3", "grpc.job_deadline_min=0.5",
                          "grpc.job_deadline_quantile=1.0")
    r = runner.prepare(config, tmp_path / "run", topology=server_topology(config))
    task = build_task(config)
    release = threading.Event()

    def never(msg: Message) -> Message:
        release.wait()
        raise RuntimeError("released at the end of the test")

    nodes = []
    for cid in range(4):
        handle = build_client_runtime(config, task, build_chains(config), ClientStateStore()).handle
        nodes.append(GrpcClient(config.grpc, cid, never if cid == 3 else handle, address=r.parts.topology.transport.address))
    threads = [threading.Thread(target=node.run, daemon=True) for node in nodes]
    for t in threads:
        t.start()
    try:
        with caplog.at_level(logging.INFO):
            records = runner.run_rounds(r)
    finally:
        release.set()
        for node in nodes:
            node.stop()
        for t in threads:
            t.join(timeout=10)
    assert records[0]["deadline"] == 3.0 and records[0]["clients_completed"] == 3
    assert all(0.5 <= x["deadline"] < 3.0 for x in records[1:])
    out = [x["backing_off"] for x in records]
    assert out[:3] == [[], [3], []]  # missed round 1: out of round 2; sampled in 3, missed again
    assert out[3] == [3] and out[4] == [3]  # two misses in a row: 2 or 3 rounds out
    sampled_again = [x["round"] for x in records if 3 not in x["backing_off"]]
    assert all(x["clients_completed"] == 3 for x in records)
    assert "client 3 missed its deadline (1 in a row): not sampled for 1 round" in caplog.text
    assert "client 3 missed its deadline (2 in a row)" in caplog.text
    assert sampled_again[:2] == [1, 3]


class RecordedJobs:
    """A :class:`~fedweave.transports.base.PostsJobs` that records who got a job, with which deadline."""

    def __init__(self) -> None:
        self.posted: list[tuple[int, float | None]] = []

    def post(self, messages: list[Message], timeout: float | None) -> None:
        self.posted.extend((m.client_id, timeout) for m in messages)


def test_fedbuff_jobs_get_the_cohort_deadline_and_none_goes_to_a_client_backing_off(tmp_path: Path) -> None:
    """Deployed FedBuff posts each job with the run's deadline: 4 x the slowest observed 0.25 s, below
    round_timeout 30; client 3 missed its deadline while step 1 was being filled, so it gets no job
    for steps 1 and 2, unless no other idle client is left."""
    config = small_config("asynchronous.enabled=true", "heterogeneity.clock=virtual", "round_timeout=30")
    r = runner.prepare(config, tmp_path / "run")
    server = r.buffered
    assert server is not None
    r.parts.deadlines = Deadlines(4, factor=4.0, q=1.0, min_seconds=0.5, most_rounds=8, seed=0)
    r.parts.deadlines.observe(1, {0: 0.2, 1: 0.25}, missed=[3])
    jobs = RecordedJobs()
    server.post(r.parts, r.params, jobs, _backing_off(r.parts, server, frozenset()))
    assert sorted(jobs.posted) == [(0, 1.0), (1, 1.0), (2, 1.0)]
    assert _backing_off(r.parts, server, frozenset({0, 1, 2})) == frozenset()  # no other idle client present
