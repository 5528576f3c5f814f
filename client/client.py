"""Python clients of the public gRPC API (cactus.v1): CactusClient (blocking) and
AsyncCactusClient (grpc.aio), with the same methods.

Both retry UNAVAILABLE (an engine restarting, a replica starting) and
RESOURCE_EXHAUSTED (a full queue) with bounded exponential backoff and full jitter,
within the call's deadline, and only before the first response: a stream that has
delivered a token is never retried (the server resumes streams itself; a client retry
would repeat tokens). Everything else is raised at once. A pause is shortened to end
2 x MIN_RETRY_LEFT_S before the deadline (an attempt that fails with less left is the
last), and a retry starts only with at least MIN_RETRY_LEFT_S of the deadline left, so
a call that runs out raises the error it had.

A value a request cannot hold (a wrong type, a negative count, a NaN) and a bad
`timeout` are a ValueError that starts with the field's name, raised before any call
(by `stream` too, at the call, not at its first iteration); the server checks the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import numbers
import random
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Set
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.cactus.v1 import cactus_pb2 as pb
from protos.cactus.v1 import cactus_pb2_grpc as pb_grpc

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# A retry is started only with at least this much of the call's deadline left after its
# pause: one with less would most likely end DEADLINE_EXCEEDED, hiding the error that
# made it retry (UNAVAILABLE, RESOURCE_EXHAUSTED), which the call raises instead.
MIN_RETRY_LEFT_S = 0.1

# the largest values the proto's integer fields hold
_UINT32_MAX = (1 << 32) - 1
_UINT64_MAX = (1 << 64) - 1
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _is_int(value) -> bool:
    """An integer (int, numpy's), not a bool (True is no token count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _finite(value) -> float | None:
    """`value` as a finite float, or None where it is none (not a real number, a bool,
    NaN, an infinity, an int too large for a float)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _int_field(name: str, value, lo: int, hi: int, wanted: str) -> int | None:
    """`value` as an int in [lo, hi] (None stays None: unset), or ValueError naming the
    field (`wanted` says what it takes: "an integer >= 0")."""
    if value is None:
        return None
    if not _is_int(value) or value < lo:
        got = f"{value!r}" if _is_int(value) else f"{value!r} ({type(value).__name__})"
        raise ValueError(f"{name}: must be {wanted}, got {got}")
    if value > hi:
        raise ValueError(f"{name}: must be at most {hi}, got {value}")
    return int(value)


def _float_field(name: str, value) -> float:
    """`value` as a finite float, or ValueError naming the field. Its range (temperature
    in [0, 2], ...) is the server's to check: it answers INVALID_ARGUMENT naming it."""
    number = _finite(value)
    if number is None:
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    return number


def _logit_bias(value) -> dict[int, float]:
    """{token id: bias} (OpenAI's logit_bias; a JSON-style str key is taken too) as the
    message's map, or ValueError naming `logit_bias`; the ranges are the server's."""
    if not isinstance(value, Mapping):
        raise ValueError(f"logit_bias: must be a mapping of token id to bias, got {value!r}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        text = key.strip() if isinstance(key, str) else ""
        tok = int(text) if text.isascii() and text.isdigit() and len(text) <= 20 else key
        if not _is_int(tok) or not _INT64[0] <= tok <= _INT64[1]:
            raise ValueError(f"logit_bias: keys must be int token ids, got {key!r}")
        if int(tok) in out:
            raise ValueError(f"logit_bias: token {int(tok)} is given twice")
        number = _finite(bias)
        if number is None:
            raise ValueError(f"logit_bias: token {int(tok)}'s bias must be a finite number")
        out[int(tok)] = number
    return out


def _str_field(name: str, value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name}: must be a str, got {value!r} ({type(value).__name__})")
    return _utf8(name, value)


def _utf8(name: str, value: str, item: int | None = None) -> str:
    """A str protobuf can send (UTF-8): a lone surrogate (undecodable bytes in argv
    become them) is a ValueError naming the field (and the item of a list), not
    protobuf's UnicodeEncodeError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        where = "" if item is None else f"; item {item}"
        raise ValueError(
            f"{name}: must be valid Unicode text (UTF-8){where}: "
            f"{value[err.start : err.end]!r} at character {err.start}"
        ) from None
    return value


def _token_ids(name: str, value) -> list[int]:
    """A sequence of token ids (list, tuple, range, numpy array) as a list of ints, or
    ValueError naming the field: never a str or bytes, whose items are no token ids."""
    wanted = f"{name}: must be a str or a sequence of int token ids"
    if name == "stop_token_ids":
        wanted = f"{name}: must be an int token id or a sequence of them"
    if isinstance(value, str | bytes | bytearray | memoryview | Mapping | Set) or not isinstance(
        value, Iterable
    ):
        raise ValueError(f"{wanted}, got {type(value).__name__}")
    ids = list(value)
    for i, tid in enumerate(ids):
        if not _is_int(tid) or not _INT64[0] <= tid <= _INT64[1]:
            raise ValueError(f"{wanted}; item {i} is {tid!r} ({type(tid).__name__})")
    return [int(tid) for tid in ids]


def _timeout(value) -> float:
    """A deadline in seconds: a finite number > 0, or ValueError naming `timeout`."""
    seconds = _finite(value)
    if seconds is None or seconds <= 0:
        raise ValueError(f"timeout: must be a finite number of seconds > 0, got {value!r}")
    return seconds


def _too_large(err: grpc.RpcError) -> bool:
    """gRPC's RESOURCE_EXHAUSTED for a message over a receive limit (the same code as a
    full queue; gRPC's details say so: "Received message larger than max (N vs. M)"),
    which the same message meets again on every attempt."""
    details = (err.details() or "").lower()
    return err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC's retry policy fields (A6): attempts in all, backoff bounds, multiplier."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    codes: tuple = RETRYABLE

    def __post_init__(self) -> None:
        if not _is_int(self.max_attempts) or self.max_attempts < 1:
            raise ValueError(f"max_attempts: must be an integer >= 1, got {self.max_attempts!r}")
        for name in ("initial_backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if _finite(value) is None or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if self.initial_backoff_s > self.max_backoff_s:
            raise ValueError(
                f"initial_backoff_s: must be <= max_backoff_s ({self.max_backoff_s}), "
                f"got {self.initial_backoff_s}"
            )
        if _finite(self.multiplier) is None or self.multiplier <= 0:
            raise ValueError(f"multiplier: must be a finite number > 0, got {self.multiplier!r}")
        codes = self.codes
        if isinstance(codes, str | bytes | grpc.StatusCode) or not isinstance(codes, Iterable):
            raise ValueError(f"codes: must be a tuple of grpc.StatusCode, got {codes!r}")
        codes = tuple(codes)  # a list would leave the frozen policy unhashable
        for code in codes:
            if not isinstance(code, grpc.StatusCode):
                raise ValueError(f"codes: must be a tuple of grpc.StatusCode, got {code!r} in it")
        object.__setattr__(self, "codes", codes)

    def backoff(self, retry: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(max, initial * multiplier ** retry)]."""
        # the exponent is bounded (multiplier ** retry overflows a float near retry 1024),
        # and a large multiplier that overflows sooner is past any cap
        try:
            growth = float(self.multiplier) ** min(retry, 64)
            cap = min(self.max_backoff_s, self.initial_backoff_s * growth)
        except OverflowError:
            cap = self.max_backoff_s if self.initial_backoff_s > 0 else 0.0
        return rng.uniform(0.0, cap)


NO_RETRY = RetryPolicy(max_attempts=1)


class _Attempts:
    """The attempts of one call: how long to wait before the next, within the deadline."""

    def __init__(self, policy: RetryPolicy, timeout: float, rng: random.Random) -> None:
        self.policy, self.rng = policy, rng
        self.deadline = time.monotonic() + timeout
        self.made = 0

    def left_s(self) -> float:
        return max(0.001, self.deadline - time.monotonic())

    def bound(self, msg: pb.GenerateRequest, own_limit_s: float) -> pb.GenerateRequest:
        """The request with a server-side time limit no later than this call's deadline,
        unless the caller set its own: the engine then ends a request whose client gave
        up even if the cancel is lost on the way (Ray Serve 2.60's gRPC proxy loses one
        that lands while it writes a chunk; README, "Errors and limits")."""
        if not own_limit_s:
            msg.time_limit_s = self.left_s()
        return msg

    def wait_after(self, err: grpc.RpcError) -> float | None:
        """Seconds to wait before retrying `err`, or None to raise it."""
        self.made += 1
        if err.code() not in self.policy.codes or self.made >= self.policy.max_attempts:
            return None
        if _too_large(err):  # RESOURCE_EXHAUSTED that a retry cannot cure
            return None
        pushback = _pushback_s(err)
        if pushback is not None and pushback < 0:  # the server says: do not retry this
            return None
        # full jitter, then shortened to end 2 x MIN_RETRY_LEFT_S before the deadline (a
        # long draw no longer ends the call with its deadline and attempts to spare; the
        # margin keeps a sleep's overrun from costing the attempt it waited for)
        room = self.deadline - time.monotonic() - 2 * MIN_RETRY_LEFT_S
        if room < 0:
            return None
        if pushback is not None:  # the server's own delay replaces the backoff (gRFC A6)
            return min(pushback, room)
        return min(self.policy.backoff(self.made - 1, self.rng), room)

    def time_for_another(self) -> bool:
        """Whether enough of the deadline is left to start the next attempt, checked
        again after the pause (a sleep may overrun)."""
        return self.deadline - time.monotonic() >= MIN_RETRY_LEFT_S


def _pushback_s(err: grpc.RpcError) -> float | None:
    """The server's retry pushback (gRFC A6's `grpc-retry-pushback-ms` trailer) in
    seconds: None when absent; negative (do not retry) when negative or unreadable, as
    gRPC's own retry policy reads it. The server sends -1 for a request that failed the
    engine every time it ran (recovery.max_attempts)."""
    trailers = getattr(err, "trailing_metadata", None)
    try:
        pairs = list(trailers() or ()) if callable(trailers) else []
    except Exception:  # no trailers to read (an error raised before the call)
        return None
    for key, value in pairs:
        if key == "grpc-retry-pushback-ms":
            try:
                ms = int(value)
            except (TypeError, ValueError):
                return -1.0
            return ms / 1000.0 if ms >= 0 else -1.0
    return None


def _closed_error() -> grpc.RpcError:
    """What a call of an AsyncCactusClient gets once close() closed its loop's channel."""
    return _cancelled_error("the client was closed")


def _cancelled_error(details: str = "Locally cancelled by application!") -> grpc.RpcError:
    """The RpcError a stream cancelled through `last_call.cancel()` raises (the same
    status and details as grpc's own)."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details
    )


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class StreamCall:
    """`last_call`: the client's latest stream across its attempts (each retry is a new
    gRPC call). `cancel()` cancels the attempt running now and every later one: a
    stream cancelled while it waits to retry, or before its first iteration, raises
    RpcError CANCELLED instead of starting a call. Every other attribute (`code()`,
    `details()`, `done()`, ...) is the current attempt's call's."""

    def __init__(self) -> None:
        self.call = None  # the current attempt's gRPC call; None before the first
        self.cancel_requested = False
        self.finished = False  # the stream ended with its last chunk
        self._wake = threading.Event()  # ends a pause before a retry
        self._loop: asyncio.AbstractEventLoop | None = None  # an asyncio call's loop

    def cancel(self) -> bool:
        """Cancel the stream; False if it had already ended with its last chunk. Safe
        from any thread: a grpc.aio call is cancelled on its own event loop."""
        if self.finished:
            return False
        self.cancel_requested = True
        self._wake.set()
        call, loop = self.call, self._loop
        if call is not None:
            if loop is None or _running_loop() is loop:
                call.cancel()
            else:  # grpc.aio's cancel touches asyncio tasks: not from another thread
                with contextlib.suppress(RuntimeError):  # that loop is closed: nothing runs
                    loop.call_soon_threadsafe(call.cancel)
        return True

    def cancelled(self) -> bool:
        return self.cancel_requested or (self.call is not None and self.call.cancelled())

    def pause(self, seconds: float) -> None:
        """The blocking client's pause before a retry; a cancel ends it at once."""
        self._wake.wait(seconds)

    async def apause(self, seconds: float) -> None:
        """The asyncio client's (a cancel from another thread too: it is polled)."""
        end = time.monotonic() + seconds
        while not self.cancel_requested and (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.02))

    def attempt(self, call):
        """The next attempt's call (cancelled at once if the stream was)."""
        if isinstance(call, grpc.aio.Call):
            self._loop = asyncio.get_running_loop()
        self.call = call
        if self.cancel_requested:
            call.cancel()
        return call

    def __getattr__(self, name):
        call = self.__dict__.get("call")
        if call is None:
            raise AttributeError(f"{name!r}: the stream has not started a call yet")
        return getattr(call, name)


async def _read(call):
    """call.read(), except that a call cancelled through `last_call.cancel()` (not by
    cancelling the task) raises RpcError CANCELLED, as the blocking client's does, where
    grpc.aio raises asyncio.CancelledError, which would look like the task's own."""
    try:
        return await call.read()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        own = task is None or task.cancelling()
        if call.cancelled() and not own:
            raise _cancelled_error() from None
        raise


class _Client:
    """What both clients share: the channel, stubs, deadline, token and retry policy."""

    _grpc = grpc  # grpc or grpc.aio: the module whose channels the client opens

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout: float = 60.0,
        max_message_bytes: int = 64 << 20,
        retry: RetryPolicy | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self.timeout = _timeout(timeout)  # before the channel: nothing left to close
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ValueError(
                f"retry: must be a RetryPolicy (NO_RETRY turns retries off) or None, "
                f"got {retry!r} ({type(retry).__name__})"
            )
        if credentials is not None and not isinstance(credentials, grpc.ChannelCredentials):
            raise ValueError(
                "credentials: must be grpc.ChannelCredentials (grpc.ssl_channel_credentials"
                f"(...)) or None for a plain-text channel, got {type(credentials).__name__}"
            )
        self._target = (address, options, credentials)
        self._connect()
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        self.retry = RetryPolicy() if retry is None else retry
        self._rng = random.Random()
        self.last_attempts = 0  # attempts the last call made (tests, logs)
        self.last_call = None  # the latest stream (a StreamCall, to cancel it); None before one

    def _open(self) -> tuple:
        """A channel and its stubs: TLS with `credentials`, plain text without."""
        address, options, credentials = self._target
        if credentials is None:
            channel = self._grpc.insecure_channel(address, options=options)
        else:
            channel = self._grpc.secure_channel(address, credentials, options=options)
        return channel, pb_grpc.CactusStub(channel), health_pb2_grpc.HealthStub(channel)

    def _connect(self) -> None:
        self.channel, self.stub, self.health_stub = self._open()

    def _deadline_s(self, timeout: float | None) -> float:
        """A call's deadline: its own `timeout`, or the client's where it is None."""
        return self.timeout if timeout is None else _timeout(timeout)


class CactusClient(_Client):
    """`CactusClient("127.0.0.1:9000").generate("def f(x):", max_tokens=32)`.

    Every call gets a deadline (`timeout`, seconds) unless given its own, covering its
    retries; `token` is sent as `authorization: Bearer <token>` metadata; `retry`
    (default RetryPolicy(); NO_RETRY turns it off) applies before the first response.
    """

    @staticmethod
    def request(
        prompt: str | list[int],
        *,
        max_tokens: int | None = None,  # None (and every unset field): the server's default
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,  # unset: 0, off
        seed: int | None = None,
        stop: str | list[str] | None = None,
        stop_token_ids: int | list[int] | None = None,
        rule: str | None = None,  # unset: "", the server's default rule
        delta: float | None = None,
        num_speculative_tokens: int | None = None,
        max_divergence_nats: float | None = None,
        request_id: str | None = None,  # unset: "", the server assigns one
        time_limit_s: float | None = None,  # unset: 0, none (the call's deadline bounds it)
        logprobs: int | None = None,
        logit_bias: Mapping[int, float] | None = None,  # {token id: bias in [-100, 100]}
    ) -> pb.GenerateRequest:
        """The GenerateRequest of these parameters. A None leaves its field unset (absent
        from the message, or proto3's default where the field is not `optional`: top_k 0,
        rule "", no stops, no logit_bias, request_id "", time_limit_s 0), which the server
        reads as its default.

        A value the message cannot hold (a wrong type, a negative count, an integer past
        its field's width, a NaN or infinite float, a bytes prompt, text that is not valid
        UTF-8) is a ValueError that starts with the field's name, raised before any call;
        the server checks the rest (ranges, the context) and answers INVALID_ARGUMENT
        naming the field."""
        ids = None if isinstance(prompt, str) else _token_ids("prompt", prompt)
        counts = "an integer >= 1 (or None: the server's default)"
        ints = {
            "max_tokens": _int_field("max_tokens", max_tokens, 0, _UINT32_MAX, counts),
            "num_speculative_tokens": _int_field(
                "num_speculative_tokens", num_speculative_tokens, 0, _UINT32_MAX, counts
            ),
            "seed": _int_field("seed", seed, 0, _UINT64_MAX, "an integer >= 0"),
            "logprobs": _int_field("logprobs", logprobs, 0, _UINT32_MAX, "an integer >= 0"),
            "top_k": _int_field("top_k", top_k, *_INT32, "an integer (0 or -1: off)"),
        }
        ints = {name: value for name, value in ints.items() if value is not None}
        floats = {
            name: _float_field(name, value)
            for name, value in (
                ("temperature", temperature),
                ("top_p", top_p),
                ("delta", delta),
                ("max_divergence_nats", max_divergence_nats),
                ("time_limit_s", time_limit_s),
            )
            if value is not None
        }
        # one stop string or id, as OpenAI clients accept (a str is not a list of chars)
        if stop is None or isinstance(stop, str):
            stops = [] if stop is None else [_utf8("stop", stop)]
        elif isinstance(stop, bytes | bytearray | Mapping) or not isinstance(stop, Iterable):
            raise ValueError(f"stop: must be a str or a sequence of str, got {stop!r}")
        else:
            stops = list(stop)
            for i, one in enumerate(stops):
                if not isinstance(one, str):
                    raise ValueError(
                        f"stop: must be a str or a sequence of str; item {i} is {one!r} "
                        f"({type(one).__name__})"
                    )
                _utf8("stop", one, item=i)
        if stop_token_ids is None:
            stop_ids = []
        elif _is_int(stop_token_ids):
            stop_ids = _token_ids("stop_token_ids", [stop_token_ids])
        else:
            stop_ids = _token_ids("stop_token_ids", stop_token_ids)
        bias = {} if logit_bias is None else _logit_bias(logit_bias)
        rule = "" if rule is None else _str_field("rule", rule)
        request_id = "" if request_id is None else _str_field("request_id", request_id)

        for name in ("max_tokens", "num_speculative_tokens"):
            if ints.get(name) == 0:  # before 2026-12-05 the client's "unset"; now None is
                warnings.warn(
                    f"{name}=0 means unset in this client (the server's default); pass None. "
                    "A 0 sent in a raw message is INVALID_ARGUMENT",
                    FutureWarning,
                    stacklevel=3,
                )
                del ints[name]
        limit_s = floats.get("time_limit_s", 0.0)
        msg = pb.GenerateRequest(request_id=request_id, time_limit_s=limit_s)
        if ids is None:
            msg.prompt = _utf8("prompt", prompt)
        else:
            msg.prompt_token_ids.ids.extend(ids)
        s = msg.sampling
        s.top_k = ints.get("top_k", 0)
        s.stop.extend(stops)
        s.stop_token_ids.extend(stop_ids)
        s.logit_bias.update(bias)
        for name in ("max_tokens", "seed", "logprobs"):
            if name in ints:
                setattr(s, name, ints[name])
        for name in ("temperature", "top_p"):
            if name in floats:
                setattr(s, name, floats[name])
        sp = msg.speculation
        sp.rule = rule
        if "num_speculative_tokens" in ints:
            sp.num_speculative_tokens = ints["num_speculative_tokens"]
        for name in ("delta", "max_divergence_nats"):
            if name in floats:
                setattr(sp, name, floats[name])
        return msg

    def generate(self, prompt, *, timeout: float | None = None, **kw) -> pb.GenerateResponse:
        msg = self.request(prompt, **kw)
        own = msg.time_limit_s
        return self._unary(self.stub.Generate, lambda a: a.bound(msg, own), timeout)

    def _unary(self, method, message, timeout: float | None):
        """One retried unary call; `message(attempts)` builds each attempt's request."""
        attempts = _Attempts(self.retry, self._deadline_s(timeout), self._rng)
        while True:
            try:
                reply = method(message(attempts), timeout=attempts.left_s(), metadata=self.metadata)
                self.last_attempts = attempts.made + 1
                return reply
            except grpc.RpcError as err:
                pause = attempts.wait_after(err)
                self.last_attempts = attempts.made
                if pause is None:
                    raise
                time.sleep(pause)
                if not attempts.time_for_another():  # the pause overran
                    raise

    def stream(
        self, prompt, *, timeout: float | None = None, **kw
    ) -> Iterator[pb.GenerateResponse]:
        """Iterate response chunks; the stream is kept on `last_call` (a StreamCall across
        its attempts, to cancel it). Retried only until the first chunk arrives. Leaving
        the loop early (break, an exception, closing the iterator) cancels the call, as
        the asyncio client's does: the server stops the request within one engine step.

        The request is checked here, so a bad value raises ValueError at this call; the
        call itself (and its deadline) starts at the first iteration."""
        msg = self.request(prompt, **kw)
        deadline = self._deadline_s(timeout)
        self.last_call = handle = StreamCall()
        return self._stream(msg, deadline, handle)

    def _stream(
        self, msg: pb.GenerateRequest, timeout: float, handle: StreamCall
    ) -> Iterator[pb.GenerateResponse]:
        own = msg.time_limit_s
        attempts = _Attempts(self.retry, timeout, self._rng)
        while True:
            if handle.cancel_requested:  # before the first attempt, or while it waited
                raise _cancelled_error()
            call = handle.attempt(
                self.stub.GenerateStream(
                    attempts.bound(msg, own), timeout=attempts.left_s(), metadata=self.metadata
                )
            )
            try:
                try:
                    first = next(call)
                except StopIteration:
                    handle.finished = True
                    return
                except grpc.RpcError as err:
                    pause = attempts.wait_after(err)
                    self.last_attempts = attempts.made
                    if pause is None:
                        raise
                    if handle.cancel_requested:  # between the failure and the pause
                        raise _cancelled_error() from None
                    handle.pause(pause)
                    if handle.cancel_requested:
                        raise _cancelled_error() from None
                    if not attempts.time_for_another():  # the pause overran
                        raise
                    continue
                self.last_attempts = attempts.made + 1
                yield first
                yield from call  # from here on an error is the caller's: never retried
                handle.finished = True
                return
            finally:
                if not call.done():
                    call.cancel()

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        """The served models and limits; retried as `generate` is."""
        return self._unary(self.stub.GetModelInfo, lambda _: pb.ModelInfoRequest(), timeout)

    def health(self, service: str = "") -> str:
        """The gRPC health service's status (SERVING, NOT_SERVING): a probe, one attempt,
        never retried, so a server that is down says so at once. `service` "" is the
        whole server (drafts flowing too), "cactus.v1.Cactus" whether it takes requests
        (README, Standard services)."""
        reply = self.health_stub.Check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=self.timeout,
            metadata=self.metadata,
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self.channel.close()


class AsyncCactusClient(_Client):
    """The asyncio client (grpc.aio): the same methods as CactusClient, awaited;
    `stream` is an async iterator. Same deadlines, token, credentials and retry policy.

    It may be built anywhere (at module level, before `asyncio.run`): a grpc.aio channel
    belongs to one event loop, so the client opens one per loop at that loop's first
    call (a second `asyncio.run`, or loops in several threads); `close` closes the
    calling loop's."""

    _grpc = grpc.aio

    request = staticmethod(CactusClient.request)

    def _connect(self) -> None:
        self._conns: dict = {}  # event loop -> its channel and stubs
        self._conns_lock = threading.Lock()  # loops in several threads
        self._closed: weakref.WeakSet = weakref.WeakSet()  # loops that called close()

    def _closed_here(self) -> bool:
        return asyncio.get_running_loop() in self._closed

    def _closed_under(self) -> bool:
        """A CancelledError came from close() closing the call's channel, not from the
        caller's own task being cancelled (whose cancellation must stay one: asyncio
        timeouts and task groups rely on it), as `_read` tells them apart."""
        task = asyncio.current_task()
        return self._closed_here() and task is not None and not task.cancelling()

    def _bound(self) -> tuple:
        loop = asyncio.get_running_loop()
        if loop in self._closed:  # close() is final: no channel is opened again
            raise _closed_error()
        conn = self._conns.get(loop)
        if conn is None:
            with self._conns_lock:
                # the channels of loops that have closed are dropped (a channel holds
                # its loop: weak keys would never go); their calls ended with their loop
                for gone in [other for other in self._conns if other.is_closed()]:
                    del self._conns[gone]
                conn = self._conns.get(loop) or self._open()
                self._conns[loop] = conn
        return conn

    @property
    def channel(self):
        return self._bound()[0]

    @property
    def stub(self):
        return self._bound()[1]

    @property
    def health_stub(self):
        return self._bound()[2]

    async def generate(self, prompt, *, timeout: float | None = None, **kw) -> pb.GenerateResponse:
        msg = self.request(prompt, **kw)
        own = msg.time_limit_s
        return await self._unary(self.stub.Generate, lambda a: a.bound(msg, own), timeout)

    async def _unary(self, method, message, timeout: float | None):
        """One retried unary call; `message(attempts)` builds each attempt's request."""
        attempts = _Attempts(self.retry, self._deadline_s(timeout), self._rng)
        while True:
            try:
                reply = await method(
                    message(attempts), timeout=attempts.left_s(), metadata=self.metadata
                )
                self.last_attempts = attempts.made + 1
                return reply
            except asyncio.CancelledError:
                # grpc.aio cancels a unary call whose channel close() closed: the
                # caller's task was not cancelled, so it gets the stream's RpcError
                if self._closed_under():
                    raise _closed_error() from None
                raise
            except grpc.RpcError as err:
                pause = attempts.wait_after(err)
                self.last_attempts = attempts.made
                if pause is None:
                    raise
                await asyncio.sleep(pause)
                if self._closed_here():  # closed during the pause: no further attempt
                    raise _closed_error() from None
                if not attempts.time_for_another():  # the pause overran
                    raise

    def stream(
        self, prompt, *, timeout: float | None = None, **kw
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Async-iterate response chunks (`async for`; not awaited); retried only until
        the first chunk arrives. Leaving the loop early (break, cancellation) cancels the
        call. As in the blocking client, a bad value raises ValueError at this call."""
        msg = self.request(prompt, **kw)
        deadline = self._deadline_s(timeout)
        self.last_call = handle = StreamCall()
        return self._stream(msg, deadline, handle)

    async def _stream(
        self, msg: pb.GenerateRequest, timeout: float, handle: StreamCall
    ) -> AsyncIterator[pb.GenerateResponse]:
        own = msg.time_limit_s
        attempts = _Attempts(self.retry, timeout, self._rng)
        while True:
            if handle.cancel_requested:  # before the first attempt, or while it waited
                raise _cancelled_error()
            call = handle.attempt(
                self.stub.GenerateStream(
                    attempts.bound(msg, own), timeout=attempts.left_s(), metadata=self.metadata
                )
            )
            try:
                try:
                    first = await _read(call)
                except grpc.RpcError as err:
                    pause = attempts.wait_after(err)
                    self.last_attempts = attempts.made
                    if pause is None:
                        raise
                    if handle.cancel_requested:  # between the failure and the pause
                        raise _cancelled_error() from None
                    await handle.apause(pause)
                    if handle.cancel_requested:
                        raise _cancelled_error() from None
                    if not attempts.time_for_another():  # the pause overran
                        raise
                    continue
                if first is grpc.aio.EOF:
                    handle.finished = True
                    return
                self.last_attempts = attempts.made + 1
                yield first
                while (chunk := await _read(call)) is not grpc.aio.EOF:
                    yield chunk
                handle.finished = True
                return
            finally:
                if not call.done():
                    call.cancel()

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        """The served models and limits; retried as `generate` is."""
        return await self._unary(self.stub.GetModelInfo, lambda _: pb.ModelInfoRequest(), timeout)

    async def health(self, service: str = "") -> str:
        """The health service's status: a probe, one attempt, never retried."""
        try:
            reply = await self.health_stub.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=self.timeout,
                metadata=self.metadata,
            )
        except asyncio.CancelledError:
            if self._closed_under():  # its channel was closed under it
                raise _closed_error() from None
            raise
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        """Close this event loop's channel, for good (one of a loop now gone went with
        it): calls in flight on it end with RpcError CANCELLED (a task cancelled
        meanwhile stays cancelled), a stream or call waiting to retry makes no further
        attempt, and later calls from this loop raise CANCELLED "the client was closed"
        at once, as the blocking client's closed channel refuses them."""
        loop = asyncio.get_running_loop()
        with self._conns_lock:
            self._closed.add(loop)
            conn = self._conns.pop(loop, None)
        if conn is not None:
            await conn[0].close()
