"""The ``fedweave`` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

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
    run.add_argument("--report", action="store_true", help="write RUN_DIR/report.html at the end (fedweave report)")

    schema = sub.add_parser("schema", help="list every config key with its type, default and meaning")
    schema.add_argument("prefix", nargs="?", default="", help="only keys starting with this, e.g. local")

    sub.add_parser("list", help="list built-in strategies, plugins, datasets, models and partitions")

    report = sub.add_parser(
        "report",
        help="write an HTML report of a run, or a comparison of several (figures, summary, config)",
        description="One self-contained HTML file (figures inlined, opens from disk) and a PNG per figure "
        "beside it. Works on a run still going on or interrupted.",
    )
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (several: a comparison)")
    report.add_argument("--out", metavar="FILE.html", help="default RUN_DIR/report.html, or ./report.html for several")
    report.add_argument("--target", type=float, metavar="ACC", help="accuracy for 'time to target' (default: "
                        "the best accuracy the weakest run reached)")

    status = sub.add_parser("status", help="print where a run stands (round, accuracy, ETA) from its files")
    status.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (of a run here or elsewhere)")

    keys = sub.add_parser(
        "keys",
        help="make the federation's CKKS keys for the 'he' plugin",
        description="Write DIR/secret.ctx (with the secret key: give it to the clients only) and "
        "DIR/public.ctx (for the server); name DIR in the 'he' plugin's keys setting.",
    )
    keys.add_argument("--out", required=True, metavar="DIR", help="folder to write secret.ctx and public.ctx into")
    keys.add_argument("--poly-degree", type=int, default=8192, choices=(8192, 16384), help="CKKS ring degree")
    keys.add_argument("--scale-bits", type=int, default=40, help="CKKS scale 2^bits (20..50)")

    decrypt = sub.add_parser(
        "decrypt",
        help="decrypt the model a run with the 'he' plugin kept encrypted (RUN_DIR/model.he.pt -> model.pt)",
        description="Where secret.ctx is (a client's machine), write RUN_DIR/model.pt, the plaintext global "
        "model, from the encrypted one the server wrote (RUN_DIR/model.he.pt).",
    )
    decrypt.add_argument("run_dir", metavar="RUN_DIR", help="the server's run directory (or a copy of model.he.pt's)")
    decrypt.add_argument("--keys", required=True, metavar="DIR", help="the folder of `fedweave keys` holding secret.ctx")

    join = sub.add_parser(
        "join",
        help="add a worker to a data-parallel run going on on this host",
        description="Start a worker in this process that joins the data-parallel run in RUN_DIR at its "
        "next step boundary and trains with it to the end (docs/heterogeneity.md, World changes).",
    )
    join.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of the running job")
    join.add_argument("--wait", type=float, default=0.0, metavar="SECONDS", help="wait this long for the run to start")
    join.add_argument("-v", "--verbose", action="store_true", help="log progress details (INFO)")
    worker = sub.add_parser(
        "worker",
        help="be one worker of a data-parallel job started by torchrun (on one host or many)",
        description="One worker of a data-parallel job under torchrun: `torchrun --nnodes=MIN:MAX "
        "--nproc-per-node=K --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --max-restarts=R -m "
        "fedweave.data_parallel CONFIG` runs this command in every process it starts.",
    )
    worker.add_argument("config", help="YAML config file (mode: data_parallel)")
    worker.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data_parallel.epochs=3")
    worker.add_argument("--run-dir", metavar="DIR", help="the job's run directory (default: "
                        "<output_dir>/<name>-<rendezvous id>), on storage every host sees")
    worker.add_argument("-v", "--verbose", action="store_true", help="log progress details (INFO)")
    _node_parsers(sub)
    deploy = sub.add_parser("deploy", help="write the manifests that deploy a config on a cluster")
    targets = deploy.add_subparsers(dest="target", metavar="TARGET", required=True)
    from fedweave.deploy.kubernetes import add_arguments

    add_arguments(targets.add_parser("k8s", help="a kustomize base and overlays for Kubernetes (docs/deployment.md)"))
    return parser


def _node_parsers(sub: Any) -> None:
    """``server``, ``client`` and ``certs``: the commands of a gRPC deployment."""
    levels = ("DEBUG", "INFO", "WARNING", "ERROR")
    server = sub.add_parser(
        "server",
        help="run the server node of a config (transport grpc); clients connect to it",
        description="Listen on grpc.address (or --listen), wait for the clients, run every round, "
        "then tell the clients to stop. Writes the run directory as `fedweave run` does; started again "
        "with the same --run-dir, it resumes the run after its checkpoint (or exits 0 if it finished).",
    )
    server.add_argument("config", nargs="?", help="YAML config file")
    server.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpc.tls=mtls")
    server.add_argument(
        "--run-dir", metavar="DIR",
        help="the run's directory instead of <output_dir>/<name>-<time>; a run already there is continued",
    )
    server.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR after its last checkpoint")
    server.add_argument("--listen", metavar="HOST:PORT", help="bind here instead of grpc.listen / grpc.address")
    server.add_argument("--address-file", metavar="PATH", help="write the bound host:port here (for port 0)")
    server.add_argument("--log-level", default="INFO", choices=levels, help="logging level (default INFO)")
    server.add_argument("-q", "--quiet", action="store_true", help="no progress line (round, accuracy, ETA)")

    client = sub.add_parser(
        "client",
        help="run one client node of a config (transport grpc)",
        description="Build client N's data and model from the config, connect to the server, "
        "serve its rounds until the server ends the run.",
    )
    client.add_argument("config", help="YAML config file (the same as the server's)")
    client.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpc.credentials=/etc/fedweave")
    client.add_argument("--id", type=int, required=True, metavar="N", help="this client's id, 0..clients-1")
    client.add_argument("--address", metavar="HOST:PORT", help="the server's address instead of grpc.address")
    client.add_argument("--token", help="this client's token (default: $FEDWEAVE_TOKEN or credentials/client-N.token)")
    client.add_argument("--log-level", default="INFO", choices=levels, help="logging level (default INFO)")

    site = sub.add_parser(
        "site",
        help="run a site leader (rank 0: one gRPC node of the server, torchdist leader) or a site member",
        description="topology hierarchical with inner torchdist and transport grpc: the leader takes one job "
        "per round for its whole site from the server (gRPC), runs it in the site's torch.distributed world "
        "and answers the members' pre-aggregated update (where exact) or their updates; a member "
        "(rank >= 1) trains its client. See docs/deployment.md (Topologies).",
    )
    site.add_argument("config", help="YAML config file (the same as the server's)")
    site.add_argument("overrides", nargs="*", help="dotted overrides, e.g. torchdist.backend=gloo")
    site.add_argument("--site", type=int, required=True, metavar="S", help="top-level site index, 0..sites-1")
    site.add_argument("--rank", type=int, required=True, metavar="R", help="0: the leader; 1..k: the site's members")
    site.add_argument("--address", metavar="HOST:PORT", help="the server's address instead of grpc.address")
    site.add_argument("--port", type=int, metavar="P", help="the site world's port (default torchdist.port + S)")
    site.add_argument("--token", help="the leader's token (default: $FEDWEAVE_TOKEN or credentials/site-S.token)")
    site.add_argument("--log-level", default="INFO", choices=levels, help="logging level (default INFO)")

    certs = sub.add_parser(
        "certs",
        help="create a CA, server, client and site-leader certificates and tokens for grpc.tls / grpc.tokens",
        description="Write DIR/ca.pem, server.pem/.key (for --host names), client-<i>.pem/.key/.token, "
        "site-<s>.pem/.key/.token and tokens.json; point grpc.credentials at DIR. Keep ca.key off the nodes.",
    )
    certs.add_argument("--out", required=True, metavar="DIR", help="folder to write the credentials into")
    certs.add_argument("--clients", type=int, required=True, metavar="N", help="number of clients")
    certs.add_argument(
        "--sites", type=int, default=0, metavar="S", help="number of site leaders (hierarchical gRPC; default 0)"
    )
    certs.add_argument(
        "--host", action="append", metavar="NAME", help="server host name or IP (repeatable; default localhost, 127.0.0.1, ::1)"
    )
    certs.add_argument("--days", type=int, default=365, help="validity in days (default 365)")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # `fedweave run -q CONFIG rounds=5` and `fedweave run CONFIG -q rounds=5` mean the same:
    # overrides that follow an option arrive here, not in args.overrides.
    if getattr(args, "command", None) in ("run", "server", "client", "site", "deploy", "worker"):
        stray = [e for e in extra if "=" in e and not e.startswith("-")]
        args.overrides = [*args.overrides, *stray]
        extra = [e for e in extra if e not in stray]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    try:
        _check_node_flags(args)
        if args.command == "run":
            return _run(args)
        if args.command == "schema":
            return _schema(args.prefix)
        if args.command == "report":
            return _write_report(args.run_dirs, args.out, args.target)
        if args.command == "status":
            return _status(args.run_dir)
        if args.command == "keys":
            return _keys(args)
        if args.command == "decrypt":
            return _decrypt(args.run_dir, args.keys)
        if args.command == "join":
            return _join(args)
        if args.command == "worker":
            return _worker(args)
        if args.command in ("server", "client", "site", "certs"):
            return _node(args)
        if args.command == "deploy":
            return _deploy(args)
        return _list()
    except BrokenPipeError:  # `fedweave list | head`
        sys.stdout = open(os.devnull, "w")
        return 0
    except (FedweaveError, OSError) as exc:
        code = _report(exc)
        if code is None:
            raise
        return code


def _report(exc: BaseException) -> int | None:
    """Print the one line of a user's mistake and return the exit status: 2 for a config or task
    error, 1 for another fedweave error or a file that cannot be made or read (an unwritable
    output_dir, --run-dir or --out); None for anything else (a bug: its traceback is wanted)."""
    if isinstance(exc, (ConfigError, TaskError)):
        print(f"fedweave: error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, FedweaveError):
        print(f"fedweave: error: {exc}", file=sys.stderr)
        return 1
    if isinstance(exc, OSError) and exc.filename is not None:
        print(f"fedweave: error: cannot use {str(exc.filename)!r}: {exc.strerror}", file=sys.stderr)
        return 1
    return None


def _check_node_flags(args: argparse.Namespace) -> None:
    """Addresses, ports and tokens given on the command line, checked before anything starts."""
    from fedweave.transports.grpc.certs import check_token
    from fedweave.config import parse_address

    for flag in ("listen", "address"):
        value = getattr(args, flag, None)
        if value is not None:
            parse_address(value, f"--{flag}")
    port = getattr(args, "port", None)
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"--port: {port} is out of range 0..65535")
    if getattr(args, "token", None) is not None:
        check_token(args.token, "--token")


def _run(args: argparse.Namespace) -> int:
    from fedweave import config as config_mod
    from fedweave import rundir, runner
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
        _write_report([r.run_dir], None, None)
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
        _write_report([r.run_dir], None, None)
    return 0


def _write_report(run_dirs: list[str] | list[Path], out: str | None, target: float | None) -> int:
    from fedweave.observe.report import write_report

    try:
        written = write_report(run_dirs, out, target)
    except FileNotFoundError as exc:  # not a run directory
        raise ConfigError(str(exc)) from None
    print(f"report written to {written}", file=sys.stderr)
    return 0


def _status(run_dir: str) -> int:
    from fedweave.observe.progress import summary_table
    from fedweave.observe.rundata import load_run
    from fedweave.observe.status import status_rows

    try:
        run = load_run(run_dir)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    print(summary_table(status_rows(run)))
    return 0


def _join(args: argparse.Namespace) -> int:
    """``fedweave join RUN_DIR``: one more worker for a running data-parallel job."""
    from fedweave import data_parallel

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    joined = data_parallel.join(args.run_dir, wait=args.wait)
    if joined.trained:
        print(f"worker {joined.worker} trained with the run in {args.run_dir} to its end", file=sys.stderr)
    else:
        print(f"worker {joined.worker}: the run in {args.run_dir} finished before it was admitted", file=sys.stderr)
    return 0


def _worker(args: argparse.Namespace) -> int:
    """``fedweave worker CONFIG``: one worker of a torchrun job (``python -m fedweave.data_parallel``)."""
    from fedweave import config as config_mod
    from fedweave.data_parallel import torchrun

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    config = config_mod.load(args.config, args.overrides)
    run_dir = torchrun.run(config, args.run_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"fedweave: the job's run directory is {run_dir}", file=sys.stderr)
    return 0


def _deploy(args: argparse.Namespace) -> int:
    from fedweave.deploy.kubernetes import render_args

    rendered = render_args(args)
    print(f"manifests of {rendered.name} in {rendered.out}; apply one with kubectl apply -k:")
    for path in rendered.kustomizations:
        print(f"  {path.parent}")
    return 0


def _keys(args: argparse.Namespace) -> int:
    from fedweave.plugins.secure.he import write_keys

    if not 20 <= args.scale_bits <= 50:
        raise ConfigError(f"--scale-bits must lie in 20..50, got {args.scale_bits}")
    secret, public = write_keys(args.out, args.poly_degree, args.scale_bits)
    print(f"secret context (clients only): {secret}\npublic context (server): {public}")
    return 0


def _decrypt(run_dir: str, keys: str) -> int:
    """``fedweave decrypt --keys DIR RUN_DIR``: RUN_DIR/model.pt from the encrypted model, with secret.ctx."""
    import torch

    from fedweave import rundir
    from fedweave.plugins.secure.he import HE, HEParams
    from fedweave.validation import Rejected

    path = Path(run_dir) / rundir.SEALED_MODEL_FILE
    if not path.is_file():
        raise ConfigError(f"{str(path)!r} does not exist: a run with plugin 'he' writes its encrypted model there at its end")
    try:
        sealed = torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - torch.load raises many types for a file that is not its format
        raise ConfigError(f"{str(path)!r} is not an encrypted model fedweave wrote") from None
    if not isinstance(sealed, dict) or not all(isinstance(t, torch.Tensor) for t in sealed.values()):
        raise ConfigError(f"{str(path)!r} is not an encrypted model fedweave wrote")
    try:
        plain = HE(HEParams(keys=keys)).unseal(sealed)
    except (ValueError, Rejected) as exc:
        raise ConfigError(f"{str(path)!r} cannot be decrypted with {keys}/secret.ctx: {exc}") from None
    rundir.save_model(plain, Path(run_dir))
    print(f"plaintext model: {Path(run_dir) / rundir.MODEL_FILE}")
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
            print(f"  {name:<12} {_first_paragraph(cls.__doc__)}  [{settings}]")
    print("datasets:   digits, mnist5k, synthetic, torchvision:mnist, torchvision:cifar10, package.module:function")
    print("models:     mlp, cnn, package.module:function")
    print("losses:     cross_entropy, nll, bce, package.module:function")
    print("partitions: iid, dirichlet (alpha), shards (shards_per_client), quantity (alpha)")
    return 0


def _first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph on one line (without the ``::`` that opens a literal block)."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    return " ".join(paragraph.split()).rstrip(":")


def _node(args: argparse.Namespace) -> int:
    """``fedweave server`` / ``client`` / ``certs``."""
    if args.command == "certs":
        from fedweave.transports.grpc.certs import DEFAULT_HOSTS, make_credentials

        out = make_credentials(args.out, args.clients, args.host or DEFAULT_HOSTS, args.days, args.sites)
        sites = f" and {args.sites} site leaders" if args.sites else ""
        print(f"credentials for a server, {args.clients} clients{sites} in {out}; set grpc.credentials: {out}")
        return 0
    from fedweave import node

    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    if not os.environ.get(node.PARENT_ENV):
        return _serve_node(args)
    # A node started by the process launcher: its work is saved when it returns, so it
    # skips the interpreter's teardown (seconds with torch loaded).
    code = 1
    try:
        code = _serve_node(args)
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
        code = _exit_code(exc)
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve_node(args: argparse.Namespace) -> int:
    from fedweave import config as config_mod
    from fedweave import node, rundir

    try:
        node.install_signal_handlers()
        if args.command == "client":
            node.run_client(config_mod.load(args.config, args.overrides), args.id, address=args.address, token=args.token)
            return 0
        if args.command == "site":
            from fedweave.topologies import deploy

            config = config_mod.load(args.config, args.overrides)
            if args.rank == 0:
                deploy.run_site_leader(config, args.site, args.address, args.port, args.token)
            else:
                deploy.run_site_member(config, args.site, args.rank, args.port)
            return 0
        if args.resume:
            if args.config is not None or args.overrides:
                raise ConfigError("--resume takes no config or overrides: the run directory holds its config")
            config = config_mod.load(Path(args.resume) / rundir.CONFIG_FILE)
            node.serve(config, args.resume, resume=True, listen=args.listen, address_file=args.address_file,
                       on_record=_server_bar(args, config))
            return 0
        if args.config is None:
            raise ConfigError("fedweave server needs a config file (or --resume RUN_DIR)")
        config = config_mod.load(args.config, args.overrides)
        run_dir = Path(args.run_dir) if args.run_dir else rundir.new_run_dir(config)
        if not args.run_dir:
            logging.getLogger("fedweave.node").info(
                "the run goes to %s; a server started again resumes it only with --run-dir %s", run_dir, run_dir
            )
        node.serve(config, run_dir, listen=args.listen, address_file=args.address_file, on_record=_server_bar(args, config))
        return 0
    except KeyboardInterrupt:
        logging.getLogger("fedweave.node").warning("%s stopped by a signal", args.command)
        return 130


def _server_bar(args: argparse.Namespace, config: Any) -> Any:
    """The server's progress line (as `fedweave run`'s) on stderr; none with -q or under the process
    launcher (which shows its own)."""
    from fedweave import node
    from fedweave.observe.progress import ProgressBar

    if args.quiet or os.environ.get(node.PARENT_ENV):
        return None
    return ProgressBar(config.rounds, sys.stderr).update


def _exit_code(exc: BaseException) -> int:
    """The exit status of a launched node that raised ``exc`` (reported as ``main`` would)."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    code = _report(exc)
    if code is not None:
        return code
    import traceback

    traceback.print_exception(exc)
    return 1
