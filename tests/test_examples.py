"""Every example config loads and runs (shortened: 1 round, small evaluation)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedweave import config as config_mod
from fedweave import data_parallel, runner

EXAMPLES_DIR = Path(__file__).parent.parent / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))

# Enough to exercise each example's own dataset, model, partition and strategy quickly.
SHORTEN = ["rounds=1", "eval.federated_every=1"]


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 3


def _lora_stdlib(folder: Path) -> list[str]:
    """examples/lora_stdlib.py's set-up, small (two packages, a model 32 wide), and the paths to it."""
    import lora_stdlib

    pytest.importorskip("peft")
    torch.set_num_threads(1)
    lora_stdlib.prepare(folder, ("tomllib", "zoneinfo"), "dbm", width=32, heads=2, positions=32, steps=20)
    return [f"task.dataset_options.path={folder}/text/{{client}}", f"task.dataset_options.test_path={folder}/test",
            f"task.model=hf:{folder}/model", "task.sequence_length=32", "clients=2", "local.steps=2"]


SET_UP = {"lora-stdlib": _lora_stdlib}
"""The examples whose data a set-up step writes first: the overrides pointing the example at it."""


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES_DIR))  # user modules an example names (custom_strategy.py)
    set_up = SET_UP[path.stem](tmp_path / "data") if path.stem in SET_UP else []
    if config_mod.load(path).mode == "data_parallel":
        config = config_mod.load(path, ["data_parallel.steps=3"])
        joins = [{"step": 2, "worker": j.worker} for j in config.heterogeneity.joins]  # within the 3 steps
        if joins:
            config = config_mod.load(path, ["data_parallel.steps=3", f"heterogeneity.joins={joins}"])
        records = data_parallel.execute(data_parallel.prepare(config, tmp_path / "run"))
        assert records[-1]["step"] == 3 and 0.0 <= records[-1]["test_accuracy"] <= 1.0
        if config.data_parallel.sync == "asp":  # an asp window lists the workers that pushed in it
            assert records[-1]["lost"] == [] and 0 < len(records[-1]["workers"]) <= config.data_parallel.workers
        else:
            assert len(records[-1]["workers"]) == config.data_parallel_workers
        assert (tmp_path / "run" / "model.pt").is_file()
        return
    config = config_mod.load(path, [*SHORTEN, *set_up])
    r = runner.prepare(config, tmp_path / "run")
    records = runner.execute(r)
    assert len(records) == 1
    last = records[0]
    assert last["clients_completed"] == last["clients_sampled"] == config.clients_per_round
    # a server that keeps the model encrypted (plugin he) cannot evaluate it: its clients do
    where = "test" if config.eval.every or r.parts.chains.sealer is None else "federated"
    if config.task.kind == "language_model":
        assert 1.0 <= last[f"{where}_perplexity"] <= 256.0  # bytes: no worse than a uniform guess, roughly
    else:
        metric = {"regression": "r2"}.get(config.task.kind, "accuracy")
        assert -1.0 <= last[f"{where}_{metric}"] <= 1.0
    assert (tmp_path / "run" / "model.pt").is_file()


def test_the_files_csv_data_is_its_scripts_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/data/files-csv holds exactly what examples/files_csv_data.py writes."""
    monkeypatch.syspath_prepend(str(EXAMPLES_DIR))
    import files_csv_data

    files_csv_data.write(tmp_path)
    committed = EXAMPLES_DIR / "data" / "files-csv"
    assert sorted(p.name for p in committed.iterdir()) == sorted(p.name for p in tmp_path.iterdir())
    assert all((committed / p.name).read_bytes() == p.read_bytes() for p in tmp_path.iterdir())
