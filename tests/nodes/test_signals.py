"""How a node process ends with the process that started it (fedweave.nodes.signals)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import poll
from fedweave.nodes.signals import KILLED_WITH_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

NODE = "from fedweave.nodes.signals import install_signal_handlers; install_signal_handlers(); print('up', flush=True)"


def gone(pid: int) -> bool:
    """Whether ``pid`` ended (a zombie that no one reaped counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def test_a_node_whose_service_is_already_gone_kills_itself_at_once() -> None:
    proc = subprocess.run([sys.executable, "-c", NODE], env=env(**{KILLED_WITH_ENV: "1"}), capture_output=True,
                          timeout=60)  # pid 1 is not its parent: the service it names is gone
    assert proc.returncode == -signal.SIGKILL and b"up" not in proc.stdout


def test_a_node_is_killed_when_its_service_is_killed_and_its_own_children_do_not_inherit_the_request(
    tmp_path: Path,
) -> None:
    pids = tmp_path / "pids"
    node = f"""{NODE}
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import os, time; print(os.environ.get({KILLED_WITH_ENV!r}), flush=True); time.sleep(600)"],
                         stdout=open({str(tmp_path / 'child.out')!r}, "w"))
open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
time.sleep(600)
"""
    service = f"""import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {node!r}], env={{**os.environ, {KILLED_WITH_ENV!r}: str(os.getpid())}})
time.sleep(600)
"""
    parent = subprocess.Popen([sys.executable, "-c", service], env=env())
    started: list[int] = []
    try:
        out = tmp_path / "child.out"
        assert poll(lambda: pids.is_file() and " " in pids.read_text() and out.read_text().endswith("\n"), 60)
        started[:] = map(int, pids.read_text().split())
        node_pid, child_pid = started
        assert not gone(node_pid)
        parent.kill()  # as kill -9 of the federation service
        parent.wait(10)
        assert poll(lambda: gone(node_pid), 30)
        assert not gone(child_pid)  # a process the node started is not the service's job server
        assert out.read_text().strip() == "None"
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in started:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
