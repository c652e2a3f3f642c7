"""A plugin written in a user's own module, named as package.module:Class in the config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_to_end

# The example of docs/privacy-and-compression.md, verbatim.
USER_MODULE = '''
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch

import torch

from fedweave.plugins.contracts import Declaration
from fedweave.types import UpdateKind


@dataclass
class ExcludeLayersHParams:
    patterns: list[str] = field(default_factory=lambda: ["head.*"])


class ExcludeLayers:
    """Keep the layers matching the patterns on the client: the server sees zero change for them."""

    name = "exclude_layers"
    HParams = ExcludeLayersHParams
    accepts = frozenset({UpdateKind.DELTA})
    combines_encoded = False
    declares = Declaration(points=("client_send",))

    def __init__(self, hp):
        self.hp = hp

    def _excluded(self, name):
        return any(fnmatch(name, p) for p in self.hp.patterns)

    def encode(self, payload, ctx):
        # an excluded tensor travels as its shape only (an int64 tensor named name + ".__excluded")
        tensors = {
            (k + ".__excluded" if self._excluded(k) else k): (torch.tensor(v.shape) if self._excluded(k) else v)
            for k, v in payload.tensors.items()
        }
        return replace(payload, tensors=tensors)

    def decode(self, payload, ctx):
        tensors = {}
        for k, v in payload.tensors.items():
            if k.endswith(".__excluded"):
                tensors[k[: -len(".__excluded")]] = torch.zeros(v.tolist())
            else:
                tensors[k] = v
        return replace(payload, tensors=tensors)
'''


def test_a_user_module_plugin_runs_in_a_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_filters.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    start, _ = run_to_end(tmp_path / "zero", "rounds=1", "local.lr=1e-12")
    params, records = run_to_end(tmp_path / "run", "plugins.client_send=[{name: 'my_filters:ExcludeLayers', patterns: ['head.*']}]")
    _, dense = run_to_end(tmp_path / "dense")
    assert all(torch.equal(params[k], start[k]) for k in params if k.startswith("head."))  # never left the clients
    assert not torch.equal(params["features.1.weight"], start["features.1.weight"])
    assert records[0]["bytes_received"] < dense[0]["bytes_received"]


def test_a_user_plugin_with_unknown_settings_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedweave.errors import ConfigError
    from conftest import small_config

    (tmp_path / "my_filters.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"unknown config key 'plugins.client_send\[0\].pattern' \(did you mean"):
        small_config("plugins.client_send=[{name: 'my_filters:ExcludeLayers', pattern: ['head.*']}]")
