"""Secure aggregation with pairwise and self masks: the server learns only the sum.

Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning",
CCS 2017 (https://eprint.iacr.org/2017/281); the sparse neighbourhoods of SecAgg+ from
Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020
(https://eprint.iacr.org/2020/704).

**Encoding (client u).** The floating tensors of the update, flattened, are clipped to
[−R, R] and quantized with stochastic rounding to integers x ∈ [0, L], L = 2^q − 1,
where q = bits − ⌈log2 max_examples⌉; the client multiplies by its example count n_u,
so that the field sum Σ n_u x_u of a round with at most ``max_examples`` examples never
wraps. Then, in the field of integers mod 2^bits,

    y_u = n_u x_u + PRG(b_u) + Σ_{v ∈ N(u), v > u} PRG(s_uv) − Σ_{v ∈ N(u), v < u} PRG(s_uv)

where b_u is a fresh random self-mask seed, N(u) the client's neighbours that completed
the key set-up (every other client for SecAgg; ``neighbours`` of them on a ring over a
seeded permutation of the round's cohort for SecAgg+), and s_uv the pair's mask seed.
PRG is AES-128-CTR keyed by the seed, one call over the whole vector. Every secret of
the protocol (b_u, the record key r_u, c_uv, s_uv) is 16 bytes: X25519 gives 128-bit
security, so wider keys would add work (10–25 % more masking time for AES-256, twice
the Shamir shares) and nothing else. y_u is uniform in the field whatever the update: the server learns
nothing from it.

**Messages** (:class:`~fedweave.types.Control` bodies through the round's topology; the
server half is :meth:`SecAgg.setup` and :meth:`SecAgg.combine`, the client half
:meth:`SecAgg.answer` and :meth:`SecAgg.encode`, whose secrets live in the client's
private state, ``ctx.state``, and never leave its process):

0. ``advertise``: each client makes a fresh X25519 key pair (k_u, K_u), a self-mask seed
   b_u and a record key r_u; it answers its public key K_u.
1. ``share``: the server sends each client the cohort and its neighbours' public keys.
   The client derives, once per pair, X25519(k_u, K_v) and from it one HKDF-SHA256 output
   whose halves are two independent keys: the channel key c_uv and the mask seed s_uv.
   It answers (a) its mask seeds, sealed with AES-128-GCM under r_u (the *seed record*,
   which the server keeps and cannot open), and (b) for each neighbour, its Shamir
   shares of r_u and b_u (threshold t of its neighbourhood, itself included), sealed with
   AES-128-GCM under c_uv (round, sender and receiver bound to each), and (c) its Pedersen
   commitments to the polynomials of those shares (:mod:`~fedweave.plugins.secure.shamir`), which
   make each share verifiable. One agreement per pair serves the
   channel and the mask; what a drop-out's shares reveal, r_d, opens its mask seeds and
   never its channel keys, so the shares of b_d it sent stay sealed (as the second key
   pair of the paper ensures there).
2. ``forward``: the server forwards each client the shares addressed to it by the
   neighbours that completed step 1, with their commitments; the client opens each and checks
   it against its dealer's commitments, keeps those that pass and answers the senders whose
   shares do not open (random bytes) or do not match (a share off the committed polynomial),
   naming them in its log. Such a pair does not mask with each other, and a client left with
   fewer than t − 1 neighbours holding valid shares of it (a dealer of bad shares to everyone)
   leaves the round before anyone masks with it; a false complaint costs the complainer the
   pair as much as the accused. The training instruction tells each client whom it masks with
   (``config[MASKING]``, checked against the shares it verified). Then the training
   exchange, whose reply is y_u (:meth:`encode`).
3. ``unmask``: the server sends each client whose y_u arrived the survivors among its
   neighbours; it answers its shares of b_w for the survivors (itself included) and of
   r_w for the neighbours that dropped: never both for one client, and only once.

**Combining (server).** Pairwise masks cancel in the sum of every pair that both sent;
the server removes PRG(b_u) of every survivor, and for each client d that dropped after
the set-up it rebuilds r_d, opens d's seed record and removes the masks s_dv of d's
surviving neighbours. Clients that drop before the set-up ends are not in the round. Each
rebuilt secret is checked against its dealer's commitment; when the shares interpolate to
another (a holder answered a shifted share), each share is checked, the holder whose share
fails is named and its shares are left out, and the others rebuild it. The record's
``secagg_excluded`` counts the clients excluded so in the round. Fewer than t
surviving (or answering) holders of a needed secret raise
:class:`~fedweave.errors.RoundError`, which the loop turns into a skipped round.

The server is honest but curious: it follows the protocol (it forwards the public keys
and commitments it received); the consistency checks and signatures of the paper's
malicious model are not implemented. Against a malicious client: its bad shares exclude
it (or the pair), its wrong revealed shares are found and left out; its masked update's
content cannot be checked, and a dealer that seals its seed record under another key than
the one it shared, then drops, still stops the round.

Modules: :mod:`.params` (the options), :mod:`.keys` (agreement, key derivation, sealing),
:mod:`.masking` (the field and its PRG masks), :mod:`.quantization`, :mod:`.neighbours`
(SecAgg+'s graph), :mod:`.messages` (the control steps' bodies), :mod:`.server` and
:mod:`.client` (the protocol's two halves) and :mod:`.plugin` (:class:`SecAgg`, both halves
as one plugin); this package re-exports their public names.
"""

from __future__ import annotations

from fedweave.plugins.secure.secagg.client import ClientRound, SecAggClient
from fedweave.plugins.secure.secagg.keys import KEY_BYTES, SEALED_SHARES, SECRET_BYTES, SHARE_BYTES, hkdf, pair_info
from fedweave.plugins.secure.secagg.masking import Field
from fedweave.plugins.secure.secagg.messages import ADVERTISE, FORWARD, MASKED, MASKED_STEP, MASKING, SHARE, SUM, UNMASK
from fedweave.plugins.secure.secagg.neighbours import ring, threshold_of
from fedweave.plugins.secure.secagg.params import SecAggHParams
from fedweave.plugins.secure.secagg.plugin import SecAgg
from fedweave.plugins.secure.secagg.quantization import Quantizer
from fedweave.plugins.secure.secagg.server import SecAggServer, ServerRound

__all__ = [
    "ADVERTISE",
    "FORWARD",
    "KEY_BYTES",
    "MASKED",
    "MASKED_STEP",
    "MASKING",
    "SEALED_SHARES",
    "SECRET_BYTES",
    "SHARE_BYTES",
    "SHARE",
    "SUM",
    "UNMASK",
    "ClientRound",
    "Field",
    "Quantizer",
    "SecAgg",
    "SecAggClient",
    "SecAggHParams",
    "SecAggServer",
    "ServerRound",
    "hkdf",
    "pair_info",
    "ring",
    "threshold_of",
]
