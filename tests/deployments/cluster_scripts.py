"""Scenarios that need a Ray cluster of their own, run as subprocesses by the tests
(the test session's own local Ray stays untouched). Each prints one JSON line."""

from __future__ import annotations

import json
import sys
import threading
import time

from cactus import environment

environment.apply()

import ray  # noqa: E402
from ray import serve  # noqa: E402

from client import CactusClient  # noqa: E402
from configs.schema import from_dict  # noqa: E402
from deployments.app import build_app, start_serve  # noqa: E402
from workers.group import NAMESPACE  # noqa: E402
from workers.tp_verifier import free_port  # noqa: E402


def _engine_actor_nodes() -> dict:
    nodes: dict = {"draft": [], "ranks": []}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != NAMESPACE:
            continue
        actor = ray.get_actor(entry["name"], namespace=NAMESPACE)
        if entry["name"].endswith("-draft"):
            nodes["draft"].append(ray.get(actor.status.remote())["node_id"])
        else:
            nodes["ranks"].append(ray.get(actor.node_id.remote()))
    return nodes


def multinode(verifier: str, draft: str, prompt: str) -> dict:
    """Two raylets: the draft actor must land on the `draft_node` one, the verifier
    ranks on the `verifier_node` one."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"draft_node": 2}}
    )
    cluster.add_node(num_cpus=2, resources={"verifier_node": 4})
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    config = from_dict(
        {
            "models": {"verifier": verifier, "draft": draft},
            "tp_size": 2,
            "grpc_port": port,
            "http_port": free_port(),
            "resources": {
                "draft": {"num_cpus": 0.25, "resources": {"draft_node": 1}},
                "verifier_rank": {"num_cpus": 0.25, "resources": {"verifier_node": 1}},
                "replica": {"num_cpus": 0.25},
            },
        }
    )
    try:
        start_serve(config, proxy_location="HeadOnly")
        serve.run(build_app(config), name=config.app_name, route_prefix="/")
        reply = CactusClient(f"127.0.0.1:{port}", timeout=120).generate(
            prompt, max_tokens=24, temperature=0.0
        )
        by_resource = {}
        for node in ray.nodes():
            for res in ("draft_node", "verifier_node"):
                if node["Alive"] and res in node["Resources"]:
                    by_resource[res] = node["NodeID"]
        drafts = [
            ray.get_actor(e["name"], namespace=NAMESPACE)
            for e in ray.util.list_named_actors(all_namespaces=True)
            if e["namespace"] == NAMESPACE and e["name"].endswith("-draft")
        ]
        return {
            "placement": _engine_actor_nodes(),
            "nodes": by_resource,
            "token_ids": list(reply.token_ids),
            "num_drafts": reply.stats.num_drafts,
            "draft_failures": reply.stats.draft_failures,
            "draft_address": ray.get(drafts[0].serve.remote()),
            "node_ips": {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()},
        }
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _replicas(app: str) -> int:
    status = serve.status().applications[app].deployments["CactusIngress"]
    return status.replica_states.get("RUNNING", 0)


def autoscale(verifier: str, draft: str) -> dict:
    """min 1 / max 2 replicas, short delays: up under concurrent streams, down after."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    config = from_dict(
        {
            "models": {"verifier": verifier, "draft": draft},
            "tp_size": 1,
            "grpc_port": port,
            "http_port": free_port(),
            "limits": {"max_ongoing_requests": 4, "max_queued_requests": 16},
            "autoscaling": {
                "min_replicas": 1,
                "max_replicas": 2,
                "target_ongoing_requests": 1,
                "upscale_delay_s": 1,
                "downscale_delay_s": 3,
                "metrics_interval_s": 0.5,
                "look_back_period_s": 2,
            },
        }
    )
    seen = {"start": 0, "peak": 0, "end": 0}
    try:
        start_serve(config)
        serve.run(build_app(config), name=config.app_name, route_prefix="/")
        seen["start"] = _replicas(config.app_name)
        done = threading.Event()
        codes = []

        def stream(i):
            try:
                client = CactusClient(f"127.0.0.1:{port}", timeout=300)
                while not done.is_set():
                    for _ in client.stream("def f(x):", max_tokens=64, seed=i, temperature=1.0):
                        pass
                codes.append("OK")
            except Exception as err:
                codes.append(repr(err)[:200])

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and seen["peak"] < 2:
            seen["peak"] = max(seen["peak"], _replicas(config.app_name))
            time.sleep(1)
        done.set()
        for t in threads:
            t.join(timeout=300)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            seen["end"] = _replicas(config.app_name)
            if seen["end"] == 1:
                break
            time.sleep(1)
        seen["stream_results"] = codes
        return seen
    finally:
        serve.shutdown()
        ray.shutdown()


def _free(resource: str) -> float:
    return round(ray.available_resources().get(resource, 0.0), 6)


def exact(verifier: str, draft: str) -> dict:
    """A node that declares exactly one replica's resources (TP = 2, one GPU per rank,
    models on CPU) starts and serves it; a second such node serves a second replica.
    Nothing is left over either time: every bundle is reserved once."""
    from ray.cluster_utils import Cluster

    from deployments.app import replica_bundles

    port = free_port()
    raw = {
        "models": {"verifier": verifier, "draft": draft},
        "tp_size": 2,
        "grpc_port": port,
        "http_port": free_port(),
        # two streams a replica: the four drain streams below fill both replicas, so
        # the one that goes away has two running
        "limits": {"max_ongoing_requests": 2},
        "resources": {
            "replica": {"num_cpus": 0.25},
            "draft": {"num_cpus": 0.25},
            "verifier_rank": {"num_cpus": 0.25, "num_gpus": 1},
        },
    }
    config = from_dict(raw)
    need: dict[str, float] = {}
    for bundle in replica_bundles(config):
        for key, value in bundle.items():
            need[key] = need.get(key, 0.0) + value
    node = {"num_cpus": int(need["CPU"]), "num_gpus": int(need["GPU"])}
    cluster = Cluster(initialize_head=True, head_node_args=node)
    ray.init(address=cluster.address, log_to_driver=False)
    out: dict = {"need": need}
    try:
        start_serve(config, proxy_location="HeadOnly")
        # Two replicas asked for on one such node: the one that fits starts, the other
        # waits for resources (placement), and takes the second node once it joins. (A
        # second serve.run to scale would replace both replicas: an imperative deploy
        # gets a new version every time.)
        two = from_dict({**raw, "autoscaling": {"min_replicas": 2, "max_replicas": 2}})
        serve._run(build_app(two), name=config.app_name, route_prefix="/", _blocking=False)
        deadline = time.monotonic() + 240
        while _replicas(config.app_name) < 1 and time.monotonic() < deadline:
            app = serve.status().applications.get(config.app_name)
            if app is not None and app.status == "DEPLOY_FAILED":
                raise RuntimeError(f"the application failed to deploy: {app.message}")
            time.sleep(0.5)
        if _replicas(config.app_name) < 1:
            raise RuntimeError(f"no replica started in 240 s: {serve.status()}")
        client = CactusClient(f"127.0.0.1:{port}", timeout=120)
        out["one"] = {
            "replicas": _replicas(config.app_name),
            "tokens": len(client.generate("def f(x):", max_tokens=8, temperature=0.0).token_ids),
            "free_cpu": _free("CPU"),
            "free_gpu": _free("GPU"),
        }
        cluster.add_node(**node)
        deadline = time.monotonic() + 300
        while _replicas(config.app_name) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        out["two"] = {
            "replicas": _replicas(config.app_name),
            "streams": [
                len(client.generate("class A:", max_tokens=8, seed=i).token_ids) for i in range(4)
            ],
            "free_cpu": _free("CPU"),
            "free_gpu": _free("GPU"),
        }
        # Scale-down drains: streams running on the replicas that go away finish (an
        # imperative deploy has a new version, so both old replicas drain and one new
        # replica starts).
        # Greedy, so each runs its whole 160 tokens (this prompt's greedy continuation
        # has no EOS before that) and none can end early, before the scale-down starts.
        results: list = []
        chunks_of: list[list] = [[] for _ in range(4)]

        def stream(i: int) -> None:
            chunks = chunks_of[i]
            try:
                for chunk in CactusClient(f"127.0.0.1:{port}", timeout=300).stream(
                    "def walk(tree):", max_tokens=160, temperature=0.0
                ):
                    chunks.append(chunk)
                streamed = sum(len(c.token_ids) for c in chunks)
                final = chunks[-1]
                whole = streamed == final.usage.completion_tokens
                results.append(final.finish_reason if whole else f"gap: {streamed}")
            except Exception as err:
                results.append(repr(err)[:200])

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        # scale down once every stream has tokens (so all four are running on one
        # replica or the other), not after a fixed time that a fast run outlasts
        deadline = time.monotonic() + 120
        while not all(chunks_of) and time.monotonic() < deadline:
            time.sleep(0.05)
        # (chunks received, finished) of each stream as the scale-down starts: a drain
        # is only shown if streams were still running then
        at_scale_down = [(len(c), any(chunk.finish_reason for chunk in c)) for c in chunks_of]
        serve.run(build_app(config), name=config.app_name, route_prefix="/")  # 1 replica
        for t in threads:
            t.join(timeout=300)
        out["drain"] = {
            "streams": results,
            "replicas": _replicas(config.app_name),
            "at_scale_down": at_scale_down,
        }
        return out
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    scenario, *args = sys.argv[1:]
    result = {"multinode": multinode, "autoscale": autoscale, "exact": exact}[scenario](*args)
    print("RESULT " + json.dumps(result), flush=True)
