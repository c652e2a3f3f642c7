"""The Python API: load a config, run it, resume it, from a notebook or a script.

The three functions are exported by the package itself (``fedweave.load_config``,
``fedweave.run``, ``fedweave.resume``) and do what ``fedweave run`` does, without
printing: a run writes the same run directory (config, metrics.jsonl, checkpoints,
final model) and returns the :class:`~fedweave.runner.Run`, whose ``records`` are the
rounds' metric lines, ``params`` the final global model and ``run_dir`` its directory.
Federated runs only; ``mode: data_parallel`` runs through :mod:`fedweave.data_parallel`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from fedweave import config as config_mod
from fedweave import rundir, runner
from fedweave.config import Config


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


def run(config: Config | str | Path | Mapping, run_dir: str | Path | None = None) -> runner.Run:
    """Run ``config`` (a Config, or what :func:`load_config` takes) to its last round in a new run
    directory (``run_dir``, or ``<output_dir>/<name>-<time>``); the finished run."""
    if not isinstance(config, Config):
        config = load_config(config)
    r = runner.prepare(config, None if run_dir is None else Path(run_dir))
    runner.execute(r)
    return r


def resume(run_dir: str | Path) -> runner.Run:
    """Continue the run saved in ``run_dir`` after its last checkpoint, to its last round; the
    finished run, whose ``records`` hold every round, those before the interruption too."""
    r = runner.resume(run_dir)
    if r.first_round <= r.config.rounds:
        runner.execute(r)
    else:
        rundir.release(r.run_dir)
    return r
