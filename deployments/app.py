"""Build the Serve application from a ServeConfig, and start Serve with the gRPC API."""

from __future__ import annotations

from ray import serve

from cactus import environment
from configs.schema import ServeConfig, to_dict
from deployments.drain import CUT_MARGIN_S
from deployments.ingress import CactusIngress, actor_resources, group_config

# A full queue over HTTP: 429 with Retry-After (Serve's default is a 503 without one),
# which OpenAI clients retry after waiting that long (openai-python honours
# Retry-After). One second: a slot frees when any running request ends, and the
# client's retries back off further on their own; gRPC stays RESOURCE_EXHAUSTED.
BACKPRESSURE_STATUS = 429
BACKPRESSURE_RETRY_AFTER_S = 1.0

GRPC_SERVICERS = [
    "protos.cactus.v1.cactus_pb2_grpc.add_CactusServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",  # grpcio-health-checking
]


def replica_bundles(config: ServeConfig) -> list[dict]:
    """Bundle 0: the replica; then the engine's (workers.group.engine_bundles): the
    draft actor, and every verifier rank in one bundle (so on one node)."""
    from workers.group import engine_bundles

    replica = actor_resources(config.resources.replica).bundle()
    return [replica, *engine_bundles(group_config(config))]


def replica_actor_options(config: ServeConfig) -> dict:
    """What the replica actor itself reserves: `resources.replica`, all of bundle 0."""
    r = config.resources.replica
    options: dict = {"num_cpus": r.num_cpus}
    if r.num_gpus:
        options["num_gpus"] = r.num_gpus
    if r.resources:
        options["resources"] = dict(r.resources)
    return options


def deployment_options(config: ServeConfig, *, own_engine: bool = True) -> dict:
    """Serve's options for the ingress deployment, from the typed config: queue bounds,
    the drain on scale-down and shutdown, the replica's placement group (when it starts
    its own engine actors) and its replica count or autoscaling."""
    from ray.serve.config import BackpressureConfig

    a, lim = config.autoscaling, config.limits
    options = {
        "name": "CactusIngress",
        "max_ongoing_requests": lim.max_ongoing_requests,
        "max_queued_requests": lim.max_queued_requests,
        # the HTTP answer past max_queued_requests (the body stays Serve's plain text)
        "backpressure_config": BackpressureConfig(
            status_code=BACKPRESSURE_STATUS, retry_after_s=BACKPRESSURE_RETRY_AFTER_S
        ),
        "ray_actor_options": replica_actor_options(config),
        "health_check_period_s": config.recovery.health_check_period_s,
        "health_check_timeout_s": 30,
        # Scale-down and shutdown: no new requests, running streams get drain_timeout_s;
        # on shutdown the replica then ends what still runs with UNAVAILABLE, and
        # Serve's kill comes CUT_MARGIN_S later (deployments/drain.py).
        "graceful_shutdown_wait_loop_s": 1.0,
        "graceful_shutdown_timeout_s": config.recovery.drain_timeout_s + CUT_MARGIN_S,
    }
    if own_engine:
        options["placement_group_bundles"] = replica_bundles(config)
        options["placement_group_strategy"] = config.resources.placement_strategy
    if a.max_replicas > a.min_replicas:
        options["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
            "metrics_interval_s": a.metrics_interval_s,
            "look_back_period_s": a.look_back_period_s,
        }
    else:
        options["num_replicas"] = a.min_replicas
    return options


def build_app(config: ServeConfig, *, engine=None):
    """The ingress deployment bound to its config (engine: inject one for shim tests)."""
    options = deployment_options(config, own_engine=engine is None)
    # gRPC methods by name, and the OpenAI HTTP routes built per replica
    # (CactusIngress.__serve_build_asgi_app__, Serve's late-bound FastAPI ingress).
    deployment = serve.deployment(serve.ingress()(CactusIngress)).options(**options)
    return (
        deployment.bind(to_dict(config), engine)
        if engine is not None
        else deployment.bind(to_dict(config))
    )


def start_serve(
    config: ServeConfig, *, http_port: int | None = None, proxy_location: str = "EveryNode"
) -> None:
    """serve.start with the public gRPC API on config.grpc_port (every interface: Ray
    Serve's gRPC proxy cannot bind one) and the HTTP API on config.http_host:http_port.

    proxy_location "HeadOnly" when several Ray nodes share one machine (tests): every
    node's proxy would otherwise bind the same gRPC port."""
    from ray.serve.config import HTTPOptions, gRPCOptions

    environment.grpc_message_size(config.limits.max_message_bytes)
    serve.start(
        proxy_location=proxy_location,
        http_options=HTTPOptions(host=config.http_host, port=http_port or config.http_port),
        grpc_options=gRPCOptions(
            port=config.grpc_port,
            grpc_servicer_functions=GRPC_SERVICERS,
            request_timeout_s=config.limits.request_timeout_s or None,
        ),
    )
