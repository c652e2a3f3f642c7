"""The errors fedweave raises on purpose; each message is one line a user can act on."""


class FedweaveError(Exception):
    """Base class of every error fedweave raises deliberately."""


class ConfigError(FedweaveError):
    """A configuration value is unknown, of the wrong type, out of range or impossible."""


class TaskError(FedweaveError):
    """A dataset, model or loss cannot be built (missing files, missing extra, bad factory)."""


class RoundError(FedweaveError):
    """A round could not complete (too few clients answered)."""


class NothingTrained(FedweaveError):
    """A run ended without applying one update (no client reached its server, every round skipped):
    it writes no model, and its run directory resumes from its start."""


class BudgetSpent(FedweaveError):
    """The next round would spend more than a budget allows (a target privacy ε): the run stops before it."""


class CheckpointError(FedweaveError):
    """A checkpoint is missing, unreadable or does not match the run it should resume."""


class SerializationError(FedweaveError):
    """A message on the wire is malformed, truncated or corrupted; nothing of it is applied."""


class PayloadTooLarge(SerializationError):
    """A message or one chunk of it is larger than the configured maximum."""


class PayloadMismatch(SerializationError):
    """A message's tensors do not match the names or shapes the receiver expects."""


class TransportError(FedweaveError):
    """A node cannot reach or stay connected to its peer, or its credentials are refused."""


def first_line(exc: BaseException) -> str:
    """The first non-blank line of ``exc``'s message, stripped (its type's name when there is none):
    a library's error spanning a page (torch, TenSEAL) told in one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
