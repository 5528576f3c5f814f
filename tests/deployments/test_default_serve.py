"""README's first command on the shipped config: `make serve` (configs/default.yaml as
shipped: TP = 2 over DeepSpeed, the goodput policy, auth off) comes up, answers over gRPC
and HTTP, and `make stop` drains it. Only the ports are the test's (PORT= and
HTTP_PORT=, which the README gives), so it runs beside anything on 9000 / 8000. The
other e2e servers run configs of their own (a token, TP = 1, a fixed policy)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from client import CactusClient
from tests.deployments.test_serve_e2e import _wait_ready, make
from workers.tp_verifier import free_port

pytestmark = pytest.mark.slow


def test_make_serve_with_the_shipped_config_serves_and_make_stop_stops_it(monkeypatch):
    import httpx2

    monkeypatch.delenv("CACTUS_AUTH_TOKEN", raising=False)  # the config's token_env
    port, http_port = free_port(), free_port()
    # its own session: a server that never gets ready is killed with its Ray head
    proc = make("serve", f"PORT={port}", f"HTTP_PORT={http_port}", start_new_session=True)
    try:
        try:
            ready = _wait_ready(proc, timeout_s=300)
        except RuntimeError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        assert f"127.0.0.1:{port}" in ready, ready
        # the shipped config has no token, and says so (printed just after READY)
        deadline = time.monotonic() + 30
        while not any("auth is off" in line for line in proc.output):
            assert time.monotonic() < deadline, "".join(proc.output[-20:])
            time.sleep(0.2)
        client = CactusClient(f"127.0.0.1:{port}", timeout=120)
        try:
            assert client.health() == "SERVING"
            reply = client.generate("def add(a, b):", max_tokens=12, temperature=0.0)
            # the shipped defaults: cactus, delta 1, K = 4 under the goodput policy
            assert len(reply.token_ids) == 12 and reply.finish_reason == "LENGTH"
            assert reply.stats.num_drafts >= 1, reply.stats
            streamed = list(client.stream("def add(a, b):", max_tokens=12, temperature=0.0))
            assert "".join(c.text for c in streamed) == reply.text
        finally:
            client.close()
        with httpx2.Client(timeout=120) as http:
            models = http.get(f"http://127.0.0.1:{http_port}/v1/models").json()
            body = {"model": models["data"][0]["id"], "prompt": "def add(a, b):"}
            body |= {"max_tokens": 12, "temperature": 0.0}
            got = http.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body).json()
        assert got["choices"][0]["text"] == reply.text, got
    finally:
        if proc.poll() is None:
            stop = make("stop", f"PORT={port}")
            said, _ = stop.communicate(timeout=180)
            assert stop.returncode == 0, said
            assert f"stopped the server on port {port}" in said, said
        assert proc.wait(timeout=120) == 0, "".join(proc.output[-40:])
