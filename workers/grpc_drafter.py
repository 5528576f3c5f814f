"""The Drafter interface over gRPC: the verifier's rank 0 calling the draft actor.

Every received block is checked (workers/wire.decode_block) against this side's own
committed length and the last block it applied before anything is used: a stale,
repeated or malformed block raises StaleBlockError and is dropped. Transport failures
raise WorkerUnavailableError; the engine then finishes the request without drafts.
Every row of an engine step travels in one ProposeBatch with its recorded commits
piggybacked (one round trip per step); a failed piggybacked commit fails that row,
which ends drafting for that request only.

Calls that must not block the engine (Open, the prefetched ProposeBatch, Close) are
blocking calls made on long-lived sender threads, not grpc's `.future()`: a
`.future()` on a channel with no call in flight starts a new polling thread each time
(about 400 threads in 25 s on rank 0 at 8 concurrent requests), and costs 0.44 against
0.30 ms of CPU and 0.33 against 0.11 ms of latency per call in isolation
(benchmarks/results/2026-12-02-vm-distributed.md, "Sender threads"). Open and Close
go through one thread, in the order they were made: both sides hold the same number of
rows, so the Open of a request that takes a finished one's row must not reach the
draft side before that row's Close (it would be refused there, and the request would
run without drafts). The lane waits for a Close's answer but only starts an Open (on
an opener thread of its own): a long prompt's Open lasts its whole draft prefill, and
the Opens behind it must not wait for that (their first propose would hold up the
step); the lane's Close of a request released while its Open runs waits for that Open's
answer (sending Close again until it comes, so it comes within a chunk). A request
released while its Open still runs (a long prompt's draft prefill) also sends a Close at
once on a sender thread, which stops that prefill; the lane's Close follows it in order.

A row the policy drafts nothing for (k = 0) sends no ProposeBatch: its commits wait in
`unsent`, and the draft side would free its session when the lease ran out. So every
session no call has named for lease_s / 4 gets a touch row (num_tokens = 0: nothing
drafted, the lease renewed), sent on the session lane after its Open. The check runs in
`prefetch`, which the engine calls at the end of every step (with no row when none
drafts, and while prompts only prefill); a dead rank 0 touches nothing, and the lease
frees its sessions.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from cactus.errors import CactusError, DraftRetryError, StaleBlockError, WorkerUnavailableError
from cactus.params import SamplingParams
from protos.cactus.internal.v1 import speculation_pb2 as pb
from protos.cactus.internal.v1 import speculation_pb2_grpc as pb_grpc
from workers.interfaces import DraftBlock, ProposeRow
from workers.wire import KEY_METADATA, MAX_MESSAGE_BYTES, decode_block, status_code

log = logging.getLogger("cactus.engine")


@contextlib.contextmanager
def _mapped_errors():
    """FAILED_PRECONDITION -> StaleBlockError (the engine drops the block); any other
    RPC failure -> WorkerUnavailableError (the engine goes on without drafts)."""
    try:
        yield
    except CancelledError:  # a call the closed client never sent
        raise WorkerUnavailableError("draft actor: client closed") from None
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
            raise StaleBlockError(err.details()) from None
        raise WorkerUnavailableError(f"draft actor: {err.code().name}: {err.details()}") from None


class _WithKey(grpc.UnaryUnaryClientInterceptor):
    """Adds the draft service's key (workers/draft_service.py) to every call."""

    def __init__(self, key: str) -> None:
        self._metadata = ((KEY_METADATA, key),)

    def intercept_unary_unary(self, continuation, details, request):
        metadata = (*(details.metadata or ()), *self._metadata)
        return continuation(details._replace(metadata=metadata), request)


# Opens in flight at once (each on its own opener thread): at least the engine's rows
# (batching.max_num_seqs, 32 by default), so a short request's Open never waits behind
# long prefills for a thread.
MAX_OPENERS = 64


@dataclass
class _ClientSession:
    committed: int
    opening: Future | None = None  # the Open call, until it has answered
    applied_seq: int = 0
    pending_seq: int = 0
    unsent: list = field(default_factory=list)  # commits to piggyback on the next Propose
    last_sent: float = field(default_factory=time.monotonic)  # the last call naming it


class GrpcDrafter:
    """Open is sent without waiting (the draft side prefills while this side prefills
    the verifier); every step's rows travel in one ProposeBatch with their commits
    piggybacked (one round trip per step, whatever the batch size)."""

    def __init__(
        self,
        address: str,
        *,
        vocab_size: int,
        timeout_s: float = 30.0,
        lease_s: float = 120.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        key: str | None = None,
        check: bool = True,
    ) -> None:
        """max_message_bytes: gRPC's largest by default; the draft side keeps each reply
        under its own limit (a block that does not fit fails alone), so a batch never
        fails whole for its size. `check`: ask the draft actor's Status first (its
        vocabulary and context; up to 10 s for one that is not up yet); off for an
        actor known to be gone, whose replacement is attached later."""
        self.address = address
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        # a session no call named for this long is touched (0: the draft side's default)
        self._touch_after_s = (lease_s if lease_s > 0 else 120.0) / 4
        self._next_scan = 0.0  # when _keep_alive looks at the sessions again
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self.key = key  # the draft service's (start_server), sent with every call
        self._channel = grpc.insecure_channel(address, options=options)
        channel = grpc.intercept_channel(self._channel, _WithKey(key)) if key else self._channel
        self._stub = pb_grpc.SpeculationStub(channel)
        # The prefetched ProposeBatch runs here, Open and Close in order on the session
        # lane (module docstring).
        self._senders = ThreadPoolExecutor(max_workers=2, thread_name_prefix="draft-rpc")
        self._lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-session")
        # Opens run here, started in order from the lane (`_open_on_lane`)
        # (up to one per row: a thread starts only when none is idle, so Opens made one
        # after another use one; a short Open must not queue behind long ones here either)
        self._openers = ThreadPoolExecutor(max_workers=MAX_OPENERS, thread_name_prefix="draft-open")
        self._sessions: dict[str, _ClientSession] = {}
        self.rpc_s = 0.0  # ProposeBatch round trips (send to reply)
        self.round_trips: list[float] = []  # each one's seconds, until the metrics take them
        self.remote_draft_s = 0.0  # of which the draft side spent drafting
        self.batches = 0  # ProposeBatch calls
        self.prefetched_batches = 0  # of which sent ahead, at the end of a step
        self.pipeline = True  # send the next step's ProposeBatch at the end of a step
        # (rows, future, sent_at, answered_at): a batch on its way
        self._prefetch: tuple | None = None
        status = self._draft_status() if check else None
        if status is not None and status.vocab_size and status.vocab_size != vocab_size:
            self.close()
            raise ValueError(
                f"draft actor {address}: vocabulary {status.vocab_size} differs from the "
                f"verifier's {vocab_size}; the pair must share a tokenizer"
            )
        # the draft model's context (None if it does not say: the engine then caps
        # drafting by the verifier's context alone)
        self.max_context = (status.max_context or None) if status is not None else None

    def _draft_status(self) -> pb.StatusReply | None:
        """The draft actor's Status (None if it does not answer: nothing is checked)."""
        try:
            return self._stub.Status(
                pb.StatusRequest(), timeout=min(10.0, self.timeout_s), wait_for_ready=True
            )
        except grpc.RpcError as err:
            log.warning("draft actor %s: no Status (%s)", self.address, err.code().name)
            return None

    def _call(self, method, msg):
        """A blocking call; transport failures mapped to the engine's errors."""
        with _mapped_errors():
            return method(msg, timeout=self.timeout_s)

    def _send(self, method, msg, *, lane: bool = False) -> Future:
        """Start a call on a sender thread (`lane`: the session lane, after every Open
        and Close made before it); its Future gives the reply or the RpcError."""
        pool = self._lane if lane else self._senders
        try:
            return pool.submit(method, msg, timeout=self.timeout_s)
        except RuntimeError as err:  # closed: as if the draft actor were gone
            raise WorkerUnavailableError(f"draft actor: client closed ({err})") from None

    @staticmethod
    def _result(future: Future):
        """The reply of a call started with _send; errors mapped as in _call."""
        with _mapped_errors():
            return future.result()

    def start(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, seed: int
    ) -> None:
        """Send Open and return; the first propose (or flush) waits for its answer."""
        msg = pb.OpenSession(
            request_id=request_id,
            prompt_token_ids=list(prompt_ids),
            sampling=pb.SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=sampling.max_tokens,
                logit_bias=dict(sampling.logit_bias),
            ),
            seed=seed,
            lease_s=self.lease_s,
        )
        self._sessions[request_id] = _ClientSession(
            committed=len(prompt_ids), opening=self._open_on_lane(msg)
        )

    def _open_on_lane(self, msg: pb.OpenSession) -> Future:
        """Start the Open in its place on the session lane (after every Close made
        before it), on an opener thread, without holding the lane until it answers: a
        long prompt's Open runs for its whole draft prefill, and a short request's Open
        queued behind it made that request's first propose, and so every running row's
        step, wait for it. The draft side prefills concurrent Opens chunk by chunk.
        Returns the Future of its answer; cancelled before an opener took it, the Open
        is never sent."""
        opening: Future = Future()
        stub, openers, timeout_s = self._stub, self._openers, self.timeout_s

        def call_open(open_msg) -> None:
            if not opening.set_running_or_notify_cancel():  # released: never sent
                return
            try:
                opening.set_result(stub.Open(open_msg, timeout=timeout_s))
            except grpc.RpcError as err:
                opening.set_exception(err)
            except ValueError:  # "Cannot invoke RPC on closed channel": never sent
                opening.set_exception(CancelledError())
            except BaseException as err:  # anything else: said, and never left pending
                log.warning("draft actor: Open failed", exc_info=err)
                opening.set_exception(err)

        def start(open_msg, timeout=None) -> None:  # on the lane
            try:
                openers.submit(call_open, open_msg)
            except RuntimeError:  # the client was closed meanwhile: never sent
                if opening.set_running_or_notify_cancel():
                    opening.set_exception(CancelledError())

        try:
            self._send(start, msg, lane=True)
        except WorkerUnavailableError as err:  # a closed client
            opening.set_running_or_notify_cancel()
            opening.set_exception(err)
        return opening

    @staticmethod
    def _open_now(session: _ClientSession) -> bool:
        """Open has answered, successfully (without waiting; a failed Open is left for
        `propose` to report)."""
        opening = session.opening
        if opening is not None:
            if not opening.done() or opening.cancelled() or opening.exception() is not None:
                return False
            session.opening = None
        return True

    def _opened(self, session: _ClientSession) -> None:
        if session.opening is not None:
            opening, session.opening = session.opening, None
            self._result(opening)

    def _propose_request(self, request_id: str, session: _ClientSession, k: int):
        request = pb.ProposeRequest(
            request_id=request_id, epoch=session.committed, num_tokens=k, commits=session.unsent
        )
        session.unsent = []  # sent, whatever the outcome: a failure ends drafting
        session.last_sent = time.monotonic()
        return request

    def _keep_alive(self) -> None:
        """Touch the sessions no call has named for lease_s / 4 (module docstring): one
        ProposeBatch of touch rows on the session lane, its outcome not waited for (a
        session gone meanwhile is reported by its next propose)."""
        now = time.monotonic()
        if now < self._next_scan:
            return
        self._next_scan = now + self._touch_after_s / 2
        idle = [
            r
            for r, s in self._sessions.items()
            # a session whose Open has not answered has no lease on the draft side yet;
            # one whose Open answered but no call has named since (a long prompt still
            # prefilling on this side) has one, and needs the touch
            if now - s.last_sent >= self._touch_after_s and self._open_now(s)
        ]
        if not idle:
            return
        for request_id in idle:
            self._sessions[request_id].last_sent = now
        touch = pb.ProposeBatchRequest(rows=[pb.ProposeRequest(request_id=r) for r in idle])
        with contextlib.suppress(WorkerUnavailableError):  # a closed client
            self._send(self._stub.ProposeBatch, touch, lane=True)

    def opened(self, request_id: str) -> bool:
        session = self._sessions.get(request_id)
        return session is None or session.opening is None or session.opening.done()

    def advance(self, tokens: int) -> None:
        """The draft actor prefills each Open's prompt on its own side, a chunk at a
        time between other calls (workers/draft_service.py)."""

    def prefetch(self, rows: Sequence[ProposeRow]) -> None:
        """Send the next step's ProposeBatch now (the engine calls this at the end of a
        step, once every row of the next one, joined rows included, has its k): the
        draft actor drafts while this side takes new requests and starts the next
        step. `propose` then takes the blocks."""
        self._keep_alive()
        if not self.pipeline or self._prefetch is not None:
            return
        sent, msgs = [], []
        for row in rows:
            session = self._sessions.get(row.request_id)
            if session is None or not self._open_now(session):
                continue  # not open yet: proposed at the next step, blocking
            msgs.append(self._propose_request(row.request_id, session, row.k))
            sent.append((row, session))
        if msgs:
            method, answered = self._stub.ProposeBatch, []

            def timed(msg, timeout):  # its round trip ends here, not when it is taken
                try:
                    return method(msg, timeout=timeout)
                finally:
                    answered.append(time.perf_counter())

            sent_at = time.perf_counter()
            future = self._send(timed, pb.ProposeBatchRequest(rows=msgs))
            self._prefetch = (sent, future, sent_at, answered)
            self.batches += 1
            self.prefetched_batches += 1

    def _take_prefetched(self, rows: Sequence[ProposeRow], out: list) -> None:
        """Fill `out` with the prefetched blocks of `rows`. A prefetched row asked for
        another K gets StaleBlockError (the engine promised K: it then drafts no more)."""
        sent, future, sent_at, answered = self._prefetch
        self._prefetch = None
        try:
            reply = self._result(future)
        except (StaleBlockError, WorkerUnavailableError) as err:
            reply, failure = None, err
        if reply is not None:
            # when it was answered: a prefetch whose rows all went (cancelled) may be
            # taken long after, and that wait is no round trip. A failed call is none
            # either (as in propose): a hung actor's 30 s timeout is not a round trip.
            self._round_trip((answered[0] if answered else time.perf_counter()) - sent_at)
            self.remote_draft_s += reply.draft_s
            if len(reply.rows) != len(sent):
                reply, failure = None, WorkerUnavailableError("draft actor: short reply")
        where = {row.request_id: i for i, (row, _) in enumerate(sent)}
        for i, row in enumerate(rows):
            j = where.get(row.request_id)
            # the session it was drafted for: a request released since, whose id a new
            # request took, opened a new session, which the old block must not reach
            if j is None or self._sessions.get(row.request_id) is not sent[j][1]:
                continue
            if reply is None:
                out[i] = failure
            elif sent[j][0].k != row.k:
                out[i] = StaleBlockError(
                    f"{row.request_id}: prefetched {sent[j][0].k}, asked {row.k}"
                )
            else:
                out[i] = self._row(row, reply.rows[j])

    def _round_trip(self, seconds: float) -> None:
        self.rpc_s += seconds
        if len(self.round_trips) < 4096:  # bounded if nothing takes them
            self.round_trips.append(seconds)

    def take_round_trips(self) -> list[float]:
        """The round trips since the last call (rank 0's metrics observe them)."""
        taken, self.round_trips = self.round_trips, []
        return taken

    def propose(self, rows: Sequence[ProposeRow]) -> list[DraftBlock | CactusError]:
        """Every row's block: the prefetched ones, then one ProposeBatch for the rest;
        each row's block is checked on its own. A transport failure gives each row sent
        a WorkerUnavailableError in its slot (those rows go on without drafts), as a row
        the draft side refused gets its own error; only a reply with the wrong number
        of rows raises."""
        out: list = [None] * len(rows)
        if self._prefetch is not None:
            self._take_prefetched(rows, out)
        sent: list[int] = []
        msgs = []
        for i, row in enumerate(rows):
            if out[i] is not None:
                continue
            session = self._sessions.get(row.request_id)
            try:
                if session is None:
                    raise StaleBlockError(f"{row.request_id}: no open draft session")
                self._opened(session)
            except (StaleBlockError, WorkerUnavailableError) as err:
                out[i] = err
                continue
            msgs.append(self._propose_request(row.request_id, session, row.k))
            sent.append(i)
        if not msgs:
            return out
        start = time.perf_counter()
        self.batches += 1
        try:
            reply = self._call(self._stub.ProposeBatch, pb.ProposeBatchRequest(rows=msgs))
        except WorkerUnavailableError as err:
            for i in sent:
                out[i] = err
            return out
        self._round_trip(time.perf_counter() - start)
        self.remote_draft_s += reply.draft_s
        if len(reply.rows) != len(msgs):
            raise WorkerUnavailableError(f"draft actor answered {len(reply.rows)} of {len(msgs)}")
        for i, result in zip(sent, reply.rows, strict=True):
            out[i] = self._row(rows[i], result)
        return out

    def _row(self, row: ProposeRow, result) -> DraftBlock | CactusError:
        if result.WhichOneof("result") != "block":
            code = status_code(result.error.code)
            message = f"draft actor: {code.name}: {result.error.message}"
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                return StaleBlockError(message)
            if code == grpc.StatusCode.ABORTED:  # the session is intact: draft it again
                return DraftRetryError(message)
            return WorkerUnavailableError(message)
        try:
            block = self.check(result.block, row.request_id, row.k)
        except StaleBlockError as err:
            return err
        self._sessions[row.request_id].pending_seq = result.block.block_seq
        return block

    def check(self, msg: pb.DraftBlock, request_id: str, k: int) -> DraftBlock:
        """Validate a received block against this request's state (drops bad ones)."""
        session = self._sessions[request_id]
        return decode_block(
            msg,
            expect_request=request_id,
            expect_epoch=session.committed,
            last_seq=session.applied_seq,
            k=k,
            vocab=self.vocab_size,
        )

    def commit(self, request_id: str, epoch: int, num_accepted: int, next_token: int) -> None:
        """Record the commit; it travels with the next ProposeBatch (`flush` sends
        recorded commits on their own)."""
        session = self._sessions[request_id]
        session.unsent.append(
            pb.CommitRequest(
                request_id=request_id,
                epoch=epoch,
                block_seq=session.pending_seq,
                num_accepted=num_accepted,
                next_token=next_token,
            )
        )
        session.applied_seq = max(session.applied_seq, session.pending_seq)
        session.pending_seq = 0
        session.committed = epoch + num_accepted + 1

    def flush(self, request_id: str) -> None:
        """Wait for Open and send the recorded commits now (tests drive the protocol
        step by step)."""
        session = self._sessions[request_id]
        self._opened(session)
        for commit in session.unsent:
            self._call(self._stub.Commit, commit)
        session.unsent = []
        session.last_sent = time.monotonic()

    def release(self, request_id: str) -> None:
        """Send Close without waiting: the draft actor may be drafting the next batch,
        and a finished request must not hold up the step (a lost Close is covered by
        the draft side's lease). On the session lane it follows this request's Open (or
        Open would reopen the session) and precedes every later Open."""
        session = self._sessions.pop(request_id, None)
        if session is None:
            return
        msg = pb.CloseSession(request_id=request_id)
        first: list[Future] = []  # calls the lane's Close must follow
        opening = session.opening
        if opening is not None and not opening.done():
            if opening.cancel():  # still queued on the lane: never sent, nothing to close
                return
            # Its Open is running (a long prompt's draft prefill, cancelled or out of
            # time): a Close on another sender stops it at its next chunk (the draft side
            # frees the row), so the Opens queued behind it on the lane, and the step
            # that waits for them, do not wait for the whole prefill. The lane's Close
            # below still follows it in order (a no-op if this one closed the session).
            with contextlib.suppress(Exception):
                first.append(self._send(self._stub.Close, msg))
            # the lane's Close after the Open's answer too: the Open runs on an opener
            # thread, and a Close that overtook it would leave the session it opens
            first.append(opening)
        pending = self._prefetch
        if pending is not None and any(row.request_id == request_id for row, _ in pending[0]):
            # a prefetched ProposeBatch drafting for this session is on its way on another
            # sender: Close (and an Open of the id after it on the lane) must reach the
            # draft side after it, or it would draft for the new session
            first.append(pending[1])
        if first:
            stub, timeout = self._stub, self.timeout_s

            def close_after(_msg, timeout=timeout):
                if opening is not None and opening in first:
                    # The Open may reach the draft side after the Close sent above (its
                    # opener had marked it running but not sent it yet), and would then
                    # prefill its whole prompt while this lane waits: Close again every
                    # 50 ms until it has answered (a repeated Close is a no-op).
                    until = time.monotonic() + timeout
                    while not opening.done() and time.monotonic() < until:
                        try:
                            opening.result(timeout=0.05)
                        except TimeoutError:
                            with contextlib.suppress(Exception):
                                stub.Close(_msg, timeout=timeout)
                        except Exception:  # its outcome is not ours
                            pass
                for call in first:
                    try:
                        call.result(timeout=timeout)
                    except TimeoutError:  # never started (a busy sender): never will
                        if not call.cancel():  # running: its own deadline bounds it
                            with contextlib.suppress(Exception):
                                call.result()
                    except Exception:  # its outcome is not ours
                        pass
                return stub.Close(_msg, timeout=timeout)

            method = close_after
        else:
            method = self._stub.Close
        with contextlib.suppress(Exception):  # a closed client: the lease frees it
            self._send(method, msg, lane=True)

    def status(self) -> pb.StatusReply:
        return self._call(self._stub.Status, pb.StatusRequest())

    def close(self) -> None:
        self._senders.shutdown(wait=False, cancel_futures=True)
        self._lane.shutdown(wait=False, cancel_futures=True)
        self._openers.shutdown(wait=False, cancel_futures=True)
        for session in list(self._sessions.values()):
            if session.opening is not None:  # an Open the lane will now never start
                session.opening.cancel()
        self._channel.close()
