"""The Drafter interface over gRPC: the verifier's rank 0 calling the draft actor.

Every received block is checked (workers/wire.decode_block) against this side's own
committed length and the last block it applied before anything is used: a stale,
repeated or malformed block raises StaleBlockError and is dropped. Transport failures
raise WorkerUnavailableError; the engine then finishes the request without drafts.
Commits are recorded and travel inside the next Propose (one round trip per step); a
failed piggybacked commit fails that Propose, which ends drafting for the request.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import grpc

from cactus.errors import StaleBlockError, WorkerUnavailableError
from cactus.params import SamplingParams
from protos.cactus.internal.v1 import speculation_pb2 as pb
from protos.cactus.internal.v1 import speculation_pb2_grpc as pb_grpc
from workers.interfaces import DraftBlock
from workers.wire import decode_block


@contextlib.contextmanager
def _mapped_errors():
    """FAILED_PRECONDITION -> StaleBlockError (the engine drops the block); any other
    RPC failure -> WorkerUnavailableError (the engine goes on without drafts)."""
    try:
        yield
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
            raise StaleBlockError(err.details()) from None
        raise WorkerUnavailableError(f"draft actor: {err.code().name}: {err.details()}") from None


@dataclass
class _ClientSession:
    committed: int
    opening: grpc.Future | None = None  # the Open call, until it has answered
    applied_seq: int = 0
    pending_seq: int = 0
    unsent: list = field(default_factory=list)  # commits to piggyback on the next Propose
    prefetch: tuple | None = None  # (k, future, sent_at, done_at): a Propose on its way


class GrpcDrafter:
    """Calls are pipelined: Open is sent without waiting (the draft side prefills while
    this side prefills the verifier), commits ride on the next Propose, and when the
    engine says how many tokens it will ask for next (commit's next_k), that Propose
    leaves at once. Rank 0's engine loop then verifies other requests while the draft
    actor drafts this one (single stream it gains nothing; with 4+ concurrent requests
    it is what lets drafting and verification overlap)."""

    def __init__(
        self,
        address: str,
        *,
        vocab_size: int,
        timeout_s: float = 30.0,
        lease_s: float = 120.0,
        max_message_bytes: int = 64 << 20,
        pipeline: bool = True,
    ) -> None:
        self.address = address
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.SpeculationStub(self._channel)
        self._sessions: dict[str, _ClientSession] = {}
        self.rpc_s = 0.0  # Propose round trips (send to reply), overlapped or not
        self.remote_draft_s = 0.0  # of which the draft side spent drafting
        self.pipeline = pipeline

    def _call(self, method, msg):
        """A blocking call; transport failures mapped to the engine's errors."""
        with _mapped_errors():
            return method(msg, timeout=self.timeout_s)

    @staticmethod
    def _result(future: grpc.Future):
        """The reply of a call sent with .future(); errors mapped as in _call."""
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
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k
            ),
            seed=seed,
            lease_s=self.lease_s,
        )
        self._sessions[request_id] = _ClientSession(
            committed=len(prompt_ids), opening=self._stub.Open.future(msg, timeout=self.timeout_s)
        )

    def _opened(self, session: _ClientSession) -> None:
        if session.opening is not None:
            opening, session.opening = session.opening, None
            self._result(opening)

    def _propose_request(self, request_id: str, session: _ClientSession, k: int):
        request = pb.ProposeRequest(
            request_id=request_id, epoch=session.committed, num_tokens=k, commits=session.unsent
        )
        session.unsent = []  # sent, whatever the outcome: a failure ends drafting
        return request

    def _send_propose(self, request_id: str, session: _ClientSession, k: int) -> None:
        request = self._propose_request(request_id, session, k)
        sent_at = time.perf_counter()
        future = self._stub.Propose.future(request, timeout=self.timeout_s)
        done_at = []
        future.add_done_callback(lambda _f: done_at.append(time.perf_counter()))
        session.prefetch = (k, future, sent_at, done_at)

    def propose(self, request_id: str, k: int) -> DraftBlock:
        session = self._sessions[request_id]
        self._opened(session)
        if session.prefetch is None:  # a blocking call: no hand-off between threads
            start = time.perf_counter()
            msg = self._call(self._stub.Propose, self._propose_request(request_id, session, k))
            self.rpc_s += time.perf_counter() - start
        else:
            sent_k, future, sent_at, done_at = session.prefetch
            session.prefetch = None
            if sent_k != k:  # the engine broke its next_k promise: drop the block
                future.cancel()
                raise StaleBlockError(f"{request_id}: prefetched {sent_k} tokens, asked {k}")
            msg = self._result(future)
            self.rpc_s += (done_at[0] if done_at else time.perf_counter()) - sent_at
        self.remote_draft_s += msg.draft_s
        block = self.check(msg, request_id, k)
        session.pending_seq = msg.block_seq
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

    def commit(
        self, request_id: str, epoch: int, num_accepted: int, next_token: int, *, next_k: int = 0
    ) -> None:
        """Record the commit; it travels with the next Propose (one round trip a step
        instead of two), which leaves now when next_k > 0. `flush` sends recorded
        commits on their own."""
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
        if self.pipeline and next_k > 0 and session.opening is None and session.prefetch is None:
            self._send_propose(request_id, session, next_k)

    def flush(self, request_id: str) -> None:
        """Wait for Open and send the recorded commits now (tests drive the protocol
        step by step)."""
        session = self._sessions[request_id]
        self._opened(session)
        for commit in session.unsent:
            self._call(self._stub.Commit, commit)
        session.unsent = []

    def release(self, request_id: str) -> None:
        session = self._sessions.pop(request_id, None)
        if session is None:
            return
        if session.prefetch is not None:  # a block nobody will use
            session.prefetch[1].cancel()
        if session.opening is not None:  # Close must follow Open, or Open would reopen
            with contextlib.suppress(grpc.RpcError):
                session.opening.result()
        with contextlib.suppress(grpc.RpcError):  # else the draft side's lease frees it
            self._stub.Close(pb.CloseSession(request_id=request_id), timeout=self.timeout_s)

    def status(self) -> pb.StatusReply:
        return self._call(self._stub.Status, pb.StatusRequest())

    def close(self) -> None:
        self._channel.close()
