"""The speculative engine: one step, propose -> score -> accept -> commit.

The engine owns the request lifecycle (validation, stop conditions, detokenisation,
statistics) and talks to a Drafter and a Verifier (workers/interfaces.py). The same
step runs in-process and, in the distributed engine, on the verifier's rank 0 with the
drafter behind gRPC: only the transport differs.

Randomness: a request with seed s drafts with torch.Generator(s) on the draft side and
draws its acceptance uniforms from torch.Generator(s ^ VERIFY_SEED_SALT) here, so a
seeded request gives the same tokens whatever else is running.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from cactus.detokenize import IncrementalDetokenizer
from cactus.errors import (
    InvalidRequestError,
    RequestCancelledError,
    StaleBlockError,
    WorkerUnavailableError,
)
from cactus.params import GenerationRequest, Limits, validate_request
from kernels import draw_uniforms, inverse_cdf_sample, processed_probs, speculative_accept
from workers.interfaces import Drafter, Verifier

VERIFY_SEED_SALT = 0x5EED_CAC7_0000_0001
DRAFTER_FAILURES = (StaleBlockError, WorkerUnavailableError)


@dataclass
class SpecStats:
    """Per-request speculation statistics (vLLM's names)."""

    num_drafts: int = 0  # verify steps that carried a draft block
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    divergence_nats: float = 0.0
    draft_failures: int = 0  # the drafter failed; the request went on without drafts
    draft_s: float = 0.0
    verify_s: float = 0.0
    kernel_s: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "divergence_nats": self.divergence_nats,
            "draft_failures": self.draft_failures,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "kernel_s": self.kernel_s,
        }


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # EOS, STOP (stop id), STOP_SEQUENCE, LENGTH
    prompt_tokens: int
    seed: int
    stats: SpecStats


@dataclass(frozen=True)
class GenerationChunk:
    """Streamed output: new tokens and text. The last chunk has the finish reason and
    the whole result."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    result: GenerationResult | None = None


class _State:
    """One request in flight."""

    def __init__(
        self, request: GenerationRequest, prompt_ids: list[int], seed: int, eos: int | None
    ):
        self.request = request
        self.id = request.request_id
        self.prompt_ids = prompt_ids
        self.seed = seed
        self.eos = eos
        self.generator = torch.Generator().manual_seed(seed ^ VERIFY_SEED_SALT)
        self.generated: list[int] = []
        self.stats = SpecStats(
            accepted_per_position=[0] * request.speculation.num_speculative_tokens
        )
        self.finish_reason: str | None = None
        self.released_chars = 0  # text already handed to the caller
        self.drafting = request.speculation.rule != "none"  # False once the drafter failed
        limit = request.time_limit_s
        self.deadline = time.monotonic() + limit if limit else None

    @property
    def committed(self) -> int:
        return len(self.prompt_ids) + len(self.generated)


class SpeculativeEngine:
    """Generates text for requests with a Drafter and a Verifier."""

    def __init__(
        self,
        drafter: Drafter,
        verifier: Verifier,
        tokenizer,
        *,
        limits: Limits | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        self.drafter = drafter
        self.verifier = verifier
        self.tokenizer = tokenizer
        self.limits = limits or Limits(
            max_context=verifier.max_context, vocab_size=verifier.vocab_size
        )
        self.eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id

    # ---- public API -------------------------------------------------------------------

    def generate(
        self, request: GenerationRequest, *, cancelled: Callable[[], bool] | None = None
    ) -> GenerationResult:
        last = None
        for last in self.stream(request, cancelled=cancelled):  # noqa: B007
            pass
        return last.result

    def stream(
        self, request: GenerationRequest, *, cancelled: Callable[[], bool] | None = None
    ) -> Iterator[GenerationChunk]:
        """Yield chunks as tokens are committed. `cancelled` is polled between steps; when
        it returns True the request's caches are freed and RequestCancelledError raised."""
        state = self._open(request)
        detok = IncrementalDetokenizer(self.tokenizer)
        try:
            while state.finish_reason is None:
                if cancelled is not None and cancelled():
                    raise RequestCancelledError(f"request {state.id} cancelled")
                if state.deadline is not None and time.monotonic() > state.deadline:
                    state.finish_reason = "TIME_LIMIT"
                    detok.flush()
                    break
                new_tokens = self._emit(state, self.step(state), detok)
                text = self._releasable(state, detok)
                if new_tokens or text:
                    yield GenerationChunk(state.id, tuple(new_tokens), text)
            tail = self._releasable(state, detok)
            yield GenerationChunk(
                state.id, (), tail, state.finish_reason, self._finish(state, detok)
            )
        finally:
            self.drafter.release(state.id)
            self.verifier.release(state.id)

    # ---- the step ---------------------------------------------------------------------

    def step(self, state: _State) -> list[int]:
        """One verify step; returns the tokens it produced (before stop handling)."""
        spec, s = state.request.speculation, state.request.sampling
        k = self._num_draft_tokens(state)
        if k == 0:
            return [self._plain_step(state)]
        t0 = time.perf_counter()
        try:
            block = self.drafter.propose(state.id, k)  # propose
        except DRAFTER_FAILURES:
            self._drafter_failed(state)
            return [self._plain_step(state)]
        t1 = time.perf_counter()
        logits = self.verifier.score(state.id, list(block.token_ids))  # score: [K + 1, V]
        t2 = time.perf_counter()
        vocab = min(logits.shape[-1], block.probs.shape[-1])
        target = processed_probs(
            logits[None, :, :vocab], temperature=s.temperature, top_k=s.top_k, top_p=s.top_p
        )
        budget = None
        if spec.max_divergence_nats is not None:
            left = max(0.0, spec.max_divergence_nats - state.stats.divergence_nats)
            budget = torch.tensor([left], dtype=torch.float64)
        result = speculative_accept(  # accept
            torch.tensor([block.token_ids]),
            block.probs[None, :, :vocab],
            target,
            rule=spec.rule,
            delta=spec.delta,
            tas_threshold=spec.tas_threshold,
            divergence_budget=budget,
            uniforms=draw_uniforms([state.generator], k + 1),
            validate=False,
        )
        t3 = time.perf_counter()
        accepted = int(result.num_accepted[0])
        tokens = [int(t) for t in result.output_token_ids[0, : accepted + 1]]
        # Commit to the drafter first: a remote one starts the next block now, while
        # this side rolls back its cache and emits (next_k 0: no next block is certain).
        stops = (state.eos, *state.request.sampling.stop_token_ids)
        finishing = any(t in stops for t in tokens)
        next_k = 0 if finishing else self._num_draft_tokens(state, produced=len(tokens))
        self._commit_drafter(state, block.epoch, accepted, tokens[-1], next_k=next_k)
        self.verifier.commit(state.id, accepted, tokens[-1])  # commit
        self._count(
            state, k, accepted, float(result.divergence_nats[0]), (t1 - t0, t2 - t1, t3 - t2)
        )
        return tokens

    def _plain_step(self, state: _State) -> int:
        """Verifier-only decoding (rule none, or no room left to draft)."""
        s = state.request.sampling
        t0 = time.perf_counter()
        logits = self.verifier.score(state.id, [])  # [1, V]
        q = processed_probs(logits, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        token = int(inverse_cdf_sample(q, draw_uniforms([state.generator], 1)[:, 0])[0])
        self.verifier.commit(state.id, 0, token)
        self._commit_drafter(state, state.committed, 0, token)
        state.stats.verify_s += time.perf_counter() - t0
        return token

    def _commit_drafter(
        self, state: _State, epoch: int, accepted: int, token: int, *, next_k: int = 0
    ) -> None:
        if not state.drafting:
            return
        try:
            self.drafter.commit(state.id, epoch, accepted, token, next_k=next_k)
        except DRAFTER_FAILURES:
            self._drafter_failed(state)

    def _drafter_failed(self, state: _State) -> None:
        """Degrade to plain decoding for the rest of the request (serving.md)."""
        state.drafting = False
        state.stats.draft_failures += 1
        self.drafter.release(state.id)

    # ---- helpers ----------------------------------------------------------------------

    def _open(self, request: GenerationRequest) -> _State:
        if not request.request_id:
            request = _with_id(request, f"req-{secrets.token_hex(8)}")
        validate_request(request, self.limits)
        prompt_ids = self._prompt_ids(request)
        validate_request(request, self.limits, prompt_len=len(prompt_ids))
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        state = _State(request, prompt_ids, seed, self.eos_token_id)
        if state.drafting:  # first: a remote drafter prefills while the verifier does
            try:
                self.drafter.start(state.id, prompt_ids, request.sampling, seed)
            except DRAFTER_FAILURES:
                self._drafter_failed(state)
        try:
            self.verifier.start(state.id, prompt_ids)
        except BaseException:
            self.drafter.release(state.id)
            self.verifier.release(state.id)
            raise
        return state

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_token_ids:
            return [int(t) for t in request.prompt_token_ids]
        ids = self.tokenizer.encode(request.prompt, add_special_tokens=False)
        if not ids:
            raise InvalidRequestError("prompt", "encodes to zero tokens")
        return ids

    def _num_draft_tokens(self, state: _State, produced: int = 0) -> int:
        """K, reduced near the end: never draft past max_tokens or the context.
        `produced`: tokens of this step not yet emitted (to ask for the next step's K)."""
        if not state.drafting:
            return 0
        k = state.request.speculation.num_speculative_tokens
        left = state.request.sampling.max_tokens - len(state.generated) - produced
        room = self.limits.max_context - state.committed - produced
        return max(0, min(k, left - 1, room - 1))

    def _count(self, state: _State, k: int, accepted: int, divergence: float, times) -> None:
        st = state.stats
        st.num_drafts += 1
        st.num_draft_tokens += k
        st.num_accepted_tokens += accepted
        for i in range(accepted):
            st.accepted_per_position[i] += 1
        st.divergence_nats += divergence
        st.draft_s += times[0]
        st.verify_s += times[1]
        st.kernel_s += times[2]

    def _emit(self, state: _State, tokens: list[int], detok: IncrementalDetokenizer) -> list[int]:
        """Commit tokens one by one, stopping at EOS, a stop id, max_tokens or a stop string."""
        s = state.request.sampling
        taken = []
        for tok in tokens:
            state.generated.append(tok)
            taken.append(tok)
            if tok == state.eos:
                state.finish_reason = "EOS"
                break
            if tok in s.stop_token_ids:  # kept in token_ids, not in the text
                state.finish_reason = "STOP"
                break
            new_chars = len(detok.add(tok))
            if new_chars and self._hit_stop_string(state, detok, new_chars):
                state.finish_reason = "STOP_SEQUENCE"
                break
            if len(state.generated) >= s.max_tokens:
                state.finish_reason = "LENGTH"
                break
        if state.finish_reason is None and state.committed >= self.limits.max_context:
            state.finish_reason = "LENGTH"
        if state.finish_reason not in (None, "STOP_SEQUENCE"):
            detok.flush()  # a trailing incomplete character, if any
        return taken

    def _hit_stop_string(
        self, state: _State, detok: IncrementalDetokenizer, new_chars: int
    ) -> bool:
        """Cut the text at the first stop string, if the last `new_chars` characters
        completed one (earlier text was already searched: only its tail can take part)."""
        stops = state.request.sampling.stop
        if not stops:
            return False
        start = max(0, len(detok.text) - new_chars - max(len(s) for s in stops) + 1)
        hits = [i for i in (detok.text.find(s, start) for s in stops) if i >= 0]
        if not hits:
            return False
        detok.text = detok.text[: min(hits)]
        return True

    def _releasable(self, state: _State, detok: IncrementalDetokenizer) -> str:
        """Text safe to hand out: hold back a tail that could still become a stop string."""
        end = len(detok.text)
        if state.finish_reason is None and state.request.sampling.stop:
            end -= max(len(s) for s in state.request.sampling.stop) - 1
        end = max(end, state.released_chars)
        text = detok.text[state.released_chars : end]
        state.released_chars = end
        return text

    def _finish(self, state: _State, detok: IncrementalDetokenizer) -> GenerationResult:
        return GenerationResult(
            request_id=state.id,
            text=detok.text,
            token_ids=tuple(state.generated),
            finish_reason=state.finish_reason or "ABORT",
            prompt_tokens=len(state.prompt_ids),
            seed=state.seed,
            stats=state.stats,
        )


def _with_id(request: GenerationRequest, request_id: str) -> GenerationRequest:
    return replace(request, request_id=request_id)
