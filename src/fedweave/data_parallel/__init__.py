"""Data-parallel training (``mode: data_parallel``): N worker processes train one model on
one dataset, each step over one global batch of B samples split into b_i by the dynamic
batch controller.

The modules, one concept each:

- :mod:`~fedweave.data_parallel.gradients`: the b_i / B weighting, flat vectors of
  parameters and buffers (pure maths);
- :mod:`~fedweave.data_parallel.controller`: the dynamic batch controller, b_i from measured
  throughput (plain logic);
- :mod:`~fedweave.data_parallel.sampler`: the global sampler, disjoint index ranges per step;
- :mod:`~fedweave.data_parallel.group`: one generation's process group, the run's
  store, and how a run fails;
- :mod:`~fedweave.data_parallel.records`: the run's saved state, metrics window,
  evaluations, checkpoint and model files;
- :mod:`~fedweave.data_parallel.workers`: what a worker process gets and builds, and
  how the workers are started;
- :mod:`~fedweave.data_parallel.elastic`: workers that leave and join a synchronous run;
- :mod:`~fedweave.data_parallel.bsp`: the synchronous step (``sync: bsp``);
- :mod:`~fedweave.data_parallel.parameter_server` and :mod:`~fedweave.data_parallel.asp`:
  the asynchronous mode (``sync: asp``);
- :mod:`~fedweave.data_parallel.launch`: prepare, resume, execute and join a run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedweave.data_parallel.gradients import assign_gradient, local_contribution, summed_gradient
    from fedweave.data_parallel.group import DataParallelError
    from fedweave.data_parallel.launch import execute, join, prepare, resume, run_config
    from fedweave.data_parallel.records import DataParallelRun

_HOMES = {
    "DataParallelError": "group",
    "DataParallelRun": "records",
    "assign_gradient": "gradients",
    "execute": "launch",
    "join": "launch",
    "local_contribution": "gradients",
    "prepare": "launch",
    "resume": "launch",
    "run_config": "launch",
    "summed_gradient": "gradients",
}
"""Each public name's module, imported when the name is first used: importing one module of the
package (the batch controller, which the federated controller shares a rule with) does not import
the launcher, which reaches the federated spine."""

__all__ = [
    "DataParallelError",
    "DataParallelRun",
    "assign_gradient",
    "execute",
    "join",
    "local_contribution",
    "prepare",
    "resume",
    "run_config",
    "summed_gradient",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
