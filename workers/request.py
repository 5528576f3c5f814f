"""Per-request bookkeeping, apart from scheduling and from the batched step: stop
conditions, incremental detokenising with held-back stop-string tails, statistics, and
the chunks handed to the caller.

A request's progress is its committed tokens (prompt + generated); its verifier row is
prefilled in chunks (`prefilled` counts them) before it joins the decode batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch

from cactus.detokenize import IncrementalDetokenizer
from cactus.params import GenerationRequest
from workers.policy import group_of

VERIFY_SEED_SALT = 0x5EED_CAC7_0000_0001
_GOLDEN = 0x9E37_79B9_7F4A_7C15
_RESUME_SALT = 0x2E5C_A11E_D5EE_D000
_MASK64 = (1 << 64) - 1


def derived_seed(seed: int, attempt: int) -> int:
    """Seed of a request's `attempt`-th draft session (0: the seed itself): a re-opened
    draft session draws fresh numbers instead of replaying the first ones at later
    positions. (A resumed request takes resumed_seed, below.)"""
    return seed if attempt == 0 else (seed + attempt * _GOLDEN) % (1 << 63)


def resumed_seed(seed: int, attempt: int) -> int:
    """Seed of a stream resumed at its `attempt`-th attempt (0: the seed itself). Hashed
    rather than a step along derived_seed's sequence: the resumed request's draft
    sessions are seeded derived_seed(this, epoch), which for this = derived_seed(seed,
    attempt) would be the seed of an earlier attempt's re-opened draft session (attempt
    1's first draft session would replay the draws of attempt 0's second)."""
    if attempt == 0:
        return seed
    return _mix64((seed ^ _RESUME_SALT) + attempt * _GOLDEN) % (1 << 63)


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that scatters nearby ones."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return x ^ (x >> 31)


@dataclass
class SpecStats:
    """Per-request speculation statistics (vLLM's names)."""

    num_drafts: int = 0  # verify steps that carried a draft block
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    divergence_nats: float = 0.0
    # max_divergence_nats was reached: every later step verifies with delta = 0
    divergence_capped: bool = False
    draft_failures: int = 0  # the drafter failed; the request went on without drafts
    # (for good, or for one step when a batched draft forward failed and was put back)
    resumed: int = 0  # times the request was resumed on a rebuilt engine (supervisor)
    draft_s: float = 0.0  # time of the steps' draft passes this request took part in
    verify_s: float = 0.0
    kernel_s: float = 0.0
    # from this attempt's first generated token to its end, on the engine's clock: a
    # unary call's time to first token is its latency less this (deployments/metrics.py)
    first_token_to_end_s: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def degraded(self) -> bool:
        """Some of the request ran without drafts (its draft actor failed)."""
        return self.draft_failures > 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def snapshot(self) -> SpecStats:
        return replace(self, accepted_per_position=list(self.accepted_per_position))

    def restore(self, saved: dict) -> None:
        """Go on from an earlier attempt's counters (a resumed request)."""
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "draft_failures"):
            setattr(self, name, int(saved.get(name, 0)))
        self.divergence_nats = float(saved.get("divergence_nats", 0.0))
        self.divergence_capped = bool(saved.get("divergence_capped", False))
        for i, n in enumerate(saved.get("accepted_per_position", ())):
            if i < len(self.accepted_per_position):
                self.accepted_per_position[i] = int(n)

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "divergence_nats": self.divergence_nats,
            "divergence_capped": self.divergence_capped,
            "draft_failures": self.draft_failures,
            "resumed": self.resumed,
            "degraded": self.degraded,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "kernel_s": self.kernel_s,
        }


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the verifier's processed q at its
    position, and the most likely alternatives there (id, logprob), best first. -inf
    (a token outside q's support) is reported as LOGPROB_FLOOR."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # EOS, STOP (stop id), STOP_SEQUENCE, LENGTH, TIME_LIMIT
    prompt_tokens: int
    seed: int
    stats: SpecStats
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when asked for


@dataclass(frozen=True)
class GenerationChunk:
    """Streamed output: new tokens and text. The last chunk has the finish reason and
    the whole result."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    result: GenerationResult | None = None
    stats: SpecStats | None = None  # the request's statistics so far (for migration)
    logprobs: tuple[TokenLogprob, ...] | None = None  # for token_ids, when asked for


# Where a request's chunks go: a GenerationChunk, or an exception that ends the request.
Sink = Callable[[object], None]


class RequestState:
    """One request in flight: its parameters, progress, stop handling and output."""

    def __init__(
        self,
        request: GenerationRequest,
        prompt_ids: list[int],
        *,
        seed: int,
        eos: Iterable[int] | None,
        tokenizer,
        max_context: int,
        sink: Sink,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        self.request = request
        self.id = request.request_id
        # A resumed request (migration): the tokens sent before are context here, and
        # count towards max_tokens, stop strings and the result as if never interrupted.
        self.prior = [int(t) for t in request.resume_token_ids]
        self.prompt_len = len(prompt_ids)
        self.prompt_ids = list(prompt_ids) + self.prior  # what both rows are prefilled with
        self.seed = seed
        self.eos = frozenset(eos or ())  # the ids that end the text (the engine's set)
        self.max_context = max_context
        self.draft_max_context: int | None = None  # the drafter's, set when it opens
        self.sink = sink
        self.cancelled = cancelled
        self.generator = torch.Generator().manual_seed(seed ^ VERIFY_SEED_SALT)
        self.generated: list[int] = []
        # TokenLogprob per generated token (this attempt's), when the request asks
        self.logprobs: list[TokenLogprob] | None = (
            [] if request.sampling.logprobs is not None else None
        )
        self._pending_logprobs: list[TokenLogprob] = []  # this step's, until emitted
        self.stats = SpecStats(
            accepted_per_position=[0] * request.speculation.num_speculative_tokens
        )
        if request.resume_stats:
            self.stats.restore(request.resume_stats)
        self.finish_reason: str | None = None
        self.detok = IncrementalDetokenizer(tokenizer, context=prompt_ids)
        for tok in self.prior:
            self.detok.add(tok)
        # text already handed to the caller
        self.released_chars = min(request.resume_text_chars, len(self.detok.text))
        self.drafting = request.speculation.rule != "none"  # False once the drafter failed
        self.draft_epoch = 0  # draft sessions re-opened on a new drafter (new draft seed)
        # re-opened on a new drafter and not yet drafted from: decodes plainly while the
        # drafter prefills its context, rather than the step waiting for that
        self.draft_reopening = False
        self.draft_retries = 0  # steps whose batched draft forward failed (engine.py)
        self.group = group_of(request.speculation)  # acceptance group (workers/policy.py)
        self.planned_k: int | None = None  # k chosen for the next step
        self.expected_tokens = 1.0  # the policy's expectation of that step's tokens
        self.undrafted = 0  # steps decoded without drafts since the draft cache last moved
        self.prefilled = 0  # verifier prompt tokens (all but the last) already in its row
        self.first_token_at: float | None = None  # time.monotonic() of the first emit
        limit = request.time_limit_s
        self.deadline = time.monotonic() + limit if limit else None

    @property
    def policy_group(self) -> str:
        """The acceptance group the policy files the request under: its own, or once its
        max_divergence_nats is spent (it verifies with delta = 0 from then on), its
        rule's delta-0 group."""
        if self.stats.divergence_capped:
            return group_of(self.request.speculation, capped=True)
        return self.group

    @property
    def committed(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def to_prefill(self) -> int:
        """Prompt tokens still to go into the verifier row (the last one never does)."""
        return len(self.prompt_ids) - 1 - self.prefilled

    @property
    def reserve_tokens(self) -> int:
        """The KV slots this request reserves: prompt + max_tokens (capped by the
        context). A step writes committed - 1 + K + 1 tokens, and K is kept below the
        tokens still to come (num_draft_tokens), so the row holds at most prompt +
        max_tokens - 1 of them: the one slot more is kept on purpose, the bound the
        README and the ingress's KV-budget refusal state ("need prompt + max_tokens
        KV slots")."""
        return min(self.max_context, self.prompt_len + self.request.sampling.max_tokens)

    @property
    def draft_seed(self) -> int:
        """The draft side's seed: the request's, then a fresh one per re-opened session."""
        return derived_seed(self.seed, self.draft_epoch)

    @property
    def num_generated(self) -> int:
        """Tokens generated for the request, those of earlier attempts included."""
        return len(self.prior) + len(self.generated)

    def num_draft_tokens(self) -> int:
        """The most tokens the next step may draft (the policy chooses 0..this): the
        request's K, reduced near the end: never draft past max_tokens or the context
        (the verifier emits one token more than it accepts)."""
        if not self.drafting:
            return 0
        k = self.request.speculation.num_speculative_tokens
        left = self.request.sampling.max_tokens - self.num_generated
        context = self.max_context
        if self.draft_max_context is not None:  # a draft model with a shorter context
            context = min(context, self.draft_max_context)
        room = context - self.committed
        return max(0, min(k, left - 1, room - 1))

    def timed_out(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    # ---- emission -----------------------------------------------------------------

    def emit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Commit tokens one by one, stopping at EOS, a stop id, max_tokens or a stop
        string; returns the tokens taken (`logprobs`: one per token, kept for those)."""
        if self.logprobs is not None and logprobs is not None:
            self._pending_logprobs = logprobs
        if tokens and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        s = self.request.sampling
        taken = []
        for tok in tokens:
            self.generated.append(tok)
            taken.append(tok)
            if tok in self.eos:
                self.finish_reason = "EOS"
                break
            if tok in s.stop_token_ids:  # kept in token_ids, not in the text
                self.finish_reason = "STOP"
                break
            new_chars = len(self.detok.add(tok))
            if new_chars and self._hit_stop_string(new_chars):
                self.finish_reason = "STOP_SEQUENCE"
                break
            if self.num_generated >= s.max_tokens:
                self.finish_reason = "LENGTH"
                break
        if self.finish_reason is None and self.committed >= self.max_context:
            self.finish_reason = "LENGTH"
        if self.finish_reason not in (None, "STOP_SEQUENCE"):
            self._flush()
        if self.logprobs is not None:
            self._pending_logprobs = self._pending_logprobs[: len(taken)]
            self.logprobs.extend(self._pending_logprobs)
        return taken

    def _hit_stop_string(self, new_chars: int) -> bool:
        """Cut the text at the first stop string, if the last `new_chars` characters
        completed one (earlier text was already searched: only its tail can take part)."""
        stops = self.request.sampling.stop
        if not stops:
            return False
        text = self.detok.text
        start = max(0, len(text) - new_chars - max(len(s) for s in stops) + 1)
        hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
        if not hits:
            return False
        self.detok.text = text[: min(hits)]
        return True

    def releasable(self) -> str:
        """Text safe to hand out: hold back a tail that could still become a stop string."""
        end = len(self.detok.text)
        if self.finish_reason is None and self.request.sampling.stop:
            end -= max(len(s) for s in self.request.sampling.stop) - 1
        end = max(end, self.released_chars)
        text = self.detok.text[self.released_chars : end]
        self.released_chars = end
        return text

    def push(self, new_tokens: list[int]) -> None:
        """Hand the caller what this step produced (the final chunk when finished)."""
        text = self.releasable()
        logprobs = None
        if self.logprobs is not None:
            logprobs, self._pending_logprobs = tuple(self._pending_logprobs), []
        if self.finish_reason is not None:
            self.sink(
                GenerationChunk(
                    self.id,
                    tuple(new_tokens),
                    text,
                    self.finish_reason,
                    self.result(),
                    logprobs=logprobs,
                )
            )
        elif new_tokens or text:
            self.sink(
                GenerationChunk(
                    self.id,
                    tuple(new_tokens),
                    text,
                    stats=self.stats.snapshot(),
                    logprobs=logprobs,
                )
            )

    def time_limit(self) -> None:
        self.finish_reason = "TIME_LIMIT"
        self._flush()

    def _flush(self) -> None:
        """At the end: the text the detokenizer held back (characters before a trailing
        incomplete one, e.g. "X" of a byte-level token " X\xe4") is searched for stop
        strings too, and one there ends the request as STOP_SEQUENCE (it came before
        whatever ended the request), cut as always."""
        flushed = self.detok.flush()
        if flushed and self._hit_stop_string(len(flushed)):
            self.finish_reason = "STOP_SEQUENCE"

    def result(self) -> GenerationResult:
        if self.first_token_at is not None:
            self.stats.first_token_to_end_s = time.monotonic() - self.first_token_at
        return GenerationResult(
            request_id=self.id,
            text=self.detok.text,
            token_ids=tuple(self.prior + self.generated),
            finish_reason=self.finish_reason or "ABORT",
            prompt_tokens=self.prompt_len,
            seed=self.seed,
            stats=self.stats,
            logprobs=tuple(self.logprobs) if self.logprobs is not None else None,
        )

    def count(self, k: int, accepted: int, divergence: float, capped: bool = False) -> None:
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += k
        st.num_accepted_tokens += accepted
        for i in range(accepted):
            st.accepted_per_position[i] += 1
        st.divergence_nats += divergence
        st.divergence_capped = st.divergence_capped or capped
