"""The errors fedweave raises on purpose; each message is one line a user can act on."""


class FedweaveError(Exception):
    """Base class of every error fedweave raises deliberately."""


class ConfigError(FedweaveError):
    """A configuration value is unknown, of the wrong type, out of range or impossible."""


class TaskError(FedweaveError):
    """A dataset, model or loss cannot be built (missing files, missing extra, bad factory)."""


class RoundError(FedweaveError):
    """A round could not complete (too few clients answered)."""


class CheckpointError(FedweaveError):
    """A checkpoint is missing, unreadable or does not match the run it should resume."""
