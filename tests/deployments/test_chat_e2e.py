"""Chat completions end to end: a copy of the embedded pair whose tokenizer has a chat
template (added here), served by `make serve` itself (stopped by `make stop`, in the
last test), the official openai client
against its HTTP port. The reply must be the verifier's greedy continuation of exactly
the prompt the template renders."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import shutil
import threading
import time

import grpc
import pytest
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpc_health.v1.health_pb2_grpc import HealthStub

from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
from tests.conftest import embedded_dirs
from tests.deployments.test_serve_e2e import RayProbe, killer, serving
from workers.tp_verifier import free_port

pytestmark = pytest.mark.slow
DRAIN_S = 5.0
TEMPLATE = (
    "{% for m in messages %}### {{ m.role }}\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chat-pair")
    dirs = {}
    for name, src in zip(("verifier", "draft"), embedded_dirs(), strict=True):
        dirs[name] = root / name
        shutil.copytree(src, dirs[name])
        tok = AutoTokenizer.from_pretrained(dirs[name])
        tok.chat_template = TEMPLATE
        tok.save_pretrained(dirs[name])
    port, http_port = free_port(), free_port()
    config = {
        "models": {"verifier": str(dirs["verifier"]), "draft": str(dirs["draft"])},
        "tp_size": 1,
        "grpc_port": port,
        "http_port": http_port,
        "http_host": "0.0.0.0",  # no token and HTTP on every interface: both warned of
        # one failed gang restart and the replica gives up (the replacement test); the
        # kill test's restart succeeds at its first attempt; a short drain (the last
        # test); Serve checks every 2 s (10 s by default), so the replica that cannot
        # rebuild its engine is replaced after 3 failed checks, 6 s
        "recovery": {
            "restart_attempts": 1,
            "drain_timeout_s": DRAIN_S,
            "health_check_period_s": 2.0,
        },
    }
    with serving(config, root, via_make=True) as (proc, ready):  # the README's command
        ray_address = re.search(r"ray (\S+)\)", ready).group(1)
        grpc_address = f"127.0.0.1:{port}"
        yield f"http://127.0.0.1:{http_port}/v1", dirs["verifier"], ray_address, grpc_address, proc


def test_chat_completions_render_the_template_and_stream(chat_server, embedded_engine):
    import openai
    from transformers import AutoTokenizer

    base_url, verifier_dir, *_ = chat_server
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
    ]
    reply = client.chat.completions.create(
        model="verifier", messages=messages, max_completion_tokens=16, temperature=0.0
    )
    ids = AutoTokenizer.from_pretrained(verifier_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    want = embedded_engine.generate(
        GenerationRequest(
            prompt_token_ids=tuple(ids),
            sampling=SamplingParams(max_tokens=16, temperature=0.0),
            speculation=SpeculationParams(rule="none"),
        )
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert reply.usage.prompt_tokens == len(ids) and reply.object == "chat.completion"
    chunks = list(
        client.chat.completions.create(
            model="verifier",
            messages=messages,
            max_completion_tokens=16,
            temperature=0.0,
            stream=True,
            logprobs=True,
            top_logprobs=2,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == len(want.token_ids) and all(e.logprob == 0.0 for e in entries)
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_an_http_stream_outlives_a_killed_draft_actor_and_rank(
    chat_server, embedded_engine, heldout_prompts
):
    """README: a dead draft actor degrades the request, a dead rank restarts the engine
    and the stream resumes; over HTTP as over gRPC (test_serve_e2e kills under a gRPC
    stream). One greedy SSE stream on this TP = 1 server (default goodput policy) while
    the draft actor and then rank 0 are killed: it ends without an error event, its text
    is the verifier's uninterrupted greedy text, and the chunk with the finish_reason
    says it was degraded and resumed. A seeded sampled stream beside it (with logprobs,
    which name every token) resumes too, with no gap and no repeat: the tokens it
    streamed are exactly its usage's completion tokens (max_tokens of them unless it
    reached EOS). Beside them, a seeded chat stream of n = 2 choices with logprobs and
    usage (each choice streams every token once: its logprob entries sum to the usage's
    completion tokens, one finish chunk per choice) and a greedy gRPC stream of the
    same prompt as the first (the same uninterrupted text): mixed traffic over both
    APIs through both kills. A unary gRPC call of the greedy prompt in flight at the rank
    kill runs again and returns the uninterrupted text, and so does a unary HTTP
    completion. A unary
    request sent right after the rank kill waits for the restart and is served."""
    import httpx2

    from client.client import CactusClient

    base_url, _, ray_address, grpc_address, _ = chat_server
    prompt, max_tokens = heldout_prompts[9], 400
    want = embedded_engine.generate(
        GenerationRequest(
            prompt=prompt,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            speculation=SpeculationParams(rule="none"),
        )
    )
    assert len(want.token_ids) == max_tokens  # long enough to run through both kills
    events: list[dict] = []
    raw: list[str] = []
    sampled: list[dict] = []
    body = {"model": "verifier", "max_tokens": max_tokens, "stream": True, "rule": "cactus"}

    def consume(fields: dict, into: list[dict], lines: list[str]) -> None:
        """One SSE completion stream: its status and lines into `lines`, its events
        (all but [DONE]) into `into`."""
        with (
            httpx2.Client(timeout=300) as http,
            http.stream("POST", f"{base_url}/completions", json={**body, **fields}) as reply,
        ):
            lines.append(str(reply.status_code))
            for line in reply.iter_lines():
                lines.append(line)
                if line.startswith("data: ") and line != "data: [DONE]":
                    into.append(json.loads(line[len("data: ") :]))

    def text() -> str:
        return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))

    chat_events: list[dict] = []
    chat_body = {
        "model": "verifier",
        "messages": [{"role": "user", "content": heldout_prompts[2]}],
        "max_completion_tokens": 300,
        "stream": True,
        "n": 2,
        "temperature": 0.8,
        "seed": 5,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }

    def consume_chat() -> None:
        with (
            httpx2.Client(timeout=300) as http,
            http.stream("POST", f"{base_url}/chat/completions", json=chat_body) as reply,
        ):
            chat_events.append({"status": reply.status_code})
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chat_events.append(json.loads(line[len("data: ") :]))

    http_unary: list = []  # the same over HTTP: a whole completion in flight at the kill

    def complete_http() -> None:
        with httpx2.Client(timeout=300) as http:
            http_unary.append(
                http.post(
                    f"{base_url}/completions",
                    json={"model": "verifier", "prompt": prompt, "max_tokens": max_tokens}
                    | {"temperature": 0.0, "rule": "cactus", "delta": 1.0},
                )
            )

    grpc_chunks: list = []
    grpc_failure: list = []
    unary: list = []  # README: a unary request runs again (the same seed) after a rank kill

    def over_grpc(method: str, into: list, failures: list) -> None:
        """One greedy gRPC call of the prompt (`generate` or `stream`): its result or
        chunks into `into`, an RpcError into `failures`."""
        client = CactusClient(grpc_address, timeout=300)
        kw = {"max_tokens": max_tokens, "temperature": 0.0, "rule": "cactus", "delta": 1.0}
        try:
            reply = getattr(client, method)(prompt, **kw)
            into.extend([reply] if method == "generate" else reply)
        except grpc.RpcError as err:
            failures.append(err)
        finally:
            client.close()

    # README (Standard services): a Watch sends the status now, then every change; the
    # Cactus service (does the replica take requests) stays SERVING through the draft
    # kill, which the whole server ("") does not
    watched: list[tuple[str, float]] = []
    channel = grpc.insecure_channel(grpc_address)
    watch_call = HealthStub(channel).Watch(
        HealthCheckRequest(service="cactus.v1.Cactus"), timeout=600
    )

    def watch():
        with contextlib.suppress(grpc.RpcError):  # cancelled at the end
            for reply in watch_call:
                name = HealthCheckResponse.ServingStatus.Name(reply.status)
                watched.append((name, time.monotonic()))

    watcher = threading.Thread(target=watch)
    watcher.start()
    greedy = {"prompt": prompt, "temperature": 0.0, "delta": 1.0}
    reader = threading.Thread(target=consume, args=(greedy, events, raw))
    seeded = {"prompt": heldout_prompts[4], "temperature": 0.8, "top_k": 20, "seed": 11}
    seeded |= {"delta": 1.0, "logprobs": 0, "stream_options": {"include_usage": True}}
    sampler = threading.Thread(target=consume, args=(seeded, sampled, []))
    chatter = threading.Thread(target=consume_chat)
    grpc_reader = threading.Thread(target=over_grpc, args=("stream", grpc_chunks, grpc_failure))
    generator = threading.Thread(target=over_grpc, args=("generate", unary, unary))
    http_generator = threading.Thread(target=complete_http)
    with killer(ray_address) as kill:
        for thread in (reader, sampler, chatter, grpc_reader, generator, http_generator):
            thread.start()
        while not (events and sampled and len(chat_events) > 2 and grpc_chunks) and all(
            t.is_alive() for t in (reader, sampler, chatter, grpc_reader)
        ):
            time.sleep(0.05)
        kill("draft")
        at_draft_kill = len(text())
        while len(text()) < at_draft_kill + 40 and reader.is_alive():
            time.sleep(0.05)
        # the supervisor's probe has found the draft actor gone and its replacement (a
        # process start and a model load, 7-10 s) is under way: "" says NOT_SERVING
        # until it is attached, so the rank kill below lands inside it
        _wait_health(grpc_address, "", "NOT_SERVING", timeout_s=10, every_s=0.05)
        assert reader.is_alive(), "the stream ended before rank 0 was killed"
        # the sampled stream follows the goodput policy's timing-dependent k, so its
        # tokens (and where it may reach EOS) differ run to run
        sampling_at_kill = sampler.is_alive()
        generating_at_kill = generator.is_alive()
        streaming_at_kill = grpc_reader.is_alive()
        completing_at_kill = http_generator.is_alive()
        rank_killed = time.monotonic()
        kill("rank0")
        # a request that arrives while the ranks restart waits for them and is served
        late: list = []
        arrival = threading.Thread(target=lambda: late.append(_complete(base_url, "def g():")))
        arrival.start()
        for thread in (reader, sampler, arrival, chatter, grpc_reader, generator, http_generator):
            thread.join(timeout=300)
    assert not reader.is_alive() and not sampler.is_alive()
    assert not chatter.is_alive() and not grpc_reader.is_alive() and not generator.is_alive()
    assert not http_generator.is_alive()
    # the unary HTTP call in flight at the rank kill ran again: 200, the uninterrupted text
    assert len(http_unary) == 1 and http_unary[0].status_code == 200, http_unary
    whole = http_unary[0].json()
    assert whole["choices"][0]["text"] == want.text, whole
    assert completing_at_kill, "the HTTP unary call ended before the rank kill: nothing tested"
    assert whole["cactus"]["resumed"] >= 1, whole["cactus"]
    # the unary gRPC call in flight at the rank kill ran again: OK, the uninterrupted text
    assert len(unary) == 1 and not isinstance(unary[0], grpc.RpcError), unary
    assert unary[0].text == want.text and list(unary[0].token_ids) == list(want.token_ids)
    assert generating_at_kill, "the unary call ended before the rank kill: nothing tested"
    assert unary[0].stats.resumed >= 1, unary[0].stats
    # the gRPC stream: OK, the uninterrupted greedy text, no token lost or repeated
    assert not grpc_failure, grpc_failure
    assert "".join(c.text for c in grpc_chunks) == want.text
    assert [t for c in grpc_chunks for t in c.token_ids] == list(want.token_ids)
    if streaming_at_kill:  # it ran through the rank kill: resumed, said in its last chunk
        assert grpc_chunks[-1].stats.resumed >= 1, grpc_chunks[-1].stats
    # the chat stream of two choices: every token of each choice streamed once
    assert chat_events[0] == {"status": 200}, chat_events[:2]
    assert not any("error" in e for e in chat_events), [e for e in chat_events if "error" in e]
    per_choice = {0: 0, 1: 0}
    finishes = {0: 0, 1: 0}
    for e in chat_events[1:]:
        for c in e.get("choices") or ():
            per_choice[c["index"]] += len((c.get("logprobs") or {}).get("content") or ())
            finishes[c["index"]] += c.get("finish_reason") is not None
    assert finishes == {0: 1, 1: 1}, finishes
    chat_usage = [e["usage"] for e in chat_events[1:] if e.get("usage")]
    assert len(chat_usage) == 1, chat_usage
    assert chat_usage[0]["completion_tokens"] == sum(per_choice.values()), (chat_usage, per_choice)
    assert all(0 < n <= 300 for n in per_choice.values()), per_choice
    assert late and late[0].status_code == 200, late
    assert late[0].json()["choices"][0]["finish_reason"] == "length", late[0].text
    lines = [line for line in raw if line]
    assert lines[0] == "200" and lines[-1] == "data: [DONE]", lines[-3:]
    assert not any("error" in e for e in events), [e for e in events if "error" in e]
    assert text() == want.text
    final = [e for e in events if e.get("choices") and e["choices"][0].get("finish_reason")]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] in ("length", "stop")
    stats = final[0]["cactus"]
    assert stats["draft_failures"] >= 1 and stats["degraded"] and stats["resumed"] >= 1, stats
    # the sampled stream: resumed, every token streamed once
    assert not any("error" in e for e in sampled), [e for e in sampled if "error" in e]
    choices = [e["choices"][0] for e in sampled if e.get("choices")]
    streamed = sum(len(c["logprobs"]["tokens"]) for c in choices)
    usage = [e["usage"] for e in sampled if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == streamed, (usage, streamed)
    closing = [e for e in sampled if e.get("choices") and e["choices"][0].get("finish_reason")]
    # what follows the resume is sampled afresh and may reach EOS: "stop" before max_tokens
    assert len(closing) == 1, closing
    reason = closing[0]["choices"][0]["finish_reason"]
    assert (reason, streamed) == ("length", max_tokens) or reason == "stop", (reason, streamed)
    assert closing[0]["cactus"]["seed"] == 11
    if sampling_at_kill:
        assert closing[0]["cactus"]["resumed"] >= 1, closing
    else:  # it had ended by EOS before the kill
        assert reason == "stop", closing
    # and the server serves the next request normally
    reply = _complete(base_url, "def f():")
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"
    # the open Watch saw the restart: SERVING, NOT_SERVING after the rank kill, SERVING
    watch_call.cancel()
    watcher.join(timeout=30)
    channel.close()
    states = [name for name, _ in watched]
    assert states and states[0] == "SERVING" and states[-1] == "SERVING", watched
    down = [at for name, at in watched if name == "NOT_SERVING"]
    assert down and min(down) >= rank_killed, (watched, rank_killed)
    assert all(a != b for a, b in itertools.pairwise(states)), states  # changes only
    # README: the draft actor is replaced, though rank 0 died while the replacement was
    # under way (40 characters after the draft kill, inside its 7-10 s) and this server
    # allows one try (restart_attempts 1): that try is not counted, it is made again
    # after the gang restart, so the server ("") comes back SERVING and requests draft
    # again; the old code gave the draft actor up for good here
    _wait_health(grpc_address, "", "SERVING", timeout_s=120)
    client = CactusClient(grpc_address, timeout=120)
    try:
        after = client.generate(prompt, max_tokens=32, temperature=0.0, rule="cactus", delta=1.0)
    finally:
        client.close()
    assert after.stats.num_draft_tokens > 0 and not after.stats.degraded, after.stats


def _wait_health(
    grpc_address: str, service: str, want: str, timeout_s: float, every_s: float = 0.5
) -> None:
    """Until the client's health Check of `service` answers `want` (SERVING,
    NOT_SERVING); an AssertionError naming the last answer after timeout_s."""
    from client.client import CactusClient

    client = CactusClient(grpc_address, timeout=10)
    try:
        status, deadline = None, time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                if (status := client.health(service)) == want:
                    return
            time.sleep(every_s)
        raise AssertionError(f"health of {service!r} not {want} in {timeout_s} s: {status}")
    finally:
        client.close()


def _complete(base_url: str, prompt: str):
    """One unary 4-token completion over HTTP."""
    import httpx2

    with httpx2.Client(timeout=120) as http:
        return http.post(
            f"{base_url}/completions",
            json={"model": "verifier", "prompt": prompt, "max_tokens": 4},
        )


def test_a_server_without_a_token_warns_that_auth_is_off(chat_server):
    """README: with no token configured or exported, the launcher prints a warning that
    auth is off and the gRPC port is reachable from other hosts, under its READY line;
    with `http_host: 0.0.0.0` it adds that HTTP is too."""
    import psutil

    base_url, *_, proc = chat_server
    out = "".join(proc.output)
    assert "WARNING: auth is off and the gRPC port is reachable from other hosts" in out
    assert "export CACTUS_AUTH_TOKEN=<token>" in out
    # http_host 0.0.0.0: the warning says HTTP is reachable too, and so does the socket
    assert "(and so is HTTP)" in out
    http_port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    bound = {
        conn.laddr.ip
        for conn in psutil.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == http_port
    }
    assert bound == {"0.0.0.0"}, bound


def test_a_replica_whose_engine_cannot_be_rebuilt_is_replaced_by_serve(chat_server):
    """README: after `recovery.restart_attempts` failed restarts the replica reports
    itself unhealthy and Serve replaces it. Runs last on this server: its verifier
    folder is moved away and rank 0 killed, so the gang restart fails for real (the new
    rank cannot load its weights); a request then gets 503 (the engine is gone, not
    restarting). With the folder back, Serve's health check replaces the replica: a new
    engine group (a new rank 0 name, not the old group's next generation) serves."""
    import httpx2

    base_url, verifier_dir, ray_address, *_ = chat_server
    probe = RayProbe(ray_address)
    # rank 0's name: engine-<the replica's group>.r<generation>-rank0
    (before,) = probe.ask("names", "rank0")
    group = before.split(".r")[0]
    away = verifier_dir.with_name("verifier-away")
    verifier_dir.rename(away)
    try:
        probe.ask("kill", "rank0")
        deadline = time.monotonic() + 120
        refused = None
        while time.monotonic() < deadline:
            try:
                reply = _complete(base_url, "def f():")
            except httpx2.HTTPError:
                continue
            if reply.status_code == 503:
                refused = reply
                break
            time.sleep(1.0)
        assert refused is not None, "the failed restart never made the engine unavailable"
        assert refused.headers.get("retry-after") == "1", refused.headers
    finally:
        away.rename(verifier_dir)
    deadline = time.monotonic() + 240
    served, seen = None, []
    while time.monotonic() < deadline:
        try:  # while no replica is up the proxy may hold the request
            reply = _complete(base_url, "def f():")
        except httpx2.HTTPError as err:
            seen.append(repr(err))
            continue
        seen.append(reply.status_code)
        if reply.status_code == 200:
            served = reply
            break
        time.sleep(2.0)
    assert served is not None, f"Serve did not bring a working replica back: {seen}"
    assert served.json()["choices"][0]["finish_reason"] == "length", served.text
    try:
        (after,) = probe.ask("names", "rank0")
    finally:
        probe.close()
    assert after.split(".r")[0] != group, (before, after)


def test_make_stop_drains_running_streams_then_ends_the_rest_with_unavailable(
    chat_server, heldout_prompts
):
    """README: `make stop` (SIGINT to the server, as Ctrl-C) drains: running streams get
    `recovery.drain_timeout_s` to finish; one still running then ends with UNAVAILABLE
    and a message saying the server is shutting down (over HTTP an error event whose
    code is 503), after the tokens already sent; the server and `make serve` exit 0,
    and the pid file is gone. Runs last: it stops this module's server (drain_timeout_s
    5 s). A 40-token gRPC stream running at the signal ends normally with every token;
    an 800-token plain stream (about 20 s here) over gRPC and one over HTTP, and an
    800-token unary call, are cut after the drain time, not before it and not at their
    end. Before deployments/drain.py Serve's kill cut them and the proxy said INTERNAL
    ("The actor died unexpectedly"). An open health Watch says NOT_SERVING and ends
    well before the drain time (it would hold the drain)."""
    import httpx2

    from client import NO_RETRY, CactusClient
    from deployments.serve import pidfile
    from tests.deployments.test_serve_e2e import make

    base_url, *_, grpc_address, proc = chat_server
    port = int(grpc_address.rsplit(":", 1)[1])
    assert pidfile(port).exists()
    prompt = heldout_prompts[9]
    results: dict[str, list] = {"short": [], "long": [], "http": [], "unary": []}
    ended: dict[str, tuple] = {}

    def unary() -> None:
        client = CactusClient(grpc_address, timeout=120, retry=NO_RETRY)
        results["unary"].append("sent")
        try:
            reply = client.generate(prompt, max_tokens=800, temperature=0.0, rule="none")
            ended["unary"] = (time.monotonic(), reply)
        except grpc.RpcError as err:
            ended["unary"] = (time.monotonic(), err)

    def consume(name: str, max_tokens: int) -> None:
        client = CactusClient(grpc_address, timeout=120, retry=NO_RETRY)
        status = None
        try:
            for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, rule="none"):
                results[name].append(chunk)
        except grpc.RpcError as err:
            status = err
        ended[name] = (time.monotonic(), status)

    def consume_http() -> None:
        body = {"model": "verifier", "prompt": prompt, "max_tokens": 800, "stream": True}
        body |= {"temperature": 0.0, "rule": "none"}
        with (
            httpx2.Client(timeout=120) as http,
            http.stream("POST", f"{base_url}/completions", json=body) as reply,
        ):
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    results["http"].append(line[len("data: ") :])
        ended["http"] = (time.monotonic(), reply.status_code)

    # an open health Watch (gRPC client-side health checking holds one per backend)
    # must not hold the drain: it says NOT_SERVING and ends
    watched: list[tuple[str, float]] = []
    channel = grpc.insecure_channel(grpc_address)

    def watch() -> None:
        try:
            for reply in HealthStub(channel).Watch(HealthCheckRequest(service=""), timeout=120):
                name = HealthCheckResponse.ServingStatus.Name(reply.status)
                watched.append((name, time.monotonic()))
            ended["watch"] = (time.monotonic(), None)
        except grpc.RpcError as err:
            ended["watch"] = (time.monotonic(), err)

    threads = [
        threading.Thread(target=consume, args=("long", 800)),
        threading.Thread(target=consume_http),
        threading.Thread(target=consume, args=("short", 40)),
        threading.Thread(target=watch),
        threading.Thread(target=unary),
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not (all(results.values()) and watched) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(results.values()) and watched == [("SERVING", watched[0][1])], (ended, watched)
    time.sleep(0.5)  # the unary call has reached the engine (nothing streams back)
    stop = make("stop", f"PORT={port}")
    signalled = time.monotonic()
    for t in threads:
        t.join(timeout=120)
    stopped = stop.communicate(timeout=120)[0]
    assert stop.returncode == 0 and f"stopped the server on port {port}" in stopped, stopped
    short_at, short_status = ended["short"]
    assert short_status is None, short_status
    assert results["short"][-1].finish_reason == "LENGTH"
    assert sum(len(c.token_ids) for c in results["short"]) == 40
    long_at, status = ended["long"]
    got = sum(len(c.token_ids) for c in results["long"])
    http_at, http_status = ended["http"]
    print(
        f"make stop: short stream ended after {short_at - signalled:.1f} s; long gRPC stream "
        f"after {long_at - signalled:.1f} s with {got} tokens and "
        f"{status.code() if status else None}: {status.details() if status else None}; "
        f"HTTP stream after {http_at - signalled:.1f} s: {results['http'][-2:]}; "
        f"health Watch ended after {ended['watch'][0] - signalled:.1f} s: {watched}; "
        f"unary call after {ended['unary'][0] - signalled:.1f} s"
    )
    assert status is not None, results["long"][-1]
    assert status.code() == grpc.StatusCode.UNAVAILABLE, (status.code(), status.details())
    assert "shutting down" in status.details() and "drain_timeout_s = 5" in status.details()
    assert 0 < got < 800
    # given the drain time (not cut at once), and ended at its end (not at the stream's)
    for at in (long_at, http_at):
        assert DRAIN_S - 0.5 <= at - signalled < DRAIN_S + 20, at - signalled
    assert http_status == 200 and results["http"][-1] == "[DONE]"
    error = json.loads(results["http"][-2])["error"]
    assert "shutting down" in error["message"] and error["type"] == "server_error", error
    assert error["code"] == 503, error
    unary_at, unary_status = ended["unary"]
    assert isinstance(unary_status, grpc.RpcError), unary_status
    assert unary_status.code() == grpc.StatusCode.UNAVAILABLE, unary_status.details()
    assert "shutting down" in unary_status.details()
    assert DRAIN_S - 0.5 <= unary_at - signalled < DRAIN_S + 20, unary_at - signalled
    texts = [json.loads(e)["choices"][0]["text"] for e in results["http"][:-2]]
    assert "".join(texts), "no tokens arrived before the cut"
    watch_at, watch_error = ended["watch"]
    channel.close()
    assert watch_error is None, watch_error  # ended by the server, with OK
    assert [name for name, _ in watched] == ["SERVING", "NOT_SERVING"], watched
    assert watch_at - signalled < DRAIN_S - 1, watch_at - signalled
    assert proc.wait(timeout=120) == 0  # `make serve`, with the server's exit status
    assert not pidfile(port).exists()
    # the set-up `make serve` depends on was already done: nothing was installed again
    assert "pip install" not in "".join(proc.output), "".join(proc.output[:20])
