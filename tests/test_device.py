"""Tests of fedweave.device: local.device checked at load and resolved at start, the same model on
cpu and auto here, what a client sends back on the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_same_params, run_to_end, small_config
from fedweave import runner
from fedweave.build import build_chains, build_client_runtime, build_task, initial_params
from fedweave.federated.client import ClientStateStore
from fedweave.device import CPU, moved, resolve
from fedweave.errors import ConfigError
from fedweave.strategies.scaffold import CONTROL
from fedweave.types import Instruction, Message, TaskKind, Work

NO_ACCELERATOR = not torch.cuda.is_available() and not torch.backends.mps.is_available()


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "cpu:0", ""])
def test_a_device_of_no_allowed_form_is_refused_at_load_naming_the_key(name: str) -> None:
    with pytest.raises(ConfigError) as refused:
        small_config(f"local.device='{name}'")
    assert str(refused.value) == (
        f"config key 'local.device': {name!r} is not a device; expected auto, cpu, cuda, cuda:N or mps"
    )


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", "mps"])
def test_every_allowed_form_loads_whatever_this_machine_has(name: str) -> None:
    assert small_config(f"local.device={name}").local.device == name  # a site's device is checked where it runs


def test_data_parallel_refuses_a_federated_device() -> None:
    with pytest.raises(ConfigError, match=r"^config key 'local.device': applies to mode federated; data_parallel"):
        small_config("mode=data_parallel", "local.device=auto")


def test_auto_prefers_cuda_then_mps_then_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve("auto", "local.device") == torch.device("cuda")
    assert resolve("cuda:1", "local.device") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"^config key 'local.device': 'cuda:2', but this machine has 2 CUDA devices \(cuda:0..cuda:1\)$"):
        resolve("cuda:2", "local.device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve("auto", "local.device") == torch.device("mps") == resolve("mps", "local.device")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve("auto", "local.device") == CPU == resolve("cpu", "local.device")
    with pytest.raises(ConfigError, match=r"^config key 'local.device': 'mps', but this machine has no MPS device; use cpu or auto$"):
        resolve("mps", "local.device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_run_asking_for_cuda_on_a_machine_without_it_fails_at_start_in_one_line(tmp_path: Path) -> None:
    config = small_config("local.device=cuda:1")
    with pytest.raises(ConfigError) as refused:
        runner.prepare(config, tmp_path)
    assert str(refused.value) == "config key 'local.device': 'cuda:1', but this machine has no CUDA device; use cpu or auto"


@pytest.mark.skipif(not NO_ACCELERATOR, reason="auto is an accelerator here")
def test_cpu_and_auto_give_the_same_model_bit_for_bit_on_this_machine(tmp_path: Path) -> None:
    plain, plain_records = run_to_end(tmp_path / "cpu", "local.device=cpu", "strategy=scaffold")
    auto, auto_records = run_to_end(tmp_path / "auto", "local.device=auto", "strategy=scaffold")
    assert_same_params(plain, auto)
    assert [r["test_loss"] for r in plain_records] == [r["test_loss"] for r in auto_records]


def test_moved_moves_tensors_through_containers_and_keeps_those_already_there() -> None:
    w, n = torch.ones(2), torch.tensor(3)
    tree = {"w": w, "nested": {"m": [n, (w,)]}, "steps": 4, "name": "x"}
    out = moved(tree, CPU)
    assert out == {"w": w, "nested": {"m": [n, (w,)]}, "steps": 4, "name": "x"}
    assert out["w"] is w and out["nested"]["m"][0] is n and isinstance(out["nested"]["m"][1], tuple)
    meta = moved(tree, torch.device("meta"))
    assert meta["w"].device.type == "meta" and meta["nested"]["m"][1][0].device.type == "meta" and meta["steps"] == 4


def test_a_client_sends_its_update_and_keeps_its_state_on_the_cpu_and_releases_its_gradients() -> None:
    config = small_config("strategy=scaffold")
    task = build_task(config)
    runtime = build_client_runtime(config, task, build_chains(config), ClientStateStore())
    assert runtime.device == CPU
    params = initial_params(config, task)
    ins = Instruction(1, TaskKind.TRAIN, Work(0, 16), params, extras={k: torch.zeros_like(v) for k, v in params.items() if v.is_floating_point()})
    update, state = runtime.work(0, ins, {})
    control = state[CONTROL]  # SCAFFOLD's c_i, kept by the client
    tensors = [*update.tensors.values(), *update.extras.values(), *control.values()]
    assert update.extras and control and all(t.device == CPU for t in tensors)
    assert all(p.grad is None for p in runtime.model.parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the benchmark measures")
def test_the_device_benchmark_says_in_one_line_that_there_is_no_gpu_and_succeeds() -> None:
    script = Path(__file__).parents[1] / "benchmarks" / "device.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "benchmarks/device.py: this machine has no CUDA device, so there is no cuda round to measure\n"
