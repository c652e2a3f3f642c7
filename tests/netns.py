"""Network namespaces for tests: each "host" a namespace of its own with its own address,
joined by a bridge, as machines on one network (needs root and iproute2's ``ip``)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path


class NetworkNamespaces:
    """The network namespaces this object made (named ``<tag>-...``); :meth:`close` removes them."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.made: list[str] = []

    def ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
        if done.returncode != 0:
            raise OSError(f"`ip {' '.join(args)}`: {done.stderr.strip()}")

    def add_namespace(self, name: str) -> None:
        self.ip("netns", "add", name)
        self.made.append(name)
        self.ip("-n", name, "link", "set", "lo", "up")

    def close(self) -> None:
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10, check=False)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        try:
            if not any(Path("/run/netns").glob("*")):  # another process's namespaces may be about to write there
                Path("/etc/netns").rmdir()  # only when no other namespace keeps files there
        except OSError:
            pass


def unavailable() -> str | None:
    """Why this machine cannot make network namespaces (None: it can)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "network namespaces need root and iproute2's ip"
    trial = NetworkNamespaces(f"fwt{os.getpid() % 100000}")
    try:
        trial.add_namespace(f"{trial.tag}-check")
    except OSError as exc:
        return f"network namespaces are not permitted here: {exc}"
    finally:
        trial.close()
    return None


class Hosts(NetworkNamespaces):
    """``count`` hosts, host i at ``<subnet>.<10 + i>`` on device ``<tag>h<i>``, their veths on
    one bridge in a namespace of its own."""

    def __init__(self, count: int, subnet: str = "10.214.0") -> None:
        super().__init__(f"fwh{os.getpid() % 100000}")
        self.count = count
        self.subnet = subnet
        bridge = f"{self.tag}-bridge"
        try:
            self.add_namespace(bridge)
            self.ip("-n", bridge, "link", "add", "br0", "type", "bridge")
            self.ip("-n", bridge, "link", "set", "br0", "up")
            for i in range(count):
                self.add_namespace(self.namespace(i))
                self.ip("link", "add", self.device(i), "type", "veth", "peer", "name", f"{self.tag}b{i}")
                self.ip("link", "set", self.device(i), "netns", self.namespace(i))
                self.ip("link", "set", f"{self.tag}b{i}", "netns", bridge)
                self.ip("-n", bridge, "link", "set", f"{self.tag}b{i}", "master", "br0", "up")
                self.ip("-n", self.namespace(i), "addr", "add", f"{self.address(i)}/24", "dev", self.device(i))
                self.ip("-n", self.namespace(i), "link", "set", self.device(i), "up")
        except BaseException:
            self.close()
            raise

    def namespace(self, i: int) -> str:
        return f"{self.tag}-{i}"

    def device(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def lie_about_hostname(self) -> None:
        """Make this machine's hostname resolve to 127.0.0.1 on every host (``ip netns exec`` mounts
        ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``), as on many a machine off DNS."""
        for i in range(self.count):
            folder = Path("/etc/netns") / self.namespace(i)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost {socket.gethostname()}\n")

    def exec(self, i: int) -> list[str]:
        """The command prefix that runs a command on host ``i``."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def torchrun(self, i: int, nnodes: str, rdzv_conf: str, port: int = 29400) -> tuple[list[str], dict[str, str]]:
        """Host ``i``'s torchrun agent (one worker; the c10d rendezvous on host 0, which hosts
        its store): the command up to the module or script to run, and the environment."""
        command = [
            *self.exec(i), sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={nnodes}", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.address(0)}:{port}", "--rdzv-id=job", "--max-restarts=3",
            f"--rdzv-conf={rdzv_conf},is_host={str(i == 0).lower()}", f"--local-addr={self.address(i)}",
            "--monitor-interval=0.1",
        ]
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": self.device(i),
            "OMP_NUM_THREADS": "1",
            "LOGLEVEL": "INFO",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # else a host that joins a running job waits forever (torch 2.13)
        }
        return command, env

    def kill(self, i: int) -> None:
        """SIGKILL every process of host ``i`` at once, as a machine that dies."""
        done = subprocess.run(["ip", "netns", "pids", self.namespace(i)], capture_output=True, text=True, timeout=10)
        for pid in done.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for i in range(self.count):
            if self.namespace(i) in self.made:
                self.kill(i)
        super().close()
