"""Joiners the run ends before admitting (:func:`fedweave.data_parallel.elastic.turn_away`)."""

from __future__ import annotations

import threading

import pytest

from fedweave.data_parallel import elastic, group
from fedweave.data_parallel.group import Stopped


def test_a_joiner_waiting_for_admission_is_turned_away_at_once_when_the_run_ends() -> None:
    store = group.launcher_store(10)
    elastic.announce(store, 5, 0)
    store.set("admitted/6", "2")  # admitted earlier: left as it is
    elastic.announce(store, 6, 0)
    outcome: list[str] = []

    def wait() -> None:
        try:
            elastic.admission(group.worker_store(("127.0.0.1", store.port), 10), 5, 0)
        except Stopped as exc:
            outcome.append(str(exc))

    waiting = threading.Thread(target=wait)
    waiting.start()
    elastic.turn_away(store)
    waiting.join(10)  # `end` is not set: only its own key releases it
    assert outcome == ["the run ended before this worker was admitted"]
    assert store.get("admitted/5").decode() == elastic.ENDED and store.get("admitted/6").decode() == "2"
    assert not store.check(["end"])  # woken by its own key, not by the run's end flag
    with pytest.raises(Stopped, match="the run ended before"):  # a joiner announced late reads it at once
        elastic.admission(store, 5, 0)
