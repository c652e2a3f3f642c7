"""Homomorphic encryption with CKKS (TenSEAL): the server keeps the global model encrypted.

Cheon, Kim, Kim & Song, "Homomorphic Encryption for Arithmetic of Approximate Numbers",
ASIACRYPT 2017; TenSEAL (Benaissa et al. 2021, https://arxiv.org/abs/2104.03152).

**Keys.** The federation's CKKS context is made once, before the run, with
``fedweave keys --out DIR``: ``DIR/secret.ctx`` (with the secret key) goes to the
clients, ``DIR/public.ctx`` (without it) to the server; the plugin's ``keys`` names the
folder. Without ``keys``, the plugin makes a fresh context in its process (simulation).
The context's modulus chain is [60, scale_bits, 60] bits: one level for the server's
product of a ciphertext by a plaintext scalar (the ring degree 4096 holds 109 bits, too
few: 8192 or 16384).

**Encoding (client).** The floating tensors of the update, flattened and multiplied by
the client's example count n_k, are packed into as many CKKS vectors as the model needs
(``poly_degree / 2`` values each) and encrypted; each ciphertext travels serialized as
a uint8 tensor (``__he_00000``, ...), so any transport carries it and its bytes are
counted. Layouts and integer tensors travel in the clear.

**The encrypted model (server).** The server's half (:class:`HEServer`) is built from
the *public* context's bytes alone: it never holds the secret key, so it can encrypt,
add and multiply by plaintext numbers, never decrypt. At the first broadcast it encrypts
the initial model w_0 (public anyway: the seeded initialisation) with the public key;
from then on it keeps the global model only encrypted (:meth:`HE.seal`) and steps it
each round by the clients' example-weighted mean delta::

    Enc(w_{t+1}) = Enc(w_t) + (1 / N_t) · Σ_k Enc(n_k Δ_k),     N_t = Σ_k n_k (public)

(:meth:`HE.combine`: additions cost no level, the one product by 1/N_t one, taken
from the fresh sum each round, so one level lasts the whole run). This is FedAvg's
and FedProx's server step; other strategies, a server-side evaluation
(``eval.every``), a ring and ``server_send`` plugins (ciphertexts cannot be compressed)
are refused when the config loads (:mod:`fedweave.rules`). The
plaintext update the strategy applies is zero for every floating tensor, so the
server's plaintext model stays w_0 (integer counters, which travel in the clear, are
combined as usual); the encrypted model is server state, saved in checkpoints.

**The broadcast (clients).** Every instruction, for training or federated evaluation,
carries Enc(w_t)'s ciphertexts in place of the model's floating tensors; each client
checks them (:func:`fedweave.federated.checks.check_ciphertexts`: exactly the ciphertexts the
layouts call for, bounded in size), decrypts them with ``secret.ctx`` (:meth:`HE.unseal`)
and trains on w_t; a broadcast that does not decrypt into finite values of the
model's size is refused with a reason (:class:`Refused`, with its verdict).

**The check (clients).** Before the server keeps a stepped model, it sends it to the
round's clients (control step ``check``, :meth:`HE.check`); each decrypts it as it would
a broadcast and answers a typed report, one int8 verdict (:data:`VERDICTS`). The model
is kept only if more clients accept it than refuse it; else the round is skipped, its
updates dropped, the model of the last accepted round kept (also in checkpoints), and
the record's ``he_refused`` counts the refusals. No client is ever asked to decrypt anything and
send the plaintext back: what a client sends is encrypted, but for a federated
evaluation's metrics (a client sends no training loss under HE). At the end the server writes the encrypted
model (``model.he.pt``); ``fedweave decrypt --keys DIR RUN_DIR``, run where
``secret.ctx`` is, writes the plaintext ``model.pt``. A simulation, whose clients and
their key live in the server's process, writes both.

**What it guarantees.** A server that holds ``public.ctx`` only and follows the
protocol (honest but curious) learns neither an update, nor an aggregate, nor the
model after round 0: it can decrypt nothing. **What it does not.** A server that
deviates can, with the public key, encrypt any model built from the ciphertexts it
holds (w_t plus a multiple of one client's update, say) and send it for a federated
evaluation: the metrics a client answers in the clear are then a function of that one
update, an oracle a few bits per round wide. (A training loss would be one too, so
under HE clients send none.) Every client holds the
same secret key, so one client that colludes with the server (or a server that also
runs a client) decrypts everything: each update, each aggregate. A threshold key,
which would close that, is not built. A client's update is checked as far as a
ciphertext can be (names, sizes, its framing: :mod:`~fedweave.plugins.secure.ckks_wire`,
that it adds to the model at its level and scale); its content cannot be. A poisoned
update that takes the model out of range (past the context's bound, or ``max_value``),
or a ciphertext under another key (noise over the modulus), is refused by the clients'
check and its round skipped, but its sender cannot be named; one inside the range
poisons the model, and robust rules, which need each update in the clear, are refused.
The check's verdict is one more bit of oracle for a deviating server.

Precision: CKKS is approximate; with the default scale 2^40 the decrypted model equals
plaintext FedAvg to about 1e-7 after 20 rounds (with 2^32, 6e-5: the rescaling prime
differs from the scale), and the model's values must stay below about
2^(60 − scale_bits).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from fedweave.errors import CheckpointError, ConfigError, RoundError, first_line
from fedweave.files import atomic_write_bytes
from fedweave.plugins.contracts import ControlExchange, Declaration, FreshDraws, PluginContext
from fedweave.plugins.secure.ckks_wire import check_vector
from fedweave.plugins.packing import FLAT, SEP, combine_plain, flatten, read_layout, unflatten
from fedweave.schema import opt
from fedweave.types import Control, Params, Update, UpdateKind
from fedweave.federated.checks import Rejected, check_ciphertexts

log = logging.getLogger(__name__)

SECRET_FILE = "secret.ctx"
PUBLIC_FILE = "public.ctx"
CHUNK = "__he_"
OUTER_BITS = 60
"""The first data prime and the special prime of the chain [60, scale_bits, 60]."""
CHECK = "check"
"""The control step by which the server asks the round's clients to check the model it combined."""
VERDICT = "verdict"
ACCEPTED, OUT_OF_RANGE, UNDECRYPTABLE, MALFORMED = range(4)
VERDICTS = {ACCEPTED: "accepted", OUT_OF_RANGE: "out of range", UNDECRYPTABLE: "undecryptable", MALFORMED: "malformed"}
"""A client's typed report on a model it was sent: one int8 code."""


class Refused(ValueError):
    """A model a client will not train on, with the verdict it reports (:data:`VERDICTS`)."""

    def __init__(self, verdict: int, reason: str):
        super().__init__(reason)
        self.verdict = verdict


@dataclass
class HEHParams:
    keys: str | None = opt(
        None, help="folder made by `fedweave keys`: clients read secret.ctx, the server public.ctx (none: fresh keys)"
    )
    poly_degree: Literal[8192, 16384] = opt(
        8192, help="without keys: CKKS ring degree (slots per ciphertext: half; 4096 holds too few modulus bits)"
    )
    scale_bits: int = opt(40, ge=20, le=50, help="without keys: CKKS scale 2^bits (precision against range)")
    max_value: float | None = opt(
        None, gt=0, help="clients refuse a model with an entry beyond ±max_value (none: the CKKS context's bound, "
        "2^(60 - scale_bits))"
    )

    def validate(self, prefix: str) -> None:
        if self.keys is not None and not self.keys.strip():
            raise ConfigError(
                f"config key '{prefix}.keys': an empty folder name (it would read the keys of the current directory); "
                "name the folder of `fedweave keys`, or leave keys out for fresh keys in a simulation"
            )


def tenseal() -> Any:
    try:
        import tenseal as ts
    except ImportError:
        raise ImportError("plugin 'he' needs TenSEAL: pip install 'fedweave[he]'") from None
    return ts


def coeff_mod_bits(scale_bits: int) -> list[int]:
    """The modulus chain: one level (``scale_bits``) for the product by 1/N each round."""
    return [OUTER_BITS, scale_bits, OUTER_BITS]


def make_context(poly_degree: int, scale_bits: int) -> Any:
    """A fresh CKKS context with its secret key."""
    ts = tenseal()
    context = ts.context(
        ts.SCHEME_TYPE.CKKS, poly_modulus_degree=poly_degree, coeff_mod_bit_sizes=coeff_mod_bits(scale_bits)
    )
    context.global_scale = 2.0**scale_bits
    return context


def public_bytes(context: Any) -> bytes:
    """The serialized context without its secret key."""
    public = context.copy()
    public.make_context_public()
    return public.serialize()


def write_keys(out: str | Path, poly_degree: int = 8192, scale_bits: int = 40) -> tuple[Path, Path]:
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
    return poly_degree(context) // 2


def poly_degree(context: Any) -> int:
    return int(context.seal_context().data.key_context_data().parms().poly_modulus_degree())


def max_ciphertext_bytes(context: Any) -> int:
    """A bound on one serialized ciphertext of ``context``: two polynomials over the chain's
    primes, 8 bytes a coefficient, and room for the header."""
    return 2 * len(coeff_mod_bits(0)) * poly_degree(context) * 8 + 65536


def value_bound(context: Any) -> float:
    """2^(60 − scale_bits): a model value past it wraps around the modulus left after the step's rescaling,
    and what a wrong key decrypts lies far beyond it (noise over the whole modulus)."""
    return 2.0 ** (OUTER_BITS - math.log2(context.global_scale))


def chunk_names(size: int, slots: int) -> list[str]:
    """The ciphertexts of a vector of ``size`` values, ``slots`` a ciphertext."""
    return [f"{CHUNK}{i:05d}" for i in range(math.ceil(size / slots))]


def chunk_sizes(size: int, slots: int) -> Iterator[int]:
    """The values each ciphertext of :func:`chunk_names` holds."""
    for start in range(0, size, slots):
        yield min(slots, size - start)


def check_levels(context: Any, where: str) -> None:
    """Refuse a context without the level the product by 1/N needs (keys of an older ``fedweave keys``)."""
    try:
        tenseal().ckks_vector(context, [0.0]) * 1.0
    except Exception:  # TenSEAL raises ValueError or RuntimeError at the end of the chain
        raise ConfigError(
            f"plugin 'he': the CKKS context of {where} has no level for the product by a number that the encrypted "
            "model needs (keys made for additions only?); make the keys again with `fedweave keys --out DIR`"
        ) from None


class HEServer:
    """The server half: the public context only (no secret key); it encrypts, adds, scales."""

    def __init__(self, context_bytes: bytes, where: str = "the server"):
        self.context = _context(context_bytes, where)
        if self.context.is_private():
            raise ConfigError("plugin 'he': the server's HE context holds a secret key; give the server public.ctx only")
        check_levels(self.context, where)
        self._zeros: dict[int, Any] = {}

    def encrypt(self, values: Any) -> list[bytes]:
        """``values`` encrypted with the public key, ``slot_count`` values a ciphertext."""
        ts, slots = tenseal(), slot_count(self.context)
        return [ts.ckks_vector(self.context, values[i : i + slots]).serialize() for i in range(0, len(values), slots)]

    def step(self, model: bytes, ciphertexts: list[bytes], scale: float) -> bytes:
        """``model + scale · Σ ciphertexts``, still encrypted."""
        ts = tenseal()
        total = ts.ckks_vector_from(self.context, ciphertexts[0])
        for data in ciphertexts[1:]:
            total += ts.ckks_vector_from(self.context, data)
        return (ts.ckks_vector_from(self.context, model) + total * scale).serialize()

    def check(self, data: bytes, size: int) -> None:
        """Raise ValueError unless ``data`` is a ciphertext of ``size`` values that can be summed
        and scaled as a fresh one (same scale, a level to spare)."""
        try:
            vector = open_vector(self.context, data, size)
            # the cached zero on the left: TenSEAL may switch the right operand's level in place
            (self._zero(size) + vector) * 1.0
        except Exception as exc:  # TenSEAL's parser and evaluator raise several types
            raise ValueError(first_line(exc)) from None

    def _zero(self, size: int) -> Any:
        if size not in self._zeros:
            self._zeros[size] = tenseal().ckks_vector(self.context, [0.0] * size)
        return self._zeros[size]


def open_vector(context: Any, data: bytes, size: int) -> Any:
    """The CKKS vector ``data`` serializes, of ``size`` values in one ciphertext of two polynomials at
    ``context``'s scale; ValueError (with the reason) for any other, before TenSEAL parses its framing."""
    check_vector(data, size, context.global_scale)
    vector = tenseal().ckks_vector_from(context, data)
    (ciphertext,) = vector.ciphertext()
    if ciphertext.size() != 2:
        raise ValueError(f"its ciphertext has {ciphertext.size()} polynomials, not 2")
    return vector


def _one_process(params: HEHParams) -> str | None:
    return "without keys each process would make its own CKKS context; make them with `fedweave keys`" if params.keys is None else None


class HE:
    """Homomorphic encryption (CKKS, TenSEAL): the server keeps the model encrypted, clients decrypt it."""

    name = "he"
    HParams = HEHParams
    accepts = frozenset(UpdateKind)
    combines_encoded = True
    declares = Declaration(stage="secure", points=("client_send",), one_process=_one_process)

    @staticmethod
    def fresh_draws(params: HEHParams) -> FreshDraws:
        """CKKS encryption is randomized: a round done again decrypts to values that differ in the last bits."""
        return FreshDraws("encryption randomness", releases=False)

    def __init__(self, hp: HEHParams):
        self.hp = hp
        self._secret: Any = None  # the client half's context, loaded when a client first needs it
        self._server: HEServer | None = None
        self.model: dict[str, torch.Tensor] = {}  # server: Enc(w_t), by ciphertext name; empty before round 1
        self._clear: Params = {}  # server: what the last broadcast carried in the clear (layouts, integer tensors)
        self.refused = 0  # server: the clients that refused the round's combined model

    @property
    def server(self) -> HEServer:
        """The server half, built from the public context alone."""
        if self._server is None:
            if self.hp.keys is None:
                self._server = HEServer(public_bytes(self._client_context()))
            else:
                path = Path(self.hp.keys) / PUBLIC_FILE
                self._server = HEServer(_read(path, "the server"), str(path))
        return self._server

    def seal(self, params: Params) -> Params:
        """Server: the global model as broadcast: Enc(w_t)'s ciphertexts in place of the floating
        tensors of ``params``, its layouts and integer tensors in the clear. Enc(w_0) is made from
        ``params`` with the public key at the first broadcast."""
        vector, clear = flatten(params)
        if not self.model:
            ciphertexts = self.server.encrypt(vector.numpy())
            names = chunk_names(vector.numel(), slot_count(self.server.context))
            self.model = {name: _bytes_tensor(c) for name, c in zip(names, ciphertexts)}
        self._clear = clear
        return {**self.model, **clear}

    def sealed_bytes(self, params: Params) -> int:
        """Server: the bytes of the largest message the encrypted model of ``params`` makes: the first
        broadcast, Enc(w_0), each of whose fresh ciphertexts is as large as one of a client's encrypted
        update (about 57 bytes a value at either ring degree; later broadcasts, one level down, about
        32), with what travels in the clear. Measured on one ciphertext of the model's first values: a
        ciphertext's size does not depend on how many of its slots are used."""
        vector, clear = flatten(params)
        slots = slot_count(self.server.context)
        count = math.ceil(vector.numel() / slots)
        one = len(self.server.encrypt(vector[:slots].numpy())[0]) if count else 0
        return count * one + sum(t.numel() * t.element_size() for t in clear.values())

    def check_encoded(self, update: Update) -> None:
        """Server: raise unless ``update``'s ciphertexts are those of the model (names, sizes) and add
        to it, and what it sends in the clear has the broadcast's layouts, names, shapes and dtypes."""
        if not self.model:
            raise ValueError("he: an encrypted update before any broadcast of the model")
        ciphertexts = {k: t for k, t in update.tensors.items() if k.startswith(CHUNK)}
        clear = {k: t for k, t in update.tensors.items() if not k.startswith(CHUNK)}
        check_ciphertexts(ciphertexts, list(self.model), max_ciphertext_bytes(self.server.context))
        if clear.keys() != self._clear.keys():
            raise ValueError("he: the tensors it sends in the clear are not the model's layouts and integer tensors")
        for key, tensor in clear.items():
            model = self._clear[key]
            flat = key.endswith(SEP + FLAT)
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != model.dtype or tensor.shape != model.shape or (
                flat and not torch.equal(tensor, model)
            ):
                raise ValueError(f"he: its clear tensor {key!r} does not match the model's")
        size = _flat_size(self._clear)
        for name, n in zip(self.model, chunk_sizes(size, slot_count(self.server.context))):
            try:
                self.server.check(_tensor_bytes(ciphertexts[name]), n)
            except ValueError as exc:
                raise ValueError(f"he: ciphertext {name} cannot be added to the model: {exc}") from None

    def combine(self, updates: list[Update], ctx: PluginContext, exchange: ControlExchange) -> Update:
        """Server: Enc(w) ← Enc(w) + (1/Σ n_k)·Σ_k Enc(n_k Δ_k) with the public context alone, kept only once
        the round's clients accept it (:meth:`check`). The update returned is the plaintext step: zero for
        every floating tensor (the step was taken on the encrypted model), the integer tensors combined as
        in the clear. Should TenSEAL refuse the step, or the clients the model, the round is skipped
        (:class:`~fedweave.errors.RoundError`) and the model kept."""
        total = sum(u.num_examples for u in updates)
        try:
            model = {
                name: _bytes_tensor(
                    self.server.step(_tensor_bytes(c), [_tensor_bytes(u.tensors[name]) for u in updates], 1.0 / total)
                )
                for name, c in self.model.items()
            }
            clear = combine_plain([{k: t for k, t in u.tensors.items() if not k.startswith(CHUNK)} for u in updates])
        except Exception as exc:  # TenSEAL's evaluator raises several types
            raise RoundError(f"he: the encrypted updates could not be added to the model: {first_line(exc)}") from None
        self.check(ctx.round, model, sorted({c for u in updates for c in u.senders}), exchange)
        self.model = model
        return Update(kind=updates[0].kind, tensors=clear, num_examples=total, applied=list(updates[0].applied))

    def check(self, rnd: int, model: dict[str, torch.Tensor], clients: list[int], exchange: ControlExchange) -> None:
        """Server: send ``model`` (the round's combined Enc(w)) to ``clients``, which decrypt it and report a
        verdict; keep it only if more of them accept it than refuse it (a model beyond the bound: an update
        scaled past it, a ciphertext under another key), else raise RoundError. A report that is not one
        int8 verdict is not counted."""
        answers = exchange({c: Control(self.name, CHECK, {**model, **self._clear}) for c in clients})
        verdicts: dict[int, int] = {}
        for c, body in sorted(answers.items()):
            tensor = body.tensors.get(VERDICT)
            if set(body.tensors) != {VERDICT} or not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int8 or (
                tensor.shape != (1,) or int(tensor) not in VERDICTS
            ):
                log.warning("round %d: client %d's verdict on the combined model is malformed; not counted", rnd, c)
                continue
            verdicts[c] = int(tensor)
        refused = {c: v for c, v in verdicts.items() if v != ACCEPTED}
        self.refused = len(refused)
        if len(verdicts) - len(refused) <= len(refused):
            reasons = ", ".join(f"client {c}: {VERDICTS[v]}" for c, v in list(refused.items())[:5])
            raise RoundError(
                f"he: {len(refused)} of the {len(verdicts)} clients that answered (of {len(clients)} asked) refuse the "
                f"round's combined model ({reasons or 'none accepts it'}); the round's updates are dropped and the "
                "model of the last accepted round kept"
            )
        if refused:
            log.warning("round %d: %d of %d clients refuse the combined model, a minority; it is kept", rnd,
                        len(refused), len(verdicts))

    def metrics(self) -> dict[str, float]:
        """``he_refused``: the clients that refused the round's combined model."""
        return {"he_refused": float(self.refused)}

    def decode(self, payload: Update, ctx: PluginContext) -> Update:
        """Server: the plaintext step of a combined update (zeros where the model is encrypted)."""
        if any(k.startswith(CHUNK) for k in payload.tensors):
            raise ValueError("he decodes only the combined step of a round, never one client's ciphertexts")
        size = _flat_size(payload.tensors)
        return replace(payload, tensors=unflatten(torch.zeros(size, dtype=torch.float64), payload.tensors))

    def encode(self, payload: Update, ctx: PluginContext) -> Update:
        """Client: n_k times the update's floating values, encrypted."""
        ts = tenseal()
        context = self._client_context()
        vector, rest = flatten(payload.tensors)
        values = (vector * payload.num_examples).numpy()
        slots = slot_count(context)
        chunks = {
            name: _bytes_tensor(ts.ckks_vector(context, values[i : i + slots]).serialize())
            for name, i in zip(chunk_names(len(values), slots), range(0, len(values), slots))
        }
        return replace(payload, tensors={**chunks, **rest})

    def unseal(self, tensors: Params) -> Params:
        """Client: the global model a broadcast carries, decrypted with ``secret.ctx``; :class:`Refused`
        (a ValueError with the verdict and the reason) for one that is not the ciphertexts of a model of
        finite values within the bound (``max_value``, else the context's)."""
        try:
            return self._unseal(tensors)
        except Refused:
            raise
        except (ValueError, Rejected) as exc:  # names, layouts, the ciphertexts' count and sizes
            raise Refused(MALFORMED, str(exc)) from None

    def _unseal(self, tensors: Params) -> Params:
        if not all(isinstance(k, str) for k in tensors):
            raise ValueError("he: the broadcast names a tensor by something other than a string")
        ciphertexts = {k: t for k, t in tensors.items() if k.startswith(CHUNK)}
        clear = {k: t for k, t in tensors.items() if not k.startswith(CHUNK)}
        try:
            size = _flat_size(clear)
        except Exception:  # a layout that is no layout: wrong dtype code, a negative size, not a tensor
            raise ValueError("he: the broadcast's layouts are malformed") from None
        context = self._client_context()
        slots = slot_count(context)
        count = -(-size // slots)  # compared before naming them: a layout may claim 2^80 values
        if count > len(ciphertexts):
            raise ValueError(
                f"he: the broadcast lacks {count - len(ciphertexts)} of the {count} ciphertexts its layouts call for"
            )
        if count < len(ciphertexts):
            raise ValueError(f"he: the broadcast holds {len(ciphertexts)} ciphertexts, its layouts call for {count}")
        check_ciphertexts(ciphertexts, chunk_names(size, slots), max_ciphertext_bytes(context))
        values: list[float] = []
        for name, n in zip(chunk_names(size, slots), chunk_sizes(size, slots)):
            try:
                values.extend(open_vector(context, _tensor_bytes(ciphertexts[name]), n).decrypt())
            except Exception as exc:  # the framing's reason, or TenSEAL's parser (several types)
                raise Refused(
                    UNDECRYPTABLE, f"he: broadcast ciphertext {name} cannot be decrypted: {first_line(exc)}"
                ) from None
        vector = torch.tensor(values, dtype=torch.float64)
        if not bool(torch.isfinite(vector).all()):
            raise Refused(OUT_OF_RANGE, "he: the broadcast model decrypts to NaN or infinite values")
        bound = value_bound(context)
        if vector.numel() and float(vector.abs().max()) >= bound:
            raise Refused(
                OUT_OF_RANGE,
                f"he: the broadcast model decrypts to values beyond ±{bound:g}, past what a ciphertext of this "
                "context holds (a key of another federation, or a model that overflowed)",
            )
        if vector.numel() and self.hp.max_value is not None and float(vector.abs().max()) > self.hp.max_value:
            raise Refused(
                OUT_OF_RANGE,
                f"he: the broadcast model decrypts to values up to ±{float(vector.abs().max()):g}, beyond "
                f"max_value={self.hp.max_value:g}",
            )
        return unflatten(vector, clear)

    def answer(self, control: Control, ctx: PluginContext) -> Control:
        """Client: its verdict on the model the server combined (:data:`VERDICTS`), the reason logged."""
        if control.step != CHECK:
            raise ValueError(f"he has no step {control.step!r}")
        try:
            self.unseal(control.tensors)
            verdict = ACCEPTED
        except Refused as exc:
            log.warning("round %d: client %d refuses the combined model: %s", ctx.round, ctx.client_id, exc)
            verdict = exc.verdict
        return Control(self.name, CHECK, {VERDICT: torch.tensor([verdict], dtype=torch.int8)})

    def setup(self, rnd: int, cohort: list[int], exchange: ControlExchange) -> list[int]:
        """Server: no set-up; every client of the cohort trains."""
        self.refused = 0
        return cohort

    def state_dict(self) -> dict[str, Any]:
        """The encrypted global model (uint8 tensors): server state, kept in checkpoints."""
        return {"model": dict(self.model)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The encrypted model of a checkpoint; refused when it was made under fresh keys (no ``keys``),
        which died with the process that made them."""
        model = dict(state.get("model", {}))
        if model and self.hp.keys is None:
            raise CheckpointError(
                "plugin 'he' made fresh CKKS keys in the process that wrote this checkpoint, and no key can decrypt "
                "its encrypted model now; a run with he resumes only with keys from `fedweave keys` (plugin key 'keys')"
            )
        self.model = model

    def _client_context(self) -> Any:
        if self._secret is None:
            if self.hp.keys is None:
                self._secret = make_context(self.hp.poly_degree, self.hp.scale_bits)
            else:
                path = Path(self.hp.keys) / SECRET_FILE
                context = _context(_read(path, "a client"), str(path))
                if not context.is_private():
                    raise ConfigError(f"plugin 'he': {path} holds no secret key")
                check_levels(context, str(path))
                self._secret = context
        return self._secret


def _read(path: Path, who: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        raise ConfigError(
            f"plugin 'he': {who} needs {path}, which cannot be read; make the keys with `fedweave keys --out DIR`"
        ) from None


def _context(data: bytes, where: str) -> Any:
    try:
        return tenseal().context_from(data)
    except Exception:  # TenSEAL's parser raises several types
        raise ConfigError(f"plugin 'he': {where} holds no CKKS context; make the keys with `fedweave keys --out DIR`") from None


def _flat_size(tensors: Params) -> int:
    """The values of the flattened vector whose layouts (``name.__flat``) ``tensors`` carry."""
    return sum(math.prod(read_layout(v)[1]) for k, v in tensors.items() if k.endswith(SEP + FLAT))


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.numpy().tobytes()
