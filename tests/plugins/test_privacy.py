"""Differential privacy: clipping and noise statistics, adaptive clipping, ε from Opacus, stopping at a target."""

from __future__ import annotations

import dataclasses

import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conftest import run_to_end, small_config
from fedweave import runner
from fedweave.build import build_task
from fedweave.observe.progress import run_summary
from fedweave.plugins.privacy.clip import l2_norm
from fedweave.plugins.privacy.dp import UNCLIPPED
from fedweave.training import ClientJob, LocalOptimizer, LocalSettings, train_local
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
    small = make("clip", max_norm=0.5)  # norms below 1 are clipped too
    out = small.encode(update({"w": torch.tensor([0.48, 0.64])}), ctx()).tensors  # norm 0.8
    torch.testing.assert_close(out["w"], torch.tensor([0.3, 0.4]))


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
    assert noise.std().item() == pytest.approx(2.0 * 1.0 / 3, rel=0.015)  # z·C on the sum, divided by m = 3
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

    with pytest.raises(ConfigError, match=r"count_noise σ_b > noise_multiplier / 2 \(σ_b = 0.5, z = 1\).*raise count_noise or sample more clients per round$"):
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
    private = plugin.training(ctx(1, 0))
    settings = LocalSettings("sgd", lr=0.1, momentum=0.0, weight_decay=0.0)
    job = ClientJob(0, ins, model, x, y, x[:0], y[:0], nn.functional.cross_entropy, settings, torch.Generator().manual_seed(1), training=private)
    result = train_local(job)
    assert result.steps == 8 and result.num_examples == 64
    assert plugin.metrics() == {}  # the server counts what it receives, nothing yet
    report = private.report()
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
    job.training = quiet.training(ctx(1, 0))
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
        plugin = make(name)
        out = plugin.encode(update(tensors), ctx())
        assert out.tensors is not tensors and set(tensors) <= set(out.tensors)
        assert torch.equal(out.tensors["bn.num_batches_tracked"], tensors["bn.num_batches_tracked"])
        assert all(out.tensors[k].dtype == v.dtype for k, v in tensors.items())  # noise drawn in float64, sent as sent
        received = plugin.decode(out, ctx(side="server"))  # nothing to undo on the server: the same update
        assert received is not out and received.tensors == out.tensors and received.num_examples == out.num_examples


def test_private_plugins_state_survives_a_checkpoint() -> None:
    """The adaptive clip norm and the DP-SGD ledger go through state_dict / load_state_dict unchanged."""
    central = make("dp_central", clip=1.0, noise_multiplier=0.5, adaptive=True, count_noise=1.0)
    central.clip_norm = 0.37
    assert central.state_dict() == {"clip_norm": 0.37}
    restored = make("dp_central", clip=1.0, noise_multiplier=0.5, adaptive=True, count_noise=1.0)
    restored.load_state_dict(central.state_dict())
    assert restored.clip_norm == 0.37 and restored.metrics() == {"clip_norm": 0.37}
    fixed = make("dp_central", clip=0.8)
    assert fixed.instruct(ctx(side="server")) == {}  # a fixed C needs no instruction: the client's copy is the server's
    assert restored.instruct(ctx(side="server")) == {"dp_central.clip": 0.37}
    dpsgd = make("dpsgd", noise_multiplier=1.1)
    dpsgd.observe([dataclasses.replace(update({}, client_id=2), metrics={"dpsgd_rate": 0.25, "dpsgd_steps": 4.0})])
    eps = dpsgd.metrics()["epsilon"]
    again = make("dpsgd", noise_multiplier=1.1)
    again.load_state_dict({"ledger": {"2": [(1.1, 0.25, 4)]}})  # a checkpoint's keys may come back as strings
    assert again.ledger == {2: [(1.1, 0.25, 4)]} and again.metrics()["epsilon"] == eps
    copy = make("dpsgd", noise_multiplier=1.1)
    copy.load_state_dict(dpsgd.state_dict())  # what a checkpoint holds
    assert copy.ledger == dpsgd.ledger and copy.metrics() == dpsgd.metrics()
    again.observe([dataclasses.replace(update({}, client_id=2), metrics={"dpsgd_rate": 0.25, "dpsgd_steps": 4.0})])
    assert again.metrics()["epsilon"] > eps  # the cache of ε follows the ledger
    assert make("dpsgd").encode(update({"w": torch.ones(2)}), ctx()).tensors["w"].tolist() == [1.0, 1.0]


def test_seeded_noise_repeats_the_run_seeds_streams() -> None:
    from fedweave.plugins.privacy.noise import SeededNoise, noise_source
    from fedweave.seeding import torch_generator

    a = SeededNoise(3, "dpsgd", 2, 1)
    u, n = a.uniform((6,)), a.normal((2, 3))
    gen = torch_generator(3, "dpsgd", 2, 1)
    assert torch.equal(u, torch.rand(6, generator=gen, dtype=torch.float64))
    assert torch.equal(n, torch.randn((2, 3), generator=gen, dtype=torch.float64))
    assert isinstance(noise_source(True, 3, "x"), SeededNoise) and not isinstance(noise_source(False, 3, "x"), SeededNoise)


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")  # client 11: no step, ε of nothing
def test_dpsgd_ledger_counts_each_report_it_receives_and_skips_malformed_ones(caplog: pytest.LogCaptureFixture) -> None:
    """The server's ledger: one (z, q, steps) entry per report, per client; a bad report is logged, not counted."""
    from fedweave.plugins.privacy.accountant import epsilon

    plugin = make("dpsgd", noise_multiplier=1.1)
    good = {"dpsgd_rate": 0.25, "dpsgd_steps": 4.0}

    def report(client: int, **metrics: float) -> Any:
        return dataclasses.replace(update({}, client_id=client), metrics=metrics)

    reports = [
        report(6, train_loss=0.5),  # no private training: nothing to count, nothing to warn about
        report(5, dpsgd_rate=1.5, dpsgd_steps=4.0),
        report(7, dpsgd_rate=0.0, dpsgd_steps=4.0),  # a rate of 0 samples nothing: not a private training
        report(8, dpsgd_rate=0.5),  # half a report
        report(9, dpsgd_steps=2.0),
        report(10, dpsgd_rate=0.5, dpsgd_steps=2.5),
        report(3, **good, train_loss=0.5),
        report(11, dpsgd_rate=1.0, dpsgd_steps=0.0),  # full batches, no step: allowed, spends nothing
    ]
    plugin.observe(reports)
    plugin.observe([reports[6]])
    assert plugin.ledger == {3: [(1.1, 0.25, 4), (1.1, 0.25, 4)], 11: [(1.1, 1.0, 0)]}
    assert plugin.metrics()["epsilon"] == pytest.approx(epsilon([(1.1, 0.25, 8)], DELTA))
    assert caplog.records[0].getMessage() == "plugin 'dpsgd': client 5 reported rate 1.5 and steps 4.0, not a private training; not counted"
    assert "client 8 reported rate 0.5 and steps nan" in caplog.text and "client 9 reported rate nan and steps 2.0" in caplog.text
    assert "client 7 reported rate 0.0" in caplog.text and "client 10 reported rate 0.5 and steps 2.5" in caplog.text
    assert "client 6" not in caplog.text


def test_dpsgd_computes_each_clients_epsilon_once_per_ledger_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """metrics() runs every round for every client that reported: ε is recomputed only when a ledger grows."""
    from fedweave.plugins.privacy import dpsgd

    calls: list[int] = []
    real = dpsgd.epsilon
    monkeypatch.setattr(dpsgd, "epsilon", lambda history, delta: calls.append(len(history)) or real(history, delta))
    plugin = make("dpsgd", noise_multiplier=1.1)
    for client in (1, 2):
        plugin.observe([dataclasses.replace(update({}, client_id=client), metrics={"dpsgd_rate": 0.5, "dpsgd_steps": 2.0})])
    first = plugin.metrics()["epsilon"]
    assert plugin.metrics()["epsilon"] == first and calls == [1, 1]
    plugin.observe([dataclasses.replace(update({}, client_id=2), metrics={"dpsgd_rate": 0.5, "dpsgd_steps": 2.0})])
    assert plugin.metrics()["epsilon"] > first and calls == [1, 1, 2]


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
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match=f"clip norm {bad!r} is not a positive number"):
            client.encode(update(tensors), dataclasses.replace(ctx(), config={"dp_central.clip": bad}))
    at_the_norm = client.encode(update({"w": torch.tensor([3.0, 4.0])}), dataclasses.replace(ctx(), config={"dp_central.clip": 5.0}))
    assert at_the_norm.tensors["__dp_unclipped"].item() == 1  # ‖Δ‖ ≤ C counts as unclipped


# --------------------------------------------------------------------------- where the noise comes from


def regenerated_local_noise(tensors: dict, rnd: int, client: int, seed: int = 0) -> dict:
    """The attack of issue 14: the server draws the client's noise again from the run seed,
    round and client id it reads in the config (what dp_local drew before the fix)."""
    from fedweave.seeding import torch_generator

    gen = torch_generator(seed, "dp_local", rnd, client)
    return {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in tensors.items() if v.is_floating_point()}


@pytest.mark.parametrize("seeded", [False, True])
def test_the_server_cannot_regenerate_a_clients_local_noise_from_the_config(seeded: bool) -> None:
    z, clip = 10.0, 1.0
    plugin = make("dp_local", clip=clip, noise_multiplier=z, seeded_noise=seeded)
    tensors = random_update(torch.Generator().manual_seed(5), 0.8)  # inside the clip: sent as is, plus noise
    sent = plugin.encode(update(tensors), ctx(3, 4)).tensors
    noise = regenerated_local_noise(tensors, 3, 4)
    recovered = {k: sent[k].double() - z * clip * noise[k] for k in noise}
    error = max((recovered[k] - tensors[k].double()).abs().max().item() for k in noise)
    if seeded:  # reproducible noise, for simulation only: the attack recovers the update (refused in deployments)
        assert error < 1e-5
    else:
        assert error > z * clip  # off by noise of std z·C: nothing of the update comes back
        again = plugin.encode(update(tensors), ctx(3, 4)).tensors  # same config, round, client: new noise
        assert not torch.equal(again["a"], sent["a"])


def test_a_client_cannot_regenerate_the_servers_central_noise() -> None:
    from fedweave.seeding import torch_generator

    plugin = make("dp_central", clip=1.0, noise_multiplier=5.0)
    tensors = random_update(torch.Generator().manual_seed(6), 0.5)
    encoded = [plugin.encode(update(tensors, client_id=i), ctx(2, i)) for i in range(2)]
    released = plugin.combine(encoded, ctx(2, -1, "server")).tensors
    gen = torch_generator(0, "dp_central", 2)
    guess = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in tensors.items() if v.is_floating_point()}
    recovered_sum = released["a"].double() * 2 - 5.0 * guess["a"]
    assert (recovered_sum - 2 * tensors["a"].double()).abs().max().item() > 1.0
    assert not torch.equal(plugin.combine(encoded, ctx(2, -1, "server")).tensors["a"], released["a"])


def test_secure_noise_is_standard_normal_and_uniform() -> None:
    from fedweave.plugins.privacy.noise import SecureNoise

    source = SecureNoise()
    normal = source.normal((300, 401))  # an odd count: Box–Muller pairs, one dropped
    assert normal.shape == (300, 401) and normal.dtype == torch.float64
    assert normal.mean().item() == pytest.approx(0.0, abs=5 / math.sqrt(normal.numel()))
    assert normal.std().item() == pytest.approx(1.0, abs=5 / math.sqrt(2 * normal.numel()))
    assert (normal.abs() > 1.96).double().mean().item() == pytest.approx(0.05, abs=0.0035)  # a Gaussian tail, 5.6 σ
    uniform = source.uniform((100_000,))
    assert 0 <= uniform.min().item() and uniform.max().item() < 1
    counts = torch.histc(uniform, bins=10, min=0, max=1)
    assert ((counts - 10_000) ** 2 / 10_000).sum().item() < 44.8  # χ², 9 degrees of freedom, p = 1e-6
    assert not torch.equal(source.normal((8,)), source.normal((8,)))


def test_seeded_noise_is_refused_wherever_the_nodes_run_apart() -> None:
    from fedweave.errors import ConfigError

    seeded = "plugins.client_send=[{name: dp_local, seeded_noise: true}]"
    assert small_config(seeded).plugins.client_send[0].params.seeded_noise
    with pytest.raises(ConfigError, match=r"^config key 'plugins.client_send\[0\].seeded_noise': .*transport 'grpc'"):
        small_config(seeded, "transport=grpc")
    with pytest.raises(ConfigError, match=r"'plugins.client_receive\[0\].seeded_noise'.*transport 'grpc'"):
        small_config("plugins.client_receive=[{name: dpsgd, seeded_noise: true}]", "transport=grpc", "launcher=process")
    with pytest.raises(ConfigError, match=r"topology.inner 'torchdist'"):
        small_config(
            "plugins.client_send=[{name: dp_central, seeded_noise: true}]", "clients=4",
            "topology={kind: hierarchical, sites: 2, inner: torchdist}",
        )


def test_a_seeded_dp_run_repeats_bit_for_bit_and_a_secure_one_does_not(tmp_path: Path) -> None:
    from conftest import assert_same_params

    seeded = "plugins.client_send=[{name: dp_local, noise_multiplier: 0.5, seeded_noise: true}]"
    a, _ = run_to_end(tmp_path / "a", "rounds=2", seeded)
    b, _ = run_to_end(tmp_path / "b", "rounds=2", seeded)
    assert_same_params(a, b)
    secure = "plugins.client_send=[{name: dp_local, noise_multiplier: 0.5}]"
    c, _ = run_to_end(tmp_path / "c", "rounds=2", secure)
    d, _ = run_to_end(tmp_path / "d", "rounds=2", secure)
    assert all(not torch.equal(c[k], d[k]) for k in c if c[k].is_floating_point())


# --------------------------------------------------------------------------- mutants issue 14 saw survive


def test_adaptive_clipping_splits_the_noise_between_the_count_and_the_update() -> None:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) by hand: z = 2, σ_b = 1.5 → (1/4 − 1/9)^(−1/2) = 2.6833, not z."""
    from fedweave.plugins.privacy.dp import split_noise

    assert split_noise(2.0, 1.5) == pytest.approx((1 / 4 - 1 / 9) ** -0.5) == pytest.approx(2.68328, abs=1e-5)
    assert split_noise(0.0, 0.6) == 0.0
    plugin = make("dp_central", clip=0.5, noise_multiplier=2.0, adaptive=True, count_noise=1.5, seeded_noise=True)
    assert plugin.update_noise == pytest.approx(2.68328, abs=1e-5)
    fixed = make("dp_central", clip=0.5, noise_multiplier=2.0, seeded_noise=True)
    assert fixed.update_noise == 2.0  # no count to release: all of the budget goes to the update
    zeros = {"w": torch.zeros(50_000, dtype=torch.float64)}
    encoded = [plugin.encode(update(zeros, client_id=i), ctx(1, i)) for i in range(2)]
    out = plugin.combine(encoded, ctx(1, -1, "server")).tensors["w"]
    assert (out * 2).std().item() == pytest.approx(2.68328 * 0.5, rel=0.02)  # the sum's noise: z_Δ·C, not z·C


def test_dpsgd_samples_at_the_rate_it_reports() -> None:
    """Poisson sampling at q = batch / n: the examples a round's steps see, against the q the ledger gets."""
    n, batch, steps = 200, 10, 300
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)
    plugin = make("dpsgd", noise_multiplier=1.0, max_grad_norm=1.0, seeded_noise=True)  # a fixed draw: no flaky bound
    model = nn.Linear(4, 2)
    ins = Instruction(1, TaskKind.TRAIN, Work(0, batch_size=batch, local_steps=steps), model.state_dict())
    private = plugin.training(ctx(1, 0))
    settings = LocalSettings("sgd", lr=0.01, momentum=0.0, weight_decay=0.0)
    job = ClientJob(0, ins, model, x, y, x[:0], y[:0], nn.functional.cross_entropy, settings, torch.Generator().manual_seed(1), training=private)
    sizes: list[int] = []

    def loss(module: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sizes.append(len(xb))
        value = nn.functional.cross_entropy(module(xb), yb)
        return value, value

    train_local(job, loss=loss)
    q = private.report()["dpsgd_rate"]
    assert q == batch / n and len(sizes) == steps
    seen, expected = sum(sizes), q * n * steps  # 3,000 examples, standard deviation √(n·steps·q(1−q)) = 75.5
    assert abs(seen - expected) < 5 * math.sqrt(n * steps * q * (1 - q))


def test_dpsgd_stops_before_a_round_its_worst_client_would_take_past_the_target() -> None:
    """The prediction: each client repeats its last round; the largest predicted ε decides."""
    from fedweave.errors import BudgetSpent
    from fedweave.plugins.privacy.accountant import epsilon

    history = {1: [(1.1, 0.25, 4)], 2: [(1.1, 0.5, 4)]}
    low = epsilon([(1.1, 0.25, 8)], DELTA)  # client 1 after one more such round
    high = epsilon([(1.1, 0.5, 8)], DELTA)  # client 2: the worst
    assert low < high
    for target, stops in [((low + high) / 2, True), (high * 1.001, False)]:
        plugin = make("dpsgd", noise_multiplier=1.1, target_epsilon=target)
        plugin.begin_round(1, [1, 2])  # an empty ledger spends nothing
        plugin.ledger = {k: list(v) for k, v in history.items()}
        if stops:
            with pytest.raises(BudgetSpent, match=rf"plugin 'dpsgd': round 2 would raise ε to {high:.3f}, past the target"):
                plugin.begin_round(2, [1, 2])
        else:
            plugin.begin_round(2, [1, 2])
    unbounded = make("dpsgd", noise_multiplier=1.1)
    unbounded.ledger = {k: list(v) for k, v in history.items()}
    unbounded.begin_round(2, [1, 2])
    make("dpsgd", target_epsilon=1e-3).begin_round(1, [1, 2])  # nothing released yet: ε is 0, under any target


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("seeded", [False, True])
def test_dpsgd_noise_and_batches_are_not_drawn_from_the_config(seeded: bool) -> None:
    """The same client, round, data, model and job generator: secure noise trains another model each
    time (nothing the server reads in the config repeats it); seeded_noise repeats it exactly."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 4, generator=g), torch.randint(0, 2, (48,), generator=g)
    plugin = make("dpsgd", noise_multiplier=1.0, max_grad_norm=1.0, seeded_noise=seeded)
    start = nn.Linear(4, 2).state_dict()
    trained = []
    for _ in range(2):
        model = nn.Linear(4, 2)
        model.load_state_dict(start)
        ins = Instruction(2, TaskKind.TRAIN, Work(0, batch_size=8, local_steps=3), start)
        private = plugin.training(ctx(2, 5))
        settings = LocalSettings("sgd", lr=0.1, momentum=0.0, weight_decay=0.0)
        job = ClientJob(5, ins, model, x, y, x[:0], y[:0], nn.functional.cross_entropy, settings, torch.Generator().manual_seed(1), training=private)
        train_local(job)
        trained.append(model.weight.detach().clone())
    assert torch.equal(trained[0], trained[1]) == seeded


def test_central_noise_of_a_seeded_simulation_is_the_run_seeds_stream() -> None:
    """seeded_noise: the server's noise is N(0, (z·C)²) from the stream (seed, 'dp_central', round), so a
    simulation repeats it; one update alone is its own mean plus noise / 1; dtypes are kept."""
    from fedweave.seeding import torch_generator

    tensors = {"a": torch.full((6,), 0.1), "b": torch.full((2, 2), -0.2, dtype=torch.float64)}
    for rnd in (1, 2):
        plugin = make("dp_central", clip=2.0, noise_multiplier=0.5, seed=3, seeded_noise=True)
        one = [plugin.encode(update(tensors), ctx(rnd, 0))]
        out = plugin.combine(one, ctx(rnd, -1, "server")).tensors
        gen = torch_generator(3, "dp_central", rnd)
        for k, v in tensors.items():
            expected = v.double() + 0.5 * 2.0 * torch.randn(v.shape, generator=gen, dtype=torch.float64)
            assert out[k].dtype == v.dtype
            torch.testing.assert_close(out[k], expected.to(v.dtype), rtol=0, atol=1e-7)
    secure = make("dp_central", clip=2.0, noise_multiplier=0.5, seed=3)
    encoded = [secure.encode(update(tensors), ctx(1, 0))]
    assert not torch.equal(secure.combine(encoded, ctx(1, -1, "server")).tensors["a"],
                           secure.combine(encoded, ctx(1, -1, "server")).tensors["a"])


def test_a_client_level_budget_stops_past_its_target_and_not_at_it() -> None:
    """dp_local's ε is the Gaussian mechanism of multiplier z/2 for every round; a round that would
    take ε past the target is refused, one that reaches it exactly is not; without noise, no ε."""
    from fedweave.errors import BudgetSpent
    from fedweave.plugins.privacy.clip import clip_tensors

    eps2, eps3 = opacus_epsilon(1.5, 1.0, 2), opacus_epsilon(1.5, 1.0, 3)
    local = make("dp_local", noise_multiplier=3.0, target_epsilon=eps2)
    local.begin_round(1, [0])
    local.begin_round(2, [0])
    with pytest.raises(BudgetSpent, match=rf"^plugin 'dp_local': round 3 would raise ε to {eps3:.3f}, past the target"):
        local.begin_round(3, [0])
    central = make("dp_central", noise_multiplier=1.0, target_epsilon=0.5)
    with pytest.raises(BudgetSpent, match=r"^plugin 'dp_central': round 1 would raise ε to"):
        central.begin_round(1, [0])
    quiet = make("dp_local", clip=0.5, noise_multiplier=0.0, target_epsilon=0.01)
    for rnd in (1, 2, 3):
        quiet.begin_round(rnd, [0])  # no noise, no finite ε: nothing to stop
    assert quiet.metrics() == {}
    tensors = random_update(torch.Generator().manual_seed(7), 2.0)
    out = quiet.encode(update(tensors), ctx()).tensors
    assert all(torch.equal(out[k], v) for k, v in clip_tensors(tensors, 0.5)[0].items())


def test_adaptive_clipping_moves_the_clip_norm_by_hand() -> None:
    """One round with seeded noise, redrawn here: the update's noise first, then the count's;
    b̃ = (Σ b_k + σ_b·N) / m, C ← C·exp(−η(b̃ − γ))."""
    from fedweave.seeding import torch_generator
    from fedweave.types import UpdateKind

    plugin = make("dp_central", clip=1.0, noise_multiplier=0.5, adaptive=True, count_noise=1.0, seed=4, seeded_noise=True)
    sent = [update({"w": torch.tensor([0.3, 0.4, 0.0])}, client_id=0), update({"w": torch.tensor([3.0, 0.0, 0.0])}, client_id=1)]
    encoded = [dataclasses.replace(plugin.encode(u, ctx(1, u.client_id)), applied=["clip", "dp_central"]) for u in sent]
    assert [e.tensors["__dp_unclipped"].item() for e in encoded] == [1, 0]
    out = plugin.combine(encoded, ctx(1, -1, "server"))
    gen = torch_generator(4, "dp_central", 1)
    noise = torch.randn(3, generator=gen, dtype=torch.float64) * (0.5**-2 - 2.0**-2) ** -0.5  # z_Δ·C, C = 1
    count = float(torch.randn((), generator=gen, dtype=torch.float64))
    torch.testing.assert_close(out.tensors["w"], ((torch.tensor([0.3, 0.4, 0.0]) + torch.tensor([1.0, 0.0, 0.0])).double() + noise).float() / 2)
    assert plugin.clip_norm == pytest.approx(math.exp(-0.2 * ((1 + count) / 2 - 0.5)), rel=1e-12)
    assert out.kind is UpdateKind.DELTA and out.applied == ["clip", "dp_central"] and "__dp_unclipped" not in out.tensors


def test_dpsgd_takes_over_training_with_each_clients_seeded_stream_and_leaves_the_wire_alone() -> None:
    from fedweave.plugins.privacy.noise import SecureNoise
    from fedweave.seeding import torch_generator

    plugin = make("dpsgd", seed=6, seeded_noise=True)
    private = plugin.training(ctx(2, 5))
    stream = torch_generator(6, "dpsgd", 2, 5)  # the run seed's stream of this client and round
    assert torch.equal(private.noise.uniform((4,)), torch.rand(4, generator=stream, dtype=torch.float64))
    assert isinstance(make("dpsgd").training(ctx(2, 5)).noise, SecureNoise)
    train = Instruction(2, TaskKind.TRAIN, Work(0, batch_size=8), {})
    assert plugin.decode(train, ctx(2, 5)) == train  # nothing of it travels in the instruction
    sent = update({"w": torch.ones(2)})
    assert plugin.decode(sent, ctx(2, 5)) == sent


def test_the_norm_of_an_update_without_floating_tensors_is_zero() -> None:
    counters = {"n": torch.tensor(3), "m": torch.tensor([1, 2])}
    assert l2_norm(counters) == 0.0
    out = make("clip", max_norm=0.5).encode(update(counters), ctx()).tensors
    assert all(torch.equal(out[k], v) for k, v in counters.items())


@pytest.mark.parametrize("module", ["opacus.grad_sample", "opacus.accountants"])
def test_without_opacus_the_error_names_the_extra(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedweave.plugins.privacy import accountant, dpsgd

    monkeypatch.setitem(sys.modules, module, None)  # as if Opacus were not installed
    load = dpsgd._opacus if module == "opacus.grad_sample" else accountant._opacus_rdp
    what = "plugin 'dpsgd' needs" if module == "opacus.grad_sample" else "privacy accounting needs"
    with pytest.raises(ImportError, match=rf"^{what} Opacus: pip install 'fedweave\[privacy\]'$"):
        load()


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_dpsgd_trains_the_model_it_is_given_and_nothing_without_data() -> None:
    """A strategy may hand its own model (Ditto's personal one); a client without data trains nothing and reports nothing."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 4, generator=g), torch.randint(0, 2, (12,), generator=g)
    plugin = make("dpsgd", noise_multiplier=0.5, max_grad_norm=1.0)

    def private_job(xs: torch.Tensor, ys: torch.Tensor) -> ClientJob:
        ins = Instruction(1, TaskKind.TRAIN, Work(0, batch_size=4, local_steps=2), nn.Linear(4, 2).state_dict())
        private = plugin.training(ctx(1, 0))
        settings = LocalSettings("sgd", lr=0.1, momentum=0.0, weight_decay=0.0)
        return ClientJob(0, ins, nn.Linear(4, 2), xs, ys, xs[:0], ys[:0], nn.functional.cross_entropy, settings, torch.Generator().manual_seed(1), training=private)

    job = private_job(x, y)
    private = job.training
    assert private.report() == {}  # nothing spent before it trains
    own = nn.Linear(4, 2)
    before, untouched = own.weight.detach().clone(), job.model.weight.detach().clone()
    result = train_local(job, model=own)
    assert result.steps == 2 and not torch.equal(own.weight, before) and torch.equal(job.model.weight, untouched)
    empty = private_job(x[:0], y[:0])
    nothing = train_local(empty)
    assert (nothing.steps, nothing.num_examples) == (0, 0) and math.isnan(nothing.mean_loss) and empty.training.report() == {}
    single = private_job(x[:1], y[:1])
    assert train_local(single).steps == 2  # one example is data: q = 1
    assert single.training.report() == {"dpsgd_rate": 1.0, "dpsgd_steps": 2.0}


def test_one_dpsgd_step_by_hand() -> None:
    """Seeded, so the batch and the noise are drawn again here: each sampled example's gradient
    clipped to C (all parameters together), summed, plus N(0, (z·C)²), divided by the expected
    batch size B, then one SGD step; Opacus's hook warning is the plugin's to silence."""
    import warnings

    from fedweave.plugins.privacy.noise import SeededNoise

    g = torch.Generator().manual_seed(3)
    n, batch, clip, z, lr = 10, 4, 0.3, 0.7, 0.5
    x, y = torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)
    model = nn.Linear(3, 2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    plugin = make("dpsgd", noise_multiplier=z, max_grad_norm=clip, seed=1, seeded_noise=True)
    ins = Instruction(1, TaskKind.TRAIN, Work(0, batch_size=batch, epochs=1), start)
    private = plugin.training(ctx(1, 2))
    settings = LocalSettings("sgd", lr=lr, momentum=0.0, weight_decay=0.0)
    job = ClientJob(2, ins, model, x[:batch], y[:batch], x[:0], y[:0], nn.functional.cross_entropy, settings, torch.Generator(), training=private)
    job.x_train, job.y_train = x, y
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = train_local(job)
    assert result.steps == 3  # one epoch: ⌈n / B⌉ steps
    stream = SeededNoise(1, "dpsgd", 1, 2)
    w, b = start["weight"].double(), start["bias"].double()
    for _ in range(3):
        chosen = (stream.uniform((n,)) < batch / n).nonzero().squeeze(1).tolist()
        total = [torch.zeros_like(w), torch.zeros_like(b)]
        for i in chosen:
            leaves = [w.clone().requires_grad_(), b.clone().requires_grad_()]
            loss = nn.functional.cross_entropy(x[i : i + 1].double() @ leaves[0].T + leaves[1], y[i : i + 1])
            grads = torch.autograd.grad(loss, leaves)
            norm = math.sqrt(sum(float(gr.pow(2).sum()) for gr in grads))
            total = [t + gr * min(1.0, clip / norm) for t, gr in zip(total, grads)]
        noisy = [(t + z * clip * stream.normal(tuple(t.shape))) / batch for t in total]
        w, b = w - lr * noisy[0], b - lr * noisy[1]
    torch.testing.assert_close(model.weight.detach().double(), w, rtol=0, atol=1e-5)
    torch.testing.assert_close(model.bias.detach().double(), b, rtol=0, atol=1e-5)


def test_dpsgd_uses_the_optimiser_and_loss_a_strategy_hands_it() -> None:
    """The strategy's optimiser steps (lr 0 here: nothing moves) and its reported loss is averaged over
    the examples of every step (a constant 2.0 averages to 2.0); after_backward sees the model trained."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 4, generator=g), torch.randint(0, 2, (20,), generator=g)
    plugin = make("dpsgd", noise_multiplier=0.5, max_grad_norm=1.0, seeded_noise=True)
    model = nn.Linear(4, 2)
    before = model.weight.detach().clone()
    ins = Instruction(1, TaskKind.TRAIN, Work(0, batch_size=5, local_steps=6), model.state_dict())
    private = plugin.training(ctx(1, 0))
    settings = LocalSettings("sgd", lr=0.1, momentum=0.0, weight_decay=0.0)
    job = ClientJob(0, ins, model, x, y, x[:0], y[:0], nn.functional.cross_entropy, settings, torch.Generator(), training=private)
    seen: list[nn.Module] = []

    def loss(module: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.cross_entropy(module(xb), yb), torch.tensor(2.0)

    result = train_local(
        job, optimizer=LocalOptimizer(model.parameters(), dataclasses.replace(settings, lr=0.0)), loss=loss,
        after_backward=seen.append,
    )
    assert torch.equal(model.weight, before) and result.mean_loss == 2.0
    assert len(seen) == 6 and all(m is model for m in seen)


def test_dpsgd_refuses_a_model_without_per_example_gradients() -> None:
    plugin = make("dpsgd")
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    ins = Instruction(1, TaskKind.TRAIN, Work(0, batch_size=4, local_steps=1), model.state_dict())
    private = plugin.training(ctx(1, 0))
    settings = LocalSettings("sgd", lr=0.1, momentum=0.0, weight_decay=0.0)
    x = torch.randn(8, 4)
    job = ClientJob(0, ins, model, x, torch.zeros(8, dtype=torch.long), x[:0], x[:0], nn.functional.cross_entropy, settings, torch.Generator(), training=private)
    with pytest.raises(ValueError, match=r"^plugin 'dpsgd' cannot train this model privately: .*BatchNorm"):
        train_local(job)


def test_epsilon_of_nothing_is_zero_and_a_huge_one_is_reported_quietly() -> None:
    import warnings

    from fedweave.plugins.privacy.accountant import epsilon

    assert epsilon([], DELTA) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = opacus_epsilon(0.05, 1.0, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Opacus's "optimal order is the smallest alpha": ε is still a bound
        assert epsilon([(0.05, 1.0, 100)], DELTA) == pytest.approx(reference, rel=1e-9)


def test_a_dpsgd_round_whose_batches_all_came_out_empty_reports_no_loss() -> None:
    """Poisson sampling at q = 1/50 may pick nobody: the round still took its (noisy) step, and its mean loss is nan."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 4, generator=g), torch.randint(0, 2, (50,), generator=g)
    plugin = make("dpsgd", noise_multiplier=1.0, max_grad_norm=1.0, seeded_noise=True)  # seed 0: the one step's batch is empty
    model = nn.Linear(4, 2)
    ins = Instruction(1, TaskKind.TRAIN, Work(0, batch_size=1, local_steps=1), model.state_dict())
    private = plugin.training(ctx(1, 0))
    settings = LocalSettings("sgd", lr=0.1, momentum=0.0, weight_decay=0.0)
    job = ClientJob(0, ins, model, x, y, x[:0], y[:0], nn.functional.cross_entropy, settings, torch.Generator(), training=private)
    result = train_local(job)
    assert result.steps == 1 and result.num_examples == 50 and math.isnan(result.mean_loss)


@pytest.mark.parametrize(("byte", "expected"), [(0x00, 2.0**-53), (0xFF, 1.0)])
def test_secure_uniforms_stay_in_the_open_closed_unit_interval(byte: int, expected: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """(k + 1)·2^−53 for 53-bit k: never 0 (Box–Muller takes its log), at most 1."""
    from fedweave.plugins.privacy import noise

    monkeypatch.setattr(noise.os, "urandom", lambda n: bytes([byte]) * n)
    assert noise._secure_uniform(3).tolist() == [expected] * 3
    assert torch.isfinite(noise.SecureNoise().normal((4,))).all()


def reply_metrics(*overrides: str) -> dict[str, float]:
    """The metrics of the update client 1 sends for round 1 under ``overrides``, as it leaves the client."""
    from fedweave.build import build_chains, build_client_runtime, build_task, initial_params
    from fedweave.federated.client import ClientStateStore
    from fedweave.types import Message

    config = small_config(*overrides)
    task = build_task(config)
    runtime = build_client_runtime(config, task, build_chains(config), ClientStateStore())
    instruction = Instruction(1, TaskKind.TRAIN, Work(1, 16), initial_params(config, task))
    return dict(runtime.handle(Message(1, 1, instruction)).body.metrics)


@pytest.mark.parametrize(
    ("chain", "sent"),
    [
        ("plugins.client_send=[]", {"train_loss"}),
        ("plugins.client_send=[{name: dp_local, noise_multiplier: 1.0}]", set()),
        ("plugins.client_send=[{name: dp_central, noise_multiplier: 1.0}]", set()),
        ("plugins.client_receive=[{name: dpsgd, noise_multiplier: 1.0, max_grad_norm: 1.0}]", {"dpsgd_rate", "dpsgd_steps"}),
    ],
    ids=["none", "dp_local", "dp_central", "dpsgd"],
)
def test_under_dp_a_client_sends_no_metric_computed_from_its_data(chain: str, sent: set[str]) -> None:
    """A training loss is a function of the client's data that neither the clip nor the noise
    reaches: under any DP plugin the update leaves without it (DP-SGD's report of its sampling
    rate and steps, what the server's ledger needs, stays)."""
    assert set(reply_metrics(chain)) == sent


def test_a_dp_runs_record_shows_no_training_loss(tmp_path: Path) -> None:
    _, plain = run_to_end(tmp_path / "plain", "rounds=1")
    _, private = run_to_end(tmp_path / "dp", "rounds=1", "plugins.client_send=[{name: dp_local, noise_multiplier: 1.0}]")
    assert math.isfinite(plain[0]["train_loss"]) and private[0]["train_loss"] is None


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_dpsgd_hands_a_strategys_loss_the_model_and_a_second_training_spends_too() -> None:
    """A loss hook reads the model's own parameter names (FedProx's anchor, Ditto's), not Opacus's
    wrapper's; a second training of the round (Ditto's personal model) adds its steps to the report,
    at the larger of the two rates."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 4, generator=g), torch.randint(0, 2, (20,), generator=g)
    plugin = make("dpsgd", noise_multiplier=0.5, max_grad_norm=1.0, seeded_noise=True)
    model = nn.Linear(4, 2)
    anchor = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ins = Instruction(1, TaskKind.TRAIN, Work(0, batch_size=5, local_steps=3), anchor)
    settings = LocalSettings("sgd", lr=0.1, momentum=0.0, weight_decay=0.0)
    job = ClientJob(0, ins, model, x, y, x[:0], y[:0], nn.functional.cross_entropy, settings, torch.Generator(),
                    training=plugin.training(ctx(1, 0)))
    names: list[set[str]] = []

    def proximal(module: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        names.append({n for n, _ in module.named_parameters()})
        task = nn.functional.cross_entropy(module(xb), yb)
        return task + sum(((p - anchor[n]) ** 2).sum() for n, p in module.named_parameters()), task

    assert train_local(job, loss=proximal).steps == 3
    assert names == [{"weight", "bias"}] * 3
    assert job.training.report() == {"dpsgd_rate": 5 / 20, "dpsgd_steps": 3.0}
    personal = nn.Linear(4, 2)
    train_local(dataclasses.replace(job, instruction=dataclasses.replace(ins, work=Work(0, batch_size=10, local_steps=2))),
                model=personal)
    assert job.training.report() == {"dpsgd_rate": 10 / 20, "dpsgd_steps": 5.0}


@pytest.mark.parametrize("strategy", ["{name: fedprox, mu: 0.1}", "{name: ditto, personal_steps: 2}"])
def test_dpsgd_runs_with_strategies_whose_loss_reads_the_model_and_counts_every_training(tmp_path: Path, strategy: str) -> None:
    """FedProx's proximal term and Ditto's personal model under DP-SGD (both failed on Opacus's
    prefixed names before); Ditto's clients train twice a round, and the ledger counts both."""
    r = runner.prepare(small_config(f"strategy={strategy}", "rounds=2", "plugins.client_receive=[{name: dpsgd, seeded_noise: true}]"),
                       tmp_path)
    records = runner.execute(r)
    assert [rec["clients_completed"] for rec in records] == [4, 4]
    ledger = r.parts.chains.client_receive.plugins[0].ledger
    sizes = build_task(r.config).clients.train_size
    steps = {c: r.config.local.epochs * -(-sizes(c) // 16) + (2 if "ditto" in strategy else 0) for c in range(4)}
    assert ledger == {c: [(1.0, 16 / sizes(c), steps[c])] * 2 for c in range(4)}
    worst = max(opacus_epsilon(1.0, 16 / sizes(c), 2 * steps[c]) for c in range(4))
    assert records[-1]["epsilon"] == pytest.approx(worst, rel=1e-9)
