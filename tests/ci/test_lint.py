"""The lint baseline of CI (.ci/lint.py): findings parsed without line numbers, the baseline only shrinks."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from conftest import load_script

_PATH = Path(__file__).resolve().parents[2] / ".ci" / "lint.py"


@pytest.fixture(scope="module")
def lint():  # type: ignore[no-untyped-def]
    return load_script(_PATH)


def test_mypy_and_ruff_lines_become_findings_without_their_line_numbers(lint) -> None:  # type: ignore[no-untyped-def]
    mypy = (
        'src/fedweave/a.py:12: error: Name "x" is not defined  [name-defined]\n'
        'src/fedweave/a.py:40: error: Name "x" is not defined  [name-defined]\n'
        "src/fedweave/b.py:3: note: See https://mypy.readthedocs.io\n"
        "Found 2 errors in 1 file (checked 2 source files)\n"
    )
    ruff = "src/fedweave/c.py:7:1: UP035 [*] Import from `collections.abc` instead: `Callable`\nFound 1 error.\n"
    assert lint.parse("mypy", mypy) == Counter({'mypy src/fedweave/a.py name-defined Name "x" is not defined': 2})
    assert lint.parse("ruff", ruff) == Counter(
        {"ruff src/fedweave/c.py UP035 Import from `collections.abc` instead: `Callable`": 1}
    )


def test_a_new_finding_and_a_fixed_one_each_fail_a_moved_one_does_not(lint) -> None:  # type: ignore[no-untyped-def]
    baseline = Counter({"mypy f.py arg-type A": 2, "ruff f.py B904 B": 1})
    assert lint.compare(baseline, Counter({"mypy f.py arg-type A": 2, "ruff f.py B904 B": 1})) == ([], [])
    new, gone = lint.compare(baseline, Counter({"mypy f.py arg-type A": 3, "ruff f.py B904 B": 1}))
    assert (new, gone) == (["mypy f.py arg-type A"], [])
    new, gone = lint.compare(baseline, Counter({"mypy f.py arg-type A": 1}))
    assert (new, gone) == ([], ["mypy f.py arg-type A", "ruff f.py B904 B"])


def test_the_baseline_round_trips_through_its_file(lint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    findings = Counter({"mypy f.py arg-type A": 2, "ruff g.py F401 unused": 1})
    path = tmp_path / "baseline.txt"
    lint.write_baseline(path, findings)
    assert lint.read_baseline(path) == findings
    assert path.read_text().startswith("# ")
