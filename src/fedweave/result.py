"""A run's result, its final global model, in the clear or kept encrypted: the one place that knows both.

Without a sealing plugin the result is ``model.pt``. With one (plugin he) the server keeps the
model encrypted and its plaintext params stay w_0: the result is ``model.he.pt``, its ciphertexts,
which only a holder of the federation's secret key opens (``fedweave decrypt``). A simulation, and
the process launcher, whose nodes all run on this machine where the clients' secret.ctx is, also
decrypt it into ``model.pt``; a deployed server cannot (it holds the public key only).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from fedweave import rundir
from fedweave.config import Config
from fedweave.errors import ConfigError
from fedweave.plugins.contracts import SealsModel
from fedweave.topologies.hierarchical import leaves, site_tree
from fedweave.types import Params

log = logging.getLogger(__name__)


def result_file(run_dir: Path, sealer: SealsModel | None) -> Path:
    """Where the run's model is: model.pt, or model.he.pt where the server keeps it encrypted."""
    return run_dir / (rundir.MODEL_FILE if sealer is None else rundir.SEALED_MODEL_FILE)


def save_result(params: Params, run_dir: Path, sealer: SealsModel | None, simulated: bool) -> Params:
    """The run's model ``params`` written to ``run_dir`` (:func:`result_file`); the params it ends with
    (the decrypted model, where a simulation's clients decrypt it)."""
    if sealer is None:
        rundir.save_model(params, run_dir)
        return params
    return save_sealed(sealer, params, run_dir, simulated)


def save_sealed(sealer: SealsModel, params: Params, run_dir: Path, simulated: bool) -> Params:
    """A global model kept encrypted: its ciphertexts in model.he.pt. A simulation, whose clients and
    their key live in this process, also has them decrypt it into model.pt, the run's result; a
    deployed server keeps its plaintext params."""
    sealed = sealer.seal(params)
    rundir.save_sealed_model(sealed, run_dir)
    if not simulated:
        log.info("the global model stays encrypted in %s; where secret.ctx is, `fedweave decrypt --keys DIR %s` "
                 "writes model.pt", run_dir / rundir.SEALED_MODEL_FILE, run_dir)
        return params
    plain = sealer.unseal(sealed)
    rundir.save_model(plain, run_dir)
    return plain


def load_result(run_dir: Path, sealer: SealsModel | None) -> Params:
    """The model a server wrote in ``run_dir``, read where every node runs (the process launcher): an
    encrypted one is decrypted here, where the clients' secret.ctx is, into model.pt too (what
    ``fedweave decrypt`` does)."""
    if sealer is None:
        return rundir.load_model(run_dir)
    params = sealer.unseal(torch.load(run_dir / rundir.SEALED_MODEL_FILE, weights_only=True))
    rundir.save_model(params, run_dir)
    return params


def check_sealed_size(sealer: SealsModel, params: Params, max_message_mb: float, updates: int = 1) -> None:
    """Refuse, before any client joins, a model kept encrypted whose messages (the first broadcast, a
    message of ``updates`` encrypted updates) a node would refuse as over ``grpc.max_message_mb``: plugin
    he sends about 57 bytes a model value, so the 2 GiB default holds about 37M values. Ciphertexts
    compress to sizes that differ by a few bytes: the size it asks for has 1% to spare."""
    one = sealer.sealed_bytes(params)
    size = one * updates
    if size > max_message_mb * (1 << 20):
        values = sum(t.numel() for t in params.values() if t.is_floating_point())
        relayed = f", a site leader relaying {updates} members' updates in one" if updates > 1 else ""
        raise ConfigError(
            f"config key 'grpc.max_message_mb': the encrypted model of {values:,} values travels in messages of "
            f"{size / (1 << 20):,.1f} MiB ({one / max(values, 1):.0f} bytes a value{relayed}), over the limit of "
            f"{max_message_mb:g} MiB; set grpc.max_message_mb to at least {math.ceil(1.01 * size / (1 << 20))}"
        )


def updates_a_message(config: Config) -> int:
    """The most encrypted updates one message carries: one, or all a site leader's sampled members
    answered (a hierarchy relays the updates of a plugin that combines them encoded)."""
    if config.topology.kind != "hierarchical":
        return 1
    tree = site_tree(config.topology.sites, config.clients)  # type: ignore[arg-type]
    return min(config.clients_per_round, max(len(leaves(site)) for site in tree))
