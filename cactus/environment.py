"""Where the embedded models are, and the one place that sets the process environment
(Ray on a loopback-only machine, offline Hugging Face, DeepSpeed's accelerator;
../shared/spec/stack.md). Every entry point calls `apply()` first: `make serve`,
`cactus`, the benchmarks, the test conftest, and the modules that load models (so a Ray
worker gets it too). Importing this imports nothing."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VERIFIER = REPO / "models" / "verifier"
DEFAULT_DRAFT = REPO / "models" / "draft"

ENV = {
    "RAY_AUTH_MODE": "disabled",  # Ray 2.60's token auth breaks the serve CLI; loopback only
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # bind 127.0.0.1
    "RAY_USAGE_STATS_ENABLED": "0",
    "DS_ACCELERATOR": "cpu",  # DeepSpeed on CPU machines ("cuda" works where there is one)
    "HF_HUB_OFFLINE": "1",  # models are local folders; nothing is downloaded
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",  # no fork warnings from Ray's worker processes
}


def apply() -> None:
    """Set every variable the caller has not set itself (an operator's value wins)."""
    for key, value in ENV.items():
        os.environ.setdefault(key, value)


GRPC_MESSAGE_SIZE = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"


def grpc_message_size(limit: int) -> None:
    """Give Serve's gRPC proxies `limits.max_message_bytes` (they read it from this
    variable, inherited by a Ray head this process starts). A different value already
    exported is a ValueError naming both: on a cluster started with `ray start` the
    nodes' proxies read their own environment, so one of the two would be ignored."""
    current = os.environ.get(GRPC_MESSAGE_SIZE)
    if current is not None and current.strip() != str(limit):
        raise ValueError(
            f"limits.max_message_bytes is {limit} but {GRPC_MESSAGE_SIZE} is exported as "
            f"{current!r}: set them alike (Serve's gRPC proxies read the variable)"
        )
    os.environ[GRPC_MESSAGE_SIZE] = str(limit)
