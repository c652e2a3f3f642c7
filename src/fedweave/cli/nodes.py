"""The nodes of a deployment, each a process of its own: ``server``, ``client``, ``site``, ``certs``,
``worker`` and ``join`` (data-parallel), and ``deploy`` (the manifests that start them on a cluster)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from fedweave.cli.outcome import exit_code
from fedweave.cli.run import log_to_stderr
from fedweave.errors import ConfigError


def node_command(args: argparse.Namespace) -> int:
    """``fedweave server`` / ``client`` / ``certs``."""
    if args.command == "certs":
        from fedweave.transports.grpc.certs import DEFAULT_HOSTS, make_credentials

        out = make_credentials(args.out, args.clients, args.host or DEFAULT_HOSTS, args.days, args.sites)
        sites = f" and {args.sites} site leaders" if args.sites else ""
        print(f"credentials for a server, {args.clients} clients{sites} in {out}; set grpc.credentials: {out}")
        return 0
    from fedweave.nodes.signals import PARENT_ENV

    log_to_stderr(level=args.log_level)
    if not os.environ.get(PARENT_ENV):
        return _serve_node(args)
    # A node started by the process launcher: its work is saved when it returns, so it
    # skips the interpreter's teardown (seconds with torch loaded).
    code = 1
    try:
        code = _serve_node(args)
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
        code = exit_code(exc)
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve_node(args: argparse.Namespace) -> int:
    from fedweave import config as config_mod
    from fedweave import rundir
    from fedweave.nodes.signals import install_signal_handlers

    try:
        install_signal_handlers()
        if args.command == "client":
            from fedweave.nodes.client import run_client

            config = config_mod.load(args.config, args.overrides)
            run_client(config, args.id, address=args.address, token=args.token, data=args.data)
            return 0
        if args.command == "site":
            from fedweave.nodes import site

            config = config_mod.load(args.config, args.overrides)
            if args.rank == 0:
                site.run_site_leader(config, args.site, args.address, args.port, args.token)
            else:
                site.run_site_member(config, args.site, args.rank, args.port)
            return 0
        from fedweave.nodes.server import serve

        if args.resume:
            if args.config is not None or args.overrides:
                raise ConfigError("--resume takes no config or overrides: the run directory holds its config")
            config = config_mod.load(Path(args.resume) / rundir.CONFIG_FILE)
            serve(config, args.resume, resume=True, listen=args.listen, address_file=args.address_file,
                  on_record=_server_bar(args, config))
            return 0
        if args.config is None:
            raise ConfigError("fedweave server needs a config file (or --resume RUN_DIR)")
        config = config_mod.load(args.config, args.overrides)
        run_dir = Path(args.run_dir) if args.run_dir else rundir.new_run_dir(config)
        if not args.run_dir:
            logging.getLogger("fedweave.nodes.server").info(
                "the run goes to %s; a server started again resumes it only with --run-dir %s", run_dir, run_dir
            )
        serve(config, run_dir, listen=args.listen, address_file=args.address_file, on_record=_server_bar(args, config))
        return 0
    except KeyboardInterrupt:
        logging.getLogger("fedweave.nodes").warning("%s stopped by a signal", args.command)
        return 130


def _server_bar(args: argparse.Namespace, config: Any) -> Any:
    """The server's progress line (as `fedweave run`'s) on stderr; none with -q or under the process
    launcher (which shows its own)."""
    from fedweave.nodes.signals import PARENT_ENV
    from fedweave.observe.progress import ProgressBar

    if args.quiet or os.environ.get(PARENT_ENV):
        return None
    return ProgressBar(config.rounds, sys.stderr).update


def join(args: argparse.Namespace) -> int:
    """``fedweave join RUN_DIR``: one more worker for a running data-parallel job."""
    from fedweave import data_parallel

    log_to_stderr(args.verbose)
    joined = data_parallel.join(args.run_dir, wait=args.wait)
    if joined.trained:
        print(f"worker {joined.worker} trained with the run in {args.run_dir} to its end", file=sys.stderr)
    else:
        print(f"worker {joined.worker}: the run in {args.run_dir} finished before it was admitted", file=sys.stderr)
    return 0


def worker(args: argparse.Namespace) -> int:
    """``fedweave worker CONFIG``: one worker of a torchrun job (``python -m fedweave.data_parallel``)."""
    from fedweave import config as config_mod
    from fedweave.data_parallel import torchrun

    log_to_stderr(args.verbose)
    config = config_mod.load(args.config, args.overrides)
    run_dir = torchrun.run(config, args.run_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"fedweave: the job's run directory is {run_dir}", file=sys.stderr)
    return 0


def deploy(args: argparse.Namespace) -> int:
    from fedweave.deploy.kubernetes import render_args

    rendered = render_args(args)
    print(f"manifests of {rendered.name} in {rendered.out}; apply one with kubectl apply -k:")
    for path in rendered.kustomizations:
        print(f"  {path.parent}")
    return 0
