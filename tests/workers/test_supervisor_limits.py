"""The recovery limits the README promises, on a group whose ranks fail on cue (the
real kills are in test_recovery.py and test_serve_e2e.py): a request that runs out of
`recovery.max_attempts` ends INTERNAL (not retried); a request that arrives during a restart waits
at most `recovery.recovery_timeout_s`; after `recovery.restart_attempts` failed gang
restarts the replica reports itself unhealthy, so Serve replaces it."""

from __future__ import annotations

import asyncio
import time

import pytest

from cactus.errors import (
    EngineFailedError,
    InvalidRequestError,
    RequestAttemptsExhaustedError,
    WorkerUnavailableError,
)
from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
from workers.request import GenerationResult, SpecStats
from workers.supervisor import EngineSupervisor, RecoveryConfig


class _Rank:
    class ping:  # Ray's actor-method spelling
        @staticmethod
        def remote():
            future = asyncio.get_running_loop().create_future()
            future.set_result(True)
            return future


class FlakyGroup:
    """Every generate fails as a dead rank does, `fail` times, then succeeds; a gang
    restart takes `restart_s` and fails `restart_failures` times first."""

    def __init__(self, fail: int, restart_s: float = 0.0, restart_failures: int = 0) -> None:
        self.fail, self.restart_s, self.restart_failures = fail, restart_s, restart_failures
        self.calls, self.restarts = 0, 0
        self.seen: list[GenerationRequest] = []
        self.ranks, self.draft = [_Rank()], None
        self.abandoned = 0  # abandon_draft calls (the supervisor's give-up)

    def model_info(self) -> dict:
        return {"vocab_size": 8, "max_context": 64, "tp_size": 1}

    async def agenerate(self, request):
        self.seen.append(request)
        self.calls += 1
        if self.calls <= self.fail:
            raise EngineFailedError("rank 0 died")
        return GenerationResult(request.request_id, "ok", (1,), "LENGTH", 1, 0, SpecStats())

    def restart_ranks(self) -> None:  # called in a thread, as the real one blocks
        time.sleep(self.restart_s)
        self.restarts += 1
        if self.restarts <= self.restart_failures:
            raise RuntimeError("placement group gone")

    def cancel(self, request_id) -> None:
        pass

    def abandon_draft(self) -> None:
        self.abandoned += 1


def _req(rid: str, time_limit_s: float | None = None) -> GenerationRequest:
    return GenerationRequest(
        prompt_token_ids=(1, 2),
        request_id=rid,
        sampling=SamplingParams(max_tokens=1, seed=1),
        speculation=SpeculationParams(rule="none"),
        time_limit_s=time_limit_s,
    )


def _config(**kw) -> RecoveryConfig:
    return RecoveryConfig(check_period_s=0.05, probe_timeout_s=1.0, **kw)


def test_a_request_that_runs_out_of_attempts_ends_internal():
    async def run(fail: int):
        group = FlakyGroup(fail=fail)
        sup = EngineSupervisor(group, _config(max_attempts=2))
        try:
            return await sup.agenerate(_req(f"r{fail}")), group.calls
        except RequestAttemptsExhaustedError as err:
            return err, group.calls

    # two failures: resumed twice, then served
    result, calls = asyncio.run(run(fail=2))
    assert result.text == "ok" and result.stats.resumed == 2 and calls == 3
    # three failures: the first try and max_attempts = 2 more, then INTERNAL
    err, calls = asyncio.run(run(fail=3))
    assert isinstance(err, RequestAttemptsExhaustedError) and "failed 3 times" in str(err)
    assert calls == 3


def test_a_request_waits_for_a_restart_at_most_the_recovery_timeout():
    async def run():
        # (seconds wide enough that a loaded machine's scheduling cannot blur them)
        group = FlakyGroup(fail=1, restart_s=5.0)
        sup = EngineSupervisor(group, _config(recovery_timeout_s=2.0))
        first = asyncio.create_task(sup.agenerate(_req("first")))
        while sup.state == "SERVING":
            await asyncio.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(WorkerUnavailableError, match="restarting"):
            await sup.agenerate(_req("late"))
        waited = time.monotonic() - start
        # its own shorter deadline wins over the recovery timeout
        start = time.monotonic()
        with pytest.raises(WorkerUnavailableError):
            await sup.agenerate(_req("hurried", time_limit_s=0.1))
        hurried = time.monotonic() - start
        with pytest.raises(WorkerUnavailableError):  # the one that saw it waits as long
            await first
        assert sup.state == "RECOVERING"  # the restart goes on; the requests did not wait
        while sup.state != "SERVING":
            await asyncio.sleep(0.05)
        return waited, hurried, await sup.agenerate(_req("after"))

    waited, hurried, after = asyncio.run(run())
    assert 1.9 < waited < 4.0, waited
    assert hurried < 1.0, hurried
    assert after.text == "ok" and after.stats.resumed == 0


def test_a_request_that_waited_out_a_restart_runs_for_what_its_time_limit_left():
    """time_limit_s counts from the request's arrival (README: request_timeout_s ends a
    request as time_limit_s ends one): a request that arrived during a restart runs on
    the rebuilt engine for what the wait left of it, not for all of it again."""

    async def run():
        group = FlakyGroup(fail=1, restart_s=0.5)
        sup = EngineSupervisor(group, _config(recovery_timeout_s=5.0))
        first = asyncio.create_task(sup.agenerate(_req("first")))
        while sup.state == "SERVING":
            await asyncio.sleep(0.01)
        await sup.agenerate(_req("waited", time_limit_s=2.0))
        await first
        return {r.request_id: r.time_limit_s for r in group.seen}

    limits = asyncio.run(run())
    assert 0.5 < limits["waited"] < 1.6, limits  # 2 s less the >= 0.5 s restart
    assert limits["first~1"] is None  # no limit stays none


def test_after_the_restart_attempts_the_replica_reports_itself_unhealthy(ray_session):
    from tests.deployments.test_ingress import _shim

    async def run():
        group = FlakyGroup(fail=1, restart_failures=2)
        sup = EngineSupervisor(group, _config(restart_attempts=2))
        shim = _shim(sup)
        await shim.check_health()  # serving: healthy
        with pytest.raises(WorkerUnavailableError):
            await sup.agenerate(_req("doomed"))
        assert group.restarts == 2 and sup.state == "FAILED" and not sup.alive()
        with pytest.raises(RuntimeError, match="engine failed"):
            await shim.check_health()  # Serve replaces a replica whose check raises
        return await sup.ahealthy()

    assert asyncio.run(run()) is False


def test_the_engine_metrics_follow_the_supervisor_between_health_checks(ray_session):
    """`cactus_engine_serving` is 0 while the ranks restart and the restart is counted
    when it starts, without waiting for Serve's health check (every 10 s: a rank
    restart takes about 7 s, so a scrape would have missed it)."""
    from types import SimpleNamespace

    from tests.deployments.test_ingress import _shim

    async def run():
        group = FlakyGroup(fail=1, restart_s=0.3)
        sup = EngineSupervisor(group, _config())
        shim = _shim(sup)
        served, restarts = [], []
        shim.metrics.engine_serving = SimpleNamespace(set=served.append)
        shim.metrics.engine_restarts = SimpleNamespace(
            inc=lambda n, tags: restarts.append((n, tags["actor"]))
        )
        result = await sup.agenerate(_req("r"))  # a rank dies once: restart, resume
        return result, served, restarts

    result, served, restarts = asyncio.run(run())
    assert result.text == "ok" and result.stats.resumed == 1
    # RECOVERING (0) when the failure is seen and when the restart starts, then 1
    assert served[0] == 0 and served[-1] == 1 and set(served) == {0, 1}, served
    assert restarts == [(1, "ranks")]


def test_a_second_request_with_a_running_id_is_refused_and_the_first_stays_cancellable():
    """A client may set request_id. A second request with the id of a running one is
    refused (INVALID_ARGUMENT on the wire) without taking over the first's entry: the
    first can still be cancelled, and its id is free again once it ends."""

    class SlowGroup(FlakyGroup):
        def __init__(self) -> None:
            super().__init__(fail=0)
            self.cancelled: list[str] = []

        async def agenerate(self, request):
            await asyncio.sleep(0.3)
            return await super().agenerate(request)

        def cancel(self, request_id) -> None:
            self.cancelled.append(request_id)

    async def run():
        group = SlowGroup()
        sup = EngineSupervisor(group, _config())
        first = asyncio.create_task(sup.agenerate(_req("same")))
        await asyncio.sleep(0.05)
        with pytest.raises(InvalidRequestError, match="request_id"):
            await sup.agenerate(_req("same"))
        with pytest.raises(InvalidRequestError, match="request_id"):
            await anext(sup.astream(_req("same")))
        sup.cancel("same")  # reaches the first request's running attempt
        assert len(group.cancelled) == 1 and group.cancelled[0].startswith("same")
        await first
        again = await sup.agenerate(_req("same"))  # the id is free once the first ended
        return again

    assert asyncio.run(run()).text == "ok"


def test_a_resumed_attempt_never_takes_an_id_a_client_request_holds():
    """A resumed attempt runs on rank 0 as `<id>~<n>`. A client request sent with that
    very id while the first waited for a restart made rank 0 refuse whichever came
    second as a duplicate: a stream would end INVALID_ARGUMENT after its tokens."""

    class Group(FlakyGroup):
        def __init__(self) -> None:
            super().__init__(fail=1, restart_s=0.2)
            self.live: set[str] = set()

        async def agenerate(self, request):
            if request.request_id in self.live:  # as rank 0 refuses a running id
                raise InvalidRequestError(
                    "request_id", f"{request.request_id!r} is already running"
                )
            self.live.add(request.request_id)
            try:
                await asyncio.sleep(0.1)  # both run at once
                return await super().agenerate(request)
            finally:
                self.live.discard(request.request_id)

    async def run():
        group = Group()
        sup = EngineSupervisor(group, _config())
        first = asyncio.create_task(sup.agenerate(_req("a")))
        while sup.state == "SERVING":
            await asyncio.sleep(0.01)
        other = asyncio.create_task(sup.agenerate(_req("a~1")))  # during the restart
        return await first, await other, [r.request_id for r in group.seen]

    a, other, seen = asyncio.run(run())
    assert a.text == other.text == "ok" and a.stats.resumed == 1
    assert a.request_id == "a" and other.request_id == "a~1"
    assert sorted(seen) == ["a", "a~1", "a~1~"], seen


def test_a_client_request_cannot_take_a_resumed_attempts_id():
    """The other direction: while a resumed attempt runs on rank 0 as `a~1`, a client
    request with the id `a~1` is refused by the supervisor, before it could reach rank 0
    (or take over the attempt's cancellation)."""

    class Group(FlakyGroup):
        def __init__(self, fail: int) -> None:
            super().__init__(fail=fail)
            self.started: list[str] = []

        async def agenerate(self, request):
            self.started.append(request.request_id)
            if request.request_id == "a~1":
                await asyncio.sleep(0.5)  # the resumed attempt runs a while
            return await super().agenerate(request)

    async def run():
        group = Group(fail=1)
        sup = EngineSupervisor(group, _config())
        first = asyncio.create_task(sup.agenerate(_req("a")))
        while "a~1" not in group.started:
            await asyncio.sleep(0.01)
        with pytest.raises(InvalidRequestError, match="already running"):
            await sup.agenerate(_req("a~1"))
        result = await first
        later = await sup.agenerate(_req("a~1"))  # free again once the attempt ended
        return result, later, [r.request_id for r in group.seen]

    result, later, seen = asyncio.run(run())
    assert result.stats.resumed == 1 and later.text == "ok"
    assert seen == ["a", "a~1", "a~1"], seen  # the refused one never reached the group


def test_a_cancel_while_a_restart_has_no_rank_0_does_not_raise():
    """A gang restart empties `ranks` before the new ones start; a cancel then (a drain's
    cut, a client's) raised IndexError, which stopped the drain's cut half way."""
    from workers.group import EngineGroup, GroupConfig

    group = EngineGroup(GroupConfig("verifier", "draft"))
    assert group.ranks == []
    group.cancel("r1")  # no rank 0: nothing to cancel, no error


def test_a_request_waiting_for_a_restart_when_the_replica_is_torn_down_counts_as_cancelled():
    """README: `cactus_request_failure` says CANCELLED "for a request running when its
    replica is torn down, which gets UNAVAILABLE". One waiting for a gang restart then
    ended with a plain WorkerUnavailableError, counted ERROR (a bug, to a dashboard);
    it now ends as a request of a stopped engine loop does."""
    from deployments.metrics import failure_reason

    async def run():
        group = FlakyGroup(fail=1, restart_s=1.5)  # (asyncio.run waits for its thread)
        sup = EngineSupervisor(group, _config(recovery_timeout_s=30.0))
        first = asyncio.create_task(sup.agenerate(_req("first")))
        while sup.state == "SERVING":
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(sup.agenerate(_req("waiting")))
        await asyncio.sleep(0.1)
        group.shutdown = lambda: None
        sup.shutdown()  # Serve tears the replica down (its __del__)
        errors = await asyncio.gather(first, waiting, return_exceptions=True)
        try:
            await sup.agenerate(_req("late"))
        except WorkerUnavailableError as late:
            return [*errors, late]
        raise AssertionError("a request after the shutdown ran")

    first, waiting, late = asyncio.run(run())
    for err in (first, waiting):
        assert isinstance(err, WorkerUnavailableError), err
        assert "shut down" in str(err)
        assert failure_reason(err) == "CANCELLED"
    # one that arrives after the shutdown never ran: refused, UNAVAILABLE, not counted
    assert isinstance(late, WorkerUnavailableError) and "shut down" in str(late)
    assert failure_reason(late) is None
