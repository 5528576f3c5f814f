"""The engine supervisor (workers/supervisor.py) against real actor deaths: a killed
draft actor is replaced while its requests go on (health SERVING throughout), a killed
verifier rank restarts the TP group and every stream resumes where it was, with no
token lost or repeated (greedy streams equal their uninterrupted output)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import replace

import pytest
import ray

from cactus.errors import EngineFailedError, is_engine_failure, is_unavailable
from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
from tests.conftest import embedded_dirs
from workers.group import EngineGroup, GroupConfig
from workers.processes import identity, is_running
from workers.supervisor import EngineSupervisor, RecoveryConfig

pytestmark = pytest.mark.slow


def _req(prompt, rid, **sampling):
    return GenerationRequest(
        prompt_token_ids=tuple(prompt),
        request_id=rid,
        sampling=SamplingParams(**sampling),
        speculation=SpeculationParams(rule="cactus", delta=1.0),
    )


async def _collect(sup, req, chunks: list) -> None:
    async for chunk in sup.astream(req):
        chunks.append(chunk)


async def _health_poll(sup, seen: list, stop: asyncio.Event) -> None:
    """Ask for health every 50 ms as a load balancer would; record (answer, when)."""
    while not stop.is_set():
        seen.append((await sup.ahealthy(), time.monotonic()))
        await asyncio.sleep(0.05)


def _answered_throughout(health: list, bound_s: float = 2.0) -> None:
    """A Check is answered on the replica's event loop, without a call to any actor, so
    its own time says nothing; what can fail is the loop: a recovery step run on it (a
    blocking Ray call, a restart) would stop the 50 ms polls for its whole length,
    seconds. The polls never stopped for bound_s."""
    times = [t for _, t in health]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) > 10 and max(gaps) < bound_s, (len(times), max(gaps, default=None))


def _streams_under_watch(sup, reqs):
    """Start one stream per request and a health poller (call inside the event loop):
    (chunks per request, their tasks, health record, poller stop event, poller task)."""
    chunks: list[list] = [[] for _ in reqs]
    health: list = []
    stop = asyncio.Event()
    poll = asyncio.create_task(_health_poll(sup, health, stop))
    tasks = [asyncio.create_task(_collect(sup, r, c)) for r, c in zip(reqs, chunks, strict=True)]
    return chunks, tasks, health, stop, poll


_REFERENCES: dict[str, object] = {}  # request (less its id) -> its uninterrupted result


def _uninterrupted(engine, req):
    """The request's result on the in-process engine, never interrupted; computed once
    per request (the draft-kill and hung-actor tests share their prompts and lengths)."""
    key = repr(replace(req, request_id=""))
    if key not in _REFERENCES:
        _REFERENCES[key] = engine.generate(replace(req, request_id="ref-" + req.request_id))
    return _REFERENCES[key]


def _check_streams(reqs, chunks, engine) -> None:
    for req, got in zip(reqs, chunks, strict=True):
        result = got[-1].result
        assert result is not None and result.request_id == req.request_id
        streamed = [t for c in got for t in c.token_ids]
        assert streamed == list(result.token_ids)  # no gap, no duplicate on the wire
        assert "".join(c.text for c in got) == result.text
        if req.sampling.temperature == 0.0:
            assert result.token_ids == _uninterrupted(engine, req).token_ids
        else:
            assert len(result.token_ids) == req.sampling.max_tokens or result.finish_reason in (
                "EOS",
                "STOP",
            )


def _bundle(actor) -> tuple[str, int]:
    """(placement group id, bundle index) an engine actor was scheduled into: an actor
    in bundle i of group g holds the resource `bundle_group_i_g`. Read in the actor
    from its core worker (private: the state API needs the dashboard, which the test
    session does not start)."""
    import re

    def held(self) -> list[str]:
        import ray

        return list(ray._private.worker.global_worker.core_worker.resource_ids())

    names = ray.get(actor.__ray_call__.remote(held))
    (found,) = [m for k in names if (m := re.fullmatch(r"bundle_group_(\d+)_(\w+)", k))]
    return found.group(2), int(found.group(1))


def _prompts(engine, texts, n):
    return [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts[:n]]


def test_one_place_classifies_engine_failures():
    assert is_engine_failure(EngineFailedError("x"))
    assert is_engine_failure(RuntimeError("[gloo/transport] Connection closed by peer"))
    assert not is_engine_failure(RuntimeError("shape mismatch"))
    assert not is_engine_failure(ValueError("gloo"))
    assert is_unavailable(ray.exceptions.GetTimeoutError("slow"))
    assert not is_unavailable(KeyError("bug"))


def test_a_killed_draft_actor_is_replaced_and_requests_speculate_again(
    ray_session, embedded_engine, heldout_prompts
):
    """README: the new draft actor starts in the same bundle (nothing is reserved
    again) and computes with `resources.threads_per_actor` threads, as rank 0 does."""
    verifier, draft = embedded_dirs()
    group = EngineGroup(
        GroupConfig(
            verifier, draft, tp_size=1, rpc_timeout_s=5, speculation_policy="fixed", threads=2
        )
    ).start()
    first = ray.get(group.draft.status.remote())
    assert first["threads"] == 2 and ray.get(group.ranks[0].status.remote())["threads"] == 2
    assert _bundle(group.draft) == (group.pg.id.hex(), 0)
    sup = EngineSupervisor(group, RecoveryConfig(check_period_s=0.2, probe_timeout_s=5))
    _pace(group.ranks[0])
    # the hung-actor test's prompts and lengths: their references are computed once
    prompts = _prompts(embedded_engine, heldout_prompts[2:], 2)
    # Long enough to outlive the replacement (a new worker process loads the model).
    reqs = [
        _req(p, f"draft-kill{i}", temperature=0.0, max_tokens=600) for i, p in enumerate(prompts)
    ]

    async def scenario():
        chunks, tasks, health, stop, poll = _streams_under_watch(sup, reqs)
        while not all(chunks):
            await asyncio.sleep(0.01)
        old = group.draft
        assert sup.speculating()
        killed = time.monotonic()
        ray.kill(old)
        # the whole server's health (""): not speculating from the probe that finds the
        # draft actor gone until the new one is up, then again
        speculating: list[tuple[float, bool]] = []
        while time.monotonic() - killed < 60:
            now = sup.speculating()
            speculating.append((round(time.monotonic() - killed, 2), now))
            if now and not all(s for _, s in speculating):
                break
            await asyncio.sleep(0.05)
        assert not all(s for _, s in speculating), speculating
        assert speculating[-1][1], ("still not speculating 60 s after the kill", speculating)
        assert group.draft is not old
        while not ray.get(group.draft.status.remote())["blocks_proposed"]:
            assert not all(t.done() for t in tasks), "the requests ended before re-speculating"
            await asyncio.sleep(0.05)
        respeculating_s = time.monotonic() - killed
        await asyncio.gather(*tasks)
        stop.set()
        await poll
        return chunks, health, respeculating_s

    try:
        chunks, health, respeculating_s = asyncio.run(scenario())
        # taking requests throughout: degraded, not down (`cactus.v1.Cactus` SERVING)
        assert all(ok for ok, _ in health)
        _answered_throughout(health)
        assert respeculating_s < 30.0, respeculating_s  # reported figure: see the chaos bench
        _check_streams(reqs, chunks, embedded_engine)
        for got in chunks:
            stats = got[-1].result.stats
            assert stats.draft_failures >= 1 and stats.degraded and stats.resumed == 0
        assert sup.counters["draft_restarts"] == 1 and sup.counters["rank_restarts"] == 0
        second = ray.get(group.draft.status.remote())
        assert second["actor_id"] != first["actor_id"] and second["threads"] == 2
        assert _bundle(group.draft) == (group.pg.id.hex(), 0)
        print(f"draft killed: speculating again after {respeculating_s:.1f} s")
    finally:
        group.shutdown()


def _pace(rank, seconds: float = 0.015) -> None:
    """Rank 0 sleeps `seconds` after each step, so that streams decoding without drafts
    cannot outrun a draft actor's replacement (a process start and a model load, 8-9 s
    on a 2-core machine) however fast or loaded the machine is."""

    def arm(actor):
        record = actor.loop.on_step

        def on_step(engine, batch):
            time.sleep(seconds)
            record(engine, batch)

        actor.loop.on_step = on_step

    ray.get(rank.__ray_call__.remote(arm))


def _fail_the_next_forward(rank) -> None:
    """The follower's next forward raises (an out-of-memory on its GPU, say) while rank 0
    goes on into the collective."""

    def arm(actor):
        def boom(*args, **kwargs):
            raise RuntimeError("injected: the follower's forward failed")

        actor.runner.forward = boom

    ray.get(rank.__ray_call__.remote(arm))


@pytest.mark.parametrize("victim", [1, 0, "raises"], ids=["follower", "rank0", "follower-raises"])
def test_a_killed_rank_restarts_the_group_and_streams_resume(
    ray_session, embedded_engine, heldout_prompts, victim
):
    """A rank killed, or a follower whose operation raised (rank 0 then waits in its
    next collective; the follower's ping fails, so the probe restarts the group)."""
    verifier, draft = embedded_dirs()
    group = EngineGroup(
        GroupConfig(verifier, draft, tp_size=2, rpc_timeout_s=5, speculation_policy="fixed")
    ).start()
    sup = EngineSupervisor(group, RecoveryConfig(check_period_s=0.2, probe_timeout_s=5))
    prompts = _prompts(embedded_engine, heldout_prompts[4:], 4)
    reqs = [
        _req(prompts[0], f"k{victim}-greedy0", temperature=0.0, max_tokens=80),
        _req(prompts[1], f"k{victim}-greedy1", temperature=0.0, max_tokens=80, stop=("\n\n\n",)),
        _req(prompts[2], f"k{victim}-sampled", temperature=0.8, max_tokens=80, seed=11),
        _req(prompts[3], f"k{victim}-unseeded", temperature=1.0, max_tokens=80),
    ]

    async def scenario():
        chunks, tasks, health, stop, poll = _streams_under_watch(sup, reqs)
        unary = asyncio.create_task(sup.agenerate(unary_req))  # nothing sent: runs again
        while not all(chunks):
            await asyncio.sleep(0.01)
        killed = time.monotonic()
        if victim == "raises":
            _fail_the_next_forward(group.ranks[1])
        else:
            ray.kill(group.ranks[victim])
        # A request that arrives while the ranks restart waits for them (README).
        while sup.state == "SERVING" and time.monotonic() - killed < 30:
            await asyncio.sleep(0.01)
        assert sup.state != "SERVING", "the supervisor never noticed the kill"
        during = asyncio.create_task(
            sup.agenerate(_req(prompts[1], f"k{victim}-during", temperature=0.0, max_tokens=8))
        )
        await asyncio.gather(*tasks)
        unary_result = await unary
        during_result = await during
        # A request that arrives after the restart is served normally.
        late = await sup.agenerate(
            _req(prompts[0], f"k{victim}-late", temperature=0.0, max_tokens=8)
        )
        stop.set()
        await poll
        return chunks, health, killed, late, unary_result, during_result

    unary_req = _req(prompts[0], f"k{victim}-unary", temperature=0.7, seed=5, max_tokens=80)
    try:
        chunks, health, killed, late, unary_result, during = asyncio.run(scenario())
        want = _req(prompts[1], "during-ref", temperature=0.0, max_tokens=8)
        assert during.token_ids == _uninterrupted(embedded_engine, want).token_ids
        assert not during.stats.resumed  # it started on the new engine, nothing to resume
        # A seeded unary request that was running gives exactly its uninterrupted result.
        assert unary_result.token_ids == _uninterrupted(embedded_engine, unary_req).token_ids
        assert unary_result.request_id == unary_req.request_id and unary_result.seed == 5
        _check_streams(reqs, chunks, embedded_engine)
        assert any(got[-1].result.stats.resumed for got in chunks)
        assert sup.counters["rank_restarts"] == 1 and sup.state == "SERVING"
        _answered_throughout(health)
        down = [at for ok, at in health if not ok and at >= killed]
        assert down, "health never said NOT_SERVING during the restart"
        back = min(at for ok, at in health if ok and at > max(down))
        assert (
            late.token_ids
            == _uninterrupted(
                embedded_engine, _req(prompts[0], "late-ref", temperature=0.0, max_tokens=8)
            ).token_ids
        )
        # the new ranks took the old ranks' bundle (bundle 1: every rank together)
        for rank in group.ranks:
            assert _bundle(rank) == (group.pg.id.hex(), 1)
        print(f"rank {victim} killed: SERVING again after {back - killed:.1f} s")
        assert back - killed < 60.0
    finally:
        group.shutdown()


PROBE_S = 2.0  # the hung-actor tests' probe timeout


def _probed_group(tp_size: int, *, draft: str | None = None, **recovery):
    """A started group of the embedded pair (`draft`: another draft folder) and its
    supervisor, probing every 0.2 s with a PROBE_S timeout unless `recovery` says."""
    verifier, embedded_draft = embedded_dirs()
    group = EngineGroup(
        GroupConfig(
            verifier,
            draft or embedded_draft,
            tp_size=tp_size,
            rpc_timeout_s=5,
            speculation_policy="fixed",
        )
    ).start()
    config = {"check_period_s": 0.2, "probe_timeout_s": PROBE_S, **recovery}
    return group, EngineSupervisor(group, RecoveryConfig(**config))


def test_a_hung_follower_rank_restarts_the_group_and_the_stream_resumes(
    ray_session, embedded_engine, heldout_prompts
):
    """README (an actor that hangs), for the one rank the test above leaves out: a
    follower of a TP = 2 group stopped (SIGSTOP) mid-stream blocks rank 0's all-reduce;
    its probe times out, the group restarts (the stopped process is ended, not waited
    for) and the greedy stream resumes to its uninterrupted tokens."""
    import os
    import signal

    group, sup = _probed_group(tp_size=2)
    (prompt,) = _prompts(embedded_engine, heldout_prompts[4:], 1)
    reqs = [_req(prompt, "hung-f", temperature=0.0, max_tokens=300)]
    ident = ray.get(group.ranks[1].__ray_call__.remote(lambda _self: identity()))
    follower = ident["pid"]

    async def scenario():
        chunks, tasks, health, stop, poll = _streams_under_watch(sup, reqs)
        while not all(chunks):
            await asyncio.sleep(0.01)
        os.kill(follower, signal.SIGSTOP)
        stopped = time.monotonic()
        while not sup.counters["rank_restarts"] and time.monotonic() - stopped < 30:
            await asyncio.sleep(0.02)
        noticed = time.monotonic() - stopped
        while sup.state != "SERVING" or not sup.counters["rank_restarts"]:
            assert time.monotonic() - stopped < 120, sup.state
            await asyncio.sleep(0.05)
        serving = time.monotonic() - stopped
        await asyncio.gather(*tasks)
        stop.set()
        await poll
        return chunks, health, noticed, serving

    try:
        chunks, health, noticed, serving = asyncio.run(scenario())
        assert noticed < PROBE_S + 3.0 and serving < 60.0, (noticed, serving)
        _answered_throughout(health)
        _check_streams(reqs, chunks, embedded_engine)
        assert chunks[0][-1].result.stats.resumed >= 1
        assert sup.counters["rank_restarts"] == 1 and sup.state == "SERVING"
        assert not is_running(ident)  # ended by the group, not left stopped
        print(f"hung follower: noticed after {noticed:.1f} s, serving again after {serving:.1f} s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(follower, signal.SIGCONT)
        group.shutdown()


def test_hung_actors_are_declared_dead_by_their_probe(
    ray_session, embedded_engine, heldout_prompts
):
    """README: an actor that does not answer a probe within `recovery.probe_timeout_s` is
    dead. A process that hangs (SIGSTOP: alive to Ray, answering nothing) is treated as
    one that died. Here the draft actor hangs first: it is replaced while the requests go
    on degraded (health SERVING); then rank 0 hangs: the group restarts and the streams
    resume. Greedy streams equal their uninterrupted output."""
    import os
    import signal

    group, sup = _probed_group(tp_size=1)
    _pace(group.ranks[0])
    prompts = _prompts(embedded_engine, heldout_prompts[2:], 2)
    reqs = [_req(p, f"hung{i}", temperature=0.0, max_tokens=600) for i, p in enumerate(prompts)]
    stopped_pids: list[int] = []
    stopped_idents: list[dict] = []

    async def hang(actor, counter: str, done) -> tuple[float, float]:
        """SIGSTOP the actor's process: seconds until the supervisor acts on it, and
        until `done()` (the actor replaced and working)."""
        ident = ray.get(actor.__ray_call__.remote(lambda _self: identity()))
        pid = ident["pid"]
        stopped_pids.append(pid)
        stopped_idents.append(ident)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while not sup.counters[counter] and time.monotonic() - stopped < 30:
            await asyncio.sleep(0.02)
        noticed = time.monotonic() - stopped
        while not done() and time.monotonic() - stopped < 120:
            await asyncio.sleep(0.05)
        return noticed, time.monotonic() - stopped

    def draft_working() -> bool:
        return (
            sup.degraded_since is None
            and group.draft is not None
            and ray.get(group.draft.status.remote())["blocks_proposed"] > 0
        )

    async def scenario():
        chunks, tasks, health, stop, poll = _streams_under_watch(sup, reqs)
        while not all(chunks):
            await asyncio.sleep(0.01)
        draft_s = await hang(group.draft, "draft_restarts", draft_working)
        draft_health = list(health)
        assert not any(t.done() for t in tasks), "the streams ended before rank 0 hung"
        rank_s = await hang(group.ranks[0], "rank_restarts", lambda: sup.state == "SERVING")
        await asyncio.gather(*tasks)
        stop.set()
        await poll
        return chunks, health, draft_health, draft_s, rank_s

    try:
        chunks, health, draft_health, draft_s, rank_s = asyncio.run(scenario())
        # noticed after the probe's timeout and a check period or two; replaced (a new
        # process loads its model) in well under a minute, not after Ray's own
        # start_timeout_s waiting for the hung process's bundle (workers/processes.py)
        assert draft_s[0] < PROBE_S + 3.0 and rank_s[0] < PROBE_S + 3.0, (draft_s, rank_s)
        assert draft_s[1] < 45.0 and rank_s[1] < 60.0, (draft_s, rank_s)
        assert all(ok for ok, _ in draft_health)  # a hung draft: degraded, never down
        _answered_throughout(health)
        _check_streams(reqs, chunks, embedded_engine)
        for got in chunks:
            stats = got[-1].result.stats
            assert stats.degraded and stats.resumed >= 1
        assert sup.counters["draft_restarts"] == 1 and sup.counters["rank_restarts"] == 1
        assert sup.state == "SERVING"
        # README: the hung processes are SIGKILLed (workers/processes.py), not left
        # stopped beside their replacements (checked before the cleanup's SIGCONT)
        assert len(stopped_idents) == 2
        assert not any(is_running(ident) for ident in stopped_idents), stopped_idents
        print(f"hung draft: noticed, working again after {draft_s} s; hung rank 0: {rank_s} s")
    finally:
        for pid in stopped_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        group.shutdown()


def test_a_rank_death_during_a_draft_replacement_is_restarted_without_waiting_for_it(
    ray_session, embedded_engine, heldout_prompts
):
    """README (recovery): the draft actor dies, and rank 0 dies while the new draft
    actor still loads. The gang restart does not wait for that load (the group loads a
    draft actor outside its restart lock; the old code held the lock through it): the
    ranks restart without a draft actor and the streams resume, then the new
    draft actor is attached to the new rank 0 and requests speculate again. The load is
    held open by the test (the driver's wait for it blocks until released), so the
    restart provably ran during it."""
    import threading

    group, sup = _probed_group(tp_size=1)
    _pace(group.ranks[0])
    loading, entered = threading.Event(), threading.Event()
    wait = group._wait

    def held_load(refs, what, more=lambda: "", since=None):
        if what == "the draft actor did not load":  # the replacement's load: it ends when released
            entered.set()
            loading.wait(120.0)
        return wait(refs, what, more, since)

    group._wait = held_load
    prompts = _prompts(embedded_engine, heldout_prompts[2:], 2)  # the draft-kill test's
    reqs = [_req(p, f"both{i}", temperature=0.0, max_tokens=600) for i, p in enumerate(prompts)]

    async def scenario():
        chunks, tasks, health, stop, poll = _streams_under_watch(sup, reqs)
        while not all(chunks):
            await asyncio.sleep(0.01)
        ray.kill(group.draft)
        killed_draft = time.monotonic()
        while not entered.is_set():  # (a renamed wait message would never set it)
            assert time.monotonic() - killed_draft < 60, "the replacement's load never began"
            await asyncio.sleep(0.02)
        ray.kill(group.ranks[0])  # while the new draft actor "loads"
        killed = time.monotonic()
        while not (sup.counters["rank_restarts"] and sup.state == "SERVING"):
            assert time.monotonic() - killed < 60, f"no restart during the load: {sup.state}"
            await asyncio.sleep(0.05)
        serving_s = time.monotonic() - killed
        assert group.draft is None and not loading.is_set()  # still loading
        assert not all(t.done() for t in tasks), "the streams ended before the restart"
        loading.set()
        while sup.degraded_since is not None:
            assert time.monotonic() - killed < 90, "the new draft actor was not attached"
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        stop.set()
        await poll
        # a request after the replacement speculates on the new draft actor
        after = _req(prompts[0], "both-after", temperature=0.0, max_tokens=32)
        return chunks, health, serving_s, await sup.agenerate(after), after

    try:
        chunks, health, serving_s, result, after = asyncio.run(scenario())
        _answered_throughout(health)
        _check_streams(reqs, chunks, embedded_engine)
        # every stream resumed on the new ranks (whether one saw the draft actor's death
        # before rank 0's depends on which step each death met: not asserted)
        assert all(got[-1].result.stats.resumed >= 1 for got in chunks)
        assert sup.counters["draft_restarts"] == 1, sup.counters
        assert sup.counters["rank_restarts"] == 1, sup.counters
        assert result.token_ids == embedded_engine.generate(after).token_ids
        assert result.stats.draft_failures == 0 and result.stats.num_drafts > 0
        assert ray.get(group.draft.status.remote())["blocks_proposed"] > 0
        print(f"rank 0 killed during the draft actor's load: serving again after {serving_s:.1f} s")
    finally:
        loading.set()
        group.shutdown()


def test_a_draft_actor_whose_model_is_gone_is_given_up_on_and_requests_decode_plainly(
    ray_session, embedded_engine, heldout_prompts, tmp_path
):
    """README (the draft actor cannot be replaced): after `recovery.restart_attempts`
    failed replacements the supervisor gives up; running and new requests go on by
    plain decoding with their greedy tokens, the server's health ("") stays NOT
    SERVING (speculating False) while the Cactus service stays SERVING. Here on a real
    group whose draft folder was removed after the start, so every replacement's
    from_pretrained fails (the fake-group tests give up on a stand-in)."""
    import shutil

    moved = tmp_path / "draft"
    shutil.copytree(embedded_dirs()[1], moved)
    group, sup = _probed_group(1, draft=str(moved), probe_timeout_s=5, restart_attempts=2)
    _pace(group.ranks[0])
    (prompt,) = _prompts(embedded_engine, heldout_prompts[2:], 1)
    reqs = [_req(prompt, "draft-gone", temperature=0.0, max_tokens=600)]

    async def scenario():
        chunks, tasks, health, stop, poll = _streams_under_watch(sup, reqs)
        while not all(chunks):
            await asyncio.sleep(0.01)
        shutil.rmtree(moved)
        ray.kill(group.draft)
        killed = time.monotonic()
        while not sup.draft_given_up:
            assert time.monotonic() - killed < 60, ("not given up", sup.counters)
            assert not all(t.done() for t in tasks), "the stream ended before the give-up"
            await asyncio.sleep(0.05)
        given_up_s = time.monotonic() - killed
        later = []
        for _ in range(10):  # probes after the give-up do not bring speculation back
            later.append(sup.speculating())
            await asyncio.sleep(0.2)
        after = await sup.agenerate(_req(prompt, "draft-gone-after", temperature=0.0, max_tokens=8))
        await asyncio.gather(*tasks)
        stop.set()
        await poll
        return chunks, health, given_up_s, later, after

    try:
        chunks, health, given_up_s, later, after = asyncio.run(scenario())
        assert not any(later), later
        assert sup.state == "SERVING" and all(ok for ok, _ in health)  # the Cactus service
        _check_streams(reqs, chunks, embedded_engine)
        assert chunks[0][-1].result.stats.degraded
        ref = _uninterrupted(embedded_engine, _req(prompt, "ref", temperature=0.0, max_tokens=8))
        assert after.token_ids == ref.token_ids and after.stats.num_drafts == 0
        # one replacement round (of restart_attempts tries), no gang restart
        assert sup.counters["draft_restarts"] == 1 and sup.counters["rank_restarts"] == 0
        print(f"draft folder gone: given up after {given_up_s:.1f} s")
    finally:
        group.shutdown()


def test_a_request_is_resumed_at_most_max_attempts_times_then_fails_not_to_be_retried(
    ray_session, embedded_engine, heldout_prompts
):
    """README (`recovery.max_attempts`): one request is resumed after an engine failure
    at most that many times; the next failure ends it with RequestAttemptsExhaustedError
    (INTERNAL on the wire, which clients do not retry). Rank 0 is killed
    twice under one stream with max_attempts 1: resumed once, then refused (the
    fake-group test raises on cue; this is two real deaths and restarts)."""
    from cactus.errors import RequestAttemptsExhaustedError

    group, sup = _probed_group(1, probe_timeout_s=5, max_attempts=1)
    _pace(group.ranks[0], 0.03)
    (prompt,) = _prompts(embedded_engine, heldout_prompts[4:], 1)
    req = _req(prompt, "twice", temperature=0.0, max_tokens=600)

    async def restart_under(chunks, task):
        before = len(chunks)
        old = group.ranks[0]
        ray.kill(old)
        killed = time.monotonic()
        while sup.state == "SERVING" and time.monotonic() - killed < 30:
            await asyncio.sleep(0.01)
        while sup.state != "SERVING" or group.ranks[0] is old:
            assert time.monotonic() - killed < 60, sup.state
            await asyncio.sleep(0.02)
        _pace(group.ranks[0], 0.03)  # the new rank 0 paced too
        return before

    async def scenario():
        chunks: list = []
        task = asyncio.create_task(_collect(sup, req, chunks))
        while not chunks:
            await asyncio.sleep(0.01)
        first_kill_at = await restart_under(chunks, task)
        while len(chunks) <= first_kill_at + 2:  # the stream goes on after one restart
            assert not task.done(), "the stream ended before its second failure"
            await asyncio.sleep(0.02)
        resumed = sup.counters["resumed"]
        await restart_under(chunks, task)
        with pytest.raises(RequestAttemptsExhaustedError, match="failed 2 times"):
            await task
        late = await sup.agenerate(_req(prompt, "twice-late", temperature=0.0, max_tokens=8))
        return chunks, resumed, late

    try:
        chunks, resumed, late = asyncio.run(scenario())
        assert resumed == 1 and sup.counters["resumed"] == 1
        assert sup.counters["rank_restarts"] == 2 and sup.state == "SERVING"
        streamed = [t for c in chunks for t in c.token_ids]
        want = _uninterrupted(embedded_engine, req).token_ids
        assert 0 < len(streamed) < len(want) and streamed == list(want[: len(streamed)])
        assert all(c.result is None for c in chunks)  # it never finished
        ref = _uninterrupted(embedded_engine, _req(prompt, "ref", temperature=0.0, max_tokens=8))
        assert late.token_ids == ref.token_ids  # the server serves on
    finally:
        group.shutdown()
