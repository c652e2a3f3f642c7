"""A host's torchrun agent (``fedweave worker --rdzv-endpoint``): the address, the interface and the
store host it picks; tests/data_parallel/test_torchrun.py runs it on hosts whose hostname lies."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import netns
import pytest

from fedweave.deploy import torchrun as agent

ON_A_HOST = textwrap.dedent(
    """
    import json
    import sys
    from fedweave.deploy import torchrun as agent

    elsewhere = sys.argv[1]
    local, _ = agent.route(elsewhere, 9)
    host = agent.agent_command(agent.Agent(f"{local}:29400", "2"), ["c.yaml", "--run-dir", "r"], {})
    join = agent.agent_command(agent.Agent(f"{elsewhere}:29400", "1:3", rdzv_conf="join_timeout=60"), ["c"], {})
    print(json.dumps({"local": local, "interface": agent.interface_of(local), "host": host, "join": join}))
    """
)


@pytest.fixture(scope="module")
def on_a_host() -> Iterator[dict[str, Any]]:
    """What the agent picks on a host of its own (a network namespace at 10.214.0.10 on a bridge)
    for an endpoint on itself and for one at 10.214.0.11, another host of that network (routed,
    never reached: a UDP socket's connect sends nothing), and that host's own device name."""
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    hosts = netns.Hosts(1)
    try:
        done = subprocess.run([*hosts.exec(0), sys.executable, "-c", ON_A_HOST, hosts.address(1)],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        yield {**json.loads(done.stdout), "address": hosts.address(0), "device": hosts.device(0),
               "elsewhere": hosts.address(1)}
    finally:
        hosts.close()


def test_the_host_the_endpoint_names_hosts_the_store_on_the_interface_that_reaches_it(on_a_host: dict[str, Any]) -> None:
    local = on_a_host["local"]
    assert local == on_a_host["address"] and on_a_host["interface"] == on_a_host["device"]
    command, env = on_a_host["host"]
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert command[-5:] == ["-m", "fedweave.data_parallel", "c.yaml", "--run-dir", "r"]
    assert {f"--local-addr={local}", "--rdzv-conf=is_host=true", "--nnodes=2", f"--rdzv-endpoint={local}:29400"} <= set(command)
    assert env["GLOO_SOCKET_IFNAME"] == on_a_host["device"]
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a host joining a running elastic job finds its store


def test_another_host_joins_as_a_client_of_the_store(on_a_host: dict[str, Any]) -> None:
    command, _ = on_a_host["join"]
    assert f"--local-addr={on_a_host['address']}" in command and "--rdzv-conf=join_timeout=60,is_host=false" in command
    assert f"--rdzv-endpoint={on_a_host['elsewhere']}:29400" in command


def test_a_loopback_endpoint_is_left_to_torchrun_and_the_users_choices_stay() -> None:
    command, env = agent.agent_command(agent.Agent("127.0.0.1:29400", rdzv_conf="is_host=true"), ["c.yaml"],
                                       {"GLOO_SOCKET_IFNAME": "eth7", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert "--local-addr=127.0.0.1" in command and "--rdzv-conf=is_host=true" in command
    assert (env["GLOO_SOCKET_IFNAME"], env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]) == ("eth7", "0")
    command, env = agent.agent_command(agent.Agent("localhost:29400"), ["c.yaml"], {})
    assert not any(c.startswith("--rdzv-conf") for c in command) and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert agent.interface_of("127.0.0.1") == "lo" and agent.interface_of("203.0.113.77") is None


@pytest.mark.parametrize("endpoint, message", [
    ("nowhere", "'nowhere' is not HOST:PORT"),
    ("host:http", "is not HOST:PORT"),
    ("no-such-host.invalid:1", "cannot resolve 'no-such-host.invalid'"),
])
def test_a_bad_endpoint_is_one_line(endpoint: str, message: str) -> None:
    with pytest.raises(agent.AgentError, match=message) as err:
        agent.agent_command(agent.Agent(endpoint), [], {})
    assert "\n" not in str(err.value)
