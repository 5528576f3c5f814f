"""End to end: the service started as `make serve` starts it, a real gRPC client.

One server for the module (embedded models, TP=2 verifier, bearer token, small queue
limits), in a subprocess with its own Ray head; the test talks to it on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml

from cactus.detokenize import encode_prompt
from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
from client import NO_RETRY, CactusClient, RetryPolicy
from tests.cactus.test_params import refused_forms
from tests.conftest import embedded_dirs
from workers.tp_verifier import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-token-0123"


class RayProbe:
    """A process attached to a server's Ray cluster that answers questions about its
    engine actors, and kills one by role: attached once, at the first question
    (attaching a driver takes seconds; the tests ask dozens of times). Actors are
    looked up by name at every question, so restarted ones are found."""

    def __init__(self, ray_address: str) -> None:
        self.ray_address = ray_address
        self._proc: subprocess.Popen | None = None

    def ask(self, *command: str, timeout_s: float = 120.0):
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _PROBE, self.ray_address],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=os.environ.copy(),
            )
        self._proc.stdin.write(" ".join(command) + "\n")
        self._proc.stdin.flush()
        # one flushed line per question: nothing waits in the pipe's buffer unseen
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        assert ready, f"the Ray probe gave no answer to {command} within {timeout_s} s"
        line = self._proc.stdout.readline()
        assert line, f"the Ray probe exited (code {self._proc.poll()}) on {command}"
        answer = json.loads(line)
        assert "error" not in answer, answer["error"]
        return answer["ok"]

    def close(self) -> None:
        """End the process (before the server stops: no outside driver then)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# The process behind RayProbe: one question per line in, one JSON line out.
_PROBE = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
from workers.group import NAMESPACE, engine_cache_counts

def named(role):
    return [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
            if e["namespace"] == NAMESPACE and e["name"].endswith("-" + role)]

def actor(role):
    (name,) = named(role)
    return ray.get_actor(name, namespace=NAMESPACE)

def proposed():
    # {draft actor name: blocks it proposed}, the live ones (a dead one may linger)
    out = {}
    for name in named("draft"):
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            out[name] = ray.get(handle.status.remote(), timeout=30)["blocks_proposed"]
        except Exception:
            pass
    return out

def pace(role, seconds):
    # the actor's engine loop sleeps `seconds` after each step (until it is replaced)
    def arm(a, seconds=float(seconds)):
        import time
        record = a.loop.on_step
        def on_step(engine, batch):
            time.sleep(seconds)
            record(engine, batch)
        a.loop.on_step = on_step
    ray.get(actor(role).__ray_call__.remote(arm), timeout=30)

def poison(request_id):
    # rank 0's verifier logits of every row whose request id holds `request_id` get a
    # NaN (a float16 overflow, say), from the next step on
    def arm(a, rid=request_id):
        engine = a.loop.engine
        real = engine.verifier.score
        def score(rows):
            logits = real(rows)
            for i, (row_id, _) in enumerate(rows):
                if rid in row_id:
                    logits[i] = logits[i].clone()
                    logits[i][-1, 5] = float("nan")
            return logits
        engine.verifier.score = score
    ray.get(actor("rank0").__ray_call__.remote(arm), timeout=30)

ASK = {
    "ping": lambda: "pong",
    "pace": pace,
    "poison": poison,
    "counts": engine_cache_counts,
    "steps": lambda: ray.get(actor("rank0").timings.remote(), timeout=30)["steps"],
    "names": named,
    "kill": lambda role: ray.kill(actor(role)),
    "proposed": proposed,
    "metrics_port": lambda: max(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]),
}
for line in sys.stdin:
    what, *args = line.split()
    try:
        answer = {"ok": ASK[what](*args)}
    except Exception as err:
        answer = {"error": repr(err)}
    print(json.dumps(answer), flush=True)
"""


class Server:
    def __init__(self, proc, address, ray_address, http_port=None):
        self.proc, self.address, self.ray_address = proc, address, ray_address
        self.http_port = http_port
        self.base_url = f"http://127.0.0.1:{http_port}/v1"
        self.probe = RayProbe(ray_address)

    def openai(self, token=TOKEN):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=token, max_retries=0, timeout=120)

    def client(self, token=TOKEN, **kw) -> CactusClient:
        return CactusClient(self.address, token=token, timeout=120, **kw)

    def cache_counts(self) -> dict:
        """Every engine's draft and verifier cache counts (workers.group)."""
        return self.probe.ask("counts")

    def decode_steps(self) -> int:
        """Decode steps rank 0's engine has run since it started."""
        return self.probe.ask("steps")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    verifier, draft = embedded_dirs()
    port, http_port = free_port(), free_port()
    config = {
        "models": {"verifier": verifier, "draft": draft},
        "tp_size": 2,
        "grpc_port": port,
        "http_port": http_port,
        "auth": {"token": TOKEN},
        "limits": {
            "max_ongoing_requests": 2,
            "max_queued_requests": 1,
            "max_message_bytes": 1 << 20,
        },
        # fixed: the seeded equalities below (over the wire = in-process, HTTP = gRPC)
        # need a k schedule that does not depend on timings; the chat e2e server runs
        # the default goodput policy
        "speculation": {"delta_ceiling": 4.0, "max_num_speculative_tokens": 8, "policy": "fixed"},
    }
    with serving(config, tmp_path_factory.mktemp("serve")) as (proc, ready):
        ray_address = re.search(r"ray (\S+)\)", ready).group(1)
        assert f"HTTP on 127.0.0.1:{http_port}" in ready
        srv = Server(proc, f"127.0.0.1:{port}", ray_address, http_port)
        try:
            yield srv
        finally:
            srv.probe.close()


# A make run inside `make test` must not join the outer make's jobserver.
_MAKE_ENV = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")


def make(*args: str, **popen) -> subprocess.Popen:
    """`make <args>` in the repository, as a user runs it (README)."""
    env = {k: v for k, v in os.environ.items() if k not in _MAKE_ENV}
    return subprocess.Popen(
        ["make", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


@contextlib.contextmanager
def serving(config: dict, folder: Path, env: dict | None = None, *, via_make: bool = False):
    """`python -m deployments.serve` on `config` (as `make serve` runs it; `via_make`:
    `make serve CONFIG=...` itself): yields the process and its READY line once it
    serves; stops it with SIGINT (`make stop` for a make run), which must exit 0.
    `env`: variables exported to it on top of this process's."""
    path = folder / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    if via_make:
        assert not env, "make serve runs with this process's environment"
        proc = make("serve", f"CONFIG={path}")
    else:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deployments.serve", "--config", str(path)],
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    ready = _wait_ready(proc, timeout_s=300)
    yield proc, ready
    if proc.poll() is None:
        if via_make:
            stop = make("stop", f"PORT={config['grpc_port']}")
            stop.communicate(timeout=120)
        else:
            proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0


def _background_stream(client, prompt: str, **kw) -> tuple[list, list, threading.Thread]:
    """A gRPC stream read on its own thread: (its chunks so far, its RpcError if it
    failed, the thread), returned once the first chunk has come (or the stream ended)."""
    chunks: list = []
    failure: list = []

    def consume() -> None:
        try:
            chunks.extend(client.stream(prompt, **kw))  # appended as they arrive
        except grpc.RpcError as err:
            failure.append(err)

    reader = threading.Thread(target=consume)
    reader.start()
    while not chunks and reader.is_alive():
        time.sleep(0.02)
    return chunks, failure, reader


def _wait_ready(proc, timeout_s: float) -> str:
    """The READY line; every line the server prints stays on `proc.output`."""
    lines: list[str] = []
    proc.output = lines
    deadline = time.monotonic() + timeout_s

    def reader():
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=reader, daemon=True).start()
    while time.monotonic() < deadline:
        for line in lines:
            if line.startswith("READY"):
                return line
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + "".join(lines[-40:]))
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server not ready:\n" + "".join(lines[-40:]))


def test_the_ready_banner_says_where_it_listens(server):
    """The lines under READY: a client example, where each API listens (gRPC on every
    interface, HTTP on its host), and no auth-off warning on a server with a token."""
    port = server.address.rsplit(":", 1)[1]
    out = "".join(server.proc.output)
    assert f"try: .venv/bin/cactus client --address 127.0.0.1:{port}" in out
    assert f"listening: gRPC on every interface ([::]:{port}" in out
    assert re.search(
        r"OpenAI HTTP on 127\.0\.0\.1:\d+ \(base_url http://127\.0\.0\.1:\d+/v1\)", out
    )
    assert "auth is off" not in out
    # and the sockets say the same: HTTP on http_host only, gRPC on the wildcard address
    import psutil

    listening: dict[int, set[str]] = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN:
            listening.setdefault(conn.laddr.port, set()).add(conn.laddr.ip)
    assert listening.get(server.http_port) == {"127.0.0.1"}, listening.get(server.http_port)
    assert listening.get(int(port)) and listening[int(port)] <= {"::", "0.0.0.0"}, listening
    # serving.md: Ray's own ports on loopback. Every socket the server's process tree
    # (the launcher, the Ray head it started, every worker) listens on is loopback, but
    # the gRPC port, each Serve replica's inter-deployment server (README: `[::]:0`) and,
    # with TP > 1, the verifier ranks' torch.distributed rendezvous store (README: it
    # binds every interface, and must, for ranks on other nodes)
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    root = psutil.Process(server.proc.pid)
    wild, seen = [], {"ServeReplica": 0, "VerifierRank": 0, "raylet": 0, "gcs_server": 0}
    stores, replica_ports = [], {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = " ".join(proc.cmdline())
            conns = proc.net_connections(kind="tcp")
        except psutil.Error:  # a short-lived process that has gone
            continue
        for kind in seen:
            seen[kind] += kind in name
        for conn in conns:
            if conn.status != psutil.CONN_LISTEN or conn.laddr.ip in loopback:
                continue
            if conn.laddr.port == int(port):
                continue
            if "ServeReplica" in name:
                replica_ports.setdefault(proc.pid, []).append(conn.laddr.port)
            elif "VerifierRank" in name:
                stores.append(conn.laddr.port)
            else:
                wild.append((conn.laddr.ip, conn.laddr.port, name[:80]))
    # the census saw the whole server: the Ray head and both kinds of actor processes
    assert all(seen.values()), seen
    assert not wild, wild
    assert len(stores) == 1, stores  # TP = 2: one rendezvous store, on rank 0
    # one inter-deployment server per replica process, nothing else
    assert all(len(ports) == 1 for ports in replica_ports.values()), replica_ports


def test_health_and_model_info(server):
    client = server.client()
    assert client.health() == "SERVING"
    info = client.model_info()
    assert info.vocab_size > 1000 and info.max_context >= 512 and info.tp_size == 2
    assert set(info.rules) == {"none", "sps", "cactus", "cactus_exact", "tas"}
    assert info.delta_ceiling == 4.0 and info.max_num_speculative_tokens == 8
    # names, not the server's folders (serving.md): the verifier's is the OpenAI API's
    # model id (the folder's name: no served_model_name here), the draft's its folder's
    models = {m.id for m in server.openai().models.list().data}
    verifier, draft = embedded_dirs()
    assert models == {info.verifier} == {Path(verifier).name}, (models, info)
    assert info.draft == Path(draft).name and "/" not in info.verifier + info.draft, info


def test_unary_and_stream_equal_the_in_process_engine(server, embedded_engine, heldout_prompts):
    client = server.client()
    prompt = heldout_prompts[6]
    kw = {
        "max_tokens": 24,
        "temperature": 0.8,
        "top_k": 30,
        "seed": 42,
        "rule": "cactus",
        "delta": 1.0,
        "num_speculative_tokens": 4,
    }
    unary = client.generate(prompt, **kw)
    chunks = list(client.stream(prompt, **kw))
    local = embedded_engine.generate(
        GenerationRequest(
            prompt=prompt,
            sampling=SamplingParams(max_tokens=24, temperature=0.8, top_k=30, seed=42),
            speculation=SpeculationParams(rule="cactus", delta=1.0, num_speculative_tokens=4),
        )
    )
    assert unary.text == local.text and list(unary.token_ids) == list(local.token_ids)
    assert unary.finish_reason == "LENGTH" and unary.seed == 42
    assert unary.usage.completion_tokens == 24 and unary.usage.prompt_tokens > 0
    assert unary.stats.num_drafts > 0
    assert "".join(c.text for c in chunks) == local.text
    assert [t for c in chunks for t in c.token_ids] == list(local.token_ids)
    last = chunks[-1]
    assert last.finish_reason == "LENGTH" and last.usage.completion_tokens == 24
    assert last.stats.num_accepted_tokens == local.stats.num_accepted_tokens
    assert all(not c.finish_reason for c in chunks[:-1])


BAD = [
    ("prompt", {"prompt": ""}),
    ("prompt_token_ids", {"prompt": [10**7]}),
    ("max_tokens", {"max_tokens": 10**6}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": -0.5}),
    ("temperature", {"temperature": 2.5}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 10**7}),
    ("stop", {"stop": ["a"] * 9}),
    ("stop", {"stop": [""]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("rule", {"rule": "greedy"}),
    ("delta", {"delta": -1.0}),
    ("delta", {"delta": math.nan}),
    ("delta", {"delta": 4.5}),
    ("num_speculative_tokens", {"num_speculative_tokens": 9}),
    ("max_divergence_nats", {"max_divergence_nats": -0.1}),
    ("max_divergence_nats", {"max_divergence_nats": math.inf}),
    ("time_limit_s", {"time_limit_s": -1.0}),
]


def _sent(client) -> dict:
    """A raw stub call's metadata and deadline."""
    return {"metadata": client.metadata, "timeout": 30}


def _raw_request(client, prompt, kw: dict):
    """The message of `kw` with the values the Python client refuses before any call
    (NaN, infinities) set in it directly: what another gRPC client may send."""
    finite = {k: v for k, v in kw.items() if not (isinstance(v, float) and not math.isfinite(v))}
    msg = client.request(prompt, **finite)
    for name, value in kw.items():
        if name not in finite:
            part = msg.sampling if name in ("temperature", "top_p") else msg.speculation
            setattr(part if name != "time_limit_s" else msg, name, value)
    return msg


def test_validation_table_then_a_good_request(server):
    client = server.client()
    for field, kw in BAD:
        prompt = kw.pop("prompt", "def f(x):")
        calls = (client.generate, lambda *a, **k: list(client.stream(*a, **k)))
        if any(isinstance(v, float) and not math.isfinite(v) for v in kw.values()):
            for call in calls:  # the Python client refuses it, naming the field
                with pytest.raises(ValueError, match=f"^{field}: "):
                    call(prompt, **kw)
            msg = _raw_request(client, prompt, kw)  # the server, sent it all the same
            calls = (
                lambda *_, m=msg, **__: client.stub.Generate(m, **_sent(client)),
                lambda *_, m=msg, **__: list(client.stub.GenerateStream(m, **_sent(client))),
            )
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call(prompt, **kw)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value)
            assert err.value.details().startswith(field), err.value.details()
            assert "Traceback" not in err.value.details()
            # README: the field, the rule and the value that broke it (a missing prompt
            # has no value to give)
            details = err.value.details()
            if "give exactly one" not in details:
                shown = refused_forms(kw.get(field, prompt))
                assert any(form in details for form in shown), (details, shown)
    # a 0 sent in the message (proto3 optional: not unset) is refused, not the default
    for part, field in (("sampling", "max_tokens"), ("speculation", "num_speculative_tokens")):
        msg = client.request("def f(x):")
        setattr(getattr(msg, part), field, 0)
        for call in (client.stub.Generate, lambda m, **k: list(client.stub.GenerateStream(m, **k))):
            with pytest.raises(grpc.RpcError) as err:
                call(msg, metadata=client.metadata, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value)
            assert err.value.details().startswith(field), err.value.details()
    good = client.generate("def f(x):", max_tokens=4)
    assert len(good.token_ids) == 4
    # every bound is inclusive where serving.md says so: each limit itself is accepted
    info = client.model_info()
    edge = client.generate(
        "def f(x):",
        max_tokens=3,
        temperature=2.0,
        top_p=1.0,
        top_k=info.vocab_size,
        seed=2**64 - 1,
        rule="cactus",
        delta=info.delta_ceiling,
        num_speculative_tokens=info.max_num_speculative_tokens,
        max_divergence_nats=0.0,
    )
    assert len(edge.token_ids) == 3 and edge.seed == 2**64 - 1


def test_auth_is_required_on_every_rpc(server):
    for token in (None, "wrong-token"):
        client = server.client(token=token)
        for call in (
            lambda c: c.generate("x", max_tokens=2),
            lambda c: list(c.stream("x")),
            lambda c: c.model_info(),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(client)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # the health service stays open to probes, which send no metadata
        assert client.health() == "SERVING"


def test_too_large_a_message_is_resource_exhausted(server):
    """... at once: the client does not retry what would be refused again (README)."""
    client = server.client()
    with pytest.raises(grpc.RpcError) as err:
        client.generate("x" * (2 << 20), max_tokens=2)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.value.details() and client.last_attempts == 1


def test_queue_overflow_is_resource_exhausted_and_service_recovers(server, long_prompt):
    """Past max_ongoing_requests + max_queued_requests a call gets RESOURCE_EXHAUSTED
    (HTTP: 429 with Retry-After: 1, deployments/app.py); a client that retries it
    (README, the client's retries) gets in once the queue has room, its first attempts
    refused; the service then serves as before.
    The streams that fill it are greedy on a prompt with no EOS for 450 tokens, so none
    ends (and frees its slot) before the test cancels it."""
    codes: list = []
    clients: list = []

    def run(i):
        client = server.client(retry=NO_RETRY)  # the server's own answer, not a retry's
        clients.append(client)
        try:
            for _ in client.stream(long_prompt, max_tokens=400, temperature=0.0):
                pass
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            codes.append(err.code())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    deadline = time.monotonic() + 60
    while codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    # README: with the replica full, Serve's HTTP proxy queues up to max_queued_requests
    # (its own queue: Serve bounds the queue per proxy) and answers 429 beyond that, with
    # Retry-After (BackpressureConfig in deployments/app.py; Serve's default is 503)
    http_statuses = _http_burst(server, 3)
    retrying = server.client(retry=RetryPolicy(max_attempts=40, max_backoff_s=1.0))
    retried: dict = {}

    def get_in():
        try:
            retried["reply"] = retrying.generate("def g():", max_tokens=3)
        except grpc.RpcError as err:
            retried["error"] = err

    def get_in_async():  # README: the asyncio client retries the same way
        import asyncio

        from client import AsyncCactusClient

        async def call():
            client = AsyncCactusClient(
                server.address,
                token=TOKEN,
                timeout=120,
                retry=RetryPolicy(max_attempts=40, max_backoff_s=1.0),
            )
            try:
                return await client.generate("def h():", max_tokens=3), client.last_attempts
            finally:
                await client.close()

        try:
            retried["async"] = asyncio.run(call())
        except grpc.RpcError as err:
            retried["async_error"] = err

    knocker = threading.Thread(target=get_in)
    async_knocker = threading.Thread(target=get_in_async)
    knocker.start()
    async_knocker.start()
    time.sleep(1.5)  # their first attempts meet the full queue
    for client in clients:  # the running, the queued and the refused (a no-op)
        if getattr(client, "last_call", None) is not None:
            client.last_call.cancel()
    for t in [*threads, knocker, async_knocker]:
        t.join(timeout=120)
    replies = http_statuses()  # (status, its Retry-After header)
    statuses = [status for status, _ in replies]
    assert 429 in statuses and set(statuses) <= {200, 429}, replies
    assert all(after == "1" for status, after in replies if status == 429), replies
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1, codes
    assert set(codes) <= {  # OK: a cancel Serve's proxy lost (README, "Cancellation")
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.OK,
    }, codes
    assert "reply" in retried, retried
    assert len(retried["reply"].token_ids) == 3 and retrying.last_attempts >= 2, (
        retrying.last_attempts
    )
    assert "async" in retried, retried
    reply, attempts = retried["async"]
    assert len(reply.token_ids) == 3 and attempts >= 2, attempts
    assert len(server.client().generate("def g():", max_tokens=3).token_ids) == 3


def _http_burst(server, n: int):
    """n short completions over HTTP at once; returns, once the first answer is in (or
    after 30 s), a function that waits for all of them and gives their statuses, each
    with its Retry-After header (None without one)."""
    import httpx2

    statuses: list[tuple[int, str | None]] = []

    def send(i):
        with httpx2.Client(timeout=300) as http:
            reply = http.post(
                f"{server.base_url}/completions",
                json={"prompt": "def f():", "max_tokens": 2, "seed": i},
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
        statuses.append((reply.status_code, reply.headers.get("retry-after")))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not statuses and time.monotonic() < deadline:
        time.sleep(0.1)

    def wait() -> list[tuple[int, str | None]]:
        for t in threads:
            t.join(timeout=300)
        return statuses

    return wait


def _assert_caches_freed(server, within_s: float = 60.0) -> None:
    """Every engine's draft and verifier cache counts reach 0 within `within_s`."""
    assert _caches_free(server, within_s), server.cache_counts()


# Cancelled requests decode plainly (one token a step), greedily, from a prompt whose
# greedy text has no EOS for CANCEL_TOKENS / 2 tokens, so freed caches after fewer steps
# prove the cancellation reached the engine however fast this machine decodes (uncancelled,
# the request frees its rows only after that many steps).
CANCEL_TOKENS = 900
CANCEL_KW = {"max_tokens": CANCEL_TOKENS, "temperature": 0.0, "rule": "none"}
# The time limit of a cancellation try (_stops_within_tries): it ends a request whose
# cancel Serve's proxy lost. Longer than the 20 s a try waits for the freed caches, so
# a request the limit ended never passes for a cancelled one.
TRY_KW = {**CANCEL_KW, "time_limit_s": 35.0}
# Tries per cancellation test: a full run on a loaded 2-core machine once saw Serve's proxy
# lose three cancels in a row (CI on 00f03f0); a cancel that never reaches the engine
# still fails every try.
CANCEL_TRIES = 5


@pytest.fixture(scope="module")
def long_prompt(embedded_engine, heldout_prompts) -> str:
    prompt = heldout_prompts[9]
    greedy = embedded_engine.generate(
        GenerationRequest(
            prompt=prompt,
            sampling=SamplingParams(max_tokens=CANCEL_TOKENS // 2, temperature=0.0),
            speculation=SpeculationParams(rule="sps"),  # greedy: the verifier's tokens
        )
    )
    assert greedy.finish_reason == "LENGTH", greedy.finish_reason
    return prompt


def _assert_stopped_early(server, steps_before: int) -> None:
    """The request's rows are freed, and rank 0 ran far fewer steps than it needed."""
    _assert_caches_freed(server)
    steps = server.decode_steps() - steps_before
    assert steps < CANCEL_TOKENS // 2, f"{steps} steps: the cancelled request ran on"


def _caches_free(server, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while True:
        counts = server.cache_counts()
        if counts and all(v == 0 for engine in counts.values() for v in engine.values()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def test_cancel_mid_stream_frees_the_caches(server, long_prompt):
    """A cancelled gRPC stream stops in the engine. Ray Serve 2.60's gRPC proxy loses a
    cancel that lands while it is writing a chunk to the client (its
    send_request_to_replica ends on GeneratorExit without cancelling the replica call;
    met in most full `make test` runs here), so the request carries a time limit that ends it
    if so, and the test tries up to CANCEL_TRIES times: a cancellation that never reaches the
    engine fails every try."""
    client = server.client()

    def leave_early() -> bool:
        # leaving the loop is the cancel: the blocking client cancels a call whose
        # iterator is closed (README: the client's stream), as the asyncio one does
        for i, _chunk in enumerate(client.stream(long_prompt, **TRY_KW)):
            if i == 2:
                break
        return _caches_free(server, within_s=20.0)

    _stops_within_tries(server, leave_early)


def test_a_cancelled_stream_leaves_its_batch_neighbour_unchanged(
    server, long_prompt, embedded_engine, heldout_prompts
):
    """README: a cancel stops that request and the other requests of its batch go on
    unchanged. A greedy neighbour runs beside the stream that is cancelled, in the same
    engine steps, and gives exactly the in-process engine's tokens (tries as above)."""
    import threading

    client = server.client()
    neighbour = heldout_prompts[4]
    kw = {"max_tokens": 160, "temperature": 0.0, "rule": "sps"}
    want = embedded_engine.generate(
        GenerationRequest(
            prompt=neighbour,
            sampling=SamplingParams(max_tokens=160, temperature=0.0),
            speculation=SpeculationParams(rule="sps"),
        )
    ).token_ids

    def beside_a_cancel() -> bool:
        got: list[int] = []
        streamed = threading.Event()

        def run() -> None:
            for chunk in client.stream(neighbour, **kw):
                got.extend(chunk.token_ids)
                streamed.set()

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        assert streamed.wait(60), "the neighbour sent nothing"
        running = False
        for i, _chunk in enumerate(client.stream(long_prompt, **TRY_KW)):
            if i == 2:
                running = worker.is_alive()
                break  # the cancel, while the neighbour runs
        worker.join(timeout=60)
        assert running, "the neighbour ended before the cancel: nothing was shown"
        assert not worker.is_alive()
        assert got == list(want), "the neighbour's tokens changed"
        return _caches_free(server, within_s=20.0)

    _stops_within_tries(server, beside_a_cancel)


def _stops_within_tries(server, leave_early) -> None:
    """`leave_early()` starts a long stream, cancels it and says whether the caches were
    freed within 20 s. Ray Serve's proxy may lose a cancel (see above), so up to CANCEL_TRIES
    tries; a try that stopped must have stopped the request early (decode steps)."""
    for _ in range(CANCEL_TRIES):
        before = server.decode_steps()
        if leave_early():
            steps = server.decode_steps() - before
            assert steps < CANCEL_TOKENS // 2, f"{steps} steps: the cancelled request ran on"
            return
        _assert_caches_freed(server, within_s=90.0)  # its time limit ends it
    raise AssertionError(f"no cancelled stream stopped in the engine in {CANCEL_TRIES} tries")


def test_a_stream_with_a_running_request_id_is_refused_and_the_first_runs_on(server, long_prompt):
    """README: a request_id that names a request still running gets INVALID_ARGUMENT,
    and the first keeps its id, and can still be cancelled. The refused stream must not
    cancel the first (a cancel by id on the way out of the refused call stopped it), and
    the first's cancel must still reach the engine (decode steps, as the cancel tests:
    up to CANCEL_TRIES tries, for the cancels Serve's proxy loses)."""
    client, second = server.client(), server.client(retry=NO_RETRY)
    tries = iter(range(CANCEL_TRIES))

    def refused_then_cancelled() -> bool:
        rid = f"dup-id-{next(tries)}"
        first = client.stream(long_prompt, request_id=rid, **TRY_KW)
        got = [next(first) for _ in range(3)]
        with pytest.raises(grpc.RpcError) as err:
            list(second.stream("def g():", request_id=rid, max_tokens=4))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "request_id" in err.value.details() and "already running" in err.value.details()
        got += [next(first) for _ in range(30)]  # it goes on (cancelled, it would end)
        assert all(not chunk.finish_reason for chunk in got)
        assert len(got) == 33
        first.close()
        return _caches_free(server, within_s=20.0)

    _stops_within_tries(server, refused_then_cancelled)


def test_a_unary_call_past_its_deadline_frees_its_request(server, long_prompt):
    """A unary Generate whose client gives up (its deadline passes; a cancel is the
    same RPC event) stops in the engine too."""
    client = server.client(retry=NO_RETRY)
    before = server.decode_steps()
    with pytest.raises(grpc.RpcError) as err:
        # its own time limit, long: the cancel must stop it, not the limit the client
        # otherwise derives from its deadline
        client.generate(long_prompt, timeout=3.0, time_limit_s=600.0, **CANCEL_KW)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
    _assert_stopped_early(server, before)


def test_cactus_client_json_is_what_cactus_generate_json_prints(server, capsys):
    """README: `cactus client --json` prints the same JSON object as `cactus generate
    --json` (with --stream after the text, gathered over the stream), less
    `divergence_capped` and the engine-only timings. The real commands: `generate` runs
    its own in-process engine, `client` asks this server; greedy, so both give the
    verifier's tokens (the unit test in tests/client compares with a stand-in server)."""
    from client.cli import main

    flags = ["--prompt", "def add(a, b):", "--max-tokens", "12", "--temperature", "0"]
    flags += ["--rule", "sps", "--seed", "7", "-K", "4", "--json"]
    verifier, draft = embedded_dirs()  # the server's pair, and its fixed K schedule
    own = ["--verifier", verifier, "--draft", draft, "--policy", "fixed"]
    assert main(["generate", *flags, *own]) == 0
    local = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("divergence_capped", "draft_s", "verify_s", "kernel_s"):
        del local["stats"][name]  # not in the gRPC API (README)
    remote = ["client", "--address", server.address, "--token", TOKEN, *flags]
    for stream in ([], ["--stream"]):
        assert main([*remote, *stream]) == 0
        printed, _, last = capsys.readouterr().out.rstrip("\n").rpartition("\n")
        got = json.loads(last)  # one line: JSON escapes the text's line breaks
        assert printed == (got["text"] if stream else "")  # the streamed text, then a newline
        assert got.keys() == local.keys() and got["stats"].keys() == local["stats"].keys()
        for name in ("text", "token_ids", "finish_reason", "seed", "usage"):
            assert got[name] == local[name], (name, got[name], local[name])
        assert got["request_id"] and got["stats"]["num_draft_tokens"] > 0


def test_openai_http_api_matches_the_grpc_api(server, embedded_engine, heldout_prompts):
    """The official openai client against the HTTP port of the same server: the same
    seeded request gives the same tokens as over gRPC, streamed or not; greedy equals
    the verifier's own decoding; errors are OpenAI-shaped."""
    import openai

    client = server.openai()
    model = client.models.list().data[0].id
    prompt = heldout_prompts[5]
    extra = {"rule": "cactus", "delta": 1.0, "top_k": 30, "num_speculative_tokens": 4}
    kw = {"max_tokens": 20, "temperature": 0.8, "seed": 321}
    http = client.completions.create(model=model, prompt=prompt, extra_body=extra, **kw)
    grpc_reply = server.client().generate(prompt, top_k=30, rule="cactus", delta=1.0, **kw)
    assert http.choices[0].text == grpc_reply.text
    assert http.usage.completion_tokens == len(grpc_reply.token_ids)
    assert http.model_extra["cactus"]["num_drafts"] == grpc_reply.stats.num_drafts
    streamed = client.completions.create(
        model=model,
        prompt=prompt,
        extra_body=extra,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == grpc_reply.text
    assert chunks[-1].usage.completion_tokens == len(grpc_reply.token_ids)
    greedy = client.completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0.0, extra_body=extra
    )
    want = embedded_engine.generate(
        GenerationRequest(
            prompt=prompt,
            sampling=SamplingParams(max_tokens=16, temperature=0.0),
            speculation=SpeculationParams(rule="none"),
        )
    )
    assert greedy.choices[0].text == want.text
    # a batch of prompts (LangChain sends them so): a choice each, in order, each the
    # text its prompt gets alone (seeded), usage summed
    other = heldout_prompts[6]
    batch = client.completions.create(model=model, prompt=[prompt, other], extra_body=extra, **kw)
    alone = server.client().generate(other, top_k=30, rule="cactus", delta=1.0, **kw)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [grpc_reply.text, alone.text]
    both = len(grpc_reply.token_ids) + len(alone.token_ids)
    assert batch.usage.completion_tokens == both
    # two samples streamed (n = 2; this server admits 3 requests at once): chunks carry
    # each choice's index; choice 0 is the seeded request above, choice 1 the request
    # seeded seed + 1 alone, as its `cactus.seed` says
    twice = client.completions.create(
        model=model,
        prompt=prompt,
        n=2,
        extra_body=extra,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    texts, seeds = ["", ""], [None, None]
    for chunk in twice:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                seeds[choice.index] = chunk.model_extra["cactus"]["seed"]
    second = server.client().generate(
        prompt, top_k=30, rule="cactus", delta=1.0, **{**kw, "seed": kw["seed"] + 1}
    )
    assert texts == [grpc_reply.text, second.text]
    assert seeds == [kw["seed"], kw["seed"] + 1]
    assert chunk.usage.completion_tokens == len(grpc_reply.token_ids) + len(second.token_ids)
    assert chunk.usage.prompt_tokens == http.usage.prompt_tokens  # the prompt counts once
    # logit_bias over both APIs: +100 on one token makes it every greedy token
    tok = server.client().generate(prompt, max_tokens=1, temperature=0.0).token_ids[0]
    favoured = server.client().generate(
        prompt, max_tokens=6, temperature=0.0, rule="cactus", logit_bias={tok: 100.0}
    )
    assert list(favoured.token_ids) == [tok] * 6
    over_http = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=6,
        temperature=0.0,
        logit_bias={str(tok): 100},
        extra_body={"rule": "cactus"},
    )
    assert over_http.choices[0].text == favoured.text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=prompt, n=65)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=prompt, extra_body={"delta": 9.0})
    assert err.value.body["param"] == "delta"
    with pytest.raises(openai.AuthenticationError):
        server.openai(token="wrong").completions.create(model=model, prompt=prompt)
    with pytest.raises(openai.BadRequestError) as err:  # the embedded tokenizer has none
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    assert "chat template" in err.value.body["message"]


def test_stop_strings_and_stop_ids_end_requests_alike_over_both_apis(
    server, embedded_engine, heldout_prompts
):
    """README (Supported fields): `stop` and `stop_token_ids` on the real server. A stop
    string taken from the greedy text's middle ends the request there over gRPC (unary
    and streamed: STOP_SEQUENCE, the text before it, no chunk carrying any of it) and
    over HTTP (unary and SSE: finish_reason "stop", the same text); a stop id ends it
    after that token (STOP; the id kept in token_ids, its text left out)."""
    import httpx2

    prompt = heldout_prompts[2]  # as tests/workers/test_engine.py's stop test
    base = embedded_engine.generate(
        GenerationRequest(
            prompt=prompt,
            sampling=SamplingParams(max_tokens=48, temperature=0.0),
            speculation=SpeculationParams(rule="none"),
        )
    )
    text = base.text
    stop = text[20:23]
    want = text[: text.find(stop)]
    assert len(stop) == 3 and want, text
    kw = {"max_tokens": 48, "temperature": 0.0, "rule": "cactus", "delta": 1.0}
    client = server.client()
    unary = client.generate(prompt, stop=[stop, "\x00never"], **kw)
    assert (unary.finish_reason, unary.text) == ("STOP_SEQUENCE", want)
    assert list(unary.token_ids) == list(base.token_ids[: len(unary.token_ids)])
    chunks = list(client.stream(prompt, stop=[stop], **kw))
    assert "".join(c.text for c in chunks) == want and chunks[-1].finish_reason == "STOP_SEQUENCE"
    assert all(stop not in c.text for c in chunks)
    body = {"model": "verifier", "prompt": prompt, "max_tokens": 48, "temperature": 0.0}
    body |= {"stop": stop, "rule": "cactus", "delta": 1.0}
    headers = {"authorization": f"Bearer {TOKEN}"}
    with httpx2.Client(timeout=120, headers=headers) as http:
        reply = http.post(f"{server.base_url}/completions", json=body).json()
        assert reply["choices"][0]["text"] == want, reply
        assert reply["choices"][0]["finish_reason"] == "stop", reply
        events = []
        with http.stream(
            "POST", f"{server.base_url}/completions", json={**body, "stream": True}
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: ") :]))
    pieces = [c["text"] for e in events for c in e.get("choices") or ()]
    assert "".join(pieces) == want and all(stop not in p for p in pieces), pieces
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "stop"
    # a stop id: the greedy text's 11th token, ended after its first occurrence
    stop_id = base.token_ids[10]
    first = list(base.token_ids).index(stop_id)
    by_id = client.generate(prompt, stop_token_ids=[stop_id], **kw)
    assert by_id.finish_reason == "STOP"
    assert list(by_id.token_ids) == list(base.token_ids[: first + 1])
    assert by_id.text == embedded_engine.tokenizer.decode(base.token_ids[:first])
    with httpx2.Client(timeout=120, headers=headers) as http:
        body = {**body, "stop_token_ids": [stop_id]}
        del body["stop"]
        reply = http.post(f"{server.base_url}/completions", json=body).json()
    assert reply["choices"][0]["finish_reason"] == "stop", reply
    assert reply["choices"][0]["text"] == by_id.text


def test_reflection_lists_the_services_and_health_is_the_standard_one(server):
    """What `grpcurl -plaintext 127.0.0.1:PORT list` shows (Ray Serve's proxy serves
    reflection), and the grpcio-health-checking service's Check / List."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(server.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {"cactus.v1.Cactus", "grpc.health.v1.Health"} <= services, services
        stub = health_pb2_grpc.HealthStub(channel)
        auth = [("authorization", f"Bearer {TOKEN}")]
        check = stub.Check(health_pb2.HealthCheckRequest(service="cactus.v1.Cactus"), metadata=auth)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        listed = stub.List(health_pb2.HealthListRequest(), metadata=auth)
        assert set(listed.statuses) >= {"cactus.v1.Cactus"}
        # README: the health service stays open without a token (probes send none), for
        # every name it answers, the standard service's own name included
        unauthenticated = stub.List(health_pb2.HealthListRequest(), timeout=30)
        assert set(unauthenticated.statuses) >= {"cactus.v1.Cactus", "grpc.health.v1.Health"}
        for service in ("", "cactus.v1.Cactus", "grpc.health.v1.Health"):
            plain = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
            assert plain.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="nope.v1.X"), metadata=auth)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        # This server has 2 request slots, so it keeps 1 Watch open (limits.health_watches):
        # each Watch below opens only once the one before it has closed, which shows a
        # cancelled Watch frees its slot through Serve's proxy (a few tries while the
        # cancel travels). Each is cancelled a moment after its first reply: Serve
        # 2.60's proxy loses a cancel that lands while it is still writing a reply
        # (README, "Cancellation"), which a loaded machine made happen here once.
        def watch_once(service: str):  # (the open call, its first reply)
            deadline = time.monotonic() + 15
            while True:
                watch = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=60)
                try:
                    first = next(watch)  # no token: probes send none
                    time.sleep(0.5)
                    return watch, first
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    assert "limits.max_health_watches" in exc.details()
                    assert time.monotonic() < deadline, "a cancelled Watch kept its slot"
                    time.sleep(0.2)

        for service, want in (("", "SERVING"), ("nope.v1.X", "SERVICE_UNKNOWN")):
            watch, first = watch_once(service)
            watch.cancel()
            assert health_pb2.HealthCheckResponse.ServingStatus.Name(first.status) == want
        # the cap holds through the proxy: a second Watch beside an open one is refused
        held, _ = watch_once("")
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limits.max_health_watches" in err.value.details()  # not Serve's full queue
        held.cancel()
        watch, _ = watch_once("")  # and the cancelled one frees its slot
        watch.cancel()
        # the probe the README gives for a full replica: Serve's proxy answers it itself
        from ray.serve.generated import serve_pb2

        healthz = channel.unary_unary(
            "/ray.serve.RayServeAPIService/Healthz",
            request_serializer=serve_pb2.HealthzRequest.SerializeToString,
            response_deserializer=serve_pb2.HealthzResponse.FromString,
        )
        assert healthz(serve_pb2.HealthzRequest(), timeout=30).message == "success"


def test_the_asyncio_client_matches_the_blocking_one(server):
    import asyncio

    from client import AsyncCactusClient

    kw = {"max_tokens": 12, "temperature": 0.7, "seed": 99, "rule": "cactus", "delta": 1.0}
    want = server.client().generate("def g(y):", **kw)

    async def run():
        client = AsyncCactusClient(server.address, token=TOKEN, timeout=120)
        try:
            unary = await client.generate("def g(y):", **kw)
            chunks = [c async for c in client.stream("def g(y):", **kw)]
            return unary, chunks, await client.health()
        finally:
            await client.close()

    unary, chunks, health = asyncio.run(run())
    assert list(unary.token_ids) == list(want.token_ids) and unary.text == want.text
    assert [t for c in chunks for t in c.token_ids] == list(want.token_ids)
    assert health == "SERVING"


def test_an_exception_in_a_stream_loop_cancels_it_on_the_server(server, long_prompt):
    """README (the client): leaving a `stream` loop by an exception cancels the call
    too, as a `break` does (test_cancel_mid_stream_frees_the_caches): the request stops
    in the engine, not at its end."""
    client = server.client()

    class Leave(Exception):
        pass

    def leave_early() -> bool:
        with pytest.raises(Leave):
            for i, _chunk in enumerate(client.stream(long_prompt, **TRY_KW)):
                if i == 2:
                    raise Leave
        return _caches_free(server, within_s=20.0)

    _stops_within_tries(server, leave_early)


def test_leaving_an_asyncio_stream_early_cancels_it_on_the_server(server, long_prompt):
    """README (the client): leaving a `stream` loop early cancels the call in both
    clients. For the asyncio client a `break` leaves its async generator suspended; its
    finaliser (the event loop's async-generator hook) closes it, and the close cancels
    the call. The request must then stop in the engine before the client is closed, as
    the blocking client's does in test_cancel_mid_stream_frees_the_caches (three tries,
    for the same Serve gap)."""
    import asyncio

    from client import AsyncCactusClient

    async def leave_early() -> bool:
        """Break out after 3 chunks; whether the caches are free while the client (its
        channel) is still open, so only the break can have cancelled the call."""
        client = AsyncCactusClient(server.address, token=TOKEN, timeout=120)
        try:
            seen = 0
            async for _chunk in client.stream(long_prompt, **TRY_KW):
                seen += 1
                if seen == 3:
                    break
            assert seen == 3
            return await asyncio.to_thread(_caches_free, server, within_s=20.0)
        finally:
            await client.close()

    _stops_within_tries(server, lambda: asyncio.run(leave_early()))


def test_the_quickstart_client_command_streams_from_the_server(server, capsys):
    """README Quickstart: `cactus client --prompt ... --stream` against the server."""
    from client.cli import main

    argv = ["client", "--address", server.address, "--prompt", "def fibonacci(n):"]
    greedy = ["--max-tokens", "12", "--temperature", "0"]
    assert main([*argv, "--token", TOKEN, "--stream", *greedy]) == 0
    printed = capsys.readouterr().out
    want = server.client().generate("def fibonacci(n):", max_tokens=12, temperature=0.0)
    assert printed == want.text + "\n"
    assert main([*argv, "--token", "wrong", "--stream", *greedy]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_logprobs_over_http_and_grpc_are_the_verifiers_processed_q(
    server, embedded_engine, heldout_prompts
):
    import torch

    from deployments.openai_api import token_text
    from tests.workers.test_logprobs import _recomputed_log_q

    prompt = heldout_prompts[2]
    ids = encode_prompt(embedded_engine.tokenizer, prompt)  # as the server encodes it
    kw = {"max_tokens": 12, "temperature": 0.7, "seed": 5}
    client = server.openai()
    http = client.completions.create(
        model="verifier", prompt=prompt, logprobs=3, extra_body={"top_k": 40}, **kw
    )
    grpc_reply = server.client().generate(prompt, top_k=40, logprobs=3, **kw)
    tokens = list(grpc_reply.token_ids)
    words = token_text(embedded_engine.tokenizer)
    sampling = SamplingParams(top_k=40, logprobs=3, **kw)
    want = _recomputed_log_q(embedded_engine, ids, tokens, sampling)
    lp = http.choices[0].logprobs
    assert len(lp.token_logprobs) == len(tokens) == len(grpc_reply.logprobs)
    for pos, (entry, http_lp) in enumerate(
        zip(grpc_reply.logprobs, lp.token_logprobs, strict=True)
    ):
        assert entry.token_id == tokens[pos]
        assert abs(entry.logprob - float(want[pos, tokens[pos]])) < 1e-4
        assert abs(http_lp - entry.logprob) < 1e-9
        # the 3 alternatives: q's 3 largest, best first, each at its q; over HTTP the
        # same, keyed by their text (the likelier keeps a text two tokens share), and the
        # sampled token too (OpenAI's legacy completions and vLLM: up to logprobs + 1)
        top = [(t.token_id, t.logprob) for t in entry.top]
        best = torch.topk(want[pos], 3).values.tolist()
        assert [v for _, v in top] == pytest.approx(best, abs=1e-4), (pos, top)
        assert all(abs(v - float(want[pos, t])) < 1e-4 for t, v in top), (pos, top)
        by_text: dict = {}
        for t, v in (*top, (entry.token_id, entry.logprob)):
            by_text.setdefault(words.text(t), v)
        assert words.text(tokens[pos]) in lp.top_logprobs[pos]
        assert lp.top_logprobs[pos] == pytest.approx(by_text, abs=1e-9), pos
    # each token's own bytes join into the text (a token that splits a character reads
    # bytes:\\xNN), and each offset counts the text's characters before it
    text = http.choices[0].text
    assert b"".join(words.bytes(t) for t in tokens).decode() == text
    assert lp.tokens == [words.text(t) for t in tokens]
    assert lp.text_offset == [
        len(b"".join(words.bytes(t) for t in tokens[:i]).decode(errors="ignore"))
        for i in range(len(tokens))
    ]
    chat_err = None
    try:
        client.chat.completions.create(
            model="verifier", messages=[{"role": "user", "content": "x"}], logprobs=True
        )
    except Exception as err:  # the embedded tokenizer has no chat template
        chat_err = err
    assert chat_err is not None and "chat template" in str(chat_err)


@pytest.mark.parametrize("n", [1, 2])
def test_an_http_client_that_goes_away_frees_its_request(server, long_prompt, n):
    """README: a client that leaves an SSE stream cancels it, every choice of it (n = 2:
    one Serve request, two engine requests; the freed caches cover both)."""
    import httpx2

    before = server.decode_steps()
    with (
        httpx2.Client(timeout=120) as http,
        http.stream(
            "POST",
            f"{server.base_url}/completions",
            json={"prompt": long_prompt, "stream": True, "n": n, **CANCEL_KW},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as reply,
    ):
        assert reply.status_code == 200
        lines = 0
        for line in reply.iter_lines():
            lines += line.startswith("data: ")
            if lines == 3:
                break  # leave with the stream open: the connection is closed
    _assert_stopped_early(server, before)


def test_an_http_unary_client_that_gives_up_frees_its_request(server, long_prompt):
    """A non-streamed completion whose client times out (the connection closes)."""
    import httpx2

    before = server.decode_steps()
    with pytest.raises(httpx2.ReadTimeout), httpx2.Client(timeout=3.0) as http:
        http.post(
            f"{server.base_url}/completions",
            json={"prompt": long_prompt, **CANCEL_KW},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
    _assert_stopped_early(server, before)


def _kill(server, role: str) -> float:
    """ray.kill (SIGKILL-like) of one engine actor of the server, by role ("draft",
    "rank0", "rank1"); returns the monotonic time the kill was asked for."""
    started = time.monotonic()
    server.probe.ask("kill", role)
    return started


@contextlib.contextmanager
def killer(ray_address: str):
    """`kill(role)` for a server the test has no Server for: a RayProbe attached before
    the test needs it, so a kill happens as soon as asked."""
    probe = RayProbe(ray_address)
    try:
        probe.ask("ping")
        yield lambda role: probe.ask("kill", role)
    finally:
        probe.close()


def test_non_finite_logits_fail_one_request_and_its_neighbour_goes_on(
    server, embedded_engine, heldout_prompts, long_prompt
):
    """README (Acceptance): non-finite verifier logits end that request with an error,
    INTERNAL on the wire naming only its id, while the rest of its batch goes on. On
    the real server (TP = 2), rank 0's logits of one request are poisoned with a NaN
    while a greedy stream runs beside it: the stream ends OK with its uninterrupted
    tokens, the poisoned call gets INTERNAL, and the server serves the next request."""
    prompt = long_prompt  # no EOS for 450 greedy tokens: it runs past the poisoned call
    want = embedded_engine.generate(
        GenerationRequest(
            prompt=prompt,
            sampling=SamplingParams(max_tokens=300, temperature=0.0),
            speculation=SpeculationParams(rule="none"),
        )
    )
    server.probe.ask("poison", "poisoned-e2e")
    client = server.client()
    chunks, failure, reader = _background_stream(
        client, prompt, max_tokens=300, temperature=0.0, rule="sps"
    )
    with pytest.raises(grpc.RpcError) as err:
        server.client().generate(
            heldout_prompts[4], max_tokens=40, request_id="poisoned-e2e", rule="cactus"
        )
    assert reader.is_alive(), "the stream ended before the poisoned call: nothing beside it"
    assert err.value.code() == grpc.StatusCode.INTERNAL, err.value
    assert err.value.details() == "internal error (request poisoned-e2e)", err.value.details()
    reader.join(timeout=120)
    assert not failure, failure
    assert [t for c in chunks for t in c.token_ids] == list(want.token_ids)
    assert client.generate("def f():", max_tokens=4).finish_reason == "LENGTH"


def test_killed_engine_actors_cost_no_stream_and_health_never_hangs(
    server, embedded_engine, heldout_prompts
):
    """Runs last on the module's server. One greedy stream (the other slot of the
    replica is for health Checks) outlives a draft kill and a follower-rank kill: it
    ends OK, equal to the uninterrupted output, with no token lost or repeated; health
    answers every poll within 3 s; the Cactus service is SERVING throughout the draft
    kill while the server ("") says NOT_SERVING until the new draft actor is up
    (serving.md); both go NOT_SERVING and back during the rank restart. Between the
    kills, the replacement draft actor drafts for the running stream: it speculates
    again (README)."""
    client = server.client()
    prompt = heldout_prompts[9]
    kw = {"max_tokens": 700, "temperature": 0.0, "rule": "cactus", "delta": 1.0}
    health: list[tuple[str, float, float]] = []  # the Cactus service's
    whole: list[tuple[str, float]] = []  # the server's (""), polled in turn
    stop = threading.Event()

    def poll():
        checker = server.client()
        while not stop.is_set():
            for service, record in (("cactus.v1.Cactus", health), ("", whole)):
                start = time.monotonic()
                try:
                    status = checker.health(service)
                except grpc.RpcError as err:
                    status = err.code().name
                if service:
                    record.append((status, time.monotonic() - start, start))
                else:
                    record.append((status, start))
            time.sleep(0.1)

    # rank 0 steps at most ~30 a second until the rank kill replaces it, so the stream
    # outlives the draft actor's replacement (a process start and a model load, during
    # which it decodes without drafts) on any machine
    server.probe.ask("pace", "rank0", "0.03")
    chunks, failure, reader = _background_stream(client, prompt, **kw)
    poller = threading.Thread(target=poll)
    poller.start()
    (killed_draft,) = server.probe.ask("names", "draft")
    draft_killed = _kill(server, "draft")
    # the rank kill waits until a new draft actor has proposed blocks (there is one
    # stream, so for it), and 1 s more
    proposals: dict = {}
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline and reader.is_alive():
        proposals = server.probe.ask("proposed")
        if any(n != killed_draft and count > 0 for n, count in proposals.items()):
            break
        time.sleep(0.2)
    drafting_again = time.monotonic() - draft_killed
    assert any(n != killed_draft and c > 0 for n, c in proposals.items()), (
        killed_draft,
        proposals,
        {"chunks": len(chunks), "s_after_kill": round(drafting_again, 1)},
    )
    time.sleep(1.0)
    assert reader.is_alive(), "the stream ended before the rank kill"
    rank_killed = _kill(server, "rank1")
    reader.join(timeout=300)
    time.sleep(1.0)
    stop.set()
    poller.join(timeout=30)
    assert not failure, failure
    final = chunks[-1]
    assert final.finish_reason in ("LENGTH", "EOS")
    want = embedded_engine.generate(
        GenerationRequest(
            prompt=prompt,
            sampling=SamplingParams(max_tokens=700, temperature=0.0),
            speculation=SpeculationParams(rule="none"),
        )
    )
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == list(want.token_ids)
    assert "".join(c.text for c in chunks) == want.text
    assert final.stats.resumed >= 1 and final.stats.draft_failures >= 1 and final.stats.degraded
    slowest = max(health, key=lambda h: h[1])
    # "at once": a hung Check would take recovery.probe_timeout_s (10 s); 3 s leaves a
    # loaded machine room for replacement actors starting beside it
    assert slowest[1] < 3.0, (  # when, relative to the first poll and the kills
        slowest,
        {"poll": health.index(slowest), "of": len(health)},
        {
            k: round(slowest[2] - t, 1)
            for k, t in [
                ("first_poll", health[0][2]),
                ("draft_killed", draft_killed),
                ("rank_killed", rank_killed),
            ]
        },
    )
    during_draft = [s for s, _, at in health if draft_killed <= at < rank_killed]
    assert during_draft and set(during_draft) == {"SERVING"}, during_draft
    # the server: NOT_SERVING once the probe found the draft actor gone, SERVING again
    # by the time the new one drafted (`drafting_again` after the kill)
    server_draft = [(s, at - draft_killed) for s, at in whole if draft_killed <= at < rank_killed]
    down = [t for s, t in server_draft if s == "NOT_SERVING"]
    assert down and {s for s, _ in server_draft} <= {"SERVING", "NOT_SERVING"}, server_draft
    assert [s for s, t in server_draft if t > drafting_again][-1:] == ["SERVING"], server_draft
    after_rank = [(s, at) for s, _, at in health if at >= rank_killed]
    assert {s for s, _ in after_rank} <= {"SERVING", "NOT_SERVING"}, after_rank
    # back within 60 s: the first SERVING after the last NOT_SERVING (the polls go on
    # until the stream has ended, which on a slow machine is long after the restart)
    down = [at for s, at in after_rank if s == "NOT_SERVING"]
    assert down, "health never said NOT_SERVING during the rank restart"
    back = [at for s, at in after_rank if s == "SERVING" and at > max(down)]
    assert back and back[0] - rank_killed < 60, (down[-1:], back[:1], rank_killed)
    assert after_rank[-1][0] == "SERVING", after_rank[-1]
    assert client.generate("def f():", max_tokens=4).finish_reason == "LENGTH"


DOCUMENTED_METRICS = [
    "cactus_request_failure",
    "cactus_spec_decode_num_drafts",
    "cactus_spec_decode_num_draft_tokens",
    "cactus_spec_decode_num_accepted_tokens",
    "cactus_spec_decode_num_accepted_tokens_per_pos",
    "cactus_divergence_nats",
    "cactus_draft_failures",
    "cactus_degraded_requests",
    "cactus_resumed_requests",
    "cactus_engine_restarts",
    "cactus_engine_serving",
    "cactus_request_success",
    "cactus_prompt_tokens",
    "cactus_generation_tokens",
    "cactus_time_to_first_token_seconds",
    "cactus_inter_token_latency_seconds",
    "cactus_e2e_request_latency_seconds",
    "cactus_running_requests",
    "cactus_num_requests_running",
    "cactus_num_requests_waiting",
    "cactus_batch_size",
    "cactus_draft_round_trip_seconds",
    "cactus_spec_chosen_k",
    "cactus_spec_predicted_tokens",
    "cactus_cancelled_requests",
    "cactus_cancelled_generation_tokens",
    "cactus_cancelled_draft_tokens",
    "cactus_cancelled_accepted_tokens",
    "cactus_spec_realised_tokens",
]


class Samples(dict):
    """name -> value; `labels`: metric name -> the label names seen on its samples."""

    labels: dict[str, set[str]]
    types: dict[str, str]


def _scrape(server) -> Samples:
    """Every sample of the server's Prometheus endpoint (Ray's metrics export port)
    whose name starts with ray_cactus_, summed over label sets except `position`."""
    import urllib.request

    port = server.probe.ask("metrics_port")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    samples = Samples()
    samples.labels = {}
    samples.types = {}  # "# TYPE ray_cactus_x counter" (the family name, no _total)
    for line in text.splitlines():
        if line.startswith("# TYPE ray_cactus_"):
            _, _, family, kind = line.split()
            samples.types[family.removesuffix("_total")] = kind
        if not line.startswith("ray_cactus_"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        samples.labels.setdefault(name, set()).update(re.findall(r'(\w+)="', name_labels))
        position = re.search(r'position="(\d+)"', name_labels)
        if position:
            name = f"{name}[{position.group(1)}]"
        reason = re.search(r'(?:finished_reason|reason|actor)="(\w+)"', name_labels)
        if reason:  # also kept per finish reason (or restarted actor): name{REASON}
            key = f"{name}{{{reason.group(1)}}}"
            samples[key] = samples.get(key, 0.0) + float(value)
        samples[name] = samples.get(name, 0.0) + float(value)
    return samples


def test_every_documented_metric_is_scraped_with_plausible_values(server, long_prompt):
    """Runs after the kill test (so the failure counters exist): scrape the running
    server's Prometheus endpoint, as an operator's Prometheus would. A unary cactus call
    cancelled by its deadline puts its work in rank 0's cancelled counters (rank 0 was
    restarted by the kill test, and a dead process's series may leave the scrape)."""
    client = server.client()
    for i in range(3):
        for _ in client.stream("def h(z):", max_tokens=16, seed=i, temperature=0.8):
            pass
    with pytest.raises(grpc.RpcError) as err:  # greedy: 450 tokens with no EOS
        server.client(retry=NO_RETRY).generate(
            long_prompt,
            timeout=2.0,
            time_limit_s=600.0,
            **{**CANCEL_KW, "rule": "cactus", "delta": 1.0},
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
    # Ray exports metrics every few seconds; the counts below compare requests that have
    # ended, so the scrape waits until none runs (a stream whose cancel Serve's proxy
    # lost runs on to its max_tokens: its first token counted, its end not yet)
    deadline = time.monotonic() + 150
    while True:
        samples = _scrape(server)
        missing = [
            m for m in DOCUMENTED_METRICS if not any(s.startswith(f"ray_{m}") for s in samples)
        ]
        running = sum(v for k, v in samples.items() if k.startswith("ray_cactus_running_requests"))
        if (not missing and running == 0) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not missing, (missing, sorted(samples))
    assert running == 0, running

    def total(name: str) -> float:
        return sum(v for k, v in samples.items() if k in (f"ray_{name}", f"ray_{name}_total"))

    drafts = total("cactus_spec_decode_num_draft_tokens")
    accepted = total("cactus_spec_decode_num_accepted_tokens")
    assert 0 < accepted <= drafts
    per_pos = [
        samples[k]
        for k in sorted(
            (k for k in samples if "num_accepted_tokens_per_pos" in k and "[" in k),
            key=lambda k: int(k.rsplit("[", 1)[1].rstrip("]")),
        )
    ]
    assert per_pos and all(a >= b for a, b in itertools.pairwise(per_pos)), per_pos
    assert sum(per_pos) == accepted
    finished = total("cactus_request_success")  # with a result (vLLM's request_success)
    # requests that ended without a result are counted by outcome (the cancel tests
    # above: a gRPC stream, a unary call past its deadline, two HTTP clients)
    unfinished = {
        r: sum(
            v
            for k, v in samples.items()
            if k.startswith("ray_cactus_request_failure") and k.endswith(f"{{{r}}}")
        )
        for r in ("CANCELLED", "ERROR")
    }
    assert unfinished["CANCELLED"] >= 4, unfinished
    # every request with a first token (cancelled ones included), no more
    ttft = samples["ray_cactus_time_to_first_token_seconds_count"]
    assert 3 <= ttft <= finished + sum(unfinished.values())
    assert not any(  # the success counter holds finish reasons only
        k.startswith("ray_cactus_request_success") and k.endswith(("{CANCELLED}", "{ERROR}"))
        for k in samples
    )
    assert samples["ray_cactus_e2e_request_latency_seconds_count"] == finished
    assert total("cactus_generation_tokens") >= 3 * 16
    # the work of requests cancelled before a result (rank 0's counters, by rule)
    assert total("cactus_cancelled_requests") >= 1
    assert total("cactus_cancelled_generation_tokens") >= 1
    cancelled_drafts = total("cactus_cancelled_draft_tokens")
    assert 0 < total("cactus_cancelled_accepted_tokens") <= cancelled_drafts
    assert total("cactus_resumed_requests") >= 1 and total("cactus_draft_failures") >= 1
    # the kill test killed the draft actor and a rank once each (README: by `actor`)
    for actor in ("draft", "ranks"):
        restarts = sum(
            v
            for k, v in samples.items()
            if k.startswith("ray_cactus_engine_restarts") and k.endswith(f"{{{actor}}}")
        )
        assert restarts >= 1, (actor, {k: v for k, v in samples.items() if "restarts" in k})
    assert total("cactus_engine_serving") == 1
    trips = samples["ray_cactus_draft_round_trip_seconds_count"]  # one per ProposeBatch
    assert trips >= 1 and 0 < samples["ray_cactus_draft_round_trip_seconds_sum"] / trips < 5.0
    # the speculation policy: every decode row counted once, with the k it chose; the
    # predicted tokens are the same order as the realised ones (the bench measures how
    # close: benchmarks/bench_policy.py)
    rows = total("cactus_spec_chosen_k")
    assert rows >= total("cactus_spec_decode_num_drafts")
    realised = total("cactus_spec_realised_tokens")
    assert rows <= realised <= rows * 9
    assert 0.5 < total("cactus_spec_predicted_tokens") / realised < 2.0
    # README: counters get Ray's `_total`, and the labels it names are on the series
    for counter in (
        "cactus_spec_decode_num_drafts",
        "cactus_request_success",
        "cactus_draft_failures",
    ):
        assert f"ray_{counter}_total" in samples.labels, sorted(samples.labels)
    ruled = re.compile(r"ray_cactus_(spec_|divergence|cancelled_)")
    by_rule = [n for n in samples.labels if ruled.match(n)]
    assert len(by_rule) >= 10, by_rule
    for name in by_rule:
        assert "rule" in samples.labels[name], (name, samples.labels[name])
    chosen = [n for n in samples.labels if n.startswith("ray_cactus_spec_chosen_k")]
    assert chosen and all({"rule", "k"} <= samples.labels[n] for n in chosen), chosen
    assert "position" in samples.labels["ray_cactus_spec_decode_num_accepted_tokens_per_pos_total"]
    assert "finished_reason" in samples.labels["ray_cactus_request_success_total"]
    assert "reason" in samples.labels["ray_cactus_request_failure_total"]
    # each series has the Prometheus type the README gives it (serving.md's list)
    kinds = {
        "counter": [
            "cactus_spec_decode_num_drafts",
            "cactus_spec_decode_num_accepted_tokens_per_pos",
            "cactus_divergence_nats",
            "cactus_request_success",
            "cactus_request_failure",
            "cactus_prompt_tokens",
            "cactus_generation_tokens",
        ],
        "histogram": [
            "cactus_time_to_first_token_seconds",
            "cactus_inter_token_latency_seconds",
            "cactus_e2e_request_latency_seconds",
            "cactus_draft_round_trip_seconds",
            "cactus_batch_size",
        ],
        "gauge": [
            "cactus_running_requests",
            "cactus_num_requests_running",
            "cactus_num_requests_waiting",
            "cactus_engine_serving",
        ],
    }
    for kind, names in kinds.items():
        for name in names:
            assert samples.types.get(f"ray_{name}") == kind, (
                name,
                samples.types.get(f"ray_{name}"),
            )
    assert "actor" in samples.labels["ray_cactus_engine_restarts_total"]


def test_stopping_the_server_drains_its_running_streams(server):
    """Runs last: it stops the module's server. SIGTERM (what docker stop, Kubernetes
    and systemd send; `make stop` and Ctrl-C send SIGINT, which every other server of
    these tests is stopped with) while a stream runs: the stream still ends normally
    with every token, a request that arrives meanwhile gets a clear status at once, and
    the process exits 0 (README: scale-down and shutdown drain). ray.init replaces a
    driver's SIGTERM handler with sys.exit(15), which cut the stream before."""
    # rank 0 steps at most 20 times a second: the stream outlives the late requests below
    # (they need the drain, not the deletion after it) on any machine
    server.probe.ask("pace", "rank0", "0.05")
    server.probe.close()  # no outside Ray driver attached while the server stops
    kw = {"max_tokens": 300, "temperature": 0.0, "rule": "cactus", "delta": 1.0}
    chunks, failure, reader = _background_stream(server.client(), "def parse(text):", **kw)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    late = None
    started = time.monotonic()
    late_client = server.client(retry=NO_RETRY)
    while late is None and time.monotonic() - started < 10:
        try:  # served while the proxy still routes to the application (a slow machine)
            late_client.generate("def f():", max_tokens=4)
            time.sleep(0.1)
        except grpc.RpcError as err:
            late = err
    refused_in = time.monotonic() - started
    # over HTTP too: the replica's 503 with Retry-After while the stream drains (before
    # the launcher's drain, Serve's HTTP proxy answered its own 404), not a hang or a 500
    import httpx2

    started = time.monotonic()
    with httpx2.Client(timeout=10) as http:
        while True:  # as above: served while this proxy still routes to the application
            reply = http.post(
                f"{server.base_url}/completions",
                json={"model": "verifier", "prompt": "def f():", "max_tokens": 4},
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            if reply.status_code != 200 or time.monotonic() - started > 10:
                break
            time.sleep(0.1)
    assert reader.is_alive(), "the stream ended before the late requests: no drain to meet"
    reader.join(timeout=120)
    assert not failure, failure
    assert chunks[-1].finish_reason == "LENGTH", chunks[-1]
    assert sum(len(c.token_ids) for c in chunks) == 300
    # the server drains: a new request is refused at once with the status clients retry
    # elsewhere (serving.md: UNAVAILABLE while draining; it was the proxy's NOT_FOUND)
    assert late is not None and late.code() == grpc.StatusCode.UNAVAILABLE, late
    assert "shutting down" in late.details() and "no new requests" in late.details(), late
    assert refused_in < 10, refused_in
    assert reply.status_code == 503 and reply.headers.get("Retry-After"), reply.text
    assert "shutting down" in reply.json()["error"]["message"], reply.text
    assert server.proc.wait(timeout=120) == 0
