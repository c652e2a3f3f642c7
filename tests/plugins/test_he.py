"""Homomorphic encryption: the decrypted aggregate is FedAvg, the server never holds the secret key (a client of
the round decrypts the sum, also over gRPC with the server given public.ctx alone), key set-up."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch

from conftest import assert_same_params, run_to_end
from fedweave.cli import main
from fedweave.errors import RoundError
from fedweave.plugins.chain import PluginContext
from fedweave.plugins.secure.he import CHUNK, PUBLIC_FILE, SECRET_FILE, SUM, slot_count
from fedweave.strategies.aggregate import weighted_average
from fedweave.types import Control

from .helpers import ctx, make, update

SERVER = ctx(1, -1, "server")


def updates(n: int = 3, size: int = 5000) -> list:
    """Updates larger than one ciphertext of a 4096-degree context (2,048 slots)."""
    g = torch.Generator().manual_seed(0)
    return [
        update({"w": torch.randn(size // 50, 50, generator=g) * 0.1, "b": torch.randn(7, generator=g), "n": torch.tensor(i)},
               num_examples=20 + 13 * i, client_id=i)
        for i in range(n)
    ]


class KeyHolders:
    """The round's clients, each with its own plugin state, answering the server's decrypt step;
    ``lost``: clients that answer nothing; ``asked``: who was asked, in order."""

    def __init__(self, plugin: object, lost: set[int] = frozenset()):
        self.plugin, self.lost = plugin, lost
        self.states: dict[int, dict] = {}
        self.asked: list[int] = []

    def ctx(self, u: int, rnd: int = 1) -> PluginContext:
        return PluginContext(rnd, u, "client", self.states.setdefault(u, {}))

    def encode(self, plain: list) -> list:
        return [self.plugin.encode(u, self.ctx(u.client_id)) for u in plain]

    def exchange(self, bodies: dict[int, Control]) -> dict[int, Control]:
        self.asked += list(bodies)
        return {u: self.plugin.answer(b, self.ctx(u)) for u, b in bodies.items() if u not in self.lost}


def public_only(keys: Path, tmp_path: Path) -> Path:
    """A server's keys folder: public.ctx and nothing else."""
    folder = tmp_path / "server-keys"
    folder.mkdir()
    (folder / PUBLIC_FILE).write_bytes((keys / PUBLIC_FILE).read_bytes())
    return folder


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("keys")
    assert main(["keys", "--out", str(out), "--poly-degree", "4096"]) == 0
    return out


def test_keys_command_writes_a_secret_and_a_public_context(keys: Path) -> None:
    import tenseal as ts

    secret = ts.context_from((keys / SECRET_FILE).read_bytes())
    public = ts.context_from((keys / PUBLIC_FILE).read_bytes())
    assert secret.is_private() and not public.is_private() and not public.has_secret_key()
    assert stat.S_IMODE((keys / SECRET_FILE).stat().st_mode) == 0o600
    assert slot_count(public) == 2048


def test_a_secret_context_that_existed_with_a_looser_mode_ends_owner_only(tmp_path: Path) -> None:
    (tmp_path / SECRET_FILE).write_bytes(b"stale")
    (tmp_path / SECRET_FILE).chmod(0o644)
    assert main(["keys", "--out", str(tmp_path), "--poly-degree", "4096"]) == 0
    assert stat.S_IMODE((tmp_path / SECRET_FILE).stat().st_mode) == 0o600
    assert (tmp_path / SECRET_FILE).read_bytes() != b"stale"


def test_decrypted_aggregate_equals_plaintext_fedavg_over_several_ciphertexts(keys: Path, tmp_path: Path) -> None:
    clients = KeyHolders(make("he", keys=str(keys)))
    plain = updates()
    encrypted = clients.encode(plain)
    assert sum(k.startswith(CHUNK) for k in encrypted[0].tensors) == 3  # 5,007 values in 2,048-slot ciphertexts
    assert all(t.dtype == torch.uint8 for k, t in encrypted[0].tensors.items() if k.startswith(CHUNK))
    server = make("he", keys=str(public_only(keys, tmp_path)))
    result = server.decode(server.combine(encrypted, SERVER, clients.exchange), SERVER)
    assert clients.asked == [0]  # one key holder decrypts the sum
    expected = weighted_average([u.tensors for u in plain], [u.num_examples for u in plain])
    assert result.num_examples == sum(u.num_examples for u in plain)
    assert_same_params(result.tensors, expected, atol=1e-4)


def test_the_server_half_never_holds_the_secret_key(keys: Path, tmp_path: Path) -> None:
    client = make("he", keys=str(keys))
    clients = KeyHolders(client, lost={0})
    plain = updates(3)
    encrypted = clients.encode(plain)
    server = make("he", keys=str(public_only(keys, tmp_path)))  # a server process gets the public context only
    combined = server.combine(encrypted, SERVER, clients.exchange)
    assert clients.asked == [0, 1]  # client 0 is gone: the next client of the round decrypts
    context = server.server.context
    assert not context.is_private() and not context.has_secret_key()
    assert server._secret is None  # combining and decoding never load a secret context
    expected = weighted_average([u.tensors for u in plain], [u.num_examples for u in plain])
    assert_same_params(server.decode(combined, SERVER).tensors, expected, atol=1e-4)
    assert server._secret is None
    with pytest.raises(ValueError, match="never one client's ciphertexts"):
        server.decode(encrypted[1], SERVER)
    # in one process (simulation) the object used in combine is still public-only
    assert not client.server.context.is_private() and not client.server.context.has_secret_key()
    assert client._secret.is_private()


def test_a_client_decrypts_once_and_only_in_a_round_it_took_part_in(keys: Path, tmp_path: Path) -> None:
    clients = KeyHolders(make("he", keys=str(keys)))
    encrypted = clients.encode(updates(2))
    sums = {k: v for k, v in encrypted[0].tensors.items() if k.startswith(CHUNK)}
    ask = Control("he", "decrypt", sums)
    with pytest.raises(ValueError, match="client 5 sent no encrypted update in round 1"):
        clients.plugin.answer(ask, clients.ctx(5))
    with pytest.raises(ValueError, match="client 0 sent no encrypted update in round 2"):
        clients.plugin.answer(ask, clients.ctx(0, rnd=2))
    assert clients.plugin.answer(ask, clients.ctx(1)).tensors[SUM].dtype == torch.float64
    with pytest.raises(ValueError, match="or decrypted already"):
        clients.plugin.answer(ask, clients.ctx(1))
    server = make("he", keys=str(public_only(keys, tmp_path)))
    nobody = KeyHolders(clients.plugin, lost={0, 1})
    with pytest.raises(RoundError, match=r"none of the round's clients \[0, 1\] decrypted"):
        server.combine(encrypted, SERVER, nobody.exchange)


def test_a_wrong_decryption_answer_is_refused_and_the_next_client_asked(keys: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clients = KeyHolders(make("he", keys=str(keys)))
    plain = updates(2)
    encrypted = clients.encode(plain)

    def lying(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = clients.exchange(bodies)
        return {u: Control("he", "decrypt", {SUM: torch.zeros(3, dtype=torch.float64)}) if u == 0 else a for u, a in answers.items()}

    server = make("he", keys=str(public_only(keys, tmp_path)))
    result = server.decode(server.combine(encrypted, SERVER, lying), SERVER)
    assert "client 0's decryption refused: not 5007 finite float64 values" in caplog.text
    expected = weighted_average([u.tensors for u in plain], [u.num_examples for u in plain])
    assert_same_params(result.tensors, expected, atol=1e-4)


def test_an_he_run_equals_plain_fedavg(tmp_path: Path) -> None:
    plain, _ = run_to_end(tmp_path / "plain")
    encrypted, records = run_to_end(tmp_path / "he", "plugins.client_send=[{name: he, poly_degree: 4096}]")
    assert_same_params(plain, encrypted, atol=1e-4)
    assert records[0]["bytes_received"] > 10 * run_to_end(tmp_path / "p2", "rounds=1")[1][0]["bytes_received"]


def test_over_grpc_a_server_with_the_public_context_alone_runs_fedavg(keys: Path, tmp_path: Path) -> None:
    """Issue 14, item 8: `fedweave server` given public.ctx only (it used to load secret.ctx and, without
    it, crash in round 1) completes the run with two `fedweave client` processes holding secret.ctx,
    and its model is plaintext FedAvg's within CKKS precision."""
    import subprocess
    import sys

    import yaml

    from conftest import free_port
    from fedweave import config as config_mod
    from fedweave import runner

    spec = {
        "name": "he-grpc", "seed": 0, "rounds": 2, "clients": 2,
        "task": {"dataset": "synthetic", "dataset_options": {"samples": 300, "features": 8, "classes": 3},
                 "model_options": {"hidden": [8]}},
        "local": {"batch_size": 16},
        "plugins": {"client_send": [{"name": "he", "keys": str(keys)}]},
        "transport": "grpc",
        "grpc": {"heartbeat_interval": 0.2, "heartbeat_timeout": 5.0, "poll_timeout": 1.0, "backoff_max": 1.0},
        "checkpoint": {"every": 0},
    }
    path = tmp_path / "he.yaml"
    path.write_text(yaml.safe_dump(spec))
    plain = runner.prepare(config_mod.load(str(path), ["transport=inmemory", "plugins.client_send=[]"]), tmp_path / "plain")
    runner.execute(plain)

    server_keys = public_only(keys, tmp_path)
    run_dir, address = tmp_path / "run", f"127.0.0.1:{free_port()}"
    server_only = f"plugins.client_send=[{{name: he, keys: {server_keys}}}]"
    commands = {
        "server": ["server", str(path), server_only, "--run-dir", str(run_dir), "--listen", address],
        **{f"client{i}": ["client", str(path), "--id", str(i), "--address", address] for i in range(2)},
    }
    logs = {name: tmp_path / f"{name}.log" for name in commands}
    procs = {}
    try:
        for name, args in commands.items():
            with logs[name].open("wb") as out:
                procs[name] = subprocess.Popen([sys.executable, "-m", "fedweave", *args], stdout=out, stderr=subprocess.STDOUT)
        for name, proc in procs.items():
            assert proc.wait(120) == 0, logs[name].read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    assert not (server_keys / SECRET_FILE).exists()
    assert "Traceback" not in logs["server"].read_text()
    assert_same_params(torch.load(run_dir / "model.pt"), plain.params, atol=1e-4)
