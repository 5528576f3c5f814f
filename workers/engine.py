"""The batched speculative engine: every running request in one step,
propose -> score -> accept -> commit.

One `step()` admits waiting requests into free rows (workers/scheduler.py), runs ONE
batched draft pass over every drafting row, ONE verifier forward over every running row,
one ragged acceptance over all of them, and commits per row; then it spends what is left
of the step's token budget on prompt chunks. Per-request bookkeeping (stops,
detokenising, statistics, chunks) lives in workers/request.py. The same engine runs
in-process (tests, `cactus generate`) and on the verifier's rank 0 of the distributed
engine (drafter behind gRPC, verifier mirrored across TP ranks): only the transport
differs. Requests join and leave between any two steps.

Rows differ in K (K shrinks near max_tokens and the context end; rule none and degraded
requests have K = 0), rule, delta, TAS threshold and divergence budget; the kernel's
ragged entry point handles all of them in one call (vLLM's flattened drafts with per-row
counts).

Randomness: a request with seed s drafts with torch.Generator(s) on the draft side and
draws its acceptance uniforms from torch.Generator(s ^ VERIFY_SEED_SALT) on rank 0
(workers/request.py), K_i + 1 per step, so a seeded request gives the same tokens
whatever else is in its batch.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from cactus.detokenize import encode_prompt
from cactus.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    DraftRetryError,
    InvalidRequestError,
    ModelOutputError,
    RequestCancelledError,
    StaleBlockError,
    WorkerUnavailableError,
)
from cactus.params import GenerationRequest, Limits, validate_request
from kernels import RaggedMetadata, ragged_accept
from workers.batching import padded_uniforms, processed_rows
from workers.interfaces import DraftBlock, Drafter, ProposeRow, Verifier
from workers.policy import PolicyConfig, PolicyRow, SpeculationPolicy
from workers.request import (
    LOGPROB_FLOOR,
    GenerationChunk,
    GenerationResult,
    RequestState,
    Sink,
    TokenLogprob,
)
from workers.scheduler import Scheduler, SchedulerConfig

# A drafter's usual failures (logged without a traceback). Any error a drafter raises
# costs the request its drafts only (it goes on by plain decoding), never the batch.
DRAFTER_FAILURES = (DraftRetryError, StaleBlockError, WorkerUnavailableError)
# A failed batched draft forward (DraftRetryError: the draft side put the row back) costs
# the row that step's drafts; the request drafts again from the next step, this many times
# at most, then goes on by plain decoding (a device that keeps failing).
MAX_DRAFT_RETRIES = 3
NON_FINITE = (
    "the verifier's logits for this request were not finite (NaN or inf): the model "
    "overflowed in its dtype; float32 may avoid it"
)
log = logging.getLogger("cactus.engine")


@dataclass
class StepTiming:
    """Engine-wide totals of the batched steps (benchmarks read them)."""

    steps: int = 0  # decode steps
    rows: int = 0  # sum of decode batch sizes
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    bookkeeping_s: float = 0.0  # commits, emission, detokenising
    prefill_s: float = 0.0
    overhead_s: float = 0.0  # the rest of each busy cycle: admission, planning, the loop
    batch_sizes: Counter = field(default_factory=Counter)  # decode batch size -> steps

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out["batch_sizes"] = dict(self.batch_sizes)
        return out


class _Timed(NamedTuple):
    """A decode step's ks and times, for the policy's cost model."""

    ks: list[int]
    lags: list[int]
    draft_s: float
    verify_s: float
    predicted_s: float
    decode_s: float  # the whole decode (draft, verify, accept, commit, emission)
    tokens: int  # emitted by the step (accepted + 1 per row)


@dataclass(frozen=True)
class StepRecord:
    """One decode step, for metrics: per row its rule, k, accepted and predicted tokens
    (rows that ended with non-finite logits left out: they emitted nothing)."""

    rules: list[str]
    ks: list[int]
    accepted: list[int]
    predicted: list[float]  # the policy's expected tokens per row


class SpeculativeEngine:
    """Generates text for a changing batch of requests with a Drafter and a Verifier."""

    def __init__(
        self,
        drafter: Drafter,
        verifier: Verifier,
        tokenizer,
        *,
        limits: Limits | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        scheduler: SchedulerConfig | None = None,
    ) -> None:
        self.drafter = drafter
        self.verifier = verifier
        self.tokenizer = tokenizer
        self.limits = limits or Limits(
            max_context=verifier.max_context, vocab_size=verifier.vocab_size
        )
        # the ids that end a text (the runners' eos_token_ids: the tokenizer's and the
        # generation config's); by default the tokenizer's only
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_token_ids = frozenset(
            () if eos is None else [eos] if isinstance(eos, int) else map(int, eos)
        )
        self.scheduler = Scheduler(scheduler)
        self.policy = SpeculationPolicy(PolicyConfig(kind=self.scheduler.config.policy))
        self.timing = StepTiming()
        self.last_step: StepRecord | None = None  # the last decode step (metrics read it)
        # (rule, "requests" | "generated" | "drafted" | "accepted") -> the work of the
        # requests cancelled since the metrics last took it (they reach no result, so the
        # replica's counters never see them); bounded by rules x 4 keys
        self.cancelled_work: Counter = Counter()
        self._left_busy: float | None = None  # when the last step ended with work left
        self._live: dict[str, RequestState] = {}

    # ---- requests in and out -------------------------------------------------------

    def add_request(
        self, request: GenerationRequest, sink: Sink, *, cancelled: Callable[[], bool] | None = None
    ) -> RequestState:
        """Validate and queue a request; its chunks (or the exception that ends it) go
        to `sink`. Raises InvalidRequestError naming the field."""
        if not request.request_id:
            request = replace(request, request_id=f"req-{secrets.token_hex(8)}")
        if request.request_id in self._live:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        validate_request(request, self.limits)
        prompt_ids = self._prompt_ids(request)
        validate_request(request, self.limits, prompt_len=len(prompt_ids))
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        state = RequestState(
            request,
            prompt_ids,
            seed=seed,
            eos=self.eos_token_ids,
            tokenizer=self.tokenizer,
            max_context=self.limits.max_context,
            sink=sink,
            cancelled=cancelled,
        )
        most = self.verifier.max_reserve_tokens
        if state.reserve_tokens > most:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt + max_tokens need {state.reserve_tokens} KV slots; "
                f"the KV budget allows {most} per request (batching.kv_budget_tokens)",
                CONTEXT_LENGTH_EXCEEDED,
            )
        self.scheduler.add(state)
        self._live[state.id] = state
        return state

    def has_work(self) -> bool:
        return bool(self._live)

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """End a request now (its caller gets `error`, default RequestCancelledError)."""
        state = self._live.get(request_id)
        if state is not None:
            self._end(state, error or RequestCancelledError(f"request {request_id} cancelled"))

    def abort_all(self, error: BaseException) -> None:
        for state in list(self._live.values()):
            self._end(state, error)

    def abort_admitted(self, error: BaseException) -> None:
        """End every request but those still waiting for a row (a step that failed
        touched only admitted ones, and one it was admitting); the waiting ones never
        ran and keep their place. If that ends nothing, the failure lies in handling
        the waiting ones (their admission, their time limits): they end too, so a
        failing step can never repeat for ever."""
        waiting = {id(state) for state in self.scheduler.waiting}
        admitted = [s for s in self._live.values() if id(s) not in waiting]
        for state in admitted or list(self._live.values()):
            self._end(state, error)

    # ---- convenience: run requests on the calling thread -----------------------------

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
        """Add the request and step the engine until it ends (other requests in the
        engine step along). Closing the iterator early frees its rows."""
        out: deque = deque()
        state = self.add_request(request, out.append, cancelled=cancelled)
        try:
            while True:
                while out:
                    item = out.popleft()
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if item.result is not None:
                        return
                self.step()
        finally:
            if self._live.get(state.id) is state:
                self._close(state)

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> int:
        """Admit, decode every running row once, prefill prompt chunks. Returns the
        decode batch size."""
        enter = time.perf_counter()
        # the time since the last step ended with work left: the caller's loop (intake,
        # metrics), a per-step cost like any other
        between = enter - self._left_busy if self._left_busy is not None else 0.0
        self._reap()
        self.scheduler.admit(lambda s: self.verifier.fits(s.reserve_tokens), self._start)
        running = list(self.scheduler.running)
        decode_tokens, timed = 0, None
        if running:
            try:
                decode_tokens, timed = self._decode(running)
            except Exception as err:  # a failed forward fails the rows that shared it
                for state in running:
                    if self._live.get(state.id) is state:
                        self._end(state, err)
        prefill_s = self.timing.prefill_s
        self._prefill(decode_tokens)
        prefill_s = self.timing.prefill_s - prefill_s
        self.scheduler.promote()
        self._plan_next()
        leave = time.perf_counter()
        if timed is not None:
            # The policy learns the step's whole busy cycle in wall-clock time except
            # its prefill chunks. Prefill is each request's own work, done once whatever
            # k the steps draft, and arrives with the requests that finish: a cost in
            # proportion to emitted tokens, which changes no choice (see
            # CostModel.coefs). Counted in the step, it also tilted the k fits: served
            # at 16 clients, sps, the goodput policy's k = 2 steps carried 20-31 ms of
            # prefill against 7-16 ms for its k = 3-5 steps (two runs), so time seemed
            # to grow less with k than it does (benchmarks/results/2026-12-01-vm-policy.md,
            # "Prefill out of the step cost").
            busy = between + (leave - enter)
            self.timing.overhead_s += busy - prefill_s - timed.decode_s
            rest_s = busy - prefill_s - timed.draft_s - timed.verify_s
            self.policy.observe_time(
                timed.ks,
                timed.lags,
                timed.draft_s,
                timed.verify_s,
                rest_s,
                timed.predicted_s,
                tokens=timed.tokens,
            )
        self._left_busy = leave if self.has_work() else None
        return len(running)

    def _plan_next(self) -> None:
        """Every row of the next step, the rows that just finished their prompt included,
        gets its k now, and a remote drafter starts drafting them all in one batch while
        requests come and go (a row left out would cost a second draft pass, with its
        fixed cost per forward, at the next step)."""
        rows = [s for s in self.scheduler.running if s.finish_reason is None]
        if not rows and not self.scheduler.prefilling:
            return
        for state in rows:
            if state.draft_reopening and self.drafter.opened(state.id):
                state.draft_reopening = False  # it drafts from the next step on
        self._plan(rows)
        try:
            # with no row (prompts still prefilling) an empty promise: a remote drafter
            # renews its sessions' leases from these calls (workers/grpc_drafter.py), and
            # a long prefill must not lose the draft session it opened
            self.drafter.prefetch(
                [
                    ProposeRow(s.id, s.planned_k)
                    for s in rows
                    if s.planned_k and not s.draft_reopening  # (it decodes plainly)
                ]
            )
        except Exception:  # only a head start: the next propose asks again, and a
            # drafter that is gone degrades the rows it concerns there, one by one
            log.warning("draft prefetch failed; the next step proposes without it", exc_info=True)

    def _decode(self, running: list[RequestState]) -> tuple[int, _Timed]:
        t0 = time.perf_counter()
        self._plan(running)  # k per row, from earlier steps only (workers/policy.py)
        # A row re-opened on a new drafter decodes plainly (k = 0; its commits wait in the
        # drafter) until `_plan_next` sees that drafter holds its context, so the step
        # does not wait for every running request's whole re-prefill (and it is never
        # prefetched before). A new request's first propose still waits for its Open,
        # which its own chunked prefill here overlaps (and seeded requests keep their
        # tokens).
        planned = [0 if s.draft_reopening else s.planned_k for s in running]
        expected = {s.id: s.expected_tokens for s in running}
        lags = {s.id: s.undrafted for s in running}
        predicted_s = self.policy.predict_time(
            planned,
            list(lags.values()),
            tokens=sum(expected[s.id] if k else 1.0 for s, k in zip(running, planned, strict=True)),
        )
        ks, blocks = self._propose(running, planned)  # propose
        # Rows of one acceptance group (same K, rule, TAS threshold and alpha) side by
        # side: the kernel then takes each group as a view of the flat tensors, not a copy.
        order = sorted(range(len(running)), key=lambda i: (ks[i], *_group(running[i])))
        running, ks = [running[i] for i in order], [ks[i] for i in order]
        t1 = time.perf_counter()
        logits = self.verifier.score(  # score: one forward, row i [K_i + 1, V]
            [(s.id, blocks[s.id].token_ids if s.id in blocks else ()) for s in running]
        )
        t2 = time.perf_counter()
        result, finite, verified = self._accept(running, ks, blocks, logits)  # accept
        outputs = result.output_token_ids.tolist()  # (on CUDA: waits for the kernel)
        finite = finite.tolist()
        accepted = result.num_accepted.tolist()
        divergence = result.divergence_nats.tolist()
        capped = result.budget_exhausted.tolist()
        t3 = time.perf_counter()
        logprobs = _logprobs(running, ks, outputs, accepted, verified.target)
        predicted = [expected[s.id] if k else 1.0 for s, k in zip(running, ks, strict=True)]
        ok = [i for i in range(len(running)) if finite[i]]  # the rest learn the policy nothing
        self.policy.observe_rows(
            [self._policy_row(running[i], fixed=ks[i]) for i in ok],
            [ks[i] for i in ok],
            [accepted[i] for i in ok],
            [predicted[i] for i in ok],
        )
        emitted = []
        for i, state in enumerate(running):  # commit, per row
            if not finite[i]:  # acceptance.md: never a silent nan_to_num
                log.error("request %s ends: %s", state.id, NON_FINITE)
                self._end(state, ModelOutputError(NON_FINITE))
                emitted.append(None)
                continue
            tokens = outputs[i][: accepted[i] + 1]
            self._commit(state, ks[i], blocks.get(state.id), accepted[i], tokens[-1])
            if state.drafting:
                state.undrafted = 0 if ks[i] else state.undrafted + 1
            st = state.stats
            st.draft_s, st.verify_s, st.kernel_s = (
                st.draft_s + t1 - t0,
                st.verify_s + t2 - t1,
                st.kernel_s + t3 - t2,
            )
            taken = state.emit(tokens, logprobs.get(i))
            emitted.append(taken)
            if ks[i]:
                self._count(state, ks[i], accepted[i], divergence[i], capped[i], taken, i, verified)
        for state, tokens in zip(running, emitted, strict=True):  # emit
            if tokens is None:  # ended above
                continue
            state.push(tokens)
            if state.finish_reason is not None:
                self._close(state)
        t4 = time.perf_counter()
        self._time(len(running), t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        sent = [i for i, tokens in enumerate(emitted) if tokens is not None]  # non-finite: none
        self.last_step = StepRecord(
            [running[i].request.speculation.rule for i in sent],
            [ks[i] for i in sent],
            [accepted[i] for i in sent],
            [predicted[i] for i in sent],
        )
        timed = _Timed(
            ks,
            [lags[s.id] for s in running],
            t1 - t0,
            t2 - t1,
            predicted_s,
            t4 - t0,
            sum(a + 1 for a in accepted),
        )
        return sum(k + 1 for k in ks), timed

    def _count(self, state, k, accepted, divergence, capped, taken, i, verified) -> None:
        """Row i's speculation statistics, over the positions whose token is emitted
        (acceptance.md): a block cut by EOS, a stop id or a stop string counts only the
        drafted tokens before the cut, and its divergence is the kernel's over those
        positions alone (`_Verified.prefix`)."""
        n = len(taken)
        if n < min(accepted + 1, k):  # the kernel summed verified positions n..
            try:
                divergence, capped = verified.prefix(i, n)
            except Exception:  # statistics only (a cut block ends its request this step)
                log.exception("request %s: the emitted prefix's divergence failed", state.id)
        was_capped = state.stats.divergence_capped
        state.count(k, min(accepted, n), divergence, capped)
        if state.stats.divergence_capped and not was_capped:
            # from now on it verifies with delta = 0 and the policy files it under its
            # rule's delta-0 group (_policy_row): its own counts so far were at its
            # delta, no longer its acceptance
            self.policy.forget(state.id)

    def _policy_row(self, state: RequestState, fixed: int | None = None) -> PolicyRow:
        # a row re-opening on a new drafter decodes plainly (`_decode`): planned as such,
        # so the other rows' k are chosen for the batch that runs
        ceiling = 0 if state.draft_reopening else state.num_draft_tokens()
        return PolicyRow(state.id, state.policy_group, ceiling, state.undrafted, fixed=fixed)

    def _plan(self, states: list[RequestState]) -> None:
        """Choose k for the rows that have none yet; a row with one keeps it (a remote
        drafter may be drafting it already). Reads only earlier steps' outcomes."""
        if all(s.planned_k is not None for s in states):
            return
        plan = self.policy.plan([self._policy_row(s, fixed=s.planned_k) for s in states])
        for state, k, e in zip(states, plan.ks, plan.expected_tokens, strict=True):
            if state.planned_k is None:
                state.planned_k, state.expected_tokens = k, e

    def _propose(
        self, running: list[RequestState], planned: list[int]
    ) -> tuple[list[int], dict[str, DraftBlock]]:
        """One batched draft pass; a row whose drafter failed goes on without drafts."""
        for state in running:
            state.planned_k = None
        ks = [min(k, s.num_draft_tokens()) for s, k in zip(running, planned, strict=True)]
        rows = [ProposeRow(s.id, k) for s, k in zip(running, ks, strict=True) if k > 0]
        blocks: dict[str, DraftBlock] = {}
        if not rows:
            return ks, blocks
        traced = False
        try:
            out = self.drafter.propose(rows)
        except Exception as err:  # any drafter error costs the drafts, not the requests
            if not isinstance(err, DRAFTER_FAILURES):  # its traceback once, not per row
                log.warning("the drafter failed for %d rows", len(rows), exc_info=err)
                traced = True
            out = [err] * len(rows)
        by_id = {s.id: s for s in running}
        for row, block in zip(rows, out, strict=True):
            state = by_id[row.request_id]
            if isinstance(block, DraftBlock):
                blocks[row.request_id] = block
            elif isinstance(block, DraftRetryError) and state.draft_retries < MAX_DRAFT_RETRIES:
                state.draft_retries += 1
                state.stats.draft_failures += 1  # (a step without drafts: `degraded`)
                log.warning(
                    "request %s: no drafts this step, again at the next: %s", row.request_id, block
                )
            else:
                self._drafter_failed(state, block, traced=traced)
        ks = [k if s.id in blocks else 0 for s, k in zip(running, ks, strict=True)]
        return ks, blocks

    def _accept(self, running, ks, blocks, logits):
        """Ragged acceptance over every row (K_i = 0 rows: plain sampling from q)."""
        vocab = min(self.verifier.vocab_size, logits[0].shape[-1])
        drafted = [blocks[s.id] for s in running if s.id in blocks]
        if drafted:
            vocab = min(vocab, drafted[0].probs.shape[-1])
        params = [
            s.request.sampling for s, k in zip(running, ks, strict=True) for _ in range(k + 1)
        ]
        flat = torch.cat([x[:, :vocab] for x in logits])
        target = processed_rows(flat, params)
        # NaN or +inf anywhere in a row of logits (a float16 / bfloat16 overflow) makes
        # its max non-finite (a -inf logit alone, a token ruled out, does not); a greedy
        # row's one-hot hides it from the probabilities, which can in turn overflow
        # alone. Two [N, V] reductions (0.02-0.03 ms each at [40, 8192], one thread).
        bad = ~torch.isfinite(flat.amax(-1)) | ~torch.isfinite(target.sum(-1))
        # which request owns each row: built on the host, so no device sync
        owner = torch.tensor(
            [i for i, k in enumerate(ks) for _ in range(k + 1)], device=flat.device
        )
        finite = torch.zeros(len(ks), dtype=torch.int64, device=flat.device)
        finite = finite.index_add_(0, owner, bad.to(torch.int64)) == 0  # [B]
        # Everything the kernel meets lives on the verifier's device (drafts arrive on
        # the CPU from the wire, uniforms come from CPU generators).
        device = target.device
        draft_ids = torch.tensor(
            [t for b in drafted for t in b.token_ids], dtype=torch.long, device=device
        )
        draft_probs = (
            torch.cat([b.probs[:, :vocab] for b in drafted]).to(device)
            if drafted
            else torch.empty(0, vocab, dtype=torch.float32, device=device)
        )
        specs = [s.request.speculation for s in running]
        budgets = [
            max(0.0, sp.max_divergence_nats - s.stats.divergence_nats)
            if sp.max_divergence_nats is not None
            else float("inf")
            for s, sp in zip(running, specs, strict=True)
        ]
        # a request whose max_divergence_nats was reached verifies losslessly from then on
        deltas = [
            0.0 if s.stats.divergence_capped else sp.delta
            for s, sp in zip(running, specs, strict=True)
        ]
        metadata = RaggedMetadata(
            num_draft_tokens=tuple(ks),
            rules=tuple(sp.rule if sp.rule != "none" else "sps" for sp in specs),
            delta=torch.tensor(deltas, dtype=torch.float64, device=device),
            tas_threshold=tuple(sp.tas_threshold for sp in specs),
            tas_alpha=tuple(sp.tas_alpha for sp in specs),
            divergence_budget=torch.tensor(budgets, dtype=torch.float64, device=device),
            uniforms=padded_uniforms(
                [s.generator for s in running], [k + 1 for k in ks], device=device
            ),
        )
        # no value scans: the rows' finiteness is checked above (verifier) and by the
        # drafters (in-process and on the wire), a row at a time
        accepted = ragged_accept(draft_ids, draft_probs, target, metadata, validate=False)
        return accepted, finite, _Verified(draft_ids, draft_probs, target, metadata)

    def _commit(self, state, k: int, block, accepted: int, token: int) -> None:
        cap = state.draft_max_context
        if state.drafting and cap is not None and state.committed + accepted + 1 >= cap - 1:
            # the draft model's context is full: it could draft no more for this row, so
            # its draft session goes now (not a failure: plain decoding by design)
            state.drafting = False
            self._release_draft(state)
        if state.drafting:
            epoch = block.epoch if k else state.committed
            try:
                self.drafter.commit(state.id, epoch, accepted if k else 0, token)
            except Exception as err:
                self._drafter_failed(state, err)
        self.verifier.commit(state.id, accepted, token)

    def _prefill(self, decode_tokens: int) -> None:
        """The step's prompt chunks: the verifier's within the step's budget, and the
        same budget of draft prefill (an in-process drafter's; a remote one prefills on
        its own side), so that neither side's long prompt stalls the running rows."""
        plan = self.scheduler.prefill_plan(decode_tokens)
        t0 = time.perf_counter()
        if plan:
            chunks = []
            for state, n in plan:
                chunks.append((state.id, state.prompt_ids[state.prefilled : state.prefilled + n]))
            try:
                self.verifier.prefill(chunks)
            except Exception as err:
                for state, _ in plan:
                    self._end(state, err)
            else:
                for state, n in plan:
                    state.prefilled += n
        try:
            self.drafter.advance(self.scheduler.prefill_budget(decode_tokens))
        except Exception:  # a failed prefill is its row's error at its next propose
            log.warning("the draft prefill failed", exc_info=True)
        self.timing.prefill_s += time.perf_counter() - t0

    # ---- lifecycle -------------------------------------------------------------------

    def _reap(self) -> None:
        """Cancelled requests end with RequestCancelledError, late ones with TIME_LIMIT."""
        for state in self.scheduler.all():
            try:
                cancelled = state.cancelled is not None and state.cancelled()
            except Exception as err:  # the caller's own check: its request alone ends
                log.exception("request %s: its cancel check raised", state.id)
                self._end(state, err)
                continue
            if cancelled:
                self._end(state, RequestCancelledError(f"request {state.id} cancelled"))
            elif state.timed_out():
                state.time_limit()
                state.push([])
                self._close(state)

    def _start(self, state: RequestState) -> None:
        """A row on each side: the drafter prefills now (a remote one while this side
        prefills the verifier, chunk by chunk, in the next steps)."""
        self._drafts_ahead(state)
        if state.drafting:
            self._open_draft(state)
        try:
            self.verifier.start(state.id, state.prompt_ids, reserve_tokens=state.reserve_tokens)
        except Exception as err:
            self._end(state, err)

    def attach_drafter(self, drafter: Drafter) -> int:
        """Switch to a new drafter (the old one died) and re-open there the draft
        session of every admitted request that speculates, from its committed tokens,
        with a fresh draft seed (the old draws are not reused). Returns how many."""
        self.drafter = drafter
        reopened = 0
        for state in [*self.scheduler.prefilling, *self.scheduler.running]:
            if state.request.speculation.rule == "none" or state.finish_reason is not None:
                continue
            state.drafting = True
            state.draft_epoch += 1
            state.draft_retries = 0  # a new actor: its own failed forwards count anew
            # the new drafter's context bounds its drafts (`_open_draft` sets it again)
            state.draft_max_context = getattr(drafter, "max_context", None)
            # the next step plans again (k chosen for the old drafter's rows, with the
            # re-opening ones drafting; its prefetched batch is lost with it)
            state.planned_k = None
            if not self._drafts_ahead(state):
                continue
            self._open_draft(state)
            # a row still prefilling its prompt here waits for its Open as a new one
            state.draft_reopening = state.drafting and state in self.scheduler.running
            reopened += state.drafting
        return reopened

    @staticmethod
    def _drafts_ahead(state: RequestState) -> bool:
        """Whether the request may still draft: one whose every step drafts nothing
        (max_tokens 1, or one token left of a resumed request: the verifier emits one
        token more than it accepts) decodes plainly, by design, without a draft session:
        it would reserve a draft row and prefill its whole prompt on the draft side, in
        the running rows' way, for nothing."""
        if state.drafting and state.num_draft_tokens() == 0:
            state.drafting = False
        return state.drafting

    def _open_draft(self, state: RequestState) -> None:
        context = state.prompt_ids + state.generated
        state.draft_max_context = getattr(self.drafter, "max_context", None)
        if state.draft_max_context is not None and len(context) >= state.draft_max_context - 1:
            # beyond the draft model's context: plain decoding, by design, not a failure
            log.info(
                "request %s decodes without drafts: %d tokens fill the draft model's context %d",
                state.id,
                len(context),
                state.draft_max_context,
            )
            state.drafting = False
            return
        # The draft row holds what the verifier row does, prompt + max_tokens at most: a
        # session opened after tokens were committed (a resumed request, a new drafter)
        # reserves only the tokens still to come beyond its context, not max_tokens again.
        sampling = state.request.sampling
        left = max(1, sampling.max_tokens - state.num_generated)
        if left != sampling.max_tokens:
            sampling = replace(sampling, max_tokens=left)
        try:
            self.drafter.start(state.id, context, sampling, state.draft_seed)
        except Exception as err:
            # whatever the drafter raised (an in-process draft prefill out of memory,
            # too): this request decodes without drafts, as over the wire, rather than
            # the error ending every request of the batch
            self._drafter_failed(state, err)

    def _drafter_failed(
        self, state: RequestState, err: BaseException, *, traced: bool = False
    ) -> None:
        """Degrade to plain decoding for the rest of the request (serving.md); the log
        says why, once per request and failure (with the traceback for an error that is
        not a drafter's usual failure)."""
        usual = traced or isinstance(err, DRAFTER_FAILURES)
        log.warning(
            "request %s goes on without drafts: %s", state.id, err, exc_info=None if usual else err
        )
        state.drafting = False
        state.stats.draft_failures += 1
        self._release_draft(state)

    def _release_draft(self, state: RequestState) -> None:
        """Free the request's draft row. A drafter's error costs drafts, never requests:
        it must not end the step's rows (nor, from `_close`, skip the verifier's row,
        which would stay reserved while admission planned around it for good)."""
        try:
            self.drafter.release(state.id)
        except Exception:
            log.exception("the drafter could not release request %s's row", state.id)

    def _close(self, state: RequestState) -> None:
        """Free the request's rows on both sides and forget it."""
        self.scheduler.remove(state)
        if self._live.get(state.id) is state:
            del self._live[state.id]
        self._release_draft(state)
        try:
            self.verifier.release(state.id)
        finally:
            self.policy.forget(state.id)

    def _end(self, state: RequestState, error: BaseException) -> None:
        try:
            self._close(state)  # (a release that raises still leaves the caller answered)
        finally:
            if isinstance(error, RequestCancelledError):
                rule, st, work = state.request.speculation.rule, state.stats, self.cancelled_work
                work[rule, "requests"] += 1
                work[rule, "generated"] += state.num_generated
                work[rule, "drafted"] += st.num_draft_tokens
                work[rule, "accepted"] += st.num_accepted_tokens
            state.sink(error)

    def abandon_all(self, error: BaseException) -> None:
        """The engine is broken (freeing rows raised, workers/engine_loop.py): answer
        every request with `error` without touching the rows, which go with the engine."""
        for state in list(self._live.values()):
            self._live.pop(state.id, None)
            try:
                self.scheduler.remove(state)
            except Exception:  # bookkeeping only; the caller must be answered
                log.exception("request %s: leaving the scheduler failed", state.id)
            state.sink(error)

    def take_cancelled_work(self) -> Counter:
        """The cancelled requests' work since the last call (EngineMetrics exports it)."""
        work, self.cancelled_work = self.cancelled_work, Counter()
        return work

    def _time(self, batch: int, draft: float, verify: float, accept: float, book: float) -> None:
        t = self.timing
        t.steps += 1
        t.rows += batch
        t.draft_s += draft
        t.verify_s += verify
        t.accept_s += accept
        t.bookkeeping_s += book
        t.batch_sizes[batch] += 1

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_token_ids is not None and len(request.prompt_token_ids):
            return [int(t) for t in request.prompt_token_ids]
        ids = encode_prompt(self.tokenizer, request.prompt)
        if not ids:
            raise InvalidRequestError("prompt", "encodes to zero tokens")
        return ids


def _logprobs(running, ks, outputs, accepted, target) -> dict[int, list[TokenLogprob]]:
    """Log q of each emitted token, and the top alternatives, for the rows that ask
    (row i's positions start at sum(K_j + 1 for j < i) in `target`); nothing for the
    others, so a request without logprobs costs nothing."""
    out: dict[int, list[TokenLogprob]] = {}
    offset = 0
    for i, state in enumerate(running):
        n_top = state.request.sampling.logprobs
        if n_top is not None:
            taken = outputs[i][: accepted[i] + 1]
            log_q = torch.log(target[offset : offset + len(taken)].double())
            log_q = torch.nan_to_num(log_q, neginf=LOGPROB_FLOOR)
            chosen = log_q[torch.arange(len(taken)), torch.tensor(taken)].tolist()
            if n_top:
                # (a vocabulary smaller than N has that many alternatives at most)
                values, ids = torch.topk(log_q, min(n_top, log_q.shape[-1]), dim=-1)
                tops = [
                    tuple(zip(r, v, strict=True))
                    for r, v in zip(ids.tolist(), values.tolist(), strict=True)
                ]
            else:
                tops = [()] * len(taken)
            out[i] = [
                TokenLogprob(tok, lp, top) for tok, lp, top in zip(taken, chosen, tops, strict=True)
            ]
        offset += ks[i] + 1
    return out


class _Verified(NamedTuple):
    """One step's acceptance inputs: the flattened tensors (`target`, the processed q of
    every position, also gives the logprobs) and their metadata."""

    draft_ids: torch.Tensor  # [sum K_i]
    draft_probs: torch.Tensor  # [sum K_i, V]
    target: torch.Tensor  # [sum (K_i + 1), V]
    metadata: RaggedMetadata

    def prefix(self, i: int, n: int) -> tuple[float, bool]:
        """(divergence, budget reached) of row i's first n verified positions, all of
        them accepted: the kernel's own result had the row drafted only those n tokens
        (the same uniforms, delta and budget decide each position alike), so the sums
        agree with the full call's, position by position."""
        m = self.metadata
        start = sum(m.num_draft_tokens[:i])
        one = RaggedMetadata(
            num_draft_tokens=(n,),
            rules=(m.rules[i],),
            delta=m.delta[i : i + 1],
            tas_threshold=(m.tas_threshold[i],),
            tas_alpha=(m.alpha(i),),
            divergence_budget=m.divergence_budget[i : i + 1],
            uniforms=m.uniforms[i : i + 1, : n + 1],
        )
        result = ragged_accept(
            self.draft_ids[start : start + n],
            self.draft_probs[start : start + n],
            self.target[start + i : start + i + n + 1],
            one,
            validate=False,
        )
        return float(result.divergence_nats[0]), bool(result.budget_exhausted[0])


def _group(state: RequestState) -> tuple[str, float, float]:
    sp = state.request.speculation
    return sp.rule, sp.tas_threshold, -1.0 if sp.tas_alpha is None else sp.tas_alpha
