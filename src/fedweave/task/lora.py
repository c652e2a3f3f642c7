"""``task.peft: {method: lora}``: federated LoRA, where only the adapters train and travel.

:class:`LoraLM` wraps a ``peft`` model whose base weights are frozen; its ``state_dict`` is the
adapter tensors alone (the parameters that train) and ``load_state_dict`` loads those alone. Since
fedweave's params are a model's ``state_dict``, the adapters are all that is sent, checked against
the update schema, aggregated, compressed and checkpointed: the base weights stay where every node
read them (:mod:`fedweave.task.hf`). Every strategy whose math is elementwise over named tensors
works on them unchanged (:func:`fedweave.rules.adapter_strategies` refuses the ones that are not).

The run's artefact (:func:`save_adapter`) is the adapter in ``peft``'s layout, loadable by
``PeftModel.from_pretrained(base, folder)``, and with ``merged`` the base model with the adapters
merged in, loadable by ``AutoModelForCausalLM.from_pretrained``. :func:`language_model` is the model
a run builds from ``task``: the ``hf:`` folder's, wrapped here when ``task.peft`` is set.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.module import _IncompatibleKeys

from fedweave.config.sections import PeftConfig, TaskConfig
from fedweave.errors import TaskError
from fedweave.task.hf import CausalLM, load_pretrained, require
from fedweave.types import Params

ADAPTER_DIR = "adapter"
"""The run folder's sub-folder of the trained adapter (peft layout)."""

MERGED_DIR = "merged"
"""The run folder's sub-folder of the base model with the adapters merged in (``task.peft.merged``)."""


class LoraLM(CausalLM):
    """A causal language model with LoRA adapters whose state is its adapters alone."""

    def adapters(self) -> dict[str, torch.nn.Parameter]:
        """The adapter parameters (those that train), by their names in this module."""
        return {name: p for name, p in self.named_parameters() if p.requires_grad}

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The adapter tensors (``prefix`` before each name), as ``nn.Module.state_dict`` gives tensors."""
        out = OrderedDict() if destination is None else destination
        for name, p in self.adapters().items():
            out[prefix + name] = p if keep_vars else p.detach()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Copy ``state_dict``'s adapter tensors in; a name missing or unknown (``strict``) or a shape that
        differs is a RuntimeError, as ``nn.Module.load_state_dict`` raises."""
        own = self.adapters()
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if strict and (missing or unexpected):
            raise RuntimeError(f"LoRA adapter state: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            for name in own.keys() & state_dict.keys():
                value = state_dict[name]
                if tuple(value.shape) != tuple(own[name].shape):
                    raise RuntimeError(f"LoRA adapter {name}: shape {tuple(value.shape)}, expected {tuple(own[name].shape)}")
                own[name].copy_(value)
        return _IncompatibleKeys(missing, unexpected)


def with_lora(base: torch.nn.Module, settings: PeftConfig) -> LoraLM:
    """``base`` with LoRA adapters of ``settings`` on its ``target_modules``, its own weights frozen."""
    peft = require("peft", "task.peft")
    conv1d = require("transformers").pytorch_utils.Conv1D  # GPT-2's layers, their weights stored (in, out)
    targets = set(settings.target_modules)
    transposed = any(isinstance(m, conv1d) for name, m in base.named_modules() if name.rpartition(".")[2] in targets)
    config = peft.LoraConfig(
        r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules), fan_in_fan_out=transposed,
    )
    try:
        model = peft.get_peft_model(base, config)
    except ValueError as exc:  # no module matched target_modules
        raise TaskError(f"task.peft.target_modules {settings.target_modules}: {exc}") from None
    return LoraLM(model)


def language_model(task: TaskConfig) -> CausalLM:
    """The model of ``task``: its ``hf:`` folder's, with the LoRA adapters of ``task.peft`` when set
    (their initial values drawn from torch's global generator, which the caller seeds)."""
    base = load_pretrained(task.model)
    if task.peft.method is None:
        return CausalLM(base)
    return with_lora(base, task.peft)


def save_adapter(task: TaskConfig, params: Params, run_dir: Path) -> None:
    """Write the adapters ``params`` in ``peft``'s layout to ``run_dir/adapter`` and, with
    ``task.peft.merged``, the merged model to ``run_dir/merged``; each folder written aside and renamed."""
    model = with_lora(load_pretrained(task.model), task.peft)
    model.load_state_dict(params)
    peft_model: Any = model.model  # a peft.PeftModel
    _write_folder(run_dir / ADAPTER_DIR, peft_model.save_pretrained)
    if task.peft.merged:
        _write_folder(run_dir / MERGED_DIR, peft_model.merge_and_unload().save_pretrained)


def _write_folder(target: Path, write: Any) -> None:
    """``write(folder)`` into a fresh folder beside ``target``, which then replaces ``target``."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(str(staging))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
