"""The draft side of the speculation service (grpc.aio), around a LocalDrafter.

Session bookkeeping: each request has a committed length (its epoch) and a counter of
proposed blocks. Propose must name the current epoch (else FAILED_PRECONDITION: the
caller's view is stale). Commit must answer the outstanding block; a repeated commit of
an already applied block is acknowledged and ignored, never applied twice. Sessions are
freed on Close, and by a lease when no call naming them arrives for lease_s seconds (a
verifier that died mid-request must not leak caches here; rank 0 keeps the session of a
row it drafts nothing for alive with touch rows, num_tokens = 0).

Open prefills the prompt in chunks of prefill_chunk_tokens and yields the event loop
between them, so a long prompt does not hold up every running row's ProposeBatch. The
session exists (ProposeBatch and Commit can reach it) only once its prefill is done; a
Close (or reset) arriving mid-prefill frees the row at once and the Open stops there.

ProposeBatch carries every row of an engine step: rows are checked one by one (a bad
row gets its own error and fails alone: a stale epoch, a bad commit, a block past its
row's room), then the good ones are drafted in one batched pass. Every reply stays under
max_reply_bytes: a block that would take it past fails alone (RESOURCE_EXHAUSTED), never
the whole call. A batched forward that raises (a device error) puts its rows back as they
were and answers each ABORTED: rank 0 decodes them one step without drafts and proposes
them again at the next. Model work runs inline on the event loop, which also serialises access to
the model (dropping the thread hop per call saved 0.3-1.4 ms a step in make
bench-distributed; other RPCs wait at most one propose or one prefill chunk).
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from dataclasses import dataclass

import grpc

from cactus.errors import DraftRetryError, WorkerUnavailableError
from cactus.params import MAX_DRAFT_TOKENS, SamplingParams
from protos.cactus.internal.v1 import speculation_pb2 as pb
from protos.cactus.internal.v1 import speculation_pb2_grpc as pb_grpc
from workers.interfaces import ProposeRow
from workers.local import DRAFT_PREFILL_CHUNK, LocalDrafter
from workers.wire import KEY_METADATA, MAX_MESSAGE_BYTES, fill_block, status_code

# An Open's pause between two prefill chunks, for the calls that arrived meanwhile: with
# `sleep(0)` a Close or a running row's ProposeBatch took about 8 chunks to get through
# (1.0 s against 0.06 s with this, tests/workers/test_grpc_drafter.py's slowed prefill).
CHUNK_YIELD_S = 0.001

# A session's lease, whatever a caller asks: finite, so a session cannot be held for ever
MIN_LEASE_S, MAX_LEASE_S = 1.0, 3600.0
# Reply bytes beyond its rows (draft_s), and per row beyond its own (tag and length).
_REPLY_SLACK = 16
_ROW_OVERHEAD = 6


@dataclass
class _Session:
    committed: int
    lease_s: float
    last_used: float
    proposed_seq: int = 0  # block_seq of the last proposed block
    applied_seq: int = 0  # block_seq of the last committed block
    outstanding: bool = False
    block_k: int = 0  # tokens in the last proposed block (a commit accepts at most these)


class _RowFailure(Exception):
    """A row of a batched propose (or a single call) that cannot be served."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):  # picklable like every project error (tests/cactus/test_errors.py)
        return (type(self), (self.code, self.message))


class DraftServicer(pb_grpc.SpeculationServicer):
    def __init__(
        self,
        drafter: LocalDrafter,
        *,
        default_lease_s: float = 120.0,
        prefill_chunk_tokens: int = DRAFT_PREFILL_CHUNK,
        max_reply_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        if prefill_chunk_tokens < 1 or not 0 < max_reply_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError("prefill_chunk_tokens >= 1, max_reply_bytes in (0, 2 GiB) required")
        self.drafter = drafter
        self.default_lease_s = default_lease_s
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_reply_bytes = max_reply_bytes  # start_server's send limit
        self.sessions: dict[str, _Session] = {}
        self._opening: dict[str, object] = {}  # request id -> the Open prefilling it
        self.blocks_proposed = 0
        self.batches = 0

    def _session(self, request_id: str) -> _Session:
        session = self.sessions.get(request_id)
        if session is None:
            raise _RowFailure(grpc.StatusCode.NOT_FOUND, f"no open session {request_id!r}")
        session.last_used = time.monotonic()
        return session

    async def Open(self, request, context):
        rid = request.request_id
        ids = list(request.prompt_token_ids)
        vocab = self.drafter.runner.vocab_size
        if not rid or not ids or any(not 0 <= t < vocab for t in ids):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "request_id and prompt ids in [0, vocab) are required",
            )
        s = request.sampling
        if any(not 0 <= t < vocab or not math.isfinite(v) for t, v in s.logit_bias.items()):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "logit_bias: ids in [0, vocab), finite biases"
            )
        max_tokens = s.max_tokens or self.drafter.runner.max_context
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=s.temperature,
            top_p=s.top_p or 1.0,
            top_k=s.top_k,
            logit_bias=tuple(sorted(s.logit_bias.items())),
        )
        self._drop(rid)  # a session of this id, or an Open of it still prefilling, ends
        token = self._opening[rid] = object()
        steps = self.drafter.start_chunked(
            rid, ids, sampling, request.seed, chunk_tokens=self.prefill_chunk_tokens
        )
        closed, failed = False, None
        try:
            for _ in steps:  # a chunk per step
                # other calls (ProposeBatch, Close) go on between chunks: a bare
                # sleep(0) moved a new gRPC call one step per chunk (about 8 chunks
                # before it ran); a 1 ms sleep lets the gRPC core's events in
                await asyncio.sleep(CHUNK_YIELD_S)
                if self._opening.get(rid) is not token:  # Close or reset freed the row
                    steps.close()
                    closed = True
                    break
        except (WorkerUnavailableError, ValueError) as err:  # nothing reserved is left
            failed = err
        except BaseException:  # the call was cancelled, or the model failed
            if self._opening.get(rid) is token:
                self._drop(rid)
            raise
        if closed:
            await context.abort(grpc.StatusCode.CANCELLED, f"{rid!r} closed while opening")
        if failed is not None:
            if self._opening.get(rid) is token:
                self._drop(rid)
            if isinstance(failed, WorkerUnavailableError):  # no row or KV budget left here
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(failed))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(failed))
        del self._opening[rid]
        lease = request.lease_s if math.isfinite(request.lease_s) else 0.0
        lease = min(max(lease or self.default_lease_s, MIN_LEASE_S), MAX_LEASE_S)
        self.sessions[rid] = _Session(len(ids), lease, time.monotonic())
        return pb.SessionAck(request_id=rid, committed=len(ids))

    async def Propose(self, request, context):
        if request.num_tokens == 0:  # a touch is a ProposeBatch row only
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"num_tokens must be 1..{MAX_DRAFT_TOKENS}"
            )
        reply = await self.ProposeBatch(pb.ProposeBatchRequest(rows=[request]), context)
        row = reply.rows[0]
        if row.WhichOneof("result") == "error":
            await context.abort(status_code(row.error.code), row.error.message)
        row.block.draft_s = reply.draft_s
        return row.block

    async def ProposeBatch(self, request, context):
        """Check every row (commits first), then draft the good ones in one pass. A touch
        row (num_tokens = 0) gets an empty result."""
        reply = pb.ProposeBatchReply()
        ready: list[tuple[int, _Session]] = []
        seen: set[str] = set()
        for i, row in enumerate(request.rows):
            reply.rows.add()
            try:
                if row.request_id in seen:
                    raise _RowFailure(grpc.StatusCode.INVALID_ARGUMENT, "request twice in a batch")
                seen.add(row.request_id)
                session = self._ready(row)
                if session is not None:
                    ready.append((i, session))
            except _RowFailure as fail:
                reply.rows[i].error.code = fail.code.value[0]
                reply.rows[i].error.message = fail.message
        if ready:
            start = time.perf_counter()
            rows = [
                ProposeRow(request.rows[i].request_id, request.rows[i].num_tokens) for i, _ in ready
            ]
            blocks = self.drafter.propose(rows)
            used = reply.ByteSize() + _REPLY_SLACK  # the rows answered so far (errors)
            for (i, session), block in zip(ready, blocks, strict=True):
                result = reply.rows[i]
                if isinstance(block, Exception):
                    # a failed batched forward left the session as it was: ABORTED, which
                    # rank 0 retries at the next step; any other row error ends its drafts
                    code = (
                        grpc.StatusCode.ABORTED
                        if isinstance(block, DraftRetryError)
                        else grpc.StatusCode.FAILED_PRECONDITION
                    )
                    result.error.code = code.value[0]
                    result.error.message = str(block)
                    used += result.ByteSize() + _ROW_OVERHEAD
                    continue
                session.proposed_seq += 1
                session.outstanding = True
                session.block_k = len(block.token_ids)
                result.block.block_seq = session.proposed_seq
                fill_block(result.block, block)
                size = result.ByteSize() + _ROW_OVERHEAD
                if used + size > self.max_reply_bytes:  # it alone fails (its session ends)
                    result.ClearField("block")
                    result.error.code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
                    result.error.message = (
                        f"a block of {size} bytes would take the reply past its limit of "
                        f"{self.max_reply_bytes}"
                    )
                    size = result.ByteSize() + _ROW_OVERHEAD
                else:
                    self.blocks_proposed += 1
                used += size
            reply.draft_s = time.perf_counter() - start
            self.batches += 1
        return reply

    def _ready(self, row) -> _Session | None:
        """Apply the row's piggybacked commits and check it may be drafted now (None: a
        touch, nothing to draft)."""
        session = self._session(row.request_id)
        for commit in row.commits:
            self._apply_commit(session, row.request_id, commit)
        if row.num_tokens == 0:
            return None
        if row.epoch != session.committed:
            raise _RowFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stale epoch {row.epoch}; committed {session.committed}",
            )
        if session.outstanding:
            raise _RowFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"block {session.proposed_seq} is still waiting for its commit",
            )
        if not 1 <= row.num_tokens <= MAX_DRAFT_TOKENS:
            raise _RowFailure(
                grpc.StatusCode.INVALID_ARGUMENT, f"num_tokens must be 1..{MAX_DRAFT_TOKENS}"
            )
        room = self.drafter.room(row.request_id)
        if row.num_tokens > room:  # in the batched forward it would fail every row
            raise _RowFailure(
                grpc.StatusCode.OUT_OF_RANGE,
                f"{row.num_tokens} tokens exceed the session's room of {room}",
            )
        return session

    async def Commit(self, request, context):
        try:
            session = self._session(request.request_id)
            self._apply_commit(session, request.request_id, request)
        except _RowFailure as fail:
            await context.abort(fail.code, fail.message)
        return pb.SessionAck(request_id=request.request_id, committed=session.committed)

    def _apply_commit(self, session: _Session, request_id: str, request) -> None:
        """Apply one commit of `request_id`'s session; a bad one raises _RowFailure with
        nothing applied (it fails its row alone, not the batched forward after it)."""
        if request.request_id != request_id:
            raise _RowFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"commit for {request.request_id!r} in a row of {request_id!r}",
            )
        if request.block_seq and request.block_seq <= session.applied_seq:
            return  # a repeat of an applied block: acknowledged, never applied twice
        if request.block_seq == 0 and request.epoch < session.committed:
            return  # a repeated plain-decoding commit
        wanted = session.proposed_seq if session.outstanding else 0
        if request.block_seq != wanted or request.epoch != session.committed:
            raise _RowFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"commit for block {request.block_seq} at epoch {request.epoch}; "
                f"expected block {wanted} at {session.committed}",
            )
        most = session.block_k if request.block_seq else 0
        vocab = self.drafter.runner.vocab_size
        if request.num_accepted > most or not 0 <= request.next_token < vocab:
            raise _RowFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"commit of {request.num_accepted} accepted (at most {most}) and next "
                f"token {request.next_token} (in [0, {vocab}))",
            )
        self.drafter.commit(
            request.request_id, request.epoch, request.num_accepted, request.next_token
        )
        session.committed = request.epoch + request.num_accepted + 1
        session.applied_seq = max(session.applied_seq, request.block_seq)
        session.outstanding = False

    async def Close(self, request, context):
        await self._close(request.request_id)
        return pb.SessionAck(request_id=request.request_id)

    async def _close(self, request_id: str) -> None:
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        """Free a session, or the row of an Open still prefilling (which then stops). The row
        is released before the session goes, so a reader that sees no session also sees no
        row (the tests poll both from another thread while the servicer runs)."""
        self.drafter.release(request_id)
        self.sessions.pop(request_id, None)
        self._opening.pop(request_id, None)

    async def reset(self) -> int:
        """Drop every session (the engine they belonged to was rebuilt)."""
        ids = list(dict.fromkeys([*self.sessions, *self._opening]))
        for rid in ids:
            await self._close(rid)
        return len(ids)

    async def Status(self, request, context):
        return pb.StatusReply(
            open_sessions=len(self.sessions),
            cached_sequences=self.drafter.runner.num_sequences,
            blocks_proposed=self.blocks_proposed,
            max_context=self.drafter.runner.max_context,
            vocab_size=self.drafter.runner.vocab_size,
        )

    async def expire_leases(self, period_s: float = 1.0) -> None:
        """Background task: free sessions whose lease ran out."""
        while True:
            await asyncio.sleep(period_s)
            now = time.monotonic()
            for rid, s in list(self.sessions.items()):
                if now - s.last_used > s.lease_s:
                    await self._close(rid)


def host_port(host: str, port: int) -> str:
    """gRPC's target form: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class _KeyCheck(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call that does not carry the group's key."""

    def __init__(self, key: str) -> None:
        self._key = key.encode()

        async def deny(request, context):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "the draft service takes only its engine's calls"
            )

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        sent = dict(handler_call_details.invocation_metadata or ()).get(KEY_METADATA, "")
        sent = sent.encode() if isinstance(sent, str) else sent
        if hmac.compare_digest(sent, self._key):
            return await continuation(handler_call_details)
        return self._deny


async def start_server(
    servicer: DraftServicer,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_request_bytes: int = 64 << 20,
    key: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Requests are small (prompt ids, commits); replies are as large as the servicer
    lets them be (DraftServicer keeps each under its max_reply_bytes). `key`: every call
    must carry it (KEY_METADATA); the engine group makes one per group."""
    options = [
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.max_send_message_length", getattr(servicer, "max_reply_bytes", MAX_MESSAGE_BYTES)),
    ]
    server = grpc.aio.server(options=options, interceptors=[_KeyCheck(key)] if key else None)
    pb_grpc.add_SpeculationServicer_to_server(servicer, server)
    bound = server.add_insecure_port(host_port(host, port))
    await server.start()
    return server, bound
