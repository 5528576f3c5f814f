"""The Ray Serve ingress: a thin shim between the public gRPC API and one engine.

Duties, and nothing else:
  1. authenticate (optional bearer token, constant-time compare) -> UNAUTHENTICATED
  2. turn the wire request into a GenerationRequest with the configured defaults and
     validate it (cactus.params.validate_request) -> INVALID_ARGUMENT naming the field
  3. assign request ids; run the request on the engine, unary or streaming
  4. map every other failure to a status with scrubbed details (no stack traces)
  5. cancel the engine's work when the client goes away; record metrics
  6. at shutdown, end what still runs when the drain time is up with UNAVAILABLE, and
     open health Watch calls with NOT_SERVING (deployments/drain.py)

The engine is injected (the `workers.interfaces.ServingEngine` protocol: agenerate /
astream / cancel / ahealthy / model_info), as Ray Serve LLM does, so the shim can be
tested with a fake engine beside the real end-to-end tests. In a real replica it is an
EngineSupervisor (workers/supervisor.py) over an EngineGroup (draft actor + verifier
ranks) started inside the replica's own placement-group bundles, wrapped in the drain
(deployments/drain.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import secrets
import time
import weakref
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from cactus.detokenize import encode_prompt
from cactus.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    InvalidRequestError,
    RequestAttemptsExhaustedError,
    ServerShuttingDownError,
    is_unavailable,
    unwrap,
)
from cactus.params import (
    MAX_REQUEST_ID_CHARS,
    GenerationRequest,
    Limits,
    SamplingParams,
    SpeculationParams,
    default_max_tokens,
    too_long,
    validate_request,
)
from configs.schema import ServeConfig, from_dict
from deployments.drain import DrainingEngine, application_deleting, drain_length, mark_busy
from deployments.metrics import ServiceMetrics, failure_reason
from protos.cactus.v1 import cactus_pb2 as pb

logger = logging.getLogger("cactus.ingress")


class RequestError(Exception):
    """A failure with the gRPC status to answer it with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details

    def __reduce__(self):  # crosses the replica -> proxy boundary pickled
        return (RequestError, (self.code, self.details))


def limits_from(config: ServeConfig, *, vocab_size: int, max_context: int) -> Limits:
    s = config.speculation
    return Limits(
        max_context=max_context,
        vocab_size=vocab_size,
        max_num_speculative_tokens=s.max_num_speculative_tokens,
        delta_ceiling=s.delta_ceiling,
        allowed_rules=tuple(s.allowed_rules),
        max_prompt_chars=config.limits.max_prompt_chars,
    )


def to_request(msg: pb.GenerateRequest, config: ServeConfig) -> GenerationRequest:
    """Wire request -> GenerationRequest, unset fields filled from the config."""
    rid = msg.request_id
    if len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
        raise InvalidRequestError(
            "request_id",
            f"must be at most {MAX_REQUEST_ID_CHARS} printable characters, got {len(rid)}"
            + ("" if rid.isprintable() else " with a non-printable character"),
        )
    s, sp = msg.sampling, msg.speculation
    sampling = SamplingParams(
        max_tokens=s.max_tokens
        if s.HasField("max_tokens")
        else default_max_tokens(config.sampling.default_max_tokens),
        temperature=s.temperature
        if s.HasField("temperature")
        else config.sampling.default_temperature,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        logit_bias=tuple(sorted(s.logit_bias.items())),
    )
    speculation = SpeculationParams(
        rule=sp.rule or config.speculation.default_rule,
        delta=sp.delta if sp.HasField("delta") else config.speculation.default_delta,
        num_speculative_tokens=(
            sp.num_speculative_tokens
            if sp.HasField("num_speculative_tokens")
            else config.speculation.default_num_speculative_tokens
        ),
        max_divergence_nats=(
            sp.max_divergence_nats if sp.HasField("max_divergence_nats") else None
        ),
        tas_threshold=config.speculation.tas_threshold,  # the operator's, for every request
        tas_alpha=config.speculation.tas_alpha,
    )
    which = msg.WhichOneof("input")
    prompt = msg.prompt if which == "prompt" else None
    ids = tuple(msg.prompt_token_ids.ids) if which == "prompt_token_ids" else None
    return GenerationRequest(
        prompt=prompt,
        prompt_token_ids=ids,
        sampling=sampling,
        speculation=speculation,
        request_id=msg.request_id or f"cactus-{secrets.token_hex(8)}",
        time_limit_s=config.limits.time_limit(msg.time_limit_s or None),
    )


def tokenize(
    request: GenerationRequest,
    tokenizer,
    limits: Limits,
    *,
    fit_max_tokens: bool = False,
    row_tokens: int | None = None,
) -> GenerationRequest:
    """Validate, tokenize a text prompt, validate the lengths; returns an ids request.
    fit_max_tokens: max_tokens is the server's default, not the client's, so it shrinks
    to the context the prompt leaves (as vLLM's default does) instead of failing.
    row_tokens: the most tokens one engine row holds (batching.kv_budget_tokens, when
    below the context): the default shrinks to what the prompt leaves of that too, and a
    prompt that leaves no room in it is refused naming the prompt, so a request that sets
    no max_tokens is never refused for a field it did not send."""
    most = limits.max_context if row_tokens is None else min(limits.max_context, row_tokens)
    if fit_max_tokens and request.sampling.max_tokens > most:
        request = replace(request, sampling=replace(request.sampling, max_tokens=most))
    validate_request(request, limits)
    if request.prompt_token_ids is not None and len(request.prompt_token_ids):
        ids = request.prompt_token_ids
    else:
        ids = encode_prompt(tokenizer, request.prompt)
        if not ids:
            raise InvalidRequestError("prompt", "encodes to zero tokens")
        if len(ids) > limits.max_context - 1:  # named as sent: a text prompt
            raise too_long("prompt", f"{len(ids)} tokens leave no room", limits.max_context)
        request = replace(request, prompt=None, prompt_token_ids=tuple(ids))
    if len(ids) > most - 1:  # the context's case is refused above, naming it
        raise InvalidRequestError(
            "prompt",
            f"{len(ids)} tokens leave no room in the {most} KV slots a request may hold "
            "(batching.kv_budget_tokens)",
            CONTEXT_LENGTH_EXCEEDED,
        )
    room = most - len(ids)
    if fit_max_tokens and 1 <= room < request.sampling.max_tokens:
        request = replace(request, sampling=replace(request.sampling, max_tokens=room))
    validate_request(request, limits, prompt_len=len(ids))
    return request


def actor_resources(section):
    """A config `resources.<actor>` section as the engine group's ActorResources (its
    placement bundle: workers.group)."""
    from workers.group import ActorResources

    return ActorResources(section.num_cpus, section.num_gpus, dict(section.resources))


def group_config(config: ServeConfig):
    """The engine's GroupConfig from the typed config: the one translation (the
    replica's placement bundles are derived from it too, deployments/app.py)."""
    from workers.group import GroupConfig

    c, r = config, config.resources
    return GroupConfig(
        verifier_dir=c.model_path("verifier"),
        draft_dir=c.model_path("draft"),
        tp_size=c.tp_size,
        dtype=c.models.dtype,
        device=c.models.device,
        threads=r.threads_per_actor,
        shm_allreduce=c.shm_allreduce,
        draft=actor_resources(r.draft),
        rank=actor_resources(r.verifier_rank),
        start_timeout_s=c.limits.start_timeout_s,
        probe_timeout_s=c.recovery.probe_timeout_s,
        max_concurrency=max(4, c.limits.max_ongoing_requests * 2, c.batching.max_num_seqs * 2),
        max_num_seqs=c.batching.max_num_seqs,
        max_num_batched_tokens=c.batching.max_num_batched_tokens,
        batch_wait_ms=c.batching.batch_wait_ms,
        kv_budget_tokens=c.batching.kv_budget_tokens,
        speculation_policy=c.speculation.policy,
    )


def recovery_config(config: ServeConfig):
    """The supervisor's RecoveryConfig from the typed config: every `recovery` key but
    the drain and the health-check period, which are Serve's (deployments/app.py)."""
    from workers.supervisor import RecoveryConfig

    r = config.recovery
    return RecoveryConfig(
        max_attempts=r.max_attempts,
        restart_attempts=r.restart_attempts,
        check_period_s=r.check_period_s,
        probe_timeout_s=r.probe_timeout_s,
        recovery_timeout_s=r.recovery_timeout_s,
    )


def stats_pb(stats) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        accepted_per_position=list(stats.accepted_per_position),
        mean_acceptance_length=stats.mean_acceptance_length,
        divergence_nats=stats.divergence_nats,
        acceptance_rate=stats.acceptance_rate,
        draft_failures=stats.draft_failures,
        resumed=stats.resumed,
        degraded=stats.degraded,
    )


def logprobs_pb(entries) -> list:
    return [
        pb.TokenLogprob(
            token_id=e.token_id,
            logprob=e.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in e.top],
        )
        for e in entries or ()
    ]


def result_pb(result) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        logprobs=logprobs_pb(result.logprobs),
        request_id=result.request_id,
        text=result.text,
        token_ids=list(result.token_ids),
        finish_reason=result.finish_reason,
        usage=pb.Usage(prompt_tokens=result.prompt_tokens, completion_tokens=len(result.token_ids)),
        seed=result.seed,
        stats=stats_pb(result.stats),
    )


class CactusIngress:
    """Serve deployment class (wrapped with serve.deployment in deployments.app)."""

    def __init__(self, config: dict, engine=None) -> None:
        self.config = from_dict(config)
        watch = {}
        if engine is None:  # a real replica: drain with statuses (deployments/drain)
            from ray import serve

            context = serve.get_replica_context()
            app = context.app_name
            watch = {
                "deleting": functools.partial(application_deleting, app),
                "drain_length": functools.partial(drain_length, app),
                "mark_busy": functools.partial(
                    mark_busy,
                    app,
                    f"{context.replica_id.deployment_id.name}:{context.replica_id.unique_id}",
                ),
            }
        self.engine = DrainingEngine(
            engine if engine is not None else self._start_engine(),
            drain_s=self.config.recovery.drain_timeout_s,
            **watch,
        )
        info = self.engine.model_info()
        self.info = info
        self.limits = limits_from(
            self.config, vocab_size=info["vocab_size"], max_context=info["max_context"]
        )
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model_path("verifier"))
        self.token = self.config.auth.resolved_token()
        self.metrics = ServiceMetrics()
        self._engine_seen: dict = {}
        self.started = int(time.time())
        # the replica's drain; weakly, so the ingress stays free of a reference cycle
        # (freed, and its __del__ run, when Serve drops it, not at a later collection)
        changed = weakref.WeakMethod(self._engine_changed)
        self.engine.on_change = lambda: (method := changed()) is not None and method()
        listeners = getattr(self.engine, "listeners", None)
        if listeners is not None:  # the supervisor: its state and restarts, when they change
            listeners.append(self._engine_changed)
            self._engine_changed()

    def _engine_changed(self) -> None:
        stats = self.engine.stats() if hasattr(self.engine, "stats") else {}
        self.metrics.engine(stats, self._engine_seen, draining=self.engine.draining)

    def _start_engine(self):
        import ray

        from workers.group import EngineGroup
        from workers.supervisor import EngineSupervisor

        pg = ray.util.get_current_placement_group()
        # Rank 0 validates against the same operator limits as this shim.
        operator = limits_from(self.config, vocab_size=1, max_context=1).overrides()
        group = EngineGroup(
            group_config(self.config), limits=operator, placement_group=pg, first_bundle=1
        ).start()
        return EngineSupervisor(group, recovery_config(self.config))

    # ---- the shim's duties ----------------------------------------------------------

    def _authorize(self, grpc_context) -> None:
        metadata = dict(grpc_context.invocation_metadata()) if grpc_context else {}
        self.authorize(metadata.get("authorization", ""))

    def authorize(self, header: str) -> None:
        """The bearer token check of both APIs (gRPC metadata, HTTP Authorization)."""
        if not self.token:
            return
        # the scheme is case-insensitive (RFC 7235: "bearer", "BEARER"); the token is not
        scheme, _, token = header.strip().partition(" ")
        right = hmac.compare_digest(token.strip().encode(), self.token.encode())
        if scheme.lower() != "bearer" or not right:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    @property
    def model_names(self) -> list[str]:
        """The names the OpenAI API answers to: `models.served_model_name`, else the
        verifier checkpoint's folder name."""
        return list(self.config.models.served_model_name) or [
            Path(self.config.models.verifier).name
        ]

    @property
    def model_name(self) -> str:
        """The first name: what a response carries when its request named none."""
        return self.model_names[0]

    def __serve_build_asgi_app__(self):
        """Ray Serve's late-bound HTTP ingress: the OpenAI-compatible routes
        (deployments/openai_api.py) over this replica's engine."""
        from deployments.openai_api import build_routes

        return build_routes(self, tokenize, logger)

    def _prepare(self, msg, grpc_context) -> GenerationRequest:
        self._authorize(grpc_context)
        try:
            return tokenize(
                to_request(msg, self.config),
                self.tokenizer,
                self.limits,
                fit_max_tokens=not msg.sampling.HasField("max_tokens"),
                row_tokens=self.config.batching.kv_budget_tokens,
            )
        except InvalidRequestError as err:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None

    @staticmethod
    def _fail(grpc_context, err: BaseException, request_id: str = "") -> tuple:
        if isinstance(err, RequestError):
            code, details = err.code, err.details
        elif isinstance(err, InvalidRequestError):
            code, details = grpc.StatusCode.INVALID_ARGUMENT, str(err)
        elif isinstance(err, ServerShuttingDownError):
            code, details = grpc.StatusCode.UNAVAILABLE, str(err)
        elif isinstance(err, RequestAttemptsExhaustedError):  # INTERNAL: not to be retried
            logger.error("%s", err)
            code, details = grpc.StatusCode.INTERNAL, str(err)
        elif is_unavailable(err):  # cactus.errors decides, for every layer
            code, details = grpc.StatusCode.UNAVAILABLE, "engine unavailable; retry later"
        else:  # a bug: log it here, tell the client only that it happened
            logger.exception("request %s failed", request_id)
            code, details = grpc.StatusCode.INTERNAL, f"internal error (request {request_id})"
        if grpc_context is not None:
            grpc_context.set_code(code)
            grpc_context.set_details(details)
        return code, details

    # ---- RPCs (method names = RPC names) ----------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None):
        start = time.monotonic()
        req = None
        try:
            req = self._prepare(request, grpc_context)
            with self.metrics.running():
                result = await self.engine.agenerate(req)
            self.metrics.finished(req, result, start, unary=True)
            return result_pb(result)
        except asyncio.CancelledError:
            if req is not None:
                self.engine.cancel(req.request_id)
                self.metrics.ended(req, "CANCELLED")
            raise
        except Exception as err:
            # refused (a request_id already running, a field the engine found bad, a
            # replica past its drain cut) is no accepted request that failed, and the
            # id's bookkeeping is the other one's (metrics.failure_reason)
            reason = failure_reason(err)
            if req is not None and reason is not None:
                self.metrics.ended(req, reason)
            self._fail(grpc_context, unwrap(err), req.request_id if req else "")
            return pb.GenerateResponse()

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None):
        start = time.monotonic()
        req = None
        done = failed = refused = False
        try:
            req = self._prepare(request, grpc_context)
            first = True
            with self.metrics.running():
                async for chunk in self.engine.astream(req):
                    if chunk.token_ids:  # a chunk with the result only is no token (a
                        # request whose time ran out while it waited has none at all)
                        self.metrics.token_latency(req, start, first)
                        first = False
                    msg = pb.GenerateResponse(
                        request_id=chunk.request_id,
                        text=chunk.text,
                        token_ids=list(chunk.token_ids),
                        logprobs=logprobs_pb(chunk.logprobs),
                    )
                    if chunk.result is not None:
                        full = result_pb(chunk.result)
                        msg.finish_reason = full.finish_reason
                        msg.usage.CopyFrom(full.usage)
                        msg.seed = full.seed
                        msg.stats.CopyFrom(full.stats)
                        self.metrics.finished(req, chunk.result, start)
                        done = True
                    yield msg
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as err:
            if req is not None:
                failed = True
                # refused before it ran (a request_id already running, a bad field the
                # engine found): there is nothing of its own to cancel, and a cancel by
                # id would stop the other request that holds the id
                reason = failure_reason(err)
                refused = reason is None
                if not refused:  # (nor is it a failure: see Generate)
                    self.metrics.ended(req, reason)
            code, details = self._fail(grpc_context, unwrap(err), req.request_id if req else "")
            # A streaming method must raise for Serve to send the status it set.
            raise RequestError(code, details) from None
        finally:
            if req is not None and not done and not refused:
                self.engine.cancel(req.request_id)  # client gone: stop within one step
                if not failed:
                    self.metrics.ended(req, "CANCELLED")

    async def GetModelInfo(self, request, grpc_context=None):
        try:
            self._authorize(grpc_context)
        except RequestError as err:
            self._fail(grpc_context, err)
            return pb.ModelInfo()
        s = self.config.speculation
        return pb.ModelInfo(
            # names, never the server's paths (serving.md: "model names"): the name the
            # OpenAI API answers to, and the draft checkpoint's folder name
            verifier=self.model_name,
            draft=Path(self.config.models.draft).name,
            vocab_size=self.info["vocab_size"],
            max_context=self.info["max_context"],
            max_num_speculative_tokens=s.max_num_speculative_tokens,
            delta_ceiling=s.delta_ceiling,
            rules=list(s.allowed_rules),
            default_rule=s.default_rule,
            default_delta=s.default_delta,
            tp_size=self.info.get("tp_size", self.config.tp_size),
        )

    SERVICES = ("", "cactus.v1.Cactus", "grpc.health.v1.Health")

    async def _status(self, service: str = "") -> int:
        """The server ("") is SERVING only while the draft actor and every verifier rank
        answer (serving.md); the services it names are SERVING while requests are
        served, degraded to plain decoding included (a dead draft actor being replaced)."""
        status = health_pb2.HealthCheckResponse
        if self.engine.draining:  # the application is being deleted (deployments/drain)
            return status.NOT_SERVING
        if not await self.engine.ahealthy():
            return status.NOT_SERVING
        speculating = getattr(self.engine, "speculating", None)
        if service == "" and speculating is not None and not speculating():
            return status.NOT_SERVING
        return status.SERVING

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1 (the grpcio-health-checking service): NOT_SERVING while the
        engine's ranks restart, and for the server ("") while a dead draft actor is
        being replaced too. It reads the supervisor's state and answers at once."""
        if request.service not in self.SERVICES:
            if grpc_context is not None:
                grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
                grpc_context.set_details(f"unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=await self._status(request.service))

    async def List(self, request, grpc_context=None):
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=await self._status(name))
                for name in self.SERVICES  # "" too, as grpcio-health-checking lists it
            }
        )

    async def Watch(self, request, grpc_context=None):
        """The status now, then every change (checked every 0.5 s). An unknown service
        gets SERVICE_UNKNOWN and the call stays open, as the health protocol says. When
        the server shuts down, the call says NOT_SERVING and ends (an open Watch would
        otherwise hold the replica's drain for its whole time)."""
        cap = self.config.limits.health_watches
        if self.engine.watches >= cap:
            # Watch needs no token (probes send none) and holds a request slot while
            # open: unbounded, anyone who reaches the port could take every slot
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            details = (
                f"{cap} health Watch calls are open on this replica (limits.max_health_watches)"
            )
            if grpc_context is not None:
                grpc_context.set_code(code)
                grpc_context.set_details(details)
            raise RequestError(code, details)
        last = None
        with self.engine.watching():
            while True:
                draining = self.engine.draining
                if draining:
                    status = health_pb2.HealthCheckResponse.NOT_SERVING
                elif request.service in self.SERVICES:
                    status = await self._status(request.service)
                else:
                    status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                if status != last:
                    last = status
                    yield health_pb2.HealthCheckResponse(status=status)
                if draining:
                    return
                await asyncio.sleep(0.5)

    async def check_health(self) -> None:
        """Serve's replica health check. A restarting engine is not a reason to replace
        the replica (the supervisor is on it); one the supervisor gave up on is."""
        # the launcher's drain key is read from now on (deployments/drain.py): a replica
        # no request reached yet refuses its first one during a drain
        self.engine.start_watch()
        alive = getattr(self.engine, "alive", None)
        if alive is not None:
            # the supervisor's monitor (it probes the actors) starts on this loop: a
            # replica that no request or probe reached yet notices a dead rank too
            await self.engine.ahealthy()
            stats = self.engine.stats()
            # also set on every change
            self.metrics.engine(stats, self._engine_seen, draining=self.engine.draining)
            if not alive():
                raise RuntimeError(f"engine failed: {stats}")
        elif not await self.engine.ahealthy():
            raise RuntimeError("engine unhealthy")

    def __del__(self) -> None:
        """Serve calls this after draining (graceful_shutdown_timeout_s): stop the
        engine's actors now rather than when Ray notices their owner is gone. Through
        the supervisor where there is one: requests waiting for a restart then end at
        once, and its monitor stops."""
        engine = getattr(self, "engine", None)
        stop = getattr(engine, "shutdown", None)  # EngineSupervisor (through the drain)
        if stop is None:
            stop = getattr(getattr(engine, "group", None), "shutdown", None)
        if stop is not None:
            with contextlib.suppress(Exception):
                stop()
