"""The process entry points of a deployment, one module each, which ``fedweave server``,
``client`` and ``site`` (:mod:`fedweave.cli.nodes`) call:

- :mod:`~fedweave.nodes.server`: the server node (``fedweave server``), over the topology
  :func:`fedweave.reach.server_topology` gives it;
- :mod:`~fedweave.nodes.client`: a client node (``fedweave client --id N``);
- :mod:`~fedweave.nodes.site`: a site leader and its members (``fedweave site``), and the
  member ranks of one torch.distributed job;
- :mod:`~fedweave.nodes.signals`: how a node ends (SIGTERM, its launcher's death).

Every node builds its parts from the same config with :mod:`fedweave.build`, so every process
derives the same data partition and the same initial model from the seed.
"""
