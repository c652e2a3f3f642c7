"""``fedweave run`` (federated and data-parallel), ``report`` and ``status``: a run on this machine and its files."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

from fedweave import __version__
from fedweave.errors import ConfigError


def log_to_stderr(verbose: bool = False, level: str | None = None) -> None:
    """The library's log lines on stderr: from ``level`` when given (a node's --log-level), else
    INFO with -v, WARNING otherwise."""
    level = level or ("INFO" if verbose else "WARNING")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def run(args: argparse.Namespace) -> int:
    from fedweave import config as config_mod
    from fedweave import rundir, runner
    from fedweave.observe.progress import ProgressBar, run_summary, summary_table

    log_to_stderr(args.verbose)
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not Path(path).exists():
        path, overrides = None, [path, *overrides]
    if args.resume:
        if path is not None or overrides:
            raise ConfigError("--resume takes no config or overrides: the run directory holds its config")
        saved = Path(args.resume) / rundir.CONFIG_FILE
        if saved.is_file() and config_mod.load(saved).mode == "data_parallel":
            return _run_data_parallel(args, None)
        r = runner.resume(args.resume)
    else:
        config = config_mod.load(path, overrides)
        if args.print_config:
            print(config_mod.to_yaml(config), end="")
            return 0
        if config.mode == "data_parallel":
            return _run_data_parallel(args, config)
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
    if args.report:
        write_report([r.run_dir], None, None)
    return 0


def _run_data_parallel(args: argparse.Namespace, config: Any) -> int:
    """``mode: data_parallel``: start the workers, print a line per metrics window, then a summary."""
    from fedweave import data_parallel
    from fedweave.observe.loggers import open_loggers
    from fedweave.observe.progress import eta_text, share_done, summary_table

    if config is None:
        r = data_parallel.resume(args.resume)
        if r.finished:
            print(f"{r.run_dir} already finished", file=sys.stderr)
            return 0
    else:
        r = data_parallel.prepare(config, Path(args.run_dir) if args.run_dir else None)
    dp = r.config.data_parallel
    quiet = args.quiet
    if not quiet:
        print(
            f"fedweave {__version__} · data-parallel run {r.config.name} → {r.run_dir} "
            f"({dp.workers} workers, global batch {dp.global_batch})",
            file=sys.stderr,
        )
    started = time.perf_counter()
    before = share_done(r.records[-1], dp.steps, dp.epochs) if r.records else 0.0  # a resumed run's start

    def show(record: dict[str, Any]) -> None:
        acc = record.get("test_accuracy")
        elapsed, done = time.perf_counter() - started, share_done(record, dp.steps, dp.epochs)
        print(
            f"step {record['step']} epoch {record['epoch']:.2f} loss {record['train_loss']:.4f}"
            + (f" acc {acc:.4f}" if acc is not None else "")
            + f" batches {[round(b) for b in record['batch']]} {elapsed:.1f}s"
            + eta_text(elapsed, (done - before) / max(1 - before, 1e-9)),
            file=sys.stderr,
        )

    loggers = open_loggers(r.config, r.run_dir)  # observe: TensorBoard, MLflow (none by default)

    def on_record(record: dict[str, Any]) -> None:
        loggers.record(record)
        if not quiet:
            show(record)

    finished = False
    try:
        records = data_parallel.execute(r, on_record)
        finished = True
    except KeyboardInterrupt:
        print(f"\ninterrupted; continue with: fedweave run --resume {r.run_dir}", file=sys.stderr)
        return 130
    finally:
        loggers.close(r.run_dir, finished)
    if not quiet and records:
        last = records[-1]
        accs = [x["test_accuracy"] for x in records if x.get("test_accuracy") is not None]
        rows = [
            ("steps", str(last["step"])),
            ("epochs", f"{last['epoch']:.2f}"),
            ("final test accuracy", "-" if last.get("test_accuracy") is None else f"{last['test_accuracy']:.4f}"),
            ("best test accuracy", f"{max(accs):.4f}" if accs else "-"),
            ("workers at the end", str(len(last["workers"]))),
            ("batch-size changes", str(last["adjustments"])),
            ("wall time", f"{time.perf_counter() - started:.1f} s"),
            ("run directory", str(r.run_dir)),
        ]
        print(summary_table(rows))
    if args.report:
        write_report([r.run_dir], None, None)
    return 0


def write_report(run_dirs: list[str] | list[Path], out: str | None, target: float | None) -> int:
    from fedweave.observe.report import write_report

    try:
        written = write_report(run_dirs, out, target)
    except FileNotFoundError as exc:  # not a run directory
        raise ConfigError(str(exc)) from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise _not_written_by_fedweave(run_dirs, exc) from None
    print(f"report written to {written}", file=sys.stderr)
    return 0


def show_status(run_dir: str) -> int:
    from fedweave.observe.progress import summary_table
    from fedweave.observe.rundata import load_run
    from fedweave.observe.status import status_rows

    try:
        run = load_run(run_dir)
        rows = status_rows(run)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise _not_written_by_fedweave([run_dir], exc) from None
    print(summary_table(rows))
    return 0


def _not_written_by_fedweave(run_dirs: list[str] | list[Path], exc: Exception) -> ConfigError:
    """The one line for run files holding values of a type or range fedweave never writes (an edit,
    a corruption): a metrics value that is not a number where one is, a config value likewise."""
    from fedweave.errors import first_line

    where = ", ".join(repr(str(d)) for d in run_dirs)
    return ConfigError(f"{where}: its config or metrics hold a value fedweave does not write ({first_line(exc)})")
