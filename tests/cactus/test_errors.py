"""Every exception the project defines survives pickling with its fields: Ray pickles
an actor's exception to its caller (rank 0 -> replica -> Serve's proxy), and one that
cannot be unpickled reaches the caller as Ray's stand-in, which the boundary answers
with INTERNAL (seen: a request above the whole KV budget, refused by rank 0, answered
INTERNAL instead of INVALID_ARGUMENT; tests/deployments/test_timeout_e2e.py has it end
to end)."""

from __future__ import annotations

import ast
import importlib
import pickle
from pathlib import Path

import grpc
import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("cactus", "client", "configs", "deployments", "kernels", "workers")


def _instances() -> dict[str, BaseException]:
    from cactus import errors
    from configs.schema import ConfigError
    from deployments.ingress import RequestError
    from deployments.openai_api import OpenAIError
    from workers.batch_runner import CapacityError
    from workers.draft_service import _RowFailure
    from workers.engine_loop import EngineLoopStopped

    made = [
        errors.CactusError("x"),
        errors.InvalidRequestError("max_tokens", "must be >= 1, got 0"),
        errors.RequestCancelledError("cancelled"),
        errors.StaleBlockError("epoch 3, expected 4"),
        errors.DraftRetryError("r1: the batched draft forward failed"),
        errors.WorkerUnavailableError("draft actor: UNAVAILABLE"),
        errors.EngineFailedError("rank 1 died"),
        errors.EngineStartError("the draft actor did not load within ..."),
        errors.ServerShuttingDownError("the server is shutting down"),
        errors.RequestAttemptsExhaustedError("request r: the engine failed 4 times"),
        errors.ModelOutputError("the verifier's logits for this request were not finite"),
        EngineLoopStopped("shut down"),
        _RowFailure(grpc.StatusCode.FAILED_PRECONDITION, "stale"),
        CapacityError("no row"),
        RequestError(grpc.StatusCode.INVALID_ARGUMENT, "top_p: must lie in (0, 1]"),
        OpenAIError(400, "max_tokens: too many", param="max_tokens", code="bad"),
        OpenAIError(500, "the engine failed 4 times", retry=False),
        ConfigError("batching.kv_budget_tokens: must be null or >= 64"),
    ]
    return {f"{type(e).__module__}.{type(e).__qualname__}": e for e in made}


def _defined_exceptions() -> set[str]:
    """Every class in the project's packages whose bases name an exception type."""
    found = set()
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            tree = ast.parse(path.read_text())
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            for node in tree.body:
                if not isinstance(node, ast.ClassDef) or not node.bases:
                    continue
                cls = getattr(importlib.import_module(module), node.name, None)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    found.add(f"{module}.{node.name}")
    return found


def test_every_project_exception_is_covered_below():
    assert _defined_exceptions() == set(_instances())


@pytest.mark.parametrize("name", sorted(_instances()))
def test_an_exception_round_trips_through_pickle_with_its_fields(name):
    err = _instances()[name]
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    assert vars(back) == vars(err)


def test_a_request_ended_by_an_engine_loop_shut_down_is_unavailable_not_a_bug():
    """Running requests of a replica torn down (scale-down, a replaced replica) end with
    EngineLoopStopped: the client is told to retry (UNAVAILABLE), and it is neither
    logged as a bug nor counted ERROR (it was a RuntimeError: INTERNAL)."""
    import grpc

    from cactus.errors import is_engine_failure, is_unavailable
    from deployments.ingress import CactusIngress
    from workers.engine_loop import EngineLoopStopped

    err = EngineLoopStopped("the engine loop was shut down")
    assert is_unavailable(err) and not is_engine_failure(err)  # no rebuild for a shutdown
    assert CactusIngress._fail(None, err, "r")[0] == grpc.StatusCode.UNAVAILABLE
    from deployments.metrics import failure_reason

    assert failure_reason(err) == "CANCELLED"  # stopped as a drain's cut stops one
