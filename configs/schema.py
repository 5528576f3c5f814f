"""Typed, validated service configuration (YAML in, frozen dataclasses out).

Every field has a description; unknown keys and bad values are rejected with the key
path (e.g. `speculation.delta_ceiling: must be a number >= 0, got -1`). Relative model
paths are resolved against the repository root, so the shipped YAML works from anywhere.
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

REPO = Path(__file__).resolve().parent.parent
RULES = ("none", "sps", "cactus", "cactus_exact", "tas")


class ConfigError(ValueError):
    """A config key is unknown or its value is invalid; the message starts with its path."""


def doc(text: str, default=MISSING, default_factory=MISSING):
    kw = {"metadata": {"doc": text}}
    if default is not MISSING:
        kw["default"] = default
    if default_factory is not MISSING:
        kw["default_factory"] = default_factory
    return field(**kw)


@dataclass(frozen=True)
class ModelsConfig:
    verifier: str = doc("verifier checkpoint folder (Hugging Face layout)", "models/verifier")
    draft: str = doc("draft checkpoint folder; must share the verifier's tokenizer", "models/draft")
    dtype: str = doc("float32, bfloat16 or float16", "float32")
    device: str = doc("cpu or cuda", "cpu")


@dataclass(frozen=True)
class ActorResourcesConfig:
    num_cpus: float = doc("CPUs reserved for the actor (fractions allowed)", 0.25)
    num_gpus: float = doc("GPUs reserved for the actor", 0.0)
    resources: dict[str, float] = doc(
        "custom resources, e.g. {draft_node: 1}", default_factory=dict
    )


@dataclass(frozen=True)
class ResourcesConfig:
    replica: ActorResourcesConfig = doc(
        "the Serve ingress replica", default_factory=ActorResourcesConfig
    )
    draft: ActorResourcesConfig = doc("the draft actor", default_factory=ActorResourcesConfig)
    verifier_rank: ActorResourcesConfig = doc(
        "each verifier TP rank", default_factory=ActorResourcesConfig
    )
    threads_per_actor: int = doc("torch intra-op threads in each actor", 1)
    placement_strategy: str = doc(
        "PACK, SPREAD, STRICT_PACK or STRICT_SPREAD for a replica's bundles", "PACK"
    )


@dataclass(frozen=True)
class SpeculationConfig:
    default_rule: str = doc("rule used when a request names none", "cactus")
    default_delta: float = doc("delta (nats) used when a request sets none", 1.0)
    default_num_speculative_tokens: int = doc("K used when a request sets none", 4)
    max_num_speculative_tokens: int = doc("largest K a request may ask for", 8)
    delta_ceiling: float = doc("largest delta a request may ask for (nats)", 4.0)
    allowed_rules: tuple[str, ...] = doc("rules requests may use", RULES)


@dataclass(frozen=True)
class SamplingConfig:
    default_temperature: float = doc("temperature when a request sets none", 1.0)
    default_max_tokens: int = doc("max_tokens when a request sets 0", 64)


@dataclass(frozen=True)
class AuthConfig:
    token: str | None = doc("bearer token every RPC must carry; null = no auth", None)
    token_env: str = doc(
        "environment variable read for the token when `token` is null", "CACTUS_AUTH_TOKEN"
    )

    def resolved_token(self) -> str | None:
        return self.token or os.environ.get(self.token_env) or None


@dataclass(frozen=True)
class LimitsConfig:
    max_ongoing_requests: int = doc("requests a replica works on at once", 8)
    max_queued_requests: int = doc(
        "requests waiting per deployment; beyond: RESOURCE_EXHAUSTED", 32
    )
    max_prompt_chars: int = doc("longest text prompt accepted", 100_000)
    max_message_bytes: int = doc("gRPC receive limit, sized to the longest prompt", 4 << 20)
    request_timeout_s: float = doc("end-to-end limit the gRPC proxy enforces (0 = none)", 0.0)
    start_timeout_s: float = doc("how long a replica may take to start its engine", 300.0)


@dataclass(frozen=True)
class BatchingConfig:
    max_num_seqs: int = doc(
        "requests in one engine batch (rows of the draft pass and the verifier forward); "
        "more wait for a row",
        32,
    )
    max_num_batched_tokens: int = doc(
        "tokens one engine step computes: the running rows' K + 1 first, then chunks of "
        "waiting prompts (vLLM's chunked prefill budget)",
        512,
    )
    kv_budget_tokens: int | None = doc(
        "verifier KV-cache slots per replica (rows x longest reservation); a request that "
        "does not fit waits. null = max_num_seqs x the model's context",
        None,
    )


@dataclass(frozen=True)
class RecoveryConfig:
    max_attempts: int = doc(
        "times one request is resumed on a rebuilt engine before it fails UNAVAILABLE", 3
    )
    restart_attempts: int = doc(
        "gang restarts of the verifier ranks tried in a row before the replica gives up "
        "(Serve then replaces it)",
        3,
    )
    check_period_s: float = doc("how often the supervisor probes the engine's actors", 0.5)
    probe_timeout_s: float = doc("an actor that does not answer a probe this long is dead", 10.0)
    recovery_timeout_s: float = doc(
        "the longest a request waits for a restart (its own deadline may be shorter)", 120.0
    )
    drain_timeout_s: float = doc(
        "on scale-down and shutdown, how long running streams may take to finish", 30.0
    )


@dataclass(frozen=True)
class AutoscalingConfig:
    min_replicas: int = doc("replicas kept at idle", 1)
    max_replicas: int = doc("upper bound under load", 1)
    target_ongoing_requests: float = doc("per-replica load the autoscaler aims for", 2.0)
    upscale_delay_s: float = doc("load must persist this long before adding a replica", 10.0)
    downscale_delay_s: float = doc("idle time before removing a replica", 60.0)
    metrics_interval_s: float = doc("how often replicas report load", 1.0)
    look_back_period_s: float = doc("window the autoscaler averages over", 5.0)


@dataclass(frozen=True)
class ServeConfig:
    models: ModelsConfig = doc("the draft/verifier pair", default_factory=ModelsConfig)
    tp_size: int = doc("verifier tensor-parallel ranks per replica", 1)
    resources: ResourcesConfig = doc("per-actor resources", default_factory=ResourcesConfig)
    speculation: SpeculationConfig = doc("defaults and limits", default_factory=SpeculationConfig)
    sampling: SamplingConfig = doc("sampling defaults", default_factory=SamplingConfig)
    auth: AuthConfig = doc("optional bearer token", default_factory=AuthConfig)
    limits: LimitsConfig = doc("queues and sizes", default_factory=LimitsConfig)
    batching: BatchingConfig = doc("continuous batching", default_factory=BatchingConfig)
    recovery: RecoveryConfig = doc("engine actor failures", default_factory=RecoveryConfig)
    autoscaling: AutoscalingConfig = doc("replica autoscaling", default_factory=AutoscalingConfig)
    grpc_port: int = doc(
        "public gRPC port (Ray Serve's gRPC proxy listens on it on every interface)", 9000
    )
    http_port: int = doc("OpenAI-compatible HTTP port (/v1/completions, ...)", 8000)
    http_host: str = doc(
        "interface the HTTP port listens on (0.0.0.0: every interface)", "127.0.0.1"
    )
    app_name: str = doc("Serve application name", "cactus")
    shm_allreduce: bool = doc("DeepSpeed shared-memory all-reduce on CPU (JIT-compiled)", False)

    def model_path(self, which: str) -> str:
        path = Path(getattr(self.models, which))
        return str(path if path.is_absolute() else REPO / path)


# ---- loading and validation -------------------------------------------------------------


def load_config(path: str | os.PathLike, overrides: dict | None = None) -> ServeConfig:
    with open(path, encoding="utf-8") as fh:
        raw = yaml.safe_load(fh) or {}
    if overrides:
        raw = _merge(raw, overrides)
    return from_dict(raw)


def from_dict(raw: dict) -> ServeConfig:
    config = _build(ServeConfig, raw, "")
    validate(config)
    return config


def to_dict(config) -> dict:
    out = {}
    for f in fields(config):
        value = getattr(config, f.name)
        out[f.name] = (
            to_dict(value)
            if is_dataclass(value)
            else (list(value) if isinstance(value, tuple) else value)
        )
    return out


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def _build(cls, raw: Any, path: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or '<root>'}: expected a mapping, got {type(raw).__name__}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for key in raw:
        if key not in known:
            raise ConfigError(
                f"{_join(path, key)}: unknown key (known: {', '.join(sorted(known))})"
            )
    kwargs = {}
    for f in fields(cls):
        if f.name in raw:
            kwargs[f.name] = _coerce(hints[f.name], raw[f.name], _join(path, f.name))
    return cls(**kwargs)


def _coerce(tp, value, path: str):
    if is_dataclass(tp):
        return _build(tp, value, path)
    origin, args = get_origin(tp), get_args(tp)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list")
        return tuple(_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping")
        return {str(k): _coerce(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if type(None) in args:  # Optional[X]
        return (
            None
            if value is None
            else _coerce(next(a for a in args if a is not type(None)), value, path)
        )
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {tp}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


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
    _check(
        0 <= s.default_delta <= s.delta_ceiling,
        "speculation.default_delta",
        f"must lie in [0, delta_ceiling={s.delta_ceiling}]",
    )
    _check(
        s.max_num_speculative_tokens >= 1, "speculation.max_num_speculative_tokens", "must be >= 1"
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
    _check(c.sampling.default_max_tokens >= 1, "sampling.default_max_tokens", "must be >= 1")
    lim = c.limits
    _check(lim.max_ongoing_requests >= 1, "limits.max_ongoing_requests", "must be >= 1")
    _check(
        lim.max_queued_requests >= -1,
        "limits.max_queued_requests",
        "must be >= -1 (-1 = unbounded)",
    )
    _check(lim.max_message_bytes >= 1024, "limits.max_message_bytes", "must be >= 1024")
    b = c.batching
    _check(b.max_num_seqs >= 1, "batching.max_num_seqs", "must be >= 1")
    _check(b.max_num_batched_tokens >= 1, "batching.max_num_batched_tokens", "must be >= 1")
    _check(
        b.kv_budget_tokens is None or b.kv_budget_tokens >= 64,
        "batching.kv_budget_tokens",
        "must be null or >= 64",
    )
    r = c.recovery
    _check(r.max_attempts >= 0, "recovery.max_attempts", "must be >= 0")
    _check(r.restart_attempts >= 1, "recovery.restart_attempts", "must be >= 1")
    for name in ("check_period_s", "probe_timeout_s", "recovery_timeout_s"):
        _check(getattr(r, name) > 0, f"recovery.{name}", "must be > 0")
    _check(r.drain_timeout_s >= 0, "recovery.drain_timeout_s", "must be >= 0")
    a = c.autoscaling
    _check(
        1 <= a.min_replicas <= a.max_replicas,
        "autoscaling.min_replicas",
        "must satisfy 1 <= min_replicas <= max_replicas",
    )
    _check(a.target_ongoing_requests > 0, "autoscaling.target_ongoing_requests", "must be > 0")
    _check(0 < c.grpc_port < 65536, "grpc_port", f"must be a TCP port, got {c.grpc_port}")
    _check(0 < c.http_port < 65536, "http_port", f"must be a TCP port, got {c.http_port}")
    _check(c.http_port != c.grpc_port, "http_port", "must differ from grpc_port")
    _check(
        c.resources.placement_strategy in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
        "resources.placement_strategy",
        "must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD",
    )
    _check(c.resources.threads_per_actor >= 1, "resources.threads_per_actor", "must be >= 1")
