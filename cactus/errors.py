"""Domain exceptions: raised anywhere, translated to gRPC status at the boundary only."""

from __future__ import annotations


class CactusError(Exception):
    """Base class of the project's errors."""


class InvalidRequestError(CactusError, ValueError):
    """A request field is out of range. `field` names it; the message gives the limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class RequestCancelledError(CactusError):
    """The caller cancelled the request; its caches have been freed."""


class StaleBlockError(CactusError):
    """A draft block refers to an old committed length (epoch) or was already applied."""


class WorkerUnavailableError(CactusError):
    """A draft actor or verifier rank is down or draining."""
