"""Differential privacy: update clipping, client-level DP-FedAvg (local or central noise,
adaptive clipping), sample-level DP-SGD through Opacus, and the Opacus RDP accountant."""
