"""The draft client against a real draft server (in-process gRPC, tiny checkpoint): its
ordering guarantees (the verifier side and the draft side hold the same number of rows,
so a finished request's Close must reach the draft side before the Open of the request
that takes its row), its sessions' leases, the vocabulary check and the reply limit."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from cactus.errors import WorkerUnavailableError
from cactus.params import SamplingParams
from workers.batch_runner import BatchRunner
from workers.draft_service import DraftServicer, start_server
from workers.grpc_drafter import GrpcDrafter
from workers.interfaces import DraftBlock, ProposeRow
from workers.local import LocalDrafter


@contextlib.contextmanager
def _serving(servicer: DraftServicer, *, lease_period_s: float | None = None):
    """Serve `servicer` on a background event loop (expiring leases every
    lease_period_s, if given); yields its address."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict = {}

    async def serve():
        box["server"], box["port"] = await start_server(servicer)
        if lease_period_s is not None:
            box["leases"] = loop.create_task(servicer.expire_leases(lease_period_s))
        started.set()

    async def stop():
        if "leases" in box:
            box["leases"].cancel()
        await box["server"].stop(None)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop)
    assert started.wait(30)
    try:
        yield f"127.0.0.1:{box['port']}"
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture
def draft_server(tiny_checkpoints):
    """A draft server with two rows on a background event loop; yields its address."""
    runner = BatchRunner(str(tiny_checkpoints["llama"]), max_num_seqs=2)
    servicer = DraftServicer(LocalDrafter(runner))
    with _serving(servicer) as address:
        yield address, servicer, runner


def test_a_close_reaches_the_draft_side_before_the_open_that_takes_its_row(draft_server):
    """Both rows are taken; one request finishes (Close) and a new one starts (Open)
    at once. However slow the Close is on its way, the Open must not overtake it: on a
    full draft side it would be refused (RESOURCE_EXHAUSTED) and the new request would
    run without drafts for its whole life, its seeded tokens no longer its solo ones.
    Served, six concurrent requests on two rows lost a request's drafts so in 2 of about
    25 runs."""
    address, servicer, runner = draft_server
    drafter = GrpcDrafter(address, vocab_size=runner.vocab_size, timeout_s=30)
    real_close = drafter._stub.Close

    def slow_close(msg, timeout=None):  # the Close is late on the wire
        time.sleep(0.5)
        return real_close(msg, timeout=timeout)

    drafter._stub.Close = slow_close
    sampling = SamplingParams(max_tokens=8, temperature=0.8)
    try:
        for rid, seed in (("a", 1), ("b", 2)):
            drafter.start(rid, [5, 6, 7], sampling, seed)
        first = drafter.propose([ProposeRow("a", 2), ProposeRow("b", 2)])
        assert all(isinstance(block, DraftBlock) for block in first), first
        drafter.commit("b", first[1].epoch, 1, 11)  # b goes on
        drafter.release("a")  # a finished: its row is free on this side at once
        drafter.start("c", [8, 9], sampling, 3)  # and c takes it
        blocks = drafter.propose([ProposeRow("b", 2), ProposeRow("c", 2)])
        assert all(isinstance(block, DraftBlock) for block in blocks), blocks
        assert set(servicer.sessions) == {"b", "c"}
    finally:
        drafter.close()


def test_a_prefetched_block_never_reaches_a_new_request_that_took_its_id(draft_server):
    """A request is prefetched, then released before the next step (cancelled), and a
    retry starts under the same id. The prefetched block belongs to the closed
    session: the new request's first proposal must be drafted for it (its own seed),
    and its commits must then keep the draft side in step."""
    address, _, runner = draft_server
    drafter = GrpcDrafter(address, vocab_size=runner.vocab_size, timeout_s=30)
    sampling = SamplingParams(max_tokens=8, temperature=0.8)
    # the draft model's context comes with the draft actor's Status (rank 0 caps K by it)
    assert drafter.max_context == runner.max_context == 256
    try:
        drafter.start("a", [5, 6, 7], sampling, 1)
        drafter.flush("a")  # Open answered, so the prefetch sends it
        real_propose = drafter._stub.ProposeBatch

        def late_propose(msg, timeout=None):  # the prefetch is slow on the wire
            time.sleep(0.5)
            return real_propose(msg, timeout=timeout)

        drafter._stub.ProposeBatch = late_propose
        drafter.prefetch([ProposeRow("a", 2)])
        drafter._stub.ProposeBatch = real_propose
        assert drafter._prefetch is not None
        drafter.release("a")
        drafter.start("a", [5, 6, 7], sampling, 9)  # the retry, its own seed
        # the late prefetch must not reach the draft side after the retry's Open (it
        # would draft for the new session, which then refuses the retry's own proposal)
        (block,) = drafter.propose([ProposeRow("a", 2)])
        assert isinstance(block, DraftBlock), block
        drafter.start("ctl", [5, 6, 7], sampling, 9)  # a fresh session, the same seed
        (want,) = drafter.propose([ProposeRow("ctl", 2)])
        assert block.token_ids == want.token_ids and block.epoch == 3
        drafter.commit("a", block.epoch, 2, 11)
        (second,) = drafter.propose([ProposeRow("a", 2)])
        assert isinstance(second, DraftBlock) and second.epoch == 6, second
    finally:
        drafter.close()


@contextlib.contextmanager
def _leased_drafter(tiny_checkpoints, lease_s: float):
    """A two-row draft server expiring leases every 20 ms, and a client whose sessions
    hold `lease_s` leases; yields (runner, servicer, drafter). The drafter is closed at
    the end (a test may close it first)."""
    runner = BatchRunner(str(tiny_checkpoints["llama"]), max_num_seqs=2)
    servicer = DraftServicer(LocalDrafter(runner))
    with _serving(servicer, lease_period_s=0.02) as address:
        drafter = GrpcDrafter(address, vocab_size=runner.vocab_size, timeout_s=30, lease_s=lease_s)
        try:
            yield runner, servicer, drafter
        finally:
            drafter.close()


def test_a_row_drafted_nothing_for_keeps_its_draft_session(tiny_checkpoints):
    """A row the policy holds at k = 0 sends no ProposeBatch, only recorded commits: the
    draft side's lease freed its session, and its next proposal failed (NOT_FOUND),
    ending its drafts. rank 0 touches such sessions; once it is gone, nothing does, and
    the lease frees them."""
    with _leased_drafter(tiny_checkpoints, lease_s=3.0) as (runner, servicer, drafter):
        drafter.start("held", [5, 6, 7], SamplingParams(max_tokens=128, temperature=0.8), 1)
        drafter.flush("held")
        committed = 3
        deadline = time.monotonic() + 7.0  # more than two leases
        while time.monotonic() < deadline:  # plain decoding steps: a commit, and the
            drafter.commit("held", committed, 0, 11)  # engine's end-of-step prefetch
            drafter.prefetch([])  # (no row drafts)
            committed += 1
            time.sleep(0.1)
        assert "held" in servicer.sessions
        (block,) = drafter.propose([ProposeRow("held", 2)])
        assert isinstance(block, DraftBlock), block
        assert block.epoch == committed
        drafter.close()
        deadline = time.monotonic() + 10  # rank 0 is gone: the lease frees the row
        while (servicer.sessions or runner.num_sequences) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not servicer.sessions and runner.num_sequences == 0


def test_a_session_opened_while_its_prompt_still_prefills_here_keeps_its_lease(
    tiny_checkpoints,
):
    """A long prompt: the draft actor answers Open while rank 0 prefills the verifier
    chunk by chunk, many steps with no call naming the row. The touches skipped every
    session whose answered Open nothing had taken yet, so the lease freed it and the
    row's first proposal failed (NOT_FOUND): the request lost its drafts for good."""
    with _leased_drafter(tiny_checkpoints, lease_s=1.5) as (_, servicer, drafter):
        drafter.start("long", [5, 6, 7], SamplingParams(max_tokens=64, temperature=0.8), 1)
        deadline = time.monotonic() + 10
        while not drafter.opened("long") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert drafter.opened("long")
        deadline = time.monotonic() + 4.0  # more than two leases of prefill steps
        while time.monotonic() < deadline:
            drafter.prefetch([])  # the engine's end-of-step call (no row drafts)
            time.sleep(0.05)
        assert "long" in servicer.sessions
        (block,) = drafter.propose([ProposeRow("long", 2)])
        assert isinstance(block, DraftBlock), block
        assert block.epoch == 3 and len(block.token_ids) == 2


def test_a_draft_actor_of_another_vocabulary_is_refused(draft_server):
    """Its every block would fail the verifier's shape check: refused at once, naming
    both sizes."""
    address, _, runner = draft_server
    vocab = runner.vocab_size
    with pytest.raises(
        ValueError, match=f"vocabulary {vocab} differs from the verifier's {vocab + 1}"
    ):
        GrpcDrafter(address, vocab_size=vocab + 1, timeout_s=30)
    GrpcDrafter(address, vocab_size=vocab, timeout_s=30).close()


def test_a_reply_over_the_message_limit_fails_only_the_rows_that_do_not_fit(tiny_checkpoints):
    """Dense draft rows of a large vocabulary can add up past the channel's limit: the
    whole ProposeBatch then failed (RESOURCE_EXHAUSTED) and every row lost its drafts.
    Here three dense blocks of about 6.5 kB against a 16 kB limit: two fit."""
    runner = BatchRunner(str(tiny_checkpoints["llama"]), max_num_seqs=3)
    servicer = DraftServicer(LocalDrafter(runner), max_reply_bytes=16_000)
    with _serving(servicer) as address:
        drafter = GrpcDrafter(address, vocab_size=runner.vocab_size, timeout_s=30)
        try:
            sampling = SamplingParams(max_tokens=16, temperature=1.0)  # full support: dense
            for seed, rid in enumerate("abc"):
                drafter.start(rid, [5, 6, 7], sampling, seed)
            a, b, c = drafter.propose([ProposeRow(rid, 4) for rid in "abc"])
            assert isinstance(a, DraftBlock) and isinstance(b, DraftBlock), (a, b)
            assert a.probs.shape == (4, runner.vocab_size) and bool((a.probs > 0).all())
            assert isinstance(c, WorkerUnavailableError) and "RESOURCE_EXHAUSTED" in str(c)
        finally:
            drafter.close()


def test_a_prefetch_taken_late_counts_its_round_trip_not_the_wait(draft_server):
    """A prefetched ProposeBatch whose rows were all cancelled is taken at the next
    propose, maybe much later: that wait is no round trip."""
    address, _, runner = draft_server
    drafter = GrpcDrafter(address, vocab_size=runner.vocab_size, timeout_s=30)
    try:
        drafter.start("a", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.8), 1)
        drafter.flush("a")
        drafter.prefetch([ProposeRow("a", 2)])
        drafter._prefetch[1].result(timeout=30)  # answered
        time.sleep(2.0)
        drafter.release("a")  # cancelled: no row takes its block
        assert drafter.propose([]) == []
        (trip,) = drafter.take_round_trips()
        assert 0 < trip < 1.5  # the 2 s wait is not in it
    finally:
        drafter.close()


def test_a_failed_prefetch_is_no_round_trip(tiny_checkpoints):
    """A prefetched ProposeBatch that fails (here the draft side aborts it, as a hung
    actor's call ends at its timeout) gives its rows the error and records no round
    trip: a 30 s timeout in cactus_draft_round_trip_seconds is not one (the blocking
    propose never counted a failed call either)."""
    import grpc

    class Failing(DraftServicer):
        async def ProposeBatch(self, request, context):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "too slow")

    runner = BatchRunner(str(tiny_checkpoints["llama"]), max_num_seqs=2)
    with _serving(Failing(LocalDrafter(runner))) as address:
        drafter = GrpcDrafter(address, vocab_size=runner.vocab_size, timeout_s=30)
        try:
            drafter.start("a", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.8), 1)
            drafter.flush("a")
            drafter.prefetch([ProposeRow("a", 2)])
            (block,) = drafter.propose([ProposeRow("a", 2)])
            assert isinstance(block, WorkerUnavailableError), block
            assert drafter.take_round_trips() == []
        finally:
            drafter.close()


@contextlib.contextmanager
def _slow_prefill_drafter(tiny_checkpoints, rows: int = 2):
    """A draft server of `rows` rows whose prefill of request "long" takes 0.1 s a chunk
    of 8 (its 241-token prompt: 30 chunks, about 3 s), and a client of it; yields
    (runner, servicer, drafter). `runner.long_chunks[0]` counts the long prefill's
    chunks so far: the tests below bound what a call waited in chunks, which a loaded
    machine slows alike, not in seconds."""
    runner = BatchRunner(str(tiny_checkpoints["llama"]), max_num_seqs=rows)
    real_forward = runner.forward
    runner.long_chunks = [0]

    def slow_forward(seq_ids, token_ids, **kw):
        if "long" in seq_ids:
            runner.long_chunks[0] += 1
            time.sleep(0.1)
        return real_forward(seq_ids, token_ids, **kw)

    runner.forward = slow_forward
    servicer = DraftServicer(LocalDrafter(runner), prefill_chunk_tokens=8)
    with _serving(servicer) as address:
        drafter = GrpcDrafter(address, vocab_size=runner.vocab_size, timeout_s=30)
        try:
            yield runner, servicer, drafter
        finally:
            drafter.close()


LONG_PROMPT = [1 + i % 300 for i in range(241)]
SAMPLING = SamplingParams(max_tokens=8, temperature=0.8)


def _prefilling(runner, rows: int) -> None:
    """Until the long prompt holds its row, then a chunk or two into its prefill."""
    deadline = time.monotonic() + 10
    while runner.num_sequences < rows and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.15)


def _release_long_then_draft_short(drafter, runner) -> tuple[int, float]:
    """Release "long", start "short" and draft it: (the long prefill's chunks that ran
    meanwhile, the seconds it took)."""
    start, chunks = time.monotonic(), runner.long_chunks[0]
    drafter.release("long")
    drafter.start("short", [5, 6, 7], SAMPLING, 2)
    (block,) = drafter.propose([ProposeRow("short", 2)])
    assert isinstance(block, DraftBlock), block
    return runner.long_chunks[0] - chunks, time.monotonic() - start


def test_a_request_released_mid_prefill_does_not_hold_up_the_next(tiny_checkpoints):
    """A long prompt's Open runs (the draft side prefills it chunk by chunk) when its
    request is cancelled or runs out of time, and a short request takes its row. Its
    Close must stop that prefill at once, not queue behind the Open on the session
    lane: the short request's first propose (which every running row of the step waits
    for) answers within about a chunk's time, not after the whole prefill, and the long
    row is freed on the draft side."""
    with _slow_prefill_drafter(tiny_checkpoints) as (runner, servicer, drafter):
        drafter.start("long", LONG_PROMPT, SAMPLING, 1)
        _prefilling(runner, 1)
        chunks, took = _release_long_then_draft_short(drafter, runner)
        # the old lane: after the whole prefill (about 28 more chunks, 2.9 s); the Close
        # behind a bare sleep(0) between chunks, about 1 s; now about 0.06 s
        assert chunks <= 2, (chunks, took)
        assert set(servicer.sessions) == {"short"}
        assert runner.num_sequences == 1


def test_a_running_rows_draft_is_served_within_a_chunk_of_a_long_prefill(tiny_checkpoints):
    """README: the draft actor prefills a new prompt in chunks and serves the running
    rows' ProposeBatch calls between them. A running row's propose during another
    request's long draft prefill answers within about a chunk's time (it took about 8
    chunks when the prefill yielded with a bare sleep(0)), and its block is valid."""
    with _slow_prefill_drafter(tiny_checkpoints) as (runner, servicer, drafter):
        drafter.start("running", [5, 6, 7], SAMPLING, 1)
        (first,) = drafter.propose([ProposeRow("running", 2)])
        assert isinstance(first, DraftBlock), first
        drafter.commit("running", first.epoch, 1, 11)
        drafter.start("long", LONG_PROMPT, SAMPLING, 2)
        _prefilling(runner, 2)
        start, chunks = time.monotonic(), runner.long_chunks[0]
        (block,) = drafter.propose([ProposeRow("running", 2)])
        took, chunks = time.monotonic() - start, runner.long_chunks[0] - chunks
        assert isinstance(block, DraftBlock), block
        # with sleep(0) between chunks: about 8 chunks (0.8-1 s)
        assert chunks <= 2, (chunks, took)
        assert "long" not in servicer.sessions  # still prefilling


def test_a_short_requests_open_does_not_wait_for_a_long_prefill(tiny_checkpoints):
    """A short request arriving behind a long prompt: its Open queued on the session
    lane behind the long one's, which lasts that whole draft prefill (about 3 s here),
    and its first propose, which every running row's step waits for, waited with it.
    Now the lane only starts an Open: the short one is answered within about a chunk,
    while the long prefill goes on; the long request then drafts too."""
    with _slow_prefill_drafter(tiny_checkpoints) as (runner, servicer, drafter):
        drafter.start("long", LONG_PROMPT, SAMPLING, 1)
        _prefilling(runner, 1)
        start, chunks = time.monotonic(), runner.long_chunks[0]
        drafter.start("short", [5, 6, 7], SAMPLING, 2)
        (block,) = drafter.propose([ProposeRow("short", 2)])
        took, chunks = time.monotonic() - start, runner.long_chunks[0] - chunks
        assert isinstance(block, DraftBlock), block
        # 0.17-0.18 s; on the old lane the whole prefill, about 28 chunks (3.3-3.4 s)
        assert chunks <= 4, (chunks, took)
        assert "long" not in servicer.sessions  # still prefilling
        (long_block,) = drafter.propose([ProposeRow("long", 2)])  # waits for its Open
        assert isinstance(long_block, DraftBlock), long_block
        assert set(servicer.sessions) == {"short", "long"}


def test_a_request_released_as_its_open_leaves_frees_its_row_within_a_chunk(tiny_checkpoints):
    """The Open runs on an opener thread: released after the opener took it but before
    it reached the draft side, the Close sent at once arrived first (a no-op), the Open
    then prefilled its whole prompt, and the lane's Close (and every Open behind it)
    waited for that. The lane now closes again until the Open has answered: on a
    one-row draft side, the next request drafts within about a chunk."""
    with _slow_prefill_drafter(tiny_checkpoints, rows=1) as (runner, servicer, drafter):
        real_open = drafter._stub.Open

        def late_open(msg, timeout=None):  # taken by its opener, on the wire 0.3 s later
            if msg.request_id == "long":
                time.sleep(0.3)
            return real_open(msg, timeout=timeout)

        drafter._stub.Open = late_open
        drafter.start("long", LONG_PROMPT, SAMPLING, 1)
        time.sleep(0.1)  # its opener has it: running, not sent
        chunks, took = _release_long_then_draft_short(drafter, runner)
        # 0.33 s (the Open's 0.3 s on the wire); without the repeated Close the whole
        # prefill, 30 chunks (3.6-3.7 s)
        assert chunks <= 3, (chunks, took)
        assert set(servicer.sessions) == {"short"}
        assert runner.num_sequences == 1


def _greedy_pair(prompts, prefix: str, max_tokens: int):
    """Two greedy cactus requests (K = 4) on the first two prompts."""
    from cactus.params import GenerationRequest, SpeculationParams

    return [
        GenerationRequest(
            prompt=prompts[i],
            request_id=f"{prefix}{i}",
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            speculation=SpeculationParams(rule="cactus", delta=1.0, num_speculative_tokens=4),
        )
        for i in range(2)
    ]


def _rank0_engine(drafter, embedded_engine):
    """Rank 0's engine in this process: the embedded verifier, `drafter`, policy fixed."""
    from workers.engine import SpeculativeEngine
    from workers.scheduler import SchedulerConfig

    return SpeculativeEngine(
        drafter,
        embedded_engine.verifier,
        embedded_engine.tokenizer,
        scheduler=SchedulerConfig(policy="fixed"),
    )


def test_rows_reopened_on_a_new_draft_actor_decode_while_it_prefills(
    embedded_engine, heldout_prompts
):
    """A new draft actor (the old one died) re-opens every running request's session
    from its whole context. The first propose after the attach waited for those Opens,
    so the whole batch stopped for the sum of their draft prefills (each at a chunk's
    pace here). The re-opened rows now decode plainly while their Opens run, the steps
    go on, and they draft again once the new actor has their context; greedy outputs
    stay the verifier's."""
    from tests.conftest import embedded_dirs

    _, draft_dir = embedded_dirs()
    vocab = embedded_engine.verifier.vocab_size

    def server_runner(slow_s: float) -> BatchRunner:
        runner = BatchRunner(draft_dir, max_num_seqs=4)
        real = runner.forward

        def forward(seq_ids, token_ids, **kw):
            if kw.get("logits") == "none":  # a prefill chunk
                time.sleep(slow_s)
            return real(seq_ids, token_ids, **kw)

        runner.forward = forward
        return runner

    first = DraftServicer(LocalDrafter(server_runner(0.0)))
    second = DraftServicer(LocalDrafter(server_runner(0.15)), prefill_chunk_tokens=8)
    reqs = _greedy_pair(heldout_prompts, "g", 48)
    solo = {r.request_id: embedded_engine.generate(r).token_ids for r in reqs}
    with _serving(first) as address, _serving(second) as new_address:
        engine = _rank0_engine(GrpcDrafter(address, vocab_size=vocab), embedded_engine)
        out: dict = {r.request_id: [] for r in reqs}
        for r in reqs:
            engine.add_request(r, out[r.request_id].append)
        steps = 0
        while steps < 4:  # both rows drafting on the first actor
            engine.step()
            steps += 1
        old = engine.drafter
        assert engine.attach_drafter(GrpcDrafter(new_address, vocab_size=vocab)) == 2
        old.close()
        while_reopening, drafted_after = 0, 0
        while engine.has_work():
            drafts = {s.id: s.stats.num_drafts for s in engine.scheduler.running}
            reopening = bool(second._opening)
            engine.step()
            steps += 1
            if reopening and second._opening:
                while_reopening += 1  # a whole step while the re-prefills ran
            for state in engine.scheduler.running:
                drafted_after += state.stats.num_drafts > drafts.get(state.id, 0)
            assert steps < 500
        engine.drafter.close()
    # each context is about 30-40 tokens: 4-5 chunks of 0.15 s, both interleaved
    assert while_reopening >= 2, while_reopening
    assert drafted_after > 0  # the rows draft again on the new actor
    for r in reqs:
        result = out[r.request_id][-1].result
        assert result.token_ids == solo[r.request_id]
        assert result.stats.draft_failures == 0


def test_a_failed_batched_forward_on_the_draft_actor_costs_one_steps_drafts(
    embedded_engine, heldout_prompts
):
    """A device error in the draft actor's batched forward failed the whole ProposeBatch
    (UNKNOWN), and rank 0 took every row of it off drafting for good. Now the draft side
    puts the rows back and answers each ABORTED; rank 0 decodes them plainly for that
    step and proposes them again at the next, over the same sessions. Greedy: the
    verifier's tokens."""
    from tests.conftest import embedded_dirs

    _, draft_dir = embedded_dirs()
    runner = BatchRunner(draft_dir, max_num_seqs=4)
    real, two_row_forwards = runner.forward, []

    def forward(seq_ids, token_ids, **kw):
        # (a first step may draft a row alone: its Open answered before the other's)
        if kw.get("logits") == "last" and len(seq_ids) == 2:
            two_row_forwards.append(1)
            if len(two_row_forwards) == 6:  # both rows' second step, its second forward
                raise RuntimeError("CUDA error: out of memory")
        return real(seq_ids, token_ids, **kw)

    runner.forward = forward
    servicer = DraftServicer(LocalDrafter(runner))
    reqs = _greedy_pair(heldout_prompts, "abort", 40)
    solo = {r.request_id: embedded_engine.generate(r).token_ids for r in reqs}
    with _serving(servicer) as address:
        drafter = GrpcDrafter(address, vocab_size=embedded_engine.verifier.vocab_size)
        engine = _rank0_engine(drafter, embedded_engine)
        out: dict = {r.request_id: [] for r in reqs}
        for r in reqs:
            engine.add_request(r, out[r.request_id].append)
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
            assert steps < 500
        until = time.monotonic() + 10  # the Closes travel on the session lane
        while servicer.sessions and time.monotonic() < until:
            time.sleep(0.01)
        drafter.close()
    assert len(two_row_forwards) > 6  # both drafted together after the failed forward
    for r in reqs:
        result = out[r.request_id][-1].result
        assert result.token_ids == solo[r.request_id]
        assert result.stats.draft_failures == 1
        assert result.stats.num_drafts >= 4, result.stats  # it drafted again
    assert not servicer.sessions and runner.num_sequences == 0
