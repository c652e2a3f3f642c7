"""Asynchronous aggregation deployed over gRPC (issue 16 item 1): FedBuff on the real clock."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from test_settled_state import FAST_GRPC

from conftest import free_port, poll, small_config
from fedweave import config as config_mod
from fedweave import rundir, runner
from fedweave.topologies.emulated import emulated_handler
from fedweave.build import build_chains, build_client_runtime, build_task
from fedweave.checkpoint import CHECKPOINT, load_checkpoint
from fedweave.federated.client import ClientStateStore
from fedweave.errors import ConfigError
from fedweave.reach import server_topology
from fedweave.transports.grpc.client import GrpcClient
from fedweave.types import Message

ASYNC = [*FAST_GRPC, "asynchronous.enabled=true", "checkpoint.every=1"]


def slowed(handle: Callable[[Message], Message], seconds: float) -> Callable[[Message], Message]:
    def slow(msg: Message) -> Message:
        time.sleep(seconds)
        return handle(msg)

    return slow


@contextmanager
def client_threads(
    config: Any,
    address: str,
    seconds: dict[int, float],
    wrap: dict[int, Callable[[Any], Any]] | None = None,
    stores: dict[int, ClientStateStore] | None = None,
) -> Iterator[list[threading.Thread]]:
    """A gRPC client thread for each id in ``seconds``, each sleeping that long before it trains
    (its handler passed through ``wrap[id]`` if given; its state in ``stores[id]``, made if absent)."""
    stores = {} if stores is None else stores
    from fedweave.transports.grpc.client import GrpcClient

    task = build_task(config)
    nodes = []
    for cid, wait in seconds.items():
        runtime = build_client_runtime(config, task, build_chains(config), stores.setdefault(cid, ClientStateStore()))
        handle = (wrap or {}).get(cid, lambda h: h)(runtime.handle)
        nodes.append(GrpcClient(config.grpc, cid, slowed(handle, wait), address=address))
    threads = [threading.Thread(target=node.run, daemon=True) for node in nodes]
    for t in threads:
        t.start()
    try:
        yield threads
    finally:
        for node in nodes:
            node.stop()
        for t in threads:
            t.join(timeout=10)


class HeldBack:
    """Holds a client's training until the server has taken ``lag`` steps past the version its job
    was trained on (its instruction's round is that version + 1), or the run's last step: its update
    then arrives exactly that stale, whatever the host's load does to the others' speed."""

    def __init__(self, lag: int, last: int) -> None:
        self.lag, self.last = lag, last
        self.steps = 0
        self.held = 0  # jobs held back
        self.cond = threading.Condition()

    def on_record(self, record: dict[str, Any]) -> None:
        with self.cond:
            self.steps = record["round"]
            self.cond.notify_all()

    def wrap(self, handle: Callable[[Message], Message]) -> Callable[[Message], Message]:
        def held(msg: Message) -> Message:
            with self.cond:
                self.held += 1
                target = min(msg.round - 1 + self.lag, self.last)
                assert self.cond.wait_for(lambda: self.steps >= target, timeout=60)
            return handle(msg)

        return held


def deployed(config: Any, run_dir: Path) -> runner.Run:
    topology = server_topology(config)
    return runner.prepare(config, run_dir, topology=topology)


def test_an_update_past_max_staleness_is_dropped_and_its_client_told_nothing_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two fast clients drive a step per arrival (K = 1); the slow one's update each time arrives
    3 server steps after the version it trained on (held back until then): past max_staleness, so
    it is dropped, never applied."""
    config = small_config(*ASYNC, "clients=3", "rounds=40", "asynchronous.buffer_size=1",
                          "asynchronous.max_staleness=2")
    r = deployed(config, tmp_path / "run")
    address = r.parts.topology.transport.address
    slow = HeldBack(3, 40)
    with caplog.at_level("INFO"), client_threads(config, address, {0: 0.05, 1: 0.05, 2: 0.0}, wrap={2: slow.wrap}):
        records = runner.run_rounds(r, slow.on_record)
    assert [x["round"] for x in records] == list(range(1, 41))
    assert all(c["staleness"] <= 2 and c["id"] != 2 for x in records for c in x["clients"])
    assert sum(x["clients_completed"] for x in records) == 40  # one update per step
    assert "update of client 2 dropped" in caplog.text
    assert slow.held >= 1 and 2 not in r.parts.accepted.rounds and {0, 1} <= set(r.parts.accepted.rounds)
    assert records[-1]["clock"] >= 1.0  # the real clock: 20 sleeps of 0.05 s at least per fast client
    assert sum(x["clients_sampled"] for x in records) > 40  # the dropped arrival counted in its step


def test_a_client_keeps_only_the_state_of_an_update_the_server_applied(tmp_path: Path) -> None:
    """SCAFFOLD: the fast clients commit the control variate of their last applied update; the slow
    client's updates are all dropped as too stale (each held back until 3 server steps past the
    version it trained on), so it commits none."""
    config = small_config(*ASYNC, "clients=3", "rounds=20", "asynchronous.buffer_size=1",
                          "asynchronous.max_staleness=2", "strategy=scaffold")
    r = deployed(config, tmp_path / "run")
    stores: dict[int, ClientStateStore] = {}
    slow = HeldBack(3, 20)
    with client_threads(config, r.parts.topology.transport.address, {0: 0.02, 1: 0.02, 2: 0.0},
                        wrap={2: slow.wrap}, stores=stores):
        runner.run_rounds(r, slow.on_record)
    assert slow.held >= 1 and 2 not in r.parts.accepted.rounds and {0, 1} <= set(r.parts.accepted.rounds)
    assert stores[2].get(2) == {}  # what it trained (at most pending still) was never committed
    for cid in (0, 1):
        assert stores[cid].get(cid), f"client {cid} committed no state"


def test_every_asynchronous_reply_is_checked_and_a_bad_one_never_applied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Client 2 sends NaN weights: each of its replies is rejected (non_finite) as in a synchronous
    round, counted in the step's record, and the other two carry every step."""
    config = small_config(*ASYNC, "clients=3", "rounds=10", "asynchronous.buffer_size=2")
    r = deployed(config, tmp_path / "run")

    def poisoned(handle: Callable[[Message], Message]) -> Callable[[Message], Message]:
        def poison(msg: Message) -> Message:
            reply = handle(msg)
            tensors = {k: v * float("nan") for k, v in reply.body.tensors.items()}
            return Message(reply.round, reply.client_id, dataclasses.replace(reply.body, tensors=tensors))

        return poison

    with caplog.at_level("INFO"), client_threads(
        config, r.parts.topology.transport.address, {0: 0.05, 1: 0.05, 2: 0.02}, wrap={2: poisoned}
    ):
        records = runner.run_rounds(r)
    assert [x["round"] for x in records] == list(range(1, 11))
    assert sum(x["rejected"].get("non_finite", 0) for x in records) >= 2
    assert all(c["id"] != 2 for x in records for c in x["clients"])
    assert 2 not in r.parts.accepted.rounds
    assert all(torch.isfinite(t).all() for t in r.params.values())
    assert "update of client 2 rejected: " in caplog.text


def test_a_client_killed_mid_training_does_not_stop_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Client 2 is a `fedweave client` process emulating a slow machine (it sleeps to speed 1 of 8);
    killed while it trains, its job fails as lost and the two others carry the run to its end."""
    port = free_port()
    config = small_config(*ASYNC, "clients=3", "rounds=60", "asynchronous.buffer_size=2",
                          "heterogeneity.speeds=[8, 8, 1]", "heterogeneity.slowdown=400",
                          "grpc.heartbeat_timeout=1.0", f"grpc.listen=127.0.0.1:{port}")
    path = tmp_path / "config.yaml"
    path.write_text(config_mod.to_yaml(config))
    r = deployed(config, tmp_path / "run")
    transport = r.parts.topology.transport
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedweave", "client", str(path), "--id", "2", "--address", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "FEDWEAVE_PARENT_PID": str(os.getpid())},
    )

    def kill_when_training() -> None:
        poll(lambda: transport.node_counts()[0] >= 3, 60)
        time.sleep(0.5)  # its job arrived at once; at speed 1 of 8 it trains for seconds
        proc.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_when_training, daemon=True)
    killer.start()
    try:
        with caplog.at_level("INFO"), client_threads(config, transport.address, {0: 0.05, 1: 0.05}):
            records = runner.run_rounds(r)
    finally:
        killer.join(timeout=70)
        proc.kill()
        proc.wait(5)
    assert proc.returncode == -signal.SIGKILL
    assert [x["round"] for x in records] == list(range(1, 61))
    assert "client 2 failed: lost" in caplog.text
    assert set(r.parts.accepted.rounds) == {0, 1}


class Events(logging.Handler):
    """What the server thread did, in order: jobs posted (``("job", id)``), what the test marked
    from ``on_record``, and the lines fedweave.federated.buffered logged (``("log", message)``)."""

    def __init__(self, transport: Any) -> None:
        super().__init__()
        self.seen: list[tuple[str, Any]] = []
        post = transport.post

        def recorded(messages: list[Message], timeout: float | None) -> None:
            self.seen.extend(("job", m.client_id) for m in messages)
            post(messages, timeout)

        transport.post = recorded

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(("log", record.getMessage()))

    def jobs(self, cid: int, start: tuple[str, Any], end: tuple[str, Any] | None = None) -> int:
        """The jobs posted to client ``cid`` between the events ``start`` and ``end`` (or the last)."""
        after = self.seen[self.seen.index(start):]
        between = after[:after.index(end)] if end is not None else after
        return between.count(("job", cid))


def test_a_killed_client_gets_no_job_until_it_registers_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 14 item 16 under FedBuff: client 2, a `fedweave client` process, is killed after server
    step 2. Once it is silent past heartbeat_timeout (1 s) the server posts it no job (without the
    check it would post it one per step, each failing at once as lost) while clients 0 and 1 carry
    steps 3-6; a client 2 registering again after step 6 gets jobs again and its updates count."""
    port = free_port()
    config = small_config(*ASYNC, "clients=3", "rounds=10", "asynchronous.buffer_size=2",
                          "grpc.heartbeat_timeout=1.0", f"grpc.listen=127.0.0.1:{port}")
    path = tmp_path / "config.yaml"
    path.write_text(config_mod.to_yaml(config))
    r = deployed(config, tmp_path / "run")
    transport = r.parts.topology.transport
    events = Events(transport)
    logging.getLogger("fedweave.federated.buffered").addHandler(events)
    caplog.set_level(logging.INFO, logger="fedweave")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedweave", "client", str(path), "--id", "2", "--address", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "FEDWEAVE_PARENT_PID": str(os.getpid())},
    )
    comeback: list[threading.Thread] = []
    again = GrpcClient(config.grpc, 2, build_client_runtime(
        config, build_task(config), build_chains(config), ClientStateStore()
    ).handle, address=transport.address)

    def on_record(record: dict[str, Any]) -> None:  # in the server's thread, between its steps
        if record["round"] == 2:
            proc.send_signal(signal.SIGKILL)
            poll(lambda: 2 in transport.absent(), 10, 0.02)
            events.seen.append(("mark", "gone"))
        elif record["round"] == 6:
            comeback.append(threading.Thread(target=again.run, daemon=True))
            comeback[0].start()
            poll(lambda: 2 not in transport.absent(), 10, 0.02)
            events.seen.append(("mark", "back"))

    try:
        with client_threads(config, transport.address, {0: 0.05, 1: 0.05}):
            records = runner.run_rounds(r, on_record)
    finally:
        logging.getLogger("fedweave.federated.buffered").removeHandler(events)
        proc.kill()
        proc.wait(5)
        again.stop()
        for thread in comeback:
            thread.join(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert [x["round"] for x in records] == list(range(1, 11))
    gone, back = ("mark", "gone"), ("mark", "back")
    assert events.jobs(2, gone, back) == 0  # known gone: no job, through four server steps
    assert events.jobs(0, gone, back) + events.jobs(1, gone, back) >= 6  # 8 updates, 2 maybe posted before
    assert events.jobs(2, back) >= 1
    lines = [what for kind, what in events.seen if kind == "log"]
    assert "clients [2] are gone (silent past the heartbeat timeout): no new jobs for them" in lines
    assert "clients [2] are back: they may get jobs again" in lines
    assert any(c["id"] == 2 for x in records[6:] for c in x["clients"])
    assert 2 in r.parts.accepted.rounds


@pytest.mark.parametrize("comes_back", [True, False])
def test_when_every_client_is_gone_the_server_waits_for_one_up_to_the_join_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, comes_back: bool
) -> None:
    """Both clients stop after server step 1 (silent: as if their machines died). Nothing in flight
    and nobody to post to, the server says so in one line and waits, without posting, up to
    grpc.join_timeout (2 s): a client 0 registering again 0.5 s into the wait carries the run to its
    end alone; with none, the run stops with one error line after the 2 s, its steps and model kept.
    (An update in flight at the stop may still arrive: the wait begins at step 2 or 3.)"""
    config = small_config(*ASYNC, "clients=2", "rounds=4", "asynchronous.buffer_size=1",
                          "grpc.heartbeat_timeout=0.5", "grpc.join_timeout=2")
    r = deployed(config, tmp_path / "run")
    transport = r.parts.topology.transport
    caplog.set_level(logging.INFO, logger="fedweave")
    task = build_task(config)
    nodes = [
        GrpcClient(config.grpc, cid, build_client_runtime(config, task, build_chains(config), ClientStateStore()).handle,
                   address=transport.address)
        for cid in (0, 1, 0)
    ]
    threads = [threading.Thread(target=node.run, daemon=True) for node in nodes]

    def on_record(record: dict[str, Any]) -> None:
        if record["round"] == 1:
            nodes[0].stop()
            nodes[1].stop()
            poll(lambda: transport.absent() == {0, 1}, 10, 0.02)
            if comes_back:
                threading.Timer(0.5, threads[2].start).start()

    for thread in threads[:2]:
        thread.start()
    try:
        records = runner.run_rounds(r, on_record)
    finally:
        for node in nodes:
            node.stop()
        for thread in threads:
            if thread.is_alive():
                thread.join(timeout=10)
    waits = [x for x in caplog.records if "are all gone (silent past the heartbeat timeout); waiting up to 2 s" in x.message]
    assert len(waits) == 1, caplog.text  # one line, not one per look
    stopped = [x for x in caplog.records if "came back within 2 s (grpc.join_timeout)" in x.message]
    if comes_back:
        assert [x["round"] for x in records] == [1, 2, 3, 4] and not stopped
        assert {c["id"] for x in records[2:] for c in x["clients"]} == {0}  # step 2 may take 1's last update
    else:
        assert [x["round"] for x in records][-1] < 4 and len(stopped) == 1
        assert 2.0 <= stopped[0].created - waits[0].created < 20  # the join wait, and bounded
        assert (tmp_path / "run" / rundir.MODEL_FILE).is_file()


def test_a_fedbuff_server_no_client_reached_fails_and_writes_no_model(tmp_path: Path) -> None:
    """Issue 26 item 8: FedBuff after 0 server steps (no client ever registered) ended as finished, w_0
    its model.pt. Now the run fails with one line, writes no model and resumes from its start."""
    from fedweave.errors import NothingTrained

    config = small_config(*ASYNC, "clients=2", "rounds=2", "grpc.heartbeat_timeout=0.5", "grpc.join_timeout=0.5")
    r = deployed(config, tmp_path / "run")
    with pytest.raises(NothingTrained, match=r"^the run trained nothing: it stopped before it applied any client's update;"):
        runner.run_rounds(r)
    assert not (tmp_path / "run" / rundir.MODEL_FILE).exists()
    assert load_checkpoint(tmp_path / "run")["round"] == 0


def test_a_killed_server_started_again_resumes_at_its_last_server_step(tmp_path: Path) -> None:
    """kill -9 the `fedweave server` after a few server steps and run the same command: it resumes
    after the checkpoint, its clients register again, and the steps go on to the end, each once.
    The clients, up before the server, keep trying to reach it for 120 s (grpc.connect_timeout): a
    loaded host may take longer than 5 s to start a server process."""
    port = free_port()
    config = small_config(*ASYNC, "clients=3", "rounds=40", "asynchronous.buffer_size=2",
                          f"grpc.listen=127.0.0.1:{port}", "grpc.connect_timeout=120")
    path = tmp_path / "config.yaml"
    path.write_text(config_mod.to_yaml(config))
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "fedweave", "server", str(path), "--run-dir", str(run_dir)]
    env = {**os.environ, "FEDWEAVE_PARENT_PID": str(os.getpid())}
    logs = [tmp_path / "server.log", tmp_path / "server-again.log"]

    def steps() -> list[int]:
        metrics = run_dir / rundir.METRICS_FILE
        return [json.loads(line)["round"] for line in metrics.read_text().splitlines()] if metrics.exists() else []

    with client_threads(config, f"127.0.0.1:{port}", {0: 0.05, 1: 0.05, 2: 0.1}) as threads:
        with logs[0].open("wb") as out:
            first = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            checkpoint = run_dir / CHECKPOINT
            poll(lambda: (len(steps()) >= 3 and checkpoint.is_file()) or first.poll() is not None, 180, 0.02)
            first.send_signal(signal.SIGKILL)
            first.wait(5)
        finally:
            first.kill()
        done = steps()
        assert 3 <= len(done) < 40, logs[0].read_text()[-2000:]
        saved = load_checkpoint(run_dir)["round"]  # a loaded box may write it some steps behind the records
        assert 1 <= saved <= done[-1]
        with logs[1].open("wb") as out:
            again = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=300)
        for thread in threads:  # told the run ended while they trained, they leave on their own (bounded, not timed)
            thread.join(timeout=30.0)
        assert not any(t.is_alive() for t in threads)
    assert again.returncode == 0, logs[1].read_text()[-3000:]
    assert steps() == list(range(1, 41))
    resumed = re.search(r"resuming .* after round (\d+)", logs[1].read_text())
    assert resumed and int(resumed[1]) == saved  # its last checkpoint, whatever the records ran ahead to
    clocks = [json.loads(line)["clock"] for line in (run_dir / rundir.METRICS_FILE).read_text().splitlines()]
    assert clocks == sorted(clocks)  # the real clock goes on from the checkpoint's
    assert (run_dir / rundir.MODEL_FILE).is_file()


def test_fedweave_run_with_the_process_launcher_runs_fedbuff_on_client_processes_of_emulated_speeds(
    tmp_path: Path,
) -> None:
    """`launcher: process`: the server and two `fedweave client` processes at speeds 4 and 1; the
    slow client's reported compute time is the emulated one, about 4 times the fast client's."""
    config = small_config(*ASYNC, "launcher=process", "clients=2", "rounds=10", "asynchronous.buffer_size=1",
                          "heterogeneity.speeds=[4, 1]", "heterogeneity.slowdown=10", output=tmp_path)
    r = runner.prepare(config, tmp_path / "run")
    records = runner.execute(r)
    assert [x["round"] for x in records] == list(range(1, 11))
    compute = {cid: [c["compute"] for x in records for c in x["clients"] if c["id"] == cid] for cid in (0, 1)}
    assert compute[0] and compute[1], compute
    assert min(compute[1]) > 2 * (sum(compute[0]) / len(compute[0]))
    assert (tmp_path / "run" / rundir.MODEL_FILE).is_file()


@pytest.mark.parametrize(
    ("overrides", "start"),
    [
        (["topology={kind: hierarchical, sites: 2}", "topology.inner=torchdist"],
         "config key 'topology.kind': asynchronous"),
        (["eval.federated_every=1"], "config key 'eval.federated_every': deployed asynchronous clients"),
        (["plugins.client_send=[secagg]"],
         "config key 'plugins.client_send[0]': plugin 'secagg' works per synchronous"),
        (["heterogeneity.clock=virtual"], "config key 'heterogeneity.clock': virtual is a simulation's clock"),
    ],
)
def test_a_deployed_asynchronous_config_that_cannot_run_is_one_line(overrides: list[str], start: str) -> None:
    with pytest.raises(ConfigError) as err:
        small_config(*ASYNC, *overrides)
    assert str(err.value).startswith(start) and "\n" not in str(err.value)


def test_a_deployed_client_sleeps_to_its_emulated_speed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speeds [4, 1], slowdown 1: client 1's emulated time is 4 times its training's CPU time and it
    sleeps until then; client 0's is its own time. Bounds the load cannot
    break: CPU time, the sleeps the handler asks for, and lower bounds of the wall time."""
    from fedweave.topologies import emulated

    config = small_config("transport=grpc", "clients=2", "heterogeneity.speeds=[4, 1]", "threads=1")
    slept: list[float] = []
    sleep = time.sleep
    monkeypatch.setattr(emulated.time, "sleep", lambda s: (slept.append(s), sleep(s)))
    spent = []

    def busy(msg: Message) -> Message:
        began = time.process_time()
        while time.process_time() - began < 0.05:
            pass
        spent.append(time.process_time() - began)
        return Message(msg.round, msg.client_id, _update(msg.client_id))

    for cid, factor in ((0, 1), (1, 4)):
        handle = emulated_handler(config, busy)
        slept.clear()
        began, cpu = time.perf_counter(), time.process_time()
        reply = handle(Message(1, cid, _instruction(cid)))
        took, cpu = time.perf_counter() - began, time.process_time() - cpu
        emulated_time = reply.body.compute_time
        assert factor * spent[-1] <= emulated_time <= max(took, factor * cpu), (cid, emulated_time, cpu, took)
        assert took >= emulated_time  # its reply waits until its emulated time
        assert slept or cid == 0  # the slow client sleeps; the other only ever up to its own CPU time (above)
    assert emulated_handler(small_config("transport=grpc"), busy) is busy


def _instruction(cid: int) -> Any:
    from fedweave.types import Instruction, TaskKind, Work

    return Instruction(1, TaskKind.TRAIN, Work(cid, 16), {})


def _update(cid: int) -> Any:
    from fedweave.types import Update, UpdateKind

    return Update(client_id=cid, kind=UpdateKind.DELTA, tensors={}, num_examples=16, local_steps=1)


@pytest.mark.parametrize("mode", ["synchronous", "asynchronous"])
def test_a_deployed_server_caps_an_inflated_claim_by_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """Over gRPC the server knows no client's size: client 2 claiming 10^6 examples is still counted
    as 3 x the cohort's median claim per client (aggregation.weight_policy cap, the default), in each
    synchronous round and in each FedBuff step that holds its update, and the record says so."""
    config = small_config(*ASYNC, f"asynchronous.enabled={mode == 'asynchronous'}", "rounds=4",
                          "asynchronous.buffer_size=2", "attacks.kind=inflate_examples", "attacks.clients=[2]")
    r = deployed(config, tmp_path / "run")
    with caplog.at_level("WARNING"), client_threads(config, r.parts.topology.transport.address, dict.fromkeys(range(4), 0.02)):
        records = runner.run_rounds(r)
    assert [x["round"] for x in records] == [1, 2, 3, 4]
    holding = [any(c["id"] == 2 for c in x["clients"]) for x in records]
    assert [x["capped"] for x in records] == [int(h) for h in holding] and any(holding)
    assert all(x["rejected"] == {} for x in records)
    size = 400 * 0.8 * 0.8 / 4  # synthetic samples, less the test set and each client's local test split
    assert re.search(rf"client 2 claims 1000000 examples, above its cohort's bound: counted as {3 * int(size)}\b",
                     caplog.text), caplog.text
