"""Simulated attackers, for measuring defences (config ``attacks``): clients that poison
their training data or their update. See :mod:`fedweave.plugins.attacks.poison`."""
