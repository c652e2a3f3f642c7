"""The Python API: load a config, run it, resume it, from a notebook or a script.

The three functions are exported by the package itself (``fedweave.load_config``,
``fedweave.run``, ``fedweave.resume``) and do what ``fedweave run`` does, without
printing: a run writes the same run directory (config, metrics.jsonl, checkpoints,
final model) and returns the run: a federated :class:`~fedweave.runner.Run`, whose ``records`` are
the rounds' metric lines, ``params`` the final global model and ``run_dir`` its directory, or, for
``mode: data_parallel``, the :class:`~fedweave.data_parallel.DataParallelRun` of
:mod:`fedweave.data_parallel` (its ``records`` the metrics windows), as ``fedweave run`` dispatches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from fedweave import config as config_mod
from fedweave import data_parallel, rundir, runner
from fedweave.config import Config
from fedweave.data_parallel import DataParallelRun


def load_config(source: str | Path | Mapping | None = None, overrides: Sequence[str] = ()) -> Config:
    """A validated config from a YAML file, a mapping of keys (as in the YAML) or, with None, the
    quickstart; ``overrides`` are dotted ``key=value`` strings as on the command line."""
    if source is None:
        data = config_mod.quickstart_data()
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        data = config_mod.read_yaml(source)
    return config_mod.from_dict(config_mod.apply_overrides(data, list(overrides)))


def run(config: Config | str | Path | Mapping, run_dir: str | Path | None = None) -> runner.Run | DataParallelRun:
    """Run ``config`` (a Config, or what :func:`load_config` takes) to its end in a new run directory
    (``run_dir``, or ``<output_dir>/<name>-<time>``), federated or data-parallel by its ``mode``; the
    finished run."""
    if not isinstance(config, Config):
        config = load_config(config)
    where = None if run_dir is None else Path(run_dir)
    if config.mode == "data_parallel":
        dp = data_parallel.prepare(config, where)
        data_parallel.execute(dp)
        return dp
    r = runner.prepare(config, where)
    runner.execute(r)
    return r


def resume(run_dir: str | Path) -> runner.Run | DataParallelRun:
    """Continue the run saved in ``run_dir`` after its last checkpoint, to its end; the finished run,
    whose ``records`` hold every round (or step window), those before the interruption too."""
    if rundir.saved_config(Path(run_dir)).mode == "data_parallel":
        dp = data_parallel.resume(run_dir)
        data_parallel.execute(dp)  # returns at once when the run had finished
        return dp
    r = runner.resume(run_dir)
    if r.first_round <= r.config.rounds:
        runner.execute(r)
    else:
        rundir.release(r.run_dir)
    return r
