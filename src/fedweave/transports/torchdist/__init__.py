"""The torch.distributed transport: a site leader exchanging with its members over gloo or NCCL.

One process group per site: the leader (the group's first rank) and its members (the
other ranks, each serving one or more client ids with a :class:`~fedweave.federated.client.ClientRuntime`).
Every collective moves one flat buffer (a *bucket* of at most ``torchdist.bucket_mb``),
never one tensor at a time:

1. **broadcast** of the round's instructions: each distinct instruction body (in FedAvg,
   the one global model all members receive) is encoded once (:mod:`fedweave.transports.serialization`)
   and the bytes are broadcast in buckets; a small JSON header says which member serves
   which client with which work. A :class:`~fedweave.types.Control` (a step of a plugin's
   own protocol, such as secure aggregation's key set-up) is meant for one client alone:
   the round's controls are encoded each on its own and **scattered**, every member
   receiving only those of the clients it serves.
2. **gather** of the reply headers (client, size, kind, examples, metrics).
3. Then either **gather** of the encoded replies in buckets (*relay*: every update reaches
   the leader whole — SCAFFOLD's control variates, FedDyn, robust rules, encoded updates,
   evaluations), or, when the leader pre-aggregates and every update is a plain same-kind
   update without extras, a **reduce** (SUM) of ``n_k · x_k`` per floating dtype bucket
   and a reduce (MAX) of integer counters: the leader receives Σ n_k x_k and Σ n_k, the
   exact weighted mean, at the cost of one model per link instead of one per member.
   Control answers, like anything but a plain update, are always gathered, never reduced.

Rendezvous comes from config (``torchdist.address`` / ``port``) or from the environment
torchrun and Slurm set (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``; ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
``SLURM_LAUNCH_NODE_IPADDR``). ``backend: auto`` picks NCCL when CUDA is available, else gloo.
A failed or timed-out collective breaks the site's group: the exchange reports every
member of the site as failed (the round goes on with the other sites) and later
exchanges fail at once; the leader's ``broken`` says why, so that the server samples
around the site's members (a gRPC site leader's reply carries it).

An exchange's ``timeout`` travels with the round: each member runs its jobs in a thread
of their own and answers when they are done or the timeout has passed, whichever comes
first, so a job past the deadline is a failure of that client alone (its late result is
dropped; the member's next jobs wait for it at most their own deadline). Until the members
have answered, the leader's collectives end by ``timeout`` + :data:`~fedweave.transports.torchdist.leader.ANSWER_GRACE` seconds: a
member that cannot take part at all (a stopped process) breaks the site then, not after
``torchdist.timeout``. The leader never waits on the members' idle group longer than
``torchdist.timeout`` (members wait there up to ``idle_timeout`` for the next round).

The package: :mod:`~fedweave.transports.torchdist.world` (rendezvous, backend, the world and
its site groups), :mod:`~fedweave.transports.torchdist.group` (one site group's counted,
bucketed collectives), :mod:`~fedweave.transports.torchdist.reduce` (pre-aggregation by
reduce: Σ n_k x_k and max of counters), :mod:`~fedweave.transports.torchdist.leader` (the
site leader's exchange) and :mod:`~fedweave.transports.torchdist.member` (a member's serve loop).
The names a deployment uses (the rendezvous, the world, the leader and the member) are
imported here too.
"""

from fedweave.transports.torchdist.leader import TorchDistLeader
from fedweave.transports.torchdist.member import Handler, TorchDistMember
from fedweave.transports.torchdist.world import Rendezvous, World, rendezvous

__all__ = [
    "Handler",
    "Rendezvous",
    "TorchDistLeader",
    "TorchDistMember",
    "World",
    "rendezvous",
]
