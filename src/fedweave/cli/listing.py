"""What can be configured: ``fedweave schema`` (every config key) and ``fedweave list`` (the built-ins)."""

from __future__ import annotations


def schema(prefix: str) -> int:
    from fedweave.config import Config
    from fedweave.schema import describe_fields

    rows = [r for r in describe_fields(Config) if r[0].startswith(prefix) and not r[0].endswith(".params")]
    width = max(len(r[0]) for r in rows) if rows else 0
    for key, kind, default, help_text in rows:
        print(f"{key:<{width}}  {help_text}  [{kind}; default {default!r}]")
    print("strategy.* and plugins.* hold the settings of the chosen strategy and plugins: see `fedweave list`.")
    return 0


def list_builtins() -> int:
    import dataclasses

    from fedweave.plugins import PLUGINS
    from fedweave.strategies import STRATEGIES

    for title, registry in (("strategies", STRATEGIES), ("plugins", PLUGINS)):
        print(f"{title}:")
        for name in registry.names():
            cls = registry.get(name, title)
            settings = ", ".join(f.name for f in dataclasses.fields(cls.HParams)) or "no settings"
            print(f"  {name:<12} {_first_paragraph(cls.__doc__)}  [{settings}]")
    print("datasets:   digits, mnist5k, synthetic, torchvision:mnist, torchvision:cifar10, package.module:function")
    print("models:     mlp, cnn, package.module:function")
    print("losses:     cross_entropy, nll, bce, package.module:function")
    print("partitions: iid, dirichlet (alpha), shards (shards_per_client), quantity (alpha)")
    return 0


def _first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph on one line (without the ``::`` that opens a literal block)."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    return " ".join(paragraph.split()).rstrip(":")
