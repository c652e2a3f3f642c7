"""A one-machine Slurm cluster for tests: munged, slurmctld and slurmd as local daemons.

The cluster is Debian's ``slurm-wlm`` and ``munge`` packages (``apt-get install -y slurm-wlm
munge``) run by root. ``slurm.conf`` is generated into a temporary folder and named by
``SLURM_CONF`` (the daemons and every client command honour it), so the machine's own
``/etc/slurm`` is left alone; state, spool, logs and pid files live in that folder too. The
node is ``localhost`` (a name every machine resolves) and declares more CPUs than the
machine may have (``SlurmdParameters=config_overrides``), so a job can run a server and its
clients as tasks of their own. No accounting, ``proctrack/linuxproc`` and ``task/affinity``
(tasks bound to their step's CPUs, as on most clusters): nothing needs cgroups or a database.

munged answers on its default socket (``/run/munge``): one already running is used as it
is, else the key is created if missing and munged started as user ``munge`` for the
cluster's lifetime. Every wait is bounded in time and in count.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import free_port, poll

MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_RUN = Path("/run/munge")
PROGRAMS = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")
NODE_CPUS = 8
"""CPUs the node declares: a server and its clients, or two torchrun workers, each one task."""
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
)
SLURM_CONF = """\
ClusterName=fedweave-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def missing() -> str | None:
    """Why the daemons cannot start here, or None."""
    if os.geteuid() != 0:
        return "needs root to start munged, slurmctld and slurmd"
    absent = [p for p in PROGRAMS if shutil.which(p) is None]
    if absent:
        return f"needs Debian's slurm-wlm and munge packages (missing {', '.join(absent)})"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "needs the munge user (Debian's munge package)"
    return None


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll ``check`` until it holds, at most ``timeout`` seconds and ``timeout / interval`` times."""
    if not poll(check, timeout, interval):
        raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@dataclass
class SlurmCluster:
    """The running cluster: ``env`` points every Slurm command at it."""

    root: Path
    env: dict[str, str]
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def command(self, *args: str, timeout: float = 30) -> str:
        done = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def submit(self, script: Path, *args: str, options: tuple[str, ...] = (), env: dict[str, str] | None = None) -> str:
        """``sbatch`` a script with its arguments; its job id. ``env`` is added to the job's environment."""
        done = subprocess.run(
            ["sbatch", "--parsable", *options, str(script), *args],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {script.name} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """The job's fields as ``scontrol show job`` reports them (JobState, ExitCode, ...)."""
        text = self.command("scontrol", "show", "job", "--oneliner", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, timeout: float) -> dict[str, str]:
        """Wait for the job to end (polling, at most ``timeout`` s); its final fields. A job
        still going at the deadline is cancelled and reported as a timeout."""
        fields: dict[str, str] = {}

        def ended() -> bool:
            fields.update(self.job(job_id))
            return fields.get("JobState") in FINAL_STATES

        try:
            wait_until(ended, timeout, f"Slurm job {job_id}", interval=0.25)
        except TimeoutError:
            self.command("scancel", job_id)
            raise
        return fields

    def idle(self) -> bool:
        done = subprocess.run(["sinfo", "--noheader", "--format=%T"], env=self.env, capture_output=True, text=True, timeout=10)
        return done.returncode == 0 and done.stdout.split() == ["idle"]

    def cancel_all(self) -> None:
        """Cancel every job of the cluster and wait (bounded) until none is left."""
        subprocess.run(["scancel", "--partition=test"], env=self.env, capture_output=True, timeout=10)

        def empty() -> bool:
            done = subprocess.run(["squeue", "--noheader"], env=self.env, capture_output=True, text=True, timeout=10)
            return done.returncode != 0 or not done.stdout.strip()

        wait_until(empty, 20, "the cancelled jobs to end", interval=0.25)

    def logs(self) -> str:
        """The tail of the daemons' logs, for a failure message."""
        return "\n".join(
            f"--- {p.name}\n" + p.read_text(errors="replace")[-2000:]
            for p in sorted([*self.root.glob("*.log"), *self.root.glob("*.out")])
        )


def munge_answers() -> bool:
    return subprocess.run(["munge", "--no-input"], capture_output=True, timeout=10).returncode == 0


def start_munged(root: Path) -> subprocess.Popen[bytes] | None:
    """A munged for the cluster, or None when one already answers on the default socket."""
    if munge_answers():
        return None
    user = pwd.getpwnam("munge")
    if not MUNGE_KEY.exists():
        MUNGE_KEY.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(MUNGE_KEY.parent, user.pw_uid, user.pw_gid)
        fd = os.open(MUNGE_KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))  # a secret: the OS's secure source
        os.chown(MUNGE_KEY, user.pw_uid, user.pw_gid)
    MUNGE_RUN.mkdir(mode=0o755, exist_ok=True)
    os.chown(MUNGE_RUN, user.pw_uid, user.pw_gid)
    with (root / "munged.log").open("wb") as out:
        proc = subprocess.Popen(
            ["munged", "--foreground"], user="munge", group="munge", extra_groups=[],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: proc.poll() is None and munge_answers(), 10, "munged")
    except TimeoutError:
        stop(proc)
        raise
    return proc


def slurm_environment(conf: Path) -> dict[str, str]:
    """This process's environment naming the test cluster; no Slurm or launcher variables of
    an enclosing job leak into the cluster's jobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "FEDWEAVE_PARENT_PID"}
    return {**env, "SLURM_CONF": str(conf)}


LOCK = Path(tempfile.gettempdir()) / "fedweave-tests-slurm.lock"
"""Held while a test cluster runs: two copies of the suite at once share the one munged (a copy
that started it stops it at its end) and the node name, so their clusters take turns."""


@contextmanager
def one_cluster_at_a_time(timeout: float = 900.0) -> Iterator[None]:
    """This machine's test-cluster lock (``LOCK``), waited for at most ``timeout`` s."""
    with LOCK.open("a") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"another copy of the tests held {LOCK} for {timeout:g} s")
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running one-node cluster (idle, ``NODE_CPUS`` CPUs), torn down after the module; one
    on this machine at a time (:func:`one_cluster_at_a_time`)."""
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    with one_cluster_at_a_time():
        yield from _cluster(tmp_path_factory)


def _cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(root=root, ctld_port=free_port(), slurmd_port=free_port(), cpus=NODE_CPUS))
    cluster = SlurmCluster(root, slurm_environment(conf))
    munged = start_munged(root)
    if munged is not None:
        cluster.daemons.append(munged)
    try:
        for name, args in (("slurmctld", ["slurmctld", "-D"]), ("slurmd", ["slurmd", "-D", "-N", "localhost"])):
            with (root / f"{name}.out").open("wb") as out:
                cluster.daemons.append(
                    subprocess.Popen(args, env=cluster.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
                )
        try:
            wait_until(cluster.idle, 20, "the Slurm node to become idle", interval=0.2)
        except TimeoutError as exc:
            pytest.fail(f"{exc}\n{cluster.logs()}")
        yield cluster
    finally:
        try:
            cluster.cancel_all()
        finally:
            for proc in reversed(cluster.daemons):
                stop(proc)
