"""The sign compressor of docs/extending.md on digits: uplink bytes, accuracy, exact resume.

The plugin is the ``# file: sign_compression.py`` block of docs/extending.md itself,
written to a temporary folder on the Python path, so this measures the documented code.
Three runs of the same federation (digits, 10 clients, Dirichlet(0.5) label skew, an MLP,
``--rounds`` rounds, seed 0): dense, sign with error feedback, sign without; then the
error-feedback run once more, interrupted halfway and resumed, compared bit for bit.

    python benchmarks/sign_compression.py [--rounds 20] [--hidden 256]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import torch

import fedweave
from fedweave import runner

DOC = Path(__file__).resolve().parent.parent / "docs" / "extending.md"


def plugin_source() -> str:
    match = re.search(r"^```python\n(# file: sign_compression\.py\n.*?)^```", DOC.read_text(), re.S | re.M)
    if match is None:
        raise SystemExit(f"no '# file: sign_compression.py' block in {DOC}")
    return match.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="fedweave-sign-"))
    (work / "sign_compression.py").write_text(plugin_source())
    sys.path.insert(0, str(work))
    base = [
        f"rounds={args.rounds}",
        "clients=10",
        "task.dataset=digits",
        f"task.model_options={{hidden: [{args.hidden}]}}",
        "task.partition={scheme: dirichlet, alpha: 0.5}",
        "eval.federated_every=0",
        f"output_dir={work}",
    ]
    runs = {
        "dense": [],
        "sign + error feedback": ["plugins.client_send=[{name: 'sign_compression:Sign'}]"],
        "sign, no error feedback": ["plugins.client_send=[{name: 'sign_compression:Sign', error_feedback: false}]"],
    }
    results = {name: fedweave.run(fedweave.load_config(None, [*base, *extra])) for name, extra in runs.items()}
    dense = results["dense"].records
    dense_up = sum(r["bytes_received"] for r in dense)
    print(f"digits, 10 clients, Dirichlet 0.5, MLP hidden {args.hidden}, {args.rounds} rounds, seed 0")
    print("| run | test accuracy | Δ vs dense (points) | uplink bytes | dense ÷ run |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        up = sum(x["bytes_received"] for x in r.records)
        acc = r.records[-1]["test_accuracy"]
        delta = 100 * (acc - dense[-1]["test_accuracy"])
        print(f"| {name} | {acc:.3f} | {delta:+.1f} | {up:,} | {dense_up / up:.1f}x |")

    every_round = "checkpoint.min_interval=0"  # a simulation checkpoints at most once per 30 s by default
    cut = runner.prepare(fedweave.load_config(None, [*base, *runs["sign + error feedback"], every_round]))
    half = args.rounds // 2

    def stop(record: dict) -> None:
        if record["round"] == half:
            raise KeyboardInterrupt

    try:
        runner.execute(cut, stop)
    except KeyboardInterrupt:
        pass
    resumed = fedweave.resume(cut.run_dir)
    whole = results["sign + error feedback"].params
    exact = all(torch.equal(resumed.params[k], whole[k]) for k in whole)
    print(f"interrupted after round {half} and resumed: final model {'bit-identical' if exact else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
