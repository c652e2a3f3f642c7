"""Shared fixtures: small, fast runs of the real spine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from fedweave import config as config_mod
from fedweave import runner
from fedweave.data_parallel.sampler import GlobalSampler
from fedweave.federation.ports import free_port as first_free_port
from fedweave.seeding import derive_seed
from fedweave.task import build_model, evaluate, load_dataset, make_loss
from fedweave.training import LocalOptimizer, LocalSettings
from fedweave.types import Params

SMALL = [
    "rounds=3",
    "clients=4",
    "task.dataset=synthetic",
    "task.dataset_options={samples: 400, features: 8, classes: 4}",
    "task.model_options={hidden: [16]}",
    "task.partition.scheme=iid",
    "local.batch_size=16",
    "eval.federated_every=0",
    "checkpoint.min_interval=0",  # a checkpoint every round: tests stop runs after any round and resume
    # one client after another: many tests compare two runs bit for bit (MOON with mu 0 against FedAvg),
    # and a vectorised cohort rounds differently from the sequential loop (tests/cohort checks by how little)
    "simulation.cohort=off",
]
"""Overrides that make the quickstart a sub-second run for tests."""


WORKERS = 2
"""pytest-xdist workers a run of the suite or of a folder uses unless told (``-n N``; ``-n 0`` or
``-p no:xdist``: one process). Most of the suite's time is subprocesses starting (importing torch)
and waiting on them, which two workers overlap on two cores."""


def _only_files(config: pytest.Config) -> bool:
    """Whether the command line named test files (or tests in them) only, no folder: a run too small
    to repay starting workers (each imports torch and collects again, some seconds)."""
    if config.args_source != pytest.Config.ArgsSource.ARGS or not config.args:
        return False
    return all((config.invocation_params.dir / arg.split("::")[0]).is_file() for arg in config.args)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """``-n 2 --dist loadgroup`` for the suite or a folder, one process for named files, unless the
    command line chose (a hook, not ``addopts``: with ``-p no:xdist`` an ``-n`` in addopts would be
    an unknown option)."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return  # no xdist, or this is one of its workers (which must not start workers of its own)
    chosen = config.option.numprocesses is not None or config.option.tx or config.getoption("usepdb", False)
    if not chosen and not _only_files(config):
        config.option.numprocesses = WORKERS
    if config.option.numprocesses and config.option.dist == "no":
        config.option.dist = "loadgroup"  # (also for a bare -n N): tests sharing a module's fixture stay together


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Tell each worker the distribution mode: a worker parses the command line again, where a
    mode :func:`pytest_cmdline_main` chose is not written, and it marks the groups only under loadgroup."""
    node.workerinput["fedweave_dist"] = node.config.option.dist


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup``, a test that uses a module-, class- or package-scoped fixture (a
    Ray or Slurm cluster, a federation's server, a trained model) runs on the same worker as the
    other tests of its file: else each worker would build the fixture again, and two such clusters
    would run at once. Every other test is scheduled on its own. (Before xdist's own hook, which
    reads the marks.)"""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or workerinput.get("fedweave_dist") != "loadgroup":
        return  # one process, or another mode: no groups
    config.option.loadgroup = True
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        shared = any(
            d.scope in ("module", "class", "package") for name in info.names_closure for d in info.name2fixturedefs.get(name, ())
        )
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.path.relative_to(config.rootpath).as_posix()))


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    """Two torch threads on two shared cores spin against each other; tests use one."""
    torch.set_num_threads(1)


@pytest.fixture
def umask_022() -> Iterator[None]:
    """A umask of 022 for the test: files others may read unless written private."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def load_script(path: Path) -> Any:
    """The module of a script that is not on the import path (a benchmark, an example's set-up, CI's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_config(*overrides: str, output: Path | None = None) -> config_mod.Config:
    extra = [f"output_dir={output}"] if output is not None else []
    return config_mod.load(None, [*SMALL, *extra, *overrides])


def run_to_end(run_dir: Path, *overrides: str) -> tuple[Params, list[dict[str, Any]]]:
    """Run a small config uninterrupted; the final global params and the metric records."""
    r = runner.prepare(small_config(*overrides), run_dir)
    records = runner.execute(r)
    return r.params, records


def run_interrupted(run_dir: Path, stop_after: int, *overrides: str) -> tuple[Params, list[dict[str, Any]]]:
    """Stop a small run after round ``stop_after`` (as Ctrl-C would), resume it, run to the end."""
    r = runner.prepare(small_config(*overrides), run_dir)

    def interrupt(record: dict[str, Any]) -> None:
        if record["round"] == stop_after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.execute(r, interrupt)
    resumed = runner.resume(run_dir)
    assert resumed.first_round == stop_after + 1
    records = runner.execute(resumed)
    return resumed.params, records


def assert_same_params(a: Params, b: Params, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0.0, atol=atol, msg=lambda m: f"{k}: {m}")


def comparable(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records without the measured times (wall time, round time, elapsed, each client's compute and
    idle time), for exact comparison."""
    return [
        {
            k: [{f: x for f, x in c.items() if f not in ("compute", "idle")} for c in v] if k == "clients" and v else v
            for k, v in r.items()
            if k not in ("wall_time", "round_time", "elapsed")
        }
        for r in records
    ]


def reference(config: config_mod.Config) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One process taking the same global batches: the params and test metrics a correct run reaches."""
    dp = config.data_parallel
    ds = load_dataset(config.task.dataset, seed=config.seed, test_fraction=config.task.test_fraction,
                      options=config.task.dataset_options)
    torch.manual_seed(derive_seed(config.seed, "init"))
    model = build_model(config.task.model, input_shape=ds.input_shape, num_classes=ds.num_classes,
                        options=config.task.model_options)
    opt = LocalOptimizer(model.parameters(), LocalSettings(dp.optimizer, dp.lr, dp.momentum, dp.weight_decay))
    loss_fn = make_loss(config.task.loss)
    sampler = GlobalSampler(len(ds.y_train), config.seed)
    while sampler.epoch < dp.epochs:
        total = sampler.step_size(dp.global_batch)
        idx = torch.from_numpy(sampler.take([total])[0])
        opt.zero_grad()
        loss_fn(model(ds.x_train[idx]), ds.y_train[idx]).backward()
        opt.step()
        sampler.advance(total)
    return model.state_dict(), evaluate(model, ds.x_test, ds.y_test, loss_fn)


def poll(check: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Call ``check`` every ``interval`` seconds until it holds, for at most ``timeout`` seconds
    (and ``timeout / interval`` + 1 calls); whether it held."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / interval) + 1):
        if check():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return bool(check())


class LargestTensor(TorchDispatchMode):
    """While active (``with LargestTensor() as built:``), ``built.entries`` is the number of entries
    of the largest tensor any torch operation of this thread returned: a check that a refusal
    came before anything was built which no host load can break, unlike a wall-clock bound."""

    def __init__(self) -> None:
        super().__init__()
        self.entries = 0

    def __enter__(self) -> LargestTensor:
        super().__enter__()
        torch.empty(0)  # the first operation through a mode loads what dispatch needs: before any measure
        return self

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.entries = max(self.entries, leaf.numel())
        return out


LOWEST_PORT = 20000
"""Test servers' ports lie from here up to the kernel's ephemeral range (above Ray's worker ports)."""
_handed_out: set[int] = set()


def _port_range() -> range:
    """This process's ports: those below the kernel's ephemeral range (no outgoing connection
    takes one of them between the choice and the server's bind; a machine whose ephemeral range
    starts below 21000 gets 20000-20999 anyway), cut into one part per xdist worker (two workers
    never hand out the same port; a worker started in a crashed one's place, named past the count,
    takes the part of its number modulo the count)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    low = max(low, LOWEST_PORT + 1000)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % workers
    width = max(1, (low - LOWEST_PORT) // workers)
    return range(LOWEST_PORT + worker * width, LOWEST_PORT + (worker + 1) * width)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and that this process has not handed out
    before (``free_port(), free_port()`` are two ports), from this process's part of the ports
    (:func:`_port_range`), starting at a place of its own (another copy of the suite may run)."""
    ports = _port_range()
    split = ports.start + os.getpid() % len(ports)
    for part in (range(split, ports.stop), range(ports.start, split)):
        port = first_free_port(part, "127.0.0.1", _handed_out)
        if port is not None:
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 in {ports.start}..{ports.stop - 1}")


SITE_MEMBER = textwrap.dedent(
    """
    import os
    import sys
    import torch
    from fedweave import config
    from fedweave.nodes.site import run_members
    from fedweave.transports.torchdist import Rendezvous

    torch.set_num_threads(1)
    rank, size, port, *paths = sys.argv[1:]
    run_members([config.load(p) for p in paths], Rendezvous("127.0.0.1", int(port), int(rank), int(size)))
    os._exit(0)  # skip torch's slow interpreter teardown
    """
)


@contextmanager
def site_members(paths: Sequence[str | Path], size: int, port: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Ranks 1..size-1 of a torch.distributed world serving the runs of the config files
    ``paths`` as site members (this process is rank 0). They must exit cleanly within 30 s
    of the block's end; they are killed whatever happens."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", SITE_MEMBER, str(rank), str(size), str(port), *map(str, paths)], env=env)
        for rank in range(1, size)
    ]
    try:
        yield procs
        for p in procs:
            assert p.wait(timeout=30) == 0
    finally:
        for p in procs:
            p.kill()
