"""The scheduler alone: first come first served, rows, and the per-step token budget."""

from __future__ import annotations

import pytest

from cactus.params import GenerationRequest, SamplingParams
from workers.request import RequestState
from workers.scheduler import Scheduler, SchedulerConfig


def _state(rid: str, prompt_len: int) -> RequestState:
    req = GenerationRequest(
        prompt_token_ids=tuple(range(1, prompt_len + 1)),
        request_id=rid,
        sampling=SamplingParams(max_tokens=8),
    )
    return RequestState(
        req,
        list(req.prompt_token_ids),
        seed=0,
        eos=None,
        tokenizer=None,
        max_context=512,
        sink=lambda _item: None,
    )


def test_first_come_first_served_within_rows_and_fits():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2))
    states = [_state(f"r{i}", 10) for i in range(4)]
    for s in states:
        sched.add(s)
    started = []
    assert sched.admit(lambda s: True, started.append) == 2
    assert started == states[:2] and list(sched.waiting) == states[2:]
    assert sched.admit(lambda s: True, started.append) == 0  # no free row
    sched.remove(states[0])
    # The head does not fit: nothing behind it overtakes it.
    assert sched.admit(lambda s: s is not states[2], started.append) == 0
    assert sched.admit(lambda s: True, started.append) == 1 and started[-1] is states[2]


def test_prefill_budget_goes_to_decode_first_then_prompt_chunks():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=40, min_prefill_chunk=8))
    a, b = _state("a", 31), _state("b", 50)  # 30 and 49 prompt tokens to prefill
    for s in (a, b):
        sched.add(s)
    sched.admit(lambda s: True, lambda s: None)
    assert sched.prefill_plan(decode_tokens=0) == [(a, 30), (b, 10)]
    assert sched.prefill_plan(decode_tokens=35) == [(a, 8)]  # at least min_prefill_chunk
    a.prefilled, b.prefilled = 30, 40
    sched.promote()
    assert sched.running == [a] and sched.prefilling == [b]
    assert sched.prefill_plan(decode_tokens=5) == [(b, 9)]


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


def test_decode_tokens_are_never_cut_by_the_budget():
    """max_num_batched_tokens does not bound the decode rows: whatever they take, prompt
    chunks still get min_prefill_chunk, and the scheduler never asks to cut decode."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=128, min_prefill_chunk=32))
    a, b = _state("a", 41), _state("b", 41)
    for s in (a, b):
        sched.add(s)
    sched.admit(lambda s: True, lambda s: None)
    assert sched.prefill_plan(decode_tokens=288) == [(a, 32)]  # 288 + 32 > 128
    assert sched.prefill_plan(decode_tokens=100) == [(a, 32)]
    assert sched.prefill_plan(decode_tokens=60) == [(a, 40), (b, 28)]
