"""The draft side of the speculation service, called directly (no transport) on a tiny
checkpoint: a bad row fails alone, a failed Open leaks no row, and a long Open's
prefill lets the running rows' ProposeBatch calls through."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from cactus.errors import StaleBlockError
from cactus.params import SamplingParams
from protos.cactus.internal.v1 import speculation_pb2 as pb
from workers.batch_runner import BatchRunner
from workers.draft_service import DraftServicer
from workers.interfaces import DraftBlock, ProposeRow
from workers.local import LocalDrafter
from workers.wire import status_code


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class _Context:
    """grpc.aio's ServicerContext as far as the servicer uses it."""

    async def abort(self, code, details):
        raise Aborted(code, details)


CTX = _Context()


@pytest.fixture
def runner(tiny_checkpoints):
    return BatchRunner(str(tiny_checkpoints["llama"]), max_num_seqs=3)


def _open(rid: str, ids: list[int], *, max_tokens: int = 16) -> pb.OpenSession:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.8)
    return pb.OpenSession(request_id=rid, prompt_token_ids=ids, sampling=sampling, seed=1)


def _row(rid: str, epoch: int, k: int, *commits: pb.CommitRequest) -> pb.ProposeRequest:
    return pb.ProposeRequest(request_id=rid, epoch=epoch, num_tokens=k, commits=commits)


async def _batch(servicer: DraftServicer, *rows: pb.ProposeRequest) -> list:
    """ProposeBatch; per row: the block, the error's status code, or None (a touch)."""
    reply = await servicer.ProposeBatch(pb.ProposeBatchRequest(rows=rows), CTX)
    out = []
    for row in reply.rows:
        kind = row.WhichOneof("result")
        out.append({"block": row.block, "error": status_code(row.error.code)}.get(kind))
    return out


def test_a_row_past_its_room_fails_alone(runner):
    """A row asked for more tokens than its KV reserve holds would make the batched
    forward raise, failing every row of the step: it is refused before it."""
    servicer = DraftServicer(LocalDrafter(runner))

    async def run():
        await servicer.Open(_open("small", [5, 6, 7], max_tokens=2), CTX)  # reserve 5
        await servicer.Open(_open("b", [5, 6, 7]), CTX)
        assert servicer.drafter.room("small") == 3  # 2 in the cache, 1 pending
        small, b = await _batch(servicer, _row("small", 3, 4), _row("b", 3, 2))
        assert small == grpc.StatusCode.OUT_OF_RANGE
        assert len(b.token_ids) == 2 and b.block_seq == 1
        # the refused row drafted nothing: a block that fits is served
        (block,) = await _batch(servicer, _row("small", 3, 3))
        assert len(block.token_ids) == 3

    asyncio.run(run())


def test_the_in_process_drafter_refuses_a_row_past_its_room_alone(runner):
    drafter = LocalDrafter(runner)
    drafter.start("small", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.8), 1)
    drafter.start("b", [5, 6, 7], SamplingParams(max_tokens=16, temperature=0.8), 2)
    small, b = drafter.propose([ProposeRow("small", 4), ProposeRow("b", 2)])
    assert isinstance(small, StaleBlockError) and "room" in str(small)
    assert isinstance(b, DraftBlock) and len(b.token_ids) == 2


def test_an_open_that_cannot_prefill_is_refused_and_leaks_no_row(runner, monkeypatch):
    servicer = DraftServicer(LocalDrafter(runner), prefill_chunk_tokens=8)

    async def run():
        too_long = list(range(1, runner.max_context + 3))  # its prefill passes the context
        with pytest.raises(Aborted) as err:
            await servicer.Open(_open("long", too_long), CTX)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert runner.num_sequences == 0 and not servicer.sessions
        # a chunk that fails mid-prefill frees the row too
        real = runner.forward
        calls = []

        def failing(seq_ids, token_ids, **kw):
            calls.append(seq_ids)
            if len(calls) == 2:
                raise RuntimeError("device lost")
            return real(seq_ids, token_ids, **kw)

        monkeypatch.setattr(runner, "forward", failing)
        with pytest.raises(RuntimeError, match="device lost"):
            await servicer.Open(_open("x", list(range(1, 40))), CTX)
        assert runner.num_sequences == 0 and not servicer.sessions
        monkeypatch.setattr(runner, "forward", real)
        await servicer.Open(_open("ok", [5, 6, 7]), CTX)  # the rows are there to take
        assert runner.num_sequences == 1 and set(servicer.sessions) == {"ok"}

    asyncio.run(run())


def test_an_open_with_a_bias_the_draft_cannot_use_is_refused(runner):
    """The engine validates logit_bias first; the draft service still refuses ids
    outside its vocabulary (a negative one would index from the end) and non-finite
    biases, before any row is taken. A good bias opens the session with it."""
    servicer = DraftServicer(LocalDrafter(runner))

    async def run():
        for bias in ({-1: 1.0}, {runner.vocab_size: 1.0}, {5: float("nan")}):
            msg = _open("b", [5, 6, 7])
            msg.sampling.logit_bias.update(bias)
            with pytest.raises(Aborted) as err:
                await servicer.Open(msg, CTX)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "logit_bias" in str(err.value)
            assert runner.num_sequences == 0 and not servicer.sessions
        msg = _open("b", [5, 6, 7])
        msg.sampling.logit_bias.update({9: -100.0, 4: 2.0})
        await servicer.Open(msg, CTX)
        assert servicer.drafter._reqs["b"].sampling.logit_bias == ((4, 2.0), (9, -100.0))

    asyncio.run(run())


def test_bad_commit_fields_fail_their_row_alone(runner):
    """An out-of-range next token would fail the next batched forward (every row), and
    more accepted tokens than the block held would put the draft side out of step."""
    servicer = DraftServicer(LocalDrafter(runner))
    vocab = runner.vocab_size

    def commit(rid, accepted, token):
        return pb.CommitRequest(
            request_id=rid, epoch=3, block_seq=1, num_accepted=accepted, next_token=token
        )

    async def run():
        for rid in ("a", "b", "c"):
            await servicer.Open(_open(rid, [5, 6, 7]), CTX)
        first = await _batch(servicer, *(_row(r, 3, 2) for r in ("a", "b", "c")))
        assert all(isinstance(block, pb.DraftBlock) for block in first)
        a, b, c = await _batch(
            servicer,
            _row("a", 4, 2, commit("a", 0, vocab)),  # token outside the vocabulary
            _row("b", 6, 2, commit("b", 3, 1)),  # 3 accepted of a 2-token block
            _row("c", 4, 2, commit("c", 0, 1)),
        )
        assert a == b == grpc.StatusCode.INVALID_ARGUMENT
        assert isinstance(c, pb.DraftBlock) and c.epoch == 4
        # nothing of the bad commits was applied: the right ones still are
        assert servicer.sessions["a"].committed == servicer.sessions["b"].committed == 3
        rows = [_row("a", 4, 2, commit("a", 0, 1)), _row("b", 6, 2, commit("b", 2, 1))]
        a, b = await _batch(servicer, *rows)
        assert a.epoch == 4 and b.epoch == 6

    asyncio.run(run())


def test_a_touch_row_renews_the_lease_and_drafts_nothing(runner):
    servicer = DraftServicer(LocalDrafter(runner))

    async def run():
        await servicer.Open(_open("a", [5, 6, 7]), CTX)
        servicer.sessions["a"].last_used = 0.0
        plain = pb.CommitRequest(request_id="a", epoch=3, num_accepted=0, next_token=9)
        touched = await _batch(servicer, pb.ProposeRequest(request_id="a", commits=[plain]))
        assert touched == [None]  # neither block nor error
        session = servicer.sessions["a"]
        assert session.last_used > 0 and session.committed == 4 and not session.outstanding
        assert servicer.blocks_proposed == 0
        with pytest.raises(Aborted) as err:
            await servicer.Propose(pb.ProposeRequest(request_id="a", epoch=4), CTX)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(run())


def test_a_long_open_prefills_in_chunks_between_other_calls(runner):
    """The draft actor has one event loop: a long prompt prefilled in one forward held
    up every running row's ProposeBatch behind it."""
    servicer = DraftServicer(LocalDrafter(runner), prefill_chunk_tokens=8)
    prompt = [1 + i % 300 for i in range(200)]

    async def run():
        await servicer.Open(_open("s", [5, 6, 7]), CTX)
        long = asyncio.create_task(servicer.Open(_open("long", prompt), CTX))
        await asyncio.sleep(0)  # the long Open starts: one chunk, then it yields
        block, unopened = await _batch(servicer, _row("s", 3, 2), _row("long", 200, 2))
        assert not long.done()
        assert 0 < runner.length("long") < 199
        assert isinstance(block, pb.DraftBlock) and len(block.token_ids) == 2
        assert unopened == grpc.StatusCode.NOT_FOUND  # no session until its prefill is done
        ack = await long
        assert ack.committed == 200 and runner.length("long") == 199
        (block,) = await _batch(servicer, _row("long", 200, 2))
        assert isinstance(block, pb.DraftBlock)

    asyncio.run(run())


def test_a_close_mid_prefill_frees_the_row_once(runner):
    """The Close frees the row at once; the Open stops, and frees nothing more: the id's
    next Open (the retry) keeps its own row."""
    servicer = DraftServicer(LocalDrafter(runner), prefill_chunk_tokens=8)
    prompt = [1 + i % 300 for i in range(200)]

    async def run():
        await servicer.Open(_open("s", [5, 6, 7]), CTX)
        first = asyncio.create_task(servicer.Open(_open("long", prompt), CTX))
        await asyncio.sleep(0)
        assert runner.num_sequences == 2
        await servicer.Close(pb.CloseSession(request_id="long"), CTX)
        assert runner.num_sequences == 1
        await servicer.Open(_open("long", [5, 6, 7]), CTX)  # the retry, under the same id
        with pytest.raises(Aborted) as err:
            await first
        assert err.value.code == grpc.StatusCode.CANCELLED
        assert runner.num_sequences == 2 and runner.length("long") == 2
        assert set(servicer.sessions) == {"s", "long"}
        (block,) = await _batch(servicer, _row("long", 3, 2))
        assert isinstance(block, pb.DraftBlock)
        # reset mid-prefill: every row goes, the Open's included
        third = asyncio.create_task(servicer.Open(_open("other", prompt), CTX))
        await asyncio.sleep(0)
        assert runner.num_sequences == 3
        assert await servicer.reset() == 3
        with pytest.raises(Aborted):
            await third
        assert runner.num_sequences == 0 and not servicer.sessions

    asyncio.run(run())


def test_the_status_names_the_draft_vocabulary(runner):
    servicer = DraftServicer(LocalDrafter(runner))
    reply = asyncio.run(servicer.Status(pb.StatusRequest(), CTX))
    assert reply.vocab_size == runner.vocab_size > 0


def test_a_long_prompt_drafts_the_same_in_process_and_through_the_service(
    tiny_checkpoints, monkeypatch
):
    """The draft actor prefills a long prompt in chunks; the in-process drafter prefills
    in the same chunks (one constant), so both compute the same draft cache and a seeded
    request drafts the same tokens and probabilities on either side. The chunks are
    checked themselves: on this tiny checkpoint a whole-prompt prefill happens to give
    the same probabilities. Its context is 256, so the chunk is shrunk to 64."""
    import workers.local
    from workers.wire import decode_block

    path = str(tiny_checkpoints["llama"])
    assert (
        DraftServicer(LocalDrafter(BatchRunner(path, max_num_seqs=1))).prefill_chunk_tokens
        == workers.local.DRAFT_PREFILL_CHUNK
    )
    monkeypatch.setattr(workers.local, "DRAFT_PREFILL_CHUNK", 64)
    ids = [(7 * i + 3) % 50 + 2 for i in range(200)]

    def recording_drafter() -> tuple[LocalDrafter, list[int]]:
        runner, widths = BatchRunner(path, max_num_seqs=1), []
        forward = runner.forward

        def recorded(seq_ids, token_ids, **kw):
            widths.append(max(len(t) for t in token_ids))
            return forward(seq_ids, token_ids, **kw)

        runner.forward = recorded
        return LocalDrafter(runner), widths

    local, local_widths = recording_drafter()
    local.start("a", ids, SamplingParams(max_tokens=16, temperature=0.8), seed=1)
    assert local_widths == []  # the row is reserved; the engine's steps prefill it
    local.advance(64)
    assert local_widths == [64]
    (want,) = local.propose([ProposeRow("a", 4)])  # the rest first, in the same chunks
    assert local_widths[:4] == [64, 64, 64, 7]  # the prompt but its last token
    remote, remote_widths = recording_drafter()
    servicer = DraftServicer(remote, prefill_chunk_tokens=64)

    async def run():
        await servicer.Open(_open("a", ids), CTX)
        return (await _batch(servicer, _row("a", len(ids), 4)))[0]

    got = decode_block(
        asyncio.run(run()),
        expect_request="a",
        expect_epoch=len(ids),
        last_seq=0,
        k=4,
        vocab=servicer.drafter.runner.vocab_size,
    )
    assert remote_widths[:4] == [64, 64, 64, 7]
    assert got.token_ids == want.token_ids
    assert torch.equal(got.probs, want.probs)


def test_a_sessions_lease_is_finite_whatever_the_caller_asks(runner):
    """`lease_s` came from the caller unchecked: 1e300 or NaN (`now - t > nan` is never
    true) held a draft row for ever. It now lies in [MIN_LEASE_S, MAX_LEASE_S]; 0 (unset)
    and a non-finite value take the service's default."""
    from workers.draft_service import MAX_LEASE_S, MIN_LEASE_S

    servicer = DraftServicer(LocalDrafter(runner), default_lease_s=30.0)
    asked = {"huge": 1e300, "nan": float("nan"), "inf": float("inf"), "tiny": 1e-9}
    asked |= {"unset": 0.0, "normal": 45.0}
    leases = {}
    for rid, lease in asked.items():

        async def opened(rid=rid, lease=lease):
            msg = _open(rid, [5, 6, 7])
            msg.lease_s = lease
            await servicer.Open(msg, CTX)
            got = servicer.sessions[rid].lease_s
            await servicer.Close(pb.CloseSession(request_id=rid), CTX)
            return got

        leases[rid] = asyncio.run(opened())
    assert leases == {
        "huge": MAX_LEASE_S,
        "nan": 30.0,
        "inf": 30.0,
        "tiny": MIN_LEASE_S,
        "unset": 30.0,
        "normal": 45.0,
    }, leases


def _recorded(path: str, rows: int) -> tuple[LocalDrafter, list[int]]:
    """An in-process drafter whose prefill chunks' widths are recorded."""
    runner, widths = BatchRunner(path, max_num_seqs=rows), []
    forward = runner.forward

    def recorded(seq_ids, token_ids, **kw):
        if kw.get("logits") == "none":
            widths.append(sum(len(t) for t in token_ids))
        return forward(seq_ids, token_ids, **kw)

    runner.forward = recorded
    return LocalDrafter(runner), widths


def test_the_in_process_draft_prefill_keeps_to_the_steps_budget_with_short_prompts(
    tiny_checkpoints, monkeypatch
):
    """`advance(tokens)` counts every chunk it runs, a prompt's last one too: six
    prompts of one chunk each, admitted together, go in over the steps, not all in
    the first (the last chunk of each went uncounted, so they did)."""
    import workers.local

    monkeypatch.setattr(workers.local, "DRAFT_PREFILL_CHUNK", 8)
    drafter, widths = _recorded(str(tiny_checkpoints["llama"]), rows=6)
    sampling = SamplingParams(max_tokens=4, temperature=0.8)
    for i in range(6):
        drafter.start(f"s{i}", [5 + i, 6, 7, 8, 9], sampling, i)  # 4 tokens to prefill
    assert widths == []
    drafter.advance(8)
    assert widths == [4, 4]
    assert [drafter.opened(f"s{i}") for i in range(6)] == [True] * 2 + [False] * 4
    drafter.advance(1)  # at least one chunk
    assert widths == [4, 4, 4]
    blocks = drafter.propose([ProposeRow(f"s{i}", 2) for i in range(6)])  # the rest
    assert all(isinstance(b, DraftBlock) for b in blocks) and widths == [4] * 6


def test_a_commit_while_the_in_process_prefill_runs_waits_for_it(tiny_checkpoints, monkeypatch):
    """A row that decodes without drafts while its draft prefill goes on (a re-opened
    session) commits its tokens: they wait for the session rather than forcing the
    whole prefill into the step, and the session then drafts what a drafter that had
    finished the prefill first drafts."""
    import workers.local

    monkeypatch.setattr(workers.local, "DRAFT_PREFILL_CHUNK", 8)
    path = str(tiny_checkpoints["llama"])
    prompt = [(3 * i + 5) % 40 + 2 for i in range(30)]  # 29 tokens: chunks 8 8 8 5
    sampling = SamplingParams(max_tokens=16, temperature=0.8)
    reference, _ = _recorded(path, rows=1)
    reference.start("a", prompt, sampling, 7)
    reference.room("a")  # the whole prefill
    reference.commit("a", 30, 0, 11)
    reference.commit("a", 31, 0, 12)
    (want,) = reference.propose([ProposeRow("a", 3)])

    drafter, widths = _recorded(path, rows=1)
    drafter.start("a", prompt, sampling, 7)
    drafter.advance(8)
    drafter.commit("a", 30, 0, 11)  # no chunk runs for it
    drafter.commit("a", 31, 0, 12)
    assert widths == [8] and not drafter.opened("a")
    with pytest.raises(StaleBlockError, match="never proposed"):
        drafter.commit("a", 32, 1, 13)  # drafts it never proposed
    drafter.advance(100)
    assert widths == [8, 8, 8, 5] and drafter.opened("a")
    (got,) = drafter.propose([ProposeRow("a", 3)])
    assert got.epoch == want.epoch == 32
    assert got.token_ids == want.token_ids and torch.equal(got.probs, want.probs)
