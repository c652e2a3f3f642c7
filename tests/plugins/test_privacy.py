"""Differential privacy: clipping and noise statistics, adaptive clipping, ε from Opacus, stopping at a target."""

from __future__ import annotations

import dataclasses

import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import run_to_end, small_config
from fedweave import runner
from fedweave.observe.progress import run_summary
from fedweave.plugins.privacy.clip import l2_norm
from fedweave.plugins.privacy.dp import UNCLIPPED
from fedweave.training import ClientJob, LocalSettings, train_local
from fedweave.types import Instruction, TaskKind, Work

from .helpers import ctx, make, model_tensors, update

DELTA = 1e-5


def random_update(g: torch.Generator, norm: float) -> dict[str, torch.Tensor]:
    tensors = {"a": torch.randn(30, generator=g), "b": torch.randn(5, 4, generator=g), "n": torch.tensor(3)}
    scale = norm / l2_norm(tensors)
    return {k: v * scale if v.is_floating_point() else v for k, v in tensors.items()}


def test_clip_bounds_the_norm_and_keeps_the_direction() -> None:
    plugin = make("clip", max_norm=1.5)
    g = torch.Generator().manual_seed(0)
    for i in range(500):
        norm = float(torch.rand((), generator=g)) * 4
        tensors = random_update(g, norm)
        out = plugin.encode(update(tensors), ctx(i)).tensors
        assert l2_norm(out) == pytest.approx(min(norm, 1.5), rel=1e-5)
        factor = min(1.0, 1.5 / norm)
        torch.testing.assert_close(out["a"], tensors["a"] * factor)
        assert torch.equal(out["n"], tensors["n"])


def test_local_noise_has_the_configured_std_after_clipping() -> None:
    plugin = make("dp_local", clip=2.0, noise_multiplier=0.5)
    g = torch.Generator().manual_seed(0)
    tensors = random_update(g, 10.0)  # clipped to norm 2 first
    clipped = {k: v * 0.2 if v.is_floating_point() else v for k, v in tensors.items()}
    noise = torch.stack(
        [torch.cat([(out[k] - clipped[k]).reshape(-1) for k in ("a", "b")])
         for out in (plugin.encode(update(tensors), ctx(r, r % 7)).tensors for r in range(1, 4001))]
    )
    assert noise.std().item() == pytest.approx(0.5 * 2.0, rel=0.01)  # z·C, 200,000 draws
    assert noise.mean(0).abs().max().item() < 5 * 1.0 / math.sqrt(4000)  # centred on the clipped update


def test_central_noise_is_added_once_to_the_sum_of_clipped_updates() -> None:
    plugin = make("dp_central", clip=1.0, noise_multiplier=2.0)
    g = torch.Generator().manual_seed(1)
    updates = [update(random_update(g, norm), num_examples=n, client_id=i) for i, (norm, n) in enumerate([(0.5, 10), (3.0, 500), (1.0, 7)])]
    encoded = [plugin.encode(u, ctx(1, u.client_id)) for u in updates]
    assert all(l2_norm(e.tensors) <= 1.0 + 1e-6 for e in encoded)
    uniform_mean = {k: sum(e.tensors[k] for e in encoded) / 3 for k in ("a", "b")}  # uniform weights, not by examples
    noise = []
    for rnd in range(1, 2001):
        out = plugin.combine(encoded, ctx(rnd, -1, "server"))
        assert out.num_examples == 517
        assert torch.equal(out.tensors["n"], torch.tensor(3))
        noise.append(torch.cat([(out.tensors[k] - uniform_mean[k]).reshape(-1) for k in ("a", "b")]))
    noise = torch.stack(noise)
    assert noise.std().item() == pytest.approx(2.0 * 1.0 / 3, rel=0.01)  # z·C on the sum, divided by m = 3
    assert noise.mean(0).abs().max().item() < 5 * (2.0 / 3) / math.sqrt(2000)


def test_adaptive_clipping_tracks_the_target_quantile() -> None:
    plugin = make(
        "dp_central", clip=0.1, noise_multiplier=0.5, adaptive=True, target_quantile=0.3, count_noise=1.0, clients=20
    )
    g = torch.Generator().manual_seed(2)
    norms = torch.linspace(0.5, 10.0, 20)  # the 30 % quantile is about 3.4
    for rnd in range(1, 151):
        encoded = [plugin.encode(update(random_update(g, float(n)), client_id=i), ctx(rnd, i)) for i, n in enumerate(norms)]
        assert all(e.tensors[UNCLIPPED].dtype == torch.int8 for e in encoded)
        out = plugin.combine(encoded, ctx(rnd, -1, "server"))
        assert UNCLIPPED not in out.tensors
    unclipped = (norms <= plugin.clip_norm).double().mean().item()
    assert unclipped == pytest.approx(0.3, abs=0.1)
    assert plugin.metrics()["clip_norm"] == plugin.clip_norm


def test_adaptive_clipping_refuses_a_count_noise_that_spends_the_budget() -> None:
    from fedweave.errors import ConfigError

    with pytest.raises(ConfigError, match="count_noise σ_b > noise_multiplier / 2"):
        make("dp_central", noise_multiplier=1.0, adaptive=True, clients=10)  # σ_b = 10 / 20 = 0.5


def opacus_epsilon(noise: float, rate: float, steps: int, delta: float = DELTA) -> float:
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=noise, sample_rate=rate)
    return accountant.get_epsilon(delta)


def test_client_level_epsilon_equals_opacus_accountant_each_round() -> None:
    central = make("dp_central", noise_multiplier=1.1, clients=100, clients_per_round=10)
    local = make("dp_local", noise_multiplier=3.0, clients=100, clients_per_round=10)
    assert central.metrics() == {} and local.metrics() == {}
    for rnd in range(1, 6):
        central.begin_round(rnd, list(range(10)))
        local.begin_round(rnd, list(range(10)))
        assert central.metrics()["epsilon"] == pytest.approx(opacus_epsilon(1.1, 0.1, rnd), rel=1e-9)
        # local model: replace-one sensitivity 2C (multiplier z / 2), no sampling amplification
        assert local.metrics()["epsilon"] == pytest.approx(opacus_epsilon(1.5, 1.0, rnd), rel=1e-9)


@pytest.mark.filterwarnings("ignore:Secure RNG turned off", "ignore:Full backward hook is firing")
def test_dpsgd_epsilon_equals_opacus_privacy_engine_and_training_is_clipped() -> None:
    from opacus import PrivacyEngine

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    plugin = make("dpsgd", noise_multiplier=1.3, max_grad_norm=0.5)

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ins = Instruction(1, TaskKind.TRAIN, Work(0, batch_size=16, epochs=2), start)
    ins = plugin.decode(ins, ctx(1, 0))
    settings = LocalSettings("sgd", lr=0.1, momentum=0.0, weight_decay=0.0, privacy=ins.config["privacy"])
    job = ClientJob(0, ins, model, x, y, x[:0], y[:0], nn.functional.cross_entropy, settings, torch.Generator().manual_seed(1))
    result = train_local(job)
    assert result.steps == 8 and result.num_examples == 64
    assert plugin.metrics() == {}  # the server counts what it receives, nothing yet
    report = ins.config["privacy"].report()
    assert report == {"dpsgd_rate": 16 / 64, "dpsgd_steps": 8.0}
    plugin.observe([dataclasses.replace(update({}), metrics=report)])
    ours = plugin.metrics()["epsilon"]

    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    engine = PrivacyEngine(accountant="rdp")
    reference, optimizer, loader = engine.make_private(
        module=reference, optimizer=optimizer, data_loader=loader, noise_multiplier=1.3, max_grad_norm=0.5, poisson_sampling=True
    )
    for _ in range(2):
        for xb, yb in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(reference(xb), yb).backward()
            optimizer.step()
    assert ours == pytest.approx(engine.get_epsilon(DELTA), rel=1e-9)

    # one step moves the weights by at most lr · (clip + noise): with no noise, at most lr · C
    quiet = make("dpsgd", noise_multiplier=1e-9, max_grad_norm=0.05)
    model.load_state_dict(start)
    one = Instruction(1, TaskKind.TRAIN, Work(0, batch_size=16, local_steps=1), start)
    one = quiet.decode(one, ctx(1, 0))
    job.settings = LocalSettings("sgd", lr=0.1, momentum=0.0, weight_decay=0.0, privacy=one.config["privacy"])
    job.instruction = one
    train_local(job)
    moved = l2_norm({k: v - start[k] for k, v in model.state_dict().items()})
    assert 0 < moved <= 0.1 * 0.05 * (1 + 1e-4)
    assert not any(hasattr(p, "grad_sample") and p.grad_sample is not None for p in model.parameters())


def test_a_dp_run_reports_epsilon_every_round_and_in_the_summary(tmp_path: Path) -> None:
    _, records = run_to_end(tmp_path / "run", "plugins.client_send=[{name: dp_central, clip: 1.0, noise_multiplier: 1.0}]")
    eps = [r["epsilon"] for r in records]
    assert eps == sorted(eps) and eps[0] > 0 and len(eps) == 3
    assert eps[-1] == pytest.approx(opacus_epsilon(1.0, 1.0, 3))
    assert ("privacy ε (at the plugin's δ)", f"{eps[-1]:.3f}") in run_summary(records, "dir", 1.0)


def test_a_run_stops_before_passing_the_target_epsilon(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = (opacus_epsilon(1.0, 1.0, 2) + opacus_epsilon(1.0, 1.0, 3)) / 2
    plugin = f"plugins.client_send=[{{name: dp_central, noise_multiplier: 1.0, target_epsilon: {target}}}]"
    r = runner.prepare(small_config(plugin), tmp_path / "run")
    with caplog.at_level(logging.WARNING):
        records = runner.execute(r)
    assert [rec["round"] for rec in records] == [1, 2]
    assert records[-1]["epsilon"] <= target
    assert "run stopped before round 3" in caplog.text and "past the target" in caplog.text
    assert (tmp_path / "run" / "model.pt").is_file()


def test_a_dpsgd_run_trains_and_reports_per_client_epsilon(tmp_path: Path) -> None:
    _, plain = run_to_end(tmp_path / "plain")
    _, records = run_to_end(tmp_path / "dpsgd", "plugins.client_receive=[{name: dpsgd, noise_multiplier: 0.7, max_grad_norm: 1.0}]")
    eps = [r["epsilon"] for r in records]
    assert eps == sorted(eps) and eps[0] > 0
    assert records[-1]["test_accuracy"] > 0.5  # 4 classes: well above chance
    assert records[-1]["test_accuracy"] <= plain[-1]["test_accuracy"] + 0.05


def test_private_plugins_keep_payloads_intact() -> None:
    tensors = model_tensors()
    for name in ("clip", "dp_local", "dp_central"):
        out = make(name).encode(update(tensors), ctx())
        assert out.tensors is not tensors and set(tensors) <= set(out.tensors)
        assert torch.equal(out.tensors["bn.num_batches_tracked"], tensors["bn.num_batches_tracked"])


def test_dpsgd_ledger_counts_each_report_it_receives_and_skips_malformed_ones(caplog: pytest.LogCaptureFixture) -> None:
    """The server's ledger: one (z, q, steps) entry per report, per client; a bad report is logged, not counted."""
    from fedweave.plugins.privacy.accountant import epsilon

    plugin = make("dpsgd", noise_multiplier=1.1)
    good = {"dpsgd_rate": 0.25, "dpsgd_steps": 4.0}
    reports = [
        dataclasses.replace(update({}, client_id=3), metrics={**good, "train_loss": 0.5}),
        dataclasses.replace(update({}, client_id=5), metrics={"dpsgd_rate": 1.5, "dpsgd_steps": 4.0}),
        dataclasses.replace(update({}, client_id=6), metrics={"train_loss": 0.5}),  # no private training
    ]
    plugin.observe(reports)
    plugin.observe(reports[:1])
    assert plugin.ledger == {3: [(1.1, 0.25, 4), (1.1, 0.25, 4)]}
    assert plugin.metrics()["epsilon"] == pytest.approx(epsilon([(1.1, 0.25, 8)], DELTA))
    assert "client 5 reported rate 1.5" in caplog.text


def test_adaptive_dp_central_sends_its_clip_norm_with_each_instruction() -> None:
    """The client clips to the norm the server's instruction carries, not to its own copy."""
    from fedweave.plugins.chain import Chain, Chains
    from fedweave.types import Instruction, TaskKind, Work

    server = make("dp_central", clip=1.0, noise_multiplier=0.5, adaptive=True, count_noise=1.0)
    server.clip_norm = 0.25  # where adaptation has taken it
    chains = Chains(client_send=Chain([server]))
    ins = chains.instruct(Instruction(1, TaskKind.TRAIN, Work(0, 8), {}), ctx(side="server"))
    assert ins.config == {"dp_central.clip": 0.25}
    client = make("dp_central", clip=1.0, noise_multiplier=0.5, adaptive=True, count_noise=1.0)  # another process
    tensors = {"w": torch.full((4,), 1.0)}  # norm 2
    out = client.encode(update(tensors), dataclasses.replace(ctx(), config=ins.config))
    assert l2_norm({"w": out.tensors["w"]}) == pytest.approx(0.25)
    assert out.tensors["__dp_unclipped"].item() == 0
    with pytest.raises(ValueError, match="clip norm nan is not a positive number"):
        client.encode(update(tensors), dataclasses.replace(ctx(), config={"dp_central.clip": float("nan")}))
