"""Sample-level differential privacy: DP-SGD inside each client's local training, through Opacus.

Abadi et al., "Deep Learning with Differential Privacy", CCS 2016
(https://arxiv.org/abs/1607.00133); Opacus (Yousefpour et al. 2021,
https://arxiv.org/abs/2109.12298) computes the per-example gradients
(``GradSampleModule``), clips each to ``max_grad_norm``, adds N(0, (z·max_grad_norm)²)
to their sum and scales by the expected batch size (``DPOptimizer.pre_step``); the
strategy's own optimiser then steps, so DP-SGD composes with every strategy.

Selected per run as a ``client_receive`` plugin: it takes over local training
(:class:`~fedweave.plugins.contracts.TakesOverTraining`). For each training instruction
the client runtime asks it for that client's :class:`PrivateTraining` of the round, a
:class:`~fedweave.training.LocalTraining` through which the strategy's client half trains
(:func:`fedweave.training.train_local`) in place of the plain loop. Batches are
Poisson-sampled (each example with probability q = batch_size / n per step), the sampling
Opacus's RDP accountant assumes; a round runs as many steps as the non-private loop would.

Both the noise and the sampling come from the operating system's secure source
(:mod:`.noise`): noise seeded from the config could be drawn again by the server and
subtracted, and the amplification by sampling holds only while nobody else knows which
examples a step used. So Opacus adds no noise itself (its multiplier is set to 0); the
plugin adds N(0, (z·max_grad_norm)²) to the clipped sum, scaled as Opacus scales it.
``seeded_noise: true`` draws both from the run seed, round and client instead
(reproducible; refused in deployments).

ε is per client (a guarantee about each example of that client's data): each client's
history of (z, q, steps) goes to Opacus's RDP accountant, and the metrics report the
largest ε over clients. The history is the server's: a client reports the sampling
rate and steps of its private training with its update (``dpsgd_rate``,
``dpsgd_steps`` in its metrics), and the server half records every report it receives
(``observe``), before the update is decoded or rejected, since the update was released
all the same. So ε, and a target ε, work the same in simulation and with clients in
their own processes; the ledger is saved in the server's checkpoints.

Limitation: Opacus computes per-example gradients of the loss's per-example terms; a
term of the loss that is not per example (FedProx's proximal term) is dropped from the
private gradient. Models with BatchNorm are refused (per-example gradients do not exist).
A strategy's loss hook gets the model itself, not Opacus's wrapper (whose parameter names
carry a ``_module.`` prefix): Opacus's hooks sit on the model's layers, so they see its
forward either way.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from fedweave.plugins.contracts import Declaration, FreshDraws, Payload, PluginContext
from fedweave.plugins.privacy.accountant import History, check_target, epsilon
from fedweave.schema import opt
from fedweave.plugins.privacy.noise import NoiseSource, noise_source
from fedweave.training import NOTHING, ClientJob, Hooks, TrainResult, opening, rows
from fedweave.types import Update, UpdateKind

log = logging.getLogger(__name__)

RATE = "dpsgd_rate"
"""Update metric: the Poisson sampling rate q of the client's private training this round."""
STEPS = "dpsgd_steps"
"""Update metric: the noisy steps it took."""


@dataclass
class DPSGDHParams:
    noise_multiplier: float = opt(1.0, gt=0, help="z: noise std over max_grad_norm, per step")
    max_grad_norm: float = opt(1.0, gt=0, help="L2 norm each example's gradient is clipped to")
    delta: float = opt(1e-5, gt=0, lt=1, help="δ of the reported (ε, δ) guarantee")
    target_epsilon: float | None = opt(None, gt=0, help="stop the run before a round that would pass this ε")
    seeded_noise: bool = opt(
        False, help="draw noise and batches from the run seed (reproducible; simulation only: anyone with the config can redraw them)"
    )


def _opacus() -> tuple[Any, Any, Any]:
    try:
        from opacus.grad_sample import GradSampleModule
        from opacus.optimizers import DPOptimizer
        from opacus.validators import ModuleValidator
    except ImportError:
        raise ImportError("plugin 'dpsgd' needs Opacus: pip install 'fedweave[privacy]'") from None
    return GradSampleModule, DPOptimizer, ModuleValidator


class DPSGD:
    """DP-SGD (Abadi et al. 2016) in local training, through Opacus; ε per client from its RDP accountant."""

    name = "dpsgd"
    HParams = DPSGDHParams
    accepts = frozenset(UpdateKind)
    combines_encoded = False
    declares = Declaration(stage="train", points=("client_receive",), protects="training")

    @staticmethod
    def fresh_draws(params: DPSGDHParams) -> FreshDraws | None:
        """Noise and batches from the OS's secure source, unless seeded: a round done again is a second release."""
        return None if params.seeded_noise else FreshDraws("privacy noise and batch sampling", releases=True)

    def __init__(self, hp: DPSGDHParams):
        self.hp = hp
        self.seed = 0
        self.ledger: dict[int, History] = {}
        self._cache: dict[int, tuple[int, float]] = {}

    def bind(self, config: Any) -> None:
        self.seed = config.seed

    def encode(self, payload: Payload, ctx: PluginContext) -> Payload:
        return replace(payload)

    def decode(self, payload: Payload, ctx: PluginContext) -> Payload:
        return replace(payload)

    def training(self, ctx: PluginContext) -> PrivateTraining:
        """Client ``ctx.client_id``'s private training of round ``ctx.round``, its noise drawn as configured."""
        return PrivateTraining(self.hp, noise_source(self.hp.seeded_noise, self.seed, self.name, ctx.round, ctx.client_id))

    def begin_round(self, rnd: int, client_ids: list[int]) -> None:
        """Stop before a round that would pass the target, predicting each client repeats its last round."""
        if self.hp.target_epsilon is None:
            return
        worst = max((epsilon([*h, h[-1]], self.hp.delta) for h in self.ledger.values() if h), default=0.0)
        check_target(worst, self.hp.target_epsilon, rnd, f"plugin {self.name!r}")

    def metrics(self) -> dict[str, float]:
        if not self.ledger:
            return {}
        return {"epsilon": max(self._epsilon(cid) for cid in self.ledger)}

    def state_dict(self) -> dict[str, Any]:
        return {"ledger": self.ledger}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ledger = {int(k): list(v) for k, v in state["ledger"].items()}
        self._cache = {}

    def observe(self, updates: list[Update]) -> None:
        """Record each update's report of its private training (the server's ledger)."""
        for update in updates:
            if RATE not in update.metrics and STEPS not in update.metrics:
                continue
            rate, steps = update.metrics.get(RATE, math.nan), update.metrics.get(STEPS, math.nan)
            if not (0 < rate <= 1 and steps >= 0 and float(steps).is_integer()):
                log.warning(
                    "plugin 'dpsgd': client %d reported rate %r and steps %r, not a private training; not counted",
                    update.client_id, rate, steps,
                )
                continue
            self.ledger.setdefault(update.client_id, []).append((self.hp.noise_multiplier, rate, int(steps)))

    def _epsilon(self, client_id: int) -> float:
        history = self.ledger[client_id]
        cached = self._cache.get(client_id)
        if cached is None or cached[0] != len(history):
            cached = (len(history), epsilon(history, self.hp.delta))
            self._cache[client_id] = cached
        return cached[1]


class PrivateTraining:
    """One client's private local training for one round (see the module doc): a
    :class:`~fedweave.training.LocalTraining`."""

    def __init__(self, hp: DPSGDHParams, noise: NoiseSource):
        self.hp = hp
        self.noise = noise
        self.spent: dict[str, float] = {}

    def report(self) -> dict[str, float]:
        """What the round's private training spent, for the server's ledger (empty before it ran):
        the sampling rate and the noisy steps of every training of the round."""
        return dict(self.spent)

    def train(self, job: ClientJob, hooks: Hooks) -> TrainResult:
        GradSampleModule, DPOptimizer, ModuleValidator = _opacus()
        start = opening(job, hooks)
        if start is None:
            return NOTHING
        model, opt, n, batch = start.model, start.optimizer, start.examples, start.batch
        loss, after_backward = hooks.loss, hooks.after_backward
        problems = ModuleValidator.validate(model, strict=False)
        if problems:
            raise ValueError(f"plugin 'dpsgd' cannot train this model privately: {problems[0]}")
        rate = batch / n
        wrapped = GradSampleModule(model)
        # Opacus clips the per-example gradients of the optimiser's parameters, sums them and
        # divides by the expected batch size; the noise is ours (see the module doc); ours then steps.
        dp = DPOptimizer(
            torch.optim.SGD(opt.params, lr=0.0),
            noise_multiplier=0.0,
            max_grad_norm=self.hp.max_grad_norm,
            expected_batch_size=batch,
        )
        std = self.hp.noise_multiplier * self.hp.max_grad_norm / batch
        device = job.x_train.device
        model.train()
        loss_sum, seen = 0.0, 0
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                for _ in range(start.steps):
                    idx = (self.noise.uniform((n,)) < rate).nonzero().squeeze(1).to(device)
                    x, y = rows(job.x_train, idx), rows(job.y_train, idx)
                    dp.zero_grad(set_to_none=True)
                    if loss is None:
                        objective = reported = job.loss_fn(model(x), y)
                    else:
                        objective, reported = loss(model, x, y)
                    objective.backward()
                    if dp.pre_step():
                        for p in dp.params:
                            p.grad.add_((std * self.noise.normal(tuple(p.grad.shape))).to(p.grad.device, p.grad.dtype))
                    if after_backward is not None:
                        after_backward(model)
                    opt.step()
                    if len(idx):
                        loss_sum += float(reported.detach()) * len(idx)
                        seen += len(idx)
        finally:
            dp.zero_grad(set_to_none=True)
            wrapped._close()
        # A second training of the round (Ditto's personal model) spends as well: its steps add up, at
        # the larger rate (ε grows with the rate, so this bounds what both spent).
        self.spent = {RATE: max(rate, self.spent.get(RATE, 0.0)), STEPS: self.spent.get(STEPS, 0.0) + start.steps}
        return TrainResult(steps=start.steps, num_examples=n, mean_loss=loss_sum / seen if seen else float("nan"))
