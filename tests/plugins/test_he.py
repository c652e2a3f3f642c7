"""Homomorphic encryption: the decrypted aggregate is FedAvg, the server never holds the secret key, key set-up."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch

from conftest import assert_same_params, run_to_end
from fedweave.cli import main
from fedweave.plugins.secure.he import CHUNK, PUBLIC_FILE, SECRET_FILE, slot_count
from fedweave.strategies.aggregate import weighted_average

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


def test_decrypted_aggregate_equals_plaintext_fedavg_over_several_ciphertexts(keys: Path) -> None:
    plugin = make("he", keys=str(keys))
    plain = updates()
    encrypted = [plugin.encode(u, ctx(1, u.client_id)) for u in plain]
    assert sum(k.startswith(CHUNK) for k in encrypted[0].tensors) == 3  # 5,007 values in 2,048-slot ciphertexts
    assert all(t.dtype == torch.uint8 for k, t in encrypted[0].tensors.items() if k.startswith(CHUNK))
    result = plugin.decode(plugin.combine(encrypted, SERVER), SERVER)
    expected = weighted_average([u.tensors for u in plain], [u.num_examples for u in plain])
    assert result.num_examples == sum(u.num_examples for u in plain)
    assert_same_params(result.tensors, expected, atol=1e-4)


def test_the_server_half_never_holds_the_secret_key(keys: Path, tmp_path: Path) -> None:
    client = make("he", keys=str(keys))
    encrypted = [client.encode(u, ctx(1, u.client_id)) for u in updates(2)]
    # a server process gets the public context only
    server_keys = tmp_path / "server"
    server_keys.mkdir()
    (server_keys / PUBLIC_FILE).write_bytes((keys / PUBLIC_FILE).read_bytes())
    server = make("he", keys=str(server_keys))
    combined = server.combine(encrypted, SERVER)
    context = server.server.context
    assert not context.is_private() and not context.has_secret_key()
    assert server._secret is None  # combining never loaded a secret context
    with pytest.raises(ValueError, match="needs .*secret.ctx, which cannot be read"):
        server.decode(combined, SERVER)
    assert_same_params(client.decode(combined, SERVER).tensors, client.decode(client.combine(encrypted, SERVER), SERVER).tensors, atol=1e-6)
    # in one process (simulation) the object used in combine is still public-only
    assert not client.server.context.is_private() and not client.server.context.has_secret_key()
    assert client._secret.is_private()


def test_an_he_run_equals_plain_fedavg(tmp_path: Path) -> None:
    plain, _ = run_to_end(tmp_path / "plain")
    encrypted, records = run_to_end(tmp_path / "he", "plugins.client_send=[{name: he, poly_degree: 4096}]")
    assert_same_params(plain, encrypted, atol=1e-4)
    assert records[0]["bytes_received"] > 10 * run_to_end(tmp_path / "p2", "rounds=1")[1][0]["bytes_received"]
