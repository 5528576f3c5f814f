"""What the batched engine needs from a draft model and from a verifier, and what the
Serve ingress needs from an engine.

Two implementations of each worker side exist: in-process ones around a BatchRunner
(workers/local.py) and distributed ones (a draft actor over gRPC, a tensor-parallel
verifier group). The engine's step is written once against these interfaces. Every call
that does model work takes ALL rows of a step (one draft pass, one verifier forward);
per-request calls are bookkeeping. The drafter is shaped after Hugging Face assisted
generation's candidate generator (propose, then be told what was accepted).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cactus.errors import CactusError
from cactus.params import SamplingParams


@dataclass(frozen=True)
class DraftBlock:
    """K drafted tokens and the draft distributions they were sampled from."""

    request_id: str
    epoch: int  # committed length (prompt + generated) the block was drafted from
    token_ids: tuple[int, ...]  # [K]
    probs: torch.Tensor  # [K, V] float32, after the request's sampling processing


@dataclass(frozen=True)
class ProposeRow:
    """One row of a batched propose: draft `k` tokens for `request_id`."""

    request_id: str
    k: int


class Drafter(Protocol):
    # The draft model's context (None: unknown). The engine drafts no row past it (a
    # pair whose draft has a shorter context than the verifier, say 2k against 32k).
    max_context: int | None

    def start(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, seed: int
    ) -> None:
        """Take a row, seed this request's draft sampler and begin the prompt's prefill
        (an in-process drafter goes on with it at each `advance`, a remote one on its
        own side; the first propose of the row waits for what is left). A prompt that
        does not fit raises ValueError, a full draft side WorkerUnavailableError."""

    def propose(self, rows: Sequence[ProposeRow]) -> list[DraftBlock | CactusError]:
        """Draft every row in one batched pass (K forwards for the longest row). A row
        that failed gets its error (StaleBlockError, WorkerUnavailableError) in place of
        a block: one bad row degrades that request only. DraftRetryError: the batched
        forward failed and the row was put back; commit that step's token (k = 0) and it
        may be proposed again."""

    def commit(self, request_id: str, epoch: int, num_accepted: int, next_token: int) -> None:
        """Keep the first num_accepted drafted tokens, then next_token; drop the rest."""

    def opened(self, request_id: str) -> bool:
        """Whether the session's draft prefill is done (or failed): a propose of it
        would not wait for it."""

    def advance(self, tokens: int) -> None:
        """Go on with the draft prefills that `start` began: about `tokens` prompt
        tokens this step, at least one chunk while any is left (the step's prefill
        budget). A remote drafter prefills on its own side and ignores it; a prefill
        that fails is its row's error at the next propose."""

    def prefetch(self, rows: Sequence[ProposeRow]) -> None:
        """The engine's promise: the next propose asks for these rows with these K (a
        remote drafter may start drafting them now; an in-process one ignores it)."""

    def release(self, request_id: str) -> None:
        """Free the request's cache (idempotent)."""


class Verifier(Protocol):
    vocab_size: int
    max_context: int

    @property
    def max_reserve_tokens(self) -> int:
        """The largest KV reservation one request may ever get (it may wait for it);
        a request needing more is refused naming max_tokens."""

    def fits(self, reserve_tokens: int) -> bool:
        """Whether a request holding at most reserve_tokens would be admitted now."""

    def start(self, request_id: str, prompt_ids: list[int], *, reserve_tokens: int) -> None:
        """Take a row for the request. Its prompt but the last token is then prefilled
        with `prefill` (chunked by the scheduler); the first score consumes the last."""

    def prefill(self, rows: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Append prompt chunks to their rows (one forward, no logits)."""

    def score(self, rows: Sequence[tuple[str, Sequence[int]]]) -> list[torch.Tensor]:
        """One forward over every row: row i's logits [len(draft_i) + 1, V] float32,
        after its last committed token and after each drafted token (bonus row last)."""

    def commit(self, request_id: str, num_accepted: int, next_token: int) -> None:
        """Drop the rejected drafted tokens (bookkeeping); next_token is now last."""

    def release(self, request_id: str) -> None:
        """Free the request's row (idempotent)."""


class ServingEngine(Protocol):
    """The contract between the Serve ingress (deployments/ingress.py) and an engine:
    an EngineSupervisor over an EngineGroup in a real replica, a fake in the shim's unit
    tests."""

    def model_info(self) -> dict:
        """vocab_size, max_context, verifier path, tp_size."""

    async def agenerate(self, request):  # -> GenerationResult
        """Run a request to the end."""

    def astream(self, request) -> AsyncIterator:  # of GenerationChunk
        """Chunks as tokens are committed; the last carries the result."""

    def cancel(self, request_id: str) -> None:
        """Stop a request at its next step and free its rows (unknown id: no-op)."""

    async def ahealthy(self, timeout_s: float = 10.0) -> bool:
        """True while the engine serves (grpc.health.v1 SERVING). The supervisor
        (workers/supervisor.py) answers from its state at once: False while the ranks
        restart, True while a dead draft actor is being replaced. An engine may also
        have `alive()` (False: give up, Serve replaces the replica) and `stats()`."""
