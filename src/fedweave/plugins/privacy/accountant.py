"""Privacy accounting with Opacus's RDP accountant (never a hand-written one).

A history is a list of ``(noise_multiplier, sample_rate, steps)`` entries, exactly what
:class:`opacus.accountants.RDPAccountant` keeps, and :func:`epsilon` returns what its
``get_epsilon`` returns for that history. It computes the same way (Opacus's
``compute_rdp`` over the accountant's default orders, then ``get_privacy_spent``), but
keeps the RDP of one step of each (noise, rate) pair, since the RDP of a history is
linear in its steps and computing it at fractional orders takes about a second.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from fedweave.errors import BudgetSpent

History = list[tuple[float, float, int]]


def _opacus_rdp() -> tuple[Any, Any]:
    try:
        from opacus.accountants import RDPAccountant
        from opacus.accountants.analysis import rdp
    except ImportError:
        raise ImportError("privacy accounting needs Opacus: pip install 'fedweave[privacy]'") from None
    return RDPAccountant, rdp


@functools.lru_cache(maxsize=256)
def _rdp_of_one_step(noise: float, rate: float) -> Any:
    accountant, analysis = _opacus_rdp()
    return analysis.compute_rdp(q=rate, noise_multiplier=noise, steps=1, orders=accountant.DEFAULT_ALPHAS)


def epsilon(history: History, delta: float) -> float:
    """ε at ``delta`` after the mechanisms of ``history`` (Opacus's RDP accountant)."""
    if not history:
        return 0.0
    accountant, analysis = _opacus_rdp()
    rdp = sum(_rdp_of_one_step(noise, rate) * steps for noise, rate, steps in history)
    with warnings.catch_warnings():  # "optimal order is the smallest alpha": ε is then large, and still a bound
        warnings.filterwarnings("ignore", message="Optimal order is the smallest alpha")
        eps, _ = analysis.get_privacy_spent(orders=accountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
    return float(eps)


def check_target(eps_next: float, target: float | None, rnd: int, what: str) -> None:
    """Raise :class:`BudgetSpent` when round ``rnd`` would take ε past ``target``."""
    if target is not None and eps_next > target:
        raise BudgetSpent(f"{what}: round {rnd} would raise ε to {eps_next:.3f}, past the target {target:g}")
