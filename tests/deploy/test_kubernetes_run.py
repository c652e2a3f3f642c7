"""The rendered federation, run: what the YAML says is what runs.

``fedweave deploy k8s`` renders a tiny config (2 clients, 2 rounds, digits), as a star and as two
hierarchical sites of one member each; ``kubectl kustomize`` builds the base; then every container
of every Deployment and Job starts as a local process with its own command and arguments (the
image's ENTRYPOINT, read from the Dockerfile, where the container names none), its own environment
with ``$(VAR)`` expanded as the kubelet does, and its mounted volumes written into a folder per pod:
ConfigMap and Secret files as the objects hold them, emptyDirs empty, a PersistentVolumeClaim as
one folder every pod of it shares. Paths under a mount are rewritten to the pod's folder.

The network: where this machine allows (root, iproute2), each pod runs in a network namespace of
its own on a bridge, and its /etc/hosts resolves each Service's names to the pod it selects, so
the manifests' own names and ports (50051, probe 8081, rendezvous 29500) run unchanged; the probe
comes from the bridge's side, as the kubelet's does. Elsewhere every pod shares the loopback: the
config picks free ports and each Service's name (and 0.0.0.0, a pod's own address) is rewritten to
127.0.0.1 in what a pod reads.

The data-parallel deployment (2 workers, synthetic data, 5 steps) runs the same way: each index of
its Indexed Job a pod of its own with ``JOB_COMPLETION_INDEX`` set, the image's ``torchrun`` as
this interpreter's ``torch.distributed.run``, pod 0's name under the headless Service resolving to
index 0; the job must end, its run directory on the shared claim holding the metrics and the model
one process trains on the same global batches.

The test asks the server's readiness probe (its ``grpc`` port) until it answers SERVING, and checks
every process ends with status 0, the server's run directory on its claim holds both rounds, and
they equal the same config run in memory.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import netns
import pytest
import yaml
from conftest import free_port
from data_parallel.test_torchrun import assert_matches_reference

from fedweave import config as config_mod
from fedweave import runner
from fedweave.deploy import kubernetes as k8s

from .conftest import ROOT, kustomize

CONFIG = """
name: k8s-run
seed: 0
rounds: 2
clients: 2
round_timeout: 60
task: {{dataset: digits, model: mlp, model_options: {{hidden: [16]}}, partition: iid}}
local: {{epochs: 1, batch_size: 64, lr: 0.1}}
strategy: fedavg
transport: grpc
grpc:{ports}
  heartbeat_interval: 0.2
  heartbeat_timeout: 5.0
  poll_timeout: 0.5
  join_timeout: 60
  connect_timeout: 60
  backoff_initial: 0.05
  backoff_max: 0.5
"""


def entrypoint() -> list[str]:
    """The image's ENTRYPOINT (the Dockerfile's last), with ``fedweave`` as this interpreter's module."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("ENTRYPOINT ")]
    command = json.loads(lines[-1].removeprefix("ENTRYPOINT "))
    assert command[0] == "fedweave"
    return [sys.executable, "-m", "fedweave", *command[1:]]


class Pod:
    """One pod of the manifests as a local process."""

    def __init__(
        self, obj: dict[str, Any], objects: list[dict[str, Any]], root: Path, claims: Path, index: int | None = None
    ):
        self.name = obj["metadata"]["name"]
        template = obj["spec"]["template"]
        self.labels: dict[str, str] = template["metadata"]["labels"]
        spec = template["spec"]
        self.env: dict[str, str] = {}  # what the kubelet adds (an Indexed Job's JOB_COMPLETION_INDEX)
        self.hostnames: list[str] = []  # the names of this pod under its subdomain's headless Service
        if index is not None:  # an Indexed Job's pod: hostname <job>-<index>
            self.name = f"{self.name}-{index}"
            self.env["JOB_COMPLETION_INDEX"] = str(index)
            if "subdomain" in spec:
                ns = obj["metadata"]["namespace"]
                fqdn = f"{self.name}.{spec['subdomain']}.{ns}.svc"
                self.hostnames = [f"{self.name}.{spec['subdomain']}", f"{self.name}.{spec['subdomain']}.{ns}", fqdn,
                                  f"{fqdn}.cluster.local"]
        (self.container,) = spec["containers"]
        self.dir = root / self.name
        self.mounts: dict[str, Path] = {}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        self.resolve: dict[str, str] = {}  # host names to rewrite (the loopback network's resolver)
        self.prefix: list[str] = []  # what runs the process in the pod's network (ip netns exec NS)
        for mount in self.container.get("volumeMounts", []):
            local = self.dir / "volumes" / mount["name"]
            self.mounts[mount["mountPath"]] = self._volume(volumes[mount["name"]], local, objects, claims)
        self.process: subprocess.Popen[bytes] | None = None

    def rewrite(self, text: str) -> str:
        """Paths under a mount to the pod's folder, and host names as ``resolve`` says."""
        paths = "|".join(re.escape(p) for p in sorted(self.mounts, key=len, reverse=True))
        text = re.sub(rf"(?<![\w/])({paths})(?![\w.-])", lambda m: str(self.mounts[m.group(1)]), text)  # one pass
        for name, address in self.resolve.items():  # a whole host name, not part of a path or a longer name
            text = re.sub(rf"(?<![\w./-]){re.escape(name)}(?![\w./-])", address, text)
        return text

    def _volume(self, volume: dict[str, Any], local: Path, objects: list[dict[str, Any]], claims: Path) -> Path:
        def named(kind: str, name: str) -> dict[str, Any]:
            (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
            return found

        if "persistentVolumeClaim" in volume:
            local = claims / named("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])["metadata"]["name"]
            local.mkdir(parents=True, exist_ok=True)
            return local
        local.mkdir(parents=True)
        if "configMap" in volume:
            for key, text in named("ConfigMap", volume["configMap"]["name"])["data"].items():
                (local / key).write_text(text)  # rewritten once every mount is known (start)
        elif "secret" in volume:
            secret = named("Secret", volume["secret"]["secretName"])
            for key, value in secret["data"].items():
                (local / key).write_bytes(base64.b64decode(value))
                (local / key).chmod(volume["secret"].get("defaultMode", 0o644) | 0o400)
        else:
            assert "emptyDir" in volume, volume
        return local

    def start(self) -> None:
        c = self.container
        for path, local in self.mounts.items():  # mounted config files name paths and hosts of the cluster
            for file in local.glob("*.yaml"):
                file.write_text(self.rewrite(file.read_text()))
        env = {**os.environ, **self.env}
        for item in c.get("env", []):
            env[item["name"]] = self.rewrite(item["value"])
        command = [self.rewrite(a) for a in c["command"]] if "command" in c else entrypoint()
        command = IMAGE_COMMANDS.get(command[0], command[:1]) + command[1:]
        args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], self.rewrite(a)) for a in c.get("args", [])]
        cwd = self.dir / "cwd"
        cwd.mkdir()
        self.log = (self.dir / "log").open("wb")
        self.process = subprocess.Popen(
            [*self.prefix, *command, *args], cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )

    def tail(self) -> str:
        self.log.flush()
        return (self.dir / "log").read_text(errors="replace")[-3000:]


IMAGE_COMMANDS = {"torchrun": [sys.executable, "-m", "torch.distributed.run"]}
"""The image's executables other than ``fedweave``, as this interpreter runs them."""


def pods(objects: list[dict[str, Any]], root: Path) -> list[Pod]:
    """A Pod per Deployment or Job, one per completion index of an Indexed Job (all at once)."""
    out = []
    for obj in objects:
        if obj["kind"] in ("Deployment", "Job"):
            spec = obj["spec"]
            if spec.get("completionMode") == "Indexed":
                assert spec["parallelism"] == spec["completions"], "every index at once"
                out.extend(Pod(obj, objects, root, root / "claims", i) for i in range(spec["completions"]))
                continue
            assert spec.get("replicas", 1) == 1 and spec.get("completions", 1) == 1, "one pod per object here"
            out.append(Pod(obj, objects, root, root / "claims"))
    return out


def service_target(service: dict[str, Any], running: list[Pod]) -> Pod:
    """The pod a Service's name resolves to: the one it selects (a headless Service of an Indexed Job: index 0)."""
    selector = service["spec"]["selector"].items()
    selected = [p for p in running if selector <= p.labels.items()]
    if len(selected) > 1 and service["spec"].get("clusterIP") == "None":
        selected = [p for p in selected if p.env.get("JOB_COMPLETION_INDEX") == "0"]
    (target,) = selected
    return target


PROBE = """
import sys, time
import grpc
from fedweave.transports.grpc.health import check
print("asking", flush=True)
deadline = time.monotonic() + float(sys.argv[2])
status = None
while status != "SERVING" and time.monotonic() < deadline:
    try:
        status = check(sys.argv[1], timeout=1.0)
    except grpc.RpcError:
        time.sleep(0.05)
print(status)
"""


def probing(command: list[str]) -> subprocess.Popen[str]:
    """The probe, asking from before the pods start until SERVING (a small federation may end within a second)."""
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def probe_status(probe: subprocess.Popen[str], seconds: float) -> str:
    try:
        out, err = probe.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        probe.kill()
        out, err = probe.communicate()
    return out.strip() or err[-500:]


class Loopback:
    """Every pod on this host's loopback: Service names and 0.0.0.0 (a pod's own address) become 127.0.0.1
    in what a pod reads; the ports are the manifests' (the config picks free ones)."""

    def attach(self, running: list[Pod], objects: list[dict[str, Any]]) -> None:
        for pod in running:
            pod.resolve = {o["metadata"]["name"]: "127.0.0.1" for o in objects if o["kind"] == "Service"}
            pod.resolve.update({name: "127.0.0.1" for p in running for name in p.hostnames})
            pod.resolve["0.0.0.0"] = "127.0.0.1"

    def probe(self, pod: Pod, port: int, seconds: float) -> subprocess.Popen[str]:
        return probing([sys.executable, "-c", PROBE, f"127.0.0.1:{port}", str(seconds)])

    def close(self) -> None:
        """Nothing to release."""


class Namespaces(netns.NetworkNamespaces):
    """Each pod in a network namespace of its own, its veth on one bridge in a "node" namespace (the
    kubelet's side, which probes), as a cluster network: a pod's /etc/hosts (``ip netns exec`` mounts
    /etc/netns/NS/hosts over it) resolves each Service's names to the address of the pod it selects,
    and this host's name to the pod's own address, as a pod's hostname resolves. Nothing is rewritten
    but paths: the manifests' own ports and names run unchanged."""

    SUBNET = "10.213.0"

    def __init__(self) -> None:
        super().__init__(f"fwk{os.getpid() % 100000}")
        self.node = f"{self.tag}-node"

    def attach(self, running: list[Pod], objects: list[dict[str, Any]]) -> None:
        self.add_namespace(self.node)
        self.ip("-n", self.node, "link", "add", "br0", "type", "bridge")
        self.ip("-n", self.node, "addr", "add", f"{self.SUBNET}.1/24", "dev", "br0")
        self.ip("-n", self.node, "link", "set", "br0", "up")
        self.address: dict[str, str] = {}
        for i, pod in enumerate(running):
            ns, pod_end, bridge_end = f"{self.tag}-{i}", f"{self.tag}p{i}", f"{self.tag}b{i}"
            self.add_namespace(ns)
            self.ip("link", "add", pod_end, "type", "veth", "peer", "name", bridge_end)
            self.ip("link", "set", pod_end, "netns", ns)
            self.ip("link", "set", bridge_end, "netns", self.node)
            self.ip("-n", self.node, "link", "set", bridge_end, "master", "br0", "up")
            self.ip("-n", ns, "addr", "add", f"{self.SUBNET}.{10 + i}/24", "dev", pod_end)
            self.ip("-n", ns, "link", "set", pod_end, "up")
            self.address[pod.name] = f"{self.SUBNET}.{10 + i}"
            pod.prefix = ["ip", "netns", "exec", ns]
        hosts = [f"{self.address[p.name]} {' '.join(p.hostnames)}" for p in running if p.hostnames]
        for service in (o for o in objects if o["kind"] == "Service"):
            target = service_target(service, running)
            meta = service["metadata"]
            svc = f"{meta['name']}.{meta['namespace']}.svc"
            hosts.append(f"{self.address[target.name]} {meta['name']} {meta['name']}.{meta['namespace']} {svc} {svc}.cluster.local")
        for i, pod in enumerate(running):
            folder = Path("/etc/netns") / f"{self.tag}-{i}"
            folder.mkdir(parents=True)
            own = f"{self.address[pod.name]} {socket.gethostname()}"
            (folder / "hosts").write_text("\n".join(["127.0.0.1 localhost", own, *hosts]) + "\n")

    def probe(self, pod: Pod, port: int, seconds: float) -> subprocess.Popen[str]:
        command = ["ip", "netns", "exec", self.node, sys.executable, "-c", PROBE, f"{self.address[pod.name]}:{port}"]
        return probing([*command, str(seconds)])



def run_pods(running: list[Pod], objects: list[dict[str, Any]], network: Loopback | Namespaces,
             ready: Callable[[], Callable[[], None]] | None = None, seconds: float = 150) -> None:
    """Start every pod (``ready`` just before: what it returns is called after) and check each ends with
    status 0 within ``seconds``."""
    try:
        network.attach(running, objects)
        check = ready() if ready is not None else (lambda: None)
        for pod in running:
            pod.start()
        deadline = time.monotonic() + seconds
        check()
        for pod in running:
            try:
                code = pod.process.wait(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{pod.name} did not finish:\n{pod.tail()}")
            assert code == 0, f"{pod.name} exited {code}:\n{pod.tail()}"
        for pod in running:  # those that listen on no port wrote the liveness file their probes read (issue 27)
            if "exec" in pod.container["livenessProbe"]:
                command = pod.container["livenessProbe"]["exec"]["command"]
                assert Path(pod.rewrite(command[command.index("--heartbeat") + 1])).is_file(), pod.name
    finally:
        for pod in running:
            if pod.process is not None and pod.process.poll() is None:
                pod.process.send_signal(signal.SIGTERM)
                try:
                    pod.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pod.process.kill()
                    pod.process.wait()
        network.close()


def run(tmp_path: Path, config: Path, names: list[str], network: Loopback | Namespaces) -> tuple[Pod, list[dict[str, Any]]]:
    """Render ``config``, start every pod of its base, wait for SERVING and for every pod to end;
    return the server's pod and the records of its run directory."""
    rendered = k8s.render(config, tmp_path / "manifests")
    objects = kustomize(rendered.out / "base")
    running = pods(objects, tmp_path / "pods")
    assert sorted(p.name for p in running) == sorted(names)
    (server,) = [p for p in running if p.name == f"{rendered.name}-server"]
    probe = server.container["readinessProbe"]["grpc"]["port"]
    assert server.container["livenessProbe"]["grpc"]["port"] == probe

    def serving() -> Callable[[], None]:
        asking = network.probe(server, probe, 120)
        assert asking.stdout is not None and asking.stdout.readline() == "asking\n"  # its imports done

        def answered() -> None:
            status = probe_status(asking, 150)
            assert status == "SERVING", f"{status}\n{server.tail()}"

        return answered

    run_pods(running, objects, network, serving)
    run_dir = Path(server.rewrite(k8s.RUN_DIR))
    assert run_dir.parent == tmp_path / "pods" / "claims" / f"{rendered.name}-run"  # the server wrote onto its claim
    return server, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_as_in_memory(records: list[dict[str, Any]], config: Path, tmp_path: Path, *overrides: str) -> None:
    """The deployment changed nothing of the training: the same metrics as the config run in memory."""
    memory = runner.run_config(config_mod.load(config, ["transport=inmemory", *overrides]), tmp_path / "memory")
    expected = [json.loads(line) for line in (memory.run_dir / "metrics.jsonl").read_text().splitlines()]
    for got, want in zip(records, expected, strict=True):
        assert got["clients_completed"] == want["clients_completed"] == 2
        for key in ("train_loss", "test_loss", "test_accuracy"):
            assert got[key] == pytest.approx(want[key], abs=1e-5), key


@pytest.fixture
def network() -> Loopback | Namespaces:
    """A network namespace per pod where this machine allows, else the loopback."""
    return Loopback() if netns.unavailable() else Namespaces()


def ports(network: Loopback | Namespaces) -> str:
    """The ports of the config: the defaults in namespaces of their own, free ones on the shared loopback."""
    if isinstance(network, Namespaces):
        return ""
    return f"\n  address: 127.0.0.1:{free_port()}\n  health_listen: 0.0.0.0:{free_port()}"


def test_the_rendered_federation_runs_as_local_processes(tmp_path: Path, network: Loopback | Namespaces) -> None:
    config = tmp_path / "k8s-run.yaml"
    config.write_text(CONFIG.format(ports=ports(network)))
    server, records = run(tmp_path, config, ["k8s-run-server", "k8s-run-client-0", "k8s-run-client-1"], network)
    if isinstance(network, Namespaces):  # the manifests' own ports
        assert server.container["readinessProbe"]["grpc"]["port"] == 8081
    assert [r["round"] for r in records] == [1, 2]
    assert_same_as_in_memory(records, config, tmp_path)
    log = (server.dir / "log").read_text()
    assert "(tls: mtls, tokens: True)" in log
    for i in range(2):  # each with its own certificate and token
        assert f"client {i} registered from" in log


def test_the_rendered_hierarchy_runs_as_local_processes(tmp_path: Path, network: Loopback | Namespaces) -> None:
    """Two sites of one member each: a leader pod per site speaks gRPC to the server and gloo to its member."""
    config = tmp_path / "k8s-run.yaml"
    rendezvous = 29500 if isinstance(network, Namespaces) else free_port()
    sites = f"topology: {{kind: hierarchical, sites: 2}}\ntorchdist: {{port: {rendezvous}, timeout: 60}}\n"
    config.write_text(CONFIG.format(ports=ports(network)) + sites)
    names = ["k8s-run-server"] + [f"k8s-run-site-{s}-{role}" for s in range(2) for role in ("leader", "member-1")]
    server, records = run(tmp_path, config, names, network)
    assert [r["round"] for r in records] == [1, 2]
    assert_same_as_in_memory(records, config, tmp_path, "topology.inner=inmemory")
    log = (server.dir / "log").read_text()
    for s in range(2):
        assert f"site {s} registered from" in log


DATA_PARALLEL = {
    "name": "k8s-dp",
    "seed": 0,
    "mode": "data_parallel",
    "task": {
        "dataset": "synthetic",
        "dataset_options": {"samples": 250, "features": 8, "classes": 4},
        "model": "data_parallel.models:mlp64",  # float64: the model of one process to 1e-6
        "model_options": {"hidden": [16]},
    },
    # 200 training samples, 47 a step: 4 steps of 47 and one of 12, split unequally between the two pods
    "data_parallel": {"workers": 2, "global_batch": 47, "epochs": 1, "lr": 0.1, "momentum": 0.9, "log_every": 1,
                      "timeout": 60},
}


def test_the_rendered_torchrun_job_runs_as_local_processes(
    tmp_path: Path, network: Loopback | Namespaces, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each index of the Indexed Job a host of its own (JOB_COMPLETION_INDEX set as the kubelet sets it),
    pod 0's name under the headless Service resolving to index 0; the job ends and its model is the one
    process's."""
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'src'}:{ROOT / 'tests'}")  # the image holds the test's model
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = tmp_path / "k8s-dp.yaml"
    config.write_text(yaml.safe_dump(DATA_PARALLEL))
    rendered = k8s.render(config, tmp_path / "manifests")
    objects = kustomize(rendered.out / "base")
    running = pods(objects, tmp_path / "pods")
    assert [p.name for p in running] == ["k8s-dp-workers-0", "k8s-dp-workers-1"]
    assert [p.env["JOB_COMPLETION_INDEX"] for p in running] == ["0", "1"]
    run_pods(running, objects, network)
    run_dir = Path(running[0].rewrite(k8s.RUN_DIR))
    assert run_dir == Path(running[1].rewrite(k8s.RUN_DIR))  # both pods mount the one claim
    assert run_dir.parent == tmp_path / "pods" / "claims" / "k8s-dp-run"
    written = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written] == [1, 2, 3, 4, 5]
    assert all(r["workers"] == [0, 1] for r in written)
    assert sum(r["samples"] for r in written) == 200
    assert_matches_reference(run_dir, config_mod.load(config))
