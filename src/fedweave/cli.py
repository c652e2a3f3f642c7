"""The ``fedweave`` command."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from fedweave import __version__
from fedweave.errors import ConfigError, FedweaveError, TaskError

EPILOG_RUN = """examples:
  fedweave run                                  the quickstart (FedAvg on digits, 10 clients)
  fedweave run rounds=20 local.lr=0.05          the quickstart with overrides
  fedweave run my.yaml strategy.name=fedavg     a config file with overrides
  fedweave run my.yaml --print-config           show the resolved config and exit
  fedweave run --resume runs/quickstart-20261129-180000
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedweave",
        description="Federated learning across machines that are not alike, from one config file.",
    )
    parser.add_argument("--version", action="version", version=f"fedweave {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run a config (the quickstart when none is given)",
        description="Run a federated training from a YAML config with dotted key=value overrides.",
        epilog=EPILOG_RUN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("config", nargs="?", help="YAML config file (default: the embedded quickstart)")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rounds=20 local.lr=0.1")
    run.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR after its last checkpoint")
    run.add_argument("--run-dir", metavar="DIR", help="write the run here instead of <output_dir>/<name>-<time>")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar, partition or summary")
    run.add_argument("-v", "--verbose", action="store_true", help="log progress details (INFO)")

    schema = sub.add_parser("schema", help="list every config key with its type, default and meaning")
    schema.add_argument("prefix", nargs="?", default="", help="only keys starting with this, e.g. local")

    sub.add_parser("list", help="list built-in strategies, plugins, datasets, models and partitions")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "schema":
            return _schema(args.prefix)
        return _list()
    except (ConfigError, TaskError) as exc:
        print(f"fedweave: error: {exc}", file=sys.stderr)
        return 2
    except FedweaveError as exc:
        print(f"fedweave: error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from fedweave import config as config_mod
    from fedweave import runner
    from fedweave.observe.progress import ProgressBar, run_summary, summary_table

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not Path(path).exists():
        path, overrides = None, [path, *overrides]
    if args.resume:
        if path is not None or overrides:
            raise ConfigError("--resume takes no config or overrides: the run directory holds its config")
        r = runner.resume(args.resume)
    else:
        config = config_mod.load(path, overrides)
        if args.print_config:
            print(config_mod.to_yaml(config), end="")
            return 0
        r = runner.prepare(config, Path(args.run_dir) if args.run_dir else None)
    if r.first_round > r.config.rounds:
        print(f"{r.run_dir} already finished all {r.config.rounds} rounds", file=sys.stderr)
        return 0
    quiet = args.quiet
    if not quiet:
        print(f"fedweave {__version__} · run {r.config.name} → {r.run_dir}", file=sys.stderr)
        print(r.partition_summary, file=sys.stderr)
    bar = None if quiet else ProgressBar(r.config.rounds, sys.stderr, start_round=r.first_round - 1)
    started = time.perf_counter()
    try:
        records = runner.execute(r, bar.update if bar else None)
    except KeyboardInterrupt:
        print(f"\ninterrupted; continue with: fedweave run --resume {r.run_dir}", file=sys.stderr)
        return 130
    if not quiet:
        print(summary_table(run_summary(records, str(r.run_dir), time.perf_counter() - started)))
    return 0


def _schema(prefix: str) -> int:
    from fedweave.config import Config
    from fedweave.schema import describe_fields

    rows = [r for r in describe_fields(Config) if r[0].startswith(prefix) and not r[0].endswith(".params")]
    width = max(len(r[0]) for r in rows) if rows else 0
    for key, kind, default, help_text in rows:
        print(f"{key:<{width}}  {help_text}  [{kind}; default {default!r}]")
    print("strategy.* and plugins.* hold the settings of the chosen strategy and plugins: see `fedweave list`.")
    return 0


def _list() -> int:
    import dataclasses

    from fedweave.plugins import PLUGINS
    from fedweave.strategies import STRATEGIES

    for title, registry in (("strategies", STRATEGIES), ("plugins", PLUGINS)):
        print(f"{title}:")
        for name in registry.names():
            cls = registry.get(name, title)
            settings = ", ".join(f.name for f in dataclasses.fields(cls.Params)) or "no settings"
            doc = (cls.__doc__ or "").strip().splitlines()[0]
            print(f"  {name:<12} {doc}  [{settings}]")
    print("datasets:   digits, mnist5k, synthetic, torchvision:mnist, torchvision:cifar10, package.module:function")
    print("models:     mlp, cnn, package.module:function")
    print("partitions: iid, dirichlet (alpha), shards (shards_per_client), quantity (alpha)")
    return 0
