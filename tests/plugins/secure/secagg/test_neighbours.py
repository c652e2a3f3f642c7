"""SecAgg+'s neighbourhoods: a symmetric, sparse ring, new every round, whose masks still cancel."""

from __future__ import annotations

from ...helpers import make
from .rounds import assert_mean_within_quantization, masked_round, unmask


def test_secagg_plus_neighbourhoods_are_symmetric_and_sparse() -> None:
    plugin = make("secagg", neighbours=4, clients=30)
    graph = plugin.graph(3, list(range(30)))
    assert all(len(nb) == 4 and u not in nb for u, nb in graph.items())
    assert all(u in graph[v] for u, nb in graph.items() for v in nb)
    assert graph != plugin.graph(4, list(range(30)))  # a new random ring every round
    plugin, fed, plain, masked = masked_round(12, neighbours=4)
    assert_mean_within_quantization(unmask(plugin, fed, masked), plain, plugin)
