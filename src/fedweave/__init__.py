"""fedweave: federated learning and heterogeneity-aware data-parallel training."""

import logging

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())
