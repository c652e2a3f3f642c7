"""Homomorphic encryption of updates with CKKS (TenSEAL): the server sums ciphertexts.

Cheon, Kim, Kim & Song, "Homomorphic Encryption for Arithmetic of Approximate Numbers",
ASIACRYPT 2017; TenSEAL (Benaissa et al. 2021, https://arxiv.org/abs/2104.03152).

**Keys.** The federation's CKKS context is made once, before the run, with
``fedweave keys --out DIR``: ``DIR/secret.ctx`` (with the secret key) goes to the
clients, ``DIR/public.ctx`` (without it) to the server; the plugin's ``keys`` names the
folder. Without ``keys``, the plugin makes a fresh context in its process (simulation).

**Encoding (client).** The floating tensors of the update, flattened and multiplied by
the client's example count n_k, are packed into as many CKKS vectors as the model needs
(``poly_degree / 2`` values each) and encrypted; each ciphertext travels serialized as
a uint8 tensor (``__he_00000``, ...), so any transport carries it and its bytes are
counted. Layouts and integer tensors travel in the clear.

**Combining (server).** The server deserializes the ciphertexts with the *public*
context (:class:`HEServer`: built only from the public context's bytes, it never holds
the secret key) and adds them: Σ_k n_k x_k, still encrypted. No multiplication is
needed, so one ciphertext modulus suffices.

**Decrypting (a key holder).** Decrypting needs the secret key, which the server never
loads: the plugin runs one step of its own protocol (a :class:`~fedweave.types.Control`
``decrypt``, through the round's topology like SecAgg's steps) that sends the encrypted
sum to one client of the round, which decrypts it with ``secret.ctx`` and answers the
plaintext Σ_k n_k x_k. The server asks the round's clients in id order until one
answers, and divides by Σ n_k (``decode``): the example-weighted mean, which the strategy
applies as usual, so the server keeps a plaintext global model and evaluates it. A client
decrypts at most once per round, and only in a round it sent an encrypted update in. As
with secure aggregation, the server learns the aggregate and never an individual update,
against an honest-but-curious server: one that deviates could send a single client's
ciphertext to be decrypted, since every client holds the same key (a threshold key, or
keeping the aggregate encrypted in the broadcast, would close that; neither is built).

Precision: CKKS is approximate; with the default scale 2^32 the mean is exact to about
1e-6, and |Σ_k n_k x_k| must stay below about 2^(60 − scale_bits) (2.7e8 by default).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from fedweave.errors import RoundError
from fedweave.files import atomic_write_bytes
from fedweave.plugins.chain import ControlExchange, PluginContext
from fedweave.plugins.packing import FLAT, SEP, combine_plain, flatten, read_layout, unflatten
from fedweave.schema import opt
from fedweave.types import Control, Update, UpdateKind

log = logging.getLogger(__name__)

SECRET_FILE = "secret.ctx"
PUBLIC_FILE = "public.ctx"
CHUNK = "__he_"
SUM = "__hesum"
"""The decrypted Σ_k n_k x_k (float64) the key holder answers and the combined update carries."""
DECRYPT = "decrypt"
COEFF_MOD_BITS = [60, 40]  # one 60-bit ciphertext modulus and the special prime: enough for additions


@dataclass
class HEParams:
    keys: str | None = opt(
        None, help="folder made by `fedweave keys`: clients read secret.ctx, the server public.ctx (none: fresh keys)"
    )
    poly_degree: Literal[4096, 8192, 16384] = opt(8192, help="without keys: CKKS ring degree (slots per ciphertext: half)")
    scale_bits: int = opt(32, ge=20, le=50, help="without keys: CKKS scale 2^bits (precision against range)")


def tenseal() -> Any:
    try:
        import tenseal as ts
    except ImportError:
        raise ImportError("plugin 'he' needs TenSEAL: pip install 'fedweave[he]'") from None
    return ts


def make_context(poly_degree: int, scale_bits: int) -> Any:
    """A fresh CKKS context with its secret key."""
    ts = tenseal()
    context = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=poly_degree, coeff_mod_bit_sizes=COEFF_MOD_BITS)
    context.global_scale = 2.0**scale_bits
    return context


def public_bytes(context: Any) -> bytes:
    """The serialized context without its secret key."""
    public = context.copy()
    public.make_context_public()
    return public.serialize()


def write_keys(out: str | Path, poly_degree: int = 8192, scale_bits: int = 32) -> tuple[Path, Path]:
    """Make the federation's CKKS context: ``secret.ctx`` (clients, owner-only) and ``public.ctx`` (server)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    context = make_context(poly_degree, scale_bits)
    secret, public = out / SECRET_FILE, out / PUBLIC_FILE
    atomic_write_bytes(context.serialize(save_secret_key=True), secret, private=True)
    atomic_write_bytes(public_bytes(context), public)
    return secret, public


def slot_count(context: Any) -> int:
    """Values one CKKS ciphertext of ``context`` holds: half the ring degree."""
    return context.seal_context().data.key_context_data().parms().poly_modulus_degree() // 2


class HEServer:
    """The server half: the public context only (no secret key), and the sum of ciphertexts."""

    def __init__(self, context_bytes: bytes):
        self.context = tenseal().context_from(context_bytes)
        if self.context.is_private():
            raise ValueError("the server's HE context holds a secret key; give the server public.ctx only")

    def add(self, ciphertexts: list[bytes]) -> bytes:
        ts = tenseal()
        total = ts.ckks_vector_from(self.context, ciphertexts[0])
        for data in ciphertexts[1:]:
            total += ts.ckks_vector_from(self.context, data)
        return total.serialize()


def _one_process(params: HEParams) -> str | None:
    return "without keys each process would make its own CKKS context; make them with `fedweave keys`" if params.keys is None else None


class HE:
    """Homomorphic encryption (CKKS, TenSEAL): the server sums encrypted updates without the secret key."""

    name = "he"
    Params = HEParams
    accepts = frozenset(UpdateKind)
    combines_encoded = True
    stage = "secure"
    points = ("client_send",)
    one_process = staticmethod(_one_process)

    def __init__(self, hp: HEParams):
        self.hp = hp
        self._secret: Any = None  # the client half's context, loaded when a client first needs it
        self._server: HEServer | None = None

    @property
    def server(self) -> HEServer:
        """The server half, built from the public context alone."""
        if self._server is None:
            if self.hp.keys is None:
                self._server = HEServer(public_bytes(self._client_context()))
            else:
                self._server = HEServer(_read(Path(self.hp.keys) / PUBLIC_FILE, "the server"))
        return self._server

    def setup(self, rnd: int, cohort: list[int], exchange: ControlExchange) -> list[int]:
        """No set-up step: every client of the cohort trains (the keys were made before the run)."""
        return cohort

    def encode(self, payload: Update, ctx: PluginContext) -> Update:
        ts = tenseal()
        context = self._client_context()
        if ctx.state is not None:
            ctx.state[self.name] = ctx.round  # this client may decrypt this round's sum, once
        vector, rest = flatten(payload.tensors)
        values = (vector * payload.num_examples).numpy()
        slots = slot_count(context)
        chunks = {
            f"{CHUNK}{i // slots:05d}": _bytes_tensor(ts.ckks_vector(context, values[i : i + slots]).serialize())
            for i in range(0, len(values), slots)
        }
        return replace(payload, tensors={**chunks, **rest})

    def combine(self, updates: list[Update], ctx: PluginContext, exchange: ControlExchange) -> Update:
        """Sum the ciphertexts with the public context, then have a key holder of the round decrypt the sum."""
        names = [k for k in updates[0].tensors if k.startswith(CHUNK)]
        sums = {k: _bytes_tensor(self.server.add([_tensor_bytes(u.tensors[k]) for u in updates])) for k in names}
        plain = combine_plain([{k: t for k, t in u.tensors.items() if not k.startswith(CHUNK)} for u in updates])
        size = sum(math.prod(read_layout(v)[1]) for k, v in plain.items() if k.endswith(SEP + FLAT))
        total = self._decrypted(sorted(u.client_id for u in updates), sums, size, ctx.round, exchange)
        return Update(
            kind=updates[0].kind,
            tensors={SUM: total, **plain},
            num_examples=sum(u.num_examples for u in updates),
            applied=list(updates[0].applied),
        )

    def _decrypted(
        self, holders: list[int], sums: dict[str, torch.Tensor], size: int, rnd: int, exchange: ControlExchange
    ) -> torch.Tensor:
        for holder in holders:
            answers = exchange({holder: Control(self.name, DECRYPT, sums)})
            if holder not in answers:
                continue
            total = answers[holder].tensors.get(SUM)
            if (
                isinstance(total, torch.Tensor) and total.dtype == torch.float64 and total.shape == (size,)
                and bool(torch.isfinite(total).all())
            ):
                return total
            log.warning("round %d: client %d's decryption refused: not %d finite float64 values", rnd, holder, size)
        raise RoundError(f"he: none of the round's clients {holders} decrypted its encrypted sum")

    def decode(self, payload: Update, ctx: PluginContext) -> Update:
        """Divide the key holder's decrypted sum by Σ n_k: the example-weighted mean."""
        if SUM not in payload.tensors:
            raise ValueError("he decodes only the decrypted sum of a round, never one client's ciphertexts")
        mean = payload.tensors[SUM] / payload.num_examples
        rest = {k: v for k, v in payload.tensors.items() if k != SUM}
        return replace(payload, tensors=unflatten(mean, rest))

    def answer(self, control: Control, ctx: PluginContext) -> Control:
        """The key holder's step: decrypt the round's encrypted sum (once, in a round this client took part in)."""
        if control.step != DECRYPT:
            raise ValueError(f"he has no step {control.step!r}")
        if ctx.state is None or ctx.state.pop(self.name, None) != ctx.round:
            raise ValueError(f"he: client {ctx.client_id} sent no encrypted update in round {ctx.round}, or decrypted already")
        names = sorted(control.tensors)
        if not names or any(not k.startswith(CHUNK) or control.tensors[k].dtype != torch.uint8 for k in names):
            raise ValueError("he decrypt: expected ciphertexts (uint8 tensors named __he_NNNNN)")
        ts = tenseal()
        context = self._client_context()
        values: list[float] = []
        for k in names:
            values.extend(ts.ckks_vector_from(context, _tensor_bytes(control.tensors[k])).decrypt())
        return Control(self.name, DECRYPT, {SUM: torch.tensor(values, dtype=torch.float64)})

    def _client_context(self) -> Any:
        if self._secret is None:
            if self.hp.keys is None:
                self._secret = make_context(self.hp.poly_degree, self.hp.scale_bits)
            else:
                context = tenseal().context_from(_read(Path(self.hp.keys) / SECRET_FILE, "a client"))
                if not context.is_private():
                    raise ValueError(f"plugin 'he': {Path(self.hp.keys) / SECRET_FILE} holds no secret key")
                self._secret = context
        return self._secret


def _read(path: Path, who: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        raise ValueError(
            f"plugin 'he': {who} needs {path}, which cannot be read; make the keys with `fedweave keys --out DIR`"
        ) from None


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.numpy().tobytes()
