"""A round's record (fedweave.federated.records): the synchronous round and FedBuff's buffered spine
finish it with one function, so their records carry the same keys."""

from __future__ import annotations

from pathlib import Path

from conftest import run_to_end
from fedweave.federated.records import RECORD_KEYS

ASYNC = ["heterogeneity.clock=virtual", "asynchronous.enabled=true", "local.steps=10"]
BUFFERED_ONLY = {"clock"}
"""The buffered spine's own key: the virtual clock at the server step."""


def test_both_spines_records_carry_the_same_keys(tmp_path: Path) -> None:
    plugins = "plugins.client_send=[{name: clip, max_norm: 1.0}]"  # the plugins' metrics finished in, too
    _, sync = run_to_end(tmp_path / "sync", "local.steps=10", plugins)
    _, buffered = run_to_end(tmp_path / "async", *ASYNC, "asynchronous.buffer_size=4", "asynchronous.concurrency=4",
                             plugins)
    assert len(sync) == len(buffered) == 3
    for s, b in zip(sync, buffered):
        assert tuple(s)[: len(RECORD_KEYS)] == tuple(b)[: len(RECORD_KEYS)] == RECORD_KEYS
        assert set(b) - BUFFERED_ONLY == set(s)
        assert s["wall_time"] > 0 and b["wall_time"] > 0
