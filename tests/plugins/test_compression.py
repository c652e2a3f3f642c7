"""Compression plugins: unbiasedness, error feedback, PowerSGD's rank bound, wire bytes, both directions."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import assert_same_params, comparable, run_interrupted, run_to_end, small_config
from fedweave import runner
from fedweave.plugins.compression.wire import DELTA
from fedweave.types import Instruction, TaskKind, Work, params_nbytes

from .helpers import ctx, make, model_tensors, roundtrip, update

MLP_100K = {  # MNIST MLP 784-128-10: 101,770 parameters
    "features.1.weight": torch.randn(128, 784, generator=torch.Generator().manual_seed(1)),
    "features.1.bias": torch.randn(128, generator=torch.Generator().manual_seed(2)),
    "head.weight": torch.randn(10, 128, generator=torch.Generator().manual_seed(3)),
    "head.bias": torch.randn(10, generator=torch.Generator().manual_seed(4)),
}


def draws(name: str, x: torch.Tensor, n: int, **params: object) -> torch.Tensor:
    """``n`` decoded encodings of ``x``, each with fresh randomness (another round)."""
    plugin = make(name, **params)
    out = [roundtrip(plugin, update({"w": x}), ctx(rnd=r)).tensors["w"] for r in range(1, n + 1)]
    return torch.stack(out)


def assert_unbiased(samples: torch.Tensor, x: torch.Tensor) -> None:
    """Per entry, the mean of the draws lies within 5 standard errors of ``x``."""
    mean = samples.double().mean(0)
    stderr = samples.double().std(0) / samples.shape[0] ** 0.5
    assert torch.all((mean - x.double()).abs() <= 6 * stderr + 1e-6)


@pytest.mark.parametrize(
    "name,params",
    [("qsgd", {"levels": 4, "bucket": 64}), ("randk", {"ratio": 0.1}), ("quantize", {"dtype": "int8", "bucket": 16})],
)
def test_stochastic_codecs_are_unbiased(name: str, params: dict) -> None:
    x = torch.randn(200, generator=torch.Generator().manual_seed(0))
    x = x.sign() * (0.2 + x.abs())  # no entry so small that 3,000 draws never round it up
    samples = draws(name, x, 3000, **params)
    assert_unbiased(samples, x)
    assert not torch.allclose(samples[0], x)  # each single draw is lossy
    with pytest.raises(AssertionError):  # the check has the power to see a biased codec
        assert_unbiased(samples * 1.5, x)


def test_topk_keeps_the_largest_entries() -> None:
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 1.0, 0.05, -2.0, 0.4])
    out = roundtrip(make("topk", ratio=0.3, error_feedback=False), update({"w": x}), ctx()).tensors["w"]
    assert torch.equal(out, torch.tensor([0, -5.0, 0, 3.0, 0, 0, 0, 0, -2.0, 0]))


def test_error_feedback_carries_residuals_across_rounds_per_client() -> None:
    plugin = make("topk", ratio=0.1)
    g = torch.Generator().manual_seed(0)
    inputs = {cid: [torch.randn(50, generator=g) for _ in range(4)] for cid in (0, 1)}
    sent: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for rnd in range(4):
        for cid in (0, 1):
            before = plugin.residuals.get(cid, {}).get("w", torch.zeros(50)).clone()  # the plugin adds to it in place
            out = roundtrip(plugin, update({"w": inputs[cid][rnd]}), ctx(rnd + 1, cid)).tensors["w"]
            # what was sent is top-k of this update plus the residual carried from the last round
            expected = inputs[cid][rnd] + before
            keep = expected.abs().topk(5).indices
            assert torch.equal(out.nonzero().squeeze(1).sort().values, keep.sort().values)
            assert torch.allclose(plugin.residuals[cid]["w"], expected - out)
            sent[cid].append(out)
    for cid in (0, 1):  # nothing is lost, only delayed: Σ sent + residual = Σ inputs
        total = torch.stack(sent[cid]).sum(0) + plugin.residuals[cid]["w"]
        assert torch.allclose(total, torch.stack(inputs[cid]).sum(0), atol=1e-5)


def test_powersgd_is_exact_for_a_matrix_of_its_rank() -> None:
    g = torch.Generator().manual_seed(0)
    m = torch.randn(60, 3, generator=g) @ torch.randn(3, 40, generator=g)
    out = roundtrip(make("powersgd", rank=3, error_feedback=False), update({"w": m}), ctx()).tensors["w"]
    torch.testing.assert_close(out, m, rtol=0, atol=1e-4)


def test_powersgd_error_is_bounded_by_the_rank_and_warm_start_reaches_it() -> None:
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(60, 40, generator=g))
    v, _ = torch.linalg.qr(torch.randn(40, 40, generator=g))
    m = u @ torch.diag(0.7 ** torch.arange(40.0)) @ v.T
    errors = {}
    for rank in (1, 2, 4, 8):
        plugin = make("powersgd", rank=rank, error_feedback=False)
        best = torch.linalg.svdvals(m)[rank:].square().sum().sqrt().item()  # the best rank-r error
        first = None
        for rnd in range(1, 13):  # the warm start (Q of the last round) is a power iteration
            err = (roundtrip(plugin, update({"w": m}), ctx(rnd)).tensors["w"] - m).norm().item()
            first = err if first is None else first
            assert err >= best * (1 - 1e-4)
        assert err <= 1.01 * best < first
        errors[rank] = err
    assert errors[1] > errors[2] > errors[4] > errors[8]


@pytest.mark.parametrize(
    "name,params,ratio",
    [
        ("topk", {"ratio": 0.01}, 60),
        ("topk", {"ratio": 0.01, "values": "float16"}, 95),
        ("randk", {"ratio": 0.01}, 95),
        ("qsgd", {"levels": 127}, 3.9),
        ("qsgd", {"levels": 7}, 7.5),
        ("quantize", {"dtype": "int8"}, 3.9),
        ("quantize", {"dtype": "float16"}, 1.99),
        ("quantize", {"dtype": "bfloat16"}, 1.99),
        ("powersgd", {"rank": 4}, 20),
    ],
)
def test_wire_bytes_of_a_100k_parameter_update(name: str, params: dict, ratio: float) -> None:
    encoded = make(name, **params).encode(update(MLP_100K), ctx())
    assert params_nbytes(MLP_100K) / params_nbytes(encoded.tensors) >= ratio


def test_integer_tensors_travel_untouched_and_shapes_come_back() -> None:
    tensors = model_tensors()
    for name in ("topk", "randk", "qsgd", "quantize", "powersgd"):
        out = roundtrip(make(name), update(tensors), ctx()).tensors
        assert out.keys() == tensors.keys()
        assert all(out[k].shape == tensors[k].shape and out[k].dtype == tensors[k].dtype for k in tensors)
        assert torch.equal(out["bn.num_batches_tracked"], tensors["bn.num_batches_tracked"])


def instruction(params: dict, rnd: int, cid: int, task: TaskKind = TaskKind.TRAIN) -> Instruction:
    return Instruction(rnd, task, Work(cid, 8), params)


def test_broadcast_sends_deltas_against_what_each_client_holds() -> None:
    plugin = make("topk", ratio=0.05)
    g = torch.Generator().manual_seed(0)
    model = {"w": torch.randn(200, generator=g), "n": torch.tensor(1)}
    for rnd in range(1, 6):
        model = {"w": model["w"] + 0.1 * torch.randn(200, generator=g), "n": model["n"] + 1}
        for cid in (3, 7):
            sent = plugin.encode(instruction(model, rnd, cid), ctx(rnd, cid, "server"))
            got = plugin.decode(sent, ctx(rnd, cid, "client")).params
            assert (DELTA in sent.params) == (rnd > 1)  # the first broadcast to a client is dense
            if rnd > 1:
                assert params_nbytes(sent.params) < params_nbytes(model) / 4
            # both ends agree on the client's model, which follows the global one
            assert_same_params(got, plugin.sent[cid])
            assert torch.equal(got["n"], model["n"])
    error = (plugin.sent[3]["w"] - model["w"]).norm() / model["w"].norm()
    assert error < 0.5  # what was not sent yet is carried to later broadcasts


def test_broadcast_passes_evaluation_instructions_dense() -> None:
    plugin = make("qsgd")
    params = {"w": torch.randn(10)}
    sent = plugin.encode(instruction(params, 1, 0, TaskKind.EVALUATE), ctx(1, 0, "server"))
    assert sent.params is params or torch.equal(sent.params["w"], params["w"])
    assert plugin.sent == {}


def test_a_delta_broadcast_to_a_client_without_a_model_is_refused() -> None:
    server, client = make("topk"), make("topk")
    params = {"w": torch.randn(10)}
    server.encode(instruction(params, 1, 0), ctx(1, 0, "server"))
    sent = server.encode(instruction({"w": params["w"] + 1}, 2, 0), ctx(2, 0, "server"))
    with pytest.raises(ValueError, match="client 0 holds no model"):
        client.decode(sent, ctx(2, 0, "client"))


def test_runs_report_fewer_bytes_per_direction(tmp_path: Path) -> None:
    _, dense = run_to_end(tmp_path / "dense")
    _, up = run_to_end(tmp_path / "up", "plugins.client_send=[{name: quantize, dtype: int8}]")
    _, down = run_to_end(tmp_path / "down", "plugins.server_send=[{name: quantize, dtype: float16}]")
    assert [r["bytes_sent"] for r in up] == [r["bytes_sent"] for r in dense]
    assert all(u["bytes_received"] < d["bytes_received"] / 2.5 for u, d in zip(up, dense))
    # first contact: dense, each broadcast with the id of the model it gives (16 bytes)
    assert down[0]["bytes_sent"] == dense[0]["bytes_sent"] + 16 * down[0]["clients_completed"]
    assert all(x["bytes_sent"] < d["bytes_sent"] / 1.5 for x, d in zip(down[1:], dense[1:]))
    assert down[-1]["test_accuracy"] >= dense[-1]["test_accuracy"] - 0.05


def test_a_resumed_run_with_error_feedback_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    plugins = ["plugins.client_send=[{name: topk, ratio: 0.1}]", "plugins.server_send=[{name: powersgd, rank: 2}]"]
    whole, records = run_to_end(tmp_path / "whole", *plugins)
    resumed, resumed_records = run_interrupted(tmp_path / "resumed", 1, *plugins)
    assert_same_params(whole, resumed)
    assert comparable(records) == comparable(resumed_records)


def test_payloads_are_new_objects(tmp_path: Path) -> None:
    original = update(model_tensors())
    for name in ("topk", "qsgd", "powersgd"):
        plugin = make(name)
        encoded = plugin.encode(original, ctx())
        assert encoded is not original and original.tensors.keys() == model_tensors().keys()
        assert replace(plugin.decode(encoded, ctx()), applied=[]) is not encoded


def test_a_client_that_lost_its_model_refuses_the_difference_and_gets_the_dense_model_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """In simulation one plugin object holds the server's copies and the clients' models: client 0's
    is dropped after round 1 (a restarted client). Round 2's difference is refused with the reason,
    which fails that client's job alone; the server, told of the failure, sends it the dense model in
    round 3, and every client completes again."""
    caplog.set_level(logging.WARNING, logger="fedweave")
    spec = "{name: quantize, dtype: bfloat16}"
    r = runner.prepare(small_config("clients=2", "rounds=3", "checkpoint.every=0", f"plugins.server_send=[{spec}]"),
                       tmp_path / "run")
    plugin = r.parts.chains.server_send.plugins[0]

    def restart(record: dict) -> None:
        if record["round"] == 1:
            plugin.held.pop(0)
            plugin.held_ids.pop(0)

    records = runner.execute(r, restart)
    assert [record["clients_completed"] for record in records] == [2, 1, 2]
    assert "round 2: client 0 refuses a compressed broadcast that is a difference of model" in caplog.text
    assert "but client 0 holds no model" in caplog.text
    assert records[2]["bytes_sent"] > 1.25 * records[1]["bytes_sent"]  # client 0 got the dense model, bf16 halves
    assert plugin.held_ids[0] == plugin.sent_ids[0] and plugin.held_ids[1] == plugin.sent_ids[1]
    assert_same_params(plugin.held[0], plugin.sent[0])
