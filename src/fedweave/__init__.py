"""fedweave: federated learning and heterogeneity-aware data-parallel training.

The Python API (:mod:`fedweave.api`): ``fedweave.load_config``, ``fedweave.run``,
``fedweave.resume``, ``fedweave.sweep``, imported when first used so that ``import fedweave`` stays light.
"""

import logging
from typing import Any

__version__ = "0.1.0"

__all__ = ["load_config", "resume", "run", "sweep"]

logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    if name == "sweep":  # its own module, which runs configs through the api
        from fedweave.sweeps import sweep

        return sweep
    if name in __all__:
        from fedweave import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedweave' has no attribute {name!r}")
