"""How fast this machine's float32 matrix products run through MKL, which torch's CPU products call
(and so the cohort's batched products, docs/simulation.md), against oneDNN, torch's other CPU
library, on the same product.

MKL chooses its kernels by processor: on an AMD processor it runs its AVX2 kernels even where the
processor has AVX-512 (``MKL_ENABLE_INSTRUCTIONS`` and ``MKL_CBWR`` do not lift that), while oneDNN
runs AVX-512 wherever the processor has it. Where the ratio printed here is near 2, a cohort's
products run at about half of what the core can do, and the cohort's gain over the sequential loop
is smaller than on a processor MKL serves with its AVX-512 kernels (the sequential loop, bound by
per-operation overhead, hardly changes). oneDNN has no batched float32 product that torch exposes
(``torch.bmm`` is MKL's), and per-client weights as a grouped convolution, which oneDNN has, were
measured slower than MKL's batched product (0.1-0.6x for the digits MLP cohort's products, one thread), so the cohort keeps
``torch.bmm``.

Rows, each on ``--threads`` torch threads, ``--pairs`` interleaved pairs (MKL, then oneDNN, each
the mean of ``--repeats`` products) after one left out: a square product (``--size``, 1024) through
both libraries, the median rate of each and the median of the per-pair ratios oneDNN / MKL with its
interquartile range; then the digits MLP cohort's products (100 clients, batch 16, 64 inputs, 128
hidden: the first layer's forward and weight gradient) through MKL's batched product, and their rate
as a share of oneDNN's square product (what the core reaches).

    python benchmarks/gemm.py [--threads 1] [--pairs 12] [--repeats 20] [--size 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from spread import load_average, ratio_spread


def seconds(product: Callable[[], torch.Tensor], repeats: int) -> float:
    """The mean wall time of one call of ``product`` over ``repeats`` calls."""
    started = time.perf_counter()
    for _ in range(repeats):
        product()
    return (time.perf_counter() - started) / repeats


def onednn_linear() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """oneDNN's ``x @ w.T`` on dense float32 tensors (``mkldnn::_linear_pointwise``), or None
    where this torch was built without it."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return None
    return lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def vendor() -> str:
    """The processor's vendor and model as Linux names them (empty elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    fields = {key.strip(): value for key, _, value in (line.partition(":") for line in lines)}  # the last processor's
    return " ".join(fields.get(key, "").strip() for key in ("vendor_id", "model name")).strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--pairs", type=int, default=12, help="measured pairs (after one left out)")
    parser.add_argument("--repeats", type=int, default=20, help="products timed together in each measurement")
    parser.add_argument("--size", type=int, default=1024, help="rows and columns of the square product")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    linear = onednn_linear()
    print(f"torch {torch.__version__}; {vendor() or 'processor unknown'}; ATen kernels "
          f"{torch.backends.cpu.get_cpu_capability()}; {args.threads} thread(s); {args.pairs} pairs; "
          f"load average {load_average()}")
    if linear is None:
        print("benchmarks/gemm.py: this torch has no oneDNN linear, so there is nothing to compare MKL with")
        return 0
    n = args.size
    x, w = torch.randn(n, n), torch.randn(n, n)
    square = 2 * n**3
    mkl = lambda: torch.mm(x, w.t())  # noqa: E731
    dnn = lambda: linear(x, w)  # noqa: E731
    reference = mkl()
    difference = float((reference - dnn()).abs().max() / reference.abs().max())
    rates: dict[str, list[float]] = {"mkl": [], "onednn": []}
    for pair in range(args.pairs + 1):
        for name, product in (("mkl", mkl), ("onednn", dnn)):
            rate = square / seconds(product, args.repeats) / 1e9
            if pair:
                rates[name].append(rate)
    ratio, q1, q3 = ratio_spread([d / m for m, d in zip(rates["mkl"], rates["onednn"])])
    reach = statistics.median(rates["onednn"])
    print(f"{'row':<44} {'GFLOP/s':>9} {'ratio':>7} {'IQR':>11}")
    print(f"{f'square {n} MKL (torch.mm)':<44} {statistics.median(rates['mkl']):>9.1f}")
    print(f"{f'square {n} oneDNN (_linear_pointwise)':<44} {reach:>9.1f} {ratio:>6.2f}x {q1:>5.2f}-{q3:<5.2f}"
          f"  (outputs within {difference:.1e} relative)")
    k, b, features, hidden = 100, 16, 64, 128  # the digits MLP cohort of benchmarks/cohort.py's digits-100 row
    weights, batch, grad = torch.randn(k, hidden, features), torch.randn(k, features, b), torch.randn(k, hidden, b)
    rows = torch.randn(k, b, features)
    cohort = 2 * k * hidden * features * b
    for name, product in (("forward W h", lambda: torch.bmm(weights, batch)),
                          ("weight gradient g x", lambda: torch.bmm(grad, rows))):
        seconds(product, args.repeats)  # left out
        rate = statistics.median(cohort / seconds(product, args.repeats) / 1e9 for _ in range(args.pairs))
        print(f"{f'cohort {name} MKL (torch.bmm)':<44} {rate:>9.1f}   {rate / reach:>5.0%} of oneDNN's square")
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
