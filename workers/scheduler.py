"""The scheduler: which requests run, which wait, and how much prompt is prefilled per step.

vLLM's V1 policy in miniature: first come, first served; a request is admitted when a
row is free (max_num_seqs) and its KV reservation fits the verifier's budget, otherwise
it waits (it is never dropped; nothing behind it overtakes it). Each step runs every
running row's decode tokens (K + 1 each, never cut, even past the budget), then chunks of
the prompts being prefilled with what the decode tokens left of a token budget
(max_num_batched_tokens), at least min_prefill_chunk tokens while any prompt waits: a long
prompt never stalls the running rows, and no prompt waits for ever.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from workers.policy import POLICIES
from workers.request import RequestState


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # requests in the batch (rows), prefilling or decoding
    # a step's token budget: decode tokens (never cut) first, prompt chunks get what is left
    max_num_batched_tokens: int = 512
    min_prefill_chunk: int = 32  # prompt tokens a step always prefills when any wait
    policy: str = "goodput"  # speculation policy: k per row per step (workers/policy.py)
    # an idle engine, given a request, waits up to this long for each further arrival
    # before its first step (workers/engine_loop.py); 0 = step at once
    batch_wait_ms: float = 2.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0.0 <= self.batch_wait_ms <= 1000.0:
            raise ValueError(f"batch_wait_ms: must be in [0, 1000], got {self.batch_wait_ms}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "min_prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.waiting: deque[RequestState] = deque()  # not yet holding a row
        self.prefilling: list[RequestState] = []  # holding a row, prompt going in
        self.running: list[RequestState] = []  # in the decode batch

    @property
    def num_rows(self) -> int:
        return len(self.prefilling) + len(self.running)

    def __len__(self) -> int:
        return len(self.waiting) + self.num_rows

    def all(self) -> list[RequestState]:
        return [*self.running, *self.prefilling, *self.waiting]

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def admit(
        self, fits: Callable[[RequestState], bool], start: Callable[[RequestState], None]
    ) -> int:
        """Move waiting requests into rows, in arrival order, while they fit; `start`
        takes each one's rows before the next is considered."""
        admitted = 0
        while self.waiting and self.num_rows < self.config.max_num_seqs:
            if not fits(self.waiting[0]):
                break
            state = self.waiting.popleft()
            self.prefilling.append(state)
            start(state)
            admitted += 1
        return admitted

    def prefill_budget(self, decode_tokens: int) -> int:
        """The prompt tokens a step may prefill: what the decode tokens left of the
        budget, at least min_prefill_chunk (decode tokens are never cut)."""
        c = self.config
        return max(c.max_num_batched_tokens - decode_tokens, c.min_prefill_chunk)

    def prefill_plan(self, decode_tokens: int) -> list[tuple[RequestState, int]]:
        """(request, tokens) chunks for this step, within `prefill_budget`."""
        budget = self.prefill_budget(decode_tokens)
        plan = []
        for state in self.prefilling:
            n = min(state.to_prefill, budget)
            if n > 0:
                plan.append((state, n))
                budget -= n
            if budget <= 0:
                break
        return plan

    def promote(self) -> None:
        """Requests whose prompt is in join the decode batch (at the next step)."""
        done = [s for s in self.prefilling if s.to_prefill == 0]
        self.prefilling = [s for s in self.prefilling if s.to_prefill > 0]
        self.running.extend(done)

    def remove(self, state: RequestState) -> None:
        for group in (self.running, self.prefilling):
            if state in group:
                group.remove(state)
                return
        if state in self.waiting:
            self.waiting.remove(state)
