"""Federated mode: the synchronous round (:mod:`.rounds`), FedBuff's buffered spine (:mod:`.buffered`),
the client runtime (:mod:`.client`), what an update may hold (:mod:`.checks`), evaluation
(:mod:`.evaluation`), the batch controllers (:mod:`.controllers`) and client selection (:mod:`.selection`).

Importing this package imports none of them: strategies and plugins import :mod:`.checks` alone."""
