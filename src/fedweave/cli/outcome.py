"""What a failed command prints and the exit status it ends with."""

from __future__ import annotations

import sys

from fedweave.errors import ConfigError, FedweaveError, TaskError


def report(exc: BaseException) -> int | None:
    """Print the one line of a user's mistake and return the exit status: 2 for a config or task
    error, 1 for another fedweave error or a file that cannot be made or read (an unwritable
    output_dir, --run-dir or --out); None for anything else (a bug: its traceback is wanted)."""
    if isinstance(exc, (ConfigError, TaskError)):
        print(f"fedweave: error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, FedweaveError):
        print(f"fedweave: error: {exc}", file=sys.stderr)
        return 1
    if isinstance(exc, OSError) and exc.filename is not None:
        print(f"fedweave: error: cannot use {str(exc.filename)!r}: {exc.strerror}", file=sys.stderr)
        return 1
    return None


def exit_code(exc: BaseException) -> int:
    """The exit status of a launched node that raised ``exc`` (reported as ``main`` would)."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    code = report(exc)
    if code is not None:
        return code
    import traceback

    traceback.print_exception(exc)
    return 1
