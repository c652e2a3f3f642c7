"""What every compression plugin shares: both directions, error feedback, per-client state.

A compression plugin is a *codec* (``compress`` one tensor into a few compact tensors,
``decompress`` them back) driven by :class:`Compressor`, which knows the two directions:

- **uplink** (``client_send``): each floating tensor of the update is compressed (an empty
  one travels as it is). With error feedback the client keeps what compression lost (the
  residual) and adds it to the next update it compresses (Seide et al. 2014;
  Karimireddy et al. 2019), so nothing is lost for good, only delayed.
- **downlink** (``server_send``): the server sends each client the *difference* between
  the global model and the model that client holds, compressed; both ends then add the
  decompressed difference to their copy of the client's model, so the copies stay
  equal and what compression lost is sent with a later broadcast (error feedback by
  construction). A client the server has sent nothing to yet gets the dense model.
  Evaluation instructions travel dense.

  Each training broadcast names the model it gives (a fresh 63-bit id), and a difference
  also the model it is a difference of (:data:`DELTA`, :data:`MODEL`): a client decodes a
  difference only against the model of that id, and refuses any other (with the reason,
  logged) rather than decoding it into a wrong model. The copies part whenever the server
  encoded a broadcast the client never decoded (its job failed, missed the deadline, its
  stream broke off), or the client decoded one twice, restarted, or holds a model a resumed
  server never checkpointed; so the server sends the dense model to every client whose
  last job failed (``failed``: a refusal fails the job too), and the run goes on from it.

State is per client id and lives in the plugin instance: in simulation one plugin
object serves every client (and the server), so the client side's residuals and model
copies and the server side's copies are kept apart, keyed by ``ctx.client_id``. The
downlink needs the server to hold one model copy per client it has trained with (and
each client one copy of its own): memory grows with the clients reached.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Protocol, runtime_checkable

import torch

from fedweave.plugins.contracts import Declaration, Payload, PluginContext
from fedweave.plugins.packing import FLAT, LAYOUT, SEP, decode_all, encode_fields, read_layout
from fedweave.seeding import derive_seed, derive_seeds
from fedweave.types import Instruction, Params, TaskKind, Update, UpdateKind

if TYPE_CHECKING:
    from fedweave.federated.checks import Specs

log = logging.getLogger("fedweave.plugins.compression")

DELTA = "__delta"
"""Marks a broadcast that carries a compressed difference rather than the dense model: int64
``[FORMAT, against, gives]``, the ids of the model it is a difference of and of the model it gives."""

MODEL = "__model"
"""A dense training broadcast's id of the model it gives: int64 ``[FORMAT, gives]``."""

FORMAT = 1
"""The version of the :data:`DELTA` and :data:`MODEL` markers (their first entry)."""


@dataclass(frozen=True)
class Site:
    """Which tensor of which payload a codec works on: seeds its randomness, keys its state."""

    plugin: str
    seed: int
    direction: str  # "up" (client update) or "down" (broadcast)
    round: int
    client_id: int
    name: str

    def seed_for(self, *keys: int | str) -> int:
        return derive_seed(self.seed, self.plugin, self.direction, self.round, *keys)

    def generator(self, *keys: int | str) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed_for(*keys))

    def stream(self) -> tuple[str, int, str, int, int]:
        """What names this site's streams but its tensor."""
        return self.plugin, self.seed, self.direction, self.round, self.client_id


def tensor_seeds(sites: Sequence[Site]) -> list[int]:
    """Each site's ``seed_for(client_id, name)``, its tensor's own stream; the keys that
    the sites of one payload share are read once."""
    if not sites or any(site.stream() != sites[0].stream() for site in sites):
        return [site.seed_for(site.client_id, site.name) for site in sites]
    plugin, seed, direction, rnd, client = sites[0].stream()
    return derive_seeds(seed, (plugin, direction, rnd, client), [site.name for site in sites])


class Codec(Protocol):
    def compress(self, x: torch.Tensor, site: Site) -> dict[str, torch.Tensor] | None:
        """Compact fields of ``x`` (float32); None sends ``x`` as it is."""

    def decompress(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """The float32 tensor of ``shape`` that ``fields`` stand for."""


@runtime_checkable
class ManyCodec(Protocol):
    """A codec that also works on all the tensors of a payload at once (one pass of each
    kernel over all of them rather than one per tensor), with the same results."""

    def compress_many(self, xs: list[torch.Tensor], sites: list[Site]) -> list[dict[str, torch.Tensor] | None]: ...

    def decompress_many(self, fields: list[dict[str, torch.Tensor]], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]: ...


@runtime_checkable
class SparseCodec(Protocol):
    """A codec whose fields carry some entries of a tensor where they lie: error feedback
    asks it for the fields and the residual at once, the residual made in place from the
    positions it has at hand rather than through a dense decoded tensor."""

    def compress_keeping_rest(self, xs: list[torch.Tensor], sites: list[Site]) -> list[dict[str, torch.Tensor]]:
        """The fields of each x (contiguous, the caller's), and each x left holding
        ``x - decompress(fields, x.shape)``, in place."""


@runtime_checkable
class TypedCodec(Protocol):
    """A codec that names every field it sends and its dtype: a received field it does not
    name, or of another dtype (a peer's data), is refused before it is decoded."""

    def field_dtypes(self) -> dict[str, torch.dtype]: ...


@runtime_checkable
class CheckedCodec(Protocol):
    """A codec that checks a peer's fields against the layout they claim before anything is
    built from them: a field the shape implies but missing, or of another size than the
    codec sends for that shape, is refused (``ValueError``), so a few bytes cannot make the
    receiver allocate for a tensor the fields do not hold."""

    def check_fields(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> None: ...


COMPRESSOR = Declaration(stage="compress", points=("server_send", "client_send"))
"""What every compressor declares (quantize and randk also when their payloads can be summed)."""


class Compressor:
    """A compression plugin: a codec driven in both directions (see the module doc)."""

    name: ClassVar[str]
    accepts: ClassVar[frozenset[UpdateKind]] = frozenset({UpdateKind.DELTA, UpdateKind.GRADIENT})
    combines_encoded: ClassVar[bool] = False
    declares: ClassVar[Declaration] = COMPRESSOR

    def __init__(self, codec: Codec, error_feedback: bool):
        self.codec = codec
        self.many = codec if isinstance(codec, ManyCodec) else None
        self.sparse = codec if isinstance(codec, SparseCodec) else None
        self.sends = codec.field_dtypes() if isinstance(codec, TypedCodec) else None  # its fields and their dtypes
        self.checked = codec if isinstance(codec, CheckedCodec) else None
        self.error_feedback = error_feedback
        self.seed = 0
        self.residuals: dict[int, Params] = {}  # client side, uplink
        self.sent: dict[int, Params] = {}  # server side: the model each client holds
        self.sent_ids: dict[int, int] = {}  # server side: the id of each of those models
        self.held: dict[int, Params] = {}  # client side: the model this client holds
        self.held_ids: dict[int, int] = {}  # client side: its id (none for a broadcast that named none)

    def bind(self, config: Any) -> None:
        self.seed = config.seed

    def encode(self, payload: Payload, ctx: PluginContext) -> Payload:
        if isinstance(payload, Update):
            return self._encode_update(payload, ctx)
        if payload.task is TaskKind.TRAIN:
            return self._encode_broadcast(payload, ctx)
        return replace(payload)

    def decode(self, payload: Payload, ctx: PluginContext) -> Payload:
        if isinstance(payload, Update):
            return replace(payload, tensors=decode_all(payload.tensors, self._decompress_many, ctx.expected))
        if payload.task is TaskKind.TRAIN:
            return self._decode_broadcast(payload, ctx)
        return replace(payload)

    def failed(self, failures: dict[int, str]) -> None:
        """Server side: the clients whose job failed (no reply) may or may not have decoded its
        broadcast, so each gets the dense model next; a client that refused a difference is one."""
        for cid in failures:
            self.sent.pop(cid, None)
            self.sent_ids.pop(cid, None)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": self.residuals, "sent": self.sent, "held": self.held, "sent_ids": self.sent_ids,
                "held_ids": self.held_ids, "codec": _codec_state(self.codec)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals, self.sent, self.held = state["residuals"], state["sent"], state["held"]
        # a checkpoint from before the ids: each client gets the dense model next, then ids
        self.sent_ids, self.held_ids = state.get("sent_ids", {}), state.get("held_ids", {})
        self.sent = {cid: model for cid, model in self.sent.items() if cid in self.sent_ids}
        if hasattr(self.codec, "load_state_dict"):
            self.codec.load_state_dict(state["codec"])

    # ------------------------------------------------------------------ uplink

    def _encode_update(self, update: Update, ctx: PluginContext) -> Update:
        residual = self.residuals.get(ctx.client_id, {}) if self.error_feedback else {}
        names = [name for name, tensor in update.tensors.items() if _compressible(tensor)]
        xs = [_accumulated(update.tensors[name], residual.get(name), copy=self.error_feedback) for name in names]
        sites = [self._site("up", ctx, name) for name in names]
        fields: Sequence[dict[str, torch.Tensor] | None]
        if self.error_feedback and self.sparse is not None:
            fields = self.sparse.compress_keeping_rest(xs, sites)
            self.residuals[ctx.client_id] = dict(zip(names, xs))
        elif self.error_feedback:  # what was not sent: each x, owned here, less what its fields decode to
            fields = self._compress_many(xs, sites)
            self.residuals[ctx.client_id] = {name: self._unsent(x, f) for name, x, f in zip(names, xs, fields)}
        else:
            fields = self._compress_many(xs, sites)
        return replace(update, tensors=encode_fields(update.tensors, dict(zip(names, fields))))

    # ---------------------------------------------------------------- downlink

    def _encode_broadcast(self, ins: Instruction, ctx: PluginContext) -> Instruction:
        cid = ctx.client_id
        ref, against = self.sent.get(cid), self.sent_ids.get(cid)
        gives = self.sent_ids[cid] = secrets.randbits(63)
        if ref is None or against is None or not _same_layout(ref, ins.params):
            self.sent[cid] = _copy(ins.params)
            return replace(ins, params={**ins.params, MODEL: _marker(gives)})
        delta = {k: v - ref[k] if v.is_floating_point() else v for k, v in ins.params.items()}
        names = [name for name, tensor in delta.items() if _compressible(tensor)]
        fields = self._compress_many([delta[n].to(torch.float32) for n in names], [self._site("down", ctx, n) for n in names])
        encoded = encode_fields(delta, dict(zip(names, fields)))
        self.sent[cid] = _advance(ref, decode_all(encoded, self._decompress_many))
        return replace(ins, params={**encoded, DELTA: _marker(against, gives)})

    def _decode_broadcast(self, ins: Instruction, ctx: PluginContext) -> Instruction:
        cid = ctx.client_id
        if DELTA not in ins.params:
            params = {k: v for k, v in ins.params.items() if k != MODEL}
            gives = self._read_marker(ins.params, MODEL, 1, ctx)[0] if MODEL in ins.params else None
            self.held[cid] = _copy(params)
            if gives is None:  # a model no difference can name
                self.held_ids.pop(cid, None)
            else:
                self.held_ids[cid] = gives
            return replace(ins, params=params)
        against, gives = self._read_marker(ins.params, DELTA, 2, ctx)
        held, held_id = self.held.get(cid), self.held_ids.get(cid)
        if held is None or held_id != against:
            holds = "no model" if held is None else "no model a difference can name" if held_id is None else f"model {held_id:x}"
            self._refuse(ctx, f"a compressed broadcast that is a difference of model {against:x}, but client {cid} "
                              f"holds {holds} (a broadcast it never decoded, or decoded twice, or a restart); "
                              "refused rather than decoded into a wrong model: the server sends the dense model next")
        encoded = {k: v for k, v in ins.params.items() if k != DELTA}
        delta = decode_all(encoded, self._decompress_many, ctx.expected)
        if not _same_layout(held, delta):  # the held model's tensors, shapes and dtypes, as the server encodes them
            raise ValueError(
                f"plugin {self.name!r}: a compressed broadcast that is not a difference of the model client {cid} holds"
            )
        model = _advance(held, delta)
        self.held[cid], self.held_ids[cid] = model, gives
        return replace(ins, params=_copy(model))

    def _read_marker(self, params: Params, key: str, ids: int, ctx: PluginContext) -> list[int]:
        """The ``ids`` model ids of a peer's marker ``key``, once it is ``[FORMAT, *ids]`` in int64."""
        value = params[key]
        if not (isinstance(value, torch.Tensor) and value.dtype == torch.int64 and value.dim() == 1
                and value.numel() == 1 + ids):
            what = f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            self._refuse(ctx, f"a broadcast whose {key!r} is {what}, not {1 + ids} int64 entries")
        version, *named = (int(v) for v in value.tolist())
        if version != FORMAT:
            self._refuse(ctx, f"a broadcast whose {key!r} is of format {version}, this client reads {FORMAT}: "
                              "run one fedweave version on every node")
        if any(i < 0 for i in named):
            self._refuse(ctx, f"a broadcast whose {key!r} names model ids {named}, not ids of 63 bits")
        return named

    def _refuse(self, ctx: PluginContext, why: str) -> NoReturn:
        """Raise (and log) a refusal of client ``ctx.client_id``'s broadcast of round ``ctx.round``."""
        log.warning("round %d: client %d refuses %s", ctx.round, ctx.client_id, why)
        raise ValueError(f"plugin {self.name!r}: {why}")

    # ----------------------------------------------------------------- helpers

    def _site(self, direction: str, ctx: PluginContext, name: str) -> Site:
        return Site(self.name, self.seed, direction, ctx.round, ctx.client_id, name)

    def _compress_many(self, xs: list[torch.Tensor], sites: list[Site]) -> list[dict[str, torch.Tensor] | None]:
        if self.many is not None and xs:
            return self.many.compress_many(xs, sites)
        return [self.codec.compress(x, site) for x, site in zip(xs, sites)]

    def check_summed(self, tensors: Params, expected: Specs) -> None:
        """Raise ``ValueError`` unless ``tensors`` (a client's update as this plugin, summable, encoded
        it and a combining plugin after it carries it, on receipt) encode each floating tensor of
        ``expected`` with entries as the fields this codec sends for its shape: the floating ones as
        their layouts in the summed vector (``name.__part.__flat``), the others in the clear. One
        client's other fields would make the clients disagree when the round's updates are combined."""
        fields: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            name, _, part = key.rpartition(SEP)
            if part == FLAT and SEP in name:  # a field in the summed vector: its layout stands for it
                name, _, part = name.rpartition(SEP)
                dtype, shape = read_layout(value)
                value = torch.empty(shape, dtype=dtype, device="meta")
            if name and part not in (LAYOUT, FLAT):
                fields.setdefault(name, {})[part] = value
        names = [n for n, spec in expected.items() if spec.dtype.is_floating_point and math.prod(spec.shape) > 0]
        laid = {key.rpartition(SEP)[0] for key in tensors if key.endswith(SEP + LAYOUT)}
        if fields.keys() != set(names) or laid != set(names):
            raise ValueError(f"plugin {self.name!r}: the update encodes {sorted(fields)[:5]}, not the model's "
                             f"floating tensors {sorted(names)[:5]}")
        self._check(names, [fields[n] for n in names], [expected[n].shape for n in names])

    def _decompress_many(
        self, names: list[str], fields: list[dict[str, torch.Tensor]], shapes: list[tuple[int, ...]]
    ) -> list[torch.Tensor]:
        self._check(names, fields, shapes)
        if self.many is not None and fields:
            return self.many.decompress_many(fields, shapes)
        return [self.codec.decompress(f, shape) for f, shape in zip(fields, shapes)]

    def _check(self, names: list[str], fields: list[dict[str, torch.Tensor]], shapes: list[tuple[int, ...]]) -> None:
        """Raise ``ValueError`` unless each tensor's fields are those the codec sends for its shape."""
        if self.sends is not None:
            self._check_dtypes(names, fields, self.sends)
        if self.checked is not None:
            for name, parts, shape in zip(names, fields, shapes):
                try:
                    self.checked.check_fields(parts, shape)
                except ValueError as exc:
                    raise ValueError(f"plugin {self.name!r}: fields of {name!r} {shape}: {exc}") from None

    def _check_dtypes(
        self, names: list[str], fields: list[dict[str, torch.Tensor]], sent: dict[str, torch.dtype]
    ) -> None:
        """Raise ``ValueError`` unless every field is one the codec ``sent``, of its dtype."""
        for name, parts in zip(names, fields):
            for part, tensor in parts.items():
                dtype = getattr(tensor, "dtype", type(tensor).__name__)
                if part not in sent or dtype != sent[part]:
                    sends = ", ".join(f"{k} ({v})" for k, v in sent.items())
                    raise ValueError(f"plugin {self.name!r}: field {part!r} of {name!r} is {dtype}; it sends {sends}")

    def _unsent(self, x: torch.Tensor, fields: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """``x`` (owned) less what ``fields`` decode to, in place: the residual error feedback keeps."""
        if fields is None:
            return x - x
        return x.sub_(self.codec.decompress(fields, tuple(x.shape)).reshape(x.shape))


def _compressible(tensor: torch.Tensor) -> bool:
    """A floating tensor with entries; an empty one (a zero-size buffer) travels as it is:
    it has no bytes to save, and a codec's "at least one entry" has none to pick."""
    return tensor.is_floating_point() and tensor.numel() > 0


def _accumulated(tensor: torch.Tensor, residual: torch.Tensor | None, copy: bool) -> torch.Tensor:
    """``tensor`` in float32 plus the ``residual`` carried to it, added into the residual (the
    plugin's own, spent by this sum); without one, a new tensor when ``copy``. Contiguous,
    so that error feedback can update it in place through a flat view. (A call that would
    change nothing is not made: each costs microseconds, once per tensor of every update.)"""
    if residual is not None:
        residual.add_(tensor if tensor.dtype == torch.float32 else tensor.to(torch.float32))
        return residual if residual.is_contiguous() else residual.contiguous()
    if not copy and tensor.dtype == torch.float32 and tensor.is_contiguous():
        return tensor
    return tensor.to(torch.float32, memory_format=torch.contiguous_format, copy=copy)


def _advance(model: Params, delta: Params) -> Params:
    """``model + delta`` for floating tensors (in the model's dtype); other tensors are values."""
    return {k: (v + delta[k].to(v.dtype)) if v.is_floating_point() else delta[k].clone() for k, v in model.items()}


def _marker(*ids: int) -> torch.Tensor:
    """A :data:`DELTA` or :data:`MODEL` marker naming ``ids``."""
    return torch.tensor([FORMAT, *ids], dtype=torch.int64)


def _same_layout(a: Params, b: Params) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)


def _copy(params: Params) -> Params:
    return {k: v.detach().clone() for k, v in params.items()}


def _codec_state(codec: Codec) -> Any:
    return codec.state_dict() if hasattr(codec, "state_dict") else None


def named(fields: dict[str, torch.Tensor], part: str) -> torch.Tensor:
    """Field ``part`` of a peer's ``fields``; ``ValueError`` when it is missing."""
    if part not in fields:
        raise ValueError(f"field {part!r} is missing")
    return fields[part]


def vectors(fields: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` unless each of a peer's ``fields`` is a vector, as a codec that sends vectors sent it."""
    for part, tensor in fields.items():
        if tensor.dim() != 1:
            raise ValueError(f"{part!r} is of shape {tuple(tensor.shape)}, not a vector")


def require(fields: dict[str, torch.Tensor], sizes: dict[str, int]) -> None:
    """Raise ``ValueError`` unless ``fields`` hold each field of ``sizes`` with that many entries."""
    for part, size in sizes.items():
        if named(fields, part).numel() != size:
            raise ValueError(f"{part!r} hold {fields[part].numel()} entries, the layout's tensor sends {size}")
