"""fedweave.reach: the one place that decides how the server reaches its clients."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conftest import small_config
from fedweave import runner
from fedweave.build import build_chains, build_client_runtime, build_task
from fedweave.federated.client import ClientStateStore
from fedweave.errors import ConfigError
from fedweave.reach import clients_topology
from fedweave.topologies.emulated import EmulatedClients
from fedweave.topologies.hierarchical import Hierarchical
from fedweave.topologies.ring import Ring
from fedweave.topologies.star import Star
from fedweave.transports.inmemory import InMemoryTransport


@pytest.mark.parametrize(
    ("overrides", "kind", "link"),
    [
        ([], Star, InMemoryTransport),
        (["heterogeneity.speeds=[1, 2, 4, 8]"], Star, EmulatedClients),
        (["topology={kind: hierarchical, sites: 2}"], Hierarchical, InMemoryTransport),
        (["topology=ring"], Ring, InMemoryTransport),
    ],
)
def test_a_simulation_reaches_its_clients_in_memory_through_its_topology(
    overrides: list[str], kind: type, link: type
) -> None:
    config = small_config(*overrides)
    runtime = build_client_runtime(config, build_task(config), build_chains(config), ClientStateStore())
    topology = clients_topology(config, runtime)
    assert type(topology) is kind
    assert type(topology.root.link if kind is Hierarchical else topology.transport) is link
    topology.close()


@pytest.mark.parametrize(("cohort", "lines"), [("auto", 1), ("off", 0)])
def test_emulated_clients_train_one_after_another_and_a_cohort_run_says_so(
    caplog: pytest.LogCaptureFixture, cohort: str, lines: int
) -> None:
    config = small_config("heterogeneity.clock=virtual", f"simulation.cohort={cohort}")
    runtime = build_client_runtime(config, build_task(config), build_chains(config), ClientStateStore())
    with caplog.at_level(logging.INFO, logger="fedweave.reach"):
        clients_topology(config, runtime).close()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("simulation.cohort:")]
    assert len(said) == lines
    assert all("one after another: emulated client speeds" in line for line in said)


def test_torchdist_sites_in_one_process_are_refused_before_the_run_begins(tmp_path: Path) -> None:
    """`topology.inner: torchdist` with `transport: inmemory` ran every link in memory without a word."""
    config = small_config("topology={kind: hierarchical, sites: 2, inner: torchdist}")
    with pytest.raises(ConfigError) as err:
        runner.prepare(config, tmp_path / "run")
    assert str(err.value).startswith("config key 'topology.inner': torchdist sites are the processes of one")
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()
