"""The engine loop (one thread steps every request, round-robin) on the embedded models,
and the engine's next-block hint to the drafter."""

from __future__ import annotations

import threading

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


@pytest.fixture
def step_order(embedded_engine, monkeypatch):
    """Record which request each engine step served, and on which thread."""
    order = []
    step = embedded_engine.step

    def recording(state):
        order.append((state.id, threading.get_ident()))
        return step(state)

    monkeypatch.setattr(embedded_engine, "step", recording)
    return order


def test_interleaved_requests_equal_their_solo_runs(embedded_engine, heldout_prompts, step_order):
    reqs = [
        _req(heldout_prompts[i], f"loop{i}", rule=rule, seed=10 + i)
        for i, rule in enumerate(("sps", "cactus", "tas"))
    ]
    solo = [embedded_engine.generate(r) for r in reqs]
    step_order.clear()
    loop = EngineLoop(embedded_engine)
    try:
        streams = [loop.submit(r) for r in reqs]
        results = [[c for c in s][-1].result for s in streams]
    finally:
        loop.shutdown()
    for want, got in zip(solo, results, strict=True):
        assert got.token_ids == want.token_ids and got.text == want.text
    ids = [rid for rid, _ in step_order]
    assert len({tid for _, tid in step_order}) == 1  # every step on the loop's thread
    assert ids[:3] == ["loop0", "loop1", "loop2"]  # round-robin, not one after another
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


def test_next_block_hint_matches_the_next_propose(embedded_engine, heldout_prompts, monkeypatch):
    """commit(next_k=n) promises the next propose asks for n tokens (a remote drafter
    drafts them before being asked); 0 when no propose follows for sure."""
    calls = []
    drafter = embedded_engine.drafter
    propose, commit = drafter.propose, drafter.commit

    def rec_propose(rid, k):
        calls.append(("propose", k))
        return propose(rid, k)

    def rec_commit(rid, epoch, accepted, token, *, next_k=0):
        calls.append(("commit", next_k))
        return commit(rid, epoch, accepted, token, next_k=next_k)

    monkeypatch.setattr(drafter, "propose", rec_propose)
    monkeypatch.setattr(drafter, "commit", rec_commit)
    for max_tokens in (7, 23):
        calls.clear()
        req = _req(heldout_prompts[4], f"hint{max_tokens}", max_tokens=max_tokens)
        assert embedded_engine.generate(req).finish_reason == "LENGTH"
        hints = [(i, n) for i, (kind, n) in enumerate(calls) if kind == "commit"]
        assert any(n > 0 for _, n in hints)
        for i, n in hints:
            if n > 0:
                assert calls[i + 1] == ("propose", n)
        assert calls[-1] == ("commit", 0)  # the request ends: no block is asked for
