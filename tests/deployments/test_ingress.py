"""The Serve shim on its own, with a fake engine (the real end-to-end test is
test_serve_e2e.py): status mapping, scrubbed details, cancellation, defaults, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from cactus.errors import EngineFailedError, InvalidRequestError, WorkerUnavailableError
from cactus.params import GenerationRequest
from client import CactusClient
from configs.schema import from_dict, to_dict
from deployments.ingress import CactusIngress, RequestError
from tests.conftest import embedded_dirs
from workers.request import GenerationChunk, GenerationResult, SpecStats


class FakeEngine:
    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.cancelled: list[str] = []
        self.seen: list[GenerationRequest] = []

    def model_info(self):
        return {"vocab_size": 8192, "max_context": 1024, "tp_size": 1}

    async def ahealthy(self):
        return self.fail is None

    def cancel(self, request_id):
        self.cancelled.append(request_id)

    def _result(self, req):
        return GenerationResult(
            req.request_id,
            "abc",
            (1, 2, 3),
            "LENGTH",
            len(req.prompt_token_ids),
            9,
            SpecStats(
                num_drafts=1,
                num_draft_tokens=4,
                num_accepted_tokens=2,
                accepted_per_position=[1, 1, 0, 0],
            ),
        )

    async def agenerate(self, req):
        self.seen.append(req)
        if self.fail:
            raise self.fail
        return self._result(req)

    async def astream(self, req):
        self.seen.append(req)
        for i in range(3):
            if self.fail and i == 1:
                raise self.fail
            yield GenerationChunk(req.request_id, (i,), "x")
        yield GenerationChunk(req.request_id, (), "", "LENGTH", self._result(req))


class Ctx:
    def __init__(self, metadata=()):
        self.metadata, self.code, self.details = list(metadata), None, None

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


def _shim(engine, **config):
    verifier, draft = embedded_dirs()
    config = {"models": {"verifier": verifier, "draft": draft}, **config}
    return CactusIngress(to_dict(from_dict(config)), engine=engine)


async def _collect(agen):
    return [m async for m in agen]


def test_defaults_fill_unset_fields(ray_session):
    engine = FakeEngine()
    shim = _shim(
        engine,
        speculation={
            "default_rule": "sps",
            "default_delta": 0.5,
            "tas_threshold": 0.2,
            "tas_alpha": 0.05,
        },
        sampling={"default_max_tokens": 40},
    )
    # the client's defaults are "unset" too: the server's defaults apply
    reply = asyncio.run(shim.Generate(CactusClient.request("def f():"), Ctx()))
    req = engine.seen[0]
    assert reply.text == "abc" and reply.stats.num_accepted_tokens == 2
    assert req.speculation.rule == "sps" and req.speculation.delta == 0.5
    # typical acceptance's settings are the operator's (vLLM V0's engine arguments)
    assert req.speculation.tas_threshold == 0.2 and req.speculation.tas_alpha == 0.05
    assert req.sampling.max_tokens == 40 and req.sampling.temperature == 1.0
    assert req.prompt is None and len(req.prompt_token_ids) > 0 and req.request_id


def test_logit_bias_reaches_the_request_and_a_bad_one_is_invalid_argument(ray_session):
    """A GenerateRequest's logit_bias map becomes the request's sorted (id, bias) pairs;
    an id past the vocabulary or a bias past 100 is INVALID_ARGUMENT naming the field,
    before the engine sees it."""
    import grpc

    engine = FakeEngine()
    shim = _shim(engine)
    msg = CactusClient.request("def f():", logit_bias={9: -100, 3: 2.5})
    asyncio.run(shim.Generate(msg, Ctx()))
    assert engine.seen[-1].sampling.logit_bias == ((3, 2.5), (9, -100.0))
    for bias in ({8192: 1.0}, {3: 100.5}):
        ctx = Ctx()
        asyncio.run(shim.Generate(CactusClient.request("x", logit_bias=bias), ctx))
        assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in ctx.details
    assert len(engine.seen) == 1


def test_an_unset_max_tokens_fits_the_context_the_prompt_leaves(ray_session):
    """The server's default max_tokens (not the client's) shrinks to what the prompt
    leaves of the context, as vLLM's does; a max_tokens the client set that does not fit
    is still INVALID_ARGUMENT on max_tokens."""
    engine = FakeEngine()  # max_context 1024
    shim = _shim(engine, sampling={"default_max_tokens": 64})
    ids = [5] * 1000
    asyncio.run(shim.Generate(CactusClient.request(ids), Ctx()))
    assert engine.seen[-1].sampling.max_tokens == 24
    asyncio.run(shim.Generate(CactusClient.request(ids[:900]), Ctx()))
    assert engine.seen[-1].sampling.max_tokens == 64
    ctx = Ctx()
    asyncio.run(shim.Generate(CactusClient.request(ids, max_tokens=30), ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in ctx.details
    # a default above the whole context ("all the room there is") fits it too
    for default in (4096, None):  # null: the rest of the context, as vLLM's default
        roomy = _shim(engine, sampling={"default_max_tokens": default})
        asyncio.run(roomy.Generate(CactusClient.request(ids[:10]), Ctx()))
        assert engine.seen[-1].sampling.max_tokens == 1014
    # the Python client's old "0 = unset" still means unset, with a FutureWarning
    with pytest.warns(FutureWarning, match="max_tokens=0"):
        msg = CactusClient.request(ids[:10], max_tokens=0, num_speculative_tokens=0)
    assert not msg.sampling.HasField("max_tokens")
    assert not msg.speculation.HasField("num_speculative_tokens")
    # a text prompt that fills the context is refused naming the field it was sent as
    for text in ("def f(x):\n" * 300, "def f(x):\n" * 2000):
        ctx = Ctx()
        asyncio.run(shim.Generate(CactusClient.request(text), ctx))
        assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT, ctx.details
        assert ctx.details.startswith("prompt:"), ctx.details
        assert "This model's maximum context length is 1024 tokens" in ctx.details
    # a sent 0 is not "unset" (both fields are proto3 optional): serving.md's >= 1
    for field in ("max_tokens", "num_speculative_tokens"):
        msg = CactusClient.request(ids[:10])
        part = msg.sampling if field == "max_tokens" else msg.speculation
        setattr(part, field, 0)
        assert part.HasField(field)
        ctx = Ctx()
        asyncio.run(shim.Generate(msg, ctx))
        assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details.startswith(field)


def test_an_unset_max_tokens_fits_the_kv_budget_a_row_has(ray_session):
    """With batching.kv_budget_tokens below the context, the server's default
    max_tokens shrinks to what the prompt leaves of the budget too: a request that sends
    no max_tokens is not refused on that field by the engine (it was, when
    kv_budget_tokens <= default_max_tokens); a max_tokens the client set is left as sent
    (the engine refuses it naming the budget)."""
    engine = FakeEngine()  # max_context 1024
    shim = _shim(engine, sampling={"default_max_tokens": 64}, batching={"kv_budget_tokens": 64})
    asyncio.run(shim.Generate(CactusClient.request([5] * 10), Ctx()))
    assert engine.seen[-1].sampling.max_tokens == 54
    asyncio.run(shim.Generate(CactusClient.request([5] * 10, max_tokens=60), Ctx()))
    assert engine.seen[-1].sampling.max_tokens == 60
    roomy = _shim(engine, sampling={"default_max_tokens": 64}, batching={"kv_budget_tokens": 4096})
    asyncio.run(roomy.Generate(CactusClient.request([5] * 1000), Ctx()))
    assert engine.seen[-1].sampling.max_tokens == 24  # the context is the tighter bound
    # a prompt that fills the budget is refused naming the prompt, not max_tokens
    seen = len(engine.seen)
    for sent in ({}, {"max_tokens": 5}):
        ctx = Ctx()
        asyncio.run(shim.Generate(CactusClient.request([5] * 70, **sent), ctx))
        assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT, ctx.details
        assert ctx.details.startswith("prompt:") and "64 KV slots" in ctx.details, ctx.details
    assert len(engine.seen) == seen


def test_the_server_request_timeout_caps_every_time_limit(ray_session):
    """limits.request_timeout_s is the ceiling of a request's time_limit_s (gRPC and
    HTTP build requests through the same LimitsConfig.time_limit); 0 leaves it alone."""
    engine = FakeEngine()
    shim = _shim(engine, limits={"request_timeout_s": 5.0})
    for own, want in ((0.0, 5.0), (2.0, 2.0), (30.0, 5.0)):
        msg = CactusClient.request("def f():")
        msg.time_limit_s = own
        asyncio.run(shim.Generate(msg, Ctx()))
        assert engine.seen[-1].time_limit_s == want, (own, engine.seen[-1].time_limit_s)
    unlimited = _shim(engine)
    msg = CactusClient.request("def f():")
    asyncio.run(unlimited.Generate(msg, Ctx()))
    assert engine.seen[-1].time_limit_s is None
    msg.time_limit_s = 7.0
    asyncio.run(unlimited.Generate(msg, Ctx()))
    assert engine.seen[-1].time_limit_s == 7.0
    # a limit no clock reaches is refused by name under a ceiling too, not capped to it
    for bad in (math.inf, math.nan, -1.0):
        for server in (shim, unlimited):
            msg.time_limit_s, ctx, seen = bad, Ctx(), len(engine.seen)
            asyncio.run(server.Generate(msg, ctx))
            assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT, (bad, ctx.code)
            assert "time_limit_s" in ctx.details and len(engine.seen) == seen


def test_an_empty_rule_is_the_servers_default_on_both_apis(ray_session):
    """proto3 cannot tell rule "" from unset, so gRPC takes the server's default; the HTTP
    API does the same for "" rather than answering 400 "unknown rule ''" (its half is in
    test_openai_api.py)."""
    engine = FakeEngine()
    shim = _shim(engine, speculation={"default_rule": "sps"})
    msg = CactusClient.request("def f():")
    msg.speculation.rule = ""
    asyncio.run(shim.Generate(msg, Ctx()))
    assert engine.seen[-1].speculation.rule == "sps"


def test_a_stream_refused_before_it_runs_cancels_nothing(ray_session):
    """A refusal (the supervisor's "request_id already running") ends the refused
    stream only: a cancel by its id would stop the running request that holds it."""
    from cactus.errors import InvalidRequestError

    class Refusing(FakeEngine):
        async def astream(self, req):
            self.seen.append(req)
            raise InvalidRequestError("request_id", f"{req.request_id!r} is already running")
            yield  # an async generator

    engine = Refusing()
    shim, ctx = _shim(engine), Ctx()
    with pytest.raises(Exception, match="already running"):
        asyncio.run(_collect(shim.GenerateStream(CactusClient.request("def f():"), ctx)))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and engine.cancelled == []


def test_engine_failures_map_to_status_without_internals(ray_session):
    for err, code in (
        (RuntimeError("Traceback (most recent call last): secret"), grpc.StatusCode.INTERNAL),
        (WorkerUnavailableError("rank 1 gone"), grpc.StatusCode.UNAVAILABLE),
        # A broken TP group as gloo words it, and the engine's own word for it.
        (RuntimeError("[gloo] rank 1: Connection closed by peer"), grpc.StatusCode.UNAVAILABLE),
        (EngineFailedError("rank 1 gone"), grpc.StatusCode.UNAVAILABLE),
    ):
        shim = _shim(FakeEngine(fail=err))
        ctx = Ctx()
        asyncio.run(shim.Generate(CactusClient.request("x", request_id="r1"), ctx))
        assert ctx.code == code and "secret" not in ctx.details and "rank 1" not in ctx.details
        ctx = Ctx()
        with pytest.raises(Exception):  # noqa: B017 - a stream must raise to send its status
            asyncio.run(_collect(shim.GenerateStream(CactusClient.request("x"), ctx)))
        assert ctx.code == code and "Traceback" not in ctx.details


def test_stream_closed_early_cancels_the_engine_request(ray_session):
    engine = FakeEngine()
    shim = _shim(engine)

    async def first_only():
        agen = shim.GenerateStream(CactusClient.request("x", request_id="gone"), Ctx())
        await agen.__anext__()
        await agen.aclose()  # what Serve does when the client disconnects

    asyncio.run(first_only())
    assert engine.cancelled == ["gone"]
    done = asyncio.run(_collect(shim.GenerateStream(CactusClient.request("x"), Ctx())))
    assert done[-1].finish_reason == "LENGTH" and engine.cancelled == ["gone"]


def test_auth_and_health(ray_session):
    shim = _shim(FakeEngine(), auth={"token": "t0k"})
    for header in (None, "Bearer nope", "t0k", "Basic t0k", "Bearer t0k0", "Bearer T0K"):
        ctx = Ctx((("authorization", header),) if header is not None else ())
        asyncio.run(shim.Generate(CactusClient.request("x"), ctx))
        assert ctx.code == grpc.StatusCode.UNAUTHENTICATED, header
    # the scheme is case-insensitive (RFC 7235), the token is not
    for header in ("Bearer t0k", "bearer t0k", "BEARER  t0k "):
        ctx = Ctx((("authorization", header),))
        assert asyncio.run(shim.Generate(CactusClient.request("x"), ctx)).text == "abc"
        assert ctx.code is None, header
    assert asyncio.run(shim.Check(health_pb2.HealthCheckRequest(), ctx)).status == 1  # SERVING
    # the health service stays open to probes that send no token (load balancers,
    # Kubernetes gRPC probes), while the Cactus RPCs above need one
    assert asyncio.run(shim.Check(health_pb2.HealthCheckRequest(), Ctx())).status == 1
    sick = _shim(FakeEngine(fail=RuntimeError("down")))
    assert (
        asyncio.run(sick.Check(health_pb2.HealthCheckRequest(), Ctx())).status == 2
    )  # NOT_SERVING


def test_watch_sends_the_status_and_service_unknown_for_an_unknown_service(ray_session):
    async def first(shim, service):
        watch = shim.Watch(health_pb2.HealthCheckRequest(service=service), Ctx())
        try:
            return (await anext(watch)).status
        finally:
            await watch.aclose()

    status = health_pb2.HealthCheckResponse
    assert asyncio.run(first(_shim(FakeEngine()), "cactus.v1.Cactus")) == status.SERVING
    sick = _shim(FakeEngine(fail=RuntimeError("down")))
    assert asyncio.run(first(sick, "")) == status.NOT_SERVING
    assert asyncio.run(first(_shim(FakeEngine()), "no.such.Service")) == status.SERVICE_UNKNOWN


def test_health_list_gives_every_service_the_server_included(ray_session):
    """List answers as Check does for each service, the server ("") among them, as
    grpcio-health-checking's servicer lists it: it is the one status that reflects the
    draft actor (it was left out)."""

    class NoDraft(FakeEngine):
        def speculating(self):
            return False

    status = health_pb2.HealthCheckResponse
    for engine, server in ((FakeEngine(), status.SERVING), (NoDraft(), status.NOT_SERVING)):
        reply = asyncio.run(_shim(engine).List(health_pb2.HealthListRequest(), Ctx()))
        assert {name: s.status for name, s in reply.statuses.items()} == {
            "": server,
            "cactus.v1.Cactus": status.SERVING,
            "grpc.health.v1.Health": status.SERVING,
        }


def test_open_health_watches_are_capped_per_replica(ray_session):
    """Watch needs no token (probes send none) and each open one holds a request slot:
    anyone who reached the port could open max_ongoing_requests of them and stall every
    authenticated request. Beyond limits.max_health_watches a Watch is
    RESOURCE_EXHAUSTED; one that closes frees its place. Check is not limited."""
    shim = _shim(FakeEngine(), auth={"token": "t0k"}, limits={"max_health_watches": 2})
    status = health_pb2.HealthCheckResponse

    async def run():
        request = health_pb2.HealthCheckRequest(service="")
        held = [shim.Watch(request, Ctx()) for _ in range(2)]
        assert [(await anext(w)).status for w in held] == [status.SERVING] * 2
        ctx = Ctx()
        with pytest.raises(RequestError):
            await anext(shim.Watch(request, ctx))
        assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limits.max_health_watches" in ctx.details
        assert (await shim.Check(request, Ctx())).status == status.SERVING  # not limited
        await held.pop().aclose()  # a place frees
        again = shim.Watch(request, Ctx())
        assert (await anext(again)).status == status.SERVING
        for w in (*held, again):
            await w.aclose()
        return shim.engine.watches

    assert asyncio.run(run()) == 0


def test_a_replaced_draft_actor_leaves_the_server_not_serving_and_the_service_serving(
    ray_session,
):
    """serving.md: the server ("") is SERVING only when the draft actor and every rank
    answer; the Cactus service still takes requests, degraded to plain decoding."""
    engine = FakeEngine()
    engine.speculating = lambda: engine.drafts
    shim = _shim(engine)
    status = health_pb2.HealthCheckResponse

    def check(service):
        return asyncio.run(shim.Check(health_pb2.HealthCheckRequest(service=service), Ctx()))

    for drafts, server in ((True, status.SERVING), (False, status.NOT_SERVING)):
        engine.drafts = drafts
        assert check("").status == server
        assert check("cactus.v1.Cactus").status == status.SERVING
        assert check("grpc.health.v1.Health").status == status.SERVING
        listed = asyncio.run(shim.List(health_pb2.HealthListRequest(), Ctx())).statuses
        assert {n: s.status for n, s in listed.items()} == {
            "": server,
            "cactus.v1.Cactus": status.SERVING,
            "grpc.health.v1.Health": status.SERVING,
        }
    # a restarting engine is NOT_SERVING for every name
    engine.fail, engine.drafts = RuntimeError("down"), True
    assert check("").status == check("cactus.v1.Cactus").status == status.NOT_SERVING


def test_the_replica_reserves_each_engine_actor_once():
    """Bundles come from the typed config in one place: the replica, the draft actor,
    and every verifier rank together in one bundle (so on one node)."""
    from deployments.app import replica_bundles
    from deployments.ingress import group_config
    from workers.group import engine_bundles

    config = from_dict(
        {
            "tp_size": 4,
            "resources": {
                "replica": {"num_cpus": 1},
                "draft": {"num_cpus": 2, "num_gpus": 0.5, "resources": {"draft_node": 1}},
                "verifier_rank": {"num_cpus": 2, "num_gpus": 1},
            },
        }
    )
    bundles = replica_bundles(config)
    assert bundles == [
        {"CPU": 1},
        {"CPU": 2, "draft_node": 1, "GPU": 0.5},
        {"CPU": 8, "GPU": 4},
    ]
    assert bundles[1:] == engine_bundles(group_config(config))


def test_the_replica_actor_holds_all_of_its_bundle():
    """`resources.replica` is what the replica actor itself reserves (GPUs and custom
    resources too), and exactly its bundle 0."""
    from deployments.app import deployment_options, replica_bundles

    replica = {"num_cpus": 0.5, "num_gpus": 0.25, "resources": {"ingress_node": 1}}
    config = from_dict({"resources": {"replica": replica}})
    options = deployment_options(config)
    assert options["ray_actor_options"] == replica
    assert options["placement_group_bundles"][0] == {"CPU": 0.5, "ingress_node": 1, "GPU": 0.25}
    assert options["placement_group_bundles"] == replica_bundles(config)
    plain = deployment_options(from_dict({}))["ray_actor_options"]
    assert plain == {"num_cpus": 0.25}


def test_config_keys_reach_serve_and_the_engine_group():
    """Keys whose effect no served test shows on one machine reach their consumer:
    placement strategy, drain, health checks, queue bounds and autoscaling become the deployment's
    Serve options, threads / shm all-reduce / start timeout / batching the engine's."""
    from deployments.app import deployment_options
    from deployments.drain import CUT_MARGIN_S
    from deployments.ingress import group_config, recovery_config

    config = from_dict(
        {
            "shm_allreduce": True,
            "resources": {"placement_strategy": "STRICT_SPREAD", "threads_per_actor": 3},
            "recovery": {
                "drain_timeout_s": 7.5,
                "health_check_period_s": 2.5,
                "probe_timeout_s": 4.0,
                "restart_attempts": 2,
            },
            "limits": {"start_timeout_s": 42.0, "max_queued_requests": 5},
            "autoscaling": {"min_replicas": 1, "max_replicas": 3, "downscale_delay_s": 9.0},
            "batching": {"max_num_seqs": 6, "batch_wait_ms": 1.5},
        }
    )
    options = deployment_options(config)
    assert options["placement_group_strategy"] == "STRICT_SPREAD"
    assert options["placement_group_bundles"][0] == {"CPU": config.resources.replica.num_cpus}
    assert options["graceful_shutdown_timeout_s"] == 7.5 + CUT_MARGIN_S  # deployments/drain
    assert options["health_check_period_s"] == 2.5
    assert options["max_queued_requests"] == 5
    assert options["autoscaling_config"]["max_replicas"] == 3
    assert options["autoscaling_config"]["downscale_delay_s"] == 9.0
    assert "num_replicas" not in options
    # an injected engine (the shim tests) reserves no engine bundles
    assert "placement_group_bundles" not in deployment_options(config, own_engine=False)
    fixed = from_dict({"autoscaling": {"min_replicas": 2, "max_replicas": 2}})
    assert deployment_options(fixed)["num_replicas"] == 2
    group = group_config(config)
    assert (group.threads, group.shm_allreduce, group.start_timeout_s) == (3, True, 42.0)
    recovery = recovery_config(config)  # the supervisor's share of `recovery`
    assert (recovery.probe_timeout_s, recovery.restart_attempts) == (4.0, 2)
    assert group.probe_timeout_s == 4.0  # the gang restart's reset of the draft actor
    assert recovery_config(from_dict({})) == type(recovery)()  # the same defaults
    assert (group.max_num_seqs, group.batch_wait_ms) == (6, 1.5)


def test_the_launcher_hands_an_exported_token_to_every_replica(monkeypatch):
    """`make serve` with CACTUS_AUTH_TOKEN exported: the token goes into the replica's
    config (a replica on another node does not see the launcher's environment)."""
    from configs.schema import load_config
    from deployments.serve import with_resolved_token

    monkeypatch.setenv("CACTUS_AUTH_TOKEN", "from-env")
    config = load_config("configs/default.yaml")
    assert config.auth.token is None
    replica = to_dict(with_resolved_token(config))
    monkeypatch.delenv("CACTUS_AUTH_TOKEN")  # as on another node
    assert from_dict(replica).auth.resolved_token() == "from-env"
    # no token anywhere: auth stays off; a token in the config is kept as it is
    assert with_resolved_token(config).auth.resolved_token() is None
    own = from_dict({**to_dict(config), "auth": {"token": "cfg"}})
    assert with_resolved_token(own).auth.token == "cfg"
    # auth.token_env names the variable read: that one, not CACTUS_AUTH_TOKEN
    named = from_dict({**to_dict(config), "auth": {"token_env": "MY_TEAM_TOKEN"}})
    monkeypatch.setenv("CACTUS_AUTH_TOKEN", "not-this-one")
    monkeypatch.setenv("MY_TEAM_TOKEN", "team")
    assert with_resolved_token(named).auth.token == "team"


def test_latency_bookkeeping_stays_bounded_when_clients_go_away(ray_session):
    """A request whose client left never reaches `finished`; its last-token time must
    not stay in the replica forever."""
    from deployments.metrics import LAST_TOKEN_ENTRIES, ServiceMetrics

    m = ServiceMetrics()
    req = GenerationRequest(prompt="x", request_id="r")
    for i in range(LAST_TOKEN_ENTRIES + 500):
        m.token_latency(replace(req, request_id=f"gone-{i}"), 0.0, first=True)
    assert len(m._last) == LAST_TOKEN_ENTRIES
    assert f"gone-{LAST_TOKEN_ENTRIES + 499}" in m._last and "gone-0" not in m._last


def test_requests_that_end_without_a_result_are_counted_by_outcome(ray_session):
    """Every accepted request is counted once: `cactus_request_success{finished_reason}`
    (LENGTH etc.) when it ends with a result, as vLLM's request_success, and
    `cactus_request_failure{reason}` otherwise: ERROR when it fails, CANCELLED when its
    client leaves; a request refused by validation is neither."""
    from types import SimpleNamespace

    def counted(engine, run) -> list[str]:
        shim = _shim(engine)
        seen: list[str] = []
        shim.metrics.requests = SimpleNamespace(
            inc=lambda tags: seen.append(tags["finished_reason"])
        )
        shim.metrics.failures = SimpleNamespace(
            inc=lambda tags: seen.append("failure:" + tags["reason"])
        )
        asyncio.run(run(shim))
        return seen

    async def unary(shim):
        await shim.Generate(CactusClient.request("x"), Ctx())

    async def stream(shim):
        with contextlib.suppress(Exception):
            await _collect(shim.GenerateStream(CactusClient.request("x"), Ctx()))

    async def left(shim):
        agen = shim.GenerateStream(CactusClient.request("x"), Ctx())
        await agen.__anext__()
        await agen.aclose()

    async def invalid(shim):
        await shim.Generate(CactusClient.request("x", temperature=-1.0), Ctx())

    failing = EngineFailedError("rank 1 gone")
    assert counted(FakeEngine(), unary) == ["LENGTH"]
    assert counted(FakeEngine(), stream) == ["LENGTH"]
    assert counted(FakeEngine(fail=failing), unary) == ["failure:ERROR"]
    assert counted(FakeEngine(fail=failing), stream) == ["failure:ERROR"]
    assert counted(FakeEngine(), left) == ["failure:CANCELLED"]
    assert counted(FakeEngine(), invalid) == []
    # refused by the engine (its id already running): neither, unary and streamed
    duplicate = InvalidRequestError("request_id", "'x' is already running")
    assert counted(FakeEngine(fail=duplicate), unary) == []
    assert counted(FakeEngine(fail=duplicate), stream) == []


def test_every_request_with_a_token_times_its_first_token_once(ray_session):
    """A stream's first chunk is timed as it goes out; a unary call has no chunks, so
    its time to first token is its latency less the engine's time after the first
    token (SpecStats.first_token_to_end_s). A resumed request's first token came on an
    earlier engine, so it is not timed at all."""
    from types import SimpleNamespace

    class SlowEngine(FakeEngine):
        def __init__(self, after_first_s: float, resumed: int = 0) -> None:
            super().__init__()
            self.after_first_s, self.resumed = after_first_s, resumed

        def _result(self, req):
            res = super()._result(req)
            stats = replace(res.stats, first_token_to_end_s=self.after_first_s)
            return replace(res, stats=replace(stats, resumed=self.resumed))

        async def agenerate(self, req):
            await asyncio.sleep(0.3)  # 0.1 s to the first token, 0.2 s after it
            return await super().agenerate(req)

    latencies: list[float] = []

    def observed(engine, run) -> list[float]:
        shim = _shim(engine)
        seen: list[float] = []
        shim.metrics.ttft = SimpleNamespace(observe=seen.append)
        shim.metrics.e2e = SimpleNamespace(observe=latencies.append)
        asyncio.run(run(shim))
        return seen

    async def unary(shim):
        await shim.Generate(CactusClient.request("x"), Ctx())

    async def stream(shim):
        await _collect(shim.GenerateStream(CactusClient.request("x"), Ctx()))

    (ttft,) = observed(SlowEngine(after_first_s=0.2), unary)
    assert latencies[-1] >= 0.3 and ttft == pytest.approx(latencies[-1] - 0.2), latencies
    (whole,) = observed(SlowEngine(after_first_s=0.0), unary)
    assert whole == latencies[-1] >= 0.3
    assert observed(SlowEngine(after_first_s=0.2, resumed=1), unary) == []
    assert len(observed(SlowEngine(after_first_s=0.2), stream)) == 1

    class NoTokenEngine(FakeEngine):  # its time ran out while it waited for a row
        async def astream(self, req):
            res = replace(self._result(req), text="", token_ids=(), finish_reason="TIME_LIMIT")
            yield GenerationChunk(req.request_id, (), "", result=res)

    assert observed(NoTokenEngine(), stream) == []  # no token, so no first token


def test_the_latency_buckets_reach_the_longest_request_a_shipped_config_allows():
    """A latency past the last bound is only +Inf: no percentile could be read there."""
    from configs.schema import load_config
    from deployments.metrics import LATENCY_BOUNDS_S

    configs = sorted(Path("configs").glob("*.yaml"))
    longest = max(load_config(str(path)).limits.request_timeout_s or 0 for path in configs)
    assert longest >= 600 and max(LATENCY_BOUNDS_S) >= longest, (longest, LATENCY_BOUNDS_S)
    assert sorted(LATENCY_BOUNDS_S) == LATENCY_BOUNDS_S


def test_a_result_reports_the_engine_time_after_its_first_token():
    import time

    from cactus.params import SamplingParams
    from workers.request import RequestState

    class Tok:
        def decode(self, ids, **_):
            return "".join(chr(97 + i % 26) for i in ids)

    state = RequestState(
        GenerationRequest(
            prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=3), request_id="r"
        ),
        [1, 2],
        seed=0,
        eos=None,
        tokenizer=Tok(),
        max_context=64,
        sink=lambda chunk: None,
    )
    assert state.result().stats.first_token_to_end_s == 0.0  # no token yet
    state.emit([])
    assert state.first_token_at is None
    state.emit([5])
    first = state.first_token_at
    assert first is not None
    time.sleep(0.05)
    state.emit([6, 7])
    assert state.first_token_at == first and state.finish_reason == "LENGTH"
    assert 0.05 <= state.result().stats.first_token_to_end_s < 5.0


def test_configured_temperature_and_k_fill_unset_fields(ray_session):
    """README: `sampling.default_temperature` and
    `speculation.default_num_speculative_tokens` are what a gRPC request that leaves the
    field unset gets (unary and stream); a field that is set, temperature 0 included
    (greedy), is kept."""
    engine = FakeEngine()
    shim = _shim(
        engine,
        sampling={"default_temperature": 0.3},
        speculation={"default_num_speculative_tokens": 6},
    )
    asyncio.run(shim.Generate(CactusClient.request("def f():"), Ctx()))
    req = engine.seen[-1]
    assert req.sampling.temperature == 0.3 and req.speculation.num_speculative_tokens == 6
    asyncio.run(_collect(shim.GenerateStream(CactusClient.request("def f():"), Ctx())))
    req = engine.seen[-1]
    assert req.sampling.temperature == 0.3 and req.speculation.num_speculative_tokens == 6
    msg = CactusClient.request("def f():", temperature=0.0, num_speculative_tokens=2)
    asyncio.run(shim.Generate(msg, Ctx()))
    req = engine.seen[-1]
    assert req.sampling.temperature == 0.0 and req.speculation.num_speculative_tokens == 2


def test_the_replicas_end_shuts_the_engine_down_through_its_supervisor(ray_session):
    """Serve calls __del__ after draining: through the supervisor where there is one
    (requests waiting for a restart end at once, its monitor stops), else the group."""
    from types import SimpleNamespace

    downs: list[str] = []

    class Supervised(FakeEngine):
        group = SimpleNamespace(shutdown=lambda: downs.append("group"))

        def shutdown(self) -> None:
            downs.append("supervisor")

    class Grouped(FakeEngine):
        group = SimpleNamespace(shutdown=lambda: downs.append("group"))

    _shim(Supervised()).__del__()
    assert downs[:1] == ["supervisor"]
    downs.clear()
    _shim(Grouped()).__del__()
    assert downs[:1] == ["group"]
    _shim(FakeEngine()).__del__()  # nothing to shut down: no error


def test_a_request_id_too_long_or_with_a_control_character_is_invalid_argument(ray_session):
    """A client's request_id travels in every draft message and streamed chunk of its
    request: one of megabytes (gRPC allows up to the message limit) swelled every step's
    ProposeBatch for the whole batch until the draft service refused it, turning drafting
    off for every row. It is now INVALID_ARGUMENT naming the field, before the engine."""
    from cactus.params import MAX_REQUEST_ID_CHARS

    engine = FakeEngine()
    shim = _shim(engine)
    for rid, why in (
        ("x" * (MAX_REQUEST_ID_CHARS + 1), "257"),
        ("a\nb", "non-printable character"),
    ):
        for call in ("unary", "stream"):
            msg = CactusClient.request("x", request_id=rid)
            ctx = Ctx()
            if call == "unary":
                asyncio.run(shim.Generate(msg, ctx))
            else:
                with pytest.raises(RequestError):
                    asyncio.run(_collect(shim.GenerateStream(msg, ctx)))
            assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT, (rid[:10], ctx.code)
            assert ctx.details.startswith("request_id:") and why in ctx.details, ctx.details
    assert engine.seen == []
    ok = CactusClient.request("x", request_id="y" * MAX_REQUEST_ID_CHARS)
    reply = asyncio.run(shim.Generate(ok, Ctx()))
    assert reply.text == "abc" and engine.seen[-1].request_id == "y" * MAX_REQUEST_ID_CHARS


def test_a_request_that_failed_the_engine_every_time_is_internal_not_unavailable(
    ray_session,
):
    """README (recovery.max_attempts): INTERNAL with its own message, not UNAVAILABLE,
    which both clients (and gRPC's retry policies) retry: the request may be what brings
    the engine down. Any other engine failure stays a plain, retried UNAVAILABLE."""
    from cactus.errors import RequestAttemptsExhaustedError

    why = "request r: the engine failed 4 times while running it; not retried"
    for stream in (False, True):
        ctx = Ctx()
        shim = _shim(FakeEngine(fail=RequestAttemptsExhaustedError(why)))
        msg = CactusClient.request("def f():")
        if stream:  # a streaming method raises for Serve to send the status it set
            with pytest.raises(RequestError):
                asyncio.run(_collect(shim.GenerateStream(msg, ctx)))
        else:
            asyncio.run(shim.Generate(msg, ctx))
        assert ctx.code == grpc.StatusCode.INTERNAL and ctx.details == why
    ctx = Ctx()
    asyncio.run(_shim(FakeEngine(fail=WorkerUnavailableError("down"))).Generate(msg, ctx))
    assert ctx.code == grpc.StatusCode.UNAVAILABLE
