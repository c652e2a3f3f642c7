"""``task.model: hf:PATH``: a ``transformers`` causal language model read from a local folder.

The folder is what ``save_pretrained`` wrote (``config.json`` and the weights); nothing is ever
downloaded (``local_files_only``, whatever ``HF_HUB_OFFLINE`` says). Every node reads the same
folder, so the base weights never travel: with ``task.peft`` only the adapters do
(:mod:`fedweave.task.lora`), without it every weight of the model trains and travels.
:class:`CausalLM` makes the model a fedweave model: token ids ``(N, T)`` in, logits ``(N, T, V)`` out.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Any

import torch
from torch import nn

from fedweave.config.sections import HF_MODEL
from fedweave.errors import TaskError

logger = logging.getLogger(__name__)

EXTRA = "pip install 'fedweave[hf]'"
"""How to install what ``task.model: hf:`` and ``task.peft`` need (transformers, peft)."""


def require(module: str, key: str = "task.model") -> ModuleType:
    """``module`` (transformers or peft) imported, or a TaskError naming ``key`` and the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TaskError(f"{key}: {module} is not installed; it comes with the extra hf: {EXTRA}") from None


def model_folder(spec: str) -> str:
    """The local folder of ``hf:PATH``, which must hold a saved model (``config.json``)."""
    folder = spec[len(HF_MODEL):]
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise TaskError(
            f"task.model: no transformers model in {folder!r} (expected a folder written by save_pretrained, "
            "with config.json; nothing is downloaded)"
        )
    return folder


def load_pretrained(spec: str) -> Any:
    """The causal language model saved in ``spec``'s folder, read from disk only."""
    transformers = require("transformers")
    folder = model_folder(spec)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TaskError(f"task.model: {folder} is not a causal language model transformers can read: {exc}") from None


class CausalLM(nn.Module):
    """A ``transformers`` causal language model as a fedweave model: every weight trains and travels."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``(N, T, V)`` of token ids ``x`` ``(N, T)``."""
        return self.model(input_ids=x).logits


def check_fits(model: CausalLM, vocab: int, sequence_length: int, spec: str) -> None:
    """Refuse a model whose vocabulary is smaller than the tokenizer's or whose positions are fewer
    than ``task.sequence_length``: one line naming the key."""
    config: Any = model.model.config  # a transformers PretrainedConfig
    size = int(config.vocab_size)
    if size < vocab:
        raise TaskError(f"task.model: {spec} has a vocabulary of {size} tokens, the tokenizer gives ids up to {vocab - 1}")
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if positions is not None and int(positions) < sequence_length:
        raise TaskError(
            f"task.sequence_length: {sequence_length} tokens, but {spec} has {int(positions)} positions; "
            f"set task.sequence_length to at most {int(positions)}"
        )
