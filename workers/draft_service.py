"""The draft side of the speculation service (grpc.aio), around a LocalDrafter.

Session bookkeeping: each request has a committed length (its epoch) and a counter of
proposed blocks. Propose must name the current epoch (else FAILED_PRECONDITION: the
caller's view is stale). Commit must answer the outstanding block; a repeated commit of
an already applied block is acknowledged and ignored, never applied twice. Sessions are
freed on Close, and by a lease when no call arrives for lease_s seconds (a verifier that
died mid-request must not leak caches here).

ProposeBatch carries every row of an engine step: rows are checked one by one (a bad
row gets its own error and fails alone), then the good ones are drafted in one batched
pass. Model work runs inline on the event loop, which also serialises access to the model
(dropping the thread hop per call saved 0.3-1.4 ms a step in make bench-distributed;
other RPCs wait at most one propose, a few ms).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from cactus.errors import WorkerUnavailableError
from cactus.params import SamplingParams
from protos.cactus.internal.v1 import speculation_pb2 as pb
from protos.cactus.internal.v1 import speculation_pb2_grpc as pb_grpc
from workers.interfaces import ProposeRow
from workers.local import MAX_DRAFT_TOKENS, LocalDrafter
from workers.wire import fill_block, status_code


@dataclass
class _Session:
    committed: int
    lease_s: float
    last_used: float
    proposed_seq: int = 0  # block_seq of the last proposed block
    applied_seq: int = 0  # block_seq of the last committed block
    outstanding: bool = False


class _RowFailure(Exception):
    """A row of a batched propose (or a single call) that cannot be served."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):  # picklable like every project error (tests/cactus/test_errors.py)
        return (type(self), (self.code, self.message))


class DraftServicer(pb_grpc.SpeculationServicer):
    def __init__(self, drafter: LocalDrafter, *, default_lease_s: float = 120.0) -> None:
        self.drafter = drafter
        self.default_lease_s = default_lease_s
        self.sessions: dict[str, _Session] = {}
        self.blocks_proposed = 0
        self.batches = 0

    def _session(self, request_id: str) -> _Session:
        session = self.sessions.get(request_id)
        if session is None:
            raise _RowFailure(grpc.StatusCode.NOT_FOUND, f"no open session {request_id!r}")
        session.last_used = time.monotonic()
        return session

    async def Open(self, request, context):
        ids = list(request.prompt_token_ids)
        vocab = self.drafter.runner.vocab_size
        if not request.request_id or not ids or any(not 0 <= t < vocab for t in ids):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "request_id and prompt ids in [0, vocab) are required",
            )
        s = request.sampling
        max_tokens = s.max_tokens or self.drafter.runner.max_context
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k
        )
        try:
            self.drafter.start(request.request_id, ids, sampling, request.seed)
        except WorkerUnavailableError as err:  # no row or KV budget left on this side
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        lease = request.lease_s or self.default_lease_s
        self.sessions[request.request_id] = _Session(len(ids), lease, time.monotonic())
        return pb.SessionAck(request_id=request.request_id, committed=len(ids))

    async def Propose(self, request, context):
        reply = await self.ProposeBatch(pb.ProposeBatchRequest(rows=[request]), context)
        row = reply.rows[0]
        if row.WhichOneof("result") == "error":
            await context.abort(status_code(row.error.code), row.error.message)
        row.block.draft_s = reply.draft_s
        return row.block

    async def ProposeBatch(self, request, context):
        """Check every row (commits first), then draft the good ones in one pass."""
        reply = pb.ProposeBatchReply()
        ready: list[tuple[int, _Session]] = []
        seen: set[str] = set()
        for i, row in enumerate(request.rows):
            reply.rows.add()
            try:
                if row.request_id in seen:
                    raise _RowFailure(grpc.StatusCode.INVALID_ARGUMENT, "request twice in a batch")
                seen.add(row.request_id)
                ready.append((i, self._ready(row)))
            except _RowFailure as fail:
                reply.rows[i].error.code = fail.code.value[0]
                reply.rows[i].error.message = fail.message
        if ready:
            start = time.perf_counter()
            rows = [
                ProposeRow(request.rows[i].request_id, request.rows[i].num_tokens) for i, _ in ready
            ]
            blocks = self.drafter.propose(rows)
            for (i, session), block in zip(ready, blocks, strict=True):
                if isinstance(block, Exception):
                    reply.rows[i].error.code = grpc.StatusCode.FAILED_PRECONDITION.value[0]
                    reply.rows[i].error.message = str(block)
                    continue
                session.proposed_seq += 1
                session.outstanding = True
                self.blocks_proposed += 1
                reply.rows[i].block.block_seq = session.proposed_seq
                fill_block(reply.rows[i].block, block)
            reply.draft_s = time.perf_counter() - start
            self.batches += 1
        return reply

    def _ready(self, row) -> _Session:
        """Apply the row's piggybacked commits and check it may be drafted now."""
        session = self._session(row.request_id)
        for commit in row.commits:
            self._apply_commit(session, commit)
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
        return session

    async def Commit(self, request, context):
        try:
            session = self._session(request.request_id)
            self._apply_commit(session, request)
        except _RowFailure as fail:
            await context.abort(fail.code, fail.message)
        return pb.SessionAck(request_id=request.request_id, committed=session.committed)

    def _apply_commit(self, session: _Session, request) -> None:
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
        self.sessions.pop(request_id, None)
        self.drafter.release(request_id)

    async def reset(self) -> int:
        """Drop every session (the engine they belonged to was rebuilt)."""
        ids = list(self.sessions)
        for rid in ids:
            await self._close(rid)
        return len(ids)

    async def Status(self, request, context):
        return pb.StatusReply(
            open_sessions=len(self.sessions),
            cached_sequences=self.drafter.runner.num_sequences,
            blocks_proposed=self.blocks_proposed,
            max_context=self.drafter.runner.max_context,
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


async def start_server(
    servicer: DraftServicer,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = 64 << 20,
) -> tuple[grpc.aio.Server, int]:
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    server = grpc.aio.server(options=options)
    pb_grpc.add_SpeculationServicer_to_server(servicer, server)
    bound = server.add_insecure_port(host_port(host, port))
    await server.start()
    return server, bound
