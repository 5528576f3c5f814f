"""The engine loop (one thread steps the whole batch) on the embedded models."""

from __future__ import annotations

import threading
import time

import pytest

from cactus.errors import InvalidRequestError, RequestCancelledError
from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
from workers.engine_loop import EngineLoop, EngineLoopStopped


def _req(prompt, rid, *, rule="cactus", seed=1, max_tokens=24, **sampling):
    return GenerationRequest(
        prompt=prompt,
        request_id=rid,
        sampling=SamplingParams(max_tokens=max_tokens, seed=seed, temperature=0.9, **sampling),
        speculation=SpeculationParams(rule=rule, delta=1.0, num_speculative_tokens=4),
    )


@pytest.fixture
def loop(embedded_engine):
    loop = EngineLoop(embedded_engine)
    yield loop
    loop.shutdown()
    assert embedded_engine.verifier.runner.num_sequences == 0
    assert embedded_engine.drafter.runner.num_sequences == 0


def test_concurrent_requests_share_steps_and_equal_their_solo_runs(
    embedded_engine, heldout_prompts
):
    reqs = [
        _req(heldout_prompts[i], f"loop{i}", rule=rule, seed=10 + i)
        for i, rule in enumerate(("sps", "cactus", "tas"))
    ]
    solo = [embedded_engine.generate(r) for r in reqs]
    threads = set()
    loop = EngineLoop(
        embedded_engine, on_step=lambda engine, batch: threads.add(threading.get_ident())
    )
    before = dict(embedded_engine.timing.batch_sizes)
    try:
        streams = [loop.submit(r) for r in reqs]
        results = [[c for c in s][-1].result for s in streams]
    finally:
        loop.shutdown()
    for want, got in zip(solo, results, strict=True):
        assert got.token_ids == want.token_ids and got.text == want.text
    assert len(threads) == 1  # every step on the loop's own thread
    after = embedded_engine.timing.batch_sizes
    assert after.get(3, 0) > before.get(3, 0)  # the three ran in one batch
    assert embedded_engine.verifier.runner.num_sequences == 0


def test_a_bad_request_fails_alone(loop, heldout_prompts):
    bad = loop.submit(_req(heldout_prompts[0], "bad", top_k=-3))
    good = loop.submit(_req(heldout_prompts[1], "good"))
    with pytest.raises(InvalidRequestError) as err:
        list(bad)
    assert err.value.field == "top_k"
    assert list(good)[-1].finish_reason == "LENGTH"


def test_cancel_flag_stops_the_request_and_frees_caches(loop, embedded_engine, heldout_prompts):
    flag = threading.Event()
    chunks = loop.submit(_req(heldout_prompts[2], "stop-me", max_tokens=200), cancelled=flag.is_set)
    seen = 0
    with pytest.raises(RequestCancelledError):
        for _ in chunks:
            seen += 1
            flag.set()
    assert seen < 10
    assert embedded_engine.verifier.runner.num_sequences == 0


def test_shutdown_ends_running_requests(embedded_engine, heldout_prompts):
    loop = EngineLoop(embedded_engine)
    chunks = loop.submit(_req(heldout_prompts[3], "long", max_tokens=400))
    next(chunks)
    loop.shutdown()
    with pytest.raises(EngineLoopStopped):
        list(chunks)
    assert embedded_engine.verifier.runner.num_sequences == 0
    with pytest.raises(EngineLoopStopped):
        loop.submit(_req(heldout_prompts[3], "late"))


def _first_step_rows(engine, wait_ms: float, gaps_s: list[float]) -> int:
    """Requests submitted to an idle loop `gaps_s` apart: how many rows the loop's
    first step holds."""
    rows = []
    loop = EngineLoop(
        engine,
        batch_wait_ms=wait_ms,
        on_step=lambda eng, batch: rows.append(eng.scheduler.num_rows),
    )
    try:
        outs = []
        for i, gap in enumerate([0.0, *gaps_s]):
            time.sleep(gap)
            outs.append(loop.submit(_req("def parse(text):", f"burst{wait_ms}-{i}", seed=i)))
        for out in outs:
            assert list(out)[-1].result is not None
    finally:
        loop.shutdown()
    return rows[0]


def test_an_idle_engine_starts_a_burst_of_requests_in_one_step(embedded_engine):
    """Four requests 5 ms apart start in one step when the idle engine waits up to 500 ms
    per arrival, and one step apart without a wait; a request that comes 1 s later is
    not waited for (the wait ends after 5 x 10 ms). (Gaps and waits are 100x the served
    ones, 0.2-1 ms and 2 ms, so that a busy machine's scheduling cannot blur them.)"""
    burst = [0.005] * 3
    assert _first_step_rows(embedded_engine, 500.0, burst) == 4
    assert _first_step_rows(embedded_engine, 0.0, [0.5] * 3) == 1
    assert _first_step_rows(embedded_engine, 10.0, [1.0]) == 1
    # the default comes from the engine's scheduler config
    loop = EngineLoop(embedded_engine)
    try:
        assert loop.batch_wait_s == embedded_engine.scheduler.config.batch_wait_ms / 1000
    finally:
        loop.shutdown()


def test_the_batch_wait_is_validated():
    from workers.scheduler import SchedulerConfig

    with pytest.raises(ValueError, match="batch_wait_ms"):
        SchedulerConfig(batch_wait_ms=-1.0)


class _Done:
    """A request's last chunk, as far as the loop's readers care."""

    result = "done"


class _StepCounter:
    """An engine without a model: a request runs `steps` steps (a pinned one: until
    `release` is set), and every step records when it ran and which requests it held."""

    def __init__(self, steps: int = 1) -> None:
        self.steps_per_request = steps
        self.rows: dict = {}  # request -> [steps left or None, sink]
        self.log: list[tuple[float, frozenset]] = []  # (time.monotonic(), requests)
        self.release = threading.Event()

    def has_work(self) -> bool:
        return bool(self.rows)

    def add_request(self, request, sink, cancelled=None) -> None:
        self.rows[request] = [self.steps_per_request, sink]

    def pin(self, request) -> None:
        """A request that runs until `release` is set."""
        self.rows[request] = [None, lambda _item: None]

    def step(self) -> int:
        time.sleep(0.001)  # a step takes some time; the loop must not spin the CPU
        self.log.append((time.monotonic(), frozenset(self.rows)))
        for request, row in list(self.rows.items()):
            if row[0] is None:
                done = self.release.is_set()
            else:
                row[0] -= 1
                done = row[0] == 0
            if done:
                del self.rows[request]
                row[1](_Done())
        return len(self.log[-1][1])

    def abort_all(self, err) -> None:
        for _, sink in self.rows.values():
            sink(err)
        self.rows.clear()


def test_a_busy_engine_never_waits_for_arrivals():
    """README: a busy engine never waits. With a batch wait of a minute per arrival
    (5 minutes in all), a request submitted while the engine is running another joins
    the steps at once: it is in a step within seconds and the running request's steps
    go on meanwhile."""
    engine = _StepCounter(steps=2)
    engine.pin("running")
    loop = EngineLoop(engine, batch_wait_ms=60_000.0)
    try:
        started = time.monotonic()
        while len(engine.log) < 3:  # the loop steps the running request
            assert time.monotonic() - started < 30.0, "the loop does not step"
            time.sleep(0.01)
        submitted = time.monotonic()
        out = loop.submit("late")
        joined = None
        while joined is None and time.monotonic() - submitted < 30.0:
            joined = next((t for t, rows in list(engine.log) if "late" in rows), None)
            time.sleep(0.01)
        assert joined is not None and joined - submitted < 5.0, joined
        assert list(out)[-1].result == "done"
        # every step held the running request: its steps never paused for the arrival
        assert all("running" in rows for _, rows in engine.log)
        engine.release.set()
    finally:
        loop.shutdown()


def test_an_idle_engines_wait_ends_after_five_batch_waits_under_continuous_arrivals():
    """README: an idle engine that gets a request waits up to the batch wait for each
    further arrival, 5 x the batch wait in all at most, before its first step. Requests
    arriving every 5 ms, far inside a 200 ms batch wait, would keep an uncapped wait
    going for as long as they come (here up to 20 s); the first step comes after at
    most 5 x 200 ms, and it holds the requests that came meanwhile."""
    engine = _StepCounter(steps=1)
    loop = EngineLoop(engine, batch_wait_ms=200.0)
    outs = []
    try:
        first = time.monotonic()
        while not engine.log and time.monotonic() - first < 20.0:
            outs.append(loop.submit(f"r{len(outs)}"))
            time.sleep(0.005)
        assert engine.log, "no step while requests kept arriving"
        stepped, rows = engine.log[0]
        assert stepped - first < 3.0, stepped - first  # 1 s nominal, and margin
        assert len(rows) >= 2  # it did wait for arrivals
        for out in outs:
            assert list(out)[-1].result == "done"
    finally:
        loop.shutdown()


def test_a_failed_step_ends_only_the_admitted_requests_and_a_failed_callback_none(
    tiny_checkpoints,
):
    """A step that raises (a bug) ends the requests it was running; one still waiting
    for a row never ran and goes on to its solo tokens. An on_step callback (the
    metrics) that raises ends nothing."""
    from workers.local import local_engine
    from workers.scheduler import SchedulerConfig

    engine = local_engine(
        str(tiny_checkpoints["llama"]),
        str(tiny_checkpoints["qwen2"]),
        scheduler=SchedulerConfig(max_num_seqs=1, policy="fixed"),
    )

    def req(rid, seed, max_tokens=12):
        return GenerationRequest(
            prompt_token_ids=(5, 6, 7, 8),
            request_id=rid,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=seed),
            speculation=SpeculationParams(rule="cactus", delta=1.0),
        )

    want = engine.generate(req("solo", 2))
    real_step, steps = engine.step, []

    def flaky_step():
        state = (engine.scheduler.num_rows, len(engine.scheduler.waiting))
        steps.append(state)
        if state == (1, 1) and steps.count(state) == 2:  # one running, one waiting
            raise RuntimeError("injected: a bug in the step")
        return real_step()

    def bad_callback(engine, batch):
        raise RuntimeError("injected: the metrics failed")

    engine.step = flaky_step
    loop = EngineLoop(engine, on_step=bad_callback)
    try:
        running, waiting = loop.submit(req("running", 1, 60)), loop.submit(req("waiting", 2))
        with pytest.raises(RuntimeError, match="injected: a bug"):
            list(running)
        got = [c for c in waiting][-1].result
    finally:
        loop.shutdown()
    assert steps.count((1, 1)) >= 2  # the second was waiting when the step failed
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert engine.verifier.runner.num_sequences == 0 == engine.drafter.runner.num_sequences


def test_a_step_that_fails_on_a_waiting_request_ends_it_rather_than_spin(embedded_engine):
    """A failure in handling the waiting requests themselves (their admission, their
    time limits) leaves no admitted request to end: the waiting ones end then, so the
    loop does not repeat the failing step for ever."""
    real_reap, calls = embedded_engine._reap, []

    def broken_reap(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("injected: reaping failed")

    embedded_engine._reap = broken_reap
    loop = EngineLoop(embedded_engine)
    try:
        stream = loop.submit(_req("def f(x):", "stuck"))
        with pytest.raises(RuntimeError, match="injected: reaping"):
            list(stream)
    finally:
        embedded_engine._reap = real_reap
        loop.shutdown()
    assert len(calls) <= 3, len(calls)


def test_a_failed_step_reports_the_rows_it_freed(tiny_checkpoints):
    """on_step (the running/waiting gauges) also follows a failed step: the loop then
    goes idle, and a gauge set only after good steps would show the ended request's row
    for ever."""
    from workers.local import local_engine
    from workers.scheduler import SchedulerConfig

    engine = local_engine(
        str(tiny_checkpoints["llama"]),
        str(tiny_checkpoints["qwen2"]),
        scheduler=SchedulerConfig(max_num_seqs=1, policy="fixed"),
    )
    real_step = engine.step

    def flaky_step():
        if engine.scheduler.num_rows:  # the request holds its row: the step fails
            raise RuntimeError("injected: a bug in the step")
        return real_step()

    reports = []
    engine.step = flaky_step
    loop = EngineLoop(
        engine,
        on_step=lambda eng, batch: reports.append(
            (batch, eng.scheduler.num_rows, len(eng.scheduler.waiting))
        ),
    )
    try:
        stream = loop.submit(
            GenerationRequest(
                prompt_token_ids=(5, 6, 7, 8),
                request_id="doomed",
                sampling=SamplingParams(max_tokens=12, temperature=0.9, seed=1),
            )
        )
        with pytest.raises(RuntimeError, match="injected: a bug"):
            list(stream)
        loop.call(lambda eng: None)  # the loop is past the failed step's report
    finally:
        loop.shutdown()
    assert reports[0][1] == 1  # the first step admitted it
    assert reports[-1] == (0, 0, 0), reports
    assert engine.verifier.runner.num_sequences == 0 == engine.drafter.runner.num_sequences


def test_a_loop_that_cannot_end_a_failed_steps_requests_answers_them_all_and_stops(
    tiny_checkpoints,
):
    """A step fails, and freeing its requests' rows fails too (a broken device: on CUDA a
    sticky error raises again in every op). The loop's thread used to die then, leaving
    every caller blocked for ever on its queue, new requests queued where nobody read
    them, and rank 0's ping answering. Now each caller is answered (the failed step's
    error, or EngineFailedError, which the supervisor resumes after a rebuild), later
    submits and calls are refused, and `alive` (rank 0's ping) turns False."""
    from cactus.errors import EngineFailedError, is_engine_failure
    from workers.actors import VerifierRank
    from workers.local import local_engine
    from workers.scheduler import SchedulerConfig

    engine = local_engine(
        str(tiny_checkpoints["llama"]),
        str(tiny_checkpoints["qwen2"]),
        scheduler=SchedulerConfig(max_num_seqs=2, policy="fixed", batch_wait_ms=0),
    )
    real_step = engine.step

    def failing_step():
        if engine.scheduler.num_rows == 2 and engine.scheduler.waiting:
            raise RuntimeError("injected: the device broke")
        return real_step()

    def failing_release(request_id):
        raise RuntimeError("injected: the device broke again")

    engine.step = failing_step
    engine.verifier.release = failing_release
    loop = EngineLoop(engine)

    def req(rid):
        return GenerationRequest(
            prompt_token_ids=(5, 6, 7, 8),
            request_id=rid,
            sampling=SamplingParams(max_tokens=200, temperature=0.9, seed=1),
        )

    outcomes: dict[str, BaseException | str] = {}

    def consume(rid):
        try:
            list(loop.submit(req(rid)))
            outcomes[rid] = "finished"
        except BaseException as err:
            outcomes[rid] = err

    threads = [threading.Thread(target=consume, args=(f"r{i}",), daemon=True) for i in range(3)]
    try:
        for t in threads:  # two take the rows, the third waits for one
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), f"callers left blocked: {outcomes}"
        assert set(outcomes) == {"r0", "r1", "r2"}
        errors = list(outcomes.values())
        assert all(isinstance(e, BaseException) for e in errors), outcomes
        # the first row ended with the step's own error, the rest the engine's failure
        assert sum(isinstance(e, EngineFailedError) for e in errors) == 2, outcomes
        assert all(is_engine_failure(e) or "injected: the device broke" in str(e) for e in errors)
        assert not loop.alive and loop.failed is not None
        with pytest.raises(EngineFailedError, match="engine loop failed"):
            loop.submit(req("late"))
        with pytest.raises(EngineFailedError):
            loop.call(lambda eng: 1, timeout_s=5)
        rank = VerifierRank.__ray_actor_class__(0, 1)  # the plain class: no Ray actor
        rank.loop = loop
        with pytest.raises(RuntimeError, match="engine loop stopped"):
            rank.ping()  # the supervisor's probe then rebuilds the group
    finally:
        loop.shutdown(timeout_s=5)


def test_a_submit_that_lands_after_the_loops_last_look_is_answered(embedded_engine):
    """A caller checks that the loop runs, then puts its request; if the loop stopped and
    emptied its inbox for the last time between the two, nobody would answer it. The
    caller now answers what is left once the loop has closed. (The window is emulated:
    the stopped flag is cleared again, as a caller that checked it just before saw it.)"""
    loop = EngineLoop(embedded_engine)
    loop.shutdown()
    loop._stopped.clear()  # what a caller saw just before the shutdown
    outcome = []

    def late():
        try:
            list(loop.submit(_req("def f(x):", "late")))
        except BaseException as err:
            outcome.append(err)
        try:
            loop.call(lambda engine: 1, timeout_s=30)
        except BaseException as err:
            outcome.append(err)

    caller = threading.Thread(target=late, daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive(), "a late caller was left waiting"
    assert len(outcome) == 2 and all(isinstance(e, EngineLoopStopped) for e in outcome)


def test_a_call_that_times_out_says_so_and_never_runs_if_not_started(embedded_engine):
    """loop.call raised a bare queue.Empty (no message) when its wait ran out, and the
    queued function still ran later. Now: TimeoutError saying so, and a call the loop
    had not started never runs."""
    loop = EngineLoop(embedded_engine)
    busy, release, ran = threading.Event(), threading.Event(), []

    def hold(_engine):
        busy.set()
        return release.wait(30)

    try:
        holder = threading.Thread(target=lambda: loop.call(hold))
        holder.start()
        assert busy.wait(30)  # the loop is busy with this one
        with pytest.raises(TimeoutError, match="never runs"):
            loop.call(lambda e: ran.append("late"), timeout_s=0.2)
        release.set()
        holder.join(30)
        assert loop.call(lambda e: "after") == "after"
        assert ran == []
    finally:
        release.set()
        loop.shutdown()
