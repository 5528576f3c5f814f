"""Typed, validated service configuration: YAML in, frozen pydantic models out.

Every field has a description (`Field(description=...)`, the README's config table is
generated from them: `python -m configs.schema --readme`); unknown keys and bad values
are rejected with the key path (e.g. `speculation.delta_ceiling: must be >= 0`).
Types are strict (no "2" for 2, no true for 1.0, no NaN). Relative model paths are
resolved against the repository root, so the shipped YAML works from anywhere. Ray
Serve LLM's configs are pydantic models too.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict, ValidationError

from cactus.params import MAX_DRAFT_TOKENS

REPO = Path(__file__).resolve().parent.parent
GRPC_MAX_MESSAGE_BYTES = 2**31 - 1  # gRPC's message size options are C ints
RULES = ("none", "sps", "cactus", "cactus_exact", "tas")
POLICIES = ("fixed", "goodput")  # workers/policy.py
README = REPO / "README.md"
TABLE_BEGIN, TABLE_END = "<!-- config-table:begin -->", "<!-- config-table:end -->"

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]
Str = Annotated[str, Strict()]
Bool = Annotated[bool, Strict()]


class ConfigError(ValueError):
    """A config key is unknown or its value is invalid; the message starts with its path."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def doc(text: str, default=..., default_factory=None):
    """A described field (its description is the README's)."""
    if default_factory is not None:
        return Field(default_factory=default_factory, description=text)
    return Field(default, description=text)


class ModelsConfig(_Model):
    verifier: Str = doc("verifier checkpoint folder (Hugging Face layout)", "models/verifier")
    draft: Str = doc("draft checkpoint folder; must share the verifier's tokenizer", "models/draft")
    dtype: Str = doc(
        "float32, bfloat16 or float16 (float16 with tp_size > 1 needs models.device cuda)",
        "float32",
    )
    device: Str = doc("cpu or cuda", "cpu")
    served_model_name: list[Str] = doc(
        "the names the OpenAI API answers to (vLLM's --served-model-name; responses carry "
        "the one a request used, else the first); empty: the verifier folder's name",
        default_factory=list,
    )


class ActorResourcesConfig(_Model):
    num_cpus: Float = doc("CPUs reserved for the actor (fractions allowed)", 0.25)
    num_gpus: Float = doc("GPUs reserved for the actor", 0.0)
    resources: dict[Str, Float] = doc(
        "custom resources, e.g. {draft_node: 1}", default_factory=dict
    )


class ResourcesConfig(_Model):
    replica: ActorResourcesConfig = doc(
        "the Serve ingress replica", default_factory=ActorResourcesConfig
    )
    draft: ActorResourcesConfig = doc("the draft actor", default_factory=ActorResourcesConfig)
    verifier_rank: ActorResourcesConfig = doc(
        "each verifier TP rank", default_factory=ActorResourcesConfig
    )
    threads_per_actor: Int = doc("torch intra-op threads in each actor", 1)
    placement_strategy: Str = doc(
        "PACK, SPREAD, STRICT_PACK or STRICT_SPREAD for a replica's bundles", "PACK"
    )


class SpeculationConfig(_Model):
    default_rule: Str = doc("rule used when a request names none", "cactus")
    default_delta: Float = doc("delta (nats) used when a request sets none", 1.0)
    default_num_speculative_tokens: Int = doc("K used when a request sets none", 4)
    max_num_speculative_tokens: Int = doc("largest K a request may ask for (at most 64)", 8)
    delta_ceiling: Float = doc("largest delta a request may ask for (nats)", 4.0)
    allowed_rules: tuple[Str, ...] = doc("rules requests may use", RULES)
    tas_threshold: Float = doc(
        "rule tas: epsilon, the posterior threshold (vLLM V0's "
        "typical_acceptance_sampler_posterior_threshold)",
        0.09,
    )
    tas_alpha: Float | None = doc(
        "rule tas: alpha; null = sqrt(tas_threshold), the paper's code (vLLM V0's "
        "posterior_alpha default: 0.3)",
        None,
    )
    policy: Str = doc(
        "tokens each row drafts per step: `fixed` (the request's K) or `goodput` "
        "(0..K per row and step, for the most tokens/s; workers/policy.py)",
        "goodput",
    )


class SamplingConfig(_Model):
    default_temperature: Float = doc("temperature when a request sets none", 1.0)
    default_max_tokens: Int | None = doc(
        "max_tokens when a request sets none (shrunk to what the prompt leaves of the context "
        "and of kv_budget_tokens); null: all of that, as OpenAI's and vLLM's default (each "
        "such request then reserves KV for the whole rest: see the README's OpenAI section)",
        64,
    )


class AuthConfig(_Model):
    token: Str | None = doc(
        "bearer token every Cactus RPC and HTTP request must carry; null = no auth", None
    )
    token_env: Str = doc(
        "environment variable read for the token when `token` is null", "CACTUS_AUTH_TOKEN"
    )

    def resolved_token(self) -> str | None:
        if self.token is not None:
            return self.token  # checked with the config (check_token)
        value = os.environ.get(self.token_env) or None
        if value is not None:
            check_token(value, f"auth.token_env ({self.token_env})", "unset or empty")
        return value


def check_token(token: str, path: str, off: str = "null") -> None:
    """A bearer token a client can send and the server can match: clients send it as gRPC
    metadata or an HTTP header, which take printable ASCII only, and the server strips
    what a client sends (so surrounding spaces could never match); "" would turn auth
    off without a word (null is how a config says no auth)."""
    _check(
        bool(token) and token == token.strip() and all(" " <= ch <= "~" for ch in token),
        path,
        "must be a non-empty token of printable ASCII without surrounding spaces "
        f"(clients send it as gRPC metadata or an HTTP header); {off} = no auth",
    )


class LimitsConfig(_Model):
    max_ongoing_requests: Int = doc(
        "requests a replica works on at once (= batching.max_num_seqs by default: every "
        "one has a row of the engine's batch)",
        32,
    )
    max_queued_requests: Int = doc(
        "requests waiting per caller (each Serve proxy or handle, so per node with "
        "proxy_location EveryNode); beyond: RESOURCE_EXHAUSTED (HTTP: 429, Retry-After 1)",
        32,
    )
    max_prompt_chars: Int = doc(
        "longest text prompt accepted (chat: all messages' content together)", 100_000
    )
    max_health_watches: Int | None = doc(
        "open grpc.health.v1 Watch calls per replica (Watch needs no token and holds one of "
        "the max_ongoing_requests slots while open); beyond: RESOURCE_EXHAUSTED. Must be "
        "below max_ongoing_requests; null: 4, or max_ongoing_requests - 1 where lower",
        None,
    )
    max_message_bytes: Int = doc(
        "gRPC message limit, both ways, and HTTP body limit (above it: RESOURCE_EXHAUSTED, "
        "HTTP 413), sized to the longest prompt; a unary Generate reply above it (tens of "
        "thousands of tokens with logprobs 20) is RESOURCE_EXHAUSTED too: stream those",
        4 << 20,
    )
    request_timeout_s: Float = doc(
        "end-to-end limit on every request (0 = none): gRPC calls end with "
        "DEADLINE_EXCEEDED, HTTP requests with their tokens so far and finish_reason length",
        0.0,
    )
    start_timeout_s: Float = doc(
        "how long each step of an engine's start may take (its placement group granted, "
        "an actor loaded, the ranks joined); past it the start fails naming the step, "
        "and what had started is stopped",
        300.0,
    )

    @property
    def health_watches(self) -> int:
        """Open Watch calls a replica allows: always fewer than its request slots, so
        Watch calls (which need no token) never hold every slot."""
        if self.max_health_watches is not None:
            return self.max_health_watches
        return min(4, self.max_ongoing_requests - 1)

    def time_limit(self, requested: float | None) -> float | None:
        """A request's `time_limit_s` under `request_timeout_s` (0 = no ceiling).

        Over gRPC, Ray Serve's proxy ends the call at request_timeout_s
        (DEADLINE_EXCEEDED) and cancels the replica call; the engine's own limit,
        counted from a later instant, then stops the request even where the proxy loses
        that cancel (README, "Cancellation"). Over HTTP, Serve's proxy gets no timeout
        (its 408 is retried by OpenAI clients, its x-request-timeout-seconds header lets
        a client lift the limit, and it cuts an SSE stream without an event), so this
        limit ends the request as `time_limit_s` does: the tokens so far, finish_reason
        "length"."""
        ceiling = self.request_timeout_s
        if not ceiling:
            return requested
        if requested is None:
            return ceiling
        try:
            finite = math.isfinite(requested)
        except (TypeError, OverflowError):
            finite = False
        # only a usable limit is capped: infinity, NaN or a huge int goes on to the
        # validator's refusal naming time_limit_s, whatever the ceiling
        return min(requested, ceiling) if finite else requested


class BatchingConfig(_Model):
    max_num_seqs: Int = doc(
        "requests in one engine batch (rows of the draft pass and the verifier forward); "
        "more wait for a row",
        32,
    )
    max_num_batched_tokens: Int = doc(
        "token budget of one engine step (vLLM's chunked prefill budget): the running rows' "
        "K + 1 tokens each always run (decode is never cut, so a step may compute more), and "
        "chunks of waiting prompts add what is left of the budget, at least 32 prompt tokens "
        "a step while any wait, so a prompt always moves",
        512,
    )
    kv_budget_tokens: Int | None = doc(
        "KV-cache slots per replica (rows x longest reservation), the verifier's and the "
        "draft actor's each; a request that does not fit waits (one above the whole budget: "
        "INVALID_ARGUMENT on max_tokens). null = max_num_seqs x the model's context",
        None,
    )
    batch_wait_ms: Float = doc(
        "an idle engine, given a request, waits up to this long for each further arrival "
        "(5 x this in all at most) before its first step, so a burst starts in one step; a busy "
        "engine never waits. 0 = step at once",
        2.0,
    )


class RecoveryConfig(_Model):
    max_attempts: Int = doc(
        "times one request is resumed on a rebuilt engine before it fails INTERNAL (not "
        "UNAVAILABLE: clients would retry a request that may be what brings the engine down)",
        3,
    )
    restart_attempts: Int = doc(
        "gang restarts of the verifier ranks (and replacements of the draft actor) tried in "
        "a row before giving up (ranks: the replica reports itself unhealthy and Serve "
        "replaces it; draft: requests go on without drafts)",
        3,
    )
    check_period_s: Float = doc("how often the supervisor probes the engine's actors", 0.5)
    probe_timeout_s: Float = doc(
        "an actor that does not answer a probe this long is dead (also the longest a gang "
        "restart waits for the draft actor's reset, and a draft replacement for rank 0's "
        "ping after a failed attach, or for a kept draft actor's status)",
        10.0,
    )
    recovery_timeout_s: Float = doc(
        "the longest a request waits for a restart (its own deadline may be shorter)", 120.0
    )
    drain_timeout_s: Float = doc(
        "on scale-down and shutdown, how long running streams may take to finish (on "
        "shutdown, those still running then end with UNAVAILABLE)",
        30.0,
    )
    health_check_period_s: Float = doc(
        "how often Serve checks that a replica's engine is not given up on; Serve "
        "replaces a replica after 3 failed checks in a row",
        10.0,
    )


class AutoscalingConfig(_Model):
    min_replicas: Int = doc("replicas kept at idle", 1)
    max_replicas: Int = doc("upper bound under load", 1)
    target_ongoing_requests: Float = doc("per-replica load the autoscaler aims for", 2.0)
    upscale_delay_s: Float = doc("load must persist this long before adding a replica", 10.0)
    downscale_delay_s: Float = doc("idle time before removing a replica", 60.0)
    metrics_interval_s: Float = doc("how often replicas report load", 1.0)
    look_back_period_s: Float = doc("window the autoscaler averages over", 5.0)


class ServeConfig(_Model):
    models: ModelsConfig = doc("the draft/verifier pair", default_factory=ModelsConfig)
    tp_size: Int = doc("verifier tensor-parallel ranks per replica", 1)
    resources: ResourcesConfig = doc("per-actor resources", default_factory=ResourcesConfig)
    speculation: SpeculationConfig = doc("defaults and limits", default_factory=SpeculationConfig)
    sampling: SamplingConfig = doc("sampling defaults", default_factory=SamplingConfig)
    auth: AuthConfig = doc("optional bearer token", default_factory=AuthConfig)
    limits: LimitsConfig = doc("queues and sizes", default_factory=LimitsConfig)
    batching: BatchingConfig = doc("continuous batching", default_factory=BatchingConfig)
    recovery: RecoveryConfig = doc("engine actor failures", default_factory=RecoveryConfig)
    autoscaling: AutoscalingConfig = doc("replica autoscaling", default_factory=AutoscalingConfig)
    grpc_port: Int = doc(
        "public gRPC port (Ray Serve's gRPC proxy listens on it on every interface)", 9000
    )
    http_port: Int = doc("OpenAI-compatible HTTP port (/v1/completions, ...)", 8000)
    http_host: Str = doc(
        "interface the HTTP port listens on (0.0.0.0: every interface)", "127.0.0.1"
    )
    app_name: Str = doc("Serve application name", "cactus")
    shm_allreduce: Bool = doc("DeepSpeed shared-memory all-reduce on CPU (JIT-compiled)", False)

    def model_path(self, which: str) -> str:
        path = Path(getattr(self.models, which))
        return str(path if path.is_absolute() else REPO / path)


# ---- loading and validation -------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error: PyYAML
    keeps the last one, so a second `limits:` block silently replaced the first."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class reports it
                break
            if repeated:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | os.PathLike, overrides: dict | None = None) -> ServeConfig:
    with open(path, encoding="utf-8") as fh:
        try:
            raw = yaml.load(fh, Loader=_UniqueKeyLoader)  # a SafeLoader
        except yaml.YAMLError as err:  # a malformed file: where, not a traceback
            raise ConfigError(f"<file> {path}: not valid YAML: {err}") from None
    if raw is None:  # an empty file: every default
        raw = {}
    if not isinstance(raw, dict):  # before the overrides are merged into it
        raise ConfigError(f"<root>: expected a mapping, got {type(raw).__name__}")
    if overrides:
        raw = _merge(raw, overrides)
    return from_dict(raw)


def from_dict(raw: dict) -> ServeConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"<root>: expected a mapping, got {type(raw).__name__}")
    try:
        config = ServeConfig.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        path = ".".join(str(part) for part in first["loc"]) or "<root>"
        message = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
        raise ConfigError(f"{path}: {message}") from None
    validate(config)
    return config


def to_dict(config: BaseModel) -> dict:
    """Plain data (lists, dicts, numbers): what Serve pickles into each replica."""
    return config.model_dump(mode="json")


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


# Rank 0 is a threaded actor with a thread per running or waiting request
# (max_concurrency = 2 x the larger of max_ongoing_requests and max_num_seqs), and Ray
# takes max_concurrency as a C int: beyond this a replica would fail at start with a
# traceback, or start thousands of threads, rather than refuse its config.
MAX_SLOTS = 8192
MAX_QUEUED = 2**31 - 1  # Serve's queue bound, a C int too


def _check(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {message}")


def validate(c: ServeConfig) -> None:
    """Range checks that types alone cannot express."""
    _check(
        c.models.dtype in ("float32", "bfloat16", "float16"),
        "models.dtype",
        f"must be float32, bfloat16 or float16, got {c.models.dtype!r}",
    )
    _check(
        not (c.models.dtype == "float16" and c.models.device == "cpu" and c.tp_size > 1),
        "models.dtype",
        "float16 tensor parallelism is not supported on CPU (DeepSpeed's CPU accelerator "
        "refuses it); use bfloat16 or float32, or tp_size 1",
    )
    names = c.models.served_model_name
    _check(
        all(n.strip() == n and n for n in names) and len(set(names)) == len(names),
        "models.served_model_name",
        f"names must be non-empty, without surrounding spaces, and distinct, got {names!r}",
    )
    _check(
        c.models.device in ("cpu", "cuda"),
        "models.device",
        f"must be cpu or cuda, got {c.models.device!r}",
    )
    if c.models.device == "cuda":
        # Ray hides the GPUs an actor did not reserve (CUDA_VISIBLE_DEVICES) only when
        # it reserves some. With TP > 1 each rank needs whole GPUs of its own (NCCL
        # refuses two ranks on one GPU); a lone rank and the draft may share one.
        gpus = c.resources.verifier_rank.num_gpus
        _check(
            gpus >= 1 and float(gpus).is_integer() if c.tp_size > 1 else gpus > 0,
            "resources.verifier_rank.num_gpus",
            f"must be {'a whole number >= 1' if c.tp_size > 1 else '> 0'} with models.device "
            f"cuda and tp_size {c.tp_size}, got {gpus}",
        )
        _check(
            c.resources.draft.num_gpus > 0,
            "resources.draft.num_gpus",
            "must be > 0 with models.device cuda (a fraction shares a GPU)",
        )
    _check(c.tp_size >= 1, "tp_size", f"must be >= 1, got {c.tp_size}")
    s = c.speculation
    _check(
        all(r in RULES for r in s.allowed_rules),
        "speculation.allowed_rules",
        f"rules must be among {RULES}",
    )
    _check(
        s.default_rule in s.allowed_rules,
        "speculation.default_rule",
        f"{s.default_rule!r} is not in allowed_rules",
    )
    _check(s.delta_ceiling >= 0, "speculation.delta_ceiling", "must be >= 0")
    _check(0 < s.tas_threshold <= 1, "speculation.tas_threshold", "must lie in (0, 1]")
    _check(s.tas_alpha is None or s.tas_alpha >= 0, "speculation.tas_alpha", "must be null or >= 0")
    _check(
        s.policy in POLICIES,
        "speculation.policy",
        f"must be one of {', '.join(POLICIES)}, got {s.policy!r}",
    )
    _check(
        0 <= s.default_delta <= s.delta_ceiling,
        "speculation.default_delta",
        f"must lie in [0, delta_ceiling={s.delta_ceiling}]",
    )
    _check(
        1 <= s.max_num_speculative_tokens <= MAX_DRAFT_TOKENS,
        "speculation.max_num_speculative_tokens",
        f"must lie in [1, {MAX_DRAFT_TOKENS}] (the widest draft block a drafter takes)",
    )
    _check(
        1 <= s.default_num_speculative_tokens <= s.max_num_speculative_tokens,
        "speculation.default_num_speculative_tokens",
        "must lie in [1, max_num_speculative_tokens]",
    )
    _check(
        0 <= c.sampling.default_temperature <= 2,
        "sampling.default_temperature",
        "must lie in [0, 2]",
    )
    _check(
        c.sampling.default_max_tokens is None or c.sampling.default_max_tokens >= 1,
        "sampling.default_max_tokens",
        "must be null or >= 1",
    )
    if c.auth.token is not None:
        check_token(c.auth.token, "auth.token")
    lim = c.limits
    _check(
        1 <= lim.max_ongoing_requests <= MAX_SLOTS,
        "limits.max_ongoing_requests",
        f"must lie in [1, {MAX_SLOTS}] (each request holds a thread of rank 0)",
    )
    _check(
        1 <= lim.max_queued_requests <= MAX_QUEUED,
        "limits.max_queued_requests",
        f"must lie in [1, {MAX_QUEUED}] (the queue is always bounded: beyond it "
        "RESOURCE_EXHAUSTED)",
    )
    _check(
        1024 <= lim.max_message_bytes <= GRPC_MAX_MESSAGE_BYTES,
        "limits.max_message_bytes",
        f"must lie in [1024, {GRPC_MAX_MESSAGE_BYTES}] (gRPC's limit is a C int)",
    )
    _check(lim.max_prompt_chars >= 1, "limits.max_prompt_chars", "must be >= 1")
    _check(
        lim.max_health_watches is None or 0 <= lim.max_health_watches < lim.max_ongoing_requests,
        "limits.max_health_watches",
        f"must be null or in [0, limits.max_ongoing_requests = {lim.max_ongoing_requests}) "
        "(an open Watch holds a request slot and needs no token: Watch calls alone must not "
        "hold every slot)",
    )
    _check(lim.request_timeout_s >= 0, "limits.request_timeout_s", "must be >= 0 (0 = no limit)")
    _check(lim.start_timeout_s > 0, "limits.start_timeout_s", "must be > 0")
    b = c.batching
    _check(
        1 <= b.max_num_seqs <= MAX_SLOTS,
        "batching.max_num_seqs",
        f"must lie in [1, {MAX_SLOTS}] (each row's request holds a thread of rank 0)",
    )
    _check(b.max_num_batched_tokens >= 1, "batching.max_num_batched_tokens", "must be >= 1")
    _check(
        b.kv_budget_tokens is None or b.kv_budget_tokens >= 64,
        "batching.kv_budget_tokens",
        "must be null or >= 64",
    )
    _check(0 <= b.batch_wait_ms <= 1000, "batching.batch_wait_ms", "must be in [0, 1000] ms")
    r = c.recovery
    _check(r.max_attempts >= 0, "recovery.max_attempts", "must be >= 0")
    _check(r.restart_attempts >= 1, "recovery.restart_attempts", "must be >= 1")
    for name in (
        "check_period_s",
        "probe_timeout_s",
        "recovery_timeout_s",
        "health_check_period_s",
    ):
        _check(getattr(r, name) > 0, f"recovery.{name}", "must be > 0")
    _check(r.drain_timeout_s >= 0, "recovery.drain_timeout_s", "must be >= 0")
    a = c.autoscaling
    _check(
        1 <= a.min_replicas <= a.max_replicas,
        "autoscaling.min_replicas",
        "must satisfy 1 <= min_replicas <= max_replicas",
    )
    _check(a.target_ongoing_requests > 0, "autoscaling.target_ongoing_requests", "must be > 0")
    for name in ("upscale_delay_s", "downscale_delay_s"):
        _check(getattr(a, name) >= 0, f"autoscaling.{name}", "must be >= 0")
    for name in ("metrics_interval_s", "look_back_period_s"):
        _check(getattr(a, name) > 0, f"autoscaling.{name}", "must be > 0")
    _check(
        a.look_back_period_s > a.metrics_interval_s,
        "autoscaling.look_back_period_s",
        f"must be above autoscaling.metrics_interval_s ({a.metrics_interval_s:g}): the "
        "window must hold more than one report (Ray Serve warns, and will refuse it)",
    )
    _check(
        bool(c.app_name) and c.app_name.strip() == c.app_name,
        "app_name",
        f"must be a non-empty name without surrounding spaces, got {c.app_name!r}",
    )
    _check(0 < c.grpc_port < 65536, "grpc_port", f"must be a TCP port, got {c.grpc_port}")
    _check(0 < c.http_port < 65536, "http_port", f"must be a TCP port, got {c.http_port}")
    _check(c.http_port != c.grpc_port, "http_port", "must differ from grpc_port")
    _check(
        c.resources.placement_strategy in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
        "resources.placement_strategy",
        "must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD",
    )
    _check(c.resources.threads_per_actor >= 1, "resources.threads_per_actor", "must be >= 1")
    for actor in ("replica", "draft", "verifier_rank"):
        res = getattr(c.resources, actor)
        _check(
            res.num_cpus >= 0, f"resources.{actor}.num_cpus", f"must be >= 0, got {res.num_cpus}"
        )
        _check(
            res.num_gpus >= 0, f"resources.{actor}.num_gpus", f"must be >= 0, got {res.num_gpus}"
        )
        for key, amount in res.resources.items():
            _check(
                amount >= 0 and key not in ("CPU", "GPU", "memory"),
                f"resources.{actor}.resources.{key}",
                f"must be a custom resource with an amount >= 0, got {amount}"
                + (" (use num_cpus / num_gpus)" if key in ("CPU", "GPU") else ""),
            )
        # each actor is a placement bundle, and Ray refuses one of only zeros (at
        # deploy time, after Ray has started: a traceback rather than this message)
        _check(
            res.num_cpus > 0 or res.num_gpus > 0 or any(v > 0 for v in res.resources.values()),
            f"resources.{actor}",
            "needs some resource > 0 (num_cpus, num_gpus or a custom one): it is a placement "
            "bundle, and Ray refuses a bundle of zeros",
        )


# ---- the README's config table, generated from the field descriptions ---------------


def _flow(value) -> str:
    """A value as one line of YAML (a tuple as a list)."""
    value = list(value) if isinstance(value, tuple) else value
    text = yaml.safe_dump(value, default_flow_style=True, width=1000)
    return text.strip().removesuffix("...").strip()


def config_rows(
    model: type[BaseModel] | None = None, prefix: str = ""
) -> list[tuple[str, str, str]]:
    """(key path, description, default) of every leaf field, in declaration order."""
    model = model or ServeConfig
    rows = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        inner = info.annotation if isinstance(info.annotation, type) else None
        if inner is not None and issubclass(inner, BaseModel):
            rows.extend(config_rows(inner, path + "."))
            continue
        default = info.get_default(call_default_factory=True)
        rows.append((path, info.description or "", _flow(default)))
    return rows


def config_table(shipped: Path = REPO / "configs" / "default.yaml") -> str:
    """The table; its last column is what `make serve`'s config (`shipped`) sets where
    that differs from the schema's default (a key it leaves out takes the default)."""
    raw = yaml.safe_load(shipped.read_text()) or {}
    lines = [
        "| key | meaning | default | `make serve` (configs/default.yaml) |",
        "|---|---|---|---|",
    ]
    for path, text, default in config_rows():
        node = raw
        for part in path.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        shipped_value = _flow(node) if node != {} else default
        same = yaml.safe_load(shipped_value) == yaml.safe_load(default)
        differs = "" if same else f"`{shipped_value}`"
        lines.append(f"| `{path}` | {text} | `{default}` | {differs} |")
    return "\n".join(lines)


def readme_with_table(readme: str) -> str:
    """The README with its config table (between the markers) regenerated."""
    start = readme.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    end = readme.index(TABLE_END)
    return readme[:start] + "\n" + config_table() + "\n" + readme[end:]


if __name__ == "__main__":
    if sys.argv[1:] == ["--readme"]:
        README.write_text(readme_with_table(README.read_text()))
    elif len(sys.argv) == 3 and sys.argv[1] == "--stop-timeout":  # make stop's default bound
        print(int(load_config(sys.argv[2]).recovery.drain_timeout_s) + 60)
    elif len(sys.argv) == 3 and sys.argv[1] == "--grpc-port":  # make stop's port
        try:
            print(load_config(sys.argv[2]).grpc_port)
        except (ValueError, OSError) as err:  # ConfigError is a ValueError
            print(f"config error: {err}", file=sys.stderr)
            sys.exit(2)
    else:
        print(config_table())
