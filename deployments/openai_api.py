"""OpenAI-compatible HTTP routes, served by the same replica as the gRPC API.

    GET  /v1/models
    POST /v1/completions
    POST /v1/chat/completions     (the tokenizer's chat template; none: 400)

The request bodies follow OpenAI's API as vLLM serves it: `max_tokens`, `temperature`,
`top_p`, `seed`, `stop`, `n` (up to 64 choices, prompts x n, each a request of its
own, streamed or not), `logit_bias`, `stream` (server-sent events ending in
`data: [DONE]`), `stream_options.include_usage`, plus vLLM's `top_k` and this project's
extras (`rule`, `delta`, `num_speculative_tokens`, `max_divergence_nats`,
`time_limit_s`) and vLLM's `stop_token_ids`, which an OpenAI client passes as
`extra_body`. Responses add a `cactus` object with the seed used, the speculation
statistics and `divergence_nats`. Validation is the gRPC path's (one
validator: cactus.params.validate_request); errors are OpenAI-shaped,
`{"error": {"message", "type", "param", "code"}}`, with the matching HTTP status. The
same bearer token as gRPC (`Authorization: Bearer ...`). A client that goes away
cancels its request (freed within one engine step).

Built per replica by CactusIngress.__serve_build_asgi_app__ (Ray Serve's late-bound
FastAPI ingress), so the routes share the replica's engine, tokenizer and limits.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import re
import secrets
import time
import weakref
from collections.abc import AsyncIterator
from http import HTTPStatus

import grpc
import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cactus.errors import (
    InvalidRequestError,
    RequestAttemptsExhaustedError,
    ServerShuttingDownError,
    is_unavailable,
    unwrap,
)
from cactus.params import (
    MAX_LOGPROBS,
    GenerationRequest,
    SamplingParams,
    SpeculationParams,
    default_max_tokens,
)
from deployments.metrics import failure_reason

logger = logging.getLogger(__name__)

FINISH = {
    "LENGTH": "length",
    "TIME_LIMIT": "length",
    "EOS": "stop",
    "STOP": "stop",
    "STOP_SEQUENCE": "stop",
    "ABORT": "abort",
}
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.UNAUTHENTICATED: HTTPStatus.UNAUTHORIZED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.TOO_MANY_REQUESTS,
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
}
_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
    500: "server_error",
}
# Fields a body may carry. Others get a 400 naming them (a typo must not pass silently),
# unless their value is null: some OpenAI clients send every field they know, unset ones
# as null.
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "user",
    "rule",
    "delta",
    "num_speculative_tokens",
    "max_divergence_nats",
    "time_limit_s",  # this project's: ends the request with finish_reason "length"
    "stop_token_ids",  # vLLM's
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
}
# OpenAI fields for what this server does not do (tools, structured output, stored
# completions), accepted with the value that means the same as leaving them out (vLLM
# accepts them; clients and frameworks send them by default): any other value is a 400.
_OFF_VALUES = {
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v in ("none", "auto"),
    "parallel_tool_calls": lambda v: isinstance(v, bool),
    "response_format": lambda v: v == {"type": "text"},
    "store": lambda v: v is False,
    "metadata": lambda v: isinstance(v, dict),
}
_OFF_MEANING = {
    "tools": "[] (this server runs no tools)",
    "tool_choice": '"none" or "auto" (this server runs no tools)',
    "parallel_tool_calls": "a boolean (this server runs no tools)",
    "response_format": '{"type": "text"} (structured output is not supported)',
    "store": "false (completions are not stored)",
    "metadata": "an object (kept nowhere: completions are not stored)",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix", "logprobs"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}


# Retry-After (seconds) on the app's own 429 and 503 answers: a restart takes seconds,
# and a client's retries back off further on their own (openai-python honours it)
RETRY_AFTER = "1"


class Counted:
    """One request counted as running (metrics.running) from now until `release()`,
    which ends the count once however often it is called; `running()` is the context
    manager `sse_events` holds while it streams, releasing on its way out."""

    def __init__(self, metrics) -> None:
        self._slot = metrics.running()
        self._slot.__enter__()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slot.__exit__(None, None, None)

    @contextlib.contextmanager
    def running(self):
        try:
            yield
        finally:
            self.release()


class OpenAIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code=None, retry=True
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = int(status), message, param, code
        self.retry = retry  # False: `x-should-retry: false`, which OpenAI's clients honour

    def __reduce__(self):  # picklable like every error that may cross a Ray boundary
        return (type(self), (self.status, self.message, self.param, self.code, self.retry))

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPE.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def as_openai_error(err: BaseException, request_id: str = "", sent=None) -> OpenAIError:
    """Any failure -> OpenAIError, the way the gRPC path maps it to a status. sent: what
    renames a field to the one the client sent (as_sent for its body), for the
    engine's errors as for the validator's."""
    err = unwrap(err)
    if isinstance(err, OpenAIError):
        return err
    if isinstance(err, InvalidRequestError):
        if sent is not None:
            err = sent(err)
        return OpenAIError(400, str(err), param=err.field, code=err.code)
    code = getattr(err, "code", None)
    if isinstance(code, grpc.StatusCode):  # the shim's RequestError
        status = _STATUS.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
        return OpenAIError(status, getattr(err, "details", str(err)))
    if isinstance(err, ServerShuttingDownError):
        return OpenAIError(503, str(err))
    if isinstance(err, RequestAttemptsExhaustedError):  # a 500 not to be retried
        return OpenAIError(500, str(err), retry=False)
    if is_unavailable(err):
        return OpenAIError(503, "engine unavailable; retry later")
    return OpenAIError(500, f"internal error (request {request_id})")


# ---- request bodies -> GenerationRequest ------------------------------------------------


def _number(body: dict, name: str, default, *, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(name, f"must be a number, got {value!r}")
    if integer and not (isinstance(value, int) or float(value).is_integer()):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if integer:
        return int(value)
    try:
        return float(value)
    except OverflowError:  # a JSON integer beyond any float
        raise InvalidRequestError(name, "must be a finite number") from None


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"<token id>": bias}, keys token ids as JSON strings (an
    integer key is taken too); the ranges are the shared validator's."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias", "must be an object of token id: bias")
    pairs = []
    for key, value in bias.items():
        text = str(key).strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 20):
            raise InvalidRequestError("logit_bias", f"keys must be token ids, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequestError("logit_bias", f"biases must be numbers, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # a JSON integer beyond any float
            raise InvalidRequestError("logit_bias", "biases must lie in [-100, 100]") from None
        pairs.append((int(text), number))
    return tuple(sorted(pairs))  # "7" and "07" both: the shared validator refuses the twice


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise InvalidRequestError("stop", "must be a string or a list of strings")


def _token_ids(body: dict, name: str) -> tuple[int, ...]:
    ids = body.get(name)
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise InvalidRequestError(name, "must be a list of token ids")
    return tuple(ids)


def _check_fields(body: dict, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    for name, value in body.items():
        # null is "unset" whatever the name (clients send `"tools": null` and the like)
        if name not in allowed and value is not None:
            if name in _OFF_VALUES:
                if _OFF_VALUES[name](value):
                    continue
                raise InvalidRequestError(name, f"only {_OFF_MEANING[name]} is supported")
            raise InvalidRequestError(name, "unknown field")
    n = _number(body, "n", 1, integer=True)
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequestError("n", f"must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    best_of = body.get("best_of")
    if best_of is not None and (type(best_of) is not int or best_of != 1):  # not true, 1.0
        raise InvalidRequestError("best_of", "only best_of = 1 is supported")
    if body.get("echo"):
        raise InvalidRequestError("echo", "echo is not supported")
    if body.get("suffix"):
        raise InvalidRequestError("suffix", "suffix is not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or value not in (0, 0.0)):
            raise InvalidRequestError(name, "penalties are not supported (use 0)")
    if not _bool_or_null(body.get("stream")):  # "false" or 1 must not start a stream
        raise InvalidRequestError("stream", f"must be true or false, got {body['stream']!r}")
    _check_stream_options(body)


STREAM_OPTIONS = {"include_usage"}


def _bool_or_null(value) -> bool:
    """A JSON true/false field: only a real boolean (or null, unset). `in (True, False)`
    would take 1 and 0.0, which equal them in Python."""
    return value is None or isinstance(value, bool)


def _check_stream_options(body: dict) -> None:
    """stream_options: an object of known keys (null ones unset, as at the top level),
    `include_usage` true or false, and only beside `stream: true` (as vLLM has it)."""
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise InvalidRequestError("stream_options", "must be an object")
    if any(v is not None for v in options.values()) and not body.get("stream"):
        raise InvalidRequestError("stream_options", "only allowed with stream: true")
    for name, value in options.items():
        if name not in STREAM_OPTIONS and value is not None:
            raise InvalidRequestError(f"stream_options.{name}", "unknown field")
    if not _bool_or_null(options.get("include_usage")):
        raise InvalidRequestError(
            "stream_options.include_usage",
            f"must be true or false, got {options['include_usage']!r}",
        )


def as_sent(err: InvalidRequestError, body: dict, chat: bool) -> InvalidRequestError:
    """The shared validator names the engine's fields (max_tokens, prompt,
    prompt_token_ids); a 400 names the field the client sent."""
    field = err.field
    if chat and field == "max_tokens" and body.get("max_completion_tokens") is not None:
        field = "max_completion_tokens"
    elif chat and field in ("prompt", "prompt_token_ids"):
        field = "messages"
    elif not chat and field == "prompt_token_ids":
        field = "prompt"
    return err if field == err.field else InvalidRequestError(field, err.reason, err.code)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Completions: `logprobs` = how many alternatives (null: off). Chat: `logprobs`
    true/false and `top_logprobs` = how many."""
    if not chat:
        return _number(body, "logprobs", None, integer=True)
    wanted = body.get("logprobs")
    if not _bool_or_null(wanted):
        raise InvalidRequestError("logprobs", "must be true or false")
    top = _number(body, "top_logprobs", None, integer=True)
    if top is not None and not wanted:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:  # named as the client sent it
        raise InvalidRequestError(
            "top_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {top!r}"
        )
    return (top or 0) if wanted else None


def _byte_level_chars() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's, used by the ByteLevel pre-tokenizer of
    Qwen, Llama 3 and the embedded pair): printable bytes stand for themselves, the
    other 68 for characters from U+0100 up, in byte order. Inverted: char -> byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in chars.values()]
    chars.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return chars


_BYTE_LEVEL = _byte_level_chars()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte tokens


METASPACE = "\u2581"  # SentencePiece's word-start marker, a space when decoded


def _decodes_metaspace(decoder) -> bool:
    """Whether the tokenizer's decoder turns the marker into a space (a Metaspace
    decoder, or Llama 2's Replace("\u2581", " ") in a Sequence): read from the
    decoder's own JSON state (the whole tokenizer's would hold its vocabulary)."""
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return False
    return METASPACE in json.dumps(state, ensure_ascii=False)


class TokenText:
    """A token's own bytes, and its text for logprobs. Decoding one token alone gives
    U+FFFD for a token that holds part of a UTF-8 character (byte-level BPE splits
    accented letters, CJK and emoji), so logprobs' `bytes` could not rebuild the
    character, as OpenAI's field is for; the bytes come from the token's vocabulary
    entry instead (byte-level and byte-fallback tokenizers), else from its decoding.
    Such a token's text is OpenAI's "bytes:\\xNN" form. A SentencePiece-style piece
    ("\u2581world": Llama 2, Mistral, Gemma) is its text with the marker as a space:
    decoding it alone strips that space, so the tokens would no longer join into the
    text, nor completions' text_offset follow it (OpenAI and vLLM give " world")."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.metaspace = decoder is not None and _decodes_metaspace(decoder)
        # special and added tokens are plain text in the vocabulary, not byte strings
        added = getattr(tokenizer, "get_added_vocab", dict)() or {}
        self.special = set(getattr(tokenizer, "all_special_ids", ()) or ()) | set(added.values())
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        got = self._bytes.get(token_id)
        if got is None:
            got = self._bytes[token_id] = self._raw(token_id)
        return got

    def _raw(self, token_id: int) -> bytes:
        if token_id not in self.special:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if self.byte_level and piece and all(c in _BYTE_LEVEL for c in piece):
                    return bytes(_BYTE_LEVEL[c] for c in piece)
                if match := _BYTE_FALLBACK.fullmatch(piece):
                    return bytes([int(match.group(1), 16)])
                if self.metaspace and METASPACE in piece:
                    return piece.replace(METASPACE, " ").encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


_TOKEN_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_text(tokenizer) -> TokenText:
    """One TokenText (and its cache) per tokenizer."""
    found = _TOKEN_TEXTS.get(tokenizer)
    if found is None:
        found = _TOKEN_TEXTS[tokenizer] = TokenText(tokenizer)
    return found


def _by_text(top, decode) -> dict[str, float]:
    """Completions' top_logprobs, {token text: logprob}: where two tokens decode alike,
    the likelier one (listed first) keeps the key."""
    out: dict[str, float] = {}
    for token_id, value in top:
        out.setdefault(decode(token_id), value)
    return out


def to_request(
    body: dict, config, *, max_tokens_field: str = "max_tokens", chat: bool = False
) -> GenerationRequest:
    """Sampling and speculation from an OpenAI body, unset fields from the config (the
    prompt is set by the caller)."""
    s, sp = config.sampling, config.speculation
    max_tokens = _number(body, max_tokens_field, None, integer=True)
    if max_tokens is None:
        default = default_max_tokens(s.default_max_tokens)
        max_tokens = _number(body, "max_tokens", default, integer=True)
    seed = _number(body, "seed", None, integer=True)
    if seed is not None and -(2**63) <= seed < 0:  # vLLM takes signed 64-bit seeds: the
        seed += 2**64  # same 64 bits, unsigned (the engine's seeds are in [0, 2^64))
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", s.default_temperature),
        top_p=_number(body, "top_p", 1.0),
        top_k=_number(body, "top_k", 0, integer=True),
        seed=seed,
        stop=_stop(body),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        logprobs=_logprobs(body, chat),
        logit_bias=_logit_bias(body),
    )
    rule = body.get("rule")
    if rule is None or rule == "":  # absent or null: unset, like every other field; and
        rule = sp.default_rule  # "" as on gRPC, where proto3 cannot tell it from unset
    if not isinstance(rule, str):
        raise InvalidRequestError("rule", "must be a string")
    divergence = body.get("max_divergence_nats")
    speculation = SpeculationParams(
        rule=rule,
        delta=_number(body, "delta", sp.default_delta),
        num_speculative_tokens=_number(
            body, "num_speculative_tokens", sp.default_num_speculative_tokens, integer=True
        ),
        max_divergence_nats=None
        if divergence is None
        else _number(body, "max_divergence_nats", None),
        tas_threshold=sp.tas_threshold,  # the operator's, for every request
        tas_alpha=sp.tas_alpha,
    )
    return GenerationRequest(
        sampling=sampling,
        speculation=speculation,
        # OpenAI's (and vLLM's) id prefixes: the response's `id` is this request's
        request_id=f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
        # 0 is none, as over gRPC (the proto's "0 = none")
        time_limit_s=config.limits.time_limit(_number(body, "time_limit_s", None) or None),
    )


def _message_text(m, i: int) -> str:
    """A message's content as text: a string; a list of text parts (OpenAI's content
    parts, as LangChain sends them), joined with newlines as vLLM does; null for an
    assistant message (OpenAI allows it beside tool calls)."""
    if not isinstance(m, dict):
        raise InvalidRequestError(f"messages[{i}]", "must be an object with role and content")
    content = m.get("content")
    if isinstance(content, str):
        return content
    if content is None and m.get("role") == "assistant":
        return ""
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequestError(
                    f"messages[{i}].content[{j}]",
                    f"only text parts are supported (this model reads text), got {kind!r}",
                )
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"messages[{i}].content[{j}].text", "must be a string")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequestError(
        f"messages[{i}].content", "must be a string or a non-empty list of text parts"
    )


# Messages in one chat request, as OpenAI's API allows: the content limit alone let a 4 MiB
# body carry about 140,000 empty messages, rendered and tokenised on the replica's loop
MAX_CHAT_MESSAGES = 2048


def chat_prompt_ids(body: dict, tokenizer, max_chars: int | None = None) -> list[int]:
    """The chat template's token ids for `messages`. max_chars (limits.max_prompt_chars,
    which bounds a completions prompt) bounds their content, all messages together,
    before the template renders them or the tokenizer sees them."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list")
    if len(messages) > MAX_CHAT_MESSAGES:  # bounds the template's work on the event loop
        raise InvalidRequestError(
            "messages", f"at most {MAX_CHAT_MESSAGES} messages, got {len(messages)}"
        )
    plain = []
    total = 0
    for i, m in enumerate(messages):
        text = _message_text(m, i)
        if m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            raise InvalidRequestError(f"messages[{i}].role", f"unknown role {m.get('role')!r}")
        total += len(text)
        if max_chars is not None and len(text) > max_chars:
            raise InvalidRequestError(
                f"messages[{i}].content", f"longer than {max_chars} characters"
            )
        if max_chars is not None and total > max_chars:
            raise InvalidRequestError(
                "messages", f"their contents total more than {max_chars} characters"
            )
        for key, value in m.items():
            if key in ("role", "content") or value is None:
                continue
            if key == "tool_calls" and value != []:
                raise InvalidRequestError(
                    f"messages[{i}].tool_calls", "tool calls are not supported (no tools run here)"
                )
            if key in ("name", "tool_call_id") and not isinstance(value, str):
                raise InvalidRequestError(f"messages[{i}].{key}", "must be a string")
            if key == "function_call":  # the deprecated form of a tool call
                raise InvalidRequestError(
                    f"messages[{i}].function_call", "function calls are not supported"
                )
            # other keys (annotations, vLLM's reasoning_content, ...) are left out of
            # the template, as before: clients replay other servers' replies
        # name and tool_call_id reach the template (those that use them render them)
        plain.append(
            {"role": m["role"], "content": text}
            | {k: m[k] for k in ("name", "tool_call_id") if m.get(k) is not None}
        )
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "messages",
            "this model's tokenizer has no chat template; use /v1/completions with a prompt",
        )
    try:
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
    except jinja2.TemplateError as err:  # the template's raise_exception, or its own bug
        raise InvalidRequestError(
            "messages", f"the model's chat template refused them: {err}"
        ) from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


# Choices in one response, prompts x n: each is a request of its own (vLLM bounds neither;
# Serve admits the call as one request, so the replica's bound applies too: `batch`)
MAX_CHOICES = 64
MAX_PROMPTS = MAX_CHOICES  # prompts in one completions request


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def completion_prompts(body: dict) -> list[dict]:
    """prompt: a string, a list of token ids, or a list of either (a batch of prompts,
    as OpenAI's API and vLLM take it: LangChain sends up to 20 at once)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        batch = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str) or _is_ids(p) for p in prompt)
    ):
        batch = prompt
    else:
        raise InvalidRequestError(
            "prompt", "must be a string, a list of token ids, or a non-empty list of those"
        )
    if len(batch) > MAX_PROMPTS:
        raise InvalidRequestError("prompt", f"at most {MAX_PROMPTS} prompts, got {len(batch)}")
    return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": tuple(p)} for p in batch]


# ---- responses --------------------------------------------------------------------------


def cactus_stats(request: GenerationRequest, result) -> dict:
    """The `cactus` extension of a response: the seed used (so a sampled request can be
    repeated) and the speculation statistics, as the gRPC API gives them."""
    stats = result.stats
    return {
        "rule": request.speculation.rule,
        "delta": request.speculation.delta,
        "seed": result.seed,
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "accepted_per_position": list(stats.accepted_per_position),
        "mean_acceptance_length": stats.mean_acceptance_length,
        "acceptance_rate": stats.acceptance_rate,
        "divergence_nats": stats.divergence_nats,
        "draft_failures": stats.draft_failures,
        "resumed": stats.resumed,
        "degraded": stats.degraded,
    }


def usage(result) -> dict:
    completion = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
    }


def nth_seed(sampling: SamplingParams, j: int) -> SamplingParams:
    """The sampling of a prompt's j-th choice (n > 1): seed + j, modulo 2^64; unseeded
    choices each get a seed of their own from the engine."""
    if j == 0 or sampling.seed is None:
        return sampling
    from dataclasses import replace

    return replace(sampling, seed=(sampling.seed + j) % 2**64)


def usage_total(results, n: int = 1) -> dict:
    """Several choices' usage (results in choice order, n a prompt): completion tokens
    summed over the choices, each prompt's tokens counted once, as OpenAI and vLLM
    count them."""
    prompt = sum(result.prompt_tokens for result in results[::n])
    completion = sum(len(result.token_ids) for result in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _sse(payload) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {text}\n\n"


class Shape:
    """What differs between /v1/completions and /v1/chat/completions."""

    def __init__(self, chat: bool, model: str, request_id: str, tokenizer=None) -> None:
        self.chat, self.model, self.id = chat, model, request_id
        self.tokenizer = tokenizer
        # completions' text_offset runs over a choice's whole completion, per choice
        # index: characters so far, and the UTF-8 decoder holding a split character
        self.text_offsets: dict[int, int] = {}
        self._decoders: dict[int, codecs.IncrementalDecoder] = {}
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def logprobs(self, entries, index: int = 0) -> dict | None:
        """OpenAI's shapes: chat {"content": [{token, logprob, bytes, top_logprobs}]},
        completions {"tokens", "token_logprobs", "top_logprobs", "text_offset"}."""
        if entries is None:
            return None
        words = token_text(self.tokenizer)
        if self.chat:
            return {
                "content": [
                    {
                        "token": words.text(e.token_id),
                        "logprob": e.logprob,
                        "bytes": list(words.bytes(e.token_id)),
                        "top_logprobs": [
                            {"token": words.text(t), "logprob": v, "bytes": list(words.bytes(t))}
                            for t, v in e.top
                        ],
                    }
                    for e in entries
                ]
            }
        # a token's offset: the characters of the completion's text before it (a token
        # that ends a split character moves it on by that character, as the text does)
        decoder = self._decoders.setdefault(
            index, codecs.getincrementaldecoder("utf-8")(errors="replace")
        )
        offsets, at = [], self.text_offsets.get(index, 0)
        for e in entries:
            offsets.append(at)
            at += len(decoder.decode(words.bytes(e.token_id)))
        self.text_offsets[index] = at
        return {
            "tokens": [words.text(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            # the sampled token too, as OpenAI's legacy completions and vLLM give it (up to
            # logprobs + 1 entries; `logprobs: 0` gives it alone, not {})
            "top_logprobs": [
                _by_text((*e.top, (e.token_id, e.logprob)), words.text) for e in entries
            ],
            "text_offset": offsets,
        }

    def choice(self, result, index: int = 0) -> dict:
        finish = FINISH.get(result.finish_reason, "stop")
        self.text_offsets[index] = 0
        self._decoders.pop(index, None)
        logprobs = self.logprobs(result.logprobs, index)
        if self.chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": finish,
                "logprobs": logprobs,
            }
        return {"index": index, "text": result.text, "finish_reason": finish, "logprobs": logprobs}

    def whole(self, request, result) -> dict:
        out = self._envelope(self.object, [self.choice(result)])
        out["usage"] = usage(result)
        out["cactus"] = cactus_stats(request, result)
        out["system_fingerprint"] = None
        return out

    def batch(self, requests, results, n: int = 1) -> dict:
        """Several choices (prompts x n): a choice each, in order, each with its own
        `cactus` object; usage as usage_total counts it."""
        choices = []
        for i, (request, result) in enumerate(zip(requests, results, strict=True)):
            choices.append({**self.choice(result, i), "cactus": cactus_stats(request, result)})
        out = self._envelope(self.object, choices)
        out["usage"] = usage_total(results, n)
        out["system_fingerprint"] = None
        return out

    def delta(
        self, text: str, finish: str | None, *, first: bool = False, logprobs=None, index: int = 0
    ) -> dict:
        """One choice's chunk (`index`: its place among the response's choices)."""
        logprobs = self.logprobs(logprobs, index)
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, request, result) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = self._envelope(obj, [])
        out["usage"] = usage(result)
        out["cactus"] = cactus_stats(request, result)
        return out

    def usage_total_chunk(self, results, n: int = 1) -> dict:
        """The usage chunk of a stream of several choices: usage summed (each choice's
        `cactus` object came with its finishing chunk)."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = self._envelope(obj, [])
        out["usage"] = usage_total(results, n)
        return out


async def sse_events(
    shape: Shape,
    request,
    first,
    rest: AsyncIterator,
    *,
    include_usage: bool,
    on_done,
    cancel,
    on_token=lambda: None,
    running=contextlib.nullcontext,
    on_end=lambda reason: None,
    sent=None,
    index: int = 0,
    last: bool = True,
    on_error=lambda: None,
    on_start=lambda: None,
) -> AsyncIterator[str]:
    """Server-sent events from the engine's chunks; `first` was already awaited (so a
    failure before the first token became an HTTP status, not an event). A stream that
    ends before the engine's final result (its client went away, the engine failed, or
    a bug of ours) cancels the request, and `rest` is closed. As a gRPC stream does
    (deployments/metrics.py), the stream counts as `running` while it lasts, and
    `on_token` is called for every later chunk with tokens (inter-token latency);
    `on_end("ERROR" | "CANCELLED")` for a stream that ends without its result. With
    `include_usage`, every chunk before the usage chunk has `"usage": null` (OpenAI's
    shape). sent: as for as_openai_error, the error event's field as the client sent it.
    index: the choice's index. last=False: one choice of several (merged_events), whose
    response is not over when this choice is: no usage chunk and no `[DONE]`, and
    `on_error()` is called before a failure's error event. on_start(): called as the
    events begin (a response whose client left before it began must clean up itself:
    ClosingStreamingResponse)."""
    on_start()
    finished = False  # the engine's final result came: nothing left to cancel
    counted = False  # on_done or on_end was called

    def event(text: str, finish: str | None, first: bool, logprobs) -> dict:
        out = shape.delta(text, finish, first=first, logprobs=logprobs, index=index)
        if include_usage:
            out["usage"] = None
        return out

    try:
        with running():
            chunk, is_first = first, True
            while chunk is not None:
                if not is_first and chunk.token_ids:
                    on_token()
                if chunk.result is not None:
                    finished = True
                    finish = FINISH.get(chunk.result.finish_reason, "stop")
                    final = event(chunk.text, finish, is_first, chunk.logprobs)
                    final["cactus"] = cactus_stats(request, chunk.result)
                    # counted before it goes out, as the gRPC stream does: the request
                    # finished in the engine even if its client leaves during this write
                    counted = True
                    on_done(chunk.result)
                    yield _sse(final)
                    if include_usage and last:
                        yield _sse(shape.usage_chunk(request, chunk.result))
                    break
                if chunk.text or is_first or chunk.logprobs:
                    yield _sse(event(chunk.text, None, is_first, chunk.logprobs))
                    is_first = False
                chunk = await anext(rest, None)
        if last:
            yield _sse("[DONE]")
    except Exception as err:  # headers are out: the failure goes in the stream
        if not counted:
            counted = True
            reason = failure_reason(err)  # a drain's cut: CANCELLED
            if reason is not None:
                on_end(reason)
        on_error()
        error = as_openai_error(err, request.request_id, sent)
        if error.status >= 500 and error.status != 503:  # as `fail` logs one before headers
            logger.error("request %s failed mid-stream", request.request_id, exc_info=unwrap(err))
        yield _sse(stream_error(error))
        if last:
            yield _sse("[DONE]")
    finally:
        if not finished:
            cancel(request.request_id)
        if not counted:
            on_end("CANCELLED")
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):  # the response is over either way
                await aclose()


async def merged_events(choices: list, tail) -> AsyncIterator[str]:
    """Several choices' events in one stream, as they come; each choice's own events stay
    in order. A choice's events are (event, ends) pairs: `ends` marks a failed choice's
    error event, after which the response ends. `tail()`: the events after every choice
    ended (the usage chunk). However the stream ends, the choices still running are
    cancelled here (their own `finally` cancels and counts their requests); what never
    began is the response's `on_close` to end (ClosingStreamingResponse)."""
    import asyncio

    import anyio

    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, events) -> None:
        try:
            async for event, ends in events:
                queue.put_nowait((event, ends))
        except Exception as err:  # a bug of ours in a choice's events, not the engine's
            queue.put_nowait((err, True))
        finally:
            queue.put_nowait((None, False))

    tasks = [asyncio.ensure_future(pump(i, events)) for i, events in enumerate(choices)]
    try:
        left = len(tasks)
        while left:
            event, ends = await queue.get()
            if isinstance(event, Exception):  # the stream still ends with an error event
                logger.error("a streamed choice failed in our own code", exc_info=event)
                event = _sse(stream_error(OpenAIError(500, "internal error")))
            if event is None:
                left -= 1
                continue
            yield event
            if ends:  # a choice's error event went out: the response ends here
                break
        else:
            for event in tail():
                yield event
        yield _sse("[DONE]")
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse whose clean-up always runs. Starlette never closes its body
    iterator: where the client leaves while the body waits at a `yield` (ASGI 2.4, whose
    send raises), or before the body began (it then has no `finally` of its own), the
    requests would run on until collected. Here the body is closed, then `on_close()`
    runs, shielded from a second cancellation, however the response ends."""

    def __init__(self, content, *, on_close, **kw) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        import anyio

        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):  # the response is over either way
                    await self.body_iterator.aclose()
                await self._on_close()


async def read_json(http: Request, limit: int):
    """The request's JSON body, refused with 413 above `limit` bytes: by its
    Content-Length when it has one, before reading it; else by the bytes read so far."""

    def too_large(size: str) -> OpenAIError:
        return OpenAIError(
            413,
            f"the request body is {size} bytes, over the limit of {limit} "
            "(limits.max_message_bytes)",
            param="body",
        )

    declared = http.headers.get("content-length")
    if declared is not None:
        if not (declared.strip().isascii() and declared.strip().isdigit()):
            raise InvalidRequestError("body", f"Content-Length {declared!r} is not a size")
        if int(declared) > limit:
            raise too_large(declared.strip())
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except RecursionError:  # nested too deep
        raise InvalidRequestError("body", "must be a JSON object (nested too deep)") from None
    except ValueError as err:
        if "integer string conversion" in str(err):  # Python's 4,300-digit limit
            raise InvalidRequestError("body", "holds an integer with too many digits") from None
        raise InvalidRequestError("body", "must be a JSON object") from None
    _check_unicode(body)
    return body


def _check_unicode(body) -> None:
    """JSON's \\uD800 escapes decode to lone surrogates, which no tokenizer takes and no
    UTF-8 response can carry back (a key with one broke the error reply itself): every
    string and key must be valid Unicode, else a 400 naming where."""
    stack = [("body", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                raise InvalidRequestError(path, "is not valid Unicode text (a lone surrogate)")
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _is_unicode(key):
                    raise InvalidRequestError(path, "has a key that is not valid Unicode text")
                stack.append((key if path == "body" else f"{path}.{key}", item))
        elif isinstance(value, list):
            stack.extend(
                (f"{path}[{i}]", item)
                for i, item in enumerate(value)
                if isinstance(item, (str, dict, list))  # not each token id of a prompt
            )


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def stream_error(error: OpenAIError) -> dict:
    """The error event of a stream whose 200 and headers are already sent: its `code`
    carries the status the response could no longer send (vLLM's ErrorResponse has the
    status in `code` too), unless the error has a code of its own."""
    body = error.body()
    if body["error"]["code"] is None:
        body["error"]["code"] = error.status
    return body


def build_routes(ingress, tokenize, logger):
    """The FastAPI app over a CactusIngress (its engine, tokenizer, limits, token)."""
    from dataclasses import replace

    app = FastAPI(title="cactus-serve", docs_url=None, redoc_url=None, openapi_url=None)

    def fail(err: BaseException, request_id: str, sent=None) -> JSONResponse:
        error = as_openai_error(err, request_id, sent)
        if error.status >= 500 and error.status != 503:
            logger.error("request %s failed", request_id, exc_info=unwrap(err))
        # a passing state (a restart, a full engine, a drain that another replica can
        # take over from): say when to retry, as Serve's own 429 does
        retry = error.status in (429, 503)
        headers = {"Retry-After": RETRY_AFTER} if retry else None
        if not error.retry:  # a request that failed the engine every time it ran
            headers = {"x-should-retry": "false"}
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        """Unknown routes and methods: OpenAI-shaped too (404, 405), not FastAPI's.
        With a token set, a request without it gets 401 first, so the server tells
        an unauthenticated caller nothing about which routes exist."""
        try:
            ingress.authorize(request.headers.get("authorization", ""))
        except Exception as auth:
            return fail(auth, "")
        message = f"{request.method} {request.url.path}: {err.detail}"
        return JSONResponse(
            OpenAIError(err.status_code, message).body(),
            status_code=err.status_code,
            headers=getattr(err, "headers", None),
        )

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": ingress.started,
            "owned_by": "cactus",
            "max_model_len": ingress.info["max_context"],
        }

    def unknown_model(model) -> OpenAIError:
        return OpenAIError(
            404,
            f"the model {model!r} does not exist here; GET /v1/models lists "
            f"{', '.join(map(repr, ingress.model_names))}",
            param="model",
            code="model_not_found",
        )

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            ingress.authorize(request.headers.get("authorization", ""))
        except Exception as err:
            return fail(err, "")
        return {"object": "list", "data": [model_card(name) for name in ingress.model_names]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        """What `client.models.retrieve(name)` calls."""
        try:
            ingress.authorize(request.headers.get("authorization", ""))
            if model not in ingress.model_names:
                raise unknown_model(model)
        except Exception as err:
            return fail(err, "")
        return model_card(model)

    def admit(reqs: list, field: str):
        """Count every choice's request as running now, before any await (so concurrent
        calls cannot all pass one check), or refuse them all. Serve admits the HTTP
        request as one, whatever its choices: they must not push the replica's running
        requests past what Serve would admit one by one (max_ongoing_requests +
        max_queued_requests), or a few calls would put thousands of requests in rank
        0's queue. Returns release(i), which ends choice i's count (once)."""
        lim = ingress.config.limits
        bound = lim.max_ongoing_requests + lim.max_queued_requests
        where = "limits.max_ongoing_requests + limits.max_queued_requests"
        what = "prompts" if field == "prompt" else "choices (prompts x n)"
        if len(reqs) > bound:  # never fits, however long the client waits
            raise InvalidRequestError(
                field, f"at most {bound} {what} on this server ({where}), got {len(reqs)}"
            )
        if ingress.metrics._running + len(reqs) > bound:
            raise OpenAIError(
                429,
                f"{len(reqs)} {what} would put this replica past {bound} requests "
                f"({ingress.metrics._running} running; {where}): retry, or send fewer at once",
            )
        counts = [Counted(ingress.metrics) for _ in reqs]  # each choice is a running request
        return lambda i: counts[i].release()

    async def batch(reqs: list, start: float, field: str) -> list:
        """Every choice's request at once (the engine batches them); one that fails
        fails the response and cancels the rest, as a client that goes away does."""
        import asyncio

        release = admit(reqs, field)

        async def one(i, req):
            try:
                result = await ingress.engine.agenerate(req)
            finally:
                release(i)
            ingress.metrics.finished(req, result, start, unary=True)
            return result

        tasks = [asyncio.ensure_future(one(i, req)) for i, req in enumerate(reqs)]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:  # a request failed, or the client went away
            for req, task in zip(reqs, tasks, strict=True):
                if task.done() and not task.cancelled():
                    if task.exception() is not None:
                        reason = failure_reason(task.exception())  # None: refused
                        if reason is not None:
                            ingress.metrics.ended(req, reason)
                    continue  # finished (counted) or failed
                task.cancel()
                ingress.engine.cancel(req.request_id)
                ingress.metrics.ended(req, "CANCELLED")
            raise
        finally:  # a task cancelled before it ran never reached its own release
            for i in range(len(reqs)):
                release(i)

    async def streams(reqs: list, n: int, start: float, field: str, shape, body, sent):
        """Several choices streamed in one response (a batch of prompts, or n > 1), each
        choice's chunks carrying its index, in the order they come. The response starts
        with the first choice that has its first chunk (a choice may wait for an engine
        row while others run); a failure that comes first is the HTTP status, as for one
        choice, and the rest are cancelled. After that, a choice that fails sends its
        error event and ends the response, cancelling the rest."""
        import asyncio

        release = admit(reqs, field)
        engine = ingress.engine
        ended = [False] * len(reqs)  # counted (finished, ended or refused) and released
        results: list = [None] * len(reqs)
        its = [engine.astream(req) for req in reqs]
        firsts = [asyncio.ensure_future(anext(it)) for it in its]
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))

        def end(i: int, reason: str | None) -> None:  # reason None: refused, not counted
            try:
                if not ended[i]:
                    ended[i] = True
                    if reason is not None:
                        ingress.metrics.ended(reqs[i], reason)
            finally:
                release(i)

        def finish(i: int, result) -> None:
            try:
                if not ended[i]:
                    ended[i] = True
                    results[i] = result
                    ingress.metrics.finished(reqs[i], result, start)
            finally:
                release(i)

        def settle(i: int) -> None:
            """Choice i as its first-chunk task left it, if that is done: failed
            (refused: not counted) or finished in its first chunk."""
            task = firsts[i]
            if ended[i] or not task.done() or task.cancelled():
                return
            if task.exception() is not None:
                end(i, failure_reason(task.exception()))
            elif task.result().result is not None:
                finish(i, task.result().result)

        async def close() -> None:
            """Cancel and count every choice that has not ended: first, with no await
            (each choice apart, so one that raises cannot leave the others running);
            then close the engine streams. Also when the body never began (the client
            left): ClosingStreamingResponse's on_close."""
            for task in firsts:
                task.cancel()
            for i, req in enumerate(reqs):
                try:
                    settle(i)
                    if not ended[i]:
                        engine.cancel(req.request_id)
                        end(i, "CANCELLED")
                except Exception:  # a bug of ours: the rest still end
                    logger.exception("closing choice %s of %s", i, req.request_id)
                    release(i)
            await asyncio.gather(*firsts, return_exceptions=True)
            for it in its:
                aclose = getattr(it, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):  # the response is over either way
                        await aclose()

        def failure(task):
            return None if task.cancelled() else task.exception()

        try:
            done, _ = await asyncio.wait(firsts, return_when=asyncio.FIRST_COMPLETED)
            failed_first = [failure(t) for t in done if failure(t) is not None]
            if failed_first:
                raise failed_first[0]
        except BaseException:  # a choice failed before any token was sent, or the client left
            await close()
            raise

        def choice(i: int):
            req = reqs[i]
            timed = [False]

            def on_token() -> None:
                ingress.metrics.token_latency(req, start, first=not timed[0])
                timed[0] = True

            async def events():
                failed = False

                def on_error() -> None:  # counted (or refused, so not counted) already
                    nonlocal failed
                    failed = True
                    end(i, None)

                try:
                    first = await firsts[i]
                except Exception as err:  # before its first token, after the response began
                    end(i, failure_reason(err))
                    yield _sse(stream_error(as_openai_error(err, req.request_id, sent))), True
                    return
                if first.token_ids:
                    on_token()

                @contextlib.contextmanager
                def running():  # counted since admit(); ends with the choice
                    try:
                        yield
                    finally:
                        release(i)

                chunks = sse_events(
                    shape,
                    req,
                    first,
                    its[i],
                    include_usage=include_usage,
                    on_done=lambda result: finish(i, result),
                    cancel=engine.cancel,
                    on_token=on_token,
                    running=running,
                    on_end=lambda reason: end(i, reason),
                    sent=sent,
                    index=i,
                    last=False,
                    on_error=on_error,
                )
                async with contextlib.aclosing(chunks):
                    async for event in chunks:
                        yield event, failed

            return events()

        def tail():
            if include_usage and all(r is not None for r in results):
                yield _sse(shape.usage_total_chunk(results, n))

        return merged_events([choice(i) for i in range(len(reqs))], tail), close

    async def generate(http: Request, chat: bool):
        import asyncio

        start = time.monotonic()
        req = base = sent = None
        try:
            ingress.authorize(http.headers.get("authorization", ""))
            body = await read_json(http, ingress.config.limits.max_message_bytes)
            _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)

            def sent(err: InvalidRequestError) -> InvalidRequestError:
                return as_sent(err, body, chat)

            model = body.get("model")
            if model is not None and not isinstance(model, str):
                raise InvalidRequestError("model", "must be a string")
            if model is not None and model not in ingress.model_names:
                raise unknown_model(model)
            field = "max_completion_tokens" if chat else "max_tokens"
            base = to_request(body, ingress.config, max_tokens_field=field, chat=chat)
            if chat:
                ids = chat_prompt_ids(body, ingress.tokenizer, ingress.limits.max_prompt_chars)
                prompts = [{"prompt_token_ids": tuple(ids)}]
            else:
                prompts = completion_prompts(body)
            try:
                unset = all(body.get(name) is None for name in (field, "max_tokens"))
                reqs = [
                    tokenize(
                        replace(base, **prompt),
                        ingress.tokenizer,
                        ingress.limits,
                        fit_max_tokens=unset,
                        row_tokens=ingress.config.batching.kv_budget_tokens,
                    )
                    for prompt in prompts
                ]
            except InvalidRequestError as err:
                raise sent(err) from None
            shape = Shape(chat, model or ingress.model_name, base.request_id, ingress.tokenizer)
            n = _number(body, "n", 1, integer=True)  # checked by _check_fields
            field = "n" if n > 1 else "prompt"
            if len(reqs) * n > MAX_CHOICES:
                raise InvalidRequestError(
                    field,
                    f"at most {MAX_CHOICES} choices (prompts x n), got "
                    f"{len(reqs)} x {n} = {len(reqs) * n}",
                )
            # choice i * n + j is prompt i's j-th sample (OpenAI's order), seeded
            # seed + j: each choice's `cactus.seed` repeats it alone
            reqs = [replace(r, sampling=nth_seed(r.sampling, j)) for r in reqs for j in range(n)]
            if len(reqs) > 1:
                reqs = [replace(r, request_id=f"{r.request_id}-{i}") for i, r in enumerate(reqs)]
                if body.get("stream"):
                    events, on_close = await streams(reqs, n, start, field, shape, body, sent)
                    return ClosingStreamingResponse(
                        events, on_close=on_close, media_type="text/event-stream"
                    )
                return JSONResponse(shape.batch(reqs, await batch(reqs, start, field), n))
            (req,) = reqs
            if not body.get("stream"):
                with ingress.metrics.running():
                    result = await ingress.engine.agenerate(req)
                ingress.metrics.finished(req, result, start, unary=True)
                return JSONResponse(shape.whole(req, result))
            # running from here, as over gRPC: a stream waiting for an engine row or a
            # restart is a running request (the gauge, and admit()'s bound, count it)
            count = Counted(ingress.metrics)
            release, running = count.release, count.running
            try:
                stream = ingress.engine.astream(req)
                first = await anext(stream)  # a failure before the first token: a status
            except BaseException:
                release()
                raise
            # the first chunk with a token is timed as the first token (a request whose
            # time ran out while it waited for a row sends its result alone: no token)
            timed = [bool(first.token_ids)]
            if timed[0]:
                ingress.metrics.token_latency(req, start, first=True)

            def on_token() -> None:
                ingress.metrics.token_latency(req, start, first=not timed[0])
                timed[0] = True

            options = body.get("stream_options") or {}
            began = [False]

            async def on_close() -> None:
                """The client left before the events began: they never will, so
                nothing of theirs cancels and counts the request; this does."""
                if began[0]:
                    return
                release()
                if first.result is not None:  # it finished in its first chunk
                    ingress.metrics.finished(req, first.result, start)
                else:
                    ingress.engine.cancel(req.request_id)
                    ingress.metrics.ended(req, "CANCELLED")
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()

            return ClosingStreamingResponse(
                sse_events(
                    shape,
                    req,
                    first,
                    stream,
                    include_usage=bool(options.get("include_usage")),
                    on_done=lambda result: ingress.metrics.finished(req, result, start),
                    cancel=ingress.engine.cancel,
                    on_token=on_token,
                    running=running,
                    on_end=lambda reason: ingress.metrics.ended(req, reason),
                    sent=sent,
                    on_start=lambda: began.__setitem__(0, True),
                ),
                on_close=on_close,
                media_type="text/event-stream",
            )
        except asyncio.CancelledError:  # the client went away
            if req is not None:
                ingress.engine.cancel(req.request_id)
                ingress.metrics.ended(req, "CANCELLED")
            raise
        except Exception as err:
            reason = failure_reason(err)  # None: refused before it ran, not counted
            if req is not None and reason is not None:
                ingress.metrics.ended(req, reason)
            request_id = req.request_id if req else base.request_id if base else ""
            return fail(err, request_id, sent)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app
