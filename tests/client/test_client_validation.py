"""The Python clients refuse bad input with a ValueError that starts with the field's name,
before any RPC: request fields (types, what the proto's fields cannot hold, NaN and
infinite floats, a bytes prompt), `stream` at the call rather than at its first
iteration, the client's and a call's `timeout`, and RetryPolicy's fields. No server is
needed: every check fails before a call is made (the address has none)."""

from __future__ import annotations

import asyncio
import math
import random
import warnings

import grpc
import numpy as np
import pytest

from client import NO_RETRY, AsyncCactusClient, CactusClient, RetryPolicy
from client.client import MIN_RETRY_LEFT_S, _Attempts

NOWHERE = "127.0.0.1:1"  # nothing listens: a call that got made would fail UNAVAILABLE

BAD_FIELDS = [
    # what protobuf used to raise without naming the field ("Value out of range: -1")
    ("max_tokens", -1),
    ("num_speculative_tokens", -1),
    ("seed", -1),
    ("logprobs", -1),
    # past the field's width (uint32, uint64, int32, int64)
    ("max_tokens", 1 << 32),
    ("num_speculative_tokens", 1 << 32),
    ("seed", 1 << 64),
    ("logprobs", 1 << 32),
    ("top_k", 1 << 31),
    ("top_k", -(1 << 31) - 1),
    ("stop_token_ids", 1 << 63),
    # wrong types (protobuf's TypeError named no field; a bool is no count)
    ("max_tokens", 1.5),
    ("max_tokens", "5"),
    ("max_tokens", True),
    ("seed", 7.0),
    ("top_k", "20"),
    ("logprobs", False),
    ("temperature", "0.5"),
    ("temperature", True),
    ("top_p", [0.9]),
    ("delta", "1"),
    ("max_divergence_nats", object()),
    ("time_limit_s", "10"),
    ("stop", 5),
    ("stop", ["ok", 5]),
    ("stop", b"\n"),
    ("stop_token_ids", "7"),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 2.0),
    ("rule", 5),
    ("request_id", 7),
    ("logit_bias", [(5, 1.0)]),  # a mapping, as OpenAI's
    ("logit_bias", {1.5: 2.0}),
    ("logit_bias", {"x": 2.0}),
    ("logit_bias", {True: 2.0}),
    ("logit_bias", {5: "2"}),
    ("logit_bias", {5: math.nan}),
    ("logit_bias", {5: 1.0, "5": 2.0}),
    ("logit_bias", {1 << 63: 1.0}),
    ("logit_bias", {"\u00b2": 1.0}),  # a digit to str.isdigit, not to int()
    ("logit_bias", {"1" * 5000: 1.0}),
    # floats the server cannot use
    ("temperature", math.nan),
    ("top_p", math.inf),
    ("delta", -math.inf),
    ("max_divergence_nats", math.nan),
    ("time_limit_s", math.inf),
    ("temperature", 10**400),  # an int too large for a float
    # text protobuf cannot encode (undecodable bytes in argv become lone surrogates):
    # protobuf's UnicodeEncodeError named no field
    ("stop", "\ud800"),
    ("stop", ["ok", "a\udcff"]),
    ("rule", "\ud800"),
    ("request_id", "id-\udc80"),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_request_refuses_a_bad_value_naming_its_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: ") as err:
        CactusClient.request("x", **{field: value})
    assert "Value out of range" not in str(err.value)


BAD_PROMPTS = [b"def f():", bytearray(b"ab"), memoryview(b"ab"), None, 5, 1.5, "def \udcff():"]
# items that are no token ids; a set has no order; 1 << 63 is past int64
BAD_PROMPTS += [[1, "2"], [1, 2.0], [True], {1, 2}, {1: 2}, [1 << 63]]


@pytest.mark.parametrize("prompt", BAD_PROMPTS)
def test_a_prompt_is_a_str_or_a_sequence_of_int_token_ids(prompt):
    """A bytes prompt used to go silently as token ids (its byte values)."""
    with pytest.raises(ValueError, match=r"^prompt: "):
        CactusClient.request(prompt)


def test_values_the_message_can_hold_go_through_unchanged():
    """Only what the message cannot hold is refused here: ranges the server checks
    (temperature <= 2, top_k <= vocab, max_tokens within the context) go to it, which
    answers INVALID_ARGUMENT naming the field; so does a negative temperature."""
    msg = CactusClient.request(
        np.array([1, 2, 3]),  # numpy's ints are ints
        max_tokens=(1 << 32) - 1,
        num_speculative_tokens=np.int64(4),
        seed=(1 << 64) - 1,
        logprobs=0,
        top_k=-1,
        temperature=-1.0,  # the server's to refuse (tests/deployments/test_ingress.py)
        top_p=1,  # an int is a number
        delta=np.float32(0.5),
        max_divergence_nats=0.0,
        time_limit_s=2,
        stop=("a", "b"),
        stop_token_ids=np.int64(7),
        rule="sps",
        request_id="r",
        logit_bias={7: 100, "9": -100.0, np.int64(3): np.float32(0.5)},  # range: the server's
    )
    assert list(msg.prompt_token_ids.ids) == [1, 2, 3]
    assert dict(msg.sampling.logit_bias) == {7: 100.0, 9: -100.0, 3: 0.5}
    s, sp = msg.sampling, msg.speculation
    assert (s.max_tokens, s.seed, s.logprobs, s.top_k) == ((1 << 32) - 1, (1 << 64) - 1, 0, -1)
    assert s.HasField("logprobs") and (s.temperature, s.top_p) == (-1.0, 1.0)
    assert (list(s.stop), list(s.stop_token_ids)) == (["a", "b"], [7])
    assert (sp.num_speculative_tokens, sp.delta, sp.rule) == (4, 0.5, "sps")
    assert sp.HasField("max_divergence_nats") and (msg.request_id, msg.time_limit_s) == ("r", 2.0)
    for prompt in ((5, 6), range(5, 7), [np.int32(5), 6]):
        assert list(CactusClient.request(prompt).prompt_token_ids.ids) == [5, 6]


def test_a_zero_count_is_still_unset_with_a_future_warning():
    for name in ("max_tokens", "num_speculative_tokens"):
        with pytest.warns(FutureWarning, match=f"{name}=0"):
            msg = CactusClient.request("x", **{name: 0})
        assert not msg.sampling.HasField("max_tokens")
        assert not msg.speculation.HasField("num_speculative_tokens")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a None or a 1 warns of nothing
        CactusClient.request("x", max_tokens=None, num_speculative_tokens=1)


def test_stream_refuses_a_bad_value_at_the_call_not_at_its_first_iteration():
    """`client.stream("x", seed=-1)` raises at once, in both clients: before, both were
    generator functions, so the error waited for the first `next`. Nothing is called."""
    client = CactusClient(NOWHERE, retry=NO_RETRY)
    with pytest.raises(ValueError, match=r"^seed: "):
        client.stream("x", seed=-1)
    with pytest.raises(ValueError, match=r"^prompt: "):
        client.stream(b"x")
    with pytest.raises(ValueError, match=r"^timeout: "):
        client.stream("x", timeout=0)
    assert client.last_call is None  # no call was made
    client.close()

    async def run():
        aclient = AsyncCactusClient(NOWHERE, retry=NO_RETRY)
        try:
            for kw, field in (({"seed": -1}, "seed"), ({"timeout": -1.0}, "timeout")):
                with pytest.raises(ValueError, match=rf"^{field}: "):
                    aclient.stream("x", **kw)
            with pytest.raises(ValueError, match=r"^temperature: "):
                aclient.stream("x", temperature="0.5")
            return aclient.last_call
        finally:
            await aclient.close()

    assert asyncio.run(run()) is None


@pytest.mark.parametrize("timeout", [None, 0, -1, math.nan, math.inf, "5", True])
def test_a_client_timeout_is_a_finite_number_of_seconds_above_zero(timeout):
    """`CactusClient(addr, timeout=None)` used to fail at its first call with a TypeError
    (`time.monotonic() + None`); a 0 gave every call an expired deadline."""
    with pytest.raises(ValueError, match=r"^timeout: "):
        CactusClient(NOWHERE, timeout=timeout)

    async def run():
        with pytest.raises(ValueError, match=r"^timeout: "):
            AsyncCactusClient(NOWHERE, timeout=timeout)

    asyncio.run(run())


@pytest.mark.parametrize("timeout", [0, -1, math.nan, math.inf, "5"])
def test_a_calls_own_timeout_is_checked_before_the_call(timeout):
    """A call's own `timeout` replaces the client's only where it is not None; a 0 used
    to fall back to the client's silently (`timeout or self.timeout`)."""
    client = CactusClient(NOWHERE, timeout=1, retry=NO_RETRY)
    for call in (
        lambda: client.generate("x", timeout=timeout),
        lambda: client.model_info(timeout=timeout),
        lambda: client.stream("x", timeout=timeout),
    ):
        with pytest.raises(ValueError, match=r"^timeout: "):
            call()
    client.close()

    async def run():
        aclient = AsyncCactusClient(NOWHERE, timeout=1, retry=NO_RETRY)
        try:
            for call in (
                lambda: aclient.generate("x", timeout=timeout),
                lambda: aclient.model_info(timeout=timeout),
            ):
                with pytest.raises(ValueError, match=r"^timeout: "):
                    await call()
        finally:
            await aclient.close()

    asyncio.run(run())


def test_last_call_is_none_before_the_first_stream():
    client = CactusClient(NOWHERE)
    assert client.last_call is None
    client.close()

    async def run():
        aclient = AsyncCactusClient(NOWHERE)
        try:
            return aclient.last_call
        finally:
            await aclient.close()

    assert asyncio.run(run()) is None


@pytest.mark.parametrize(
    ("field", "kw"),
    [
        ("max_attempts", {"max_attempts": 0}),
        ("max_attempts", {"max_attempts": 2.5}),
        ("max_attempts", {"max_attempts": True}),
        ("initial_backoff_s", {"initial_backoff_s": -0.1}),
        ("initial_backoff_s", {"initial_backoff_s": math.nan}),
        ("initial_backoff_s", {"initial_backoff_s": 6.0}),  # above max_backoff_s 5
        ("max_backoff_s", {"max_backoff_s": math.inf}),
        ("max_backoff_s", {"max_backoff_s": "5"}),
        ("multiplier", {"multiplier": 0}),
        ("multiplier", {"multiplier": math.nan}),
        ("codes", {"codes": grpc.StatusCode.UNAVAILABLE}),  # one code, not a tuple of them
        ("codes", {"codes": ("UNAVAILABLE",)}),
        ("codes", {"codes": (14,)}),
    ],
)
def test_retry_policy_refuses_a_bad_field_naming_it(field, kw):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        RetryPolicy(**kw)


def test_retry_policy_takes_its_documented_values():
    assert RetryPolicy(max_attempts=1) == RetryPolicy(max_attempts=1, codes=RetryPolicy().codes)
    policy = RetryPolicy(initial_backoff_s=0, max_backoff_s=0, codes=[grpc.StatusCode.ABORTED])
    assert policy.codes == (grpc.StatusCode.ABORTED,)  # a list is kept a tuple,
    hash(policy)  # so the frozen policy stays hashable (a list in it raised TypeError)
    assert RetryPolicy(codes=()).codes == ()


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "try again"


def test_no_retry_starts_with_almost_none_of_the_deadline_left():
    """A retry that would start with less than MIN_RETRY_LEFT_S of the deadline left
    after its pause is not made: the call raises the error it had (UNAVAILABLE) rather
    than a DEADLINE_EXCEEDED of an attempt that had no time to answer. With time left it
    retries as before."""
    instant = RetryPolicy(max_attempts=100, initial_backoff_s=0.0, max_backoff_s=0.0)
    rng = random.Random(0)
    assert _Attempts(instant, 30.0, rng).wait_after(_Unavailable()) == 0.0
    short = _Attempts(instant, MIN_RETRY_LEFT_S / 2, rng)
    assert short.wait_after(_Unavailable()) is None
    assert not short.time_for_another()
