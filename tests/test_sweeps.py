"""Tests of fedweave.sweeps and ``fedweave sweep``: the grid's cross product as runs under one
folder, a rerun that does nothing, and a summary whose mean ± std is computed here by hand from
the runs' metrics files."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

import fedweave
from fedweave import cli
from fedweave.errors import ConfigError
from fedweave.sweeps import folder_name, parse_grid, parse_seeds, plan

TINY = ["rounds=2", "clients=3", "task.dataset=digits", "eval.federated_every=0", "checkpoint.min_interval=0"]


def test_grid_values_split_at_top_level_commas_only() -> None:
    assert parse_grid(["strategy.name=fedavg,fedprox", "heterogeneity.speeds=[1, 2],[1,4]"]) == {
        "strategy.name": ["fedavg", "fedprox"], "heterogeneity.speeds": ["[1, 2]", "[1,4]"]}
    for bad in (["lr"], ["lr=0.1,"], ["x=[1,2"], ["a=1", "a=2"]):
        with pytest.raises(ConfigError, match="--grid"):
            parse_grid(bad)
    assert parse_seeds("3,1") == [3, 1]
    with pytest.raises(ConfigError, match="--seeds"):
        parse_seeds("1,x")


def test_the_plan_is_the_cross_product_with_a_folder_per_point_and_seed() -> None:
    jobs = plan([1, 2], {"strategy.name": ["fedavg", "fedprox"], "local.lr": ["0.1"]})
    assert [j.name for j in jobs] == [
        "strategy.name=fedavg,local.lr=0.1,seed=1", "strategy.name=fedavg,local.lr=0.1,seed=2",
        "strategy.name=fedprox,local.lr=0.1,seed=1", "strategy.name=fedprox,local.lr=0.1,seed=2"]
    assert jobs[3].overrides == ["strategy.name=fedprox", "local.lr=0.1", "seed=2"]
    odd = folder_name({"strategy": "{name: fedprox, mu: 0.1}"}, 1)
    assert odd.startswith("strategy=_name__fedprox,_mu__0.1_,seed=1-") and "/" not in odd
    assert odd != folder_name({"strategy": "{name: fedprox, mu: 0.1 }"}, 1)  # the hash keeps them apart


def test_a_bad_grid_value_fails_before_any_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="strategy.name"):
        fedweave.sweep(None, [1], {"strategy.name": ["fedavg", "fedprocks"]}, folder=tmp_path / "s",
                       overrides=TINY)
    assert not (tmp_path / "s").exists()


def test_two_strategies_three_seeds_then_a_rerun_that_does_nothing(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    args = ["sweep", *TINY, "--seeds", "1,2,3", "--grid", "strategy.name=fedavg,fedprox", "--jobs", "1",
            "--out", str(out), "--target", "test_accuracy=0.2"]
    assert cli.main(args) == 0
    printed = capsys.readouterr()
    runs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert runs == [f"strategy.name={s},seed={k}" for s in ("fedavg", "fedprox") for k in (1, 2, 3)]
    assert "6/6 runs done" in printed.err  # the progress line
    finals = {s: [json.loads((out / f"strategy.name={s},seed={k}" / "metrics.jsonl").read_text().splitlines()[-1])
                  ["test_accuracy"] for k in (1, 2, 3)] for s in ("fedavg", "fedprox")}
    table = printed.out.splitlines()
    assert table[0] == f"sweep {out}: 6 runs, 6 run now, 0 already finished, 0 failed"
    for strategy, accs in finals.items():
        (row,) = [line for line in table if line.startswith(f"strategy={strategy} ")]
        mean, std = statistics.fmean(accs), statistics.stdev(accs)
        assert f"{mean:.4f} ± {std:.4f}" in row
        assert "(3/3)" in row  # every seed reached the target
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/metrics.jsonl")}
    assert cli.main(args) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"sweep {out}: 6 runs, 0 run now, 6 already finished, 0 failed"
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/metrics.jsonl")} == stamps


def test_from_python_a_callback_sees_every_round_and_an_unfinished_run_is_run_again(tmp_path: Path) -> None:
    seen: list[tuple[str, int]] = []
    done = fedweave.sweep(None, [4], ["strategy.name=fedavg,fedprox"], folder=tmp_path / "s", jobs=1,
                          on_round=lambda run, record: seen.append((run, record["round"])), overrides=TINY)
    assert seen == [("strategy.name=fedavg,seed=4", 1), ("strategy.name=fedavg,seed=4", 2),
                    ("strategy.name=fedprox,seed=4", 1), ("strategy.name=fedprox,seed=4", 2)]
    assert [g.label for g in done.summary] == ["strategy=fedavg", "strategy=fedprox"]
    broken = tmp_path / "s" / "strategy.name=fedprox,seed=4"
    (broken / "model.pt").unlink()
    (broken / "checkpoint.pt").unlink()
    again = fedweave.sweep(None, [4], ["strategy.name=fedavg,fedprox"], folder=tmp_path / "s", jobs=1,
                           overrides=TINY)
    assert (again.ran, again.skipped) == (["strategy.name=fedprox,seed=4"], ["strategy.name=fedavg,seed=4"])
    assert len((broken / "metrics.jsonl").read_text().splitlines()) == 2  # begun again, not appended to


def test_processes_run_side_by_side_and_a_folder_of_another_sweep_is_refused(tmp_path: Path) -> None:
    done = fedweave.sweep(None, [1, 2], {}, folder=tmp_path / "s", jobs=2, overrides=[*TINY, "rounds=1"])
    assert sorted(done.ran) == ["seed=1", "seed=2"] and done.failed == {}
    assert [len(g.runs) for g in done.summary] == [2]
    with pytest.raises(ConfigError, match="another config"):
        fedweave.sweep(None, [1], {}, folder=tmp_path / "s", overrides=[*TINY, "rounds=3"])
