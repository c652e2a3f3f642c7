"""Tests of fedweave.checkpoint: atomic writes that leave the previous file intact on failure."""

from __future__ import annotations

import stat
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fedweave import checkpoint, files
from fedweave.checkpoint import (
    CHECKPOINT,
    check_params,
    atomic_save,
    load_checkpoint,
)
from fedweave.errors import CheckpointError
from fedweave.files import atomic_write_bytes, atomic_write_text
from fedweave.types import Update, UpdateKind


def state(rnd: int) -> dict[str, Any]:
    return {"round": rnd, "params": {"w": torch.full((3,), float(rnd))}, "strategy": {}, "client_states": {}}


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> None:
    """A checkpoint as the data-parallel spine writes one: atomic_save in the foreground."""
    atomic_save(state, run_dir / CHECKPOINT)


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

    monkeypatch.setattr(files.os, "replace", failing_replace)
    with pytest.raises(OSError, match="rename failed"):
        atomic_write_text("rounds: 2\n", path)
    assert path.read_text() == "rounds: 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


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


class _RunsCode:
    """A pickle that, when loaded without ``weights_only``, opens (creates) a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_a_checkpoint_that_would_run_code_is_refused_in_one_line(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    torch.save({"round": 1, "params": _RunsCode(marker)}, tmp_path / CHECKPOINT)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(tmp_path)
    message = str(refused.value)
    assert message.endswith("cannot be read: it calls for io.open, which is not checkpoint data (refused, nothing unpickled)")
    assert "\n" not in message
    assert not marker.exists()
    torch.load(tmp_path / CHECKPOINT, weights_only=False)  # the file is the exploit it claims to be
    assert marker.exists()


def test_registered_types_load_with_weights_only(tmp_path: Path) -> None:
    update = Update(UpdateKind.DELTA, {"w": torch.ones(2)}, num_examples=3, client_id=1)
    save_checkpoint(tmp_path, {"round": 4, "buffer": [update]})
    (loaded,) = load_checkpoint(tmp_path)["buffer"]
    assert loaded.kind is UpdateKind.DELTA and loaded.num_examples == 3 and torch.equal(loaded.tensors["w"], torch.ones(2))


def test_check_params_names_the_first_mismatch() -> None:
    model = {"a": torch.zeros(2, 3), "b": torch.zeros(3)}
    check_params({"a": torch.ones(2, 3), "b": torch.ones(3)}, model, "here")
    with pytest.raises(CheckpointError, match=r"^here: tensor 'a' has shape \[3, 2\] in the checkpoint but \[2, 3\] "):
        check_params({"a": torch.ones(3, 2), "b": torch.ones(3)}, model, "here")
    with pytest.raises(CheckpointError, match=r"^here: the config's model has tensor 'b', the checkpoint does not$"):
        check_params({"a": torch.ones(2, 3)}, model, "here")
    with pytest.raises(CheckpointError, match=r"^here: the checkpoint has tensor 'c', the config's model does not$"):
        check_params({"a": torch.ones(2, 3), "b": torch.ones(3), "c": torch.ones(1)}, model, "here")
    with pytest.raises(CheckpointError, match=r"^here: 'b' is not a tensor in the checkpoint$"):
        check_params({"a": torch.ones(2, 3), "b": [1.0]}, model, "here")


@pytest.mark.usefixtures("umask_022")
@pytest.mark.parametrize("private", [True, False])
def test_a_private_file_is_owner_only_even_when_it_existed_with_a_looser_mode(tmp_path: Path, private: bool) -> None:
    path = tmp_path / "client-0.key"
    path.write_bytes(b"old")
    path.chmod(0o644)
    atomic_write_bytes(b"secret", path, private=private)
    assert path.read_bytes() == b"secret"
    assert stat.S_IMODE(path.stat().st_mode) == (0o600 if private else 0o644)
    assert [p.name for p in tmp_path.iterdir()] == ["client-0.key"]


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

    monkeypatch.setattr(files.os, "fsync", no_space)
    writer.save(state(2))
    with pytest.raises(CheckpointError, match="could not be written: No space left on device"):
        writer.close()
    writer.close()  # reported once
    assert (tmp_path / CHECKPOINT).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT]


def test_a_foreground_writer_returns_with_the_checkpoint_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = checkpoint.CheckpointWriter._write

    def slow_write(self: checkpoint.CheckpointWriter, buffer: Any, rnd: int) -> None:
        time.sleep(0.3)  # a slow disk
        write(self, buffer, rnd)

    monkeypatch.setattr(checkpoint.CheckpointWriter, "_write", slow_write)
    for background in (True, False):
        folder = tmp_path / str(background)
        folder.mkdir()
        writer = checkpoint.CheckpointWriter(folder, background=background)
        writer.save(state(4))
        assert (folder / CHECKPOINT).is_file() is not background  # in flight only in the background
        writer.close()
        assert load_checkpoint(folder)["round"] == 4


@pytest.mark.parametrize("background", [True, False])
def test_the_files_a_checkpoint_covers_are_synced_before_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b'{"round": 1}\n')
    synced: list[str] = []
    fsync = files.os.fsync
    monkeypatch.setattr(
        files.os, "fsync", lambda fd: (synced.append(Path(files.os.readlink(f"/proc/self/fd/{fd}")).name), fsync(fd))
    )
    writer = checkpoint.CheckpointWriter(tmp_path, background=background, covers=[metrics])
    writer.save(state(1))
    writer.close()
    assert len(synced) == 2 and synced[0] == "metrics.jsonl" and synced[1].startswith(f".{CHECKPOINT}.")
    assert load_checkpoint(tmp_path)["round"] == 1
