"""gloo all-reduce of the flattened model against one all-reduce per tensor.

Two processes on 127.0.0.1 all-reduce the same model, a stack of many small and a few
large tensors (like a deep network's weights, biases and norms), in two ways:

- per tensor: one ``all_reduce`` call for each of the model's tensors;
- flattened: the tensors copied into flat buffers of at most ``--bucket-mb`` (what
  ``fedweave.transports.torchdist`` does), one ``all_reduce`` per buffer, copied back.

Each way is repeated and its best time shown, then the ratio per-tensor / flattened.

    python benchmarks/gloo_allreduce.py [--layers 100] [--width 256] [--bucket-mb 25] [--repeats 5]

Set OMP_NUM_THREADS=1 on a small machine (two processes, two cores).
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fedweave.transports.torchdist.group import plan_buckets


def model(layers: int, width: int) -> list[torch.Tensor]:
    """``layers`` blocks of a weight (width x width), a bias and two norm vectors (4 tensors each)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        out += [
            torch.randn(width, width, generator=gen),
            torch.randn(width, generator=gen),
        ]
        out += [torch.ones(width), torch.zeros(width)]
    return out


def per_tensor(tensors: list[torch.Tensor]) -> int:
    for t in tensors:
        dist.all_reduce(t)
    return len(tensors)


def flattened(tensors: list[torch.Tensor], bucket_bytes: int) -> int:
    buckets = plan_buckets(
        [t.numel() * t.element_size() for t in tensors], bucket_bytes
    )
    for lo, hi in buckets:
        group = tensors[lo:hi]
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    return len(buckets)


def worker(
    rank: int,
    port: int,
    args: argparse.Namespace,
    results: "mp.Queue[tuple[str, float, int]]",
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    try:
        tensors = model(args.layers, args.width)
        for name, fn in (
            ("per-tensor", per_tensor),
            ("flattened", lambda ts: flattened(ts, int(args.bucket_mb * (1 << 20)))),
        ):
            best, calls = float("inf"), 0
            for _ in range(args.repeats + 1):  # the first run warms up
                dist.barrier()
                start = time.perf_counter()
                calls = fn(tensors)
                best = min(best, time.perf_counter() - start)
            if rank == 0:
                results.put((name, best, calls))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tensors = model(args.layers, args.width)
    size = sum(t.numel() * t.element_size() for t in tensors)
    print(
        f"model: {len(tensors)} tensors, {size / 1e6:.1f} MB; 2 gloo processes on 127.0.0.1"
    )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, port, args, results)) for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        if p.exitcode != 0:
            raise SystemExit(f"a worker failed (exit code {p.exitcode})")
    times = {}
    for _ in range(2):
        name, best, calls = results.get(timeout=10)
        times[name] = best
        print(
            f"{name:>10}: {calls:4d} all-reduce calls, {best * 1e3:8.1f} ms, {size / best / 1e9:.2f} GB/s"
        )
    print(
        f"ratio per-tensor / flattened: {times['per-tensor'] / times['flattened']:.2f}x"
    )


if __name__ == "__main__":
    main()
