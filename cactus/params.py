"""Request parameters and their validation: one pure function, table-tested.

Field names and semantics follow vLLM / OpenAI (../shared/spec/serving.md). Everything
that can be wrong with a request is checked here, before any model work, and reported as
InvalidRequestError naming the field and the limit. Non-finite floats are rejected with
math.isfinite (NaN compares False against every bound).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from cactus.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequestError

RULES = ("none", "sps", "cactus", "cactus_exact", "tas")
MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# A client's own request_id (gRPC): every draft message and streamed chunk of the request
# carries it, so an unbounded one would swell every step's messages for the whole batch.
MAX_REQUEST_ID_CHARS = 256
# sampling.default_max_tokens: null stands for this (no context reaches it), which the
# ingress's fit for an unset max_tokens shrinks to all the prompt leaves
REST_OF_CONTEXT = 2**31 - 1


def default_max_tokens(configured: int | None) -> int:
    """max_tokens for a request that sets none, from `sampling.default_max_tokens` (null:
    the rest of the context, which the ingress's `tokenize(fit_max_tokens=True)` cuts to
    what the prompt leaves). Both APIs' request builders call it."""
    return REST_OF_CONTEXT if configured is None else configured


MAX_SEED = 2**64 - 1
# The widest draft block any drafter takes (K): the ceiling of the config's
# speculation.max_num_speculative_tokens, and the draft service's bound on the wire.
MAX_DRAFT_TOKENS = 64


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None  # None: the engine picks one and echoes it
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # None: off (no cost). n in 0..MAX_LOGPROBS: the log-probability of every emitted
    # token under the verifier's processed distribution q, with the n most likely
    # alternatives there (OpenAI / vLLM `logprobs`).
    logprobs: int | None = None
    # (token id, bias) pairs, ids ascending: added to those tokens' logits before the
    # processing above, on the verifier's and the draft's rows alike (OpenAI's logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()


MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # tokens, as OpenAI's API takes
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100], as OpenAI's API takes


@dataclass(frozen=True)
class SpeculationParams:
    rule: str = "cactus"  # none, sps, cactus, cactus_exact, tas
    delta: float = 1.0  # nats; 0 = lossless
    num_speculative_tokens: int = 4  # K
    max_divergence_nats: float | None = None  # per-request ceiling on the summed divergence
    tas_threshold: float = 0.09  # typical acceptance epsilon (posterior_threshold)
    # typical acceptance alpha; None = sqrt(tas_threshold), the paper's code (vLLM V0: 0.3)
    tas_alpha: float | None = None


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: SpeculationParams = field(default_factory=SpeculationParams)
    request_id: str = ""
    time_limit_s: float | None = None  # the request ends with TIME_LIMIT past this
    # Request migration (workers/supervisor.py), never set from the wire: the tokens
    # already generated and sent before an engine failure, and how many characters of
    # their text the caller got. The engine continues the request after them as if it
    # had never stopped (max_tokens, stop strings and the result count them).
    resume_token_ids: tuple[int, ...] = ()
    resume_text_chars: int = 0
    # ...and the speculation statistics so far (SpecStats.as_dict()): the divergence
    # budget and the counters go on from there rather than from zero.
    resume_stats: dict | None = None


@dataclass(frozen=True)
class Limits:
    """What the deployment allows; the validator checks requests against it."""

    max_context: int  # prompt + max_tokens <= max_context
    vocab_size: int
    max_num_speculative_tokens: int = 16
    delta_ceiling: float = 8.0
    allowed_rules: tuple[str, ...] = RULES
    max_prompt_chars: int = 1_000_000

    def overrides(self) -> dict:
        """The operator's part (everything but the model's context and vocabulary): what
        the ingress hands to the engine on rank 0, which adds the model's own."""
        return {
            "max_num_speculative_tokens": self.max_num_speculative_tokens,
            "delta_ceiling": self.delta_ceiling,
            "allowed_rules": tuple(self.allowed_rules),
            "max_prompt_chars": self.max_prompt_chars,
        }


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_in(name: str, value, low: float, high: float, *, low_open: bool = False) -> None:
    try:
        finite = _is_number(value) and math.isfinite(value)
    except OverflowError:  # an int no float holds (10**400): no number the engine can use
        finite = False
    if not finite:
        raise _invalid(name, f"must be a finite number, got {_short(value)}")
    if value < low or (low_open and value == low) or value > high:
        bracket = "(" if low_open else "["
        raise _invalid(name, f"must lie in {bracket}{low}, {high}], got {_short(value)}")


def _invalid(name: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(name, message)


def _check_unicode(name: str, text: str) -> None:
    """Text must be valid Unicode: a lone surrogate (what undecodable bytes in argv
    become, or JSON's \\ud800) reached the tokenizer, which raised TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _invalid(
            name,
            f"must be valid Unicode text (UTF-8): {text[err.start : err.end]!r} at "
            f"character {err.start}",
        ) from None


def _short(value) -> str:
    """repr of a refused value, cut so that a huge int or string cannot swell the error."""
    if isinstance(value, int) and abs(value) >= 10**30:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, tuple) and len(value) == 2:  # a (token id, bias) pair
        return f"({_short(value[0])}, {_short(value[1])})"
    try:
        text = repr(value)
    except ValueError:  # an int inside, past the 4,300 digits repr() may write
        return "a value too large to show"
    return text if len(text) <= 80 else text[:77] + "..."


def _sequence(name: str, value, what: str) -> None:
    """A field holding several items (a tuple or a list, as the Python API takes them): a
    bare string would be read item by item (stop="END" as three stop strings), and a
    bare number has no length."""
    try:
        sized = not isinstance(value, (str, bytes)) and len(value) >= 0
    except TypeError:  # no length: a number, or a 0-d numpy array
        sized = False
    if not sized:
        raise _invalid(name, f"must be a sequence of {what}, got {_short(value)}")


def too_long(name: str, message: str, context: int) -> InvalidRequestError:
    """A prompt or max_tokens the context cannot hold, in the words OpenAI's and vLLM's
    messages use ("This model's maximum context length is N tokens"), which clients
    match to trim a conversation, and with their error code."""
    return InvalidRequestError(
        name,
        f"{message}. This model's maximum context length is {context} tokens",
        CONTEXT_LENGTH_EXCEEDED,
    )


def validate_request(
    request: GenerationRequest, limits: Limits, *, prompt_len: int | None = None
) -> None:
    """Raise InvalidRequestError for the first bad field; return None if all are fine.

    prompt_len: the prompt's length in tokens, when the caller has tokenised it (the
    context-length checks need it; the rest do not).
    """
    _validate_prompt(request, limits)
    if request.time_limit_s is not None:
        _finite_in("time_limit_s", request.time_limit_s, 0.0, math.inf, low_open=True)
    _validate_sampling(request.sampling, limits, prompt_len)
    _validate_speculation(request.speculation, limits)
    _validate_resume(request, limits)


def _validate_resume(request: GenerationRequest, limits: Limits) -> None:
    ids = request.resume_token_ids
    _sequence("resume_token_ids", ids, "token ids")
    if len(ids) >= request.sampling.max_tokens:
        raise _invalid("resume_token_ids", "must be fewer than max_tokens")
    for tok in ids:
        if not _is_int(tok) or not 0 <= tok < limits.vocab_size:
            raise _invalid("resume_token_ids", f"ids must lie in [0, {limits.vocab_size})")
    if not _is_int(request.resume_text_chars) or request.resume_text_chars < 0:
        raise _invalid("resume_text_chars", "must be an integer >= 0")


def _validate_prompt(request: GenerationRequest, limits: Limits) -> None:
    if request.prompt_token_ids is not None:
        _sequence("prompt_token_ids", request.prompt_token_ids, "token ids")
    has_text = request.prompt is not None and request.prompt != ""
    has_ids = request.prompt_token_ids is not None and len(request.prompt_token_ids) > 0
    if has_text == has_ids:
        raise _invalid("prompt", "give exactly one non-empty prompt or prompt_token_ids")
    if has_text:
        if not isinstance(request.prompt, str):
            raise _invalid("prompt", "must be a string")
        _check_unicode("prompt", request.prompt)
        if len(request.prompt) > limits.max_prompt_chars:
            raise _invalid(
                "prompt",
                f"longer than {limits.max_prompt_chars} characters, got {len(request.prompt)}",
            )
        return
    ids = request.prompt_token_ids
    if len(ids) > limits.max_context - 1:  # at least one token must still fit
        raise too_long("prompt_token_ids", f"{len(ids)} tokens leave no room", limits.max_context)
    for i, tok in enumerate(ids):  # numpy's ints too: the engine takes int() of each
        if not _is_token(tok) or not 0 <= tok < limits.vocab_size:
            raise _invalid(
                "prompt_token_ids",
                f"ids must lie in [0, {limits.vocab_size}), got {_short(tok)} at index {i}",
            )


def _validate_sampling(s: SamplingParams, limits: Limits, prompt_len: int | None) -> None:
    if not _is_int(s.max_tokens) or s.max_tokens < 1:
        raise _invalid("max_tokens", f"must be an integer >= 1, got {_short(s.max_tokens)}")
    if prompt_len is not None:
        if prompt_len > limits.max_context - 1:
            raise too_long("prompt", f"{prompt_len} tokens leave no room", limits.max_context)
        if prompt_len + s.max_tokens > limits.max_context:
            raise too_long(
                "max_tokens",
                f"prompt ({prompt_len}) + max_tokens ({s.max_tokens}) = "
                f"{prompt_len + s.max_tokens} tokens",
                limits.max_context,
            )
    elif s.max_tokens > limits.max_context:
        raise too_long("max_tokens", f"got {_short(s.max_tokens)}", limits.max_context)
    _finite_in("temperature", s.temperature, 0.0, 2.0)
    _finite_in("top_p", s.top_p, 0.0, 1.0, low_open=True)
    if not _is_int(s.top_k) or s.top_k < -1 or s.top_k > limits.vocab_size:
        raise _invalid(
            "top_k", f"must be -1, 0 (off) or 1..{limits.vocab_size}, got {_short(s.top_k)}"
        )
    if s.seed is not None and (not _is_int(s.seed) or not 0 <= s.seed <= MAX_SEED):
        raise _invalid("seed", f"must be an integer in [0, 2^64 - 1], got {_short(s.seed)}")
    _sequence("stop", s.stop, "strings")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise _invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
    for text in s.stop:
        if not isinstance(text, str) or not text or len(text) > MAX_STOP_STRING_CHARS:
            got = f"{len(text)} characters" if isinstance(text, str) else repr(text)
            raise _invalid(
                "stop",
                f"stop strings must be non-empty, <= {MAX_STOP_STRING_CHARS} characters, got {got}",
            )
        _check_unicode("stop", text)
    if s.logprobs is not None and (not _is_int(s.logprobs) or not 0 <= s.logprobs <= MAX_LOGPROBS):
        raise _invalid(
            "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {_short(s.logprobs)}"
        )
    _validate_logit_bias(s.logit_bias, limits)
    _sequence("stop_token_ids", s.stop_token_ids, "token ids")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _invalid(
            "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(s.stop_token_ids)}"
        )
    for tok in s.stop_token_ids:
        if not _is_int(tok) or not 0 <= tok < limits.vocab_size:
            raise _invalid(
                "stop_token_ids", f"ids must lie in [0, {limits.vocab_size}), got {_short(tok)}"
            )


def _validate_logit_bias(bias, limits: Limits) -> None:
    if not isinstance(bias, tuple):
        raise _invalid("logit_bias", "must be a tuple of (token id, bias) pairs")
    if len(bias) > MAX_LOGIT_BIAS:
        raise _invalid("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
    seen = set()
    for pair in bias:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise _invalid("logit_bias", f"must hold (token id, bias) pairs, got {_short(pair)}")
        tok, value = pair
        if not _is_int(tok) or not 0 <= tok < limits.vocab_size:
            raise _invalid(
                "logit_bias", f"token ids must lie in [0, {limits.vocab_size}), got {_short(pair)}"
            )
        if tok in seen:
            raise _invalid("logit_bias", f"token {tok} is given twice, got {_short(pair)}")
        seen.add(tok)
        if (  # the comparison refuses NaN, and an int of any size without overflowing
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE
        ):
            raise _invalid(
                "logit_bias",
                f"biases must be numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                f"got {_short(pair)}",
            )


def _validate_speculation(sp: SpeculationParams, limits: Limits) -> None:
    if sp.rule not in RULES:
        raise _invalid(
            "rule", f"unknown rule {_short(sp.rule)}; expected one of {', '.join(RULES)}"
        )
    if sp.rule not in limits.allowed_rules:
        raise _invalid(
            "rule",
            f"{_short(sp.rule)} is not enabled here; allowed: {', '.join(limits.allowed_rules)}",
        )
    _finite_in("delta", sp.delta, 0.0, limits.delta_ceiling)
    k = sp.num_speculative_tokens
    if not _is_int(k) or not 1 <= k <= limits.max_num_speculative_tokens:
        raise _invalid(
            "num_speculative_tokens",
            f"must be an integer in [1, {limits.max_num_speculative_tokens}], got {_short(k)}",
        )
    if sp.max_divergence_nats is not None:
        _finite_in("max_divergence_nats", sp.max_divergence_nats, 0.0, math.inf)
        if sp.rule == "tas":  # tas has no delta to drop: a ceiling could not be kept
            raise _invalid(
                "max_divergence_nats",
                "rule 'tas' has no divergence budget (it ignores delta); use cactus or "
                f"cactus_exact for a ceiling, got {_short(sp.max_divergence_nats)}",
            )
    _finite_in("tas_threshold", sp.tas_threshold, 0.0, 1.0, low_open=True)
    if sp.tas_alpha is not None:
        _finite_in("tas_alpha", sp.tas_alpha, 0.0, math.inf)
