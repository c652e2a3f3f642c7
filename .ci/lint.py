#!/usr/bin/env python3
"""The type checker (mypy) and the linter (ruff) over src/, held to a committed baseline.

``.ci/lint-baseline.txt`` lists the findings the code has today, one per line as
``tool file code message`` (no line numbers: they move with every edit). CI fails on a finding
that is not in the baseline (new code must type-check and lint clean) and on a baseline entry
that no longer occurs (a fix must shrink the baseline in the same commit): the baseline may only
shrink. ``.ci/lint.py --update`` rewrites it from the current findings; do that only to record
fixes, never to accept a new finding.

Settings of both tools live in pyproject.toml ([tool.mypy], [tool.ruff]).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / ".ci" / "lint-baseline.txt"
TARGET = "src/fedweave"

# "src/x.py:12: error: Message  [code]" (mypy); "src/x.py:12:5: B904 Message" (ruff concise).
_MYPY = re.compile(r"^(?P<file>[^:]+\.py):\d+(?::\d+)?: error: (?P<message>.*?)\s+\[(?P<code>[a-z-]+)\]$")
_RUFF = re.compile(r"^(?P<file>[^:]+\.py):\d+:\d+: (?P<code>[A-Z]+[0-9]+) (?P<message>.*)$")


def parse(tool: str, output: str) -> Counter[str]:
    """The findings in a tool's output as ``tool file code message`` lines, counted."""
    pattern = _MYPY if tool == "mypy" else _RUFF
    found: Counter[str] = Counter()
    for line in output.splitlines():
        match = pattern.match(line.strip())
        if match:
            message = " ".join(match["message"].removeprefix("[*] ").split())
            found[f"{tool} {match['file']} {match['code']} {message}"] += 1
    return found


def compare(baseline: Counter[str], current: Counter[str]) -> tuple[list[str], list[str]]:
    """(new findings, baseline entries that are gone), each line once per surplus occurrence."""
    new = sorted((current - baseline).elements())
    gone = sorted((baseline - current).elements())
    return new, gone


def read_baseline(path: Path) -> Counter[str]:
    if not path.exists():
        return Counter()
    return Counter(line for line in path.read_text().splitlines() if line and not line.startswith("#"))


def write_baseline(path: Path, findings: Counter[str]) -> None:
    head = "# mypy and ruff findings in src/ that CI tolerates; it may only shrink (.ci/lint.py --update)\n"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(head + "".join(f"{line}\n" for line in sorted(findings.elements())))
    tmp.replace(path)


def run_tools() -> Counter[str]:
    python = sys.executable
    runs = {
        "mypy": [python, "-m", "mypy", TARGET],
        "ruff": [python, "-m", "ruff", "check", "--output-format", "concise", TARGET],
    }
    found: Counter[str] = Counter()
    for tool, command in runs.items():
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode not in (0, 1):
            raise SystemExit(f"{tool} failed to run (rc {done.returncode}): {done.stderr.strip()[:500]}")
        found += parse(tool, done.stdout)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="rewrite the baseline from today's findings")
    args = parser.parse_args(argv)
    current = run_tools()
    if args.update:
        write_baseline(BASELINE, current)
        print(f"baseline: {sum(current.values())} findings written to {BASELINE.relative_to(ROOT)}")
        return 0
    new, gone = compare(read_baseline(BASELINE), current)
    for line in new:
        print(f"new finding: {line}")
    for line in gone:
        print(f"fixed, remove from the baseline (.ci/lint.py --update): {line}")
    print(f"lint: {sum(current.values())} findings in the baseline's tolerance, {len(new)} new, {len(gone)} fixed")
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main())
