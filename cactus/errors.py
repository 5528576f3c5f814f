"""Domain exceptions: raised anywhere, translated to gRPC status at the boundary only."""

from __future__ import annotations


class CactusError(Exception):
    """Base class of the project's errors."""


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code, vLLM's too


class InvalidRequestError(CactusError, ValueError):
    """A request field is out of range. `field` names it; the message gives the limit.
    `code`: a machine-readable reason where clients look for one (the HTTP API's
    `error.code`: CONTEXT_LENGTH_EXCEEDED for a prompt or max_tokens the context or the
    KV budget cannot hold, which OpenAI clients use to trim a conversation)."""

    def __init__(self, field: str, message: str, code: str | None = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message
        self.code = code

    def __reduce__(self):
        # Rank 0 raises some of these (a request above the whole KV budget) and Ray
        # pickles them to the replica; the default reduce would call __init__ with the
        # one formatted message, fail to unpickle, and the caller would get INTERNAL.
        return (type(self), (self.field, self.reason, self.code))


class RequestCancelledError(CactusError):
    """The caller cancelled the request; its caches have been freed."""


class StaleBlockError(CactusError):
    """A draft block refers to an old committed length (epoch) or was already applied."""


class DraftRetryError(CactusError):
    """The batched draft forward failed (a device error on the draft side) and left the
    row's draft session as it was before it: the row decodes this step without drafts
    and drafts again at the next (the engine bounds how often, workers/engine.py)."""


class WorkerUnavailableError(CactusError):
    """A draft actor or verifier rank is down or draining."""


class RequestAttemptsExhaustedError(CactusError):
    """The engine failed under this request on every attempt `recovery.max_attempts`
    allows. Not UNAVAILABLE, which clients retry: a request that brings the engine down
    would bring it down again, once per retry, for every other request on the replica.
    gRPC INTERNAL with this message (gRPC's guidance: UNAVAILABLE only for a call the
    client can simply retry); HTTP 500 with `x-should-retry: false`, which OpenAI's
    clients honour (they retry a 500 otherwise)."""


class ServerShuttingDownError(WorkerUnavailableError):
    """The replica is being stopped and the request was still running when its drain
    time was up (deployments/drain.py). The message says so; clients retry elsewhere.
    `refused`: it arrived after that cut and never ran (no accepted request, so the
    replica's metrics do not count it)."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused

    def __reduce__(self):
        return (type(self), (str(self), self.refused))


class ModelOutputError(CactusError):
    """The verifier's output for a request was unusable (NaN or inf logits): that request
    ends with this error (INTERNAL on the wire, the message in the server log); the other
    requests of its batch go on."""


class EngineStartError(CactusError):
    """The engine did not start: its placement group was not granted, or an actor did
    not load, join or answer within limits.start_timeout_s. What had started is stopped
    (workers/group.py)."""


class EngineFailedError(WorkerUnavailableError):
    """A verifier rank died or the tensor-parallel group broke: the engine must be torn
    down and rebuilt (workers/supervisor.py); its requests are resumed on the new one."""


# Ray's exceptions for an actor (or its node, or its owner) that is gone.
_RAY_DEATHS = frozenset(
    {
        "RayActorError",
        "ActorDiedError",
        "ActorUnavailableError",
        "ActorUnschedulableError",
        "WorkerCrashedError",
        "NodeDiedError",
        "OwnerDiedError",
        "ObjectLostError",
    }
)
_TIMEOUTS = frozenset({"GetTimeoutError", "TimeoutError"})
# Collective failures as gloo / NCCL / torch.distributed word them.
_COLLECTIVE_MARKERS = (
    "gloo",
    "nccl",
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "distbackenderror",
    "process group",
)


def unwrap(err: BaseException) -> BaseException:
    """A RayTaskError wraps the remote exception (as .cause); get the original back."""
    cause = getattr(err, "cause", None)
    return unwrap(cause) if isinstance(cause, BaseException) and cause is not err else err


def is_engine_failure(err: BaseException) -> bool:
    """The engine itself is gone or broken (a rank died, the TP group failed): rebuild
    it and resume its requests. The one place that knows what those errors look like."""
    err = unwrap(err)
    if isinstance(err, EngineFailedError) or type(err).__name__ in _RAY_DEATHS:
        return True
    if isinstance(err, RuntimeError):
        text = f"{type(err).__name__} {err}".lower()
        return any(marker in text for marker in _COLLECTIVE_MARKERS)
    return False


def is_unavailable(err: BaseException) -> bool:
    """Failures the client should retry (gRPC UNAVAILABLE): engine failures, a worker
    that is down or draining, timeouts talking to one. Everything else unexpected is a
    bug (INTERNAL)."""
    err = unwrap(err)
    return (
        is_engine_failure(err)
        or isinstance(err, WorkerUnavailableError)
        or type(err).__name__ in _TIMEOUTS
    )
