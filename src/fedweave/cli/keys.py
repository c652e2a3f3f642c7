"""The federation's secrets: ``fedweave keys`` makes the HE keys, ``fedweave certs`` the gRPC
credentials, ``fedweave decrypt`` opens a run's encrypted model.

Neither command replaces what a folder holds already unless given ``--force``, and never a key
file a run directory records (its run.json keeps the SHA-256 of the keys its config named:
:func:`fedweave.rundir.key_fingerprints`): replaced HE keys leave that run's model undecryptable,
replaced credentials lock every node of it out. The run directories looked at are those named by
``--runs`` (a run directory, or a folder of them; by default ``runs``, the default output_dir).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from fedweave.errors import ConfigError

DEFAULT_RUNS = ("runs",)


def make_keys(args: argparse.Namespace) -> int:
    from fedweave.plugins.secure.he import PUBLIC_FILE, SECRET_FILE, write_keys

    if not 20 <= args.scale_bits <= 50:
        raise ConfigError(f"--scale-bits must lie in 20..50, got {args.scale_bits}")
    out = Path(args.out)
    refuse_replacing("keys", out, [out / SECRET_FILE, out / PUBLIC_FILE], args.force, args.runs or DEFAULT_RUNS)
    secret, public = write_keys(out, args.poly_degree, args.scale_bits)
    print(f"secret context (clients only): {secret}\npublic context (server): {public}")
    return 0


def make_certs(args: argparse.Namespace) -> int:
    from fedweave.transports.grpc.certs import (
        DEFAULT_HOSTS,
        credential_files,
        make_credentials,
    )

    out = Path(args.out)
    refuse_replacing("certs", out, credential_files(out), args.force, args.runs or DEFAULT_RUNS)
    site_names, admins = args.site_name or [], args.admin or []
    make_credentials(out, args.clients, args.host or DEFAULT_HOSTS, args.days, args.sites,
                     site_names=site_names, admins=admins)
    sites = f" and {args.sites} site leaders" if args.sites else ""
    named = "".join(f", {len(v)} {what} ({', '.join(v)})" for what, v in (("named sites", site_names), ("admins", admins)) if v)
    print(f"credentials for a server, {args.clients} clients{sites}{named} in {out}; set grpc.credentials: {out}")
    return 0


def refuse_replacing(command: str, out: Path, files: Sequence[Path], force: bool, runs: Sequence[str]) -> None:
    """A ConfigError when ``out`` holds any of ``files`` already: without ``force`` always; with it,
    when a run directory among ``runs`` records one of them."""
    from fedweave import rundir

    present = [f for f in files if f.is_file()]
    if not present:
        return
    names = ", ".join(f.name for f in present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
    if not force:
        raise ConfigError(
            f"{command}: {str(out)!r} holds {names} already: replacing them locks out every run that uses them; "
            "write to another folder, or pass --force to replace them"
        )
    for path in present:
        using = rundir.runs_using(path, [Path(r) for r in runs])
        if using:
            raise ConfigError(
                f"{command}: {str(path)!r} is a key of the run in {str(using[0])!r} (its {rundir.RUN_FILE}), "
                "which it would lock out: not replaced, --force or not; write to another folder"
            )


def decrypt(run_dir: str, keys: str) -> int:
    """``fedweave decrypt --keys DIR RUN_DIR``: RUN_DIR/model.pt from the encrypted model, with secret.ctx."""
    import torch

    from fedweave import rundir
    from fedweave.federated.checks import Rejected
    from fedweave.plugins.secure.he import HE, HEHParams

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
        plain = HE(HEHParams(keys=keys)).unseal(sealed)
    except (ValueError, Rejected) as exc:
        raise ConfigError(f"{str(path)!r} cannot be decrypted with {keys}/secret.ctx: {exc}") from None
    rundir.save_model(plain, Path(run_dir))
    print(f"plaintext model: {Path(run_dir) / rundir.MODEL_FILE}")
    return 0
