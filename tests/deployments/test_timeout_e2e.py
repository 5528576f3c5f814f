"""limits.request_timeout_s end to end: a server started as `make serve` starts it, with
a 3 s limit, and requests that would run far longer (400 greedy tokens with no EOS from
this prompt, about 10 s of plain decoding on 2 cores).

Over gRPC the call ends with DEADLINE_EXCEEDED and the engine stops the request; over
HTTP the request ends as `time_limit_s` ends one: its tokens so far, finish_reason
"length", a stream closed by its last chunk and `data: [DONE]`. The figure each test
leans on: fewer than MAX_TOKENS tokens in the limit means under MAX_TOKENS / 3 s =
133 tok/s of served plain decoding; this machine does about 40 (22.5 s for 900 tokens,
measured 2026-12-04), and the engine's in-process greedy check in
test_chat_e2e asserts this prompt runs MAX_TOKENS tokens without an EOS.
"""

from __future__ import annotations

import json
import re
import time

import grpc
import pytest

from client import NO_RETRY
from tests.deployments.test_serve_e2e import Server, serving
from workers.tp_verifier import free_port

pytestmark = pytest.mark.slow
LIMIT_S = 3.0
MAX_TOKENS = 400
KW = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "rule": "none"}


@pytest.fixture(scope="module")
def timeout_server(tmp_path_factory):
    from tests.conftest import embedded_dirs

    verifier, draft = embedded_dirs()
    port, http_port = free_port(), free_port()
    config = {
        "models": {"verifier": verifier, "draft": draft},
        "tp_size": 1,
        "grpc_port": port,
        "http_port": http_port,
        "limits": {"request_timeout_s": LIMIT_S},
    }
    with serving(config, tmp_path_factory.mktemp("timeout")) as (proc, ready):
        ray_address = re.search(r"ray (\S+)\)", ready).group(1)
        yield Server(proc, f"127.0.0.1:{port}", ray_address, http_port)


def _caches_freed(server, within_s: float = 30.0) -> dict:
    deadline = time.monotonic() + within_s
    while True:
        counts = server.cache_counts()
        if counts and all(v == 0 for engine in counts.values() for v in engine.values()):
            return counts
        assert time.monotonic() < deadline, f"rows still held: {counts}"
        time.sleep(1)


def test_a_grpc_call_past_the_server_limit_is_deadline_exceeded_and_stops(
    timeout_server, heldout_prompts
):
    """Unary and streamed: DEADLINE_EXCEEDED at the limit although the client's own
    deadline (120 s) and time_limit_s (600 s) are far off; the engine ran fewer decode
    steps than the request needed and holds no rows afterwards."""
    client = timeout_server.client(token=None, retry=NO_RETRY)
    prompt = heldout_prompts[9]
    for streamed in (False, True):
        before = timeout_server.decode_steps()
        started = time.monotonic()
        chunks = 0
        with pytest.raises(grpc.RpcError) as err:
            if streamed:
                for _chunk in client.stream(prompt, time_limit_s=600.0, **KW):
                    chunks += 1
            else:
                client.generate(prompt, time_limit_s=600.0, **KW)
        took = time.monotonic() - started
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
        assert LIMIT_S - 0.5 < took < LIMIT_S + 10.0, took
        assert not streamed or chunks > 0, "the stream sent nothing before its limit"
        _caches_freed(timeout_server)
        steps = timeout_server.decode_steps() - before
        assert steps < MAX_TOKENS, f"{steps} steps: the request ran on past the limit"


def test_an_http_request_past_the_server_limit_ends_with_length(timeout_server, heldout_prompts):
    """Unary: 200, finish_reason "length", fewer tokens than max_tokens. Streamed: the
    last choice chunk says "length", the usage chunk and `data: [DONE]` follow. A
    request's own shorter time_limit_s still wins."""
    import httpx2

    url = timeout_server.base_url + "/completions"
    body = {"model": "verifier", "prompt": heldout_prompts[9], **KW}
    with httpx2.Client(timeout=120) as http:
        started = time.monotonic()
        reply = http.post(url, json=body)
        took = time.monotonic() - started
        assert reply.status_code == 200, reply.text
        unary = reply.json()
        assert unary["choices"][0]["finish_reason"] == "length", unary
        assert 0 < unary["usage"]["completion_tokens"] < MAX_TOKENS, unary["usage"]
        assert LIMIT_S - 0.5 < took < LIMIT_S + 10.0, took

        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", url, json=stream_body) as streamed:
            assert streamed.status_code == 200
            lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
        assert not any("error" in e for e in events), events[-2:]
        reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert reasons == ["length"], reasons
        assert 0 < events[-1]["usage"]["completion_tokens"] < MAX_TOKENS, events[-1]

        started = time.monotonic()
        short = http.post(url, json={**body, "time_limit_s": 0.5}).json()
        assert short["choices"][0]["finish_reason"] == "length", short
        assert time.monotonic() - started < LIMIT_S, "the request's own limit did not win"
    _caches_freed(timeout_server)
