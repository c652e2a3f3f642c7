"""gRPC transfer throughput and memory against a raw loopback socket, measured in one run.

For each model size, these transfers run between two fresh processes on 127.0.0.1:

- raw socket: the sender ``sendall``s the tensor's memory, the receiver ``recv_into``s
  fresh memory, either a plain ``torch.empty`` tensor ("fresh tensor") or the huge-page
  mapping fedweave's receiver uses ("huge pages"), the fastest a Python process takes in
  a new model here;
- bare gRPC: grpcio alone, the same 1 MiB messages client-streamed with no framing,
  checksum or decoding and discarded on arrival: the ceiling of any Python gRPC
  transport on this machine;
- gRPC down: the server sends a model to a client (``GrpcServerTransport.exchange``
  -> the client's handler gets the decoded message);
- gRPC up: a client returns a model to the server (the client's handler returns
  -> ``exchange`` returns the decoded update).

Throughput is payload / wall time of the transfer, printed against each reference;
memory is each process's peak RSS (``ru_maxrss``) minus its peak just before the
payload existed, over the payload size: 1.0 means the payload itself and nothing else.

    python benchmarks/grpc_throughput.py [--sizes-mb 100,1000] [--checksum both|on|off] [--repeats 3]

On a shared machine single runs swing widely; each transfer is repeated and its best
throughput shown (memory: the worst ratio seen).

Targets: gRPC >= 50 % of raw socket throughput; peak memory <= 2.5x the payload on each side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from typing import Any

MB = 1_000_000
CHUNK = 1 << 20  # bare gRPC: bytes per message, and its message size limit
LIMITS = [("grpc.max_send_message_length", CHUNK), ("grpc.max_receive_message_length", CHUNK)]


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def report(**values: Any) -> None:
    print(json.dumps(values), flush=True)


# --------------------------------------------------------------------------- roles (subprocesses)


def raw_receiver(port: int, size: int, memory: str) -> None:
    import torch

    from fedweave.transports.serialization import receive_region

    listener = socket.create_server(("127.0.0.1", port))
    base = peak_bytes()
    conn, _ = listener.accept()
    region = receive_region(size) if memory == "huge" else None
    buf = torch.empty(size, dtype=torch.uint8) if region is None else torch.frombuffer(region, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    got = 0
    while got < size:
        n = conn.recv_into(view[got:], min(size - got, 1 << 22))
        if n == 0:
            raise SystemExit("sender closed early")
        got += n
    report(end=time.time(), base=base, peak=peak_bytes())


def raw_sender(port: int, size: int) -> None:
    import torch

    base = peak_bytes()
    payload = torch.ones(size, dtype=torch.uint8)
    deadline = time.monotonic() + 60
    while True:
        try:
            conn = socket.create_connection(("127.0.0.1", port))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    start = time.time()
    conn.sendall(memoryview(payload.numpy()))
    conn.close()
    report(start=start, base=base, peak=peak_bytes())


BARE = "/bench.Bare/Push"


def bare_server(port: int) -> None:
    import threading
    from concurrent import futures

    import grpc

    done, marks = threading.Event(), {}

    def push(frames: Any, _context: Any) -> bytes:
        got = sum(len(frame) for frame in frames)
        marks["end"] = time.time()
        done.set()
        return str(got).encode()

    handler = grpc.stream_unary_rpc_method_handler(push, lambda b: b, lambda b: b)
    server = grpc.server(futures.ThreadPoolExecutor(2), options=LIMITS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Bare", {"Push": handler}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    base = peak_bytes()
    if not done.wait(600):
        raise SystemExit("no upload arrived")
    report(end=marks["end"], base=base, peak=peak_bytes())
    server.stop(1)


def bare_client(port: int, size: int) -> None:
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=LIMITS)
    grpc.channel_ready_future(channel).result(timeout=60)
    call = channel.stream_unary(BARE, lambda b: b, lambda b: b)
    base = peak_bytes()
    payload = os.urandom(CHUNK)

    def frames() -> Any:
        for start in range(0, size, CHUNK):
            yield payload[: min(CHUNK, size - start)]

    start = time.time()
    got = int(call(frames(), timeout=600))
    assert got == size, (got, size)
    report(start=start, base=base, peak=peak_bytes())


def _settings(checksum: bool) -> Any:
    from fedweave import config as config_mod

    return config_mod.load(None, ["transport=grpc", "clients=1", f"grpc.checksum={str(bool(checksum)).lower()}"]).grpc


def grpc_server(port: int, size: int, direction: str, checksum: bool) -> None:
    import torch

    from fedweave.transports.grpc.server import GrpcServerTransport
    from fedweave.types import Instruction, Message, TaskKind, Work

    server = GrpcServerTransport(_settings(checksum), 1, listen=f"127.0.0.1:{port}")
    server.wait_for_clients(1, 60)
    base = peak_bytes()
    if direction == "down":
        params = {"w": torch.ones(size // 4, dtype=torch.float32)}
        applied: list[str] = []
    else:
        params, applied = {"w": torch.zeros(1)}, ["bench"]  # the reply's shape is its own
    message = Message(1, 0, Instruction(1, TaskKind.TRAIN, Work(0, 1), params, applied=applied))
    start = time.time()
    result = server.exchange([message], timeout=600)
    end = time.time()
    assert not result.failures, result.failures
    report(start=start, end=end, base=base, peak=peak_bytes())
    server.close()


def grpc_client(port: int, size: int, direction: str, checksum: bool) -> None:
    import torch

    from fedweave.transports.grpc.client import GrpcClient
    from fedweave.types import Message, Update, UpdateKind

    marks: dict[str, float] = {}

    def handler(msg: Message) -> Message:
        marks["received"] = time.time()
        marks["handler_base"] = peak_bytes()
        tensors = {"w": torch.ones(size // 4, dtype=torch.float32)} if direction == "up" else {}
        marks["replying"] = time.time()
        return Message(1, 0, Update(UpdateKind.WEIGHTS, tensors, 1, applied=["bench"] if tensors else [], client_id=0))

    client = GrpcClient(_settings(checksum), 0, handler, address=f"127.0.0.1:{port}")
    base = peak_bytes()
    client.run()
    report(
        base=base if direction == "down" else marks["handler_base"],
        peak=peak_bytes(),
        received=marks["received"],
        replying=marks["replying"],
    )


ROLES = {
    "raw-receiver": raw_receiver,
    "raw-sender": raw_sender,
    "bare-server": bare_server,
    "bare-client": bare_client,
    "grpc-server": grpc_server,
    "grpc-client": grpc_client,
}


# --------------------------------------------------------------------------- orchestration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pair(first: list[str], second: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run two roles as processes; return their reports."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, __file__, "--role", *args], stdout=subprocess.PIPE, env=env)
        for args in (first, second)
    ]
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"role {proc.args[3:]} failed with code {proc.returncode}")
        outputs.append(json.loads(out.decode().strip().splitlines()[-1]))
    return outputs[0], outputs[1]


def ratio(report_: dict[str, Any], size: int) -> float:
    return (report_["peak"] - report_["base"]) / size


def measure(size: int, checksums: list[bool]) -> list[tuple[str, float, float, float]]:
    rows = []
    for memory, tag in (("fresh", "fresh tensor"), ("huge", "huge pages")):
        port = free_port()
        args = [str(port), str(size)]
        receiver, sender = pair(["raw-receiver", *args, memory], ["raw-sender", *args])
        seconds = receiver["end"] - sender["start"]
        rows.append((f"raw socket, {tag}", size / seconds, ratio(sender, size), ratio(receiver, size)))
    port = free_port()
    server, client = pair(["bare-server", str(port)], ["bare-client", str(port), str(size)])
    seconds = server["end"] - client["start"]
    rows.append(("bare gRPC (grpcio alone)", size / seconds, ratio(client, size), ratio(server, size)))
    for checksum in checksums:
        tag = "crc on" if checksum else "crc off"
        for direction in ("down", "up"):
            port = free_port()
            args = [str(port), str(size), direction, str(int(checksum))]
            server, client = pair(["grpc-server", *args], ["grpc-client", *args])
            if direction == "down":
                seconds = client["received"] - server["start"]
                row = (f"gRPC server->client, {tag}", size / seconds, ratio(server, size), ratio(client, size))
            else:
                seconds = server["end"] - client["replying"]
                row = (f"gRPC client->server, {tag}", size / seconds, ratio(client, size), ratio(server, size))
            rows.append(row)
    return rows


def best(runs: list[list[tuple[str, float, float, float]]]) -> list[tuple[str, float, float, float]]:
    """Per transfer, the best throughput and the worst memory over the repeats."""
    return [
        (rows[0][0], max(r[1] for r in rows), max(r[2] for r in rows), max(r[3] for r in rows))
        for rows in zip(*runs)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="100,1000", help="model sizes in MB, comma-separated")
    parser.add_argument("--checksum", choices=("both", "on", "off"), default="both", help="CRC-32 per chunk")
    parser.add_argument("--repeats", type=int, default=3, help="runs per transfer; the best throughput is shown")
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        name, *rest = args.role
        ROLES[name](*(int(v) if v.isdigit() and i != 2 else v for i, v in enumerate(rest)))  # type: ignore[operator]
        return
    checksums = {"both": [True, False], "on": [True], "off": [False]}[args.checksum]
    print(
        f"{'transfer':<30} {'size':>8} {'GB/s':>7} {'vs raw':>7} {'vs raw+huge':>12} {'vs bare gRPC':>13} "
        f"{'sender mem':>11} {'receiver mem':>13}"
    )
    for mb in (int(v) for v in args.sizes_mb.split(",")):
        size = mb * MB // 4 * 4
        rows = best([measure(size, checksums) for _ in range(args.repeats)])
        raw, raw_huge, bare = (row[1] for row in rows[:3])
        for name, rate, sent_mem, recv_mem in rows:
            print(
                f"{name:<30} {mb:>6}MB {rate / 1e9:>7.3f} {rate / raw:>6.0%} {rate / raw_huge:>11.0%} "
                f"{rate / bare:>12.0%} {sent_mem:>10.2f}x {recv_mem:>12.2f}x"
            )


if __name__ == "__main__":
    main()
