"""Client retries against a real gRPC server on 127.0.0.1 that fails on purpose: both
clients retry UNAVAILABLE and RESOURCE_EXHAUSTED before the first response, with
bounded backoff inside the deadline, never after a streamed token, never other codes."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import NO_RETRY, AsyncCactusClient, CactusClient, RetryPolicy
from protos.cactus.v1 import cactus_pb2 as pb
from protos.cactus.v1 import cactus_pb2_grpc as pb_grpc

FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)


class Flaky(pb_grpc.CactusServicer):
    """Fails the first `failures` calls with `code`; a stream may fail after its first
    chunk instead (`fail_mid_stream`)."""

    def __init__(self) -> None:
        self.failures, self.code, self.fail_mid_stream = 0, grpc.StatusCode.UNAVAILABLE, False
        self.calls = 0
        self.pause_s = 0.0  # between a stream's two chunks
        self.first_pause_s = 0.0  # before its first
        self.limits: list[float] = []  # each call's time_limit_s, as received
        self.remaining: list[float] = []  # each call's gRPC deadline, seconds left at arrival
        self.fail_after_s = 0.0  # a failing call answers after this long
        self.pushback: str | None = None  # grpc-retry-pushback-ms on a failure
        self.lock = threading.Lock()

    def _maybe_fail(self, context, request=None) -> None:
        with self.lock:
            self.calls += 1
            if request is not None:
                self.limits.append(request.time_limit_s)
            self.remaining.append(context.time_remaining())
            failing = self.calls <= self.failures
        if failing:
            time.sleep(self.fail_after_s)
            if self.pushback is not None:
                context.set_trailing_metadata((("grpc-retry-pushback-ms", self.pushback),))
            context.abort(self.code, "try again")

    def Generate(self, request, context):
        self._maybe_fail(context, request)
        return pb.GenerateResponse(request_id="r", text="ok", token_ids=[1, 2])

    def GetModelInfo(self, request, context):
        self._maybe_fail(context)
        return pb.ModelInfo(verifier="v")

    def GenerateStream(self, request, context):
        self._maybe_fail(context, request)
        time.sleep(self.first_pause_s)
        yield pb.GenerateResponse(request_id="r", text="a", token_ids=[1])
        time.sleep(self.pause_s)
        if self.fail_mid_stream:
            context.abort(grpc.StatusCode.UNAVAILABLE, "engine restarting")
        yield pb.GenerateResponse(request_id="r", text="b", token_ids=[2], finish_reason="LENGTH")


class FlakyHealth(health_pb2_grpc.HealthServicer):
    """The gRPC health service, failing as its Flaky twin says (shares its counter)."""

    def __init__(self, twin: Flaky) -> None:
        self.twin = twin

    def Check(self, request, context):
        self.twin._maybe_fail(context)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture()
def flaky():
    servicer = Flaky()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_CactusServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(FlakyHealth(servicer), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_both_clients_retry_before_the_first_response(flaky, code):
    servicer, address = flaky
    servicer.failures, servicer.code = 2, code
    client = CactusClient(address, retry=FAST, timeout=10)
    assert client.generate("x").text == "ok" and client.last_attempts == 3
    servicer.calls = 0
    assert [c.text for c in client.stream("x")] == ["a", "b"] and client.last_attempts == 3

    async def run():
        aclient = AsyncCactusClient(address, retry=FAST, timeout=10)
        servicer.calls = 0
        reply = await aclient.generate("x")
        unary = aclient.last_attempts
        servicer.calls = 0
        texts = [c.text async for c in aclient.stream("x")]
        await aclient.close()
        return reply.text, unary, texts, aclient.last_attempts

    assert asyncio.run(run()) == ("ok", 3, ["a", "b"], 3)


def test_model_info_is_retried_and_health_is_a_single_probe(flaky):
    """model_info() retries as generate() does (a replica starting answers UNAVAILABLE);
    health() is a probe: one attempt, so a server that is down says so at once."""
    servicer, address = flaky
    servicer.failures = 2
    client = CactusClient(address, retry=FAST, timeout=10)
    assert client.model_info().verifier == "v" and client.last_attempts == 3

    async def run():
        aclient = AsyncCactusClient(address, retry=FAST, timeout=10)
        servicer.calls = 0
        info = await aclient.model_info()
        attempts = aclient.last_attempts
        servicer.calls = 0
        try:
            await aclient.health()
        except grpc.RpcError as err:
            code = err.code()
        await aclient.close()
        return info.verifier, attempts, code, servicer.calls

    assert asyncio.run(run()) == ("v", 3, grpc.StatusCode.UNAVAILABLE, 1)
    servicer.calls = 0
    with pytest.raises(grpc.RpcError) as err:
        client.health()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and servicer.calls == 1
    servicer.failures = 0
    assert client.health() == "SERVING" and servicer.calls == 2


def test_attempts_are_bounded_and_other_codes_are_not_retried(flaky):
    servicer, address = flaky
    servicer.failures = 100
    client = CactusClient(address, retry=FAST, timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        client.generate("x")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and servicer.calls == 4
    servicer.calls, servicer.code = 0, grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream("x"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and servicer.calls == 1
    servicer.calls, servicer.code = 0, grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError):
        CactusClient(address, retry=NO_RETRY).generate("x")
    assert servicer.calls == 1


def test_a_stream_is_never_retried_after_a_token(flaky):
    servicer, address = flaky
    servicer.fail_mid_stream = True
    client = CactusClient(address, retry=FAST, timeout=10)
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for chunk in client.stream("x"):
            got.append(chunk.text)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert got == ["a"] and servicer.calls == 1  # no second call: "a" is not repeated

    async def run():
        aclient = AsyncCactusClient(address, retry=FAST, timeout=10)
        servicer.calls = 0
        seen = []
        try:
            async for chunk in aclient.stream("x"):
                seen.append(chunk.text)
        except grpc.RpcError as e:
            seen.append(e.code())
        await aclient.close()
        return seen

    assert asyncio.run(run()) == ["a", grpc.StatusCode.UNAVAILABLE] and servicer.calls == 1


def test_backoff_is_full_jitter_under_the_cap():
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0)
    rng = random.Random(0)
    # far retries (a patient policy with a long deadline) stay at the cap, no overflow
    for retry, cap in [(0, 0.1), (1, 0.2), (3, 0.8), (6, 1.0), (2000, 1.0), (10**6, 1.0)]:
        draws = [policy.backoff(retry, rng) for _ in range(200)]
        assert min(draws) >= 0.0 and max(draws) <= cap
        assert max(draws) > 0.8 * cap  # it does spread over the range


def test_the_default_policy_is_the_documented_one():
    """README: 5 attempts, 0.2 s doubling to 5 s, on UNAVAILABLE and RESOURCE_EXHAUSTED;
    both clients use it unless told otherwise."""
    default = RetryPolicy()
    assert (default.max_attempts, default.initial_backoff_s, default.max_backoff_s) == (5, 0.2, 5.0)
    assert default.multiplier == 2.0
    assert set(default.codes) == {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert CactusClient("127.0.0.1:1").retry == default

    async def aclient():
        client = AsyncCactusClient("127.0.0.1:1")
        try:
            return client.retry
        finally:
            await client.close()

    assert asyncio.run(aclient()) == default


def test_every_attempt_carries_what_is_left_of_the_deadline_as_its_time_limit(flaky):
    """README: the clients give every request a server-side time_limit_s equal to what
    is left of the call's deadline, unless the caller sets one (then it is sent as is)."""
    servicer, address = flaky
    servicer.failures = 2
    client = CactusClient(address, retry=FAST, timeout=10)
    client.generate("x")
    first, *later = servicer.limits
    assert 9.0 < first <= 10.0 and len(later) == 2
    assert all(a > b for a, b in itertools.pairwise(servicer.limits))  # shrinking
    servicer.limits.clear()
    list(client.stream("x", timeout=5))
    assert len(servicer.limits) == 1 and 4.0 < servicer.limits[0] <= 5.0
    servicer.limits.clear()
    client.generate("x", time_limit_s=600.0)
    assert servicer.limits == [600.0]

    async def run():
        aclient = AsyncCactusClient(address, retry=FAST, timeout=7)
        await aclient.generate("x")
        [c async for c in aclient.stream("x", time_limit_s=3.0)]
        await aclient.close()

    servicer.limits.clear()
    asyncio.run(run())
    assert 6.0 < servicer.limits[0] <= 7.0 and servicer.limits[1] == 3.0


def test_retries_stop_at_the_calls_deadline(flaky, monkeypatch):
    """README: the retries stay inside the call's deadline. Against a server that always
    answers UNAVAILABLE, a policy that would otherwise retry for minutes (a million
    attempts, backoff up to 0.2 s) ends a 1.5 s call at its deadline, after a bounded
    number of attempts: unary and streaming, in both clients. It raises the server's
    UNAVAILABLE, not DEADLINE_EXCEEDED: no retry starts with less than MIN_RETRY_LEFT_S
    of the deadline left, which a local server answers well within (here raised to
    0.4 s, so that a loaded machine's stall cannot blur it)."""
    import client.client as client_module

    monkeypatch.setattr(client_module, "MIN_RETRY_LEFT_S", 0.4)
    servicer, address = flaky
    servicer.failures = 10**9
    patient = RetryPolicy(max_attempts=10**6, initial_backoff_s=0.05, max_backoff_s=0.2)
    rng = random.Random(0)  # its pauses alone would add up to far more than the deadline
    assert sum(patient.backoff(retry, rng) for retry in range(1000)) > 50.0
    timeout = 1.5

    def blocking(kind):
        client = CactusClient(address, retry=patient, timeout=timeout)
        try:
            if kind == "generate":
                client.generate("x")
            else:
                list(client.stream("x"))
        except grpc.RpcError as err:
            return err.code(), client.last_attempts
        finally:
            client.close()
        raise AssertionError("the call succeeded against a server that always fails")

    async def asyncio_client(kind):
        client = AsyncCactusClient(address, retry=patient, timeout=timeout)
        try:
            if kind == "generate":
                await client.generate("x")
            else:
                [c async for c in client.stream("x")]
        except grpc.RpcError as err:
            return err.code(), client.last_attempts
        finally:
            await client.close()
        raise AssertionError("the call succeeded against a server that always fails")

    calls = [
        ("blocking generate", lambda: blocking("generate")),
        ("blocking stream", lambda: blocking("stream")),
        ("asyncio generate", lambda: asyncio.run(asyncio_client("generate"))),
        ("asyncio stream", lambda: asyncio.run(asyncio_client("stream"))),
    ]
    for name, call in calls:
        servicer.calls = 0
        start = time.monotonic()
        code, attempts = call()
        elapsed = time.monotonic() - start
        assert code == grpc.StatusCode.UNAVAILABLE, name
        # it retried (the first pause is at most 0.05 s) and gave up at the deadline: no
        # retry once less than 2 x MIN_RETRY_LEFT_S (0.8 s here) is left when an attempt
        # fails, none started with less than MIN_RETRY_LEFT_S after its pause
        assert 2 <= servicer.calls < 200 and 2 <= attempts < 200, (name, servicer.calls)
        assert timeout - 0.8 < elapsed < timeout + 3.5, (name, elapsed)


def test_each_attempts_grpc_deadline_is_what_is_left_of_the_calls(flaky):
    """README: the retries stay inside the call's deadline: each attempt's gRPC deadline
    is what the earlier attempts left, not the whole timeout again. The first attempt
    fails after 1 s; the second arrives with at most 5 - 1 s left. Both clients, unary
    and streaming."""
    servicer, address = flaky
    servicer.fail_after_s = 1.0

    def check(run) -> None:
        servicer.failures, servicer.calls, servicer.remaining = 1, 0, []
        run()
        first, second = servicer.remaining
        assert 4.5 < first < 5.1 and second < first - 0.9, servicer.remaining

    client = CactusClient(address, retry=FAST, timeout=5.0)
    check(lambda: client.generate("x"))
    check(lambda: list(client.stream("x")))
    client.close()

    async def run():
        aclient = AsyncCactusClient(address, retry=FAST, timeout=5.0)
        try:
            servicer.failures, servicer.calls, servicer.remaining = 1, 0, []
            await aclient.generate("x")
            unary = list(servicer.remaining)
            servicer.failures, servicer.calls, servicer.remaining = 1, 0, []
            await _alist(aclient.stream("x"))
            return unary, list(servicer.remaining)
        finally:
            await aclient.close()

    for first, second in asyncio.run(run()):
        assert 4.5 < first < 5.1 and second < first - 0.9, (first, second)


def test_a_long_jitter_draw_is_shortened_to_the_deadline(flaky, monkeypatch):
    """A backoff drawn longer than the deadline leaves (full jitter up to a 5 s cap, 3 s
    left) is shortened to end 2 x MIN_RETRY_LEFT_S before the deadline, and the attempt
    after it succeeds:
    the old client gave up at once, UNAVAILABLE with most of its deadline and attempts
    unused (computed: 44% of the default policy's 4th pauses, drawn up to 1.6 s, with
    1 s left). Both clients, unary and streaming."""
    import client.client as client_module

    # 0.4 s (0.8 s left after the pause), so that a loaded machine's stall cannot blur it
    monkeypatch.setattr(client_module, "MIN_RETRY_LEFT_S", 0.4)
    monkeypatch.setattr(RetryPolicy, "backoff", lambda self, retry, rng: 5.0)
    servicer, address = flaky
    patient = RetryPolicy(max_attempts=3, initial_backoff_s=5.0, max_backoff_s=5.0)
    client = CactusClient(address, retry=patient, timeout=3.0)

    def timed(call):
        servicer.failures, servicer.calls = 1, 0
        start = time.monotonic()
        out = call()
        return out, servicer.calls, time.monotonic() - start

    results = [
        timed(lambda: client.generate("x").text),
        timed(lambda: [c.text for c in client.stream("x")]),
    ]
    client.close()

    async def run():
        aclient = AsyncCactusClient(address, retry=patient, timeout=3.0)
        try:
            return [
                await _atimed(servicer, lambda: aclient.generate("x"), lambda r: r.text),
                await _atimed(
                    servicer, lambda: _alist(aclient.stream("x")), lambda r: [c.text for c in r]
                ),
            ]
        finally:
            await aclient.close()

    results += asyncio.run(run())
    assert [r[0] for r in results] == ["ok", ["a", "b"], "ok", ["a", "b"]], results
    for _, calls, elapsed in results:
        assert calls == 2, results  # retried once, after a pause cut to fit
        assert 1.5 < elapsed < 3.0, results  # the pause was about 2.2 s, not 5 s


async def _alist(stream):
    return [chunk async for chunk in stream]


async def _atimed(servicer, call, shape):
    servicer.failures, servicer.calls = 1, 0
    start = time.monotonic()
    out = shape(await call())
    return out, servicer.calls, time.monotonic() - start


def test_the_asyncio_clients_stream_is_cancelled_from_another_thread(flaky):
    """README: `last_call.cancel()` from any thread; grpc.aio's own cancel is not
    thread-safe (it cancels asyncio tasks of the client's loop), so the client hands it
    to that loop: the stream, mid-way (the server pauses 2 s between its chunks), ends
    with RpcError CANCELLED well before the next chunk would have come."""
    servicer, address = flaky
    servicer.pause_s = 2.0

    async def run():
        aclient = AsyncCactusClient(address, retry=FAST, timeout=10)
        stream = aclient.stream("x")
        first = (await anext(stream)).text
        call, threads = aclient.last_call.call, []
        cancel = call.cancel

        def recorded():  # the thread grpc.aio's cancel runs on
            threads.append(threading.get_ident())
            return cancel()

        call.cancel = recorded
        await asyncio.to_thread(aclient.last_call.cancel)
        start = time.monotonic()
        try:
            await anext(stream)
            code = "a chunk"
        except grpc.RpcError as err:
            code = err.code()
        took = time.monotonic() - start
        await aclient.close()
        return first, code, took, threads

    first, code, took, threads = asyncio.run(run())
    assert (first, code) == ("a", grpc.StatusCode.CANCELLED)
    assert took < 1.0, took
    # on the loop's thread (asyncio.run's, this one), not the caller's
    assert threads and threads[0] == threading.get_ident(), threads


def test_no_retry_makes_one_attempt_in_the_asyncio_client(flaky):
    """README: `retry=NO_RETRY` turns retries off: the asyncio client's unary calls and
    streams make exactly one attempt on UNAVAILABLE."""
    servicer, address = flaky
    servicer.failures = 10**9

    async def run():
        client = AsyncCactusClient(address, retry=NO_RETRY, timeout=10)
        seen = []
        try:
            for call in (
                lambda: client.generate("x"),
                lambda: client.model_info(),
                lambda: _drain(client.stream("x")),
            ):
                servicer.calls = 0
                try:
                    await call()
                except grpc.RpcError as err:
                    seen.append((err.code(), servicer.calls, client.last_attempts))
        finally:
            await client.close()
        return seen

    async def _drain(stream):
        return [c async for c in stream]

    assert asyncio.run(run()) == [(grpc.StatusCode.UNAVAILABLE, 1, 1)] * 3


def test_a_message_over_the_servers_receive_limit_is_not_retried():
    """RESOURCE_EXHAUSTED for a message over the receive limit (gRPC: "Received message
    larger than max") is raised at once by both clients: the same message would meet it
    on every attempt. A full queue's RESOURCE_EXHAUSTED is still retried (above)."""
    servicer = Flaky()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2),
        options=[("grpc.max_receive_message_length", 1024)],
    )
    pb_grpc.add_CactusServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    try:
        client = CactusClient(address, retry=FAST, timeout=10)
        for call in (lambda: client.generate("x" * 4096), lambda: list(client.stream("y" * 4096))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in err.value.details() and client.last_attempts == 1

        async def run():
            aclient = AsyncCactusClient(address, retry=FAST, timeout=10)
            try:
                await aclient.generate("x" * 4096)
            except grpc.RpcError as err:
                code = err.code()
            await aclient.close()
            return code, aclient.last_attempts

        assert asyncio.run(run()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 1)
        assert servicer.calls == 0  # refused before the handler, every time
        # a short message goes through the same client
        assert client.generate("x").text == "ok"
    finally:
        server.stop(grace=None)


def test_a_single_stop_string_or_id_is_one_stop_not_its_characters():
    msg = CactusClient.request("p", stop="\n\n###", stop_token_ids=7)
    assert list(msg.sampling.stop) == ["\n\n###"] and list(msg.sampling.stop_token_ids) == [7]
    msg = CactusClient.request("p", stop=["a", "bc"], stop_token_ids=[1, 2])
    assert list(msg.sampling.stop) == ["a", "bc"] and list(msg.sampling.stop_token_ids) == [1, 2]


UNSET = {
    "max_tokens": None,
    "temperature": None,
    "top_p": None,
    "top_k": None,
    "seed": None,
    "stop": None,
    "stop_token_ids": None,
    "rule": None,
    "delta": None,
    "num_speculative_tokens": None,
    "max_divergence_nats": None,
    "request_id": None,
    "time_limit_s": None,
    "logprobs": None,
    "logit_bias": None,
}


def test_none_leaves_every_request_field_unset():
    """README: a field left unset (None in the clients) takes the server's default: an
    `optional` field is absent from the message, any other holds proto3's default (top_k
    0, rule "", no stops, no logit_bias, request_id "", time_limit_s 0), which the server reads as
    unset. A None for any of them is the same message as leaving it out."""
    assert set(UNSET) == set(CactusClient.request.__kwdefaults__)  # every parameter
    msg = CactusClient.request("p", **UNSET)
    empty = pb.GenerateRequest(
        prompt="p", sampling=pb.SamplingParams(), speculation=pb.SpeculationParams()
    )
    assert msg == CactusClient.request("p") == empty
    s, sp = msg.sampling, msg.speculation
    for name in ("max_tokens", "temperature", "top_p", "seed", "logprobs"):
        assert not s.HasField(name), name
    for name in ("delta", "num_speculative_tokens", "max_divergence_nats"):
        assert not sp.HasField(name), name
    assert (s.top_k, list(s.stop), list(s.stop_token_ids)) == (0, [], [])
    assert dict(s.logit_bias) == {}
    assert (sp.rule, msg.request_id, msg.time_limit_s) == ("", "", 0.0)
    # set values still go through
    msg = CactusClient.request("p", top_k=5, rule="sps", request_id="r", time_limit_s=2.0)
    assert (msg.sampling.top_k, msg.speculation.rule) == (5, "sps")
    assert (msg.request_id, msg.time_limit_s) == ("r", 2.0)


def test_both_clients_send_a_request_of_nones(flaky):
    """generate and stream, blocking and asyncio, take the Nones too; a None time limit
    is bounded by the call's deadline as an absent one is."""
    servicer, address = flaky
    client = CactusClient(address, retry=FAST, timeout=10)
    assert client.generate("x", **UNSET).text == "ok"
    assert [c.text for c in client.stream("x", **UNSET)] == ["a", "b"]

    async def run():
        aclient = AsyncCactusClient(address, retry=FAST, timeout=10)
        reply = await aclient.generate("x", **UNSET)
        chunks = [c.text async for c in aclient.stream("x", **UNSET)]
        await aclient.close()
        return reply.text, chunks

    assert asyncio.run(run()) == ("ok", ["a", "b"])
    assert len(servicer.limits) == 4 and all(0 < limit <= 10 for limit in servicer.limits)


def test_a_stream_cancelled_through_last_call_raises_cancelled_in_both_clients(flaky):
    """`last_call.cancel()` mid-stream: the blocking client raises RpcError CANCELLED,
    and so does the asyncio one (grpc.aio alone raises asyncio.CancelledError, which a
    caller cannot tell from its task's own cancellation); a cancelled task still gets
    CancelledError."""
    servicer, address = flaky
    servicer.pause_s = 2.0
    client = CactusClient(address, retry=FAST, timeout=10)
    stream = client.stream("x")
    assert next(stream).text == "a"
    client.last_call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert err.value.code() == grpc.StatusCode.CANCELLED

    async def run():
        aclient = AsyncCactusClient(address, retry=FAST, timeout=10)
        stream = aclient.stream("x")
        first = (await anext(stream)).text
        aclient.last_call.cancel()
        try:
            await anext(stream)
        except grpc.RpcError as err:
            code = err.code()

        async def consume():
            async for _ in aclient.stream("x"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.5)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            cancelled = True
        # cancelled before its first chunk: the same
        servicer.first_pause_s = 2.0
        early = asyncio.ensure_future(anext(aclient.stream("x")))
        await asyncio.sleep(0.5)
        aclient.last_call.cancel()
        try:
            await early
        except grpc.RpcError as err:
            before_first = err.code()
        await aclient.close()
        return first, code, cancelled, before_first

    cancelled = grpc.StatusCode.CANCELLED
    assert asyncio.run(run()) == ("a", cancelled, True, cancelled)


def test_a_stream_cancelled_before_it_starts_or_while_it_waits_to_retry_makes_no_call(
    flaky, monkeypatch
):
    """`last_call` is the stream from `stream()` on, across its attempts: cancelled
    before the first iteration, or during the pause before a retry (an overloaded
    server said RESOURCE_EXHAUSTED), the stream raises RpcError CANCELLED and starts
    no further call, in both clients. (It used to be the attempt's call: a cancel in
    the pause reached the finished attempt and the retry ran the whole stream.)"""
    servicer, address = flaky
    monkeypatch.setattr(RetryPolicy, "backoff", lambda self, retry, rng: 3.0)
    cancelled = grpc.StatusCode.CANCELLED
    client = CactusClient(address, retry=FAST, timeout=10)
    stream = client.stream("x")
    client.last_call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert err.value.code() == cancelled and servicer.calls == 0

    servicer.failures, servicer.code = 1, grpc.StatusCode.RESOURCE_EXHAUSTED
    outcome: list = []

    def consume() -> None:
        try:
            outcome.extend(c.text for c in client.stream("x"))
        except grpc.RpcError as failed:
            outcome.append(failed.code())

    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.monotonic() + 5
    while servicer.calls < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # in the 3 s pause before the retry
    cancelled_at = time.monotonic()
    assert client.last_call.cancel()
    reader.join(timeout=5)
    waited = time.monotonic() - cancelled_at
    time.sleep(0.3)
    assert outcome == [cancelled] and servicer.calls == 1, (outcome, servicer.calls)
    assert waited < 2.0, waited  # the cancel ends the pause, not its end
    client.close()

    async def run():
        aclient = AsyncCactusClient(address, retry=FAST, timeout=10)
        servicer.calls, servicer.failures = 0, 0
        early = aclient.stream("x")
        aclient.last_call.cancel()
        try:
            await anext(early)
            before = "a chunk"
        except grpc.RpcError as failed:
            before = failed.code()
        calls_before = servicer.calls
        servicer.failures = 1

        async def consume_async():
            try:
                return [c.text async for c in aclient.stream("x")]
            except grpc.RpcError as failed:
                return failed.code()

        task = asyncio.create_task(consume_async())
        while servicer.calls < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        cancelled_at = time.monotonic()
        aclient.last_call.cancel()
        waiting = await asyncio.wait_for(task, 5)
        quick = time.monotonic() - cancelled_at < 2.0
        await asyncio.sleep(0.3)
        await aclient.close()
        return before, calls_before, waiting, servicer.calls, quick

    assert asyncio.run(run()) == (cancelled, 0, cancelled, 1, True)


def test_a_cancel_between_a_retryable_failure_and_its_pause_raises_cancelled(flaky, monkeypatch):
    """A `last_call.cancel()` that landed after an attempt's RESOURCE_EXHAUSTED arrived
    but before the pause began re-raised RESOURCE_EXHAUSTED: the caller who cancelled
    got the overload error. Both clients now raise CANCELLED there, and call no more."""
    import client.client as client_module

    servicer, address = flaky
    servicer.failures, servicer.code = 1, grpc.StatusCode.RESOURCE_EXHAUSTED
    real = client_module._Attempts.wait_after
    holder: dict = {}

    def cancelling(self, err):  # the cancel arrives just as the failure is read
        holder["client"].last_call.cancel()
        return real(self, err)

    monkeypatch.setattr(client_module._Attempts, "wait_after", cancelling)
    client = holder["client"] = CactusClient(address, retry=FAST, timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream("x"))
    assert err.value.code() == grpc.StatusCode.CANCELLED and servicer.calls == 1
    client.close()

    async def run():
        aclient = holder["client"] = AsyncCactusClient(address, retry=FAST, timeout=10)
        servicer.calls = 0
        try:
            return [c.text async for c in aclient.stream("x")]
        except grpc.RpcError as failed:
            return failed.code(), servicer.calls
        finally:
            await aclient.close()

    assert asyncio.run(run()) == (grpc.StatusCode.CANCELLED, 1)


def test_the_async_client_may_be_built_outside_an_event_loop(flaky):
    """A grpc.aio channel belongs to one event loop: built at module level (outside
    any loop, as the blocking client is in the README) and called in `asyncio.run`,
    the client's calls failed with "attached to a different loop". Its channel now
    opens at the first call, on that loop, and again on a later loop."""
    _, address = flaky
    aclient = AsyncCactusClient(address, retry=FAST, timeout=10)

    async def call():
        reply = await asyncio.wait_for(aclient.generate("x"), 5)
        texts = [c.text async for c in aclient.stream("x")]
        return reply.text, texts, await aclient.health()

    assert asyncio.run(call()) == ("ok", ["a", "b"], "SERVING")
    assert asyncio.run(call()) == ("ok", ["a", "b"], "SERVING")  # a second loop
    assert len(aclient._conns) == 1  # the first loop's channel went with it
    # loops in two threads at once: a channel each (one replacing the other's would
    # close it under its running calls)
    outcomes: list = []
    threads = [threading.Thread(target=lambda: outcomes.append(asyncio.run(call())))]
    threads.append(threading.Thread(target=lambda: outcomes.append(asyncio.run(call()))))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert outcomes == [("ok", ["a", "b"], "SERVING")] * 2

    async def closing():
        out = await call()
        await aclient.close()
        return out

    assert asyncio.run(closing())[0] == "ok"


@pytest.mark.parametrize("retry", [False, 0, 3, {"max_attempts": 1}])
def test_a_retry_that_is_no_policy_is_a_value_error_naming_it(retry):
    """`retry=False` used to mean the default policy (five attempts, the opposite of
    what it says), and `retry=3` failed with an AttributeError at the first retry."""
    with pytest.raises(ValueError, match=r"^retry: "):
        CactusClient("127.0.0.1:1", retry=retry)
    with pytest.raises(ValueError, match=r"^retry: "):
        AsyncCactusClient("127.0.0.1:1", retry=retry)


def test_a_large_multiplier_backs_off_at_most_max_backoff():
    """multiplier ** retry overflowed a float (OverflowError) long before retry 64 for a
    large multiplier."""
    rng = random.Random(0)
    for multiplier in (1e10, 10**6):
        policy = RetryPolicy(multiplier=multiplier, max_attempts=100)
        assert all(0 <= policy.backoff(r, rng) <= policy.max_backoff_s for r in range(70))
    still = RetryPolicy(initial_backoff_s=0.0, max_backoff_s=0.0, multiplier=1e10)
    assert still.backoff(63, rng) == 0.0


class _LongestPause(random.Random):
    """The jitter's longest draw, so a retry's pause lasts the whole backoff."""

    def uniform(self, a, b):
        return b


def test_closing_the_async_client_ends_its_calls_for_good(flaky):
    """`await close()` is final for its loop: a unary call or a stream waiting to retry
    makes no further attempt (it reopened a channel that nothing closed), a call in
    flight ends with RpcError CANCELLED (grpc.aio raised CancelledError for a unary call,
    as if the caller's own task had been cancelled), and a later call raises the same at
    once; nothing reaches the server after the close."""
    servicer, address = flaky
    slow = RetryPolicy(max_attempts=3, initial_backoff_s=1.0, max_backoff_s=1.0)

    async def closed_during(call, *, in_flight: bool):
        aclient = AsyncCactusClient(address, retry=slow, timeout=20)
        aclient._rng = _LongestPause()
        servicer.calls, servicer.failures = 0, 1
        servicer.fail_after_s = 1.0 if in_flight else 0.0
        task = asyncio.create_task(call(aclient))
        await asyncio.sleep(0.3)  # the first attempt is in flight, or failed and pausing
        assert servicer.calls == 1 and not task.done()
        await aclient.close()
        with pytest.raises(grpc.RpcError) as err:
            await asyncio.wait_for(task, 5)
        await asyncio.sleep(1.2)  # past the pause: no second attempt was made
        assert servicer.calls == 1 and not aclient._conns
        with pytest.raises(grpc.RpcError) as later:
            await aclient.generate("x")
        assert later.value.code() == grpc.StatusCode.CANCELLED and servicer.calls == 1
        return err.value

    async def unary(aclient):
        return await aclient.generate("x")

    async def stream(aclient):
        return [c async for c in aclient.stream("x")]

    async def health(aclient):
        return await aclient.health()

    async def cancelled_and_closed():
        """The caller cancels its task as the client closes (a shutdown): the task ends
        cancelled, not with an RpcError (asyncio.timeout and task groups count on it)."""
        aclient = AsyncCactusClient(address, retry=slow, timeout=20)
        servicer.calls, servicer.failures, servicer.fail_after_s = 0, 1, 1.0
        task = asyncio.create_task(aclient.generate("x"))
        await asyncio.sleep(0.3)
        task.cancel()
        await aclient.close()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled()

    async def run():
        errors = [await closed_during(c, in_flight=False) for c in (unary, stream)]
        errors += [await closed_during(c, in_flight=True) for c in (unary, health)]
        return errors, await cancelled_and_closed()

    errors, cancelled = asyncio.run(run())
    for error in errors:
        assert error.code() == grpc.StatusCode.CANCELLED, error
    assert cancelled


def test_both_clients_honour_the_servers_retry_pushback(flaky):
    """gRFC A6's `grpc-retry-pushback-ms` trailer: negative (the server's answer for a
    request that failed the engine on every attempt) means do not retry, in both
    clients, unary and stream; a non-negative one replaces the backoff."""
    servicer, address = flaky
    servicer.failures, servicer.pushback = 2, "-1"
    client = CactusClient(address, retry=FAST, timeout=10)
    for call in (lambda: client.generate("x"), lambda: list(client.stream("x"))):
        servicer.calls = 0
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and servicer.calls == 1

    async def run():
        aclient = AsyncCactusClient(address, retry=FAST, timeout=10)
        codes = []
        for call in (lambda: aclient.generate("x"), lambda: _drain(aclient.stream("x"))):
            servicer.calls = 0
            with pytest.raises(grpc.RpcError) as err:
                await call()
            codes.append((err.value.code(), servicer.calls))
        await aclient.close()
        return codes

    async def _drain(stream):
        return [c async for c in stream]

    assert asyncio.run(run()) == [(grpc.StatusCode.UNAVAILABLE, 1)] * 2
    # 300 ms: longer than FAST's backoff (at most 50 ms), so the wait is the server's
    servicer.calls, servicer.failures, servicer.pushback = 0, 1, "300"
    start = time.monotonic()
    assert client.generate("x").text == "ok" and servicer.calls == 2
    assert time.monotonic() - start >= 0.28
