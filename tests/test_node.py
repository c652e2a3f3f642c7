"""The nodes of a deployment: what `fedweave client` refuses before it connects."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedweave import config as config_mod
from fedweave import node
from fedweave.errors import ConfigError

SRC = Path(__file__).parents[1] / "src"


def test_a_client_of_a_simulation_config_is_refused_at_once() -> None:
    config = config_mod.load(None, ["clients=2"])  # transport: inmemory
    with pytest.raises(ConfigError, match="config key 'transport': `fedweave client` connects to a server over gRPC"):
        node.run_client(config, 0)


def test_fedweave_client_on_a_simulation_config_prints_one_line_not_a_60_s_retry(tmp_path: Path) -> None:
    """Issue 14 item 13."""
    path = tmp_path / "sim.yaml"
    path.write_text("name: sim\nclients: 2\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from fedweave.cli import main; sys.exit(main())", "client", str(path), "--id", "0"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )
    assert time.monotonic() - began < 30
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "fedweave: error: config key 'transport': `fedweave client` connects to a server over gRPC, but this "
        "config's transport is 'inmemory' (its clients run inside `fedweave run`); set transport: grpc"
    ]
