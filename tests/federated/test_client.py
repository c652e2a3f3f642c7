"""Tests of fedweave.federated.client: the state store, one runtime serving every client, the scale property,
control messages with per-client private plugin state."""

from __future__ import annotations

import dataclasses
import functools
import gc
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import LargestTensor, small_config
from fedweave import runner
from fedweave.federated.selection import sample_clients
from fedweave.build import build_chains, build_client_runtime, build_task, initial_params
from fedweave.federated.client import ClientData, ClientRuntime, ClientStateStore, Opened
from fedweave.plugins.chain import Chain, Chains
from fedweave.plugins.contracts import PluginContext
from fedweave.plugins.compression.topk import TopK, TopKHParams
from fedweave.plugins.compression.wire import DELTA, FORMAT, MODEL
from fedweave.seeding import numpy_rng
from fedweave.strategies.fedavg import FedAvg, FedAvgClient
from fedweave.task.models import MLP
from fedweave.training import ClientJob
from fedweave.types import Control, Evaluation, Instruction, Message, Params, TaskKind, Update, UpdateKind, Work


class CountingClient(FedAvgClient):
    """FedAvg whose clients with an even id count, in their state, the rounds they trained."""

    def train(self, job: ClientJob) -> Update:
        if job.client_id % 2 == 0:
            job.state["rounds"] = job.state.get("rounds", torch.tensor(0)) + 1
        return super().train(job)


class Counting(FedAvg):
    Client = CountingClient


COUNTING = f"{__name__}:Counting"


# --------------------------------------------------------------------------- the store


def test_client_data_keeps_test_rows_until_something_edits_them() -> None:
    x, y = torch.arange(20.0).reshape(10, 2), torch.arange(10)
    data = ClientData(x, y, train_idx=[torch.tensor([0, 1, 2])], test_idx=[torch.tensor([3, 4])])
    first = data.split(0)
    assert torch.equal(first[0], x[:3]) and torch.equal(first[1], y[:3])
    assert torch.equal(first[2], torch.tensor([[6.0, 7.0], [8.0, 9.0]])) and torch.equal(first[3], torch.tensor([3, 4]))
    again = data.split(0)
    assert again[2] is first[2] and again[3] is first[3]  # gathered once
    again[2].mul_(0)  # a job's in-place edit never reaches the next job
    edited = data.split(0)
    assert edited[2] is not again[2] and torch.equal(edited[2], torch.tensor([[6.0, 7.0], [8.0, 9.0]]))
    x[3] = 100.0  # nor is an edit of the dataset missed
    assert torch.equal(data.split(0)[2], torch.tensor([[100.0, 100.0], [8.0, 9.0]]))
    data.test_idx[0] = torch.tensor([5])
    assert torch.equal(data.split(0)[2], torch.tensor([[10.0, 11.0]])) and torch.equal(data.split(0)[3], torch.tensor([5]))


def test_client_data_splits_are_each_clients_split_gathered_in_one_pass() -> None:
    x, y = torch.arange(20.0).reshape(10, 2), torch.arange(10)
    data = ClientData(x, y, train_idx=[torch.tensor([4, 0]), torch.tensor([7]), torch.tensor([1, 2, 3])],
                      test_idx=[torch.tensor([5]), torch.tensor([6]), torch.tensor([8])])
    together = data.splits([2, 0, 1])
    for cid, split in zip([2, 0, 1], together):
        assert all(torch.equal(a, b) for a, b in zip(split, data.split(cid)))
    assert together[0][0].data_ptr() + 3 * 2 * 4 == together[1][0].data_ptr()  # rows of one gathered tensor


def test_client_data_splits_keeps_the_gathered_rows_until_something_edits_them() -> None:
    x, y = torch.arange(20.0).reshape(10, 2), torch.arange(10)
    data = ClientData(x, y, train_idx=[torch.tensor([4, 0]), torch.tensor([7]), torch.tensor([1, 2, 3])],
                      test_idx=[torch.tensor([5]), torch.tensor([6]), torch.tensor([8])])
    first = data.splits([2, 0])
    again = data.splits([2, 0])
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(first, again))  # the same clients: gathered once

    def fresh(cids: list[int]) -> list[tuple[torch.Tensor, ...]]:
        got = data.splits(cids)
        assert all(torch.equal(a, b) for split, cid in zip(got, cids) for a, b in zip(split, data.split(cid)))
        return got

    again[1][0].mul_(0)  # a job's in-place edit of its rows never reaches the next call
    edited = fresh([2, 0])
    assert edited[1][0] is not again[1][0] and torch.equal(edited[1][0], torch.tensor([[8.0, 9.0], [0.0, 1.0]]))
    x[1] = 100.0  # nor an edit of the dataset
    assert torch.equal(fresh([2, 0])[0][0][0], torch.tensor([100.0, 100.0]))
    data.train_idx[0] = torch.tensor([9])  # nor a client's new index
    assert torch.equal(fresh([2, 0])[1][0], torch.tensor([[18.0, 19.0]]))
    data.train_idx[0].fill_(8)  # nor an index edited in place
    assert torch.equal(fresh([2, 0])[1][1], torch.tensor([8]))
    assert len(fresh([0, 2, 1])) == 3 and len(fresh([1])) == 1  # other clients: their own rows


def test_store_keeps_copies_not_aliases() -> None:
    store = ClientStateStore()
    state = {"c": torch.zeros(2), "nested": {"m": torch.ones(1)}, "steps": 3}
    store.put(4, state)
    state["c"] += 1
    state["nested"]["m"] += 1
    got = store.get(4)
    assert torch.equal(got["c"], torch.zeros(2)) and torch.equal(got["nested"]["m"], torch.ones(1))
    assert got["steps"] == 3
    got["c"] += 5
    assert torch.equal(store.get(4)["c"], torch.zeros(2))


def test_store_holds_only_clients_with_state() -> None:
    store = ClientStateStore()
    store.put(1, {})
    assert len(store) == 0 and store.get(1) == {}
    store.put(1, {"x": torch.ones(1)})
    store.put(2, {"x": torch.ones(1)})
    store.put(1, {})  # a client that drops its state frees its slot
    assert len(store) == 1 and set(store.state_dict()) == {2}


def test_store_state_dict_round_trip() -> None:
    store = ClientStateStore()
    store.put(3, {"x": torch.tensor([1.5])})
    restored = ClientStateStore()
    restored.load_state_dict({"3": store.state_dict()[3]})  # keys may come back as strings
    assert torch.equal(restored.get(3)["x"], torch.tensor([1.5]))


def test_a_staged_state_is_committed_only_for_the_accepted_round() -> None:
    store = ClientStateStore()
    store.put(1, {"x": torch.tensor([1.0])})
    store.stage(1, 4, {"x": torch.tensor([2.0])})
    assert store.get(1)["x"].item() == 1.0 and len(store) == 1  # training goes on from the committed state
    store.settle(1, 3, training=False)  # an evaluation while round 4 is unsettled: still pending
    assert store.pending_state_dict()[1][0] == 4
    store.settle(1, 4, training=False)
    assert store.get(1)["x"].item() == 2.0 and not store.pending_state_dict()
    store.stage(1, 5, {"x": torch.tensor([3.0])})
    store.settle(1, 4, training=True)  # a new round, and round 5 was not applied: dropped
    assert store.get(1)["x"].item() == 2.0 and not store.pending_state_dict()
    store.stage(1, 6, {})  # a client that drops its state does so when round 6 is applied
    store.settle(1, 6, training=True)
    assert len(store) == 0
    store.stage(2, 1, {})  # no state before or after: nothing is kept
    assert len(store) == 0
    store.stage(2, 1, {"x": torch.tensor([7.0])})
    assert len(store) == 1 and store.get(2) == {}
    store.settle(2, None, training=True)  # a sender that does not track acceptance: commit
    assert store.get(2)["x"].item() == 7.0


def test_a_server_rolled_back_past_a_committed_state_is_warned_of_once(caplog: pytest.LogCaptureFixture) -> None:
    """A gRPC server restarted from a checkpoint older than the client's committed state (checkpoint.every
    > 1): the state cannot be rolled back, so the client says the run is no longer the uninterrupted one."""
    store = ClientStateStore()
    store.stage(1, 3, {"x": torch.tensor([3.0])})
    store.settle(1, 3, training=True)
    with caplog.at_level("WARNING"):
        store.settle(1, 3, training=True)  # the server applied up to round 3, as the client has: nothing to say
        assert not caplog.records
        store.settle(1, 2, training=True)
        store.settle(1, 2, training=True)
    assert [r.getMessage() for r in caplog.records] == [
        "client 1: its state is of round 3, but the server applied its updates only up to round 2 (a server "
        "restarted from a checkpoint older than its last round: checkpoint.every > 1 or checkpoint.min_interval > 0); "
        "the run goes on with the newer state, so it "
        "is not the same as an uninterrupted run"
    ]
    assert store.get(1)["x"].item() == 3.0

def test_pending_states_round_trip() -> None:
    store = ClientStateStore()
    store.stage(3, 2, {"x": torch.tensor([1.5])})
    restored = ClientStateStore()
    restored.load_pending_state_dict({"3": store.pending_state_dict()[3]})
    restored.settle(3, 2, training=True)
    assert torch.equal(restored.get(3)["x"], torch.tensor([1.5]))


def test_state_tensors_are_stored_compact() -> None:
    store = ClientStateStore()
    wide = torch.zeros(4, 4).t()
    store.put(0, {"w": wide, "view": torch.arange(100.0)[:2]})
    kept = store.state_dict()[0]
    assert kept["w"].is_contiguous()
    assert kept["view"].untyped_storage().nbytes() == 2 * 4  # not the 100-element base


# --------------------------------------------------------------------------- the runtime


@pytest.fixture(scope="module")
def runtime_and_params() -> tuple[ClientRuntime, Params]:
    config = small_config(f"strategy={COUNTING}")
    task = build_task(config)
    runtime = build_client_runtime(config, task, build_chains(config), ClientStateStore())
    return runtime, initial_params(config, task)


def train_message(cid: int, params: Params, rnd: int = 1, **config: Any) -> Message:
    return Message(rnd, cid, Instruction(rnd, TaskKind.TRAIN, Work(cid, 16), params, config=config))


def test_one_model_serves_every_client_without_carrying_anything_over(
    runtime_and_params: tuple[ClientRuntime, Params],
) -> None:
    runtime, params = runtime_and_params
    model = runtime.model
    fresh = runtime.handle(train_message(1, params)).body
    runtime.handle(train_message(0, params))
    after_other = runtime.handle(train_message(1, params)).body
    assert runtime.model is model
    assert fresh.client_id == after_other.client_id == 1
    for name in fresh.tensors:
        assert torch.equal(fresh.tensors[name], after_other.tensors[name])
    assert fresh.num_examples == len(runtime.data.train_idx[1])
    assert fresh.compute_time > 0


def test_instruction_config_changes_the_rounds_local_training(runtime_and_params: tuple[ClientRuntime, Params]) -> None:
    runtime, params = runtime_and_params
    frozen = runtime.handle(train_message(1, params, lr=1e-30)).body
    assert all(float(t.abs().max()) < 1e-20 for t in frozen.tensors.values() if t.is_floating_point())
    n = runtime.data.train_size(1)
    per_epoch = -(-n // 16)
    assert runtime.handle(train_message(1, params)).body.local_steps == per_epoch
    assert runtime.handle(train_message(1, params, epochs=3)).body.local_steps == 3 * per_epoch
    assert runtime.handle(train_message(1, params, epochs=3, steps=2)).body.local_steps == 2  # steps overrides epochs
    assert runtime.handle(train_message(1, params, batch_size=n)).body.local_steps == 1
    message = train_message(1, params, epochs=2)  # epochs set by the strategy, though the controller assigned steps
    message.body.work = Work(1, 16, local_steps=5)
    assert runtime.handle(message).body.local_steps == 2 * per_epoch
    adam = runtime.handle(train_message(1, params, optimizer="adam", lr=0.01)).body
    sgd = runtime.handle(train_message(1, params, lr=0.01)).body
    assert any(not torch.equal(adam.tensors[k], sgd.tensors[k]) for k in adam.tensors)


@pytest.mark.parametrize(
    ("config", "line"),
    [
        ({"mu": 0.5}, "client 1: instruction config key 'mu' is unknown; an instruction may set epochs, steps, batch_size, "
                      "optimizer, lr, momentum, weight_decay, accepted_round, the keys its strategy's client half reads "
                      "(instruction_keys) and '<plugin>.<key>' of this client's plugins"),
        ({"privacy": 1.0}, "client 1: instruction config key 'privacy' is unknown;"),
        ({"dp_central.clip": 1.0}, "client 1: instruction config key 'dp_central.clip' is unknown;"),  # no such plugin here
        ({"optimizer": "adamw"}, "client 1: instruction config key 'optimizer': 'adamw' is not allowed; expected one of "
                                 "'sgd', 'adam' (did you mean 'adam'?)"),
        ({"lr": -0.1}, "client 1: instruction config key 'lr': must be > 0, got -0.1"),
        ({"epochs": 0}, "client 1: instruction config key 'epochs': must be >= 1, got 0"),
        ({"epochs": 2.5}, "client 1: instruction config key 'epochs': expected an integer, got 2.5"),
        ({"epochs": True}, "client 1: instruction config key 'epochs': expected an integer, got True"),
        ({"momentum": 1.0}, "client 1: instruction config key 'momentum': must be < 1, got 1.0"),
        ({"device": "cuda"}, "client 1: instruction config key 'device' is unknown;"),  # the site's, not the server's
    ],
)
def test_an_instruction_key_the_client_cannot_honour_is_refused_in_one_line(
    runtime_and_params: tuple[ClientRuntime, Params], config: dict[str, Any], line: str
) -> None:
    runtime, params = runtime_and_params
    with pytest.raises(ValueError) as refused:
        runtime.handle(train_message(1, params, **config))
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)
    evaluation = Message(1, 1, Instruction(1, TaskKind.EVALUATE, Work(1, 64), params, config=config))
    with pytest.raises(ValueError, match=r"^client 1: instruction config key"):
        runtime.handle(evaluation)


class ReadsMu(FedAvgClient):
    """A client half that reads a key of its own in the instruction, and reports a training metric."""

    instruction_keys = frozenset({"mu"})
    train_metrics = frozenset({"train_mu"})

    def train(self, job: ClientJob) -> Update:
        update = super().train(job)
        update.metrics.update(train_mu=float(job.instruction.config.get("mu", 0.0)), accuracy=0.5)
        return update


class PerRoundEpochs(FedAvg):
    """FedAvg whose server half asks for ``round`` epochs in each round, and ``mu = round / 10``."""

    Client = ReadsMu

    def configure(self, rnd: int, params: Params, plan: list[Work]) -> list[Instruction]:
        return [dataclasses.replace(i, config={"epochs": rnd, "mu": rnd / 10}) for i in super().configure(rnd, params, plan)]


def test_epochs_a_strategy_sets_per_round_are_honoured_and_declared_metrics_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The server half asks for r epochs in round r: every client takes r passes over its data; the
    metric its client half declares is recorded as the example-weighted mean; an undeclared one is
    refused, in one line naming it, once."""
    config = small_config(f"strategy={__name__}:PerRoundEpochs")
    sizes = build_task(config).clients.train_size
    with caplog.at_level("WARNING", logger="fedweave.federated.client"):
        records = runner.execute(runner.prepare(config, tmp_path))
    for record in records:
        rnd = record["round"]
        assert [c["steps"] for c in record["clients"]] == [rnd * -(-sizes(c["id"]) // 16) for c in record["clients"]]
        assert record["train_mu"] == pytest.approx(rnd / 10, rel=1e-12)
        assert "accuracy" not in record and "train_accuracy" not in record
    refused = [r.getMessage() for r in caplog.records if "accuracy" in r.getMessage()]
    assert refused == [
        "client 0: training metric 'accuracy' is refused: its strategy's client half does not declare it "
        "(train_metrics; declared: train_loss, train_mu), so no record would hold it"
    ]


def test_a_declared_training_metric_must_be_named_as_records_name_them() -> None:
    from fedweave.strategies.base import training_metrics

    class Misnamed(FedAvgClient):
        train_metrics = frozenset({"accuracy"})

    assert training_metrics(ReadsMu) == training_metrics(ReadsMu(None)) == {"train_loss", "train_mu"}
    assert training_metrics(FedAvgClient) == {"train_loss"}
    with pytest.raises(ValueError, match=r"^.*Misnamed.train_metrics: 'accuracy' does not start with 'train_'"):
        training_metrics(Misnamed)


def test_evaluate_message(runtime_and_params: tuple[ClientRuntime, Params]) -> None:
    runtime, params = runtime_and_params
    reply = runtime.handle(Message(2, 3, Instruction(2, TaskKind.EVALUATE, Work(3, 64), params)))
    assert isinstance(reply.body, Evaluation)
    assert reply.body.client_id == 3 and reply.body.num_examples == len(runtime.data.test_idx[3])
    assert 0.0 <= reply.body.metrics["accuracy"] <= 1.0


def test_client_state_is_restored_and_kept(runtime_and_params: tuple[ClientRuntime, Params]) -> None:
    runtime, params = runtime_and_params
    runtime.store.load_state_dict({})
    runtime.store.load_pending_state_dict({})
    accepted = {1: 0, 2: 1, 3: 2, 4: 2, 5: 4}  # round -> the last applied round the server tells: round 3 rejected
    for rnd in (1, 2, 3, 4, 5):
        runtime.handle(train_message(0, params, rnd, accepted_round=accepted[rnd]))
        runtime.handle(train_message(1, params, rnd, accepted_round=accepted[rnd]))
    assert set(runtime.store.state_dict()) == {0}
    assert runtime.store.get(0)["rounds"].item() == 3  # rounds 1, 2 and 4; round 5 pending
    runtime.handle(Message(5, 0, Instruction(5, TaskKind.EVALUATE, Work(0, 64), params, {"accepted_round": 5})))
    assert runtime.store.get(0)["rounds"].item() == 4 and not runtime.store.pending_state_dict()


def test_bad_messages(runtime_and_params: tuple[ClientRuntime, Params]) -> None:
    runtime, params = runtime_and_params
    with pytest.raises(ValueError, match=r"client id 9 is outside 0\.\.3"):
        runtime.handle(train_message(9, params))
    with pytest.raises(TypeError, match="client 0 expected an instruction, got Evaluation"):
        runtime.handle(Message(1, 0, Evaluation(1, {})))
    with pytest.raises(ValueError, match="client 0: instruction config 'accepted_round' is -1, not a round >= 0"):
        runtime.handle(train_message(0, params, accepted_round=-1))
    encoded = train_message(0, params)
    encoded.body.applied = ["zip"]  # a plugin this client lacks: refused though it has no plugin at all
    with pytest.raises(ValueError, match="encoded by plugin 'zip', which this side's chain lacks"):
        runtime.handle(encoded)


def test_a_client_without_plugins_opens_an_instruction_as_it_came(
    runtime_and_params: tuple[ClientRuntime, Params],
) -> None:
    runtime, params = runtime_and_params
    msg = train_message(2, params)
    opened = runtime.open(msg)
    assert isinstance(opened, Opened) and opened.instruction is msg.body and opened.ctx is None
    assert 2 not in runtime.plugin_state  # no context, no plugin state kept for it
    runtime.release(2)


# --------------------------------------------------------------------------- scale


SCALE = [
    "clients=200",
    "sample_fraction=0.1",
    "task.dataset_options={samples: 2000, features: 8, classes: 4}",
    "eval.every=0",
]


def test_models_do_not_grow_with_clients(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 clients, 20 a round: a constant number of model instances, never one per client."""
    built: Counter[str] = Counter()
    alive: weakref.WeakSet[MLP] = weakref.WeakSet()
    original = MLP.__init__

    @functools.wraps(original)  # the model builder reads the signature
    def counting_init(self: MLP, *args: Any, **kwargs: Any) -> None:
        built["models"] += 1
        alive.add(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(MLP, "__init__", counting_init)
    peak = 0

    def measure(record: dict[str, Any]) -> None:
        nonlocal peak
        gc.collect()
        peak = max(peak, len(alive))

    few = runner.prepare(small_config(), tmp_path / "few")
    runner.execute(few)
    built_for_four = built["models"]
    built.clear()
    alive.clear()
    many = runner.prepare(small_config(*SCALE, f"strategy={COUNTING}"), tmp_path / "many")
    records = runner.execute(many, measure)
    assert [r["clients_sampled"] for r in records] == [20, 20, 20]
    assert built["models"] == built_for_four <= 3
    assert peak <= 2

    sampled = [sample_clients(numpy_rng(0, "sample", rnd), 200, 20) for rnd in (1, 2, 3)]
    even_rounds = Counter(cid for ids in sampled for cid in ids if cid % 2 == 0)
    # Every update was applied, but a client hears so only in its next instruction: the state of
    # its last round is pending (the server's record says it is to be kept), the one before committed.
    pending = many.store.pending_state_dict()
    assert {cid: int(s["rounds"]) for cid, (_, s) in pending.items()} == dict(even_rounds)
    assert all(many.parts.accepted.rounds[cid] == rnd for cid, (rnd, _) in pending.items())
    committed = {cid: int(s["rounds"]) for cid, s in many.store.state_dict().items()}
    assert committed == {cid: n - 1 for cid, n in even_rounds.items() if n > 1}
    assert len(many.store) == len(even_rounds)  # only clients that had state, and no others


def test_a_stateless_strategy_keeps_no_client_state(tmp_path: Path) -> None:
    r = runner.prepare(small_config(*SCALE), tmp_path)
    runner.execute(r)
    assert len(r.store) == 0


def test_the_planned_local_work_is_followed(runtime_and_params: tuple[ClientRuntime, Params]) -> None:
    runtime, params = runtime_and_params
    message = train_message(2, params)
    message = dataclasses.replace(
        message, body=dataclasses.replace(message.body, work=Work(2, batch_size=4, local_steps=3))
    )
    assert runtime.handle(message).body.local_steps == 3


# --------------------------------------------------------------------------- control messages


class Tally:
    """A plugin with a client half: each client counts, in its private state, the control
    messages it got and answers the count; ``reset`` empties its state."""

    name = "tally"
    accepts = frozenset(UpdateKind)
    combines_encoded = False

    def answer(self, control: Control, ctx: PluginContext) -> Control:
        assert ctx.side == "client" and ctx.state is not None
        if control.step == "reset":
            ctx.state.clear()
            return Control("tally", "reset")
        ctx.state["n"] = ctx.state.get("n", 0) + int(control.tensors["add"])
        return Control("tally", "count", {"n": torch.tensor([ctx.state["n"]])})

    def encode(self, payload: Any, ctx: PluginContext) -> Any:
        return payload

    def decode(self, payload: Any, ctx: PluginContext) -> Any:
        return payload


def test_control_messages_reach_their_plugin_with_each_clients_private_state(
    runtime_and_params: tuple[ClientRuntime, Params],
) -> None:
    runtime, _ = runtime_and_params
    tally = Tally()
    served = ClientRuntime(
        runtime.algorithm, runtime.data, runtime.model, runtime.loss_fn, runtime.settings,
        Chains(client_send=Chain([tally])), ClientStateStore(), runtime.seed,
    )

    def count(cid: int, add: int) -> int:
        reply = served.handle(Message(1, cid, Control("tally", "count", {"add": torch.tensor([add])})))
        assert reply.client_id == cid and reply.body.plugin == "tally"
        return int(reply.body.tensors["n"])

    assert [count(0, 1), count(1, 5), count(0, 2), count(1, 1)] == [1, 5, 3, 6]  # one state per client
    assert served.plugin_state == {0: {"n": 3}, 1: {"n": 6}}
    served.handle(Message(1, 0, Control("tally", "reset")))
    assert served.plugin_state == {1: {"n": 6}}  # an emptied state is dropped
    with pytest.raises(ValueError, match="no plugin of this client answers control messages of 'secagg'"):
        served.handle(Message(1, 1, Control("secagg", "advertise")))
    with pytest.raises(ValueError, match=r"client id 9 is outside 0\.\.3"):
        served.handle(Message(1, 9, Control("tally", "count", {"add": torch.tensor([1])})))


def test_a_compressed_broadcast_whose_layout_is_not_the_model_s_is_refused_before_it_is_decoded(
    runtime_and_params: tuple[ClientRuntime, Params],
) -> None:
    """A server (or anyone speaking for it) sends a top-k delta whose layout claims 2^26 entries
    for a tensor of the client's model: the client refuses it naming both layouts, before building
    anything (no tensor of more entries than the model's largest), and still trains on an honest
    broadcast afterwards."""
    runtime, params = runtime_and_params
    plugin = TopK(TopKHParams())
    client = ClientRuntime(runtime.algorithm, runtime.data, runtime.model, runtime.loss_fn, runtime.settings,
                           Chains(server_send=Chain([plugin])), ClientStateStore(), runtime.seed)
    dense = train_message(0, params)
    dense.body.applied = ["topk"]
    dense.body.params = {**params, MODEL: torch.tensor([FORMAT, 7])}  # the model of id 7
    client.handle(dense)  # the dense model, through the plugin: what the client holds from now on
    name = next(k for k, v in params.items() if v.is_floating_point())
    forged = {k: v for k, v in params.items() if k != name}
    forged.update({f"{name}.__layout": torch.tensor([0, 1 << 26], dtype=torch.int32), f"{name}.__values": torch.ones(1),
                   f"{name}.__indices": torch.tensor([-32768], dtype=torch.int16), DELTA: torch.tensor([FORMAT, 7, 8])})
    message = Message(2, 0, Instruction(2, TaskKind.TRAIN, Work(0, 16), forged, applied=["topk"]))
    with LargestTensor() as built, pytest.raises(ValueError, match=rf"the layout of '{name}' is torch.float32 \(67108864,\), the model's"):
        client.handle(message)
    assert built.entries <= max(v.numel() for v in params.values())
    assert isinstance(client.handle(train_message(0, params, 3)).body, Update)


def test_cohort_jobs_are_the_jobs_job_makes_and_a_bad_instruction_fails_alone(
    runtime_and_params: tuple[ClientRuntime, Params],
) -> None:
    runtime, params = runtime_and_params
    batch = [(cid, train_message(cid, params, rnd=3).body, {}) for cid in (2, 0, 1)]
    batch.insert(1, (3, train_message(3, params, rnd=3, nonsense=1).body, {}))
    made = runtime.cohort_jobs(batch)  # type: ignore[arg-type]
    assert isinstance(made[1], ValueError) and "'nonsense' is unknown" in str(made[1])
    for (cid, instruction, state), job in zip(batch, made):
        if cid == 3:
            continue
        assert isinstance(job, ClientJob)
        alone = runtime.job(cid, instruction, state)  # type: ignore[arg-type]
        assert job.client_id == cid and job.settings == alone.settings and job.instruction.work == alone.instruction.work
        assert torch.equal(job.x_train, alone.x_train) and torch.equal(job.y_train, alone.y_train)
        assert torch.equal(job.x_test, alone.x_test) and torch.equal(job.y_test, alone.y_test)
        assert torch.equal(torch.randperm(50, generator=job.generator), torch.randperm(50, generator=alone.generator))
    shared = [job.instruction.params for job in made if isinstance(job, ClientJob)]
    assert all(p is shared[0] for p in shared)  # one broadcast, moved once for all of them


def test_a_job_and_a_trained_update_keep_every_field_they_do_not_change(
    runtime_and_params: tuple[ClientRuntime, Params],
) -> None:
    """The job's instruction and the update that leaves are built field by field (faster than
    ``dataclasses.replace``): each field not changed is the very object given (a field added to
    Instruction or Update and forgotten there comes out as a fresh default and fails this)."""
    runtime, params = runtime_and_params
    given = Instruction(3, TaskKind.TRAIN, Work(2, 16), params, config={"lr": 0.05}, extras={}, applied=[])
    job = runtime.job(2, given, {})
    for f in dataclasses.fields(Instruction):
        if f.name not in ("work", "params", "extras"):
            assert getattr(job.instruction, f.name) is getattr(given, f.name), f.name
    update = Update(UpdateKind.DELTA, {k: torch.zeros_like(v) for k, v in params.items()}, 7, metrics={},
                    extras={}, applied=[], client_id=99, local_steps=5, compute_time=9.0, clients=1, members=[])
    sent, _ = runtime.trained(job, given, update, 0.25)
    assert (sent.client_id, sent.compute_time) == (2, 0.25)
    for f in dataclasses.fields(Update):
        if f.name not in ("metrics", "client_id", "compute_time"):
            assert getattr(sent, f.name) is getattr(update, f.name), f.name


def test_cohort_jobs_a_client_whose_rows_cannot_be_gathered_fails_alone(
    runtime_and_params: tuple[ClientRuntime, Params],
) -> None:
    runtime, params = runtime_and_params
    data = runtime.data
    broken = ClientData(data.x, data.y, [*data.train_idx], data.test_idx)
    broken.train_idx[1] = torch.tensor([len(data.x) + 5])  # a row past the dataset's end
    client = ClientRuntime(runtime.algorithm, broken, runtime.model, runtime.loss_fn, runtime.settings,
                           runtime.chains, ClientStateStore(), runtime.seed)
    made = client.cohort_jobs([(cid, train_message(cid, params, rnd=2).body, {}) for cid in (0, 1, 2)])
    assert isinstance(made[0], ClientJob) and isinstance(made[2], ClientJob) and isinstance(made[1], Exception)
    assert torch.equal(made[2].x_train, client.job(2, train_message(2, params, rnd=2).body, {}).x_train)
