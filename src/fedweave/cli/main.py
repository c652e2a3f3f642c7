"""``fedweave``: parse the command line and run the command."""

from __future__ import annotations

import argparse
import os
import sys

from fedweave.cli.federation import COMMANDS as FEDERATION_COMMANDS
from fedweave.cli.federation import command as federation_command
from fedweave.cli.keys import decrypt, make_certs, make_keys
from fedweave.cli.listing import list_builtins, schema
from fedweave.cli.nodes import deploy, join, node_command, probe, worker
from fedweave.cli.outcome import report
from fedweave.cli.parser import build_parser
from fedweave.cli.run import run, show_status, write_report
from fedweave.errors import ConfigError, FedweaveError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `fedweave run -q CONFIG rounds=5` and `fedweave run CONFIG -q rounds=5` mean the same:
    # overrides that follow an option arrive here, not in args.overrides.
    if hasattr(args, "overrides"):  # run, server, client, site, worker, deploy k8s
        stray = [e for e in extra if "=" in e and not e.startswith("-")]
        args.overrides = [*args.overrides, *stray]
        extra = [e for e in extra if e not in stray]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    try:
        check_node_flags(args)
        if args.command == "run":
            return run(args)
        if args.command == "sweep":
            from fedweave.cli.sweep import run_sweep

            return run_sweep(args)
        if args.command == "schema":
            return schema(args.prefix)
        if args.command == "report":
            return write_report(args.run_dirs, args.out, args.target, args.figures, args.band)
        if args.command == "status":
            return show_status(args.run_dir)
        if args.command == "probe":
            return probe(args.heartbeat, args.max_age)
        if args.command == "keys":
            return make_keys(args)
        if args.command == "certs":
            return make_certs(args)
        if args.command == "decrypt":
            return decrypt(args.run_dir, args.keys)
        if args.command == "join":
            return join(args)
        if args.command == "worker":
            return worker(args)
        if args.command in ("server", "client", "site"):
            return node_command(args)
        if args.command == "deploy":
            return deploy(args)
        if args.command in FEDERATION_COMMANDS:
            return federation_command(args)
        return list_builtins()
    except BrokenPipeError:  # `fedweave list | head`
        sys.stdout = open(os.devnull, "w")
        return 0
    except (FedweaveError, OSError) as exc:
        code = report(exc)
        if code is None:
            raise
        return code


def check_node_flags(args: argparse.Namespace) -> None:
    """Addresses, ports and tokens given on the command line, checked before anything starts."""
    if all(getattr(args, flag, None) is None for flag in ("listen", "address", "port", "token")):
        return  # (most commands take none: no imports for them)
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
