"""Tests of the ``fedweave`` command: help, schema, list, print-config, errors, runs, the quickstart."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import SMALL
from fedweave import config as config_mod
from fedweave import runner
from fedweave import rundir
from fedweave.cli import main
from fedweave.plugins import PLUGINS
from fedweave.strategies import STRATEGIES


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fedweave")
    assert all(command in out for command in ("run", "schema", "list"))
    assert main([]) == 0
    assert capsys.readouterr().out == out


def test_run_help_shows_options_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--print-config", "--resume", "--run-dir", "--quiet", "--verbose"):
        assert option in out
    assert "fedweave run rounds=20 local.lr=0.05" in out


def test_schema_lists_keys_with_type_default_and_meaning(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[:-1]}
    assert {"rounds", "local.lr", "task.partition.alpha", "eval.every"} <= set(rows)
    assert rows["local.lr"].endswith("local learning rate  [a number; default 0.05]")
    assert main(["schema", "local"]) == 0
    local = capsys.readouterr().out.splitlines()[:-1]
    assert local and all(line.startswith("local.") for line in local)


def test_schema_task_gives_the_dataset_model_and_loss_signatures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "task"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[:-1]}
    assert "f(seed=..., **dataset_options) returning (x_train, y_train, x_test, y_test), or (x, y)" in rows["task.dataset"]
    assert "f(**model_options, input_shape=(...), num_classes=N) returning a torch.nn.Module" in rows["task.model"]
    assert "bce" in rows["task.loss"] and "f(outputs, labels)" in rows["task.loss"]


def test_list_names_the_built_ins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    fedavg = "  fedavg       FedAvg (McMahan et al., 2017): global ← global + Σ n_k Δ_k / Σ n_k.  [no settings]"
    assert fedavg in lines
    assert "  identity     Pass payloads through unchanged (as a copy, as every plugin must).  [no settings]" in lines
    assert all(f"  {name:<12} " in out for name in STRATEGIES.names() + PLUGINS.names())
    assert "datasets:   digits, mnist5k, synthetic" in out


def test_print_config_with_overrides(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", "rounds=7", "local.lr=0.2", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert out == config_mod.to_yaml(config_mod.load(None, ["rounds=7", "local.lr=0.2"]))
    assert yaml.safe_load(out)["rounds"] == 7 and yaml.safe_load(out)["local"]["lr"] == 0.2
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nrounds: 2\n")
    assert main(["run", str(path), "clients=3", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["name"], printed["rounds"], printed["clients"]) == ("mine", 2, 3)
    assert list(tmp_path.iterdir()) == [path]  # nothing run, no run directory


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.endswith("\n") and captured.err.count("\n") == 1
    return captured.err.rstrip("\n")


def test_config_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["run", "roudns=3"]) == 2
    assert one_line_error(capsys).startswith("fedweave: error: unknown config key 'roudns' (did you mean 'rounds'?)")
    assert main(["run", "local.lr=-1"]) == 2
    assert one_line_error(capsys) == "fedweave: error: config key 'local.lr': must be > 0, got -1.0"
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert one_line_error(capsys).startswith("fedweave: error: cannot read config file")
    assert main(["run", "--resume", str(tmp_path), "rounds=3"]) == 2
    assert one_line_error(capsys) == (
        "fedweave: error: --resume takes no config or overrides: the run directory holds its config"
    )


def test_resume_of_a_non_run_directory_exits_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["run", "--resume", str(tmp_path)]) == 1
    assert one_line_error(capsys) == f"fedweave: error: '{tmp_path}' is not a run directory: it has no config.yaml"


def test_run_end_to_end_in_process(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main(["run", *SMALL, "--run-dir", str(run_dir)]) == 0
    captured = capsys.readouterr()
    table = captured.out.splitlines()
    assert table[0].startswith("+-") and table[-1] == table[0]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table[1:-1]}
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows["rounds"] == "3"
    assert rows["final test accuracy"] == f"{lines[-1]['test_accuracy']:.4f}"
    assert rows["best test accuracy"] == f"{max(line['test_accuracy'] for line in lines):.4f}"
    assert rows["run directory"] == str(run_dir)
    assert {"config.yaml", "metrics.jsonl", "partition.json", "checkpoint.pt", "model.pt"} <= {
        p.name for p in run_dir.iterdir()
    }
    err = captured.err.splitlines()
    assert err[0] == f"fedweave 0.1.0 · run quickstart → {run_dir}"
    assert any(line.startswith("4 clients, ") for line in err)  # the partition summary
    assert [line.split(" [")[0] for line in err if line.startswith("round ")] == ["round 1/3", "round 2/3", "round 3/3"]


def test_quiet_prints_nothing_and_finished_runs_say_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["run", *SMALL, "--run-dir", str(tmp_path), "-q"]) == 0
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "")
    assert main(["run", "--resume", str(tmp_path), "-q"]) == 0
    assert capsys.readouterr().err == f"{tmp_path} already finished all 3 rounds\n"
    assert main(["run", *SMALL, "--run-dir", str(tmp_path), "-q"]) == 2
    assert "already holds a run" in one_line_error(capsys)


def test_interrupt_tells_how_to_resume(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(r: runner.Run, on_record: object = None) -> list[dict[str, object]]:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "execute", interrupted)
    assert main(["run", *SMALL, "--run-dir", str(tmp_path), "-q"]) == 130
    assert capsys.readouterr().err == f"\ninterrupted; continue with: fedweave run --resume {tmp_path}\n"


def stop_after_round_1(run_dir: Path) -> None:
    """The SMALL run in ``run_dir``, interrupted once its first round is written."""
    r = runner.prepare(config_mod.load(None, SMALL), run_dir)

    def stop(record: dict[str, object]) -> None:
        if record["round"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.execute(r, stop)


def test_resume_continues_an_interrupted_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    stop_after_round_1(tmp_path)
    assert main(["run", "--resume", str(tmp_path)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" [")[0] for line in err if line.startswith("round ")] == ["round 2/3", "round 3/3"]
    rounds = [json.loads(line)["round"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]


def test_quickstart_end_to_end(tmp_path: Path) -> None:
    """`fedweave run` as a user types it: the embedded quickstart reaches 90 % test accuracy."""
    run_dir = tmp_path / "quickstart"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "fedweave", "run", "--run-dir", str(run_dir), "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == list(range(1, 11))
    assert lines[-1]["test_accuracy"] >= 0.90
    assert lines[-1]["clients_completed"] == 10
    assert elapsed < 60


def test_a_checkpoint_that_does_not_match_the_config_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["run", *SMALL, "rounds=1", "--run-dir", str(tmp_path), "-q"]) == 0
    saved = tmp_path / rundir.CONFIG_FILE
    data = yaml.safe_load(saved.read_text())
    data["rounds"], data["task"]["model_options"]["hidden"] = 2, [32]
    saved.write_text(yaml.safe_dump(data))
    assert main(["run", "--resume", str(tmp_path), "-q"]) == 1
    assert one_line_error(capsys) == (
        f"fedweave: error: checkpoint in '{tmp_path}': tensor 'features.1.weight' has shape [16, 8] in the "
        "checkpoint but [32, 8] in the config's model (was the config changed since?)"
    )


def test_resume_after_a_kill_that_tore_the_last_metrics_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    stop_after_round_1(tmp_path)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"round": 2, "train_lo')  # killed while round 2's line was written
    assert main(["run", "--resume", str(tmp_path), "-q"]) == 0
    rounds = [json.loads(line)["round"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]


def test_careless_flags_and_folders_get_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [
        (["run", *SMALL, f"output_dir={a_file}", "-q"], 1, f"cannot use '{a_file}/quickstart-"),
        (["run", *SMALL, "--run-dir", str(a_file / "run"), "-q"], 1, f"cannot use '{a_file / 'run'}': Not a directory"),
        (["run", *SMALL, "task.model_options={hidden: [100000000000000]}", "-q"], 2, "task.model 'mlp' with"),
        (["certs", "--out", str(a_file), "--clients", "1"], 1, f"cannot use '{a_file}': File exists"),
        (["certs", "--out", str(tmp_path / "c"), "--clients", "1", "--days", "-5"], 2, "certs: --days must lie in 1..36,500"),
        (["certs", "--out", str(tmp_path / "c"), "--clients", "1", "--days", "10000000"], 2, "certs: --days must lie"),
        (["certs", "--out", str(tmp_path / "c"), "--clients", "1000000"], 2, "certs: --clients must lie in 1..10,000"),
        (["certs", "--out", str(tmp_path / "c"), "--clients", "1", "--host", "bücher.example"], 2, "certs: --host"),
        (["keys", "--out", str(a_file)], 1, f"cannot use '{a_file}': File exists"),
        (["client", "x.yaml", "--id", "0", "--token", "abc\ndef"], 2, "--token: a token is one line of printable ASCII"),
        (["server", "x.yaml", "--listen", "127.0.0.1:99999"], 2, "--listen: port 99999 is out of range 0..65535"),
        (["client", "x.yaml", "--id", "0", "--address", "127.0.0.1:http"], 2, "--address: expected host:port"),
        (["site", "x.yaml", "--site", "0", "--rank", "0", "--port", "70000"], 2, "--port: 70000 is out of range"),
    ]
    for argv, code, start in cases:
        assert main(argv) == code, argv
        assert one_line_error(capsys).startswith(f"fedweave: error: {start}"), argv
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]  # nothing was written


def test_a_run_name_cannot_leave_output_dir(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    assert main(["run", *SMALL, "name=../../escaped", f"output_dir={runs}", "-q"]) == 2
    assert one_line_error(capsys).startswith("fedweave: error: config key 'name': '../../escaped' is not a run name")
    assert list(tmp_path.iterdir()) == []


def test_a_run_killed_before_its_first_checkpoint_is_resumed_from_the_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 26 item 10: kill -9 before any checkpoint leaves the config and metrics lines; --resume
    begins the run again (its lines written anew) rather than refusing the folder."""
    runner.prepare(config_mod.load(None, SMALL), tmp_path)
    (tmp_path / rundir.METRICS_FILE).write_text('{"round": 1, "train_loss": 9.0}\n{"round": 2, "tr')
    rundir.release(tmp_path)  # (the process that wrote them was killed: its lock went with it)
    assert main(["run", "--resume", str(tmp_path), "-q"]) == 0
    lines = [json.loads(line) for line in (tmp_path / rundir.METRICS_FILE).read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2, 3] and lines[0]["train_loss"] != 9.0


def test_a_checkpoint_of_another_run_is_refused_with_both_run_ids(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 26 item 10: run b's checkpoint (another seed) copied into run a is not resumed."""
    from fedweave.checkpoint import CHECKPOINT, run_id

    for name, seed in (("a", 0), ("b", 1)):
        assert main(["run", *SMALL, "rounds=1", f"seed={seed}", "--run-dir", str(tmp_path / name), "-q"]) == 0
    (tmp_path / "a" / CHECKPOINT).write_bytes((tmp_path / "b" / CHECKPOINT).read_bytes())
    assert main(["run", "--resume", str(tmp_path / "a"), "-q"]) == 1
    a, b = run_id(tmp_path / "a"), run_id(tmp_path / "b")
    assert a and b and a != b
    assert one_line_error(capsys) == (
        f"fedweave: error: checkpoint '{tmp_path / 'a' / CHECKPOINT}' was written by run {b}, but "
        f"'{tmp_path / 'a'}' is run {a} (its run.json): a checkpoint of another run is not resumed; put this "
        "run's checkpoint back, or begin a new run"
    )


def test_keys_and_certs_replace_nothing_without_force_and_never_what_a_run_uses(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26 item 4: over existing keys or credentials both commands refuse (rc 2, one line) and
    leave the files as they were; --force replaces them, unless a run directory records them."""
    monkeypatch.chdir(tmp_path)
    commands = {"certs": (["certs", "--clients", "1"], "ca.pem"), "keys": (["keys"], "public.ctx")}
    for command, (argv, kept) in commands.items():
        out = tmp_path / command
        assert main([*argv, "--out", str(out)]) == 0
        capsys.readouterr()
        before = (out / kept).read_bytes()
        assert main([*argv, "--out", str(out)]) == 2
        assert one_line_error(capsys).startswith(f"fedweave: error: {command}: '{out}' holds ")
        assert (out / kept).read_bytes() == before
        assert main([*argv, "--out", str(out), "--force"]) == 0
        capsys.readouterr()
        assert (out / kept).read_bytes() != before
    he = f"plugins.client_send=[{{name: he, keys: {tmp_path / 'keys'}}}]"
    used = config_mod.load(None, [*SMALL, he, "eval.every=0", f"grpc.credentials={tmp_path / 'certs'}"])
    rundir.release(rundir.create(used, tmp_path / "runs" / "used")[0])
    elsewhere = tmp_path / "elsewhere"
    (tmp_path / "runs" / "used").rename(elsewhere)
    for command, (argv, kept) in commands.items():
        out = tmp_path / command
        before = (out / kept).read_bytes()
        assert main([*argv, "--out", str(out), "--force", "--runs", str(elsewhere)]) == 2
        assert one_line_error(capsys).startswith(f"fedweave: error: {command}: '{out}/")
        assert (out / kept).read_bytes() == before
    elsewhere.rename(tmp_path / "runs" / "used")  # in ./runs, looked at by default
    assert main(["certs", "--clients", "1", "--out", str(tmp_path / "certs"), "--force"]) == 2
    assert one_line_error(capsys) == (
        f"fedweave: error: certs: '{tmp_path / 'certs' / 'ca.pem'}' is a key of the run in 'runs/used' (its "
        "run.json), which it would lock out: not replaced, --force or not; write to another folder"
    )


def test_status_and_report_on_corrupt_run_files_give_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Issue 26 item 10: a config.yaml that is not YAML, a list, or nested too deep, and metrics
    lines nested as deep or holding values of the wrong type, gave tracebacks; now one line and exit 2,
    or the bad line left out (a note) when the rest of the run reads."""
    import shutil

    good = tmp_path / "good"
    assert main(["run", *SMALL, "rounds=2", "--run-dir", str(good), "-q"]) == 0
    deep = "[" * 1_500 + "]" * 1_500  # (past the interpreter's recursion limit, as 100,000 is, and quicker to read)
    refused = {
        "config.yaml": [(": : [", "config.yaml' line 1: not valid YAML"),
                        ("- 1\n", "config.yaml': expected a mapping of keys at the top level"),
                        (deep, "config.yaml': refused, it nests deeper than 100 levels")],
        "metrics.jsonl": [('{"round": 3, "wall_time": Infinity, "train_loss": [1]}\n',
                           "its config or metrics hold a value fedweave does not write")],
    }
    for name, cases in refused.items():
        for k, (text, why) in enumerate(cases):
            run = tmp_path / f"{name}-{k}"
            shutil.copytree(good, run)
            with (run / name).open("w" if name == "config.yaml" else "a") as f:
                f.write(text)
            for command in ("status", "report") if k == 0 else ("status",):  # (both read through load_run)
                assert main([command, str(run)]) == 2, (command, name, k)
                assert why in one_line_error(capsys), (command, name, k)
    run = tmp_path / "left-out"
    shutil.copytree(good, run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(deep + '\n{"round": "x", "wall_time": "b"}\n')
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "line 3 is not JSON; left out" in out and "line 4 has no round or step number; left out" in out
