"""Compression of updates (uplink) and of the broadcast (downlink), with error feedback.

top-k, random-k, QSGD, fp16 / bf16 / int8 quantization and PowerSGD; see
:mod:`fedweave.plugins.compression.wire` for what they share.
"""
