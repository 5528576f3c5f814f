"""In-process Drafter and Verifier around a BatchRunner (gpt-fast style bookkeeping).

Both keep the committed text in their rows of the KV cache except its last token or
two, the "pending" tokens the next forward consumes. Rolling back is bookkeeping: the
row's length drops and the rejected slots are overwritten by the next forward.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from cactus.errors import CactusError, DraftRetryError, StaleBlockError, WorkerUnavailableError
from cactus.params import SamplingParams
from kernels import inverse_cdf_sample
from workers.batch_runner import BatchRunner, CapacityError
from workers.batching import padded_uniforms, processed_rows
from workers.interfaces import DraftBlock, ProposeRow

log = logging.getLogger("cactus.engine")

# Draft prefill chunk: the draft actor yields to other calls between chunks, and the
# in-process drafter prefills in the same chunks, so both compute the same draft cache
# (seeded requests draft the same tokens in-process and distributed).
DRAFT_PREFILL_CHUNK = 256


class _Request:
    def __init__(self, pending: list[int], sampling: SamplingParams | None, seed: int) -> None:
        self.pending = pending  # committed tokens not yet in the cache
        self.sampling = sampling
        self.generator = torch.Generator().manual_seed(seed)
        self.committed = 0  # prompt + generated tokens
        self.reserve = 0  # the tokens its row may hold
        self.drafted: list[int] = []  # the last proposed block


@dataclass
class _Opening:
    steps: Iterator[None]  # `start_chunked`'s, one chunk a next()
    left: int  # prompt tokens still to prefill
    chunk: int
    commits: list[tuple[int, int]] = field(default_factory=list)  # (epoch, token), k = 0


class LocalDrafter:
    """Draft model in this process: drafts every row of a step in K batched forwards,
    sampling each drafted token from the row's processed p."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner
        self.max_context = runner.max_context
        self._reqs: dict[str, _Request] = {}
        # sessions whose draft prefill `advance` goes on with (in start order), and the
        # error of a prefill that failed there, until the row's propose reports it
        self._opening: dict[str, _Opening] = {}
        self._failed: dict[str, BaseException] = {}

    def start(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, seed: int
    ) -> None:
        """Reserve the row (raising as `start_chunked` does) and leave the prompt's
        prefill to `advance`, a chunk at a time inside the engine's steps (a long prompt
        does not stall the running rows), or to the row's first propose."""
        self._forget(request_id)  # a session of this id is replaced (its row with it)
        chunk = DRAFT_PREFILL_CHUNK
        steps = self.start_chunked(
            request_id, prompt_ids, sampling, seed, chunk_tokens=chunk, yield_first=True
        )
        try:
            next(steps)  # the checks and the reservation, no chunk yet
        except StopIteration:  # a one-token prompt: nothing to prefill
            return
        self._opening[request_id] = _Opening(steps, len(prompt_ids) - 1, chunk)

    def opened(self, request_id: str) -> bool:
        return request_id not in self._opening

    def advance(self, tokens: int) -> None:
        """Prefill chunks of the opening sessions, oldest first, until `tokens` prompt
        tokens went in (at least one chunk). A chunk that fails frees its row; the
        error is that row's at its next propose or commit."""
        spent = 0
        while self._opening and (spent < tokens or not spent):
            request_id, opening = next(iter(self._opening.items()))
            n = min(opening.chunk, opening.left)  # every next() runs one chunk
            spent += n
            try:
                next(opening.steps)
                opening.left -= n
            except StopIteration:  # that was its last chunk
                try:
                    self._finish(request_id)
                except Exception as err:
                    self._failed[request_id] = err
            except Exception as err:
                del self._opening[request_id]
                self._failed[request_id] = err

    def _finish(self, request_id: str) -> None:
        """The session exists: apply the commits that waited for its prefill."""
        opening = self._opening.pop(request_id)
        for epoch, next_token in opening.commits:
            self._commit(request_id, epoch, 0, next_token)

    def _opened(self, request_id: str) -> None:
        """Finish the session's prefill now, if `advance` has not (its first propose),
        and raise the error of a prefill that failed."""
        err = self._failed.pop(request_id, None)
        if err is not None:
            raise err
        opening = self._opening.get(request_id)
        if opening is not None:
            try:
                for _ in opening.steps:
                    pass
            except BaseException:
                del self._opening[request_id]
                raise
            self._finish(request_id)

    def _forget(self, request_id: str) -> None:
        """Stop an opening session's prefill (its row stays with the runner)."""
        self._failed.pop(request_id, None)
        opening = self._opening.pop(request_id, None)
        if opening is not None:
            opening.steps.close()

    def start_chunked(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        seed: int,
        chunk_tokens: int | None = None,
        yield_first: bool = False,
    ) -> Iterator[None]:
        """Open a session a prefill chunk at a time (None: the whole prompt at once):
        reserves the row at the first step and yields between chunks (and, with
        yield_first, between the reservation and the first chunk); the session exists
        once the iterator is exhausted. A prompt that does not fit raises ValueError and
        a full draft side WorkerUnavailableError, with nothing reserved; a chunk that
        raises frees the row. Closed early, it leaves the row to its caller (`release`)."""
        if not prompt_ids or len(prompt_ids) > self.runner.max_context:
            raise ValueError(
                f"{request_id}: a prompt of {len(prompt_ids)} tokens does not fit the draft "
                f"model's context {self.runner.max_context}"
            )
        # The draft row never holds more than the committed text (plus K - 1 drafts, which
        # the engine keeps under max_tokens and the context): the request's own length.
        reserve = min(self.runner.max_context, len(prompt_ids) + sampling.max_tokens)
        try:
            self.runner.start(request_id, reserve_tokens=reserve)
        except CapacityError as err:  # the engine goes on without drafts
            raise WorkerUnavailableError(f"draft model: {err}") from None
        self._reqs.pop(request_id, None)  # a session of this id had its row replaced
        body = list(prompt_ids[:-1])
        step = chunk_tokens or max(1, len(body))
        try:
            for at in range(0, len(body), step):
                if at or yield_first:
                    yield
                self.runner.forward([request_id], [body[at : at + step]], logits="none")
        except GeneratorExit:  # closed between chunks: the caller owns the row
            raise
        except BaseException:
            self.runner.release(request_id)  # no session holds it: it would leak
            raise
        req = _Request([prompt_ids[-1]], sampling, seed)
        req.committed = len(prompt_ids)
        req.reserve = reserve
        self._reqs[request_id] = req

    def room(self, request_id: str) -> int:
        """The widest block the session's row can still take: its pending tokens and
        K - 1 drafts go into the cache (KeyError for an unknown session)."""
        self._opened(request_id)
        req = self._reqs[request_id]
        return req.reserve - self.runner.length(request_id) - len(req.pending) + 1

    def propose(self, rows: Sequence[ProposeRow]) -> list[DraftBlock | CactusError]:
        out: list = [None] * len(rows)
        live = []
        for i, row in enumerate(rows):
            try:
                self._opened(row.request_id)  # what `advance` has not prefilled yet
            except Exception as err:  # this row's draft prefill failed: its error
                out[i] = err
                continue
            req = self._reqs.get(row.request_id)
            if req is None:
                out[i] = StaleBlockError(f"{row.request_id}: no open draft session")
            elif req.drafted:
                out[i] = StaleBlockError(
                    f"{row.request_id}: the previous block was never committed"
                )
            elif row.k > self.room(row.request_id):  # the forward would fail every row
                out[i] = StaleBlockError(
                    f"{row.request_id}: {row.k} tokens exceed the row's room "
                    f"{self.room(row.request_id)}"
                )
            else:
                live.append(i)
        if live:
            for i, block in zip(live, self._drafted([rows[i] for i in live]), strict=True):
                out[i] = block
        return out

    def _drafted(self, rows: Sequence[ProposeRow]) -> list[DraftBlock | CactusError]:
        """`_draft`, and if it raises (a device error in a batched forward), each row's
        DraftRetryError with the row put back: its cache truncated to the length it had
        (the K forwards append the pending tokens and drafts; the failed one's writes
        past it are zeroed), its pending tokens and commits untouched, so a commit of
        that step's token (k = 0) and the next propose go on as after any plain step
        (its sampler has drawn on: the next drafts are not those the failed step would
        have made). A row that cannot be put back fails for good (StaleBlockError: its
        session must not draft on a wrong cache)."""
        lengths = [self.runner.length(r.request_id) for r in rows]
        pending = [self._reqs[r.request_id].pending for r in rows]
        try:
            return self._draft(rows)
        except Exception as err:
            log.warning("the batched draft forward failed for %d rows", len(rows), exc_info=err)
            out: list[DraftBlock | CactusError] = []
            for row, length, feed in zip(rows, lengths, pending, strict=True):
                rid = row.request_id
                try:
                    self.runner.truncate(rid, length)
                    self._reqs[rid].pending, self._reqs[rid].drafted = feed, []
                except Exception as fail:
                    log.exception("request %s: its draft row could not be rolled back", rid)
                    out.append(StaleBlockError(f"{rid}: draft row lost ({fail})"))
                    continue
                out.append(DraftRetryError(f"{rid}: the batched draft forward failed: {err}"))
            return out

    @staticmethod
    def _checked(block: DraftBlock, finite: bool) -> DraftBlock | StaleBlockError:
        """A block whose probabilities are not all finite (a float16 / bfloat16 draft
        overflowing) is this row's failure, as the wire's check makes it on the draft
        actor's path: the kernel would take a NaN p for a rejection and sample token 0
        from a NaN residual."""
        if finite:
            return block
        return StaleBlockError(f"{block.request_id}: draft probabilities not finite")

    def _draft(self, rows: Sequence[ProposeRow]) -> list[DraftBlock | StaleBlockError]:
        ids = [r.request_id for r in rows]
        reqs = [self._reqs[i] for i in ids]
        feeds = [list(r.pending) for r in reqs]
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        finite = None  # [B] on the model's device: read once at the end, no sync a step
        for j in range(max(r.k for r in rows)):
            logits = self.runner.forward(ids, feeds, logits="last")  # row i: [1, V] or [0, V]
            active = [i for i, r in enumerate(rows) if r.k > j]
            p = processed_rows(
                torch.cat([logits[i] for i in active]), [reqs[i].sampling for i in active]
            )  # [A, V]
            u = padded_uniforms(
                [reqs[i].generator for i in active], [1] * len(active), device=p.device
            )
            picked = inverse_cdf_sample(p, u[:, 0]).tolist()
            # NaN or inf anywhere in a row makes its sum so: one [A, V] reduction
            if finite is None:
                finite = torch.ones(len(rows), dtype=torch.bool, device=p.device)
            finite[active] &= torch.isfinite(p.sum(-1))
            feeds = [[] for _ in rows]
            for a, i in enumerate(active):
                tokens[i].append(picked[a])
                probs[i].append(p[a])
                if j < rows[i].k - 1:  # the last drafted token stays pending
                    feeds[i] = [picked[a]]
        finite = finite.tolist()
        blocks = []
        for i, req in enumerate(reqs):
            req.pending, req.drafted = [], tokens[i]
            block = DraftBlock(ids[i], req.committed, tuple(tokens[i]), torch.stack(probs[i]))
            blocks.append(self._checked(block, finite[i]))
        return blocks

    def commit(self, request_id: str, epoch: int, num_accepted: int, next_token: int) -> None:
        opening = self._opening.get(request_id)
        if opening is not None:
            # a row that decoded without drafts while its prefill goes on (a re-opened
            # session): the commit waits for the session, the step does not wait for it
            if num_accepted:
                raise StaleBlockError(f"{request_id}: a commit of drafts never proposed")
            opening.commits.append((epoch, next_token))
            return
        self._opened(request_id)
        self._commit(request_id, epoch, num_accepted, next_token)

    def _commit(self, request_id: str, epoch: int, num_accepted: int, next_token: int) -> None:
        req = self._reqs[request_id]
        if epoch != req.committed:
            raise StaleBlockError(f"{request_id}: commit for length {epoch}, at {req.committed}")
        k = len(req.drafted)
        # The cache holds the old pending tokens and drafted[:k-1]; keep drafted[:m].
        if k == 0:  # nothing was drafted (the engine decoded plainly this step)
            req.pending.append(next_token)
        elif num_accepted < k:
            self.runner.rollback(request_id, k - 1 - num_accepted)
            req.pending = [next_token]
        else:
            req.pending = [req.drafted[-1], next_token]
        req.committed = epoch + num_accepted + 1
        req.drafted = []

    def prefetch(self, rows: Sequence[ProposeRow]) -> None:
        """Nothing to overlap in one process: drafting happens at propose."""

    def release(self, request_id: str) -> None:
        self._forget(request_id)
        self._reqs.pop(request_id, None)
        self.runner.release(request_id)


class LocalVerifier:
    """Verifier model in this process: scores [last committed token] + drafted tokens
    for every running row in one forward."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.max_context = runner.max_context
        self._pending: dict[str, int] = {}
        self._scored: dict[str, int] = {}

    @property
    def max_reserve_tokens(self) -> int:
        """The largest reservation one request may ever get (it may wait for it)."""
        return min(self.runner.kv_budget_tokens, self.runner.max_context)

    def fits(self, reserve_tokens: int) -> bool:
        return self.runner.fits(reserve_tokens)

    def start(self, request_id: str, prompt_ids: list[int], *, reserve_tokens: int) -> None:
        self.runner.start(request_id, reserve_tokens=reserve_tokens)
        self._pending[request_id] = prompt_ids[-1]

    def prefill(self, rows: Sequence[tuple[str, Sequence[int]]]) -> None:
        self.runner.forward([r for r, _ in rows], [list(t) for _, t in rows], logits="none")

    def score(self, rows: Sequence[tuple[str, Sequence[int]]]) -> list[torch.Tensor]:
        feeds = []
        for request_id, drafted in rows:
            feeds.append([self._pending[request_id], *drafted])
            self._scored[request_id] = len(drafted)
        return self.runner.forward([r for r, _ in rows], feeds, logits="all")

    def commit(self, request_id: str, num_accepted: int, next_token: int) -> None:
        self.runner.rollback(request_id, self._scored.pop(request_id) - num_accepted)
        self._pending[request_id] = next_token

    def release(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._scored.pop(request_id, None)
        self.runner.release(request_id)


def local_engine(
    verifier_dir: str,
    draft_dir: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    limits=None,
    scheduler=None,
    kv_budget_tokens: int | None = None,
):
    """An in-process SpeculativeEngine over two local checkpoint folders.
    scheduler: a SchedulerConfig (max_num_seqs, max_num_batched_tokens)."""
    from workers.engine import SpeculativeEngine
    from workers.scheduler import SchedulerConfig

    scheduler = scheduler or SchedulerConfig()
    rows = scheduler.max_num_seqs
    verifier = BatchRunner(
        verifier_dir,
        dtype=dtype,
        device=device,
        max_num_seqs=rows,
        kv_budget_tokens=kv_budget_tokens,
    )
    # the draft's KV is bounded alike, as the draft actor's is (batching.kv_budget_tokens:
    # "the verifier's and the draft actor's each")
    draft = BatchRunner(
        draft_dir,
        dtype=dtype,
        device=device,
        max_num_seqs=rows,
        kv_budget_tokens=kv_budget_tokens,
    )
    if draft.vocab_size != verifier.vocab_size:
        raise ValueError(
            f"draft_dir: vocabulary {draft.vocab_size} differs from the verifier's "
            f"{verifier.vocab_size}; the pair must share a tokenizer"
        )
    return SpeculativeEngine(
        LocalDrafter(draft),
        LocalVerifier(verifier),
        verifier.tokenizer,
        limits=limits,
        eos_token_id=verifier.eos_token_ids,
        scheduler=scheduler,
    )
