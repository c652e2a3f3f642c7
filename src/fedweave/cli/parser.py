"""The ``fedweave`` command's commands and their arguments."""

from __future__ import annotations

import argparse
from typing import Any

from fedweave import __version__

EPILOG_RUN = """examples:
  fedweave run                                  the quickstart (FedAvg on digits, 10 clients)
  fedweave run rounds=20 local.lr=0.05          the quickstart with overrides
  fedweave run my.yaml strategy.name=fedavg     a config file with overrides
  fedweave run my.yaml --print-config           show the resolved config and exit
  fedweave run --resume runs/quickstart-20261129-180000
"""


def build_parser() -> argparse.ArgumentParser:
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
        help="write an HTML report of a run, or a comparison of several or of a sweep (figures, summary, config)",
        description="One self-contained HTML file (figures inlined, opens from disk). Runs of one config but "
        "their seeds are drawn as a mean line with a band. Works on a run still going on or interrupted.",
    )
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run directories or sweep folders (several: a comparison)")
    report.add_argument("--out", metavar="FILE.html", help="default RUN_DIR/report.html, or ./report.html for several")
    report.add_argument("--figures", metavar="DIR", help="also write each figure as DIR/<figure>.png")
    report.add_argument("--band", choices=("range", "std"), default="range",
                        help="around the mean of a config's seeds: their range (default) or ± std")
    report.add_argument("--target", type=float, metavar="ACC", help="accuracy for 'time to target' (default: "
                        "the best accuracy the weakest run reached)")

    status = sub.add_parser("status", help="print where a run stands (round, accuracy, ETA) from its files")
    status.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (of a run here or elsewhere)")

    probe = sub.add_parser(
        "probe",
        help="exit 0 if a node's liveness file is fresh, 1 if it is missing or stale (an exec probe)",
        description="The liveness check of a node that listens on no port: a client, site or worker started "
        "with FEDWEAVE_HEARTBEAT=FILE touches FILE while its loop runs (docs/deployment.md, Kubernetes).",
    )
    probe.add_argument("--heartbeat", required=True, metavar="FILE", help="the node's liveness file")
    probe.add_argument("--max-age", required=True, type=float, metavar="S",
                       help="seconds since the file's last touch past which the node counts as dead")

    keys = sub.add_parser(
        "keys",
        help="make the federation's CKKS keys for the 'he' plugin",
        description="Write DIR/secret.ctx (with the secret key: give it to the clients only) and "
        "DIR/public.ctx (for the server); name DIR in the 'he' plugin's keys setting.",
    )
    keys.add_argument("--out", required=True, metavar="DIR", help="folder to write secret.ctx and public.ctx into")
    keys.add_argument("--poly-degree", type=int, default=8192, choices=(8192, 16384), help="CKKS ring degree")
    keys.add_argument("--scale-bits", type=int, default=40, help="CKKS scale 2^bits (20..50)")
    _replacing_flags(keys, "keys")

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
        help="be one host's torchrun agent of a data-parallel job (--rdzv-endpoint), or one worker under torchrun",
        description="With --rdzv-endpoint HOST:PORT: this host's torchrun agent, on the address of the interface "
        "that reaches HOST (whatever the hostname resolves to), the store hosted on HOST; run it on every host "
        "(docs/heterogeneity.md, Many hosts). Without: one worker of a data-parallel job under torchrun, which "
        "`torchrun ... -m fedweave.data_parallel CONFIG` runs in every process it starts.",
    )
    worker.add_argument("config", help="YAML config file (mode: data_parallel)")
    worker.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data_parallel.epochs=3")
    worker.add_argument("--run-dir", metavar="DIR", help="the job's run directory (default: "
                        "<output_dir>/<name>-<rendezvous id>), on storage every host sees")
    worker.add_argument("-v", "--verbose", action="store_true", help="log progress details (INFO)")
    agent = worker.add_argument_group("the torchrun agent of this host (with --rdzv-endpoint)")
    agent.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="the rendezvous: HOST hosts its store")
    agent.add_argument("--nnodes", default="1", metavar="N|MIN:MAX", help="hosts in the job (default 1)")
    agent.add_argument("--nproc-per-node", default="1", metavar="K", help="workers on this host (default 1)")
    agent.add_argument("--rdzv-id", default="fedweave", metavar="ID", help="the job's id, alike on every host")
    agent.add_argument("--max-restarts", type=int, default=0, metavar="R",
                       help="times torchrun starts the workers again after a failure or a world change")
    agent.add_argument("--rdzv-conf", default="", metavar="K=V,...", help="torchrun's --rdzv-conf (timeouts)")
    from fedweave.cli.sweep import add_parser as add_sweep

    add_sweep(sub)
    _node_parsers(sub)
    _federation_parsers(sub)
    deploy = sub.add_parser("deploy", help="write the manifests that deploy a config on a cluster")
    targets = deploy.add_subparsers(dest="target", metavar="TARGET", required=True)
    from fedweave.deploy import image
    from fedweave.deploy.kubernetes import add_arguments, federation

    add_arguments(targets.add_parser("k8s", help="a kustomize base and overlays for Kubernetes (docs/deployment.md)"))
    federation.add_arguments(targets.add_parser(
        "federation", help="the federation service on Kubernetes: its server and sites (docs/federation-policy.md)"
    ))
    image.add_arguments(targets.add_parser(
        "image", help="the build context of an image with your modules and extras (docs/deployment.md, Images)"
    ))
    return parser


def _federation_parsers(sub: Any) -> None:
    """``federation serve|join``, ``submit``, ``jobs``, ``job``, ``cancel``, ``logs``: a long-lived federation."""
    from fedweave.cli.federation import add_parsers

    add_parsers(sub)


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
    client.add_argument(
        "--data", metavar="PATH", help="this site's own data file or folder (task.dataset: files), instead of "
        "task.dataset_options.path; the client reads nothing else"
    )
    client.add_argument("--device", metavar="DEV", help="this site's device: auto, cpu, cuda, cuda:N, mps (local.device)")
    client.add_argument("--site", metavar="FILE",
                        help="a YAML file of this site's own settings: data, device, threads (--data, --device win)")
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
        "site-<s>.pem/.key/.token and tokens.json; point grpc.credentials at DIR. With --site-name and --admin, "
        "also a federation's site-<name>.pem/.key and admin-<name>.pem/.key. Keep ca.key off the nodes.",
    )
    certs.add_argument("--out", required=True, metavar="DIR", help="folder to write the credentials into")
    certs.add_argument("--clients", type=int, default=0, metavar="N",
                       help="number of clients of a run's deployment (default 0: a federation's named identities only)")
    certs.add_argument(
        "--sites", type=int, default=0, metavar="S", help="number of site leaders (hierarchical gRPC; default 0)"
    )
    certs.add_argument(
        "--host", action="append", metavar="NAME", help="server host name or IP (repeatable; default localhost, 127.0.0.1, ::1)"
    )
    certs.add_argument("--site-name", action="append", metavar="NAME",
                       help="a named site of a long-lived federation: site-NAME.pem/.key (repeatable; "
                       "docs/federation-service.md)")
    certs.add_argument("--admin", action="append", metavar="NAME",
                       help="an admin of a long-lived federation, who may submit and cancel jobs: admin-NAME.pem/.key "
                       "(repeatable)")
    certs.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    _replacing_flags(certs, "credentials")


def _replacing_flags(command: argparse.ArgumentParser, what: str) -> None:
    """``--force`` and ``--runs`` of the commands that write secrets (see fedweave.cli.keys)."""
    command.add_argument(
        "--force", action="store_true",
        help=f"replace the {what} DIR holds already (never those a run directory records in its run.json)",
    )
    command.add_argument(
        "--runs", action="append", metavar="PATH",
        help=f"a run directory, or a folder of them, whose {what} --force must not replace (repeatable; default runs)",
    )
