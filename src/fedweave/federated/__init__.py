"""Federated mode: the synchronous round (:mod:`.rounds`), FedBuff's buffered spine (:mod:`.buffered`),
the client runtime (:mod:`.client`), the receive pipeline (:mod:`.receive`), what an update may hold
(:mod:`.checks`), a round's record (:mod:`.records`), evaluation
(:mod:`.evaluation`), the controller protocol and its static plan (:mod:`.controller`), the adaptive controller
(:mod:`.adaptive`) and client selection (:mod:`.selection`).

Importing this package imports none of them: strategies and plugins import :mod:`.checks` alone."""
