"""validate_request: every rule of serving.md's table, one bad field at a time."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from cactus.errors import InvalidRequestError
from cactus.params import (
    GenerationRequest,
    Limits,
    SamplingParams,
    SpeculationParams,
    validate_request,
)

LIMITS = Limits(
    max_context=1024,
    vocab_size=8192,
    max_num_speculative_tokens=8,
    delta_ceiling=4.0,
    allowed_rules=("none", "sps", "cactus", "cactus_exact"),
)
GOOD = GenerationRequest(
    prompt="def f(x):",
    sampling=SamplingParams(max_tokens=16),
    speculation=SpeculationParams(rule="cactus", delta=1.0),
)


def _s(**kw):
    return replace(GOOD, sampling=replace(GOOD.sampling, **kw))


def _sp(**kw):
    return replace(GOOD, speculation=replace(GOOD.speculation, **kw))


BAD = [
    ("prompt", replace(GOOD, prompt="")),
    ("prompt", replace(GOOD, prompt=None)),
    ("prompt", replace(GOOD, prompt_token_ids=(1, 2))),  # both given
    ("prompt_token_ids", replace(GOOD, prompt=None, prompt_token_ids=(1, 8192))),
    ("prompt_token_ids", replace(GOOD, prompt=None, prompt_token_ids=(-1,))),
    ("prompt_token_ids", replace(GOOD, prompt=None, prompt_token_ids=tuple(range(1025)))),
    ("max_tokens", _s(max_tokens=0)),
    ("max_tokens", _s(max_tokens=-3)),
    ("max_tokens", _s(max_tokens=1025)),
    ("max_tokens", _s(max_tokens=2.5)),
    ("temperature", _s(temperature=math.nan)),
    ("temperature", _s(temperature=math.inf)),
    ("temperature", _s(temperature=-0.1)),
    ("temperature", _s(temperature=2.5)),
    ("top_p", _s(top_p=0.0)),
    ("top_p", _s(top_p=1.5)),
    ("top_p", _s(top_p=math.nan)),
    ("top_k", _s(top_k=-2)),
    ("top_k", _s(top_k=8193)),
    ("top_k", _s(top_k=1.5)),
    ("seed", _s(seed=-1)),
    ("seed", _s(seed=2**64)),
    ("stop", _s(stop=("",))),
    ("stop", _s(stop=tuple("abcdefghi"))),
    ("stop", _s(stop=("x" * 257,))),
    ("stop_token_ids", _s(stop_token_ids=(9000,))),
    ("logit_bias", _s(logit_bias=((9000, 1.0),))),
    ("logit_bias", _s(logit_bias=((5, 100.5),))),
    ("logit_bias", _s(logit_bias=((5, math.nan),))),
    ("logit_bias", _s(logit_bias=((5, True),))),
    ("logit_bias", _s(logit_bias=((5, 1.0), (5, -1.0)))),
    ("logit_bias", _s(logit_bias=tuple((i, 1.0) for i in range(301)))),
    ("logit_bias", _s(logit_bias=((5, 10**400),))),  # an int no float holds: no OverflowError
    ("rule", _sp(rule="greedy")),
    ("rule", _sp(rule="tas")),  # valid rule, not enabled by these limits
    ("delta", _sp(delta=-0.5)),
    ("delta", _sp(delta=math.nan)),
    ("delta", _sp(delta=4.5)),  # above the operator ceiling
    ("num_speculative_tokens", _sp(num_speculative_tokens=0)),
    ("num_speculative_tokens", _sp(num_speculative_tokens=9)),
    ("max_divergence_nats", _sp(max_divergence_nats=-1.0)),
    ("max_divergence_nats", _sp(max_divergence_nats=math.inf)),
    # ints no float holds: refused by name, not an OverflowError from math.isfinite
    ("temperature", _s(temperature=10**400)),
    ("top_p", _s(top_p=-(10**400))),
    ("delta", _sp(delta=10**400)),
    ("max_divergence_nats", _sp(max_divergence_nats=10**400)),
    ("tas_threshold", _sp(tas_threshold=10**400)),
    ("tas_alpha", _sp(tas_alpha=10**400)),
    ("time_limit_s", replace(GOOD, time_limit_s=10**400)),
    # a bare string would be read character by character; a bare number has no length
    ("stop", _s(stop="END")),
    ("stop", _s(stop=5)),
    ("stop_token_ids", _s(stop_token_ids=5)),
    ("prompt_token_ids", replace(GOOD, prompt=None, prompt_token_ids=5)),
    ("prompt_token_ids", replace(GOOD, prompt=None, prompt_token_ids="12")),
    ("prompt_token_ids", replace(GOOD, prompt=None, prompt_token_ids=(1, 2.0))),
    ("resume_token_ids", replace(GOOD, resume_token_ids=7)),
]


@pytest.mark.parametrize(("field", "request_"), BAD)
def test_bad_field_is_named(field, request_):
    with pytest.raises(InvalidRequestError) as err:
        validate_request(request_, LIMITS)
    assert err.value.field == field
    assert isinstance(err.value, ValueError) and field in str(err.value)


def test_context_checks_need_the_prompt_length():
    """Worded as OpenAI's and vLLM's ("This model's maximum context length is N
    tokens") and with their code: clients match either to trim a conversation."""
    said = "This model's maximum context length is 1024 tokens"
    validate_request(_s(max_tokens=1000), LIMITS)
    with pytest.raises(InvalidRequestError, match="1030 tokens. " + said) as err:
        validate_request(_s(max_tokens=1000), LIMITS, prompt_len=30)
    assert err.value.field == "max_tokens" and err.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError, match=said) as err:
        validate_request(_s(max_tokens=2000), LIMITS)
    assert err.value.field == "max_tokens" and err.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError) as err:
        validate_request(GOOD, LIMITS, prompt_len=1024)
    assert err.value.field == "prompt" and err.value.code == "context_length_exceeded"
    # a request that came with ids is told about the field it sent
    for n in (1024, 1025):
        ids = replace(GOOD, prompt=None, prompt_token_ids=(1,) * n)
        with pytest.raises(InvalidRequestError, match=f"{n} tokens leave no room. {said}") as err:
            validate_request(ids, LIMITS)
        assert err.value.field == "prompt_token_ids"
        assert err.value.code == "context_length_exceeded"
    # the code survives pickling (rank 0 raises the KV budget's over Ray)
    import pickle

    again = pickle.loads(pickle.dumps(err.value))
    assert (again.field, again.code, str(again)) == (
        err.value.field,
        err.value.code,
        str(err.value),
    )
    # other checks have no code
    with pytest.raises(InvalidRequestError) as err:
        validate_request(_s(temperature=3.0), LIMITS)
    assert err.value.code is None
    validate_request(replace(GOOD, prompt=None, prompt_token_ids=(1,) * 1023), LIMITS)


def test_a_text_prompt_over_max_prompt_chars_is_refused_by_name():
    """limits.max_prompt_chars bounds a text prompt before it is tokenised."""
    limits = replace(LIMITS, max_prompt_chars=20)
    validate_request(replace(GOOD, prompt="x" * 20), limits)
    with pytest.raises(InvalidRequestError, match="longer than 20 characters") as err:
        validate_request(replace(GOOD, prompt="x" * 21), limits)
    assert err.value.field == "prompt"


def test_every_refusal_gives_the_value_it_refused():
    """README: INVALID_ARGUMENT details give the field, the rule and the value (or the
    count) that broke it; only a prompt that is missing has no value to give."""
    for field, request in BAD:
        with pytest.raises(InvalidRequestError) as err:
            validate_request(request, LIMITS)
        message = str(err.value)
        if "give exactly one" in message:
            continue
        value = next(
            getattr(part, field)
            for part in (request, request.sampling, request.speculation)
            if hasattr(part, field)
        )
        assert any(shown in message for shown in refused_forms(value)), (field, message)


def refused_forms(value) -> set[str]:
    """How a refusal may show the value it refused: itself, or for a sequence its
    length or one of its items (or that item's length)."""
    forms = {repr(value), str(value)}
    if isinstance(value, int) and abs(value) >= 10**30:  # shown by its size
        forms = {f"an integer of {value.bit_length()} bits"}
    if isinstance(value, (list, tuple, str)):
        forms.add(str(len(value)))
        if not isinstance(value, str):
            for item in value:
                forms |= {repr(item), str(item)}
                if isinstance(item, str):
                    forms.add(f"{len(item)} characters")
    return {f for f in forms if f}


def test_tas_with_a_divergence_ceiling_is_refused():
    """tas ignores delta, so no ceiling could be kept: refused naming the field, not
    silently ignored (the other rules take one)."""
    limits = replace(LIMITS, allowed_rules=(*LIMITS.allowed_rules, "tas"))
    validate_request(_sp(rule="tas", delta=0.0), limits)
    with pytest.raises(InvalidRequestError, match="rule 'tas' has no divergence") as err:
        validate_request(_sp(rule="tas", delta=0.0, max_divergence_nats=1.0), limits)
    assert err.value.field == "max_divergence_nats"
    for rule in ("none", "sps", "cactus", "cactus_exact"):
        validate_request(_sp(rule=rule, delta=0.0, max_divergence_nats=1.0), limits)


def test_good_requests_pass():
    validate_request(GOOD, LIMITS, prompt_len=5)
    validate_request(_s(temperature=0.0, top_k=-1, top_p=1.0, seed=2**64 - 1), LIMITS)
    validate_request(_sp(rule="none", delta=0.0, max_divergence_nats=0.0), LIMITS)
    validate_request(replace(GOOD, prompt=None, prompt_token_ids=(0, 8191)), LIMITS)
    # OpenAI's bounds: 300 tokens, biases in [-100, 100], ids in the vocabulary
    most = (*((i, 100.0 - 0.5 * i) for i in range(299)), (8191, -100))
    validate_request(_s(logit_bias=most), LIMITS)


def test_the_readmes_invalid_argument_example_is_the_real_message():
    """README (Errors and limits on the wire) quotes one INVALID_ARGUMENT detail; it
    must be what validation says for that value."""
    import re
    from pathlib import Path

    from cactus.errors import InvalidRequestError
    from cactus.params import GenerationRequest, Limits, SamplingParams, validate_request

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Errors and limits on the wire") :]
    quoted = re.search(r"\(`(temperature: [^`]+)`\)", section).group(1)
    request = GenerationRequest(prompt_token_ids=(1, 2), sampling=SamplingParams(temperature=3.5))
    with pytest.raises(InvalidRequestError) as err:
        validate_request(request, Limits(vocab_size=100, max_context=100), prompt_len=2)
    assert str(err.value) == quoted


def test_numpy_token_ids_are_taken_as_the_ints_they_hold():
    """The Python API takes a numpy array or numpy ints as prompt_token_ids (the engine
    converts each with int()); a numpy float is still refused by name."""
    import numpy as np

    validate_request(replace(GOOD, prompt=None, prompt_token_ids=np.array([1, 2, 3])), LIMITS)
    validate_request(replace(GOOD, prompt=None, prompt_token_ids=(np.int64(5),)), LIMITS)
    with pytest.raises(InvalidRequestError) as err:
        validate_request(replace(GOOD, prompt=None, prompt_token_ids=(np.float32(5),)), LIMITS)
    assert err.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as err:
        validate_request(replace(GOOD, prompt=None, prompt_token_ids=np.array([1, 8192])), LIMITS)
    assert err.value.field == "prompt_token_ids"


@pytest.mark.parametrize(
    "field, request_",
    [
        ("max_tokens", _s(max_tokens=10**5000)),
        ("top_k", _s(top_k=10**5000)),
        ("seed", _s(seed=10**5000)),
        ("logprobs", _s(logprobs=10**5000)),
        ("stop_token_ids", _s(stop_token_ids=(10**5000,))),
        ("logit_bias", _s(logit_bias=((5, 10**5000),))),
        ("logit_bias", _s(logit_bias=((10**5000, 1.0),))),
        ("num_speculative_tokens", _sp(num_speculative_tokens=10**5000)),
        ("prompt_token_ids", replace(GOOD, prompt=None, prompt_token_ids=(10**5000,))),
    ],
)
def test_an_int_past_the_digits_python_prints_is_refused_by_name(field, request_):
    """Python 3.11 refuses to print an int of more than 4,300 digits (ValueError): a
    refusal that showed it would fail with that instead of naming the field."""
    with pytest.raises(InvalidRequestError) as err:
        validate_request(request_, LIMITS)
    assert err.value.field == field and len(str(err.value)) < 200, str(err.value)[:300]


def test_a_huge_refused_value_does_not_swell_the_message():
    with pytest.raises(InvalidRequestError) as err:
        validate_request(_s(temperature=10**400), LIMITS)
    assert str(err.value) == "temperature: must be a finite number, got an integer of 1329 bits"
