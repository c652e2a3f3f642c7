"""Mutation testing of the privacy and secure-aggregation plugins (issue 14), with mutmut.

mutmut (3.8.1, the ``mutation`` extra) changes one thing at a time in
``src/fedweave/plugins/privacy/`` and ``src/fedweave/plugins/secure/secagg/`` (an operator,
a constant, a removed call, ...) and runs the plugin tests that reach the changed function;
a mutant the tests do not notice *survived*. The score is killed / (killed + survived),
timeouts counting as killed as mutmut counts them; mutants left unchecked when the time
limit ends the run are reported, not scored.

The run happens in a copy of ``src/`` and ``tests/`` (``--workdir``, a temporary folder by
default), with its own ``pyproject.toml`` holding mutmut's settings, so the repository is
left as it was. Run again with the same ``--workdir`` to go on where a time-limited run
stopped (mutmut keeps its results there), and ``cd WORKDIR && mutmut show NAME`` shows a
mutant's diff.

    python benchmarks/mutation.py [--workdir DIR] [--time-limit 3600] [--max-children 1]
                                  [--only 'fedweave.plugins.privacy.dp.*' ...] [--diffs]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTATED = ["src/fedweave/plugins/privacy/*", "src/fedweave/plugins/secure/secagg/*"]
TESTS = [  # the plugin tests, without SecAgg's runs across processes (gRPC nodes, gloo sites)
    "tests/plugins/test_privacy.py", "tests/plugins/secure", "tests/plugins/test_compose.py",
    "--ignore=tests/plugins/secure/secagg/test_plugin_grpc.py", "--ignore=tests/plugins/secure/secagg/test_plugin_sites.py",
]
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          37: "caught by type check", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", None: "not checked"}


def quoted(items: list[str]) -> str:
    """A TOML array of strings."""
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def settings() -> str:
    """mutmut's settings, in the copy's own pyproject.toml."""
    return (
        "[tool.mutmut]\n"
        'source_paths = ["src"]\n'
        f"only_mutate = {quoted(MUTATED)}\n"
        f"pytest_add_cli_args_test_selection = {quoted(TESTS)}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-x", "-q"]\n'
        "\n[tool.pytest.ini_options]\n"
        'testpaths = ["tests"]\n'
    )


def prepare(workdir: Path) -> None:
    """A copy of the sources and tests with mutmut's settings (kept if it is already there)."""
    if (workdir / "pyproject.toml").exists():
        return
    workdir.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "src", workdir / "src", ignore=ignore)
    shutil.copytree(ROOT / "tests", workdir / "tests", ignore=ignore)
    (workdir / "pyproject.toml").write_text(settings())


def statuses(workdir: Path) -> dict[str, str]:
    """Every mutant mutmut generated, by name, with its status (from mutmut's result files)."""
    out: dict[str, str] = {}
    for meta in sorted((workdir / "mutants").rglob("*.meta")):
        data = json.loads(meta.read_text())
        for name, code in data.get("exit_code_by_key", {}).items():
            out[name] = STATUS.get(code, "suspicious")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, help="where to copy the sources and keep results (default: a fresh temporary folder)")
    parser.add_argument("--time-limit", type=float, default=3600.0, help="seconds before the run is stopped (results so far are kept)")
    parser.add_argument("--max-children", type=int, default=1, help="parallel mutant runs (one core each)")
    parser.add_argument("--only", nargs="*", default=[], help="mutant names or globs, e.g. 'fedweave.plugins.privacy.dp.*'")
    parser.add_argument("--diffs", action="store_true", help="print each surviving mutant's diff")
    args = parser.parse_args()
    if importlib.util.find_spec("mutmut") is None:
        print("benchmarks/mutation.py needs mutmut: pip install 'fedweave[mutation]'")
        return 1
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fedweave-mutation-"))
    prepare(workdir)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # mutmut puts mutants/src first itself
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children), *args.only]
    print(f"mutmut in {workdir}: {' '.join(command[1:])} (stops after {args.time_limit:g} s)", flush=True)
    try:
        subprocess.run(command, cwd=workdir, env=env, timeout=args.time_limit, stdout=subprocess.DEVNULL, check=False)
        stopped = False
    except subprocess.TimeoutExpired:
        stopped = True
    found = statuses(workdir)
    counts = Counter(found.values())
    scored = counts["killed"] + counts["timeout"] + counts["survived"]
    print(f"mutants: {len(found)}  " + "  ".join(f"{status}: {n}" for status, n in sorted(counts.items())))
    if stopped:
        print(f"the time limit ended the run: {counts['not checked']} mutants not checked (run again with --workdir {workdir})")
    if scored:
        print(f"mutation score: {(counts['killed'] + counts['timeout']) / scored:.1%} ({counts['killed'] + counts['timeout']} of {scored} checked mutants killed)")
    survivors = sorted(name for name, status in found.items() if status in ("survived", "suspicious", "no tests"))
    for name in survivors:
        print(f"{found[name]}: {name}")
        if args.diffs:
            diff = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=workdir, env=env, capture_output=True, text=True)
            print(diff.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
