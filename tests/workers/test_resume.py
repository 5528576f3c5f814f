"""Request migration, engine side: a request resumed from the tokens it had already
sent continues as if it had never stopped (workers/supervisor.py builds such requests
after an engine failure)."""

from dataclasses import replace

import pytest

from cactus.errors import InvalidRequestError
from cactus.params import (
    GenerationRequest,
    Limits,
    SamplingParams,
    SpeculationParams,
    validate_request,
)
from tests.conftest import request_state
from workers.supervisor import _attempt


def _req(prompt_ids, rid, **sampling):
    return GenerationRequest(
        prompt_token_ids=tuple(prompt_ids),
        request_id=rid,
        sampling=SamplingParams(**sampling),
        speculation=SpeculationParams(rule="cactus", delta=1.0, num_speculative_tokens=4),
    )


def _streamed(engine, req):
    ids, text, last = [], "", None
    for chunk in engine.stream(req):
        ids += chunk.token_ids
        text += chunk.text
        last = chunk
    return ids, text, last.result


@pytest.mark.parametrize("cut", [1, 9, 23])
def test_a_resumed_greedy_stream_equals_the_uninterrupted_one(
    embedded_engine, heldout_prompts, cut
):
    prompt = embedded_engine.tokenizer.encode(heldout_prompts[3], add_special_tokens=False)
    whole = _req(prompt, "whole", max_tokens=40, temperature=0.0)
    ids, text, result = _streamed(embedded_engine, whole)
    assert len(ids) == 40
    # The caller got `cut` tokens and part of their text, then the engine died.
    sent_text = embedded_engine.tokenizer.decode(ids[:cut])[:-1]
    resumed = replace(
        whole,
        request_id=f"resumed-{cut}",
        resume_token_ids=tuple(ids[:cut]),
        resume_text_chars=len(sent_text),
    )
    rest_ids, rest_text, rest = _streamed(embedded_engine, resumed)
    assert ids[:cut] + rest_ids == ids  # no token lost, none repeated
    assert sent_text + rest_text == text  # nor a character
    assert rest.token_ids == result.token_ids and rest.text == result.text
    assert rest.prompt_tokens == len(prompt) and rest.finish_reason == "LENGTH"


def test_a_stop_string_across_the_resume_point_still_stops(embedded_engine, heldout_prompts):
    prompt = embedded_engine.tokenizer.encode(heldout_prompts[0], add_special_tokens=False)
    probe = _streamed(embedded_engine, _req(prompt, "probe", max_tokens=30, temperature=0.0))
    text = probe[1]
    stop = text[10:14]  # four characters of the greedy text
    whole = _req(prompt, "stop-whole", max_tokens=30, temperature=0.0, stop=(stop,))
    ids, streamed, result = _streamed(embedded_engine, whole)
    assert result.finish_reason == "STOP_SEQUENCE"
    # Resume at a token inside the stop string (the stream had held its head back).
    cut = next(i for i in range(1, len(ids)) if len(embedded_engine.tokenizer.decode(ids[:i])) > 11)
    resumed = replace(
        whole,
        request_id="stop-resumed",
        resume_token_ids=tuple(ids[:cut]),
        resume_text_chars=min(10, len(streamed)),
    )
    rest_ids, rest_text, rest = _streamed(embedded_engine, resumed)
    assert rest.finish_reason == "STOP_SEQUENCE"
    assert ids[:cut] + rest_ids == ids
    assert streamed[:10] + rest_text == streamed == rest.text


def test_a_resumed_sampled_request_keeps_its_length_and_context(embedded_engine, heldout_prompts):
    prompt = embedded_engine.tokenizer.encode(heldout_prompts[1], add_special_tokens=False)
    first = _streamed(embedded_engine, _req(prompt, "s1", max_tokens=32, temperature=0.8, seed=3))
    resumed = replace(
        _req(prompt, "s2", max_tokens=32, temperature=0.8, seed=4),
        resume_token_ids=tuple(first[0][:12]),
    )
    rest_ids, _, rest = _streamed(embedded_engine, resumed)
    assert len(rest_ids) == 20 and rest.token_ids[:12] == tuple(first[0][:12])
    assert len(rest.token_ids) == 32


def test_resume_fields_are_validated(embedded_engine):
    req = _req([5, 6, 7], "bad", max_tokens=4)
    with pytest.raises(InvalidRequestError, match="resume_token_ids"):
        embedded_engine.generate(replace(req, resume_token_ids=(1, 2, 3, 4)))
    with pytest.raises(InvalidRequestError, match="resume_token_ids"):
        embedded_engine.generate(replace(req, resume_token_ids=(10**7,)))
    with pytest.raises(InvalidRequestError, match="resume_text_chars"):
        embedded_engine.generate(replace(req, resume_text_chars=-1))


def test_a_resumed_request_goes_on_from_its_statistics(embedded_engine, heldout_prompts):
    """The divergence budget is the request's, not the attempt's: a resumed request
    that had spent its budget accepts no more divergence."""
    prompt = embedded_engine.tokenizer.encode(heldout_prompts[2], add_special_tokens=False)
    spec = SpeculationParams(rule="cactus", delta=2.0, max_divergence_nats=0.5)
    req = replace(_req(prompt, "budget", max_tokens=24, temperature=0.9, seed=8), speculation=spec)
    first = embedded_engine.generate(req)
    spent = {
        "num_drafts": 5,
        "num_draft_tokens": 20,
        "num_accepted_tokens": 12,
        "accepted_per_position": [5, 4, 2, 1],
        "divergence_nats": 0.5,
        "draft_failures": 1,
    }
    resumed = replace(
        req,
        request_id="budget-resumed",
        resume_token_ids=first.token_ids[:6],
        resume_stats=spent,
    )
    out = embedded_engine.generate(resumed).stats
    assert out.num_drafts >= 5 and out.num_draft_tokens >= 20 and out.draft_failures == 1
    assert out.accepted_per_position[0] >= 5 and out.degraded
    assert out.divergence_nats == pytest.approx(0.5, abs=1e-9)  # nothing more was spent


# Seeds at the edges of the range a request may ask for (0 .. 2^64 - 1), and some others.
SEEDS = (0, 1, 7, 2**63 - 1, 2**63, 2**64 - 1, 0x1234_5678_9ABC_DEF0, 0x9E37_79B9_7F4A_7C15)


def test_a_resumed_stream_continues_from_a_derived_seed():
    """README (recovery): a resumed stream goes on after the tokens it sent from a seed
    derived from the request's, so no random draw is reused; a unary request (nothing
    sent) runs again with its own seed. The derived seeds differ per attempt and from
    the request's, are a function of (seed, attempt) alone, and are valid seeds."""
    limits = Limits(max_context=512, vocab_size=1000)
    for seed in SEEDS:
        req = _req([5, 6, 7], "r", max_tokens=32, temperature=0.9, top_p=0.95, seed=seed)
        assert _attempt(req, 0, None) is req
        again = _attempt(req, 1, None)  # failed before sending anything: run it again
        assert again.sampling == req.sampling and again.request_id == "r~1"
        resumed = [_attempt(req, a, None, sent=(9, 10), sent_chars=2) for a in range(1, 9)]
        seeds = [r.sampling.seed for r in resumed]
        assert len(set(seeds)) == len(seeds) and seed not in seeds, (seed, seeds)
        assert seeds == [_attempt(req, a, None, sent=(11,)).sampling.seed for a in range(1, 9)]
        for attempt, r in enumerate(resumed, start=1):
            assert r.request_id == f"r~{attempt}" and r.resume_token_ids == (9, 10)
            # only the seed changes: the rest of the sampling parameters are the request's
            assert replace(r.sampling, seed=seed) == req.sampling
            validate_request(r, limits, prompt_len=3)


def test_no_generator_seed_of_an_earlier_attempt_is_used_again():
    """workers/request.py: a re-opened draft session (a new drafter) or a resumed
    request draws fresh numbers instead of replaying earlier ones at later positions.
    Across resumed attempts (supervisor) and re-opened draft sessions within each
    (engine), every torch generator a request's randomness comes from, the verifier's
    acceptance draws and the drafter's, is seeded differently: e.g. a stream whose
    drafter was replaced once and whose engine then failed does not draft with the
    seed its replaced drafter's session had."""
    for seed in SEEDS:
        req = _req([5, 6, 7], "r", max_tokens=32, temperature=0.9, seed=seed)
        verify, draft = [], []
        for attempt in range(6):
            inner = _attempt(req, attempt, None, sent=tuple(range(8, 8 + attempt)))
            # as the engine admits it (its seed: the request's)
            state = request_state(inner, seed=inner.sampling.seed)
            verify.append(state.generator.initial_seed())
            for epoch in range(6):  # the drafter replaced `epoch` times in this attempt
                state.draft_epoch = epoch
                draft.append(state.draft_seed)
        assert len(set(verify)) == len(verify), (seed, verify)
        assert len(set(draft)) == len(draft), (seed, sorted(draft))
        assert not set(verify) & set(draft), seed
