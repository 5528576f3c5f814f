"""limits.request_timeout_s end to end: a server started as `make serve` starts it, with
a 3 s limit, and requests that would run far longer (400 greedy tokens with no EOS from
this prompt, about 10 s of plain decoding on 2 cores).

Over gRPC the call ends with DEADLINE_EXCEEDED and the engine stops the request; over
HTTP the request ends as `time_limit_s` ends one: its tokens so far, finish_reason
"length", a stream closed by its last chunk and `data: [DONE]`. The figure each test
leans on: fewer than MAX_TOKENS tokens in the limit means under MAX_TOKENS / 3 s =
133 tok/s of served plain decoding; this machine does about 40 (22.5 s for 900 tokens
over HTTP, measured by hand on 2026-12-04 on a2dfb06, the code before the HTTP limit),
and the engine's in-process greedy check in test_chat_e2e asserts this prompt runs
MAX_TOKENS tokens without an EOS.

The token comes from CACTUS_AUTH_TOKEN exported to `make serve` (README: an exported
token protects every replica; the config names none), so this server also checks that.
It also starts beside a stale Ray cluster record (RAY_TMPDIR names a folder whose
ray/ray_current_cluster points at a port nobody listens on, RAY_ADDRESS is unset): the
launcher warns and starts its own head instead of dialling the dead GCS.
"""

from __future__ import annotations

import json
import re
import time

import grpc
import pytest

from client import NO_RETRY
from tests.cactus.test_ray_isolation import stale_ray_record
from tests.deployments.test_serve_e2e import Server, _assert_caches_freed, serving
from workers.tp_verifier import free_port

pytestmark = pytest.mark.slow
LIMIT_S = 3.0
MAX_TOKENS = 400
TOKEN = "exported-token-42"
KW = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "rule": "none"}
KV_BUDGET = 768
DEFAULT_DELTA = 0.25
DEFAULT_MAX_TOKENS = 7
MAX_NUM_SEQS = 2


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
        # below the model's 1,024-token context, so one request can be too large for
        # the KV budget while the replica's own checks pass it (the last test)
        # two rows: the batching test's requests wait for one
        "batching": {"kv_budget_tokens": KV_BUDGET, "max_num_seqs": MAX_NUM_SEQS},
        # what a request leaves unset (the defaults test); fixed: the batching test's
        # seeded equalities need a k schedule that does not depend on timings
        "speculation": {
            "default_rule": "cactus",
            "default_delta": DEFAULT_DELTA,
            "policy": "fixed",
        },
        "sampling": {"default_max_tokens": DEFAULT_MAX_TOKENS},
    }
    folder = tmp_path_factory.mktemp("timeout")
    with stale_ray_record() as (stale, dead):
        env = {"CACTUS_AUTH_TOKEN": TOKEN, "RAY_ADDRESS": "", "RAY_TMPDIR": stale}
        with serving(config, folder, env=env) as (proc, ready):
            ray_address = re.search(r"ray (\S+)\)", ready).group(1)
            assert ray_address != dead
            assert any(dead in line and "does not answer" in line for line in proc.output)
            srv = Server(proc, f"127.0.0.1:{port}", ray_address, http_port)
            try:
                yield srv
            finally:
                srv.probe.close()


def test_a_grpc_call_past_the_server_limit_is_deadline_exceeded_and_stops(
    timeout_server, heldout_prompts
):
    """Unary and streamed: DEADLINE_EXCEEDED at the limit although the client's own
    deadline (120 s) and time_limit_s (600 s) are far off; the engine ran fewer decode
    steps than the request needed and holds no rows afterwards."""
    client = timeout_server.client(token=TOKEN, retry=NO_RETRY)
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
        _assert_caches_freed(timeout_server, within_s=30.0)
        steps = timeout_server.decode_steps() - before
        assert steps < MAX_TOKENS, f"{steps} steps: the request ran on past the limit"


def test_a_grpc_time_limit_ends_the_request_with_time_limit(timeout_server, heldout_prompts):
    """README / serving.md: a request's own `time_limit_s` (below the server's limit)
    ends it with its tokens so far and finish_reason TIME_LIMIT, unary and streamed,
    through Serve's real gRPC proxy; its rows are freed."""
    client = timeout_server.client(token=TOKEN, retry=NO_RETRY)
    prompt = heldout_prompts[9]
    started = time.monotonic()
    unary = client.generate(prompt, time_limit_s=0.5, timeout=60, **KW)
    assert time.monotonic() - started < LIMIT_S, "the server's limit ended it, not its own"
    assert unary.finish_reason == "TIME_LIMIT", unary.finish_reason
    assert 0 < len(unary.token_ids) < MAX_TOKENS, len(unary.token_ids)
    chunks = list(client.stream(prompt, time_limit_s=0.5, timeout=60, **KW))
    assert chunks[-1].finish_reason == "TIME_LIMIT", chunks[-1]
    streamed = sum(len(c.token_ids) for c in chunks)
    assert 0 < streamed < MAX_TOKENS, streamed
    _assert_caches_freed(timeout_server, within_s=30.0)


def test_an_http_request_past_the_server_limit_ends_with_length(timeout_server, heldout_prompts):
    """Unary: 200, finish_reason "length", fewer tokens than max_tokens. Streamed: the
    last choice chunk says "length", the usage chunk and `data: [DONE]` follow. A
    request's own shorter time_limit_s still wins."""
    import httpx2

    url = timeout_server.base_url + "/completions"
    body = {"model": "verifier", "prompt": heldout_prompts[9], **KW}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx2.Client(timeout=120, headers=auth) as http:
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
    _assert_caches_freed(timeout_server, within_s=30.0)


def test_the_exported_token_guards_both_apis(timeout_server):
    """No token or a wrong one: UNAUTHENTICATED over gRPC, 401 over HTTP; the right
    one is served (the tests above)."""
    import httpx2

    for token in (None, "wrong"):
        with pytest.raises(grpc.RpcError) as err:
            timeout_server.client(token=token, retry=NO_RETRY).generate("x", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
    reply = httpx2.post(
        timeout_server.base_url + "/completions",
        json={"model": "verifier", "prompt": "x", "max_tokens": 2},
        headers={"Authorization": "Bearer wrong"},
        timeout=60,
    )
    assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
    assert timeout_server.client(token=TOKEN).health() == "SERVING"


def test_http_errors_through_serves_proxy_are_openai_shaped(timeout_server):
    """The routes' statuses as a client meets them behind Serve's HTTP proxy (the
    unit tests drive the app directly): the model by name, an unknown one, an unknown
    route, a wrong method, a field this server does not take, a null field."""
    import httpx2

    base = timeout_server.base_url
    with httpx2.Client(timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        assert http.get(f"{base}/models/verifier").json()["id"] == "verifier"
        for method, path, body, status, param in (
            ("GET", "/models/nope", None, 404, "model"),
            ("GET", "/nowhere", None, 404, None),
            ("GET", "/completions", None, 405, None),
            ("POST", "/completions", {"prompt": "x", "tools": [{"type": "x"}]}, 400, "tools"),
        ):
            reply = http.request(method, base + path, json=body)
            assert reply.status_code == status, (path, reply.text)
            error = reply.json()["error"]
            assert error["message"] and (param is None or error["param"] == param), error
        body = {"model": "verifier", "prompt": "x", "max_tokens": 2, "response_format": None}
        assert http.post(f"{base}/completions", json=body | {"rule": None}).status_code == 200
    # Without the token: 401 on every route the app serves, unknown ones included; only
    # Serve's own /-/healthz and /-/routes, which its proxy answers itself (README).
    root = base.removesuffix("/v1")
    with httpx2.Client(timeout=60) as http:
        for method, path in (("GET", "/models"), ("GET", "/nowhere"), ("POST", "/completions")):
            reply = http.request(method, base + path, json={"prompt": "x"})
            assert reply.status_code == 401, (path, reply.text)
        assert http.get(f"{root}/-/healthz").status_code == 200
        assert http.get(f"{root}/-/routes").status_code == 200


def test_a_request_above_the_whole_kv_budget_is_invalid_argument_on_both_apis(timeout_server):
    """README: a request above the whole KV budget is refused at once, INVALID_ARGUMENT
    on max_tokens naming the budget. Rank 0 decides it (only it knows the budget), so
    its InvalidRequestError crosses Ray to the replica: it must arrive as itself, not as
    Ray's stand-in for an exception it could not unpickle (which answered INTERNAL).
    Then the server serves a request that fits."""
    import httpx2

    too_many = KV_BUDGET + 100  # with a one-token prompt: inside the context, above the budget
    with pytest.raises(grpc.RpcError) as err:
        timeout_server.client(token=TOKEN, retry=NO_RETRY).generate(
            "x", max_tokens=too_many, rule="none"
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    details = err.value.details()
    assert details.startswith("max_tokens:") and "batching.kv_budget_tokens" in details, details
    reply = httpx2.post(
        timeout_server.base_url + "/completions",
        json={"model": "verifier", "prompt": "x", "max_tokens": too_many},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "max_tokens" and "kv_budget_tokens" in error["message"], error
    # the code OpenAI clients match to trim a conversation crosses Ray with the error
    assert error["code"] == "context_length_exceeded", error
    with httpx2.Client(timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        # a prompt the model's context cannot hold, as OpenAI and vLLM word it
        reply = http.post(
            timeout_server.base_url + "/completions",
            json={"model": "verifier", "prompt": "def f(x): " * 800, "max_tokens": 2},
        )
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded"), error
        assert "This model's maximum context length is 1024 tokens" in error["message"]
        # a body over limits.max_message_bytes (4 MiB): 413 naming `body` through Serve's
        # own HTTP proxy, declared (Content-Length) or streamed (chunked)
        big = json.dumps({"model": "verifier", "prompt": "x" * (4 * 2**20)}).encode()

        def chunked():
            for i in range(0, len(big), 2**16):
                yield big[i : i + 2**16]

        for content in (big, chunked()):
            reply = http.post(
                timeout_server.base_url + "/completions",
                content=content,
                headers={"content-type": "application/json"},
            )
            assert reply.status_code == 413, reply.text[:500]
            error = reply.json()["error"]
            assert error["param"] == "body" and "4194304" in error["message"], error
    served = timeout_server.client(token=TOKEN).generate("x", max_tokens=4, rule="none")
    assert len(served.token_ids) == 4


def test_fields_a_request_leaves_unset_take_the_configs_defaults_on_both_apis(
    timeout_server, heldout_prompts
):
    """README (config table): `speculation.default_rule`, `default_delta` and
    `sampling.default_max_tokens` fill what a request leaves unset, over HTTP (a body
    with the prompt alone) as over gRPC (the client's unset fields), and the model info
    says which defaults apply. Greedy, so no EOS cuts the 7 tokens short (this prompt
    runs MAX_TOKENS tokens without one: the module docstring)."""
    import httpx2

    prompt = heldout_prompts[9]
    reply = httpx2.post(
        timeout_server.base_url + "/completions",
        json={"prompt": prompt, "temperature": 0.0},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert (body["cactus"]["rule"], body["cactus"]["delta"]) == ("cactus", DEFAULT_DELTA), body
    assert body["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS, body["usage"]
    assert body["choices"][0]["finish_reason"] == "length"
    client = timeout_server.client(token=TOKEN)
    info = client.model_info()
    assert (info.default_rule, info.default_delta) == ("cactus", DEFAULT_DELTA), info
    served = client.generate(prompt, temperature=0.0)
    assert len(served.token_ids) == DEFAULT_MAX_TOKENS and served.finish_reason == "LENGTH"
    assert served.stats.num_drafts > 0  # cactus speculated (rule none would draft nothing)


# Polls rank 0's load (running rows, waiting requests) until stdin closes, then prints
# the largest of each: what the batching test's requests met on the engine.
_LOAD_MONITOR = """
import json, sys, threading, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
from workers.group import NAMESPACE
(name,) = [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
           if e["namespace"] == NAMESPACE and e["name"].endswith("-rank0")]
rank0 = ray.get_actor(name, namespace=NAMESPACE)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("POLLING", flush=True)
top = {"running": 0, "waiting": 0}
while not done.is_set():
    load = ray.get(rank0.load.remote(), timeout=30)
    top = {k: max(top[k], load[k]) for k in top}
    time.sleep(0.03)
print(json.dumps(top), flush=True)
"""


def test_requests_beyond_max_num_seqs_wait_for_a_row_and_keep_their_solo_tokens(
    timeout_server, heldout_prompts
):
    """README (batching.max_num_seqs, Reproducibility): with two rows, six concurrent
    requests of mixed rules all succeed; the engine never runs more than two rows and
    the others wait (rank 0's load, polled); and with `speculation.policy: fixed` each
    seeded or greedy request gives the tokens it gives alone."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from tests.deployments.test_serve_e2e import REPO

    client = timeout_server.client(token=TOKEN)
    rules = ("cactus", "sps", "none", "cactus_exact", "tas", "cactus")
    calls = [
        # short: the last of three waves must end well inside the server's 3 s limit
        dict(prompt=heldout_prompts[i], max_tokens=16, seed=100 + i, rule=rule, delta=1.0)
        | ({"temperature": 0.0} if rule == "none" else {"temperature": 0.8})
        for i, rule in enumerate(rules)
    ]

    def run(kw):
        kw = dict(kw)
        return client.generate(kw.pop("prompt"), **kw)

    solo = [run(kw) for kw in calls]
    monitor = subprocess.Popen(
        [sys.executable, "-c", _LOAD_MONITOR, timeout_server.ray_address],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert monitor.stdout.readline().strip() == "POLLING"
        with ThreadPoolExecutor(len(calls)) as pool:
            together = list(pool.map(run, calls))
    finally:
        top = json.loads(monitor.communicate("", timeout=60)[0].strip().splitlines()[-1])
    assert all(0 < len(r.token_ids) <= 16 for r in solo), [len(r.token_ids) for r in solo]
    ended = [r.finish_reason for r in (*solo, *together)]
    assert set(ended) <= {"LENGTH", "EOS"}, ended  # none cut by the time limit
    differ = [
        (i, calls[i]["rule"], a.seed, b.seed, a.finish_reason, b.finish_reason, a.stats, b.stats)
        for i, (a, b) in enumerate(zip(solo, together, strict=True))
        if list(a.token_ids) != list(b.token_ids)
    ]
    assert not differ, differ
    # none lost its drafts on the way (a Close overtaken by the next Open did so)
    assert [r.stats.draft_failures for r in together] == [0] * len(calls)
    assert top["running"] == MAX_NUM_SEQS and top["waiting"] >= 1, top
