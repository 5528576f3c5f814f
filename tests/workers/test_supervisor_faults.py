"""The supervisor's edges, on model-free fake groups (the real kills are in
test_recovery.py): a stream whose engine fails after its result is not resumed, a
stopped supervisor (or a shut-down group) restarts nothing, a cancel reaches a request
waiting for a restart, a draft actor that cannot be replaced is given up on, and
EngineGroup.shutdown does not race a gang restart."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from cactus.errors import (
    EngineFailedError,
    EngineStartError,
    RequestCancelledError,
    WorkerUnavailableError,
)
from tests.workers.test_supervisor_limits import FlakyGroup, _config, _req
from workers.request import GenerationChunk, GenerationResult, SpecStats
from workers.supervisor import EngineSupervisor, RecoveryConfig


class _Answer:
    """An actor method (Ray's spelling) whose call answers, or raises, at once."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls = fail, 0

    def remote(self):
        self.calls += 1
        future = asyncio.get_running_loop().create_future()
        if self.fail:
            future.set_exception(RuntimeError("actor died"))
        else:
            future.set_result(True)
        return future


class DiesAfterTheResult(FlakyGroup):
    """Rank 0 yields a token and the result, then its Ray stream fails as a dead
    actor's does (the window between the last item and the streaming task's end)."""

    def __init__(self) -> None:
        super().__init__(fail=0)
        self.streams: list = []

    async def astream(self, request):
        self.streams.append(request)
        yield GenerationChunk(request.request_id, (5,), "a")
        result = GenerationResult(request.request_id, "a", (5,), "EOS", 2, 1, SpecStats())
        yield GenerationChunk(request.request_id, (), "", "EOS", result)
        raise EngineFailedError("rank 0 died")


def test_a_stream_whose_engine_fails_after_its_result_is_not_resumed():
    async def run():
        group = DiesAfterTheResult()
        sup = EngineSupervisor(group, _config())
        chunks = [chunk async for chunk in sup.astream(_req("s"))]  # ends cleanly
        return group, sup, chunks

    group, sup, chunks = asyncio.run(run())
    results = [c.result for c in chunks if c.result is not None]
    assert len(results) == 1 and results[0].finish_reason == "EOS"
    assert chunks[-1].result is results[0] and results[0].stats.resumed == 0
    assert len(group.streams) == 1  # no second attempt
    assert sup.counters["resumed"] == 0
    # the failure was seen all the same: the ranks are restarted for the next requests
    assert sup.counters["rank_restarts"] == 1


class _Stoppable(FlakyGroup):
    """A group whose shutdown empties its ranks, as EngineGroup.shutdown does."""

    def __init__(self, **kw) -> None:
        super().__init__(fail=0, **kw)
        self.ranks = [SimpleNamespace(ping=_Answer())]
        self.closed = False
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.closed = True
        self.shutdowns += 1
        self.ranks = []


def test_serves_health_check_alone_starts_the_monitor_that_finds_a_dead_rank(ray_session):
    """The monitor started with the first request or probe: a replica that Serve's
    health check alone reached never probed its actors, so a rank that died while it
    was idle was never restarted (and `cactus_engine_serving` stayed 1)."""
    from tests.deployments.test_ingress import _shim

    async def run():
        group = _Stoppable()
        group.ranks = [SimpleNamespace(ping=_Answer(fail=True))]  # died while idle
        sup = EngineSupervisor(group, _config())
        shim = _shim(sup)
        for _ in range(10):
            await shim.check_health()  # what Serve calls, every period
            await asyncio.sleep(0.05)
        return group, sup

    group, sup = asyncio.run(run())
    assert group.ranks[0].ping.calls >= 1 and group.restarts >= 1
    assert sup.counters["rank_restarts"] >= 1
    sup.shutdown()


@pytest.mark.parametrize("how", ["supervisor", "group"])
def test_after_shutdown_the_monitor_restarts_nothing(how):
    """The ingress's __del__ shuts the group down (directly, or through the
    supervisor's shutdown): the monitor's next probe finds no ranks, which must not
    start a gang restart of an engine that was shut down."""

    async def run():
        group = _Stoppable()
        sup = EngineSupervisor(group, _config())
        assert (await sup.agenerate(_req("r"))).text == "ok"  # starts the monitor
        await asyncio.sleep(0.12)  # probed while serving
        assert group.ranks[0].ping.calls >= 1
        if how == "supervisor":
            sup.shutdown()
        else:  # what the ingress's __del__ does today
            group.shutdown()
        await asyncio.sleep(0.3)  # six check periods
        with pytest.raises(WorkerUnavailableError, match="shut down"):
            await sup.agenerate(_req("late"))
        return group, sup

    group, sup = asyncio.run(run())
    assert group.restarts == 0 and sup.counters["rank_restarts"] == 0
    assert sup.state == "SERVING" and group.shutdowns == 1
    assert sup._monitor.done()


def test_a_request_waiting_for_a_restart_ends_when_the_engine_shuts_down():
    release = threading.Event()

    class SlowRestart(_Stoppable):
        def restart_ranks(self) -> None:
            release.wait(5.0)
            super().restart_ranks()

    async def run():
        group = SlowRestart()
        group.fail = 1
        sup = EngineSupervisor(group, _config())
        waiting = asyncio.create_task(sup.agenerate(_req("w")))
        while sup.state == "SERVING":
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the request waits for the restart now
        start = time.monotonic()
        sup.shutdown()
        with pytest.raises(WorkerUnavailableError, match="shut down"):
            await asyncio.wait_for(waiting, 4.0)
        ended = time.monotonic() - start
        release.set()
        while sup._recovery is not None and not sup._recovery.done():
            await asyncio.sleep(0.01)
        return ended, group

    ended, group = asyncio.run(run())
    assert ended < 2.0, ended  # at once (the restart holds for 5 s)
    assert group.calls == 1  # never started again


def test_a_cancel_between_attempts_ends_the_request_at_once():
    """A cancel that arrives while a request waits for a gang restart (no attempt runs,
    nothing on rank 0 to cancel) ends it then, not with a fresh attempt after the
    restart; a drain's cut relies on it (tests/deployments/test_drain.py)."""
    release = threading.Event()

    class SlowRestart(FlakyGroup):
        def restart_ranks(self) -> None:
            release.wait(5.0)
            super().restart_ranks()

    async def run():
        group = SlowRestart(fail=1)
        sup = EngineSupervisor(group, _config())
        waiting = asyncio.create_task(sup.agenerate(_req("w")))
        while sup.state == "SERVING":
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        start = time.monotonic()
        sup.cancel("w")
        with pytest.raises(RequestCancelledError):
            await asyncio.wait_for(waiting, 4.0)
        ended = time.monotonic() - start
        release.set()
        while sup.state != "SERVING":
            await asyncio.sleep(0.01)
        after = await sup.agenerate(_req("w"))  # the id is free, nothing stays cancelled
        return ended, group, after

    ended, group, after = asyncio.run(run())
    assert ended < 2.0, ended  # at once (the restart holds for 5 s)
    assert [r.request_id for r in group.seen] == ["w", "w"]  # the first, then the new one
    assert after.text == "ok" and after.stats.resumed == 0


class _DraftNotReplaced(FlakyGroup):
    """A group whose draft actor does not answer and whose every replacement fails;
    `leaves_one`: each failed try leaves a draft that answers the probe (it started,
    but rank 0 could not attach it)."""

    def __init__(self, leaves_one: bool = False) -> None:
        super().__init__(fail=0)
        self.draft = SimpleNamespace(status=_Answer(fail=True))
        self.replacements, self.leaves_one = 0, leaves_one

    def replace_draft(self) -> None:
        self.replacements += 1
        if self.leaves_one:
            self.draft = SimpleNamespace(status=_Answer())  # up, but never attached
            raise RuntimeError("rank 0 did not attach the new draft actor")
        raise RuntimeError("the draft model does not load")


async def _given_up(sup: EngineSupervisor) -> None:
    """Serve a request, then wait until the supervisor gives up on the draft actor."""
    assert (await sup.agenerate(_req("r"))).text == "ok"
    deadline = time.monotonic() + 30
    while not sup.draft_given_up and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def test_a_draft_actor_that_cannot_be_replaced_is_given_up_on():
    """Each replacement starts an actor process and loads the draft model: after
    restart_attempts failed tries the supervisor stops, requests decode plainly."""

    async def run():
        group = _DraftNotReplaced()
        sup = EngineSupervisor(group, _config(restart_attempts=2))
        # 2 tries with 0.5 s and 1 s back-off (given up at ~1.6 s); the old code began
        # a new round at the next probe, every ~1.6 s
        await _given_up(sup)
        await asyncio.sleep(2.5)  # more than a round: none starts
        result = await sup.agenerate(_req("after"))
        return group, sup, result

    group, sup, result = asyncio.run(run())
    assert group.replacements == 2, group.replacements
    assert sup.draft_given_up and sup.counters["draft_restarts"] == 1
    assert group.abandoned == 1  # EngineGroup.abandon_draft: an unattached actor goes
    assert not sup.speculating() and sup.state == "SERVING"
    assert result.text == "ok"


def test_a_draft_that_answers_after_the_give_up_does_not_make_the_server_serving():
    """A replacement that fails after its actor started (rank 0 could not attach it)
    may leave something answering the draft probe; once the supervisor has given up,
    rank 0 has no drafter, so the server ("") must stay NOT_SERVING (speculating False)
    over later probes."""

    async def run():
        group = _DraftNotReplaced(leaves_one=True)
        sup = EngineSupervisor(group, _config(restart_attempts=2))
        await _given_up(sup)
        seen = []
        for _ in range(12):  # several probe periods after the give-up
            seen.append(sup.speculating())
            await asyncio.sleep(0.25)
        return group, sup, seen

    group, sup, seen = asyncio.run(run())
    assert sup.draft_given_up and group.replacements == 2
    assert group.draft.status.calls >= 2  # the probe went on asking it, and it answered
    assert not any(seen), seen
    assert sup.state == "SERVING"


class _RankDiesDuringTheReplacement(FlakyGroup):
    """The draft actor is dead; the first replacement's attach finds rank 0 dead too
    (its ping fails from then on, until a gang restart), the next one works. `events`
    records the order of replacements and restarts."""

    def __init__(self, always: bool = False) -> None:
        super().__init__(fail=0, restart_s=0.3)
        self.draft = SimpleNamespace(status=_Answer(fail=True))
        self.ranks = [SimpleNamespace(ping=_Answer())]
        self.events: list[str] = []
        self.always = always  # every try brings rank 0 down

    def replace_draft(self) -> None:
        if self.ranks[0].ping.fail:  # a try while the ranks are down: never made
            self.events.append("replace-while-down")
            raise RuntimeError("rank 0 died")
        if "restart" not in self.events or self.always:
            self.events.append("replace-failed")
            self.ranks = [SimpleNamespace(ping=_Answer(fail=True))]  # rank 0 died
            raise RuntimeError("rank 0 did not attach the new draft actor")
        self.events.append("replaced")
        self.draft = SimpleNamespace(status=_Answer())

    def restart_ranks(self) -> None:
        super().restart_ranks()
        self.events.append("restart")
        self.ranks = [SimpleNamespace(ping=_Answer())]


def test_a_rank_death_during_a_draft_replacement_does_not_use_up_its_tries():
    """A draft replacement attaches the new actor to rank 0; when rank 0 dies under
    it, that try is not the draft's failure: it is not counted, the ranks are
    restarted, and the replacement is tried again after (never while they are down).
    The old code counted it: with restart_attempts 1 it gave the draft actor up for
    good, although both could run."""

    async def run():
        group = _RankDiesDuringTheReplacement()
        sup = EngineSupervisor(group, _config(restart_attempts=1))
        assert (await sup.agenerate(_req("r"))).text == "ok"  # starts the monitor
        deadline = time.monotonic() + 20
        while "replaced" not in group.events and not sup.draft_given_up:
            assert time.monotonic() < deadline, group.events
            await asyncio.sleep(0.05)
        while sup._replacing_draft is not None:
            await asyncio.sleep(0.01)
        return group, sup

    group, sup = asyncio.run(run())
    assert group.events == ["replace-failed", "restart", "replaced"], group.events
    assert not sup.draft_given_up and sup.draft_ok and sup.speculating()
    assert sup.counters["rank_restarts"] == 1 and sup.state == "SERVING"


def test_replacements_that_bring_the_ranks_down_are_given_up_on_too():
    """The uncounted tries are bounded: a replacement that itself brings rank 0 down
    every time (a draft load that exhausts memory a shared device) is not counted
    restart_attempts times, then counts: the loop of load, rank death, gang restart
    ends with the draft given up, and the ranks serve."""

    async def run():
        group = _RankDiesDuringTheReplacement(always=True)
        sup = EngineSupervisor(group, _config(restart_attempts=1))
        assert (await sup.agenerate(_req("r"))).text == "ok"
        deadline = time.monotonic() + 20
        while not sup.draft_given_up:
            assert time.monotonic() < deadline, group.events
            await asyncio.sleep(0.05)
        while sup.state != "SERVING":
            await asyncio.sleep(0.05)
        return group, sup

    group, sup = asyncio.run(run())
    # one uncounted try, then one counted: restart_attempts = 1 of each
    assert group.events == ["replace-failed", "restart", "replace-failed", "restart"], group.events
    assert sup.draft_given_up and not sup.speculating()


def test_a_restart_that_found_no_live_draft_says_so_at_once():
    """A gang restart (started by a request's failure, so no probe ran) that found the
    draft actor dead, hung or gone (EngineGroup.restart_ranks returns False): the
    server ("") is NOT_SERVING from the restart's end, not from a probe up to
    probe_timeout_s later (the monitor is slowed to one probe a minute here). A restart
    with a live draft actor leaves it SERVING."""

    class Restarts(FlakyGroup):
        def __init__(self, draft_alive) -> None:
            super().__init__(fail=1)
            self.draft_alive = draft_alive

        def restart_ranks(self):
            super().restart_ranks()
            return self.draft_alive

    async def run(draft_alive):
        group = Restarts(draft_alive)
        config = RecoveryConfig(check_period_s=60.0, probe_timeout_s=1.0)
        sup = EngineSupervisor(group, config)
        before = sup.speculating()
        result = await sup.agenerate(_req("r"))  # fails once: a restart, then runs again
        return before, result.text, group.restarts, sup.speculating()

    assert asyncio.run(run(False)) == (True, "ok", 1, False)
    assert asyncio.run(run(True)) == (True, "ok", 1, True)


def test_a_request_waits_through_a_second_restart():
    """A restart that succeeds, then fails again before a waiting request runs (the
    new engine died at once): the request waits for the next restart within its
    deadline; the old code ended it UNAVAILABLE at the first wake-up."""

    async def run():
        group = FlakyGroup(fail=0, restart_s=0.2)
        sup = EngineSupervisor(group, _config())
        failed_again = []

        def fail_again() -> None:  # runs right after the first restart's wake-up
            if sup.state == "SERVING" and group.restarts == 1 and not failed_again:
                failed_again.append(sup.generation)
                sup.engine_failed(sup.generation, "the new engine died at once")

        sup.listeners.append(fail_again)
        sup._ensure_started()
        sup.engine_failed(0, "rank 0 died")
        result = await sup.agenerate(_req("w"))
        return group, sup, result, failed_again

    group, sup, result, failed_again = asyncio.run(run())
    assert failed_again == [1] and group.restarts == 2
    assert result.text == "ok" and sup.state == "SERVING"
    assert [r.request_id for r in group.seen] == ["w"]  # run once, on generation 2


def test_a_gang_restart_without_a_live_draft_does_not_wait_for_it(fake_ray):
    """EngineGroup: a gang restart while the draft actor is gone (a replacement that
    failed left none) or does not answer tells rank 0 so: the old code had rank 0's
    draft client wait up to 10 s for the dead actor's Status in every such restart."""
    from ray.exceptions import GetTimeoutError, RayActorError

    from workers.group import EngineGroup, GroupConfig

    def failing(error: Exception):
        """A draft actor whose reset fails with `error` (Ray's method spelling)."""

        def remote():
            raise error

        return SimpleNamespace(reset=SimpleNamespace(remote=remote))

    group = EngineGroup(GroupConfig(verifier_dir="v", draft_dir="d"))
    seen = []
    group._start_ranks = lambda draft_alive=True: seen.append(draft_alive)
    drafts = [
        None,  # a failed replacement left none
        failing(RayActorError()),  # dead
        failing(GetTimeoutError()),  # hung: the supervisor's probe replaces it
        failing(ValueError("a bug in reset")),  # it answered: it runs, Status is asked
        _Actor("draft", []),
    ]
    returned = []
    for draft in drafts:
        group.draft = draft
        returned.append(group.restart_ranks())  # what the supervisor is told
    assert seen == returned == [False, False, False, True, True]


def test_a_gang_restart_waits_for_the_draft_actors_reset_only_a_probes_time(monkeypatch):
    """EngineGroup: a gang restart resets the draft actor (drops the old rank 0's
    sessions) and waits for that at most `probe_timeout_s` (recovery.probe_timeout_s),
    after which the draft actor is as dead as the supervisor's probe would declare it;
    it waited rpc_timeout_s (30 s) before, holding every stream."""
    import workers.group as group_mod
    from workers.group import EngineGroup, GroupConfig

    timeouts: list = []

    def get(refs, timeout=None):
        timeouts.append(timeout)
        return refs

    monkeypatch.setattr(group_mod, "ray", SimpleNamespace(get=get, kill=lambda actor: None))
    monkeypatch.setattr(group_mod, "kill_processes", lambda where, timeout_s: None)
    group = EngineGroup(GroupConfig(verifier_dir="v", draft_dir="d", probe_timeout_s=4.0))
    group.draft, group.ranks = _Actor("draft", []), [_Actor("rank0", [])]
    group._start_ranks = lambda draft_alive=True: None
    assert group.restart_ranks() is True
    assert timeouts == [4.0]


def test_the_draft_client_can_skip_the_status_of_a_dead_actor(monkeypatch):
    """GrpcDrafter(check=False), what rank 0 builds in a restart without a live draft
    actor: no Status call (the one that waits for the actor to come up)."""
    from workers.grpc_drafter import GrpcDrafter

    calls = []
    monkeypatch.setattr(GrpcDrafter, "_draft_status", lambda self: calls.append(1))
    GrpcDrafter("127.0.0.1:1", vocab_size=8, check=False).close()
    assert calls == []
    GrpcDrafter("127.0.0.1:1", vocab_size=8).close()
    assert calls == [1]


def _replacing(group, new, log: list, loading=None, fail: str = "", attaching=None):
    """Make `group` replace its draft actor with `new` (a fake handle): `loading` and
    `attaching`, Events the new actor's load and its attach to rank 0 wait for; `fail`,
    the wait (its message) that fails."""

    def launch() -> None:
        group.draft, group._draft_serving, group._draft_launched = new, "serve", 0.0

    def wait(ref, what, more=None, since=None):
        log.append(("wait", what))
        if what == "the draft actor did not load" and loading is not None:
            assert loading.wait(10.0)
        if "did not attach" in what and attaching is not None:
            assert attaching.wait(10.0)
        if fail and fail in what:
            raise EngineStartError(what)
        if what == "the draft actor did not load":
            return "127.0.0.1:1"
        if "did not answer" in what:
            return {"node_id": "n1", "process": {"pid": 1}}
        return None

    group._launch_draft, group._wait = launch, wait


@pytest.mark.parametrize("fail", ["did not load", "did not attach"])
def test_a_draft_replacement_that_fails_ends_the_new_actor(fake_ray, fail):
    """EngineGroup: a new draft actor that did not load, or that rank 0 could not
    attach, is killed and forgotten (group.draft None), so it neither holds the bundle
    nor answers probes."""
    from workers.group import EngineGroup, GroupConfig

    log: list = []
    group = EngineGroup(GroupConfig(verifier_dir="v", draft_dir="d"))
    old = _Actor("old-draft", log)
    group.draft, group.ranks = old, [_Actor("rank0", log)]
    new = _Actor("new-draft", log)
    _replacing(group, new, log, fail=fail)
    with pytest.raises(EngineStartError, match=fail):
        group.replace_draft()
    assert group.draft is None and group._loading_draft is None
    assert fake_ray == [old, new]  # both ended
    assert (("rank0", "attach_draft") in log) == (fail == "did not attach")


def _replacement_loading(group, log: list) -> tuple[threading.Thread, list]:
    """Run group.replace_draft on a thread until its new actor's load is entered:
    (the thread, the errors it raised)."""
    errors: list = []

    def replace() -> None:
        try:
            group.replace_draft()
        except BaseException as err:  # checked by the caller
            errors.append(err)

    thread = threading.Thread(target=replace)
    thread.start()
    deadline = time.monotonic() + 5.0
    while ("wait", "the draft actor did not load") not in log:
        assert thread.is_alive() and time.monotonic() < deadline, errors
        time.sleep(0.01)
    return thread, errors


@pytest.mark.parametrize("draft_gpus", [0.0, 0.5], ids=["own-device", "shared-gpu"])
def test_a_gang_restart_does_not_wait_for_a_draft_actor_that_loads(fake_ray, draft_gpus):
    """EngineGroup: a draft replacement loads its actor (a process start and a model
    load) outside the restart lock, so a rank that dies meanwhile is restarted at once,
    without a draft actor, and the new one is then attached to the new rank 0. The old
    code held the lock through the load: the gang restart (every stream) waited for it,
    up to start_timeout_s. A draft actor on a fraction of a GPU (which a rank may share)
    still loads under the lock: the two loads never need their memory at once."""
    from workers.group import ActorResources, EngineGroup, GroupConfig

    log: list = []
    config = GroupConfig(verifier_dir="v", draft_dir="d", draft=ActorResources(num_gpus=draft_gpus))
    group = EngineGroup(config)
    group.draft, group.ranks = _Actor("old-draft", log), [_Actor("rank0", log)]
    new, loading = _Actor("new-draft", log), threading.Event()
    _replacing(group, new, log, loading=loading)
    started = []

    def start_ranks(draft_alive: bool = True) -> None:
        started.append(draft_alive)
        group.ranks = [_Actor("new-rank0", log)]

    group._start_ranks = start_ranks
    replacing, errors = _replacement_loading(group, log)
    restart = threading.Thread(target=lambda: started.append(group.restart_ranks()))
    try:
        restart.start()
        restart.join(2.0 if not draft_gpus else 0.5)
        assert replacing.is_alive()  # still loading
        if draft_gpus:  # waits for the load, then restarts with the new actor
            assert restart.is_alive() and started == []
        else:
            assert not restart.is_alive(), "the gang restart waited for the draft's load"
            # the loading actor is not the group's draft yet: it is neither reset nor
            # waited for, and rank 0 starts without one
            assert started == [False, False] and ("new-draft", "reset") not in log
    finally:
        loading.set()
        replacing.join(5.0)
        restart.join(5.0)
    assert not replacing.is_alive() and not restart.is_alive()
    assert not errors and group.draft is new and group.draft_address == "127.0.0.1:1"
    assert group.placement["draft"] == "n1" and group._loading_draft is None
    if draft_gpus:  # the restart ran once the new actor was recorded: it reset it,
        # and the attach went to whichever rank 0 ran then (both orders are fine)
        assert ("new-draft", "reset") in log and started == [True, True]
        # no second attach to a rank 0 the restart connected already
        assert ("new-rank0", "attach_draft") not in log
    else:
        assert ("new-rank0", "attach_draft") in log and ("rank0", "attach_draft") not in log


class _DeadRank:
    """A rank whose process is gone: every call's ray.get raises as Ray's would."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __getattr__(self, method):
        def remote(*args, **kwargs):
            from ray.exceptions import RayActorError

            self.log.append((self.name, method))
            return RayActorError()  # the fake ray.get raises what it is given

        return SimpleNamespace(remote=remote)


def _kept_after_a_silent_attach(log: list):
    """An EngineGroup (fake Ray) whose draft replacement loaded a new actor that rank 0,
    silent, did not attach: the attach is owed and the loaded actor kept. Returns
    (group, the kept actor); the old draft actor was ended."""
    from workers.group import EngineGroup, GroupConfig

    group = EngineGroup(GroupConfig(verifier_dir="v", draft_dir="d"))
    group.draft, group.ranks = _Actor("old-draft", log), [_DeadRank("rank0", log)]
    kept = _Actor("kept", log)
    _replacing(group, kept, log, fail="did not attach")
    with pytest.raises(EngineStartError, match="does not answer"):
        group.replace_draft()
    assert group.draft is kept and group._attach_owed
    return group, kept


@pytest.mark.parametrize("then", ["ranks-restarted", "rank0-answers-again"])
def test_an_attach_that_fails_with_rank0_silent_keeps_the_new_draft_actor(fake_ray, then):
    """EngineGroup.replace_draft: an attach that fails while rank 0 does not answer its
    ping keeps the loaded actor (the group's draft actor from then on) and raises: the
    attach is owed. If rank 0 was dead, the gang restart that follows resets the new
    actor and connects the new rank 0 to it, and the supervisor's next try finds nothing
    to do; if rank 0 was only slow, the next try attaches the kept actor. Neither loads
    a second one (the old code ended the loaded actor, and the next try loaded another)."""
    log: list = []
    group, new = _kept_after_a_silent_attach(log)
    assert [a.name for a in fake_ray] == ["old-draft"] and ("rank0", "ping") in log
    load = ("wait", "the draft actor did not load")
    assert log.count(load) == 1
    if then == "ranks-restarted":  # the supervisor's probe found rank 0 dead
        started = []

        def start_ranks(draft_alive: bool = True) -> None:
            started.append(draft_alive)
            group.ranks = [_Actor("new-rank0", log)]

        group._start_ranks = start_ranks
        assert group.restart_ranks() is True
        assert started == [True] and ("kept", "reset") in log
    else:  # it was only slow: it answers again
        group.ranks = [_Actor("rank0-again", log)]
    _replacing(group, _Actor("unused", log), log)  # the next try's load, were it made
    group.replace_draft()  # the supervisor's next try
    assert group.draft is new and new not in fake_ray and log.count(load) == 1
    attached = [name for name, method in log if method == "attach_draft"]
    # (the first, failed attach, then the owed one where no restart connected it)
    assert attached == ["rank0"] + ([] if then == "ranks-restarted" else ["rank0-again"])
    assert group._draft_user == group.rank_generation and not group._attach_owed


def test_a_give_up_ends_a_kept_actor_that_rank0_never_attached(fake_ray):
    """EngineGroup.abandon_draft (the supervisor's give-up): the actor kept for an owed
    attach is ended, so the next gang restart starts the ranks without a drafter. Left
    recorded, it held its bundle and the restart connected the new rank 0 to it, while
    the replica reported no speculation for good. The actor rank 0 drafts with is not
    ended."""
    log: list = []
    group, kept = _kept_after_a_silent_attach(log)
    assert kept not in fake_ray
    group.abandon_draft()
    assert group.draft is None and not group._attach_owed and kept in fake_ray
    started = []

    def start_ranks(draft_alive: bool = True) -> None:
        started.append(draft_alive)
        group.ranks = [_Actor("new-rank0", log)]

    group._start_ranks = start_ranks
    assert group.restart_ranks() is False and started == [False]
    assert ("kept", "reset") not in log
    in_use = group.draft = _Actor("in-use", log)  # one the new rank 0 drafts with
    group._draft_user = group.rank_generation
    group.abandon_draft()
    assert group.draft is in_use and in_use not in fake_ray


def test_a_give_up_ends_the_kept_actor_a_gang_restart_connected_meanwhile(fake_ray):
    """The other order: the give-up comes once the ranks' failure was counted, and the
    gang restart that failure started runs during the supervisor's back-off, resets the
    kept actor and connects the new rank 0 to it. abandon_draft then found it in use and
    left it: the replica drafted with it while reporting no speculation for good. The
    owed attach marks it as the last try's: it is ended (rank 0's requests then decode
    plainly, as the give-up says)."""
    log: list = []
    group, kept = _kept_after_a_silent_attach(log)
    group._start_ranks = lambda draft_alive=True: setattr(
        group, "ranks", [_Actor("new-rank0", log)]
    )
    assert group.restart_ranks() is True and ("kept", "reset") in log
    assert group._draft_user == group.rank_generation  # the new rank 0 drafts with it
    group.abandon_draft()
    assert group.draft is None and kept in fake_ray and not group._attach_owed


def test_an_owed_attach_of_a_kept_actor_that_died_loads_a_new_one(fake_ray):
    """EngineGroup.replace_draft: the next try after an owed attach asks the kept actor
    first; one that died since (its status fails) is ended and replaced by a new load,
    not attached (rank 0 would take a dead actor and decode without drafts)."""
    log: list = []
    group, _ = _kept_after_a_silent_attach(log)
    group.draft = dead = _DeadRank("kept-dead", log)  # the kept actor died since
    group.ranks = [_Actor("rank0-again", log)]
    fresh = _Actor("fresh", log)
    _replacing(group, fresh, log)
    group.replace_draft()
    assert group.draft is fresh and dead in fake_ray and ("kept-dead", "status") in log
    assert log.count(("wait", "the draft actor did not load")) == 2
    assert ("rank0-again", "attach_draft") in log and ("kept-dead", "reset") not in log


def test_a_rank0_whose_restart_failed_part_way_is_not_attached_to(fake_ray):
    """EngineGroup: a gang restart that raised after starting the new ranks but before
    rank 0 connected leaves a rank 0 that answers its ping but has no engine. A new draft
    actor is not attached there (that attach fails, the ping answers, and the loaded
    actor would be ended): it stays the group's, and the next restart connects it."""
    from workers.group import EngineGroup, GroupConfig

    log: list = []
    group = EngineGroup(GroupConfig(verifier_dir="v", draft_dir="d"))
    group.draft, group.ranks = _Actor("old-draft", log), [_Actor("rank0", log)]

    def start_fails(draft_alive: bool = True) -> None:
        group.ranks = [_Actor("half-started-rank0", log)]
        raise EngineStartError("rank 0 did not connect to the draft actor")

    group._start_ranks = start_fails
    with pytest.raises(EngineStartError):
        group.restart_ranks()
    new = _Actor("new-draft", log)
    _replacing(group, new, log)
    group.replace_draft()
    assert group.draft is new and new not in fake_ray
    assert not [name for name, method in log if method == "attach_draft"]
    started = []
    group._start_ranks = lambda draft_alive=True: started.append(draft_alive)
    assert group.restart_ranks() is True and started == [True]
    assert group._draft_user == group.rank_generation


def test_a_gang_restart_does_not_wait_for_a_draft_actors_attach(fake_ray):
    """EngineGroup: the attach of a new draft actor to rank 0 runs outside the restart
    lock. A hung rank 0 keeps an attach waiting (up to start_timeout_s); the gang restart
    that the supervisor's probe starts meanwhile goes ahead at once, connects the new
    ranks to the new draft actor, and the attach that then fails is no failure of the
    replacement. The old code held the lock through the attach."""
    from workers.group import EngineGroup, GroupConfig

    log: list = []
    group = EngineGroup(GroupConfig(verifier_dir="v", draft_dir="d"))
    group.draft, group.ranks = _Actor("old-draft", log), [_Actor("rank0", log)]
    new, attaching = _Actor("new-draft", log), threading.Event()
    _replacing(group, new, log, fail="did not attach", attaching=attaching)
    started = []

    def start_ranks(draft_alive: bool = True) -> None:
        started.append(draft_alive)
        group.ranks = [_Actor("new-rank0", log)]

    group._start_ranks = start_ranks
    errors: list = []
    replacing = threading.Thread(
        target=lambda: _record_errors(group.replace_draft, errors), daemon=True
    )
    replacing.start()
    deadline = time.monotonic() + 5.0
    while ("wait", "rank 0 did not attach the new draft actor") not in log:
        assert replacing.is_alive() and time.monotonic() < deadline, errors
        time.sleep(0.01)
    restart = threading.Thread(target=lambda: started.append(group.restart_ranks()))
    try:
        restart.start()
        restart.join(2.0)
        assert not restart.is_alive(), "the gang restart waited for the draft's attach"
        assert started == [True, True] and ("new-draft", "reset") in log
    finally:
        attaching.set()
        replacing.join(5.0)
    assert not replacing.is_alive()
    # the attach failed, but the restart had connected the new ranks to the new actor
    assert not errors and group.draft is new and new not in fake_ray
    assert group._draft_user == group.rank_generation and not group._attach_owed


def _record_errors(call, errors: list) -> None:
    try:
        call()
    except BaseException as err:  # checked by the caller
        errors.append(err)


def test_a_shutdown_while_a_draft_replacement_loads_ends_the_loading_actor(fake_ray):
    """EngineGroup.shutdown does not wait for a replacement's load (it holds no lock
    then), so it ends the loading actor itself, and the replacement, once loaded, is
    refused rather than attached."""
    from workers.group import EngineGroup, GroupConfig

    log: list = []
    group = EngineGroup(GroupConfig(verifier_dir="v", draft_dir="d"))
    group.draft, group.ranks = _Actor("old-draft", log), [_Actor("rank0", log)]
    new, loading = _Actor("new-draft", log), threading.Event()
    _replacing(group, new, log, loading=loading)
    replacing, errors = _replacement_loading(group, log)
    shutdown = threading.Thread(target=group.shutdown)
    try:
        shutdown.start()
        shutdown.join(2.0)
        assert not shutdown.is_alive(), "shutdown waited for the draft actor's load"
        assert new in fake_ray  # ended while it loaded
    finally:
        loading.set()
        replacing.join(5.0)
    assert not replacing.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], EngineStartError)
    assert ("new-draft", "shutdown") not in log and ("rank0", "attach_draft") not in log
    assert group.draft is None and group._loading_draft is None


def test_a_replacement_whose_launch_fails_or_that_a_newer_one_overtakes_is_ended(fake_ray):
    """EngineGroup.replace_draft: an actor launched when its serve() call then raised is
    ended (not left in `draft`, answering probes that rank 0 never drafts with); and a
    replacement started while an abandoned one still loads ends that one, which then
    fails instead of attaching."""
    from workers.group import EngineGroup, GroupConfig

    log: list = []
    group = EngineGroup(GroupConfig(verifier_dir="v", draft_dir="d"))
    group.draft, group.ranks = _Actor("old-draft", log), [_Actor("rank0", log)]
    launched = _Actor("launched", log)

    def launch_fails() -> None:
        group.draft = launched
        raise RuntimeError("serve() failed")

    group._launch_draft = launch_fails
    with pytest.raises(RuntimeError, match="serve"):
        group.replace_draft()
    assert launched in fake_ray and group.draft is None

    first, loading = _Actor("first", log), threading.Event()
    _replacing(group, first, log, loading=loading)
    replacing, errors = _replacement_loading(group, log)
    try:
        second = _Actor("second", log)
        _replacing(group, second, log)  # this one loads at once
        group.replace_draft()
        assert first in fake_ray and group.draft is second
    finally:
        loading.set()
        replacing.join(5.0)
    assert not replacing.is_alive()
    assert len(errors) == 1 and "ended while it loaded" in str(errors[0])
    assert group.draft is second and group._loading_draft is None
    assert [name for name, method in log if method == "attach_draft"] == ["rank0"]


# ---- EngineGroup.shutdown against a gang restart -------------------------------------


class _Actor:
    """A Ray actor handle whose method calls are recorded; ray.get (patched) returns
    what .remote() returned."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __getattr__(self, method):
        return SimpleNamespace(remote=lambda *a, **k: self.log.append((self.name, method)))


@pytest.fixture
def fake_ray(monkeypatch):
    import workers.group as group_mod

    killed: list = []

    def get(refs, timeout=None):
        if isinstance(refs, BaseException):  # a fake call that fails (_DeadRank)
            raise refs
        return refs

    fake = SimpleNamespace(get=get, kill=killed.append)
    monkeypatch.setattr(group_mod, "ray", fake)
    monkeypatch.setattr(group_mod, "kill_processes", lambda where, timeout_s: None)
    return killed


def test_group_shutdown_waits_for_a_restart_and_refuses_later_ones(fake_ray):
    from workers.group import EngineGroup, GroupConfig

    log: list = []
    group = EngineGroup(GroupConfig(verifier_dir="v", draft_dir="d"))
    group.draft = _Actor("draft", log)
    group.ranks = [_Actor("rank0", log)]
    in_start, release = threading.Event(), threading.Event()
    starts = []

    def start_ranks(draft_alive: bool = True) -> None:  # the slow part of a restart
        starts.append(1)
        in_start.set()
        release.wait(5.0)
        group.ranks = [_Actor("new-rank0", log)]

    group._start_ranks = start_ranks
    restart = threading.Thread(target=group.restart_ranks)
    restart.start()
    assert in_start.wait(2.0) and group.ranks == []  # mid-restart: no ranks
    shutdown = threading.Thread(target=group.shutdown)
    shutdown.start()
    time.sleep(0.1)
    assert shutdown.is_alive()  # waits for the restart instead of racing it
    release.set()
    restart.join(2.0)
    shutdown.join(2.0)
    assert not shutdown.is_alive()
    # the draft actor and the restarted rank were shut down, nothing left running
    assert ("draft", "shutdown") in log and ("new-rank0", "shutdown") in log
    assert group.ranks == [] and group.draft is None and group.closed
    with pytest.raises(EngineStartError, match="shut down"):
        group.restart_ranks()
    with pytest.raises(EngineStartError, match="shut down"):
        group.replace_draft()
    assert len(starts) == 1


def test_a_cancel_drops_a_call_still_queued_for_a_rank0_thread(ray_session):
    """Rank 0 runs at most max_concurrency calls at once; a batch of prompts (HTTP `n`,
    a prompt list) can queue more. A cancel (a drain's cut, a client's) must end a
    queued call too (a drain's cut frees the running calls' threads at once, and the
    queued ones would then start and run to their max_tokens): rank 0's cancel flag
    only reaches a call that has started, so EngineGroup.cancel drops the queued one
    (ray.cancel). It never runs; its caller gets RequestCancelledError when rank 0's
    thread frees (Ray answers a dropped call when it reaches the front of the queue)."""
    import ray

    from workers.group import EngineGroup, GroupConfig

    @ray.remote(max_concurrency=1, concurrency_groups={"control": 1})
    class OneThreadRank:
        def __init__(self) -> None:
            self.started: list[str] = []
            self.flags: dict[str, threading.Event] = {}

        def generate(self, request):
            flag = self.flags.setdefault(request.request_id, threading.Event())
            self.started.append(request.request_id)
            if flag.wait(timeout=30):
                raise RequestCancelledError(f"request {request.request_id} was cancelled")
            return "done"

        @ray.method(concurrency_group="control")
        def cancel(self, request_id: str) -> None:  # as VerifierRank's: started calls only
            flag = self.flags.get(request_id)
            if flag is not None:
                flag.set()

        @ray.method(concurrency_group="control")
        def seen(self) -> list[str]:
            return list(self.started)

    rank0 = OneThreadRank.remote()
    group = EngineGroup(GroupConfig(verifier_dir="v", draft_dir="d"))
    group.ranks = [rank0]

    async def outcome(task) -> str:
        try:
            await asyncio.wait_for(task, 10.0)
            return "finished"
        except RequestCancelledError:
            return "cancelled"
        except TimeoutError:
            return "still waiting"

    async def run():
        running = asyncio.ensure_future(group.agenerate(_req("running")))
        while await rank0.seen.remote() != ["running"]:
            await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(group.agenerate(_req("queued")))
        await asyncio.sleep(0.5)  # queued behind "running" on rank 0's one thread
        start = time.monotonic()
        group.cancel("queued")
        group.cancel("running")  # the started call: by rank 0's flag
        outcomes = [await outcome(running), await outcome(queued)]
        took = time.monotonic() - start
        await asyncio.sleep(0.5)  # a dropped call that wrongly started would show now
        return outcomes, took, await rank0.seen.remote()

    outcomes, took, seen = asyncio.run(run())
    # on the old code the queued call started once "running" ended, and waited 30 s
    assert outcomes == ["cancelled", "cancelled"] and took < 5.0, (outcomes, took)
    assert seen == ["running"]  # the queued call never ran
    assert group._calls == {}  # nothing left registered
    ray.kill(rank0)


def test_a_draft_replacement_clearing_the_actor_mid_probe_does_not_break_the_probe():
    """The probe read `group.draft` twice; a draft replacement (another thread) sets it
    to None while it loads the new actor, and a None between the two reads raised
    AttributeError, which ended the monitor until the next request or health check.
    It now reads it once: the probe answers, saying the draft is not there."""

    class Vanishing(FlakyGroup):
        def __init__(self) -> None:
            super().__init__(fail=0)
            self.reads = 0
            self.actor = SimpleNamespace(status=_Answer())

        @property
        def draft(self):
            self.reads += 1
            return self.actor if self.reads == 1 else None  # gone after the first read

        @draft.setter
        def draft(self, value) -> None:
            pass

    async def run():
        group = Vanishing()
        sup = EngineSupervisor(group, _config())
        return await sup._probe(), group.reads

    (ranks_ok, draft_ok), reads = asyncio.run(run())
    assert ranks_ok and draft_ok and reads == 1
