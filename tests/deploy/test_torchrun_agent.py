"""A host's torchrun agent (``fedweave worker --rdzv-endpoint``): the address, the interface and the
store host it picks; tests/data_parallel/test_torchrun.py runs it on hosts whose hostname lies."""

from __future__ import annotations

import pytest

from fedweave.deploy import torchrun as agent

ELSEWHERE = "198.51.100.7"  # a documentation address: routed (by the default route), never reached


def own_address() -> str:
    try:
        local, _ = agent.route(ELSEWHERE, 9)
    except agent.AgentError:
        pytest.skip("this machine has no route off itself")
    return local


def test_the_host_the_endpoint_names_hosts_the_store_on_the_interface_that_reaches_it() -> None:
    local = own_address()
    command, env = agent.agent_command(agent.Agent(f"{local}:29400", "2"), ["c.yaml", "--run-dir", "r"], {})
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert command[-5:] == ["-m", "fedweave.data_parallel", "c.yaml", "--run-dir", "r"]
    assert {f"--local-addr={local}", "--rdzv-conf=is_host=true", "--nnodes=2", f"--rdzv-endpoint={local}:29400"} <= set(command)
    assert env["GLOO_SOCKET_IFNAME"] == agent.interface_of(local) is not None
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a host joining a running elastic job finds its store


def test_another_host_joins_as_a_client_of_the_store() -> None:
    local = own_address()
    command, _ = agent.agent_command(agent.Agent(f"{ELSEWHERE}:29400", "1:3", rdzv_conf="join_timeout=60"), ["c"], {})
    assert f"--local-addr={local}" in command and "--rdzv-conf=join_timeout=60,is_host=false" in command


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
