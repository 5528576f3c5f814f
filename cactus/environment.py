"""Where the embedded models are, and the environment Ray needs on a loopback-only
machine (../shared/spec/stack.md). Plain constants: importing this imports nothing."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VERIFIER = REPO / "models" / "verifier"
DEFAULT_DRAFT = REPO / "models" / "draft"

RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",  # Ray 2.60's token auth breaks the serve CLI; loopback only
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # bind 127.0.0.1
    "DS_ACCELERATOR": "cpu",
    "RAY_USAGE_STATS_ENABLED": "0",
}
