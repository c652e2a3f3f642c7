"""The run directory: one folder per run, from its creation to its resume.

``<output_dir>/<name>-<timestamp>/`` holds ``config.yaml`` (the validated config,
written first), ``run.json`` (the run's id, which each checkpoint records, and the fingerprints
of the keys it was begun with: :func:`key_fingerprints`), ``run.lock`` (:func:`lock`), ``metrics.jsonl`` (one line per round or metrics window, appended as
each ends), ``checkpoint.pt`` (:mod:`fedweave.checkpoint`), ``model.pt`` (the trained
model's tensors) and the plots. Both spines, the federated runner
(:mod:`fedweave.runner`, :mod:`fedweave.launchers.process`) and the data-parallel
launcher (:mod:`fedweave.data_parallel.launch`), create, reopen and follow a run
directory through these functions.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import yaml

from fedweave import config as config_mod
from fedweave.checkpoint import CHECKPOINT, RUN_FILE, atomic_save, run_id
from fedweave.files import atomic_write_text
from fedweave.config import Config
from fedweave.errors import CheckpointError, ConfigError, FedweaveError
from fedweave.observe.metrics import MetricsWriter, read_metrics

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
MODEL_FILE = "model.pt"
SEALED_MODEL_FILE = "model.he.pt"
"""The global model a run kept encrypted (plugin he), as its server holds it; `fedweave decrypt` makes model.pt."""
LOCK_FILE = "run.lock"
KEY_FILES = ("public.ctx", "secret.ctx", "ca.pem", "tokens.json")
"""The files of the he plugin's keys and of the gRPC credentials that a run directory records."""

log = logging.getLogger(__name__)

_held: dict[Path, int | None] = {}
"""The run directories this process writes: the descriptor of each one's lock (None: written under
the lock of the process that started this one)."""


class RunInUse(FedweaveError):
    """Another process writes the run directory."""


def new_run_dir(config: Config) -> Path:
    """``<output_dir>/<name>-<timestamp>``, made unique with a suffix if it exists."""
    base = Path(config.output_dir) / f"{config.name}-{datetime.now():%Y%m%d-%H%M%S}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
    return path


def create(config: Config, run_dir: Path | None = None) -> tuple[Path, bool]:
    """The directory of a new run (``run_dir``, else :func:`new_run_dir`) with ``config``
    saved in it, and whether it was fresh (absent or empty) before.

    A directory that already holds a run (metrics or a checkpoint) is refused rather
    than mixed with the new run's records.
    """
    run_dir = new_run_dir(config) if run_dir is None else Path(run_dir)
    _refuse_a_run_in(run_dir)
    fresh = not run_dir.exists() or all(p.name == LOCK_FILE for p in run_dir.iterdir())
    taken = lock(run_dir)
    try:
        _refuse_a_run_in(run_dir)  # (begun by another process before this one held the lock)
    except ConfigError:
        if taken:
            release(run_dir)
        raise
    atomic_write_text(config_mod.to_yaml(config), run_dir / CONFIG_FILE)
    info = {"id": secrets.token_hex(6), "keys": key_fingerprints(config)}
    atomic_write_text(json.dumps(info, indent=1) + "\n", run_dir / RUN_FILE)
    return run_dir, fresh


def _refuse_a_run_in(run_dir: Path) -> None:
    if (run_dir / METRICS_FILE).exists() or (run_dir / CHECKPOINT).exists():
        raise ConfigError(
            f"run directory {str(run_dir)!r} already holds a run; continue it with "
            "`fedweave run --resume` or choose another directory"
        )


def lock(run_dir: Path) -> bool:
    """Make this process the one writer of ``run_dir`` (made if absent) until :func:`release` or its
    end; whether it took the lock now (False: it held it already, or writes under its parent's).

    The lock is an exclusive ``flock`` of ``run_dir/run.lock``, which names its holder's pid; the
    system drops it when the holder ends, however it ends (kill -9 too). A second writer (another
    ``fedweave server``, ``fedweave run --resume`` or torchrun job on the same directory) gets
    :class:`RunInUse` naming the holder. A node the holder started itself (the server of the
    process launcher) writes under its parent's lock. A run directory without an id (begun by an
    older version) gets one.
    """
    key = Path(run_dir).resolve()
    if _holds(key):
        return False
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # a file system without locks
            log.warning("cannot lock %s (%s): nothing keeps a second writer out", key / LOCK_FILE, exc.strerror)
            _held[key] = None
        elif holder == str(os.getppid()):
            _held[key] = None
        else:
            raise RunInUse(
                f"run directory {str(run_dir)!r} is in use by process {holder or '(unknown)'}, which holds "
                f"{LOCK_FILE} in it; wait for that process to end or stop it, or choose another directory"
            ) from None
        return True
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[key] = fd
    if holds_run(key) and run_id(key) is None:
        atomic_write_text(json.dumps({"id": secrets.token_hex(6), "keys": {}}, indent=1) + "\n", key / RUN_FILE)
    return True


def _holds(key: Path) -> bool:
    """Whether this process holds the lock of ``key`` still (its lock file not removed since)."""
    if key not in _held:
        return False
    fd = _held[key]
    try:
        if fd is None or os.fstat(fd).st_ino == os.stat(key / LOCK_FILE).st_ino:
            return True
    except OSError:
        pass
    release(key)  # the directory was removed (a run that could not be built) or made again
    return False


def release(run_dir: Path) -> None:
    """Let another process write ``run_dir`` (the end of this process's run in it)."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


def key_fingerprints(config: Config) -> dict[str, str]:
    """SHA-256 of each key file ``config`` names that exists here, by its path: the he plugin's
    contexts (``public.ctx``, ``secret.ctx``) and the gRPC credentials' CA certificate and token
    hashes. A run directory records them in run.json; `fedweave keys` and `fedweave certs` never
    replace a file a run directory records (:func:`runs_using`)."""
    folders = [config.grpc.credentials]  # (auto: the process launcher's, made for the run in its directory)
    for spec in (s for chain in vars(config.plugins).values() for s in chain if s.name == "he"):
        params = spec.params
        folders.append(params.get("keys") if isinstance(params, Mapping) else getattr(params, "keys", None))
    files = [Path(f) / name for f in folders if isinstance(f, str) for name in KEY_FILES]
    return {str(path): fingerprint(path) for path in files if path.is_file()}


def fingerprint(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def runs_using(path: Path, places: Iterable[Path]) -> list[Path]:
    """The run directories among ``places`` (each a run directory or a folder of them) whose run.json
    records the key file ``path`` (by its fingerprint, wherever the file is now)."""
    mine = fingerprint(path)
    return [run for run in _run_dirs(places) if mine in _recorded_keys(run).values()]


def _run_dirs(places: Iterable[Path]) -> Iterator[Path]:
    for place in places:
        if (place / RUN_FILE).is_file():
            yield place
        elif place.is_dir():
            yield from (child for child in sorted(place.iterdir()) if (child / RUN_FILE).is_file())


def _recorded_keys(run: Path) -> dict[str, Any]:
    try:
        keys = json.loads((run / RUN_FILE).read_text()).get("keys")
    except (OSError, ValueError, AttributeError):
        return {}
    return keys if isinstance(keys, dict) else {}


def died_unsaved(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` ended before its first checkpoint without finishing (killed):
    resuming it begins it again (a run that finished with checkpoints off has its model)."""
    ended = (run_dir / CHECKPOINT, run_dir / MODEL_FILE, run_dir / SEALED_MODEL_FILE)
    return holds_run(run_dir) and not any(path.is_file() for path in ended)


def begin_again(run_dir: Path) -> None:
    """Drop the records of a run that died before its first checkpoint, which begins again."""
    log.info("%s holds no checkpoint of its run: beginning it again", run_dir)
    (run_dir / METRICS_FILE).unlink(missing_ok=True)


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` is the directory of a run begun before (its config is saved in it)."""
    return (run_dir / CONFIG_FILE).is_file()


def check_same_config(config: Config, run_dir: Path) -> None:
    """Refuse to continue the run in ``run_dir`` with a config other than the one it was begun with,
    naming the first key that differs."""
    saved = yaml.safe_load(config_mod.to_yaml(saved_config(run_dir)))
    given = yaml.safe_load(config_mod.to_yaml(config))
    if saved != given:
        key = _first_difference(saved, given)
        raise ConfigError(
            f"run directory {str(run_dir)!r} holds a run of another config (key {key!r} differs); start the "
            "server with the config it was begun with, or choose another directory"
        )


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
    return prefix.rstrip(".")


def saved_config(run_dir: Path) -> Config:
    """The config of the run saved in ``run_dir``; refused when it is not a run directory."""
    if not (run_dir / CONFIG_FILE).is_file():
        raise CheckpointError(f"{str(run_dir)!r} is not a run directory: it has no {CONFIG_FILE}")
    return config_mod.load(run_dir / CONFIG_FILE)


def records_until(run_dir: Path, key: str, last: int) -> list[dict[str, Any]]:
    """The metrics lines whose ``key`` (``round``, or ``step`` in data-parallel runs) is at
    most ``last``; the later ones, which a resumed run redoes, are dropped from the file."""
    metrics = MetricsWriter(run_dir / METRICS_FILE)
    metrics.truncate_after(last, key)
    return read_metrics(metrics.path)


class MetricsTail:
    """The records appended to ``metrics.jsonl`` since the last look (whole lines only)."""

    def __init__(self, path: Path, skip: int):
        self.path = path
        self.offset = 0
        self.skip = skip

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        records = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        fresh, self.skip = records[self.skip :], max(0, self.skip - len(records))
        return fresh


def save_model(params: Mapping[str, torch.Tensor], run_dir: Path) -> None:
    """The trained model's tensors in ``run_dir``."""
    atomic_save(params, run_dir / MODEL_FILE)


def save_sealed_model(tensors: Mapping[str, torch.Tensor], run_dir: Path) -> None:
    """The encrypted model's tensors (ciphertexts as uint8, layouts and integer tensors) in ``run_dir``."""
    atomic_save(tensors, run_dir / SEALED_MODEL_FILE)


def load_model(run_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors :func:`save_model` wrote in ``run_dir``."""
    return torch.load(run_dir / MODEL_FILE, weights_only=True)
