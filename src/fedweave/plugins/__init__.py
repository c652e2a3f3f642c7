"""Transforms of payloads on the wire: privacy, secure aggregation, encryption, compression.

Plugins are named in the config under one of four attachment points (see
:mod:`fedweave.plugins.chain`) by built-in name or ``package.module:Class``; what a
plugin must have is in :mod:`fedweave.plugins.contracts`, the rules of their order in
:mod:`fedweave.plugins.compose`, run with every other composition rule by :mod:`fedweave.rules`.
"""

from fedweave.registry import Registry

PLUGINS = Registry(
    "plugin",
    {
        "identity": "fedweave.plugins.identity:Identity",
        # compression (server_send, client_send)
        "topk": "fedweave.plugins.compression.topk:TopK",
        "randk": "fedweave.plugins.compression.randk:RandK",
        "qsgd": "fedweave.plugins.compression.qsgd:QSGD",
        "quantize": "fedweave.plugins.compression.quantize:Quantize",
        "powersgd": "fedweave.plugins.compression.powersgd:PowerSGD",
        # differential privacy
        "clip": "fedweave.plugins.privacy.clip:Clip",
        "dp_local": "fedweave.plugins.privacy.dp:DPLocal",
        "dp_central": "fedweave.plugins.privacy.dp:DPCentral",
        "dpsgd": "fedweave.plugins.privacy.dpsgd:DPSGD",
        # secure aggregation and homomorphic encryption
        "secagg": "fedweave.plugins.secure.secagg:SecAgg",
        "he": "fedweave.plugins.secure.he:HE",
    },
)
