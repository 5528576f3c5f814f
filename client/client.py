"""Python clients of the public gRPC API (cactus.v1): CactusClient (blocking) and
AsyncCactusClient (grpc.aio), with the same methods.

Both retry UNAVAILABLE (an engine restarting, a replica starting) and
RESOURCE_EXHAUSTED (a full queue) with bounded exponential backoff and full jitter,
within the call's deadline, and only before the first response: a stream that has
delivered a token is never retried (the server resumes streams itself; a client retry
would repeat tokens). Everything else is raised at once.
"""

from __future__ import annotations

import asyncio
import random
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.cactus.v1 import cactus_pb2 as pb
from protos.cactus.v1 import cactus_pb2_grpc as pb_grpc

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


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

    def backoff(self, retry: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(max, initial * multiplier ** retry)]."""
        # the exponent is bounded: multiplier ** retry overflows a float near retry 1024
        growth = self.multiplier ** min(retry, 64)
        cap = min(self.max_backoff_s, self.initial_backoff_s * growth)
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
        pause = self.policy.backoff(self.made - 1, self.rng)
        return pause if time.monotonic() + pause < self.deadline else None


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
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.CANCELLED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details="Locally cancelled by application!",
            ) from None
        raise


class _Client:
    """What both clients share: the channel, stubs, deadline, token and retry policy."""

    _channel = None  # grpc.insecure_channel or grpc.aio.insecure_channel

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout: float = 60.0,
        max_message_bytes: int = 64 << 20,
        retry: RetryPolicy | None = None,
    ) -> None:
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self.channel = self._channel(address, options=options)
        self.stub = pb_grpc.CactusStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        self.retry = retry or RetryPolicy()
        self._rng = random.Random()
        self.last_attempts = 0  # attempts the last call made (tests, logs)


class CactusClient(_Client):
    """`CactusClient("127.0.0.1:9000").generate("def f(x):", max_tokens=32)`.

    Every call gets a deadline (`timeout`, seconds) unless given its own, covering its
    retries; `token` is sent as `authorization: Bearer <token>` metadata; `retry`
    (default RetryPolicy(); NO_RETRY turns it off) applies before the first response.
    """

    _channel = staticmethod(grpc.insecure_channel)

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
    ) -> pb.GenerateRequest:
        """The GenerateRequest of these parameters. A None leaves its field unset (absent
        from the message, or proto3's default where the field is not `optional`: top_k 0,
        rule "", no stops, request_id "", time_limit_s 0), which the server reads as its
        default."""
        for name, value in (
            ("max_tokens", max_tokens),
            ("num_speculative_tokens", num_speculative_tokens),
        ):
            if value == 0:  # before 2026-12-05 the client's "unset"; now None is
                warnings.warn(
                    f"{name}=0 means unset in this client (the server's default); pass None. "
                    "A 0 sent in a raw message is INVALID_ARGUMENT",
                    FutureWarning,
                    stacklevel=3,
                )
        max_tokens = max_tokens or None
        num_speculative_tokens = num_speculative_tokens or None
        msg = pb.GenerateRequest(request_id=request_id or "", time_limit_s=time_limit_s or 0.0)
        if isinstance(prompt, str):
            msg.prompt = prompt
        else:
            msg.prompt_token_ids.ids.extend(prompt)
        s = msg.sampling
        s.top_k = top_k or 0
        # one stop string or id, as OpenAI clients accept (a str is not a list of chars)
        s.stop.extend([stop] if isinstance(stop, str) else stop or ())
        s.stop_token_ids.extend(
            [stop_token_ids] if isinstance(stop_token_ids, int) else stop_token_ids or ()
        )
        for name, value in (
            ("max_tokens", max_tokens),
            ("temperature", temperature),
            ("top_p", top_p),
            ("seed", seed),
            ("logprobs", logprobs),
        ):
            if value is not None:
                setattr(s, name, value)
        sp = msg.speculation
        sp.rule = rule or ""
        if num_speculative_tokens is not None:
            sp.num_speculative_tokens = num_speculative_tokens
        if delta is not None:
            sp.delta = delta
        if max_divergence_nats is not None:
            sp.max_divergence_nats = max_divergence_nats
        return msg

    def generate(self, prompt, *, timeout: float | None = None, **kw) -> pb.GenerateResponse:
        msg = self.request(prompt, **kw)
        own = msg.time_limit_s
        return self._unary(self.stub.Generate, lambda a: a.bound(msg, own), timeout)

    def _unary(self, method, message, timeout: float | None):
        """One retried unary call; `message(attempts)` builds each attempt's request."""
        attempts = _Attempts(self.retry, timeout or self.timeout, self._rng)
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

    def stream(
        self, prompt, *, timeout: float | None = None, **kw
    ) -> Iterator[pb.GenerateResponse]:
        """Iterate response chunks; the current call is kept on `last_call` (to cancel
        it). Retried only until the first chunk arrives. Leaving the loop early (break,
        an exception, closing the iterator) cancels the call, as the asyncio client's
        does: the server stops the request within one engine step."""
        msg = self.request(prompt, **kw)
        own = msg.time_limit_s
        attempts = _Attempts(self.retry, timeout or self.timeout, self._rng)
        while True:
            call = self.stub.GenerateStream(
                attempts.bound(msg, own), timeout=attempts.left_s(), metadata=self.metadata
            )
            self.last_call = call
            try:
                try:
                    first = next(call)
                except StopIteration:
                    return
                except grpc.RpcError as err:
                    pause = attempts.wait_after(err)
                    self.last_attempts = attempts.made
                    if pause is None:
                        raise
                    time.sleep(pause)
                    continue
                self.last_attempts = attempts.made + 1
                yield first
                yield from call  # from here on an error is the caller's: never retried
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
    `stream` is an async iterator. Same deadlines, token and retry policy."""

    _channel = staticmethod(grpc.aio.insecure_channel)

    request = staticmethod(CactusClient.request)

    async def generate(self, prompt, *, timeout: float | None = None, **kw) -> pb.GenerateResponse:
        msg = self.request(prompt, **kw)
        own = msg.time_limit_s
        return await self._unary(self.stub.Generate, lambda a: a.bound(msg, own), timeout)

    async def _unary(self, method, message, timeout: float | None):
        """One retried unary call; `message(attempts)` builds each attempt's request."""
        attempts = _Attempts(self.retry, timeout or self.timeout, self._rng)
        while True:
            try:
                reply = await method(
                    message(attempts), timeout=attempts.left_s(), metadata=self.metadata
                )
                self.last_attempts = attempts.made + 1
                return reply
            except grpc.RpcError as err:
                pause = attempts.wait_after(err)
                self.last_attempts = attempts.made
                if pause is None:
                    raise
                await asyncio.sleep(pause)

    async def stream(
        self, prompt, *, timeout: float | None = None, **kw
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Async-iterate response chunks; retried only until the first chunk arrives.
        Leaving the loop early (break, cancellation) cancels the call."""
        msg = self.request(prompt, **kw)
        own = msg.time_limit_s
        attempts = _Attempts(self.retry, timeout or self.timeout, self._rng)
        while True:
            call = self.stub.GenerateStream(
                attempts.bound(msg, own), timeout=attempts.left_s(), metadata=self.metadata
            )
            self.last_call = call
            try:
                try:
                    first = await _read(call)
                except grpc.RpcError as err:
                    pause = attempts.wait_after(err)
                    self.last_attempts = attempts.made
                    if pause is None:
                        raise
                    await asyncio.sleep(pause)
                    continue
                if first is grpc.aio.EOF:
                    return
                self.last_attempts = attempts.made + 1
                yield first
                while (chunk := await _read(call)) is not grpc.aio.EOF:
                    yield chunk
                return
            finally:
                if not call.done():
                    call.cancel()

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        """The served models and limits; retried as `generate` is."""
        return await self._unary(self.stub.GetModelInfo, lambda _: pb.ModelInfoRequest(), timeout)

    async def health(self, service: str = "") -> str:
        """The health service's status: a probe, one attempt, never retried."""
        reply = await self.health_stub.Check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=self.timeout,
            metadata=self.metadata,
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        await self.channel.close()
