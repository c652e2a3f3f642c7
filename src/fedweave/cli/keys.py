"""The federation's HE keys: ``fedweave keys`` makes them, ``fedweave decrypt`` opens a run's encrypted model."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedweave.errors import ConfigError


def make_keys(args: argparse.Namespace) -> int:
    from fedweave.plugins.secure.he import write_keys

    if not 20 <= args.scale_bits <= 50:
        raise ConfigError(f"--scale-bits must lie in 20..50, got {args.scale_bits}")
    secret, public = write_keys(args.out, args.poly_degree, args.scale_bits)
    print(f"secret context (clients only): {secret}\npublic context (server): {public}")
    return 0


def decrypt(run_dir: str, keys: str) -> int:
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
