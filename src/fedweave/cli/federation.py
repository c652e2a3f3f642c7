"""The commands of a long-lived federation: ``federation serve|join``, and an admin's ``submit``,
``jobs``, ``job``, ``cancel``, ``logs`` (docs/federation-service.md).

An admin command finds the federation and the admin's credentials in an admin file
(``--admin-file FILE``, default ``$FEDWEAVE_ADMIN``: ``federation``, ``credentials``, ``name``), or in
``--federation HOST:PORT --credentials DIR --name NAME``, which win over the file's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from fedweave.errors import ConfigError

COMMANDS = ("federation", "submit", "jobs", "job", "cancel", "logs")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_parsers(sub: Any) -> None:
    """The parsers of :data:`COMMANDS`."""
    federation = sub.add_parser(
        "federation", help="run a long-lived federation server, or join one as a site (docs/federation-service.md)"
    )
    kinds = federation.add_subparsers(dest="federation_command", metavar="ACTION", required=True)
    serve = kinds.add_parser(
        "serve", help="serve the federation of FED.yaml: its job store, its queue, gRPC health, mutual TLS",
        description="Stay up across jobs: take the admins' submissions, offer each job to the sites, run it with "
        "the sites that accept, keep the job store on disk (a restart resumes the running job and keeps the queue).",
    )
    serve.add_argument("config", metavar="FED.yaml", help="the federation's file")
    serve.add_argument("--address-file", metavar="PATH", help="write the bound host:port here (for port 0)")
    serve.add_argument("--log-level", default="INFO", choices=LEVELS, help="logging level (default INFO)")
    join = kinds.add_parser(
        "join", help="join the federation as the site of SITE.yaml and run the jobs its policy accepts",
        description="Poll the federation, judge each job it offers by this site's policy, run the accepted ones' "
        "clients on this site's catalogue data, reconnect on its own after a cut or a restart of either side.",
    )
    join.add_argument("config", metavar="SITE.yaml", help="the site's file")
    join.add_argument("--log-level", default="INFO", choices=LEVELS, help="logging level (default INFO)")

    def admin(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, **kwargs)
        parser.add_argument("--admin-file", metavar="FILE",
                            help="the admin file: federation, credentials, name (default $FEDWEAVE_ADMIN)")
        parser.add_argument("--federation", metavar="HOST:PORT", help="the federation's address")
        parser.add_argument("--credentials", metavar="DIR", help="folder of ca.pem and admin-NAME.pem/.key")
        parser.add_argument("--name", metavar="NAME", help="the admin's name (its certificate admin-NAME)")
        return parser

    submit = admin("submit", help="submit a job (a config naming its data catalog:NAME) to a federation")
    submit.add_argument("config", metavar="JOB.yaml", help="the job's config")
    submit.add_argument("--code", metavar="DIR", help="ship DIR's Python files as the job's code bundle")
    admin("jobs", help="list a federation's jobs and sites")
    for name, what in (("job", "show a job: state, rounds done, each site's part, the run folder"),
                       ("cancel", "cancel a job (a running one stops within a round; its sites are freed)"),
                       ("logs", "print the end of a job server's log")):
        parser = admin(name, help=what)
        parser.add_argument("job", metavar="ID", help="the job's id (job-0001)")
        if name != "logs":
            parser.add_argument("--json", action="store_true", help="print the job's record as JSON")


def command(args: argparse.Namespace) -> int:
    """Run one of :data:`COMMANDS`."""
    if args.command == "federation":
        logging.basicConfig(level=args.log_level, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from fedweave.nodes.signals import install_signal_handlers

        install_signal_handlers()
        try:
            if args.federation_command == "serve":
                from fedweave.federation.config import load_federation
                from fedweave.federation.service import run_service

                run_service(load_federation(args.config), address_file=args.address_file)
            else:
                from fedweave.federation.config import load_site
                from fedweave.federation.site import join

                join(load_site(args.config))
        except KeyboardInterrupt:
            return 0
        return 0
    return _admin_command(args)


def admin_config(args: argparse.Namespace) -> Any:
    """The admin's file with the flags given over it."""
    from fedweave.federation.config import ADMIN_ENV, AdminConfig, load_admin
    from fedweave.schema import parse

    path = args.admin_file or os.environ.get(ADMIN_ENV)
    values: dict[str, Any] = {}
    if path:
        loaded = load_admin(path)
        values = {"federation": loaded.federation, "credentials": loaded.credentials, "name": loaded.name}
    for key in ("federation", "credentials", "name"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    missing = [k for k in ("federation", "credentials", "name") if k not in values]
    if missing:
        raise ConfigError(
            f"{args.command}: no {missing[0]} of the federation's admin: give --admin-file FILE (or set "
            f"$FEDWEAVE_ADMIN) or --{missing[0]}"
        )
    config: AdminConfig = parse(AdminConfig, values)
    config.credentials = str(Path(config.credentials).resolve())
    return config


def _admin_command(args: argparse.Namespace) -> int:
    from fedweave.federation.admin import Admin, describe

    with Admin(admin_config(args)) as admin:
        if args.command == "submit":
            from fedweave.config import read_yaml

            job = admin.submit(read_yaml(args.config), code=args.code)
            print(job)
        elif args.command == "jobs":
            listing = admin.jobs()
            for site, entry in sorted(listing["sites"].items()):
                print(f"site {site:<16} {'online' if entry['online'] else 'away'}")
            for record in listing["jobs"]:
                print(f"{record['id']}  {record['state']:<9} rounds {record['rounds_done']}/{record['rounds'] or '?'}"
                      f"  {record['name'] or ''}  by {record['submitted_by']}")
        elif args.command == "logs":
            sys.stdout.write(admin.logs(args.job))
        else:
            record = admin.job(args.job) if args.command == "job" else admin.cancel(args.job)
            print(json.dumps(record, indent=1, sort_keys=True) if args.json else "\n".join(describe(record)))
    return 0
