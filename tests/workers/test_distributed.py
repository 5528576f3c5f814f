"""The distributed engine on a real local Ray: draft actor + DeepSpeed AutoTP verifier
ranks exchanging draft blocks over gRPC, against the in-process engine."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import replace

import grpc
import pytest
import ray
import torch

from cactus.detokenize import encode_prompt
from cactus.errors import EngineStartError, StaleBlockError
from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
from protos.cactus.internal.v1 import speculation_pb2 as pb
from protos.cactus.internal.v1 import speculation_pb2_grpc as pb_grpc
from tests.conftest import embedded_dirs
from workers.group import ActorResources, EngineGroup, GroupConfig
from workers.grpc_drafter import GrpcDrafter, _WithKey
from workers.interfaces import ProposeRow
from workers.tp_verifier import SHM_PREFIX

pytestmark = pytest.mark.slow


def _req(prompt, rid, *, rule="cactus", delta=1.0, **sampling):
    sampling.setdefault("max_tokens", 32)
    return GenerationRequest(
        prompt=prompt,
        request_id=rid,
        sampling=SamplingParams(**sampling),
        speculation=SpeculationParams(rule=rule, delta=delta),
    )


@pytest.fixture(scope="module")
def groups(ray_session):
    verifier, draft = embedded_dirs()
    started = {
        tp: EngineGroup(
            GroupConfig(verifier, draft, tp_size=tp, speculation_policy="fixed")
        ).start()
        for tp in (1, 2)
    }
    yield started
    for group in started.values():
        group.shutdown()


def test_tp2_logits_match_the_unsharded_model(groups, embedded_engine):
    ids = embedded_engine.tokenizer.encode("def add(a, b):\n    return a + b\n\n\nclass Point:")
    sharded = ray.get(groups[2].rank0.logits.remote(ids))
    runner = embedded_engine.verifier.runner
    with torch.inference_mode():
        full = runner.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    # The two ranks' partial matmuls are summed by an all-reduce, so the float32
    # reduction order differs from the unsharded model's and the difference grows
    # through 16 layers: CI measured 1.05e-5 at logits of magnitude ~12 (about 11
    # ulps). Bound it relative to the logit scale (1e-5 of it, ~100 ulps); a wrong
    # shard or a missed all-reduce is off by O(1).
    scale = float(full.abs().max())
    assert float((sharded - full).abs().max()) < 1e-5 * max(1.0, scale)


def test_greedy_distributed_equals_in_process_and_verifier_only(
    groups, embedded_engine, heldout_prompts
):
    for i, prompt in enumerate(heldout_prompts[:8]):
        plain = embedded_engine.generate(_req(prompt, f"p{i}", rule="none", temperature=0.0))
        local = embedded_engine.generate(_req(prompt, f"l{i}", temperature=0.0))
        assert local.token_ids == plain.token_ids
        for tp, group in groups.items():
            dist = group.generate(_req(prompt, f"g{tp}-{i}", temperature=0.0))
            assert dist.token_ids == plain.token_ids, (tp, i)


@pytest.mark.parametrize("rule", ["sps", "cactus"])
def test_seeded_sampling_distributed_equals_in_process(
    groups, embedded_engine, heldout_prompts, rule
):
    for i, prompt in enumerate(heldout_prompts[8:11]):
        kw = {"temperature": 0.8, "top_k": 40, "seed": 1000 + i}
        local = embedded_engine.generate(_req(prompt, f"ls{i}", rule=rule, **kw))
        for tp, group in groups.items():
            dist = group.generate(_req(prompt, f"ds{tp}-{rule}-{i}", rule=rule, **kw))
            assert dist.token_ids == local.token_ids, (tp, i)
            assert dist.stats.num_accepted_tokens == local.stats.num_accepted_tokens


def test_logit_bias_reaches_the_draft_actor(groups, heldout_prompts, embedded_engine):
    """The draft actor gets a request's logit_bias with its session (OpenSession): with
    +100 on one token it proposes that token, and every draft is accepted (a draft
    without the bias would propose its own tokens, which the verifier rejects)."""
    tok = embedded_engine.tokenizer.encode("x", add_special_tokens=False)[0]
    req = _req(heldout_prompts[3], "bias-d", temperature=0.0, logit_bias=((tok, 100.0),))
    got = groups[1].generate(req)
    assert set(got.token_ids) == {tok}
    assert got.stats.num_draft_tokens > 0 and got.stats.draft_failures == 0
    assert got.stats.num_accepted_tokens == got.stats.num_draft_tokens
    # sampled and seeded, a bias the draft must apply as the verifier does: the tokens
    # and the acceptance are the in-process engine's
    bias = ((tok, 3.0), (tok + 1, -100.0))
    kw = {"temperature": 0.9, "seed": 77, "logit_bias": bias}
    local = embedded_engine.generate(_req(heldout_prompts[4], "bias-l", **kw))
    dist = groups[1].generate(_req(heldout_prompts[4], "bias-d2", **kw))
    assert dist.token_ids == local.token_ids and tok + 1 not in dist.token_ids
    assert dist.stats.num_accepted_tokens == local.stats.num_accepted_tokens


def test_mixed_batch_tp2_gives_each_request_its_solo_tokens(
    groups, embedded_engine, heldout_prompts
):
    """The 8 mixed requests of the in-process batch test, sent at once to one TP = 2
    rank 0: they share its steps, and each equals its solo in-process run."""
    from tests.workers.test_batched_engine import _mixed

    reqs = _mixed(heldout_prompts)
    group = groups[2]
    before = ray.get(group.rank0.timings.remote())
    together = ray.get([group.rank0.generate.remote(r) for r in reqs])
    after = ray.get(group.rank0.timings.remote())
    sizes = after["batch_sizes"]
    # (>= 5 of 8: the shortest request may end before the last calls reach rank 0)
    assert max(int(b) for b, n in sizes.items() if n > before["batch_sizes"].get(b, 0)) >= 5
    # Followers get one message per forward (a step's rollbacks and releases ride along),
    # not one per request and operation: decode steps + prefill chunks + row starts.
    steps = after["steps"] - before["steps"]
    assert after["broadcasts"] - before["broadcasts"] <= steps + 3 * len(reqs)
    for req, got in zip(reqs, together, strict=True):
        solo = embedded_engine.generate(replace(req, request_id="solo-" + req.request_id))
        assert got.token_ids == solo.token_ids, req.speculation.rule
        assert got.stats.num_accepted_tokens == solo.stats.num_accepted_tokens


def _settled_counts(group, within_s: float = 30.0) -> dict:
    """Cache counts once they are all 0, or as they are after `within_s`: rank 0 sends
    Close without waiting, and the draft actor answers it after at most one propose (a
    wide deadline: a loaded machine runs several actor processes on few cores, and a
    passing run returns as soon as the counts are 0)."""
    deadline = time.monotonic() + within_s
    counts = group.cache_counts()
    while any(counts.values()) and time.monotonic() < deadline:
        time.sleep(0.02)
        counts = group.cache_counts()
    return counts


def test_stale_or_duplicated_blocks_are_dropped(groups, embedded_engine):
    group = groups[1]
    ids = embedded_engine.tokenizer.encode("import os\n")
    client = GrpcDrafter(
        group.draft_address, vocab_size=embedded_engine.verifier.vocab_size, key=group._draft_key
    )
    channel = grpc.insecure_channel(group.draft_address)
    stub = pb_grpc.SpeculationStub(grpc.intercept_channel(channel, _WithKey(group._draft_key)))
    client.start("proto", ids, SamplingParams(temperature=1.0), seed=5)
    client.flush("proto")  # Open is sent without waiting; wait for it here
    msg = stub.Propose(pb.ProposeRequest(request_id="proto", epoch=len(ids), num_tokens=3))
    block = client.check(msg, "proto", 3)
    # The draft side refuses a second block before this one is committed, and a stale epoch.
    for epoch in (len(ids), len(ids) - 1):
        with pytest.raises(grpc.RpcError) as err:
            stub.Propose(pb.ProposeRequest(request_id="proto", epoch=epoch, num_tokens=3))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    client._sessions["proto"].pending_seq = msg.block_seq
    client.commit("proto", len(ids), 1, block.token_ids[1])
    client.flush("proto")
    committed = len(ids) + 2
    # The same commit again is acknowledged but not applied twice.
    again = stub.Commit(
        pb.CommitRequest(
            request_id="proto",
            epoch=len(ids),
            block_seq=msg.block_seq,
            num_accepted=1,
            next_token=7,
        )
    )
    assert again.committed == committed
    # Verifier side: the old block is now stale (epoch) and already applied (seq).
    with pytest.raises(StaleBlockError, match="epoch"):
        client.check(msg, "proto", 3)
    fresh = stub.Propose(pb.ProposeRequest(request_id="proto", epoch=committed, num_tokens=3))
    replay = pb.DraftBlock()
    replay.CopyFrom(fresh)
    replay.block_seq = msg.block_seq
    with pytest.raises(StaleBlockError, match="already applied"):
        client.check(replay, "proto", 3)
    bad = pb.DraftBlock()
    bad.CopyFrom(fresh)
    bad.token_ids[0] = 10**6
    with pytest.raises(StaleBlockError, match="outside"):
        client.check(bad, "proto", 3)
    assert client.check(fresh, "proto", 3).token_ids == tuple(fresh.token_ids)
    client.release("proto")
    assert _settled_counts(group)["draft"] == 0


def test_the_draft_service_takes_only_its_engines_calls(groups, embedded_engine):
    """The draft actor's service listens on its node's address: any host of the cluster
    network could open, close or draft from the sessions of other requests. Every call
    must now carry the group's key (a random one per group, given to the draft actor and
    rank 0 only); one without it, or with another, is UNAUTHENTICATED and changes
    nothing."""
    group = groups[1]
    ids = embedded_engine.tokenizer.encode("import os\n")
    sessions = _settled_counts(group)["draft_sessions"]
    for key in (None, "not-the-key"):
        channel = grpc.insecure_channel(group.draft_address)
        if key:
            channel = grpc.intercept_channel(channel, _WithKey(key))
        stub = pb_grpc.SpeculationStub(channel)
        calls = [
            (stub.Status, pb.StatusRequest()),
            (stub.Open, pb.OpenSession(request_id="intruder", prompt_token_ids=ids)),
            (stub.ProposeBatch, pb.ProposeBatchRequest()),
            (stub.Close, pb.CloseSession(request_id="intruder")),
        ]
        for method, msg in calls:
            with pytest.raises(grpc.RpcError) as err:
                method(msg, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, err.value)
    assert _settled_counts(group)["draft_sessions"] == sessions
    # the engine's own client (the group's key) is served
    client = GrpcDrafter(
        group.draft_address, vocab_size=embedded_engine.verifier.vocab_size, key=group._draft_key
    )
    try:
        assert client.status().vocab_size == embedded_engine.verifier.vocab_size
    finally:
        client.close()


def test_the_drafter_client_starts_no_thread_per_call(groups, embedded_engine, monkeypatch):
    """Open, the prefetched ProposeBatch and Close go through a few long-lived sender
    threads: grpc's `.future()` started a polling thread for nearly every call (one
    per engine step on rank 0)."""
    import threading

    started = []
    start = threading.Thread.start

    def counting_start(thread):
        started.append(thread.name)
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    group = groups[1]
    ids = embedded_engine.tokenizer.encode("import os\n")
    client = GrpcDrafter(
        group.draft_address, vocab_size=embedded_engine.verifier.vocab_size, key=group._draft_key
    )
    try:
        for i in range(12):
            rid = f"threads-{i}"
            client.start(rid, ids, SamplingParams(temperature=1.0), seed=i)
            client.flush(rid)  # Open has answered: the next prefetch sends this row
            client.prefetch([ProposeRow(rid, 2)])
            (block,) = client.propose([ProposeRow(rid, 2)])
            assert len(block.token_ids) == 2
            assert client.prefetched_batches == i + 1
            client.commit(rid, len(ids), 0, block.token_ids[0])
            client.release(rid)
        assert _settled_counts(group)["draft_sessions"] == 0  # every Close was sent
    finally:
        client.close()
    assert len(started) <= 4, started  # the sender pool, not one thread per call


def test_cancel_frees_caches_on_both_sides(groups, heldout_prompts):
    group = groups[2]
    seen = 0
    for _chunk in group.stream(
        _req(heldout_prompts[0], "cancel-me", max_tokens=200, temperature=1.0, seed=1)
    ):
        seen += 1
        if seen == 2:
            group.cancel("cancel-me")
    assert seen < 60
    assert _settled_counts(group) == {"draft": 0, "draft_sessions": 0, "rank0": 0}


def test_cancelling_one_stream_leaves_the_batch_alone(groups, embedded_engine, heldout_prompts):
    group = groups[2]
    kw = {"temperature": 0.9, "max_tokens": 48}
    keep = [_req(heldout_prompts[i], f"keep{i}", seed=60 + i, **kw) for i in range(3)]
    refs = [group.rank0.generate.remote(r) for r in keep]
    seen = 0
    for _chunk in group.stream(_req(heldout_prompts[5], "drop-me", seed=7, **kw)):
        seen += 1
        if seen == 2:
            group.cancel("drop-me")
    assert seen < 20
    for req, got in zip(keep, ray.get(refs), strict=True):
        solo = embedded_engine.generate(replace(req, request_id="solo-" + req.request_id))
        assert got.token_ids == solo.token_ids
    assert _settled_counts(group) == {"draft": 0, "draft_sessions": 0, "rank0": 0}


def test_control_calls_never_wait_behind_requests_that_hold_every_thread(
    ray_session, heldout_prompts
):
    """Rank 0's requests hold a thread each for as long as they run (max_concurrency);
    the supervisor's probe (ping), cancels and load questions have their own concurrency
    group, so a rank whose request threads are all taken still answers at once (before,
    a probe timed out there and the whole group was restarted). A call still queued
    for a thread whose caller gives up (a batch of prompts beyond max_concurrency, its
    HTTP client gone) never starts."""
    verifier, draft = embedded_dirs()
    group = EngineGroup(
        GroupConfig(
            verifier,
            draft,
            tp_size=1,
            max_concurrency=2,
            max_num_seqs=1,
            speculation_policy="fixed",
        )
    ).start()
    try:
        kw = {"rule": "none", "temperature": 0.0, "max_tokens": 900}
        holds = [
            group.rank0.generate.remote(_req(heldout_prompts[i], f"hold{i}", **kw))
            for i in range(2)
        ]
        # the third, through the engine group's asyncio API, waits in Ray's queue
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        queued = asyncio.run_coroutine_threadsafe(
            group.agenerate(_req(heldout_prompts[2], "hold2", **kw)), loop
        )
        deadline = time.monotonic() + 60
        while ray.get(group.rank0.load.remote()) != {"running": 1, "waiting": 1}:
            assert time.monotonic() < deadline, ray.get(group.rank0.load.remote())
            time.sleep(0.05)
        start = time.monotonic()
        assert ray.get(group.rank0.ping.remote(), timeout=30) == 0
        took = time.monotonic() - start
        assert not ray.wait(holds, timeout=0)[0], "a held request ended: nothing was tested"
        assert took < 10.0, took  # (waiting for a thread: until a 900-token call ends)
        queued.cancel()  # its caller gives up while it waits for a thread
        # the loop has run the cancelled call's except block (rank 0's cancel and
        # ray.cancel sent) once a later coroutine has run on it
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=10)
        time.sleep(3.0)  # ray.cancel reaches rank 0's queue before a thread is freed
        for i in range(2):
            ray.get(group.rank0.cancel.remote(f"hold{i}"), timeout=5)
        ready, _ = ray.wait(holds, num_returns=2, timeout=20)
        assert len(ready) == 2  # the running and the waiting one, cancelled at once
        time.sleep(1.5)  # the freed threads would take the queued call now
        assert ray.get(group.rank0.load.remote()) == {"running": 0, "waiting": 0}
        loop.call_soon_threadsafe(loop.stop)
    finally:
        group.shutdown()


def test_a_second_call_with_a_running_id_leaves_the_first_cancellable(groups):
    """Rank 0 refuses a call whose id is running; that call's cancel flag must not
    replace (and on its way out remove) the first call's, or the first could no longer
    be cancelled and would run to its end."""
    group = groups[1]
    req = _req("def walk(tree):", "twice", rule="none", temperature=0.0, max_tokens=900)
    first = group.rank0.generate.remote(req)
    deadline = time.monotonic() + 30
    while ray.get(group.rank0.load.remote())["running"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(ray.exceptions.RayTaskError, match="already running"):
        ray.get(group.rank0.generate.remote(req), timeout=30)
    ray.get(group.rank0.cancel.remote("twice"), timeout=5)
    ready, _ = ray.wait([first], timeout=10)
    assert ready, "the first call was not cancelled"
    assert _settled_counts(group) == {"draft": 0, "draft_sessions": 0, "rank0": 0}


def test_dead_draft_actor_degrades_every_running_request(
    ray_session, embedded_engine, heldout_prompts
):
    """Under the goodput policy (the default): k changes from step to step and the
    prefetched draft blocks keep matching it (no request degrades), greedy output is
    the verifier's, and requests that join running ones are drafted in the same
    ProposeBatch as them (one round trip per step). Then streams in flight when the
    draft actor dies finish by plain decoding: greedy output equals the verifier's, no
    token lost or repeated. The group's draft-session lease reaches both sides (rank 0
    sent 120 s in every Open whatever the group said)."""
    verifier, draft = embedded_dirs()
    group = EngineGroup(
        GroupConfig(verifier, draft, tp_size=1, rpc_timeout_s=5, lease_s=30.0)
    ).start()
    try:
        warm = [
            _req(heldout_prompts[i], f"goodput{i}", temperature=0.0, max_tokens=48)
            for i in range(4)
        ]
        before = ray.get(group.rank0.timings.remote())
        refs = []
        for r in warm:  # each joins while the earlier ones are decoding
            refs.append(group.rank0.generate.remote(r))
            time.sleep(0.4)
        results = ray.get(refs)
        after = ray.get(group.rank0.timings.remote())
        batches = after["propose_batches"] - before["propose_batches"]
        ahead = after["prefetched_batches"] - before["prefetched_batches"]
        steps = after["policy"]["steps"] - before["policy"]["steps"]
        # every step's rows in one batch, sent at the end of the step before (a row whose
        # draft-side Open has not answered by then is proposed at its step, blocking)
        # (at most one such row per joining request)
        assert batches <= steps and batches - ahead <= len(warm), (batches, ahead, steps)
        for req, result in zip(warm, results, strict=True):
            plain = replace(
                req, request_id="v-" + req.request_id, speculation=SpeculationParams(rule="none")
            )
            assert result.token_ids == embedded_engine.generate(plain).token_ids
            assert result.stats.draft_failures == 0 and result.stats.num_drafts > 0
        policy = ray.get(group.rank0.timings.remote())["policy"]
        chosen = policy["groups"]["cactus:1"]["chosen_k"]
        assert len([k for k, n in chosen.items() if n]) >= 3, chosen
        reqs = [
            # long enough to be running when the kill lands (Ray kills asynchronously)
            _req(heldout_prompts[i], f"orphan{i}", temperature=0.0, max_tokens=200)
            for i in range(3)
        ]
        streams = [group.rank0.stream.options(num_returns="streaming").remote(r) for r in reqs]
        chunks = [[ray.get(next(s))] for s in streams]  # every request is running
        deadline = time.monotonic() + 5
        while True:  # the sessions' leases on the draft side, once an Open has answered
            leases = ray.get(
                group.draft.__ray_call__.remote(
                    lambda a: sorted({s.lease_s for s in a.servicer.sessions.values()})
                )
            )
            if leases or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert leases == [30.0], leases
        assert ray.get(group.rank0.__ray_call__.remote(lambda a: a.drafter.lease_s)) == 30.0
        ray.kill(group.draft)
        for got, stream in zip(chunks, streams, strict=True):
            got.extend(ray.get(ref) for ref in stream)
        for req, got in zip(reqs, chunks, strict=True):
            result = got[-1].result
            want = embedded_engine.generate(
                replace(
                    req,
                    request_id="v-" + req.request_id,
                    speculation=SpeculationParams(rule="none"),
                )
            )
            assert result.token_ids == want.token_ids
            assert [t for c in got for t in c.token_ids] == list(result.token_ids)
            assert result.stats.draft_failures == 1
    finally:
        group.shutdown()


def test_shutdown_leaves_no_actors_or_shm(groups):
    """The module's TP = 2 group, after the traffic of the tests above (the last test
    here that uses it: it is taken out of the fixture, so a later user fails plainly)."""
    group = groups.pop(2)
    handles = [(group.draft, "status"), *[(r, "ping") for r in group.ranks]]
    assert group.healthy()
    group.shutdown()
    for actor, method in handles:  # every actor of the group is gone (ray.kill lands
        deadline = time.monotonic() + 30  # asynchronously: a call right after may still
        while True:  # be answered on a slow machine)
            try:
                ray.get(getattr(actor, method).remote(), timeout=30)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, f"{method}: an actor outlived shutdown"
            time.sleep(0.2)
    shm = os.path.dirname(SHM_PREFIX)
    assert not [n for n in os.listdir(shm) if n.startswith(os.path.basename(SHM_PREFIX))]


def _engine_actors(name: str) -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(name)
    ]


def _gone(name: str, timeout_s: float = 30.0) -> bool:
    """True once no named actor of engine `name` is left (ray.kill is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while _engine_actors(name):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_an_engine_that_cannot_be_placed_fails_naming_the_setting_and_leaves_nothing(
    ray_session,
):
    """limits.start_timeout_s bounds the start: resources the cluster lacks give an
    EngineStartError naming the setting and the bundles, and the engine's own placement
    group is removed (not left pending, holding a claim on the cluster)."""
    verifier, draft = embedded_dirs()
    rank = ActorResources(resources={"no_such_node_resource": 1.0})
    group = EngineGroup(GroupConfig(verifier, draft, tp_size=1, rank=rank, start_timeout_s=2.0))
    start = time.monotonic()
    with pytest.raises(EngineStartError) as err:
        group.start()
    took = time.monotonic() - start
    message = str(err.value)
    assert "placement group" in message and "not granted" in message, message
    assert "limits.start_timeout_s = 2 s" in message and "no_such_node_resource" in message
    assert 2.0 <= took < 20.0, took
    assert group.pg is None and group.draft is None and group.ranks == []
    wanted = [
        entry["state"]
        for entry in ray.util.placement_group_table().values()
        if any("no_such_node_resource" in b for b in entry["bundles"].values())
    ]
    assert wanted and set(wanted) == {"REMOVED"}, wanted
    assert _engine_actors(group.name) == []


def test_a_draft_actor_that_fails_beside_loading_ranks_ends_the_start_at_once(ray_session):
    """The draft actor loads while the ranks do: its failure is raised when it happens,
    not after the verifier has loaded (minutes for a large model), and a draft that
    loads leaves the ranks' wait to go on. Real Ray calls stand in for both loads."""

    @ray.remote(num_cpus=0)  # none waits for a CPU behind the others
    def load(seconds: float, fail: bool = False) -> str:
        time.sleep(seconds)
        if fail:
            raise OSError("no model in the draft folder")
        return "127.0.0.1:1"

    group = EngineGroup(GroupConfig("verifier", "draft", start_timeout_s=60.0))
    ranks = [load.remote(30.0), load.remote(30.0)]
    group._draft_serving = load.remote(0.5, fail=True)
    began = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError, match="no model in the draft folder"):
        group._unless_draft_fails(ranks)
    assert time.monotonic() - began < 15.0  # not the ranks' 30 s
    for ref in ranks:
        ray.cancel(ref, force=True)
    group._draft_serving = load.remote(0.5)
    began = time.monotonic()
    ranks = [load.remote(20.0)]
    group._unless_draft_fails(ranks)
    # it waited for the draft's load, then returned: the ranks are waited for as usual
    assert 0.4 <= time.monotonic() - began < 10.0
    ray.cancel(ranks[0], force=True)


def test_a_failed_start_stops_the_actors_it_had_started(ray_session, tmp_path):
    """The draft actor starts, then the verifier cannot load (an empty model folder):
    the error is the loader's, and the draft actor and the rank are stopped. The ranks
    start while the draft actor still loads (they waited for it: a replica started
    5-6 s slower on 2 cores)."""
    _verifier, draft = embedded_dirs()
    group = EngineGroup(GroupConfig(str(tmp_path), draft, tp_size=1, start_timeout_s=120.0))
    names, loaded = [], []
    original = group._start_ranks

    def start_ranks(**kw):
        names.extend(_engine_actors(group.name))  # what had started before the ranks
        loaded.extend(ray.wait([group._draft_serving], timeout=0)[0])
        original(**kw)

    group._start_ranks = start_ranks
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        group.start()
    assert str(tmp_path) in str(err.value) or "config" in str(err.value).lower(), err.value
    assert names == [f"{group.name}.d0-draft"], names
    assert loaded == [], "the ranks started after the draft actor had loaded"
    assert _gone(group.name), _engine_actors(group.name)
    assert group.pg is None and group.draft is None and group.ranks == []


def test_bfloat16_tp2_gives_the_in_process_bfloat16_greedy_tokens(ray_session, heldout_prompts):
    """README (models.dtype): bfloat16 runs sharded too (gloo all-reduces bfloat16 on
    CPU); float16 with tp_size > 1 on CPU is refused before anything starts, naming
    the field (DeepSpeed's CPU accelerator raises it only inside the rank's init)."""
    from workers.local import local_engine

    verifier, draft = embedded_dirs()
    with pytest.raises(ValueError, match="dtype: float16"):
        EngineGroup(GroupConfig(verifier, draft, tp_size=2, dtype="float16"))
    local = local_engine(verifier, draft, dtype="bfloat16")
    req, want = _clear_bfloat16_greedy(local, verifier, heldout_prompts)
    group = EngineGroup(
        GroupConfig(verifier, draft, tp_size=2, dtype="bfloat16", speculation_policy="fixed")
    ).start()
    try:
        got = group.generate(req)
        assert got.token_ids == want.token_ids and len(got.token_ids) == 32
    finally:
        group.shutdown()


def _clear_bfloat16_greedy(local, verifier, prompts, margin=0.25):
    """A greedy sps request whose in-process bfloat16 path has no near-tie: at each of its
    32 tokens the verifier's best logit leads the second by >= `margin` (8 bfloat16 ulps
    at logits of 4-8). Sharded, each logit is a sum of two bfloat16 halves, so where the
    two best are within rounding (one held-out prompt's first token: 5.9253 against
    5.9205 in float32, equal in bfloat16) either token is the greedy one."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.bfloat16)
    for i, prompt in enumerate(prompts):
        req = _req(prompt, f"bf16-{i}", rule="sps", delta=0.0, temperature=0.0)
        want = local.generate(replace(req, request_id=f"bf16-local-{i}"))
        ids = encode_prompt(local.tokenizer, prompt) + list(want.token_ids)
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -len(want.token_ids) - 1 : -1]
        best = logits.float().topk(2).values
        if len(want.token_ids) == 32 and (best[:, 0] - best[:, 1]).min() >= margin:
            return req, want
    raise AssertionError("no held-out prompt has a clear bfloat16 greedy path")


def test_a_gpu_rank_uses_the_one_gpu_ray_gave_it_and_deepspeeds_cuda_accelerator():
    """On CUDA each rank actor sees only its own GPU (Ray's CUDA_VISIBLE_DEVICES), so
    DeepSpeed's set_device(LOCAL_RANK) must get 0, not the rank; and DeepSpeed's
    accelerator must be CUDA although the project's environment defaults it to cpu."""
    from workers.tp_verifier import rank_environment

    gpu = rank_environment(3, 4, 29500, "cuda")
    assert gpu["LOCAL_RANK"] == "0" and gpu["RANK"] == "3" and gpu["WORLD_SIZE"] == "4"
    assert gpu["DS_ACCELERATOR"] == "cuda"
    cpu = rank_environment(3, 4, 29500, "cpu")
    assert cpu["LOCAL_RANK"] == "3" and cpu["DS_ACCELERATOR"] == "cpu"
    assert cpu["MASTER_PORT"] == "29500" and cpu["LOCAL_SIZE"] == "4"
