"""Tests of fedweave.checkpoint: atomic writes that leave the previous file intact on failure."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fedweave import checkpoint
from fedweave.checkpoint import CHECKPOINT, atomic_write_text, load_checkpoint, save_checkpoint
from fedweave.errors import CheckpointError


def state(rnd: int) -> dict[str, Any]:
    return {"round": rnd, "params": {"w": torch.full((3,), float(rnd))}, "strategy": {}, "client_states": {}}


def test_save_then_load(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, state(2))
    loaded = load_checkpoint(tmp_path)
    assert loaded["round"] == 2 and torch.equal(loaded["params"]["w"], torch.full((3,), 2.0))
    save_checkpoint(tmp_path, state(3))
    assert load_checkpoint(tmp_path)["round"] == 3
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT]


def test_a_failure_while_saving_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_checkpoint(tmp_path, state(1))
    before = (tmp_path / CHECKPOINT).read_bytes()

    def half_then_fail(obj: Any, f: Any) -> None:
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", half_then_fail)
    with pytest.raises(OSError, match="No space left on device"):
        save_checkpoint(tmp_path, state(2))
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT]  # no temporary file left behind
    assert (tmp_path / CHECKPOINT).read_bytes() == before
    monkeypatch.undo()
    assert load_checkpoint(tmp_path)["round"] == 1


def test_an_interrupt_while_saving_cleans_up_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(obj: Any, f: Any) -> None:
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, state(1))
    assert list(tmp_path.iterdir()) == []


def test_text_is_replaced_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config.yaml"
    atomic_write_text("rounds: 1\n", path)

    def failing_replace(src: Any, dst: Any) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr(checkpoint.os, "replace", failing_replace)
    with pytest.raises(OSError, match="rename failed"):
        atomic_write_text("rounds: 2\n", path)
    assert path.read_text() == "rounds: 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.mark.usefixtures("umask_022")
def test_files_get_the_permissions_of_the_umask(tmp_path: Path) -> None:
    """As open() would give them: a run directory others may read, like metrics.jsonl."""
    atomic_write_text("x", tmp_path / "config.yaml")
    save_checkpoint(tmp_path, state(1))
    for name in ("config.yaml", CHECKPOINT):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"^no checkpoint at '.*checkpoint\.pt': nothing to resume$"):
        load_checkpoint(tmp_path)
    (tmp_path / CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"checkpoint '.*' cannot be read"):
        load_checkpoint(tmp_path)
    torch.save([1, 2], tmp_path / CHECKPOINT)
    with pytest.raises(CheckpointError, match=r"checkpoint '.*' is not a fedweave server state$"):
        load_checkpoint(tmp_path)


def test_the_writer_saves_the_state_as_it_was_when_saved(tmp_path: Path) -> None:
    writer = checkpoint.CheckpointWriter(tmp_path)
    first = state(1)
    writer.save(first)
    first["params"]["w"].fill_(99.0)  # the next round changes the tensors in place
    writer.close()
    assert torch.equal(load_checkpoint(tmp_path)["params"]["w"], torch.full((3,), 1.0))
    writer.save(state(2))
    writer.save(state(3))  # waits for round 2's write
    writer.close()
    assert load_checkpoint(tmp_path)["round"] == 3
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT]


def test_a_failed_background_write_is_raised_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = checkpoint.CheckpointWriter(tmp_path)
    writer.save(state(1))
    writer.close()
    before = (tmp_path / CHECKPOINT).read_bytes()

    def no_space(fd: int) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint.os, "fsync", no_space)
    writer.save(state(2))
    with pytest.raises(CheckpointError, match="could not be written: No space left on device"):
        writer.close()
    writer.close()  # reported once
    assert (tmp_path / CHECKPOINT).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT]
