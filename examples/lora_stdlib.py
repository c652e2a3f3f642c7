"""The set-up step of examples/lora-stdlib.yaml: a tiny GPT-2-shaped causal LM and the clients' text.

Nothing can be downloaded, so the base model is made from a config, pre-trained for a few steps on
English prose (the library's LICENSE.txt) and saved with ``save_pretrained``; the text is the Python standard library's own source, which ships on every
machine, split naturally: client i holds the ``.py`` files of package ``PACKAGES[i]`` (json, http,
email, ...), and the held-out test text is another package's (html)::

    python examples/lora_stdlib.py [FOLDER]     # default: examples/data/lora-stdlib

writes FOLDER/model (the base model), FOLDER/text/<i> (client i's files) and FOLDER/test.
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path

PACKAGES = ("json", "http", "email", "asyncio", "urllib", "logging")
"""The clients' packages, client i holding PACKAGES[i]."""

HELD_OUT = "html"
"""The package whose source is the central test set."""


def base_model(
    folder: Path, *, layers: int = 2, width: int = 64, heads: int = 4, positions: int = 64, steps: int = 150
) -> None:
    """A GPT-2-shaped causal LM over bytes (vocabulary 256), seeded, pre-trained for ``steps`` Adam steps
    on English prose (the standard library's LICENSE.txt, not code: the clients' Python is a new domain
    to it), saved in ``folder``. A base whose tied embedding is still at its random initial scale could
    not be adapted: LoRA leaves the embedding and the output layer as they are."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from fedweave.task.metrics import next_token_loss
    from fedweave.training import LocalOptimizer, LocalSettings

    config = GPT2Config(
        vocab_size=256, n_positions=positions, n_embd=width, n_layer=layers, n_head=heads,
        activation_function="gelu", bos_token_id=None, eos_token_id=None,
    )
    prose = torch.tensor(list((Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_bytes()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2026)
        model = GPT2LMHeadModel(config)
        optimizer = LocalOptimizer(model.parameters(), LocalSettings("adam", lr=3e-3, momentum=0.0, weight_decay=0.0))
        for _ in range(steps):
            starts = torch.randint(0, len(prose) - positions, (16,))
            batch = torch.stack([prose[s : s + positions] for s in starts])
            optimizer.zero_grad()
            next_token_loss(model(input_ids=batch).logits, batch).backward()
            optimizer.step()
    model.save_pretrained(str(folder))


def package_source(package: str, folder: Path) -> None:
    """The ``.py`` files of standard-library ``package`` (its tests left out) copied into ``folder``."""
    root = Path(sysconfig.get_paths()["stdlib"]) / package
    for file in sorted(root.rglob("*.py")):
        relative = file.relative_to(root)
        if "tests" in relative.parts or "test" in relative.parts:
            continue
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, folder / relative)


def prepare(folder: Path, packages: tuple[str, ...] = PACKAGES, held_out: str = HELD_OUT, **model: int) -> None:
    """Write the base model, each client's text and the test text under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    base_model(folder / "model", **model)
    for i, package in enumerate(packages):
        package_source(package, folder / "text" / str(i))
    package_source(held_out, folder / "test")


if __name__ == "__main__":
    prepare(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "data" / "lora-stdlib"))
