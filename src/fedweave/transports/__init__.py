"""Transports move messages between nodes; see :mod:`fedweave.transports.base`."""
