"""What the engine needs from a draft model and from a verifier.

Two implementations of each exist: in-process ones around a ModelRunner
(workers/local.py) and distributed ones (a draft actor over gRPC, a tensor-parallel
verifier group). The engine's step is written once against these interfaces. Shaped
after Hugging Face assisted generation's candidate generator (propose, then be told
what was accepted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cactus.params import SamplingParams


@dataclass(frozen=True)
class DraftBlock:
    """K drafted tokens and the draft distributions they were sampled from."""

    request_id: str
    epoch: int  # committed length (prompt + generated) the block was drafted from
    token_ids: tuple[int, ...]  # [K]
    probs: torch.Tensor  # [K, V] float32, after the request's sampling processing


class Drafter(Protocol):
    def start(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, seed: int
    ) -> None:
        """Prefill the prompt and seed this request's draft sampler."""

    def propose(self, request_id: str, k: int) -> DraftBlock:
        """Draft k tokens after the committed text."""

    def commit(
        self, request_id: str, epoch: int, num_accepted: int, next_token: int, *, next_k: int = 0
    ) -> None:
        """Keep the first num_accepted drafted tokens, then next_token; drop the rest.
        next_k: the engine's next propose will ask for next_k tokens (0: none is coming
        for sure); a remote drafter may start drafting them now, overlapping the
        engine's bookkeeping. The block must be the one propose(next_k) would return."""

    def release(self, request_id: str) -> None:
        """Free the request's cache (idempotent)."""


class Verifier(Protocol):
    vocab_size: int
    max_context: int

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        """Prefill the prompt (all but its last token, which the first score consumes)."""

    def score(self, request_id: str, draft_token_ids: list[int]) -> torch.Tensor:
        """Logits [len(draft) + 1, V] float32: after the last committed token and after
        each drafted token (the last row is the bonus position)."""

    def commit(self, request_id: str, num_accepted: int, next_token: int) -> None:
        """Drop the rejected drafted tokens from the cache; next_token is now last."""

    def release(self, request_id: str) -> None:
        """Free the request's cache (idempotent)."""
