"""deployments/drain.py on a model-free engine: the end of a replica's drain ends running
requests with ServerShuttingDownError (after the chunks already sent), refuses late ones,
and the watch cuts only once the application is being deleted, `drain_s` after it saw
that. The served behaviour (SIGINT, gRPC and HTTP streams) is tested end to end in
test_chat_e2e's last test."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from cactus.errors import (
    EngineFailedError,
    InvalidRequestError,
    RequestCancelledError,
    ServerShuttingDownError,
)
from cactus.params import GenerationRequest, SamplingParams
from deployments.drain import DrainingEngine
from deployments.ingress import RequestError
from deployments.openai_api import as_openai_error
from workers.request import GenerationChunk, GenerationResult, SpecStats


def _req(rid: str) -> GenerationRequest:
    return GenerationRequest(
        prompt_token_ids=(1, 2), request_id=rid, sampling=SamplingParams(max_tokens=1000)
    )


class EndlessEngine:
    """A token every 5 ms until cancelled; `finite` requests end after 2 tokens."""

    def __init__(self, finite: tuple[str, ...] = ()) -> None:
        self.cancelled: dict[str, asyncio.Event] = {}
        self.finite = finite

    def model_info(self) -> dict:
        return {"vocab_size": 8192, "max_context": 1024, "tp_size": 1}

    async def ahealthy(self) -> bool:
        return True

    def _flag(self, rid: str) -> asyncio.Event:
        return self.cancelled.setdefault(rid, asyncio.Event())

    def cancel(self, request_id: str) -> None:
        self._flag(request_id).set()

    async def agenerate(self, req):
        await self._flag(req.request_id).wait()
        raise RequestCancelledError(f"request {req.request_id} cancelled")

    async def astream(self, req):
        flag = self._flag(req.request_id)
        for i in range(10_000):
            if flag.is_set():
                return  # as rank 0's stream ends a cancelled request: no result
            if req.request_id in self.finite and i == 2:
                result = GenerationResult(req.request_id, "ab", (0, 1), "LENGTH", 2, 2, SpecStats())
                yield GenerationChunk(req.request_id, (), "", "LENGTH", result)
                return
            yield GenerationChunk(req.request_id, (i,), "x")
            await asyncio.sleep(0.005)


async def _collect(engine, req, into: list):
    async for chunk in engine.astream(req):
        into.append(chunk)


def test_a_cut_ends_running_requests_after_their_chunks_and_refuses_late_ones():
    async def scenario():
        engine = DrainingEngine(EndlessEngine(finite=("done",)))
        done: list = []
        await _collect(engine, _req("done"), done)  # ended before the cut: untouched
        chunks: list = []
        stream = asyncio.create_task(_collect(engine, _req("s"), chunks))
        unary = asyncio.create_task(engine.agenerate(_req("u")))
        while len(chunks) < 3:
            await asyncio.sleep(0.005)
        assert engine.running == {"s", "u"}
        assert engine.cut("the server is shutting down (test)") == 2
        for task in (stream, unary):
            with pytest.raises(ServerShuttingDownError, match="shutting down") as info:
                await task
            assert not info.value.refused  # it ran: the metrics count it CANCELLED
        assert len(chunks) >= 3 and all(c.token_ids for c in chunks)
        assert engine.running == set()
        # a request that arrives after the cut is refused at once (never ran: the
        # metrics do not count it)
        with pytest.raises(ServerShuttingDownError) as info:
            await engine.agenerate(_req("late"))
        assert info.value.refused
        with pytest.raises(ServerShuttingDownError) as info:
            await _collect(engine, _req("late-stream"), [])
        assert info.value.refused
        return done

    done = asyncio.run(scenario())
    assert done[-1].result is not None and done[-1].result.finish_reason == "LENGTH"


def test_a_refused_duplicate_id_leaves_the_running_request_tracked():
    """A second request with a running one's id is refused by the engine: that refusal
    untracked the first, so a cut at shutdown missed it and it ran on until Serve killed
    the replica (INTERNAL instead of UNAVAILABLE)."""

    class Refusing(EndlessEngine):
        def __init__(self) -> None:
            super().__init__()
            self.live: set[str] = set()

        async def astream(self, req):
            if req.request_id in self.live:
                raise InvalidRequestError("request_id", f"{req.request_id!r} is already running")
            self.live.add(req.request_id)
            try:
                async for chunk in super().astream(req):
                    yield chunk
            finally:
                self.live.discard(req.request_id)

    async def scenario():
        engine = DrainingEngine(Refusing())
        chunks: list = []
        stream = asyncio.create_task(_collect(engine, _req("x"), chunks))
        while len(chunks) < 2:
            await asyncio.sleep(0.005)
        with pytest.raises(InvalidRequestError, match="already running"):
            await _collect(engine, _req("x"), [])
        assert engine.running == {"x"}
        assert engine.cut("the server is shutting down (test)") == 1
        with pytest.raises(ServerShuttingDownError):
            await asyncio.wait_for(stream, 1.0)

    asyncio.run(scenario())


def test_an_error_of_a_request_not_cut_passes_through():
    class Failing(EndlessEngine):
        async def agenerate(self, req):
            raise ValueError("a bug")

    async def scenario():
        engine = DrainingEngine(Failing())
        with pytest.raises(ValueError, match="a bug"):
            await engine.agenerate(_req("x"))
        engine.cancel("y")  # the inner engine's own methods are reachable
        assert engine.inner.cancelled["y"].is_set()

    asyncio.run(scenario())


def test_the_watch_asks_only_while_requests_run_and_cuts_drain_s_after_the_deletion():
    asks: list[float] = []
    deleting_from = [None]

    def deleting() -> bool:
        asks.append(time.monotonic())
        return deleting_from[0] is not None and len(asks) >= deleting_from[0]

    async def scenario():
        engine = DrainingEngine(
            EndlessEngine(finite=("first",)), drain_s=0.3, deleting=deleting, poll_s=0.01
        )
        await _collect(engine, _req("first"), [])  # starts the watch
        watch = engine._watch
        await asyncio.sleep(0.2)  # an ask begun while "first" ran has ended
        asks.clear()
        await asyncio.sleep(0.1)
        assert asks == [] and not watch.done()  # idle: no controller call
        chunks: list = []
        stream = asyncio.create_task(_collect(engine, _req("s"), chunks))
        await asyncio.sleep(0.1)
        assert asks and not stream.done()  # asked, not deleting: the stream runs on
        deleting_from[0] = len(asks) + 2
        with pytest.raises(ServerShuttingDownError, match=r"drain_timeout_s = 0.3 s"):
            await stream
        cut_at = time.monotonic()
        await asyncio.wait_for(watch, 1.0)  # the watch ends with the cut
        return cut_at

    cut_at = asyncio.run(scenario())
    seen_at = asks[-1]  # the last ask said "deleting"
    assert 0.3 <= cut_at - seen_at < 1.0, cut_at - seen_at


def test_the_first_request_starts_the_watch_in_a_real_replica():
    async def scenario():
        engine = DrainingEngine(
            EndlessEngine(finite=("a", "b")), drain_s=1.0, deleting=lambda: False
        )
        assert engine._watch is None
        await _collect(engine, _req("a"), [])
        first = engine._watch
        assert first is not None and not first.done()
        await _collect(engine, _req("b"), [])
        assert engine._watch is first  # one watch per replica
        first.cancel()

    async def without_deleting():
        engine = DrainingEngine(EndlessEngine(finite=("a",)))
        await _collect(engine, _req("a"), [])
        return engine._watch

    asyncio.run(scenario())
    # without `deleting` (the shim tests' injected engines) no watch is started
    assert asyncio.run(without_deleting()) is None


def test_both_apis_say_the_server_is_shutting_down():
    from protos.cactus.v1 import cactus_pb2 as pb
    from tests.deployments.test_ingress import Ctx, _shim

    shim = _shim(EndlessEngine())

    async def scenario():
        got: list = []

        async def read():
            async for msg in shim.GenerateStream(pb.GenerateRequest(prompt="abc"), Ctx()):
                got.append(msg)

        task = asyncio.create_task(read())
        while len(got) < 2:
            await asyncio.sleep(0.005)
        shim.engine.cut("the server is shutting down: test")
        with pytest.raises(RequestError) as err:
            await task
        return err.value

    err = asyncio.run(scenario())
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert err.details == "the server is shutting down: test"
    http = as_openai_error(ServerShuttingDownError("the server is shutting down: test"))
    assert http.status == 503 and http.message == "the server is shutting down: test"


def test_a_stream_whose_cancel_is_lost_ends_at_its_next_chunk():
    class Deaf(EndlessEngine):
        def cancel(self, request_id: str) -> None:  # the cancel goes nowhere
            self.lost = request_id

    async def scenario():
        engine = DrainingEngine(Deaf())
        chunks: list = []
        stream = asyncio.create_task(_collect(engine, _req("s"), chunks))
        while len(chunks) < 2:
            await asyncio.sleep(0.005)
        engine.cut("the server is shutting down (test)")
        with pytest.raises(ServerShuttingDownError):
            await asyncio.wait_for(stream, 1.0)
        assert engine.inner.lost == "s" and engine.running == set()
        return len(chunks)

    assert asyncio.run(scenario()) >= 2


def test_an_open_health_watch_keeps_the_watch_asking_and_ends_once_draining():
    """A Watch never ends by itself, so it would hold the drain: while one is open the
    deletion is watched for, and once the application is being deleted the Watch says
    NOT_SERVING and ends (through the ingress shim)."""
    from grpc_health.v1 import health_pb2

    from tests.deployments.test_ingress import _shim

    asks: list[bool] = []

    def deleting() -> bool:
        asks.append(True)
        return len(asks) >= 3

    shim = _shim(EndlessEngine())
    # as a real replica's ingress wraps its engine (the shim's has no deletion watch)
    engine = shim.engine = DrainingEngine(
        shim.engine.inner, drain_s=5.0, deleting=deleting, poll_s=0.01
    )
    statuses: list[int] = []

    async def scenario():
        started = time.monotonic()
        async for reply in shim.Watch(health_pb2.HealthCheckRequest(service="")):
            statuses.append(reply.status)
        ended = time.monotonic() - started
        assert engine.watches == 0 and engine.draining and engine.cut_reason is None
        engine._watch.cancel()
        return ended

    ended = asyncio.run(scenario())
    status = health_pb2.HealthCheckResponse
    assert statuses == [status.SERVING, status.NOT_SERVING]
    assert len(asks) >= 3  # asked although no request ran: the Watch was open
    assert ended < 2.0, ended


def test_a_cut_ends_requests_waiting_for_a_restart():
    """README: a request still running when the drain time is up ends UNAVAILABLE; that
    includes one the supervisor holds between two attempts while the ranks restart
    (there is no attempt on rank 0 to cancel then): it ends at the cut, not with a
    fresh attempt after the restart."""
    from tests.workers.test_supervisor_limits import FlakyGroup, _config
    from workers.supervisor import EngineSupervisor

    release = threading.Event()

    class RestartingGroup(FlakyGroup):
        """Both attempts fail as a dead rank 0 does, the stream after a token; the gang
        restart then takes until the test ends."""

        def restart_ranks(self) -> None:
            release.wait(10.0)
            super().restart_ranks()

        async def agenerate(self, request):
            self.calls += 1
            await asyncio.sleep(0.05)
            raise EngineFailedError("rank 0 died")

        async def astream(self, request):
            self.calls += 1
            yield GenerationChunk(request.request_id, (1,), "x")
            await asyncio.sleep(0.05)
            raise EngineFailedError("rank 0 died")

    async def scenario():
        group = RestartingGroup(fail=0)
        engine = DrainingEngine(EngineSupervisor(group, _config()))
        chunks: list = []
        stream = asyncio.create_task(_collect(engine, _req("s"), chunks))
        unary = asyncio.create_task(engine.agenerate(_req("u")))
        while engine.inner.state == "SERVING":
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.15)  # both failed and wait for the restart now
        assert group.calls == 2 and engine.inner._inner == {"s": "", "u": ""}
        assert engine.running == {"s", "u"} and len(chunks) == 1
        start = time.monotonic()
        assert engine.cut("the server is shutting down (test)") == 2
        for task in (stream, unary):
            with pytest.raises(ServerShuttingDownError, match="shutting down"):
                await asyncio.wait_for(task, 1.0)
        ended = time.monotonic() - start
        # let the restart thread go now: asyncio.run waits for its executor's threads
        release.set()
        return ended, group

    try:
        ended, group = asyncio.run(scenario())
    finally:
        release.set()
    assert ended < 1.0, ended
    assert group.calls == 2  # neither started again


async def _until(condition, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_the_launchers_drain_refuses_new_requests_and_lets_running_ones_finish():
    """The launcher writes the drain's length before it deletes the application
    (serving.md: UNAVAILABLE while draining, where Serve's proxy said NOT_FOUND): the
    replica refuses new requests at once (UNAVAILABLE, never run), says NOT_SERVING
    (`draining`), lets its running stream finish, says busy while it runs, then not;
    once the key is gone (a new launcher cleared it) it serves again."""
    flag: list = [None]
    said: list[bool] = []

    async def scenario():
        engine = DrainingEngine(
            EndlessEngine(finite=("done", "again")),
            drain_s=5.0,
            drain_length=lambda: flag[0],
            mark_busy=said.append,
            flag_poll_s=0.01,
        )
        engine.start_watch()  # Serve's health check: no request reached it yet
        chunks: list = []
        stream = asyncio.create_task(_collect(engine, _req("s"), chunks))
        await _until(lambda: len(chunks) >= 3)
        flag[0] = 5.0
        await _until(lambda: said == [True])
        assert engine.draining and engine.refusing
        with pytest.raises(ServerShuttingDownError, match="takes no new requests") as info:
            await engine.agenerate(_req("late"))
        assert info.value.refused
        assert not stream.done()  # it runs on
        engine.inner.cancel("s")  # it ends (as a finished stream leaves the engine)
        await asyncio.wait_for(stream, 1.0)
        await _until(lambda: said == [True, False])  # idle: the launcher may delete
        assert engine.refusing  # while the key is there
        flag[0] = None
        await _until(lambda: not engine.refusing and not engine.draining)
        again: list = []
        await _collect(engine, _req("again"), again)  # served again
        engine._watch.cancel()
        return chunks, again

    chunks, again = asyncio.run(scenario())
    assert len(chunks) >= 3 and again[-1].result is not None


def test_the_launchers_drain_cuts_what_runs_at_its_end():
    said: list[bool] = []
    length: list = [None]

    async def scenario():
        engine = DrainingEngine(
            EndlessEngine(),
            drain_s=0.3,
            drain_length=lambda: length[0],
            mark_busy=said.append,
            flag_poll_s=0.01,
        )
        chunks: list = []
        stream = asyncio.create_task(_collect(engine, _req("s"), chunks))
        await _until(lambda: len(chunks) >= 2)
        length[0] = 0.3
        began = time.monotonic()
        with pytest.raises(ServerShuttingDownError, match=r"drain_timeout_s = 0.3 s"):
            await asyncio.wait_for(stream, 2.0)
        took = time.monotonic() - began
        await _until(lambda: said == [True, False])
        engine._watch.cancel()
        return took

    took = asyncio.run(scenario())
    assert 0.3 <= took < 0.8, took  # counted from when the replica saw the key


def test_a_drain_key_that_cannot_be_read_is_asked_again():
    """A GCS that does not answer (busy, going away) is asked again at the next poll;
    the replica serves meanwhile."""
    answers = iter([RuntimeError("GCS busy"), None, 5.0])

    def length():
        answer = next(answers, 5.0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def scenario():
        engine = DrainingEngine(EndlessEngine(finite=("a",)), drain_length=length, flag_poll_s=0.01)
        await _collect(engine, _req("a"), [])  # served; starts the watch
        await _until(lambda: engine.refusing)
        engine._watch.cancel()

    asyncio.run(scenario())


def test_a_failed_watch_is_started_again():
    """A watch that failed (a bug) is restarted by the next request or health check: a
    replica must keep seeing a drain (it was started once, and never again)."""

    async def scenario():
        engine = DrainingEngine(EndlessEngine(), drain_length=lambda: 5.0, flag_poll_s=0.01)
        real = engine._drain_for
        failures = []

        async def drain_for(drain_s):
            if not failures:
                failures.append(drain_s)
                raise RuntimeError("a bug in the drain")
            await real(drain_s)

        engine._drain_for = drain_for
        engine.start_watch()
        first = engine._watch
        with pytest.raises(RuntimeError, match="a bug"):
            await first
        assert not engine.refusing
        engine.start_watch()  # Serve's next health check
        assert engine._watch is not first
        await _until(lambda: engine.refusing)
        engine._watch.cancel()

    asyncio.run(scenario())


def test_the_launchers_drain_keys_in_rays_kv_store(ray_session):
    """The launcher's side, on a real Ray head: the drain it writes is what replicas
    read; it waits while a replica says busy (and not past its end), and clears every
    key of its application, never another application's (one namespace each, so an
    application named like another's key prefix cannot mix with it)."""
    import threading

    from deployments.drain import (
        busy_replicas,
        clear_drain,
        drain_length,
        mark_busy,
        start_drain,
        wait_drained,
    )

    apps = ("app-a", "app-b", "app-a/busy")
    for app in apps:
        clear_drain(app)
    assert drain_length("app-a") is None
    deadline = start_drain("app-a", 30.0)
    assert drain_length("app-a") == 30.0 and drain_length("app-b") is None
    assert deadline == pytest.approx(time.monotonic() + 30.0, abs=1.0)
    mark_busy("app-a", "r1", True)
    mark_busy("app-a", "r2", True)
    mark_busy("app-b", "r1", True)
    mark_busy("app-a/busy", "x", True)
    assert busy_replicas("app-a") == 2
    mark_busy("app-a", "r2", False)
    assert busy_replicas("app-a") == 1
    threading.Timer(1.5, mark_busy, args=("app-a", "r1", False)).start()
    started = time.monotonic()
    wait_drained("app-a", deadline, settle_s=0.1)
    assert 1.4 <= time.monotonic() - started < 10  # until the last replica was idle
    clear_drain("app-a")
    assert drain_length("app-a") is None and busy_replicas("app-a") == 0
    assert busy_replicas("app-b") == 1 and busy_replicas("app-a/busy") == 1
    # a drain past its end (and the cut's margin) waits no longer
    started = time.monotonic()
    wait_drained("app-b", time.monotonic() - 10.0, settle_s=0.0)
    assert time.monotonic() - started < 1.0
    for app in apps:
        clear_drain(app)


def test_the_engine_serving_gauge_is_0_while_the_replica_drains():
    """`cactus_engine_serving` stayed 1 through the launcher's drain (it followed the
    supervisor's state only), so a dashboard showed a draining replica as serving. The
    drain now tells the ingress when it begins and ends: 0 while draining, 1 again once
    the key is gone."""
    from types import SimpleNamespace

    from tests.deployments.test_ingress import _shim

    shim = _shim(EndlessEngine())
    served: list[int] = []
    shim.metrics.engine_serving = SimpleNamespace(set=served.append)
    shim.engine.draining = True
    shim.engine.on_change()  # wired by the ingress
    assert served == [0]
    served.clear()
    flag: list = [None]
    # as a real replica's ingress wraps its engine (the shim's reads no drain key)
    engine = shim.engine = DrainingEngine(
        shim.engine.inner, drain_s=5.0, drain_length=lambda: flag[0], flag_poll_s=0.01
    )
    engine.on_change = shim._engine_changed

    async def scenario():
        engine.start_watch()
        await asyncio.sleep(0.05)
        assert served == []  # nothing changed yet
        flag[0] = 5.0
        await _until(lambda: served == [0])
        assert engine.refusing
        flag[0] = None
        await _until(lambda: served == [0, 1])
        assert not engine.draining
        engine._watch.cancel()

    asyncio.run(scenario())
