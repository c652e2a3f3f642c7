"""Every built-in compressor over gRPC: its fields cross the wire in both directions (a server
node and two client threads), and the deployed run equals the simulation."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from conftest import assert_same_params, free_port, run_to_end, small_config
from fedweave.nodes.client import run_client
from fedweave.nodes.server import serve

GRPC = [
    "transport=grpc",
    "grpc.heartbeat_interval=0.1",
    "grpc.heartbeat_timeout=2.0",
    "grpc.poll_timeout=0.5",
    "grpc.join_timeout=10",
    "grpc.backoff_initial=0.05",
    "grpc.backoff_max=0.5",
]

CODECS = {  # each codec's configurations, one per kind of field it sends
    "topk": "{name: topk, ratio: 0.1}",  # int16 positions
    "topk-fp16-blocks": "{name: topk, ratio: 0.001, values: float16}",  # more than 65,536 entries: int32 counts
    "randk": "{name: randk, ratio: 0.2}",  # int64 seed
    "qsgd-4bit": "{name: qsgd, levels: 7}",  # uint8 nibbles
    "qsgd-8bit": "{name: qsgd, levels: 127}",  # int8 levels
    "qsgd-16bit": "{name: qsgd, levels: 1000}",  # int16 levels
    "int8": "{name: quantize, dtype: int8}",
    "fp16": "{name: quantize, dtype: float16}",
    "bf16": "{name: quantize, dtype: bfloat16}",
    "powersgd": "{name: powersgd, rank: 2}",
}


@pytest.mark.parametrize("codec", CODECS)
def test_a_compressed_run_over_grpc_equals_the_in_memory_run(tmp_path: Path, codec: str) -> None:
    """Both directions compressed, two rounds: the second broadcast is a compressed delta.
    Every codec draws from seeds of the config, round, client and tensor, so the deployed
    run is the simulation to the bit."""
    spec = CODECS[codec]
    model = ["task.model_options={hidden: [8200]}"] if codec == "topk-fp16-blocks" else []
    overrides = ["clients=2", "rounds=2", "checkpoint.every=0", *model,
                 f"plugins.client_send=[{spec}]", f"plugins.server_send=[{spec}]"]
    simulated, _ = run_to_end(tmp_path / "inmemory", *overrides)
    config = small_config(*overrides, *GRPC, f"grpc.address=127.0.0.1:{free_port()}")
    answered: dict[int, int] = {}
    clients = [threading.Thread(target=lambda c=cid: answered.__setitem__(c, run_client(config, c)), daemon=True)
               for cid in (0, 1)]
    for t in clients:
        t.start()
    deployed = serve(config, tmp_path / "grpc")
    for t in clients:
        t.join(20)
    records = [json.loads(line) for line in (tmp_path / "grpc" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["clients_completed"], r.get("rejected", {})) for r in records] == [(2, {}), (2, {})]
    assert answered == {0: 2, 1: 2}
    assert_same_params(deployed.params, simulated)
