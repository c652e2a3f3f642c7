"""A sweep: one config run at every point of a grid of overrides and for every seed, each run in
its own folder under one sweep folder.

``<sweep>/sweep.yaml`` is the base config (resolved) and ``<sweep>/sweep.json`` the plan: the
seeds, the grid, and per run its folder, grid point and seed. A run's folder is named after its
grid point and seed (``strategy.name=fedprox,local.lr=0.1,seed=2``), so the same sweep finds the
same folders again: a rerun skips every finished run (its model written and its metrics at the
last round or step), resumes a run that left a checkpoint and begins again one that did not.

``jobs`` runs go on at a time. One job runs in this process (a callback sees every record as it
is written); several run as ``fedweave run`` processes whose records are followed in their
metrics files (those of a resumed run are not: it rewrites the file as it starts), each process given its share of the cores (``OMP_NUM_THREADS``). Every config is
validated before the first run starts: a typo in the grid fails at once, not after an hour.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from fedweave import config as config_mod
from fedweave import rundir
from fedweave.checkpoint import CHECKPOINT
from fedweave.config import Config
from fedweave.errors import ConfigError, FedweaveError
from fedweave.observe.compare import GroupSummary, group_summaries
from fedweave.observe.rundata import load_runs
from fedweave.observe.status import finished
from fedweave.rundir import MetricsTail

log = logging.getLogger(__name__)

BASE_FILE = "sweep.yaml"
PLAN_FILE = "sweep.json"
POLL = 0.2  # seconds between looks at the running processes

OnRound = Callable[[str, dict[str, Any]], None]
"""``on_round(run, record)``: the run's folder name and one of its metrics records."""


def parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    """``key=v1,v2`` items (dotted keys, as overrides) as key -> values; a value with commas of its
    own is written in brackets or braces (``heterogeneity.speeds=[1,2],[1,4]``)."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"--grid {item!r}: write key=value1,value2")
        if key in grid:
            raise ConfigError(f"--grid {item!r}: key {key!r} is given twice")
        grid[key] = split_values(values, f"--grid {item!r}")
    return grid


def split_values(text: str, where: str) -> list[str]:
    """``a,b`` -> [a, b]; commas inside brackets or braces do not split."""
    values, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            values.append(current)
            current = ""
        else:
            current += ch
    values.append(current)
    if depth != 0 or any(not v.strip() for v in values):
        raise ConfigError(f"{where}: an empty value or unbalanced brackets")
    return [v.strip() for v in values]


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: write whole numbers separated by commas, e.g. 1,2,3") from None
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r}: a seed is given twice")
    return seeds


def folder_name(point: Mapping[str, str], seed: int) -> str:
    """The folder of a grid point's run of ``seed``: its ``key=value`` pairs and the seed. Characters
    other than letters, digits and ``.=_+-`` become ``_``, and then a short hash of the point keeps two
    points apart."""
    plain = ",".join([*(f"{k}={v}" for k, v in point.items()), f"seed={seed}"])
    safe = re.sub(r"[^A-Za-z0-9.=_+,-]", "_", plain)
    if safe != plain or len(safe) > 120:
        safe = f"{safe[:100]}-{hashlib.sha256(plain.encode()).hexdigest()[:8]}"
    return safe


@dataclass(frozen=True)
class Job:
    name: str  # the run's folder under the sweep folder
    point: dict[str, str]
    seed: int

    @property
    def overrides(self) -> list[str]:
        return [*(f"{k}={v}" for k, v in self.point.items()), f"seed={self.seed}"]


def plan(seeds: Sequence[int], grid: Mapping[str, Sequence[str]]) -> list[Job]:
    """Every grid point (in the grid's order, the last key varying fastest) with every seed."""
    keys = list(grid)
    points = [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]
    return [Job(folder_name(p, s), p, s) for p in points for s in seeds]


@dataclass
class Sweep:
    """A sweep's folder, its runs and, once run, the summary per grid point."""

    folder: Path
    jobs: list[Job]
    ran: list[str] = field(default_factory=list)  # runs this call ran (or resumed)
    skipped: list[str] = field(default_factory=list)  # runs already finished
    failed: dict[str, str] = field(default_factory=dict)  # run -> why
    summary: list[GroupSummary] = field(default_factory=list)

    @property
    def run_dirs(self) -> list[Path]:
        return [self.folder / j.name for j in self.jobs]


def default_folder(config: Config) -> Path:
    return Path(config.output_dir) / f"{config.name}-sweep"


def default_jobs() -> int:
    """What the cores allow: one run per core this process may use."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def sweep(
    config: Config | str | Path | Mapping | None,
    seeds: Sequence[int] = (0,),
    grid: Mapping[str, Sequence[str]] | Sequence[str] = (),
    *,
    folder: str | Path | None = None,
    jobs: int | None = None,
    target: tuple[str, float] | None = None,
    on_round: OnRound | None = None,
    progress: bool | TextIO = False,
    overrides: Sequence[str] = (),
) -> Sweep:
    """Run ``config`` at every point of ``grid`` (key -> values, or ``key=v1,v2`` strings) for every
    seed in ``folder`` (default ``<output_dir>/<name>-sweep``), ``jobs`` at a time (default
    :func:`default_jobs`); the finished :class:`Sweep`, its summary per grid point with the time to
    ``target`` (metric, value) where given. ``progress``: a line per finished run on stderr (or the
    stream given); it is logged (INFO) either way."""
    from fedweave.api import load_config

    base = config if isinstance(config, Config) else load_config(config, overrides)
    if not isinstance(grid, Mapping):
        grid = parse_grid(grid)
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ConfigError(f"--jobs: {jobs} must be at least 1")
    if not seeds:
        raise ConfigError("--seeds: give at least one seed")
    out = Path(folder) if folder is not None else default_folder(base)
    work = plan(seeds, grid)
    base_text = config_mod.to_yaml(base)
    configs = {j.name: config_mod.from_dict(config_mod.apply_overrides(config_mod.parse_yaml(base_text), j.overrides))
               for j in work}  # every config checked before the first run starts
    out.mkdir(parents=True, exist_ok=True)
    _check_same_sweep(out, base_text)
    (out / BASE_FILE).write_text(base_text)
    plan_data = {"seeds": list(seeds), "grid": {k: list(v) for k, v in grid.items()},
                 "runs": [{"dir": j.name, "point": j.point, "seed": j.seed} for j in work]}
    (out / PLAN_FILE).write_text(json.dumps(plan_data, indent=1))
    result = Sweep(out, work)
    todo = []
    for job in work:
        run_dir = out / job.name
        if finished(run_dir):
            result.skipped.append(job.name)
        else:
            todo.append(job)
    stream = sys.stderr if progress is True else progress or None
    tracker = _Progress(len(work), len(result.skipped), stream)
    if result.skipped:
        tracker.say(f"{len(result.skipped)} of {len(work)} runs already finished: skipped")
    if jobs == 1:
        for job in todo:
            _run_here(job, configs[job.name], out / job.name, on_round, result, tracker)
    else:
        _run_processes(todo, out, jobs, on_round, result, tracker)
    result.summary = group_summaries(load_runs(result.run_dirs), target)
    return result


def _check_same_sweep(out: Path, base_text: str) -> None:
    """A folder holding another sweep's runs is refused: its runs would be mixed with this one's."""
    saved = out / BASE_FILE
    if saved.is_file() and saved.read_text() != base_text:
        raise ConfigError(
            f"sweep folder {str(out)!r} holds a sweep of another config; choose another folder (--out)"
        )


class _Progress:
    """``sweep: 3/6 runs done (1 skipped, 0 failed), 2 running, 12.3 s``, logged and written."""

    def __init__(self, total: int, skipped: int, stream: TextIO | None):
        self.total, self.done, self.failed, self.running = total, skipped, 0, 0
        self.stream = stream
        self.started = time.perf_counter()
        self.skipped = skipped

    def say(self, text: str) -> None:
        log.info("sweep: %s", text)
        if self.stream is not None:
            self.stream.write(f"sweep: {text}\n")
            self.stream.flush()

    def ended(self, name: str, why: str | None = None) -> None:
        self.done += 1
        self.failed += why is not None
        state = f"failed: {why}" if why else "finished"
        self.say(f"{name} {state}; {self.done}/{self.total} runs done ({self.skipped} skipped, {self.failed} failed), "
                 f"{self.running} running, {time.perf_counter() - self.started:.1f} s")


def _resumable(run_dir: Path) -> bool:
    """A run begun before whose checkpoint it can continue from; a run directory without one is begun again."""
    if rundir.holds_run(run_dir) and (run_dir / CHECKPOINT).is_file():
        return True
    if run_dir.exists():
        shutil.rmtree(run_dir)
    return False


def _run_here(job: Job, config: Config, run_dir: Path, on_round: OnRound | None, result: Sweep,
              tracker: _Progress) -> None:
    from fedweave import api

    callback = None if on_round is None else (lambda record: on_round(job.name, record))
    tracker.running = 1
    try:
        if _resumable(run_dir):
            api.resume(run_dir, on_round=callback)
        else:
            api.run(config, run_dir, on_round=callback)
    except FedweaveError as exc:
        result.failed[job.name] = str(exc)
    else:
        result.ran.append(job.name)
    tracker.running = 0
    tracker.ended(job.name, result.failed.get(job.name))


def _command(job: Job, out: Path) -> list[str]:
    run_dir = out / job.name
    head = [sys.executable, "-m", "fedweave", "run", "-q"]
    if _resumable(run_dir):
        return [*head, "--resume", str(run_dir)]
    return [*head, str(out / BASE_FILE), *job.overrides, "--run-dir", str(run_dir)]


def _run_processes(todo: list[Job], out: Path, jobs: int, on_round: OnRound | None, result: Sweep,
                   tracker: _Progress) -> None:
    threads = max(1, default_jobs() // jobs)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    waiting = list(todo)
    running: dict[str, tuple[subprocess.Popen[bytes], MetricsTail | None, Any]] = {}
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                job = waiting.pop(0)
                command = _command(job, out)
                log_file = (out / f".{job.name}.log").open("wb")
                proc = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)
                # a resumed run rewrites its metrics file first: its records are not followed
                tail = None if "--resume" in command else MetricsTail(out / job.name / rundir.METRICS_FILE, 0)
                running[job.name] = (proc, tail, log_file)
            tracker.running = len(running)
            time.sleep(POLL)
            for name, (proc, tail, log_file) in list(running.items()):
                code = proc.poll()
                if tail is not None and on_round is not None:
                    for record in tail.read():
                        on_round(name, record)
                if code is None:
                    continue
                log_file.close()
                del running[name]
                tracker.running = len(running)
                if code == 0:
                    result.ran.append(name)
                    (out / f".{name}.log").unlink(missing_ok=True)
                    tracker.ended(name)
                else:
                    result.failed[name] = f"exit code {code}; its output is in {out / f'.{name}.log'}"
                    tracker.ended(name, result.failed[name])
    finally:
        for proc, _, log_file in running.values():  # interrupted: the runs stop, resumable from their checkpoints
            proc.terminate()
            proc.wait(30)
            log_file.close()
