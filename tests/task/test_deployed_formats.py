"""Sites of Hugging Face folders and image folders, deployed: each client reads only its own
folder (``--data``'s path), the server none but the test set; the run equals the simulation of the
same folders through ``{client}``, and nothing a client sends holds more than its update's tensors."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import free_port
from fedweave import config as config_mod
from fedweave import runner
from fedweave.build import build_task
from fedweave.nodes.client import run_client
from fedweave.reach import server_topology
from fedweave.types import Evaluation, Update

from .conftest import assert_same_run, write_hf_sites, write_image_sites

WRITERS = {"hf": write_hf_sites, "imagefolder": write_image_sites}
DECLARED = {"hf": {"classes": ["ant", "bee", "cow"]}, "imagefolder": {}}  # what every node's config says of the labels


def federation(options: dict[str, Any], transport: str) -> config_mod.Config:
    grpc = {"listen": f"127.0.0.1:{free_port()}", "allow_unauthenticated": True, "join_timeout": 60,
            "connect_timeout": 60} if transport == "grpc" else {}
    return config_mod.from_dict({
        "name": "sites", "seed": 5, "rounds": 3, "clients": 3,
        "task": {"dataset": "files", "dataset_options": options, "model_options": {"hidden": [16]}},
        "local": {"epochs": 1, "batch_size": 8, "lr": 0.1},
        "eval": {"every": 1, "federated_every": 3},
        "checkpoint": {"every": 0},
        "transport": transport,
        "grpc": grpc,
    })


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_deployed_sites_of_a_format_equal_the_simulation_and_send_only_their_updates(fmt: str, tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    options = WRITERS[fmt](tmp_path) | DECLARED[fmt]
    simulated = federation(options, "inmemory")
    reference = runner.run_config(simulated, tmp_path / "reference")
    shape = build_task(simulated).dataset.input_shape  # what a server without the sites' data is told

    server_options = {k: v for k, v in options.items() if k != "path"}  # the server reads the test set alone
    server_config = federation(server_options | {"input_shape": list(shape)}, "grpc")
    topology = server_topology(server_config)
    replies: list[Any] = []
    exchange = topology.transport.exchange

    def recorded(messages: list[Any], timeout: float | None) -> Any:
        result = exchange(messages, timeout)
        replies.extend(m.body for m in result.replies)
        return result

    topology.transport.exchange = recorded
    run = runner.prepare(server_config, tmp_path / "server", topology=topology)
    address = topology.transport.address
    clients = [
        threading.Thread(target=run_client, args=(server_config, cid),
                         kwargs={"address": address, "data": options["path"].format(client=cid)}, daemon=True)
        for cid in range(3)
    ]
    for thread in clients:
        thread.start()
    records = runner.run_rounds(run)
    for thread in clients:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in clients)

    assert_same_run(reference.records, records)
    for name, tensor in reference.params.items():
        torch.testing.assert_close(run.params[name], tensor, rtol=1e-6, atol=1e-7, msg=name)

    # what the server heard: each training reply the model's tensors in their shapes and nothing else,
    # each evaluation reply two numbers of metrics; no row, no label, no extra tensor
    shapes = {name: tuple(t.shape) for name, t in reference.params.items()}
    updates = [b for b in replies if isinstance(b, Update)]
    assert len(updates) == 3 * 3 and all(isinstance(b, (Update, Evaluation)) for b in replies)
    for update in updates:
        assert {n: tuple(t.shape) for n, t in update.tensors.items()} == shapes and update.extras == {}
    for evaluation in (b for b in replies if isinstance(b, Evaluation)):
        assert set(evaluation.metrics) == {"loss", "accuracy"}

