"""The nodes of a deployment, each a process of its own: ``server``, ``client``, ``site``,
``worker`` and ``join`` (data-parallel), ``probe`` (their liveness), and ``deploy`` (the manifests that start them on a cluster)."""

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
    """``fedweave server`` / ``client`` / ``site``."""
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
            from fedweave.nodes.client import run_client, site_data, site_overrides

            local = site_overrides(args.site, device=args.device)  # this client's copy alone
            config = config_mod.load(args.config, [*args.overrides, *local])
            data = site_data(args.site, args.data)
            run_client(config, args.id, address=args.address, token=args.token, data=data)
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


def probe(heartbeat: str, max_age: float) -> int:
    """``fedweave probe --heartbeat FILE --max-age S``: one line, and 0 when the node that touches
    ``FILE`` did so within ``S`` seconds, else 1 (a Kubernetes exec probe; no shell in the image needed)."""
    from fedweave.liveness import check

    why = check(heartbeat, max_age)
    print(f"alive: {heartbeat}" if why is None else f"not alive: {why}")
    return 0 if why is None else 1


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
    """``fedweave worker CONFIG``: one worker of a torchrun job (``python -m fedweave.data_parallel``);
    with ``--rdzv-endpoint``, this host's torchrun agent, whose workers are such workers."""
    log_to_stderr(args.verbose)
    if args.rdzv_endpoint is not None:  # this host's agent (torch is imported by the workers only)
        from fedweave.deploy.torchrun import Agent, agent_command

        worker_args = [args.config, *args.overrides, *(["--run-dir", args.run_dir] if args.run_dir else []),
                       *(["-v"] if args.verbose else [])]
        agent = Agent(args.rdzv_endpoint, args.nnodes, args.nproc_per_node, args.rdzv_id, args.max_restarts,
                      args.rdzv_conf)
        command, env = agent_command(agent, worker_args, os.environ)
        sys.stderr.flush()
        os.execve(command[0], command, env)
    from fedweave import config as config_mod
    from fedweave.data_parallel import torchrun

    config = config_mod.load(args.config, args.overrides)
    try:
        run_dir = torchrun.run(config, args.run_dir)
    except torchrun.WorkerStopped as exc:  # torchrun restarts the workers: a warning, not an error
        print(f"fedweave: warning: {exc}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"fedweave: the job's run directory is {run_dir}", file=sys.stderr)
    return 0


def deploy(args: argparse.Namespace) -> int:
    if args.target == "image":
        from fedweave.deploy.image import write_context

        path = write_context(args.code, args.extras.split(","), args.out, args.base)
        print(f"build context in {path.parent}; build it with: docker build -t REGISTRY/NAME:TAG {path.parent}")
        return 0
    if args.target == "federation":
        from fedweave.deploy.kubernetes.federation import render_args as render_federation

        rendered = render_federation(args)
    else:
        from fedweave.deploy.kubernetes import render_args

        rendered = render_args(args)
    print(f"manifests of {rendered.name} in {rendered.out}; apply one with kubectl apply -k:")
    for path in rendered.kustomizations:
        print(f"  {path.parent}")
    for note in rendered.notes:
        print(f"fedweave deploy {args.target}: {note}", file=sys.stderr)
    return 0
