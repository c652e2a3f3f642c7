"""Client-level differential privacy for federated averaging (DP-FedAvg).

McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private Recurrent Language
Models", ICLR 2018 (https://arxiv.org/abs/1710.06963); adaptive clipping from Andrew,
Thakkar, McMahan & Ramaswamy, "Differentially Private Learning with Adaptive Clipping",
NeurIPS 2021 (https://arxiv.org/abs/1905.03871).

Each client clips its update Δ_k to L2 norm C. Then Gaussian noise:

- ``dp_central``: the server adds N(0, z²C²) once to the *sum* of the clipped updates
  and divides by the number m of updates summed: (Σ_k clip(Δ_k) + N(0, z²C²I)) / m.
  It is a combining plugin (the server must see the updates only through their noisy
  sum), so it works with weighted-sum strategies and ``aggregation.rule: mean``.
  Guarantee: (ε, δ) for adding or removing one client's whole data, from Opacus's RDP
  accountant for the subsampled Gaussian mechanism with noise multiplier z, sample
  rate q = clients per round / clients, one step per round.
- ``dp_local``: each client adds N(0, z²C²) to its own clipped update before sending
  it, so nobody (not the server either) sees an un-noised update. Guarantee per
  client, in the local model: any two updates of one client differ by at most 2C, so
  each round is a Gaussian mechanism of multiplier z/2 without sampling amplification
  (the server knows who took part); ε is counted as if the client took part in every
  round (an upper bound).

**Weights.** McMahan et al. weight client k by w_k = min(n_k / ŵ, 1) and divide by a
fixed q·W, which needs a cap ŵ on data sizes to bound the sensitivity. fedweave uses
uniform weights (w_k = 1, the paper's choice when clients hold similar amounts of data):
the sum's sensitivity is then exactly C and nothing about a client's data size enters
the mechanism. The strategy's example weighting is therefore replaced by the plain mean
of the clipped updates (the returned update still reports the total examples).

**Adaptive clipping** (``dp_central``, ``adaptive: true``): each client also sends one
bit b_k = [‖Δ_k‖ ≤ C] (an int8 tensor); the server estimates the fraction of unclipped
updates b̃ = (Σ b_k + N(0, σ_b²)) / m and moves C geometrically towards the target
quantile γ: C ← C · exp(−η (b̃ − γ)). The update noise is z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2),
so that both releases together cost what one Gaussian mechanism of multiplier z costs
(Andrew et al., Theorem 1); σ_b defaults to m / 20 as in the paper.

The noise comes from the operating system's secure source (:mod:`.noise`): every node
reads the same config, so noise seeded from it could be drawn again by the server (for
``dp_local``) or by any client (for ``dp_central``) and subtracted. ``seeded_noise: true``
draws it from the run seed, round and client instead, so a simulation repeats bit for
bit; a deployment refuses that at load. The server sends the current clip norm with each instruction (``instruct``, the
instruction's ``config``), so the clients clip to the same C in simulation and in a
deployment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from fedweave.errors import ConfigError
from fedweave.plugins.contracts import Declaration, FreshDraws, PluginContext
from fedweave.plugins.packing import combine_plain
from fedweave.plugins.privacy.accountant import History, check_target, epsilon
from fedweave.plugins.privacy.clip import clip_tensors
from fedweave.plugins.privacy.noise import NoiseSource, noise_source
from fedweave.schema import opt
from fedweave.types import Params, Update, UpdateKind

UNCLIPPED = "__dp_unclipped"
"""The adaptive-clipping bit b_k a client sends with its update (int8, never compressed)."""
CLIP = "dp_central.clip"
"""Instruction config: the clip norm C the client clips to this round (adaptive clipping)."""
SEEDED_HELP = "draw the noise from the run seed (reproducible; simulation only: anyone with the config can redraw it)"


def fresh_noise(params: DPLocalHParams | DPCentralHParams) -> FreshDraws | None:
    """Privacy noise from the OS's secure source, unless seeded: a round done again is a second release."""
    return None if params.seeded_noise else FreshDraws("privacy noise", releases=True)


@dataclass
class DPLocalHParams:
    clip: float = opt(1.0, gt=0, help="L2 norm C each client's update is clipped to")
    noise_multiplier: float = opt(1.0, ge=0, help="z: each client adds N(0, (z·C)²) to every entry")
    delta: float = opt(1e-5, gt=0, lt=1, help="δ of the reported (ε, δ) guarantee")
    target_epsilon: float | None = opt(None, gt=0, help="stop the run before a round that would pass this ε")
    seeded_noise: bool = opt(False, help=SEEDED_HELP)


@dataclass
class DPCentralHParams:
    clip: float = opt(1.0, gt=0, help="L2 norm C each client's update is clipped to (the initial C when adaptive)")
    noise_multiplier: float = opt(1.0, ge=0, help="z: the server adds N(0, (z·C)²) to every entry of the sum")
    delta: float = opt(1e-5, gt=0, lt=1, help="δ of the reported (ε, δ) guarantee")
    target_epsilon: float | None = opt(None, gt=0, help="stop the run before a round that would pass this ε")
    adaptive: bool = opt(False, help="adapt C to a quantile of the update norms (Andrew et al. 2021)")
    target_quantile: float = opt(0.5, gt=0, lt=1, help="adaptive: share of updates that should be left unclipped")
    clip_lr: float = opt(0.2, gt=0, help="adaptive: learning rate η of the geometric update of C")
    count_noise: float | None = opt(None, gt=0, help="adaptive: σ_b of the noisy unclipped count (none: clients per round / 20)")
    seeded_noise: bool = opt(False, help=SEEDED_HELP)


class _Budget:
    """The accountant side shared by both modes: ε per round, the target, the metrics."""

    def __init__(self, name: str, noise: float, delta: float, target: float | None):
        self.name = name
        self.noise = noise  # the multiplier the accountant sees
        self.delta = delta
        self.target = target
        self.rate = 1.0
        self.rounds = 0

    def history(self, rounds: int) -> History:
        return [(self.noise, self.rate, rounds)] if rounds else []

    def epsilon(self, rounds: int) -> float:
        return epsilon(self.history(rounds), self.delta)

    def begin_round(self, rnd: int) -> None:
        if self.noise > 0:
            check_target(self.epsilon(rnd), self.target, rnd, f"plugin {self.name!r}")
        self.rounds = rnd

    def metrics(self) -> dict[str, float]:
        if self.noise == 0 or not self.rounds:  # no noise: no finite ε to report
            return {}
        return {"epsilon": self.epsilon(self.rounds)}


class DPLocal:
    """DP-FedAvg, local noise: each client clips its update and adds Gaussian noise."""

    name = "dp_local"
    HParams = DPLocalHParams
    accepts = frozenset({UpdateKind.DELTA, UpdateKind.GRADIENT})
    combines_encoded = False
    declares = Declaration(stage="noise", points=("client_send",), summable=True, protects="update")
    fresh_draws = staticmethod(fresh_noise)

    def __init__(self, hp: DPLocalHParams):
        self.hp = hp
        self.seed = 0
        # Replace-one adjacency in the local model: sensitivity 2C, so multiplier z / 2, no sampling.
        self.budget = _Budget(self.name, hp.noise_multiplier / 2, hp.delta, hp.target_epsilon)

    def bind(self, config: Any) -> None:
        self.seed = config.seed

    def begin_round(self, rnd: int, client_ids: list[int]) -> None:
        self.budget.begin_round(rnd)

    def metrics(self) -> dict[str, float]:
        return self.budget.metrics()

    def encode(self, payload: Update, ctx: PluginContext) -> Update:
        clipped, _ = clip_tensors(payload.tensors, self.hp.clip)
        source = noise_source(self.hp.seeded_noise, self.seed, self.name, ctx.round, ctx.client_id)
        return replace(payload, tensors=add_noise(clipped, self.hp.noise_multiplier * self.hp.clip, source))

    def decode(self, payload: Update, ctx: PluginContext) -> Update:
        return replace(payload)


class DPCentral:
    """DP-FedAvg, central noise: clients clip, the server adds noise once to the sum."""

    name = "dp_central"
    HParams = DPCentralHParams
    accepts = frozenset({UpdateKind.DELTA, UpdateKind.GRADIENT})
    combines_encoded = True
    declares = Declaration(stage="noise", points=("client_send",), protects="update")
    fresh_draws = staticmethod(fresh_noise)

    def __init__(self, hp: DPCentralHParams):
        self.hp = hp
        self.seed = 0
        self.clip_norm = hp.clip
        self.count_noise = 0.0
        self.update_noise = hp.noise_multiplier
        self.budget = _Budget(self.name, hp.noise_multiplier, hp.delta, hp.target_epsilon)

    def bind(self, config: Any) -> None:
        self.seed = config.seed
        self.budget.rate = config.clients_per_round / config.clients
        if self.hp.adaptive:
            self.count_noise = self.hp.count_noise or config.clients_per_round / 20
            self.update_noise = split_noise(self.hp.noise_multiplier, self.count_noise)

    def begin_round(self, rnd: int, client_ids: list[int]) -> None:
        self.budget.begin_round(rnd)

    def metrics(self) -> dict[str, float]:
        out = self.budget.metrics()
        if self.hp.adaptive:
            out["clip_norm"] = self.clip_norm
        return out

    def instruct(self, ctx: PluginContext) -> dict[str, Any]:
        """The clip norm of the round, for the clients (it moves when adaptive)."""
        return {CLIP: self.clip_norm} if self.hp.adaptive else {}

    def encode(self, payload: Update, ctx: PluginContext) -> Update:
        clip = float(ctx.config.get(CLIP, self.clip_norm))
        if not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"plugin 'dp_central': the server's clip norm {clip!r} is not a positive number")
        clipped, norm = clip_tensors(payload.tensors, clip)
        if self.hp.adaptive:
            clipped[UNCLIPPED] = torch.tensor([int(norm <= clip)], dtype=torch.int8)
        return replace(payload, tensors=clipped)

    def combine(self, updates: list[Update], ctx: PluginContext) -> Update:
        m = len(updates)
        floating = [{k: v for k, v in u.tensors.items() if v.is_floating_point()} for u in updates]
        plain = [{k: v for k, v in u.tensors.items() if not v.is_floating_point() and k != UNCLIPPED} for u in updates]
        total = {k: torch.as_tensor(sum(f[k].double() for f in floating)) for k in floating[0]}
        source = noise_source(self.hp.seeded_noise, self.seed, self.name, ctx.round)
        noisy = add_noise(total, self.update_noise * self.clip_norm, source)
        mean = {k: (v / m).to(floating[0][k].dtype) for k, v in noisy.items()}
        if self.hp.adaptive:
            unclipped = sum(float(u.tensors[UNCLIPPED].item()) for u in updates)
            fraction = (unclipped + self.count_noise * float(source.normal(()))) / m
            self.clip_norm *= math.exp(-self.hp.clip_lr * (fraction - self.hp.target_quantile))
        tensors = {**mean, **combine_plain(plain)} if plain[0] else mean
        order = [k for k in updates[0].tensors if k != UNCLIPPED]
        return Update(
            kind=updates[0].kind,
            tensors={k: tensors[k] for k in order},
            num_examples=sum(u.num_examples for u in updates),
            applied=list(updates[0].applied),
        )

    def decode(self, payload: Update, ctx: PluginContext) -> Update:
        return replace(payload)

    def state_dict(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip_norm = state["clip_norm"]


def add_noise(tensors: Params, std: float, source: NoiseSource) -> Params:
    """Each floating tensor plus independent N(0, std²) entries (drawn in float64 from ``source``)."""
    if std == 0:
        return dict(tensors)
    return {
        k: (v.double() + std * source.normal(tuple(v.shape))).to(v.dtype)
        if v.is_floating_point()
        else v
        for k, v in tensors.items()
    }


def split_noise(noise_multiplier: float, count_noise: float) -> float:
    """Andrew et al.'s z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2): the update noise that leaves room for the count's."""
    if noise_multiplier == 0:
        return 0.0
    if 2 * count_noise <= noise_multiplier:
        raise ConfigError(
            f"plugin 'dp_central': adaptive clipping needs count_noise σ_b > noise_multiplier / 2 "
            f"(σ_b = {count_noise:g}, z = {noise_multiplier:g}): the noisy count would spend the whole budget; "
            "raise count_noise or sample more clients per round"
        )
    return (noise_multiplier**-2 - (2 * count_noise) ** -2) ** -0.5
