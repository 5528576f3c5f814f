"""logprobs: every emitted token's log-probability under the verifier's processed q at
its position, and the top alternatives, equal to q recomputed here by a plain forward
of the verifier over the prompt and the generated tokens (within 1e-4)."""

from dataclasses import replace

import pytest
import torch

from cactus.errors import InvalidRequestError
from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
from workers.batching import processed_rows
from workers.request import LOGPROB_FLOOR


def _request(prompt_ids, rid, rule, **sampling):
    return GenerationRequest(
        prompt_token_ids=tuple(prompt_ids),
        request_id=rid,
        sampling=SamplingParams(**sampling),
        speculation=SpeculationParams(rule=rule, delta=1.0, num_speculative_tokens=4),
    )


def _recomputed_log_q(engine, prompt_ids, generated, sampling) -> torch.Tensor:
    """log q for each generated position, from one forward over the whole text."""
    ids = list(prompt_ids) + list(generated)
    model = engine.verifier.runner.model
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    rows = logits[len(prompt_ids) - 1 : len(ids) - 1]
    q = processed_rows(rows, [sampling] * len(generated))
    return torch.nan_to_num(torch.log(q.double()), neginf=LOGPROB_FLOOR)


@pytest.mark.parametrize("rule", ["cactus", "sps", "none"])
def test_logprobs_are_the_verifiers_processed_q(embedded_engine, heldout_prompts, rule):
    prompt = embedded_engine.tokenizer.encode(heldout_prompts[4], add_special_tokens=False)
    sampling = {"max_tokens": 24, "temperature": 0.8, "top_k": 50, "seed": 3, "logprobs": 5}
    req = _request(prompt, f"lp-{rule}", rule, **sampling)
    chunks = list(embedded_engine.stream(req))
    result = chunks[-1].result
    assert len(result.logprobs) == len(result.token_ids)
    streamed = [lp for c in chunks for lp in (c.logprobs or ())]
    assert streamed == list(result.logprobs)  # the chunks carry their tokens' entries
    want = _recomputed_log_q(embedded_engine, prompt, result.token_ids, req.sampling)
    for pos, entry in enumerate(result.logprobs):
        assert entry.token_id == result.token_ids[pos]
        assert entry.logprob == pytest.approx(float(want[pos, entry.token_id]), abs=1e-4)
        assert entry.logprob > LOGPROB_FLOOR  # an emitted token lies in q's support
        assert len(entry.top) == 5
        # q's 5 largest (as values: ties may list either token), each at its own q
        values = [v for _, v in entry.top]
        assert values == pytest.approx(torch.topk(want[pos], 5).values.tolist(), abs=1e-4)
        assert all(v == pytest.approx(float(want[pos, t]), abs=1e-4) for t, v in entry.top)
        assert len({t for t, _ in entry.top}) == 5
        assert values == sorted(values, reverse=True)
        assert values[0] >= entry.logprob - 1e-9


def test_logprobs_off_by_default_zero_alternatives_and_validated(embedded_engine):
    base = _request([5, 6, 7, 8], "lp-off", "cactus", max_tokens=6, temperature=0.0)
    assert embedded_engine.generate(base).logprobs is None
    greedy = embedded_engine.generate(
        replace(base, request_id="lp-0", sampling=replace(base.sampling, logprobs=0))
    )
    assert [e.top for e in greedy.logprobs] == [()] * len(greedy.token_ids)
    assert all(e.logprob == 0.0 for e in greedy.logprobs)  # greedy q is one-hot
    # so every alternative lies outside q's support: -9999 stands for -inf (README)
    two = embedded_engine.generate(
        replace(base, request_id="lp-2", sampling=replace(base.sampling, logprobs=2))
    )
    assert LOGPROB_FLOOR == -9999.0
    for e in two.logprobs:
        assert e.top[0] == (e.token_id, 0.0) and e.top[1][1] == -9999.0, e
    for bad in (-1, 21, 2.5):
        with pytest.raises(InvalidRequestError, match="logprobs"):
            embedded_engine.generate(
                replace(base, request_id="lp-bad", sampling=replace(base.sampling, logprobs=bad))
            )
