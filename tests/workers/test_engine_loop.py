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
    """Four requests 5 ms apart start in one step when the idle engine waits up to 50 ms
    per arrival, and one step apart without a wait; a request that comes 400 ms later
    is not waited for (the wait ends after 5 x 10 ms). (Gaps and waits are 10x the
    served ones, 0.2-1 ms and 2 ms, so that a busy machine's scheduling cannot blur
    them.)"""
    burst = [0.005] * 3
    assert _first_step_rows(embedded_engine, 50.0, burst) == 4
    assert _first_step_rows(embedded_engine, 0.0, [0.05] * 3) == 1
    assert _first_step_rows(embedded_engine, 10.0, [0.4]) == 1
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
