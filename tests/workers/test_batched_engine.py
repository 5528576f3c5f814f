"""The batched engine: many requests in one step, each giving exactly its solo tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cactus.errors import InvalidRequestError, RequestCancelledError, WorkerUnavailableError
from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
from workers.engine import SpeculativeEngine
from workers.local import local_engine
from workers.scheduler import SchedulerConfig


def _req(prompt, rid, *, rule="cactus", delta=1.0, k=4, **sampling):
    sampling.setdefault("max_tokens", 24)
    return GenerationRequest(
        prompt=prompt,
        request_id=rid,
        sampling=SamplingParams(**sampling),
        speculation=SpeculationParams(rule=rule, delta=delta, num_speculative_tokens=k),
    )


def _run_together(engine, reqs, *, on_step=None, cancelled=None):
    """Add every request, step until all end; returns {id: [chunks or the error]}."""
    out = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(
            r, out[r.request_id].append, cancelled=(cancelled or {}).get(r.request_id)
        )
    steps = 0
    while engine.has_work():
        batch = engine.step()
        steps += 1
        if on_step is not None:
            on_step(steps, batch)
        assert steps < 2000
    return out


def _sharing(embedded_engine, **scheduler):
    """An engine on the embedded engine's models, with its own scheduler (policy
    `fixed`, min_prefill_chunk 4 unless given)."""
    scheduler = {"min_prefill_chunk": 4, "policy": "fixed", **scheduler}
    return SpeculativeEngine(
        embedded_engine.drafter,
        embedded_engine.verifier,
        embedded_engine.tokenizer,
        scheduler=SchedulerConfig(**scheduler),
    )


def _result(items):
    assert items and not isinstance(items[-1], BaseException), items[-1:]
    return items[-1].result


def _mixed(prompts):
    """8 requests: every rule, different K, deltas, prompt lengths, max_tokens, stops."""
    specs = [
        ("none", 0.0, 4, {"temperature": 0.8, "seed": 1, "max_tokens": 20}),
        ("sps", 0.0, 4, {"temperature": 0.9, "top_k": 40, "seed": 2, "max_tokens": 31}),
        ("cactus", 1.0, 6, {"temperature": 0.7, "top_p": 0.9, "seed": 3, "max_tokens": 27}),
        ("cactus", 0.3, 2, {"temperature": 1.0, "seed": 4, "max_tokens": 9, "stop": ("\n\n",)}),
        ("cactus_exact", 0.5, 3, {"temperature": 0.8, "top_k": 20, "seed": 5, "max_tokens": 24}),
        ("tas", 0.0, 5, {"temperature": 0.9, "seed": 6, "max_tokens": 18}),
        ("sps", 0.0, 1, {"temperature": 0.0, "max_tokens": 22}),
        ("cactus", 2.0, 8, {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 8}),
    ]
    reqs = []
    for i, (rule, delta, k, kw) in enumerate(specs):
        prompt = prompts[i][: 20 + 9 * i]  # different prompt lengths
        req = _req(prompt, f"mix{i}", rule=rule, delta=delta, k=k, **kw)
        if i == 4:
            req = replace(req, speculation=replace(req.speculation, max_divergence_nats=0.5))
        reqs.append(req)
    return reqs


def test_mixed_batch_gives_each_request_its_solo_tokens(embedded_engine, heldout_prompts):
    reqs = _mixed(heldout_prompts)
    solo = {
        r.request_id: embedded_engine.generate(replace(r, request_id="s-" + r.request_id))
        for r in reqs
    }
    sizes = []
    out = _run_together(embedded_engine, reqs, on_step=lambda _s, b: sizes.append(b))
    assert max(sizes) == 8  # all eight really shared steps
    for r in reqs:
        got, want = _result(out[r.request_id]), solo[r.request_id]
        assert got.token_ids == want.token_ids, r.speculation
        assert got.text == want.text and got.finish_reason == want.finish_reason
        assert got.stats.num_accepted_tokens == want.stats.num_accepted_tokens
        # q moves by ~1e-6 with the KV padding of a batch (never enough to flip a token here)
        assert got.stats.divergence_nats == pytest.approx(want.stats.divergence_nats, rel=1e-4)
        streamed = [t for c in out[r.request_id] for t in c.token_ids]
        assert streamed == list(got.token_ids)  # nothing lost, nothing twice
    assert embedded_engine.verifier.runner.num_sequences == 0
    assert embedded_engine.drafter.runner.num_sequences == 0


def test_greedy_batch_of_every_rule_equals_verifier_greedy(embedded_engine, heldout_prompts):
    rules = ("sps", "cactus", "cactus_exact", "tas")
    want = {}
    reqs = []
    for i, prompt in enumerate(heldout_prompts[:5]):
        want[i] = embedded_engine.generate(
            _req(prompt, f"g-plain{i}", rule="none", temperature=0.0, max_tokens=32)
        ).token_ids
        for rule in rules:
            reqs.append(
                _req(
                    prompt,
                    f"g{i}-{rule}",
                    rule=rule,
                    delta=2.0,
                    temperature=0.0,
                    max_tokens=32,
                    k=2 + i % 4,
                )
            )
    out = _run_together(embedded_engine, reqs)
    for r in reqs:
        i = int(r.request_id[1 : r.request_id.index("-")])
        assert _result(out[r.request_id]).token_ids == want[i], r.request_id


def test_cancelling_one_row_frees_it_within_a_step(embedded_engine, heldout_prompts):
    reqs = [
        _req(heldout_prompts[i], f"c{i}", seed=20 + i, temperature=0.9, max_tokens=40)
        for i in range(4)
    ]
    solo = {
        r.request_id: embedded_engine.generate(replace(r, request_id="s" + r.request_id))
        for r in reqs
    }
    flag = {"set": False}
    rows_after = []

    def on_step(step, _batch):
        rows_after.append(embedded_engine.verifier.runner.num_sequences)
        if step == 3:
            flag["set"] = True

    embedded_engine.take_cancelled_work()  # what earlier tests left
    out = _run_together(
        embedded_engine, reqs, on_step=on_step, cancelled={"c1": lambda: flag["set"]}
    )
    assert isinstance(out["c1"][-1], RequestCancelledError)
    # its work reaches the engine's cancelled counters (EngineMetrics exports them), the
    # finished requests' does not (their results carry it)
    work = embedded_engine.take_cancelled_work()
    streamed = sum(len(c.token_ids) for c in out["c1"][:-1])
    assert {key for rule, key in work if rule != "cactus"} == set(), work
    assert work["cactus", "requests"] == 1 and 0 < streamed <= work["cactus", "generated"] < 40
    assert 0 < work["cactus", "accepted"] <= work["cactus", "drafted"], work
    assert not embedded_engine.take_cancelled_work()
    assert rows_after[2] == 4 and rows_after[3] == 3  # freed at the very next step
    for rid in ("c0", "c2", "c3"):
        assert _result(out[rid]).token_ids == solo[rid].token_ids
    assert embedded_engine.drafter.runner.num_sequences == 0


def test_rows_and_token_budget_make_requests_wait_not_fail(embedded_engine, heldout_prompts):
    """max_num_seqs 2, 16 tokens a step: the rest wait their turn, a long prompt goes in
    chunk by chunk while the running rows keep decoding, and every output equals solo."""
    engine = _sharing(embedded_engine, max_num_seqs=2, max_num_batched_tokens=16)
    long_prompt = " ".join(heldout_prompts[:6])
    reqs = [_req(heldout_prompts[i], f"w{i}", seed=40 + i, temperature=0.8) for i in range(4)]
    reqs.append(_req(long_prompt, "w-long", seed=50, temperature=0.8))
    solo = {
        r.request_id: embedded_engine.generate(replace(r, request_id="s" + r.request_id))
        for r in reqs
    }
    seen = {"rows": 0, "waiting": 0, "prefill_steps": 0}

    def on_step(_step, batch):
        sched = engine.scheduler
        seen["rows"] = max(seen["rows"], sched.num_rows)
        seen["waiting"] = max(seen["waiting"], len(sched.waiting))
        if batch and any(s.id == "w-long" for s in sched.prefilling):
            seen["prefill_steps"] += 1  # decoding went on while the long prompt went in

    out = _run_together(engine, reqs, on_step=on_step)
    assert seen["rows"] == 2 and seen["waiting"] >= 1
    assert seen["prefill_steps"] >= 3
    for r in reqs:
        assert _result(out[r.request_id]).token_ids == solo[r.request_id].token_ids


def test_kv_budget_queues_requests_that_do_not_fit(tiny_checkpoints):
    engine = local_engine(
        str(tiny_checkpoints["llama"]), str(tiny_checkpoints["qwen2"]), kv_budget_tokens=128
    )
    reqs = [
        GenerationRequest(
            prompt_token_ids=tuple(range(5, 25)),
            request_id=f"kv{i}",
            sampling=SamplingParams(max_tokens=40, temperature=0.0),
        )
        for i in range(3)
    ]
    most = []
    out = _run_together(engine, reqs, on_step=lambda *_: most.append(engine.scheduler.num_rows))
    assert max(most) == 2  # 64-slot rows: two fit in 128, the third waited
    want = engine.generate(replace(reqs[0], request_id="kv-solo")).token_ids
    assert all(_result(out[r.request_id]).token_ids == want for r in reqs)
    assert engine.verifier.runner.kv_slots <= 128
    # the in-process draft's cache is bounded alike (it was not: max_num_seqs x context),
    # and every request still drafted
    assert engine.drafter.runner.kv_budget_tokens == 128
    assert engine.drafter.runner.kv_slots <= 128
    assert all(_result(out[r.request_id]).stats.draft_failures == 0 for r in reqs)


def test_a_request_larger_than_the_whole_kv_budget_is_refused_not_queued(tiny_checkpoints):
    """A request that could never fit (prompt + max_tokens above the KV budget) would
    wait forever: it gets an error naming max_tokens and the budget, and the engine
    goes on serving requests that fit."""
    engine = local_engine(
        str(tiny_checkpoints["llama"]), str(tiny_checkpoints["qwen2"]), kv_budget_tokens=128
    )
    big = GenerationRequest(
        prompt_token_ids=tuple(range(5, 25)),
        request_id="too-big",
        sampling=SamplingParams(max_tokens=109, temperature=0.0),
    )
    with pytest.raises(InvalidRequestError) as err:  # at admission: it is never queued
        engine.add_request(big, [].append)
    assert err.value.field == "max_tokens"
    assert "need 129 KV slots" in str(err.value) and "allows 128" in str(err.value)
    assert not engine.has_work() and engine.scheduler.num_rows == 0
    fits = replace(big, request_id="fits", sampling=replace(big.sampling, max_tokens=108))
    assert len(engine.generate(fits).token_ids) > 0


class _DyingDrafter:
    """The in-process drafter, dead from the `after`-th propose on."""

    def __init__(self, inner, after):
        self.inner, self.after, self.calls = inner, after, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, rows):
        self.calls += 1
        if self.calls >= self.after:
            raise WorkerUnavailableError("draft actor: UNAVAILABLE")
        return self.inner.propose(rows)


def test_a_drafter_release_that_raises_frees_the_verifier_row_and_ends_no_request(
    embedded_engine, heldout_prompts
):
    """The drafter's release raised and _close stopped there: the verifier's row stayed
    reserved while the scheduler no longer counted it (with one row, the next request
    waited for good), and the step's exception ended every admitted request. Now the
    drafter's error is logged: the step's rows all finish, the rows agree, and the
    next request runs."""

    class FlakyRelease:
        def __init__(self, inner):
            self.inner, self.failed = inner, False

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def release(self, request_id):
            self.inner.release(request_id)
            if not self.failed:
                self.failed = True
                raise RuntimeError("device error while freeing the draft row")

    drafter = FlakyRelease(embedded_engine.drafter)
    engine = SpeculativeEngine(
        drafter,
        embedded_engine.verifier,
        embedded_engine.tokenizer,
        scheduler=SchedulerConfig(max_num_seqs=1, policy="fixed"),
    )
    reqs = [_req(heldout_prompts[i], f"r{i}", temperature=0.0, max_tokens=6) for i in range(2)]
    out = _run_together(engine, reqs)
    assert drafter.failed
    for r in reqs:
        assert len(_result(out[r.request_id]).token_ids) == 6
    assert embedded_engine.verifier.runner.num_sequences == engine.scheduler.num_rows == 0


class _DyingUnreleasable(_DyingDrafter):
    """Dead as _DyingDrafter, and freeing the first row after its death raises too."""

    failed_releases = 0

    def release(self, request_id):
        self.inner.release(request_id)
        if self.calls >= self.after and not self.failed_releases:
            self.failed_releases += 1
            raise RuntimeError("draft device error while freeing the row")


@pytest.mark.parametrize("drafter_class", [_DyingDrafter, _DyingUnreleasable])
def test_dead_drafter_degrades_every_row_without_losing_a_token(
    embedded_engine, heldout_prompts, drafter_class
):
    """Every row goes on by plain decoding. _DyingUnreleasable: `_drafter_failed` called
    the drafter's release unguarded, so its error ended every request of the step; now
    it costs drafts only, like every drafter error."""
    drafter = drafter_class(embedded_engine.drafter, after=4)
    engine = SpeculativeEngine(drafter, embedded_engine.verifier, embedded_engine.tokenizer)
    reqs = [
        _req(p, f"d{i}", temperature=0.0, max_tokens=30) for i, p in enumerate(heldout_prompts[:4])
    ]
    want = [
        embedded_engine.generate(
            replace(r, request_id="p" + r.request_id, speculation=SpeculationParams(rule="none"))
        )
        for r in reqs
    ]
    out = _run_together(engine, reqs)
    assert drafter_class is _DyingDrafter or drafter.failed_releases == 1
    for r, w in zip(reqs, want, strict=True):
        got = _result(out[r.request_id])
        assert got.token_ids == w.token_ids
        assert [t for c in out[r.request_id] for t in c.token_ids] == list(got.token_ids)
        assert got.stats.draft_failures == 1 and got.stats.num_drafts == 3
    assert embedded_engine.drafter.runner.num_sequences == 0


def _failing_draft_forwards(monkeypatch, runner, failing):
    """Make the draft runner's draft forwards (logits "last") number `failing(n)` raise
    a device error; returns the list the forwards are counted in."""
    real = runner.forward
    calls = []

    def forward(seq_ids, token_ids, **kw):
        if kw.get("logits") == "last":
            calls.append(len(seq_ids))
            if failing(len(calls)):
                raise RuntimeError("CUDA error: out of memory")
        return real(seq_ids, token_ids, **kw)

    monkeypatch.setattr(runner, "forward", forward)
    return calls


@pytest.mark.parametrize("persistent", [False, True])
def test_a_failed_batched_draft_forward_costs_its_rows_that_steps_drafts_only(
    embedded_engine, heldout_prompts, monkeypatch, persistent
):
    """A device error in the batched draft forward (the second forward of the second
    step: the first had appended the pending tokens) made the in-process drafter's
    propose raise, and every row of it went on without drafts for good (over the wire
    the same: the draft actor answered UNKNOWN). Now the drafter puts the rows back and
    each decodes that step plainly and drafts again at the next; a forward that keeps
    failing ends drafting after MAX_DRAFT_RETRIES steps. Greedy: the verifier's tokens
    throughout."""
    from workers.engine import MAX_DRAFT_RETRIES

    reqs = [_req(heldout_prompts[i], f"fail{i}", temperature=0.0, max_tokens=40) for i in range(3)]
    solo = {r.request_id: embedded_engine.generate(r) for r in reqs}
    calls = _failing_draft_forwards(
        monkeypatch,
        embedded_engine.drafter.runner,
        (lambda n: n >= 6) if persistent else (lambda n: n == 6),
    )
    out = _run_together(_sharing(embedded_engine), reqs)
    assert calls[5] == 3  # the failed forward had every row
    for r in reqs:
        got = _result(out[r.request_id])
        assert got.token_ids == solo[r.request_id].token_ids, r.request_id
        if persistent:  # step 1 drafted; steps 2-4 retried; step 5 gave up
            assert got.stats.draft_failures == MAX_DRAFT_RETRIES + 1
            assert got.stats.num_drafts == 1
        else:
            assert got.stats.draft_failures == 1 and got.stats.degraded
            assert got.stats.num_drafts >= 4, got.stats  # it drafted again
            # as many accepted drafts as solo, give or take a step's worth
            assert got.stats.num_accepted_tokens >= solo[r.request_id].stats.num_accepted_tokens - 8
    assert embedded_engine.drafter.runner.num_sequences == 0
    assert not embedded_engine.has_work()


def test_a_failed_draft_forward_puts_the_rows_back_as_they_were(
    embedded_engine, heldout_prompts, monkeypatch
):
    """After the failed forward (its second: the first had appended the rows' pending
    tokens to the draft cache) and a plain step's commit, a row drafts from exactly the
    cache a fresh session of the same text has: the first draft token's q is the same.
    Without the roll-back the cache held the pending token twice."""
    from cactus.errors import DraftRetryError
    from workers.interfaces import ProposeRow

    drafter = embedded_engine.drafter
    tok = embedded_engine.tokenizer
    texts = [tok.encode(p, add_special_tokens=False)[:40] for p in heldout_prompts[:2]]
    sampling = SamplingParams(max_tokens=16, temperature=0.8)
    for i, ids in enumerate(texts):
        drafter.start(f"put{i}", ids, sampling, 10 + i)
    rows = [ProposeRow("put0", 4), ProposeRow("put1", 4)]
    try:
        with monkeypatch.context() as patch:
            _failing_draft_forwards(patch, drafter.runner, lambda n: n == 2)
            failed = drafter.propose(rows)
        assert all(isinstance(b, DraftRetryError) for b in failed), failed
        nexts = [11, 12]
        for i, ids in enumerate(texts):
            drafter.commit(f"put{i}", len(ids), 0, nexts[i])
            drafter.start(f"fresh{i}", [*ids, nexts[i]], sampling, 20 + i)
        again = drafter.propose(rows)
        fresh = drafter.propose([ProposeRow("fresh0", 4), ProposeRow("fresh1", 4)])
        for a, f in zip(again, fresh, strict=True):
            assert a.epoch == f.epoch
            torch.testing.assert_close(a.probs[0], f.probs[0], atol=1e-4, rtol=0)
    finally:
        for rid in ("put0", "put1", "fresh0", "fresh1"):
            drafter.release(rid)
    assert drafter.runner.num_sequences == 0


def test_a_request_that_can_never_draft_opens_no_draft_session(
    embedded_engine, heldout_prompts, monkeypatch
):
    """max_tokens 1: every step's draft ceiling is 0 (the verifier emits one token more
    than it accepts), yet its draft session was opened: a draft row reserved and the
    whole prompt prefilled on the draft side, in the running rows' way, for nothing. It
    now decodes plainly from the start, not counted as a draft failure."""
    reqs = [
        _req(heldout_prompts[0], "one", temperature=0.0, max_tokens=1),
        _req(heldout_prompts[1], "many", temperature=0.0, max_tokens=12),
    ]
    solo = {r.request_id: embedded_engine.generate(r).token_ids for r in reqs}
    drafter, started = embedded_engine.drafter, []
    real_start = drafter.start

    def start(request_id, *args, **kw):
        started.append(request_id)
        return real_start(request_id, *args, **kw)

    monkeypatch.setattr(drafter, "start", start)
    out = _run_together(_sharing(embedded_engine), reqs)
    assert started == ["many"]
    for r in reqs:
        assert _result(out[r.request_id]).token_ids == solo[r.request_id], r.request_id
    one = _result(out["one"]).stats
    assert one.num_drafts == 0 and one.draft_failures == 0 and not one.degraded
    assert _result(out["many"]).stats.num_drafts > 0
    assert drafter.runner.num_sequences == 0


class _SlowToReopen:
    """The same drafter, saying for its first `steps` looks that no row is opened yet (a
    new draft actor still prefilling the re-opened contexts)."""

    def __init__(self, inner, steps: int) -> None:
        self._inner, self.looks = inner, steps

    def opened(self, request_id):
        self.looks -= 1
        return self.looks < 0 and self._inner.opened(request_id)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_rows_reopening_on_a_new_drafter_are_planned_with_no_drafts(
    embedded_engine, heldout_prompts, monkeypatch
):
    """A row re-opening on a new drafter decodes plainly until that drafter holds its
    context, but the policy was given its whole ceiling: the step's cap and whether
    drafting pays were chosen for rows that would not draft. Now it is planned with a
    ceiling of 0, and with its K again once opened; greedy outputs stay the verifier's."""
    reqs = [_req(heldout_prompts[i], f"re{i}", temperature=0.0, max_tokens=40) for i in range(2)]
    solo = {r.request_id: embedded_engine.generate(r).token_ids for r in reqs}
    engine = _sharing(embedded_engine)
    ceilings = []
    real_plan = engine.policy.plan

    def plan(rows):
        ceilings.append({row.request_id: row.ceiling for row in rows})
        return real_plan(rows)

    monkeypatch.setattr(engine.policy, "plan", plan)
    out = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r, out[r.request_id].append)
    for _ in range(3):
        engine.step()
    assert engine.attach_drafter(_SlowToReopen(embedded_engine.drafter, steps=6)) == 2
    planned_from = len(ceilings)
    reopening = []
    while engine.has_work():
        reopening.append(all(s.draft_reopening for s in engine.scheduler.running))
        engine.step()
    after = ceilings[planned_from:]
    assert reopening[0] and after[0] == {"re0": 0, "re1": 0}, after[:3]
    assert any(c and min(c.values()) == 4 for c in after), after  # drafting again
    for r in reqs:
        assert _result(out[r.request_id]).token_ids == solo[r.request_id]
    assert embedded_engine.drafter.runner.num_sequences == 0


def test_a_draft_model_with_a_shorter_context_caps_drafting_not_the_requests(
    tiny_checkpoints, tiny_tokenizer, tmp_path
):
    """A pair whose draft model has a shorter context than the verifier (64 against 256
    positions here): a prompt beyond the draft's context decodes without drafts, a row
    that grows past it stops drafting there, and neither fails nor counts as a draft
    failure; every greedy output stays the verifier's. Before, the draft model's own
    context check raised inside the step and ended every request of the batch."""
    from tests.tiny_models import build_tiny

    short = build_tiny(
        tmp_path / "short", "qwen2", tiny_tokenizer, seed=5, max_position_embeddings=64
    )
    engine = local_engine(str(tiny_checkpoints["llama"]), str(short))
    assert engine.drafter.max_context == 64 and engine.verifier.max_context == 256

    def req(rid, n, max_tokens, rule="cactus"):
        return GenerationRequest(
            prompt_token_ids=tuple(5 + (i * 7) % 300 for i in range(n)),
            request_id=rid,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            speculation=SpeculationParams(rule=rule, delta=1.0, num_speculative_tokens=4),
        )

    reqs = [req("beyond", 100, 30, "sps"), req("crosses", 40, 60), req("short", 10, 20)]
    sessions = []  # per step: the draft sessions held, and how long "crosses" was

    def watch(steps, batch):
        crossing = engine._live.get("crosses")
        if crossing is not None:
            sessions.append((crossing.committed, set(engine.drafter._reqs)))

    out = _run_together(engine, reqs, on_step=watch)
    # a row at the draft context gives its draft session (and draft row) back at once
    assert any(n < 62 and "crosses" in held for n, held in sessions), sessions
    assert all("crosses" not in held for n, held in sessions if n >= 63), sessions
    assert "beyond" not in set().union(*(held for _, held in sessions))
    for r in reqs:
        got = _result(out[r.request_id])
        want = engine.generate(
            replace(r, request_id=f"ref-{r.request_id}", speculation=SpeculationParams(rule="none"))
        )
        assert got.token_ids == want.token_ids, r.request_id
        assert got.stats.draft_failures == 0 and not got.stats.degraded, r.request_id
    stats = {r.request_id: _result(out[r.request_id]).stats for r in reqs}
    assert stats["beyond"].num_draft_tokens == 0
    assert 0 < stats["crosses"].num_draft_tokens < 4 * 60
    assert stats["short"].num_draft_tokens > 0


def test_a_request_that_reached_its_divergence_ceiling_stays_lossless(
    embedded_engine, heldout_prompts, monkeypatch
):
    """acceptance.md: once the running sum would exceed max_divergence_nats, the request's
    REMAINING positions use delta = 0, in later steps too (the kernel's flag alone covers
    only its own call). Recorded at the kernel's boundary: after the step that spent the
    budget, the request is verified with delta 0 at every step, its divergence no longer
    grows, and the ceiling holds."""
    import workers.engine as engine_module

    real = engine_module.ragged_accept
    seen = []  # (delta, budget_exhausted, divergence) per step of the capped request

    def recording(ids, draft, target, metadata, **kw):
        result = real(ids, draft, target, metadata, **kw)
        if metadata.num_draft_tokens and metadata.num_draft_tokens[0]:
            seen.append(
                (
                    float(metadata.delta[0]),
                    bool(result.budget_exhausted[0]),
                    float(result.divergence_nats[0]),
                )
            )
        return result

    monkeypatch.setattr(engine_module, "ragged_accept", recording)
    req = _req(heldout_prompts[3], "capped", rule="cactus", delta=1.0, k=4, temperature=1.0)
    req = replace(
        req,
        sampling=replace(req.sampling, seed=11, max_tokens=60),
        speculation=replace(req.speculation, max_divergence_nats=0.3),
    )
    result = _result(_run_together(embedded_engine, [req])["capped"])
    spent = next(i for i, (_, exhausted, _) in enumerate(seen) if exhausted)
    assert spent + 1 < len(seen), "the budget was spent at the last step: nothing to see"
    assert all(delta == 1.0 for delta, _, _ in seen[: spent + 1]), seen
    assert all(delta == 0.0 and div == 0.0 for delta, _, div in seen[spent + 1 :]), seen
    assert result.stats.divergence_capped and result.stats.divergence_nats <= 0.3 + 1e-9
    assert result.stats.divergence_nats == pytest.approx(sum(d for _, _, d in seen))
    # resumed on a rebuilt engine (the supervisor hands over the stats so far): the
    # spent budget stays spent from the new attempt's first step
    seen.clear()
    resumed = replace(
        req,
        request_id="capped-resumed",
        resume_token_ids=tuple(result.token_ids[:10]),
        resume_stats=result.stats.as_dict(),
    )
    again = _result(_run_together(embedded_engine, [resumed])["capped-resumed"])
    assert seen and all(delta == 0.0 and div == 0.0 for delta, _, div in seen), seen
    assert again.stats.divergence_capped
    assert again.stats.divergence_nats == result.stats.divergence_nats


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_request_whose_logits_are_not_finite_fails_alone(
    embedded_engine, heldout_prompts, monkeypatch, bad
):
    """A NaN in one request's verifier logits (a float16 overflow, say) ends that request
    with ModelOutputError, never a silent garbage token; the other rows of its batch give
    their solo tokens."""
    from cactus.errors import ModelOutputError

    reqs = [_req(heldout_prompts[i], f"r{i}", temperature=0.0, max_tokens=16) for i in range(3)]
    solo = {r.request_id: embedded_engine.generate(r).token_ids for r in reqs}
    verifier = embedded_engine.verifier
    real = verifier.score
    calls = []

    def poisoned(rows):
        logits = real(rows)
        calls.append(len(rows))
        if len(calls) == 3:  # a decode step with every request in it
            i = [rid for rid, _ in rows].index("r1")
            logits[i] = logits[i].clone()
            logits[i][-1, 5] = bad
        return logits

    monkeypatch.setattr(verifier, "score", poisoned)
    embedded_engine.last_step = None
    recorded = []  # rows the metrics' StepRecord kept, rows stepped

    def on_step(_step, batch):
        if embedded_engine.last_step is not None:
            recorded.append((len(embedded_engine.last_step.ks), batch))
            embedded_engine.last_step = None

    out = _run_together(embedded_engine, reqs, on_step=on_step)
    assert isinstance(out["r1"][-1], ModelOutputError), out["r1"][-1:]
    assert "not finite" in str(out["r1"][-1])
    for rid in ("r0", "r2"):
        assert _result(out[rid]).token_ids == solo[rid], rid
    assert not embedded_engine.has_work()
    # the policy metrics leave the failed row out of its step (it emitted nothing)
    assert [(kept, rows) for kept, rows in recorded if kept != rows] == [(2, 3)], recorded


def test_a_request_whose_draft_probabilities_are_not_finite_goes_on_without_drafts(
    embedded_engine, heldout_prompts, monkeypatch
):
    """A NaN in one sampled request's draft logits (a float16 draft overflowing) made a
    NaN p, which the kernel took for a rejection and whose NaN residual gave token 0:
    the in-process drafter checked nothing (the wire checks the draft actor's blocks).
    Now that row's block is a draft failure: the request goes on by plain decoding, and
    the other rows give their solo tokens."""
    reqs = [
        _req(heldout_prompts[i], f"n{i}", temperature=0.8, seed=40 + i, max_tokens=16)
        for i in range(3)
    ]
    solo = {r.request_id: embedded_engine.generate(r).token_ids for r in reqs}
    runner = embedded_engine.drafter.runner
    real = runner.forward
    calls = []

    def poisoned(seq_ids, token_ids, **kw):
        logits = real(seq_ids, token_ids, **kw)
        if kw.get("logits") == "last" and "n1" in seq_ids and len(seq_ids) == 3:
            calls.append(1)
            if len(calls) == 2:  # a draft forward with every request in it
                i = list(seq_ids).index("n1")
                logits[i] = torch.full_like(logits[i], float("nan"))
        return logits

    monkeypatch.setattr(runner, "forward", poisoned)
    out = _run_together(embedded_engine, reqs)
    assert len(calls) >= 2
    poisoned_result = _result(out["n1"])
    assert poisoned_result.stats.draft_failures == 1
    assert len(poisoned_result.token_ids) == 16
    for rid in ("n0", "n2"):
        assert _result(out[rid]).token_ids == solo[rid], rid
    assert not embedded_engine.has_work()


@pytest.mark.parametrize("where", ["start", "chunk"])
def test_a_draft_prefill_that_raises_degrades_its_request_alone(
    embedded_engine, heldout_prompts, monkeypatch, where
):
    """An error in the in-process drafter's prefill other than a drafter's usual ones
    (an out-of-memory RuntimeError, say) escaped the step and ended every request of
    the batch. It now degrades that request alone, as a draft actor's failure does:
    raised by `start` at admission, or by a prefill chunk in a later step
    (`LocalDrafter.advance`: the chunk frees the draft row, and the error is the row's
    at its first propose); the others keep their drafts."""
    reqs = [_req(heldout_prompts[i], f"d{i}", temperature=0.0, max_tokens=12) for i in range(3)]
    solo = {r.request_id: embedded_engine.generate(r).token_ids for r in reqs}
    drafter = embedded_engine.drafter
    if where == "start":
        real_start = drafter.start

        def failing_start(request_id, *args, **kw):
            if request_id == "d1":
                raise RuntimeError("out of memory in the draft prefill")
            return real_start(request_id, *args, **kw)

        monkeypatch.setattr(drafter, "start", failing_start)
    else:
        real_forward = drafter.runner.forward

        def failing_chunk(seq_ids, token_ids, **kw):
            if kw.get("logits") == "none" and list(seq_ids) == ["d1"]:
                raise RuntimeError("out of memory in a draft prefill chunk")
            return real_forward(seq_ids, token_ids, **kw)

        monkeypatch.setattr(drafter.runner, "forward", failing_chunk)
    out = _run_together(embedded_engine, reqs)
    for rid in ("d0", "d1", "d2"):  # greedy: the verifier's tokens, drafts or none
        assert _result(out[rid]).token_ids == solo[rid], rid
    assert _result(out["d1"]).stats.draft_failures == 1
    assert _result(out["d1"]).stats.num_drafts == 0
    assert _result(out["d0"]).stats.num_drafts > 0 and _result(out["d2"]).stats.num_drafts > 0
    assert not embedded_engine.has_work() and drafter.runner.num_sequences == 0


def test_a_long_prompts_draft_prefill_goes_in_within_the_steps_budget(
    embedded_engine, heldout_prompts, monkeypatch
):
    """The in-process drafter prefilled a new request's whole draft prompt inside its
    admission, so a long prompt stalled every running row for that long (outside the
    step's token budget, and counted by the policy as step time). Its draft prefill now
    goes in a chunk at a time in the steps, within the step's prefill budget, while the
    running row decodes; each request still gives its solo tokens."""
    import workers.local

    monkeypatch.setattr(workers.local, "DRAFT_PREFILL_CHUNK", 8)
    engine = _sharing(embedded_engine, max_num_seqs=2, max_num_batched_tokens=16)
    short = _req(heldout_prompts[0], "short", seed=3, temperature=0.8, max_tokens=40)
    long = _req(" ".join(heldout_prompts[1:7]), "long", seed=4, temperature=0.8)
    solo = {r.request_id: embedded_engine.generate(r).token_ids for r in (short, long)}
    runner = embedded_engine.drafter.runner
    real = runner.forward
    widths: list[int] = []  # draft prefill tokens of the step running now

    def recorded(seq_ids, token_ids, **kw):
        if kw.get("logits") == "none":
            widths.append(sum(len(t) for t in token_ids))
        return real(seq_ids, token_ids, **kw)

    monkeypatch.setattr(runner, "forward", recorded)
    out = {"short": [], "long": []}
    engine.add_request(short, out["short"].append)
    while not engine.scheduler.running:
        engine.step()
    engine.add_request(long, out["long"].append)
    per_step, decoding = [], 0
    while engine.has_work():
        widths.clear()
        batch = engine.step()
        per_step.append(sum(widths))
        if widths and batch and any(s.id == "long" for s in engine.scheduler.prefilling):
            decoding += 1  # the short row decoded in a step that prefilled the long draft
        assert len(per_step) < 500
    long_ids = embedded_engine.tokenizer.encode(long.prompt, add_special_tokens=False)
    assert sum(per_step) >= len(long_ids) - 1  # the whole draft prompt went in
    # at most the budget's 16 tokens a step, in whole chunks of 8: 24
    assert max(per_step) <= 24, per_step
    assert decoding >= 3, per_step
    for rid in ("short", "long"):
        assert _result(out[rid]).token_ids == solo[rid], rid
        assert _result(out[rid]).stats.num_drafts > 0


def test_tas_alpha_reaches_the_kernel_per_request(embedded_engine, heldout_prompts):
    """Two tas requests in one batch, alpha 0 (every drafted token with q > 0 accepted)
    and the default: each gives its solo tokens, and alpha 0 accepts more."""
    reqs = []
    for rid, alpha in (("a0", 0.0), ("default", None)):
        r = _req(heldout_prompts[5], rid, rule="tas", delta=0.0, k=4, temperature=0.9, seed=7)
        r = replace(r, sampling=replace(r.sampling, max_tokens=40))
        reqs.append(replace(r, speculation=replace(r.speculation, tas_alpha=alpha)))
    solo = {r.request_id: embedded_engine.generate(r) for r in reqs}
    out = _run_together(embedded_engine, reqs)
    for r in reqs:
        assert _result(out[r.request_id]).token_ids == solo[r.request_id].token_ids
    accepted = {rid: res.stats.acceptance_rate for rid, res in solo.items()}
    assert accepted["a0"] > accepted["default"], accepted


def test_a_step_that_only_prefills_still_calls_the_drafter(embedded_engine, heldout_prompts):
    """A remote drafter renews its draft sessions' leases from the engine's draft calls
    (workers/grpc_drafter.py). A step with no running row made none, so a prompt that
    took longer than the lease to prefill lost its draft session. Every such step now
    makes an empty prefetch."""

    class Recording:
        def __init__(self, inner) -> None:
            self.inner, self.prefetches = inner, []

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def prefetch(self, rows) -> None:
            self.prefetches.append(list(rows))
            self.inner.prefetch(rows)

    drafter = Recording(embedded_engine.drafter)
    engine = SpeculativeEngine(
        drafter,
        embedded_engine.verifier,
        embedded_engine.tokenizer,
        scheduler=SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=8, min_prefill_chunk=8, policy="fixed"
        ),
    )
    calls_after_prefill_only_steps = []

    def on_step(_step, _batch):
        if not engine.scheduler.running and engine.scheduler.prefilling:
            calls_after_prefill_only_steps.append(len(drafter.prefetches))

    prompt = " ".join(heldout_prompts[:2])
    out = _run_together(
        engine, [_req(prompt, "long", seed=1, temperature=0.8, max_tokens=4)], on_step=on_step
    )
    assert _result(out["long"]).token_ids  # it decoded once its prompt was in
    seen = calls_after_prefill_only_steps
    assert len(seen) >= 3, seen
    # one more prefetch in every prefill-only step, with no row in it
    assert seen == list(range(seen[0], seen[0] + len(seen))) and seen[0] >= 1, seen
    assert all(rows == [] for rows in drafter.prefetches[: seen[-1]])


def test_logit_bias_moves_only_its_rows_tokens_before_the_processing():
    """A row's logit_bias is added to its logits before temperature / top-k / top-p (and
    the greedy argmax); rows without one, in the same batch, are bit-identical to their
    solo processing; ids past the model's vocabulary (a smaller draft's) are left out."""
    import torch

    from workers.batching import processed_rows

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    plain = SamplingParams(temperature=0.7, top_k=20)
    favour = replace(plain, logit_bias=((7, 100.0), (60, 5.0)))  # 60: past this vocab
    ban = SamplingParams(temperature=0.0, logit_bias=((int(logits[2].argmax()), -100.0),))
    probs = processed_rows(logits, [plain, favour, ban])
    assert torch.equal(probs[0], processed_rows(logits[:1], [plain])[0])
    assert float(probs[1, 7]) > 0.999
    want = logits[2].clone()
    want[int(logits[2].argmax())] -= 100.0
    assert int(probs[2].argmax()) == int(want.argmax()) != int(logits[2].argmax())
    assert float(probs[2].max()) == 1.0  # greedy: one-hot at the biased argmax


def test_logit_bias_reaches_the_verifier_and_the_drafter(embedded_engine, heldout_prompts):
    """A token favoured by +100 is every token of a greedy request, whatever its rule;
    the draft proposes from the same biased distribution, so it proposes that token and
    the verifier accepts every draft. A sampled, seeded request with a bias gives its
    solo tokens in a batch beside others."""
    tok = embedded_engine.tokenizer.encode("x", add_special_tokens=False)[0]
    bias = ((tok, 100.0),)
    reqs = [
        _req(heldout_prompts[i], f"bias-{rule}", rule=rule, temperature=0.0, logit_bias=bias)
        for i, rule in enumerate(("none", "sps", "cactus", "cactus_exact"))
    ]
    sampled = _req(
        heldout_prompts[5], "bias-s", temperature=0.9, seed=11, logit_bias=((tok, -100.0),)
    )
    solo = embedded_engine.generate(replace(sampled, request_id="bias-solo"))
    out = _run_together(embedded_engine, [*reqs, sampled, *_mixed(heldout_prompts)[:3]])
    for req in reqs:
        got = _result(out[req.request_id])
        assert set(got.token_ids) == {tok}, req.request_id
        if req.speculation.rule != "none":
            assert got.stats.num_draft_tokens > 0
            assert got.stats.num_accepted_tokens == got.stats.num_draft_tokens
    got = _result(out["bias-s"])
    assert got.token_ids == solo.token_ids and tok not in got.token_ids


def _reserve(runner, rid):
    return runner._reserves[runner._ids.index(rid)]


def test_a_reopened_draft_session_reserves_what_its_verifier_row_does(
    embedded_engine, heldout_prompts
):
    """A draft session opened after tokens were committed (a resumed request; every
    running request re-opened on a new drafter after a draft actor died) reserves the
    request's own length, prompt + max_tokens, as its verifier row does: not max_tokens
    more on top of the tokens already generated, which made a tight KV budget refuse
    later draft sessions (those requests then decoded without drafts)."""
    engine = embedded_engine
    draft_runner = engine.drafter.runner
    first = engine.generate(_req(heldout_prompts[0], "first", temperature=0.0, max_tokens=40))
    resumed = replace(
        _req(heldout_prompts[0], "resumed", temperature=0.0, max_tokens=40),
        resume_token_ids=tuple(first.token_ids[:15]),
    )
    seen = []

    def on_step(steps, _batch):
        if steps == 3:  # mid-request: re-open every session, as a new draft actor does
            assert engine.attach_drafter(engine.drafter) == 2
        for rid in ("resumed", "fresh"):
            state = engine._live.get(rid)
            if state is not None and rid in draft_runner._ids and state.drafting:
                seen.append(
                    (rid, steps, _reserve(draft_runner, rid), _reserve(engine.verifier.runner, rid))
                )

    fresh = _req(heldout_prompts[1], "fresh", temperature=0.0, max_tokens=40)
    out = _run_together(engine, [resumed, fresh], on_step=on_step)
    assert {rid for rid, *_ in seen} == {"resumed", "fresh"}
    assert any(steps >= 3 for _, steps, *_ in seen)  # after the re-open too
    assert all(draft == verify for _, _, draft, verify in seen), seen
    # and the resumed request still speculates to the end and gives its solo tokens
    again = _result(out["resumed"])
    assert again.token_ids == first.token_ids
    assert again.stats.draft_failures == 0 and again.stats.num_draft_tokens > 0


def test_a_request_whose_time_runs_out_while_it_waits_ends_then_and_frees_its_place(
    embedded_engine, heldout_prompts
):
    """One row (max_num_seqs 1): a request waiting behind a running one whose time limit
    passes ends TIME_LIMIT with no token at the next step, while the running one goes
    on; the one queued after it is admitted when the row frees, first come first
    served, and nothing is left on either side."""
    import time

    engine = SpeculativeEngine(
        embedded_engine.drafter,
        embedded_engine.verifier,
        embedded_engine.tokenizer,
        scheduler=SchedulerConfig(max_num_seqs=1, policy="fixed"),
    )
    long = _req(heldout_prompts[0], "long", temperature=0.0, max_tokens=120)
    late = _req(heldout_prompts[1], "late", temperature=0.0, max_tokens=8)
    late = replace(late, time_limit_s=0.005)  # over before the first step ends
    after = _req(heldout_prompts[2], "after", temperature=0.0, max_tokens=8)
    ended: dict[str, int] = {}
    out = {r.request_id: [] for r in (long, late, after)}
    for r in (long, late, after):
        engine.add_request(r, out[r.request_id].append)
    started = time.monotonic()
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        for rid, items in out.items():
            last = items[-1] if items else None
            done = isinstance(last, BaseException) or getattr(last, "result", None)
            if done and rid not in ended:
                ended[rid] = steps
        assert steps < 500
    took = time.monotonic() - started
    late_result = _result(out["late"])
    assert late_result.finish_reason == "TIME_LIMIT" and len(late_result.token_ids) == 0
    assert ended["late"] < ended["long"] < ended["after"], (ended, took)
    assert _result(out["long"]).finish_reason == "LENGTH"
    assert _result(out["after"]).token_ids  # admitted once the row freed
    assert engine.verifier.runner.num_sequences == 0
    assert engine.drafter.runner.num_sequences == 0


def test_a_failed_steps_decode_record_is_never_counted_as_the_next_steps():
    """A step that raised after its decode left `engine.last_step`; the loop records
    batch 0 for it, which neither counted nor cleared it, and the next step (whose own
    decode failed, recording nothing) counted it. Every record is now taken, once."""
    from types import SimpleNamespace

    from workers.engine import StepRecord
    from workers.engine_metrics import EngineMetrics

    counted: list = []
    fake = SimpleNamespace(inc=lambda n, tags: counted.append((n, tags)), observe=counted.append)
    metrics = EngineMetrics.__new__(EngineMetrics)  # its Ray metrics replaced by fakes
    metrics.steps = 0
    metrics.batch = metrics.round_trip = metrics.chosen_k = fake
    metrics.predicted = metrics.realised = fake
    metrics.running = metrics.waiting = SimpleNamespace(set=lambda v: None)
    metrics.cancelled = {}
    engine = SimpleNamespace(
        drafter=SimpleNamespace(),
        last_step=StepRecord(rules=["cactus"], ks=[4], accepted=[2], predicted=[3.0]),
        cancelled_work=None,
        scheduler=SimpleNamespace(num_rows=1, waiting=[]),
    )
    metrics.record(engine, 0)  # the failed step
    assert engine.last_step is None and counted == []
    metrics.record(engine, 3)  # a next step whose decode set no record
    assert counted == []
    engine.last_step = StepRecord(rules=["sps"], ks=[2], accepted=[1], predicted=[2.0])
    metrics.record(engine, 1)
    assert (1, {"rule": "sps", "k": "2"}) in counted and 1 in counted


def test_a_block_cut_by_a_stop_counts_only_its_emitted_positions(
    embedded_engine, heldout_prompts, monkeypatch
):
    """acceptance.md sums the divergence over the positions whose token is emitted. A
    block whose first accepted token is a stop id ends the request there; the kernel had
    summed d(h || q) over every verified position of the block, and the statistics
    counted every accepted draft. Now the request reports position 0's divergence,
    d(h_0 || q_0) with h_0 Cactus's boosted mass (recomputed here from the kernel's
    inputs), and one accepted draft."""
    import workers.engine as engine_module
    from kernels.divergence import binary_kl, cactus_boost

    real = engine_module.ragged_accept
    calls = []

    def recording(ids, draft, target, metadata, **kw):
        result = real(ids, draft, target, metadata, **kw)
        calls.append((ids, target, metadata, result))
        return result

    monkeypatch.setattr(engine_module, "ragged_accept", recording)
    for seed in range(20):  # a seed whose first block accepts 2 or more drafts
        req = _req(heldout_prompts[5], f"free{seed}", delta=2.0, temperature=1.0, seed=seed)
        calls.clear()
        free = _result(_run_together(embedded_engine, [req])[req.request_id])
        ids, target, _, result = calls[0]
        if int(result.num_accepted[0]) >= 2:
            break
    else:
        pytest.fail("no seed of 20 accepted 2 drafts in its first block")
    full = float(result.divergence_nats[0])
    q_0 = target[0, ids[0]].to(torch.float64).reshape(1)
    want = float(binary_kl(cactus_boost(q_0, torch.tensor([2.0], dtype=torch.float64)), q_0)[0])
    assert 0 < want < full  # the block's other positions add to it
    stop = free.token_ids[0]
    cut = replace(
        req,
        request_id=f"cut{seed}",
        sampling=replace(req.sampling, stop_token_ids=(stop,)),
    )
    calls.clear()
    got = _result(_run_together(embedded_engine, [cut])[cut.request_id])
    assert got.token_ids == (stop,) and got.finish_reason == "STOP"
    # the step's call (the same block), then the emitted prefix's
    assert [c[2].num_draft_tokens for c in calls] == [(4,), (1,)]
    assert float(calls[0][3].divergence_nats[0]) == full
    assert got.stats.num_accepted_tokens == 1 and got.stats.accepted_per_position[:2] == [1, 0]
    assert got.stats.divergence_nats == pytest.approx(want, rel=1e-12)


def test_logprobs_beyond_a_small_vocabulary_give_every_token_it_has():
    """logprobs N is bounded by 20, not by the vocabulary: with fewer tokens than N,
    topk raised inside the step and ended every request of the batch."""
    from types import SimpleNamespace

    from workers.engine import _logprobs

    state = SimpleNamespace(request=SimpleNamespace(sampling=SimpleNamespace(logprobs=20)))
    target = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(0)), -1)
    out = _logprobs([state], [2], [[4, 7, 1]], [2], target)
    assert [t.token_id for t in out[0]] == [4, 7, 1]
    assert all(len(t.top) == 10 for t in out[0])


def test_a_cancel_check_that_raises_ends_its_request_alone(embedded_engine, heldout_prompts):
    """`cancelled` is the caller's callable, read every step for every request: one that
    raised ended the step, and the loop then ended every admitted request with it. Now
    its own request ends with that error and the others finish."""
    calls = [0]

    def broken() -> bool:
        calls[0] += 1
        if calls[0] > 2:
            raise RuntimeError("the caller's cancel flag is gone")
        return False

    engine = _sharing(embedded_engine)
    reqs = [
        _req(p, f"c{i}", temperature=0.0, max_tokens=12) for i, p in enumerate(heldout_prompts[:3])
    ]
    out = _run_together(engine, reqs, cancelled={"c1": broken})
    assert isinstance(out["c1"][-1], RuntimeError) and calls[0] == 3
    for rid in ("c0", "c2"):
        assert len(_result(out[rid]).token_ids) == 12
    assert engine.scheduler.num_rows == 0
    assert embedded_engine.verifier.runner.num_sequences == 0


@pytest.mark.parametrize("seed", range(4))
def test_an_emitted_prefix_is_verified_as_the_step_verified_those_positions(seed):
    """`_Verified.prefix` re-verifies row i's first n drafted tokens (a block cut by a
    stop). Over a ragged batch of every rule, K, delta and budget (the kernel tests'
    rows, most at i > 0): n = every position the step's call summed gives that call's
    divergence and budget flag exactly (a wrong row, offset or uniform would not), and
    shorter prefixes give partial sums that only grow."""
    from kernels import ragged_accept
    from tests.kernels.test_ragged import ROWS, make_batch
    from workers.engine import _Verified

    batch = make_batch(ROWS, seed)
    ids, draft, target = batch.flat()
    full = ragged_accept(ids, draft, target, batch.metadata)
    verified = _Verified(ids, draft, target, batch.metadata)
    cut = 0
    for i, k in enumerate(batch.metadata.num_draft_tokens):
        if not k:
            continue
        accepted = int(full.num_accepted[i])
        div, capped = verified.prefix(i, min(accepted + 1, k))
        assert div == float(full.divergence_nats[i]), (i, div)
        assert capped == bool(full.budget_exhausted[i]), i
        partial = [verified.prefix(i, n)[0] for n in range(1, min(accepted, k - 1) + 1)]
        assert partial == sorted(partial) and all(d <= div for d in partial), (i, partial)
        cut += len(partial)
    assert cut >= 3  # rows whose accepted run a stop could cut
