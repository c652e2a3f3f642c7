"""Where a node computes: ``local.device`` and the moves of tensors to it and back.

``local.device`` is ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps``; ``auto`` is cuda if this
machine has it, else mps if it has that, else cpu. Its form is checked when the config loads
(:class:`~fedweave.config.LocalConfig`); whether this machine has it, when a node starts
(:func:`resolve`), since in a deployment each site's config names its own device. Everything that travels (updates,
instructions, checkpoints) stays on the CPU: a client moves what it receives to its device
(:func:`moved`) and what it sends back.
"""

from __future__ import annotations

from typing import Any

import torch

from fedweave.errors import ConfigError

CPU = torch.device("cpu")


def resolve(name: str, key: str) -> torch.device:
    """The device ``name`` (of config key ``key``, of a checked form) stands for on this machine;
    one ConfigError naming the key when this machine has no such device."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if torch.backends.mps.is_available() else CPU
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"config key '{key}': {name!r}, but this machine has no CUDA device; use cpu or auto")
        if device.index is not None and device.index >= count:
            raise ConfigError(
                f"config key '{key}': {name!r}, but this machine has {count} CUDA device{'s' * (count != 1)} "
                f"(cuda:0..cuda:{count - 1})"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"config key '{key}': 'mps', but this machine has no MPS device; use cpu or auto")
    return device


def moved(tree: Any, device: torch.device) -> Any:
    """``tree`` with its tensors on ``device``, through dicts, lists and tuples (a tensor already
    there is the same tensor, not a copy)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):  # a tensor's move inline: a client's state and update, several a client a round
        return {k: v.to(device) if isinstance(v, torch.Tensor) else moved(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(moved(v, device) for v in tree)
    return tree
