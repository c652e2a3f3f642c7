"""``fedweave sweep CONFIG --seeds 1,2,3 --grid key=v1,v2 [key=...] [--jobs N]``: a config run at
every grid point for every seed under one sweep folder (:mod:`fedweave.sweeps`), then the summary
per grid point on stdout."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fedweave.errors import ConfigError

EPILOG = """examples:
  fedweave sweep my.yaml --seeds 1,2,3 --grid strategy.name=fedavg,fedprox
  fedweave sweep my.yaml --seeds 1,2 --grid strategy.name=fedavg,fedprox local.lr=0.05,0.1 --jobs 2
  fedweave sweep my.yaml --seeds 1,2,3 --grid strategy.name=fedavg,fedprox --target test_accuracy=0.9
  fedweave report runs/my-sweep                 the figures of the sweep: a mean line and band per grid point
"""


def add_parser(sub: Any) -> None:
    sweep = sub.add_parser(
        "sweep",
        help="run a config at every point of a grid of overrides for several seeds; a summary per grid point",
        description="The cross product of --grid and --seeds as runs under one sweep folder, --jobs at a time. "
        "A rerun skips the finished runs and continues the others. The summary gives per grid point the "
        "mean ± std (sample) over its seeds of the final and best metrics.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep.add_argument("config", nargs="?", help="YAML config file (default: the embedded quickstart)")
    sweep.add_argument("overrides", nargs="*", help="dotted overrides of every run, e.g. rounds=20")
    sweep.add_argument("--seeds", default="0", help="seeds, comma-separated (default 0)")
    sweep.add_argument("--grid", nargs="+", default=[], metavar="KEY=V1,V2",
                       help="a dotted key and its values; several keys: their cross product")
    sweep.add_argument("--jobs", type=int, metavar="N", help="runs at a time (default: one per core)")
    sweep.add_argument("--out", metavar="DIR", help="the sweep folder (default <output_dir>/<name>-sweep)")
    sweep.add_argument("--target", metavar="METRIC=VALUE",
                       help="give the time until METRIC first reached VALUE (at most VALUE for a loss)")
    sweep.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    sweep.add_argument("-v", "--verbose", action="store_true", help="log progress details (INFO)")


def parse_target(text: str | None) -> tuple[str, float] | None:
    if text is None:
        return None
    metric, sep, value = text.partition("=")
    try:
        number = float(value)
    except ValueError:
        number = None
    if not sep or not metric or number is None:
        raise ConfigError(f"--target {text!r}: write METRIC=VALUE, e.g. test_accuracy=0.9")
    return metric, number


def run_sweep(args: argparse.Namespace) -> int:
    from fedweave.cli.run import log_to_stderr
    from fedweave.observe.compare import format_table, group_table
    from fedweave.sweeps import parse_seeds, sweep

    log_to_stderr(args.verbose)
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path:
        path, overrides = None, [path, *overrides]
    done = sweep(path, parse_seeds(args.seeds), args.grid, folder=args.out, jobs=args.jobs,
                 target=parse_target(args.target), progress=not args.quiet, overrides=overrides)
    print(f"sweep {done.folder}: {len(done.jobs)} runs, {len(done.ran)} run now, {len(done.skipped)} already "
          f"finished, {len(done.failed)} failed")
    print(format_table(group_table(done.summary)))
    for name, why in done.failed.items():
        print(f"failed: {name}: {why}", file=sys.stderr)
    return 1 if done.failed else 0
