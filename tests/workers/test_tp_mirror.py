"""Rank 0's side of a tensor-parallel group without a cluster: MirroredRunner over a fake
runner (the broadcast patched out), and VerifierRank's own methods called on the plain
class (Ray's actor wrapper left out). A mirrored op that fails on rank 0 alone breaks
the group: rank 0's ping fails (its probe restarts the group); the step's requests get
EngineFailedError (the supervisor resumes them) for an out-of-memory, the error itself
for a bug (they end once, not on every restarted group). Bad arguments are refused
before the broadcast and break nothing. Switching to a new draft actor
keeps the drafter the engine actually uses."""

from __future__ import annotations

import queue
import sys
import time
import types
from typing import ClassVar

import pytest
import torch

from cactus.errors import EngineFailedError, is_engine_failure
from workers import tp_verifier
from workers.actors import VerifierRank
from workers.tp_verifier import MirroredRunner


class _Runner:
    """A BatchRunner's mirrored surface; forward fails as an out-of-memory on rank 0's
    GPU does (no collective is involved: no marker of one in the message)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.ops: list[str] = []

    def start(self, seq_id, reserve_tokens=None) -> None:
        self.ops.append("start")

    def check_start(self, seq_id, reserve_tokens=None):  # BatchRunner's: it fits
        return reserve_tokens, None

    def _rows_for(self, seq_ids, token_ids, logits):  # BatchRunner's argument check
        if any(s != "a" for s in seq_ids):
            raise KeyError(seq_ids)
        return [0] * len(seq_ids)

    def forward(self, seq_ids, token_ids, *, logits="all"):
        self.ops.append("forward")
        raise self.error

    def rollback(self, seq_id, num_tokens) -> None:
        self.ops.append("rollback")

    def release(self, seq_id) -> bool:
        self.ops.append("release")
        return True


@pytest.fixture
def broadcasts(monkeypatch):
    sent: list = []
    monkeypatch.setattr(
        tp_verifier.torch.distributed,
        "broadcast_object_list",
        lambda objects, src=0: sent.append(objects[0]),
    )
    return sent


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ],
    ids=["RuntimeError", "OutOfMemoryError"],
)
def test_a_rank0_only_failure_after_the_broadcast_fails_the_group(broadcasts, error):
    assert not is_engine_failure(error)  # by itself it does not read as a dead engine
    runner = _Runner(error)
    mirror = MirroredRunner(runner, world_size=2, keepalive_s=None)
    mirror.start("a", 4)
    with pytest.raises(EngineFailedError, match="out of memory") as raised:
        mirror.forward(["a"], [[1, 2]])
    assert is_engine_failure(raised.value)  # the supervisor restarts and resumes
    assert raised.value.__cause__ is error  # what happened stays in the traceback
    assert mirror.failed is error
    assert [ops[-1][0] for ops in broadcasts] == ["start", "forward"]  # followers ran it
    # the ranks are out of step: nothing more runs or is broadcast
    with pytest.raises(EngineFailedError):
        mirror.start("b", 4)
    assert runner.ops == ["start", "forward"] and len(broadcasts) == 2
    mirror.stop_followers()  # no stop message to a broken group
    assert len(broadcasts) == 2


def test_a_bug_after_the_broadcast_fails_the_group_but_not_every_restart(broadcasts):
    """Not a collective failure, not out of memory: the step's requests get the error
    itself (INTERNAL, not resumed onto the next group to fail it again), and the group
    is still done (the next op raises EngineFailedError, the ping fails)."""
    error = ValueError("a bookkeeping bug")
    runner = _Runner(error)
    mirror = MirroredRunner(runner, world_size=2, keepalive_s=None)
    mirror.start("a", 4)
    with pytest.raises(ValueError, match="bookkeeping bug") as raised:
        mirror.forward(["a"], [[1, 2]])
    assert raised.value is error and mirror.failed is error
    with pytest.raises(EngineFailedError):
        mirror.forward(["a"], [[3]])


def test_bad_forward_arguments_are_refused_before_the_broadcast(broadcasts):
    """An unknown sequence raises on rank 0 before the followers see the op (they would
    raise too, and leave the group), so the group goes on."""
    runner = _Runner(RuntimeError("unused"))
    mirror = MirroredRunner(runner, world_size=2, keepalive_s=None)
    mirror.start("a", 4)
    with pytest.raises(KeyError):
        mirror.forward(["nobody"], [[1]])
    assert mirror.failed is None and len(broadcasts) == 1
    mirror.release("a")
    mirror.start("a", 4)  # the group still works, the queued release travels with it
    assert [op[0] for op in broadcasts[-1]] == ["release", "start"]


def test_a_start_that_does_not_fit_is_refused_before_the_broadcast(broadcasts, tiny_checkpoints):
    """A start rank 0 refuses (no row left, or a bad reserve) used to be broadcast
    first: each follower's start raised too and ended its loop, and the group was
    broken for every request. It is refused before any follower sees it."""
    from workers.batch_runner import BatchRunner, CapacityError

    runner = BatchRunner(str(tiny_checkpoints["llama"]), max_num_seqs=1)
    mirror = MirroredRunner(runner, 2, keepalive_s=None)
    mirror.start("a", 8)
    with pytest.raises(CapacityError, match="cannot admit 'b'"):
        mirror.start("b", 8)
    with pytest.raises(ValueError, match="reserve_tokens=0"):
        mirror.start("c", 0)
    assert mirror.failed is None and len(broadcasts) == 1
    mirror.start("a", 8)  # a start that replaces its own row still fits
    assert mirror.failed is None and len(broadcasts) == 2


def _rank0(mirror=None) -> VerifierRank:
    rank = VerifierRank.__ray_actor_class__(0, 2)  # the plain class: no Ray actor
    if mirror is not None:
        rank.mirror = mirror
    return rank


def test_rank0s_ping_fails_once_its_mirror_is_broken(broadcasts):
    mirror = MirroredRunner(
        _Runner(RuntimeError("CUDA out of memory")), world_size=2, keepalive_s=None
    )
    rank = _rank0(mirror)
    assert rank.ping() == 0
    with pytest.raises(Exception, match="out of memory"):  # old code: the raw error
        mirror.forward(["a"], [[1]])
    assert mirror.failed is not None
    with pytest.raises(RuntimeError, match="tensor-parallel group broke"):
        rank.ping()
    assert _rank0().ping() == 0  # a rank before connect (no mirror) answers


# ---- attach_draft ---------------------------------------------------------------------


class _Drafter:
    made: ClassVar[list[_Drafter]] = []

    def __init__(
        self,
        address: str,
        *,
        vocab_size: int = 8,
        timeout_s: float = 5.0,
        key=None,
        lease_s: float = 120.0,
    ) -> None:
        self.address, self.timeout_s, self.closed = address, timeout_s, False
        self.key = key  # the draft service's (the group's): a new drafter keeps it
        self.lease_s = lease_s  # the group's draft-session lease: kept too
        _Drafter.made.append(self)

    def close(self) -> None:
        self.closed = True


class _Engine:
    def __init__(self, drafter, fail_after_switch: bool = False) -> None:
        self.drafter, self.fail_after_switch = drafter, fail_after_switch

    def attach_drafter(self, drafter) -> int:
        self.drafter = drafter
        if self.fail_after_switch:
            raise RuntimeError("re-opening a session failed")
        return 3


class _Loop:
    """EngineLoop.call: `mode` "run" runs fn, "stopped" refuses it, "timeout" keeps it
    queued (run later by the test) and gives up waiting, as loop.call's timeout does."""

    def __init__(self, engine, mode: str) -> None:
        self.engine, self.mode, self.queued = engine, mode, []

    def call(self, fn):
        if self.mode == "stopped":
            from workers.engine_loop import EngineLoopStopped

            raise EngineLoopStopped("the engine loop is shut down")
        if self.mode == "timeout":
            self.queued.append(fn)
            raise queue.Empty
        return fn(self.engine)


@pytest.fixture
def fake_grpc_drafter(monkeypatch):
    module = types.ModuleType("workers.grpc_drafter")
    module.GrpcDrafter = _Drafter
    monkeypatch.setitem(sys.modules, "workers.grpc_drafter", module)


def _attaching(mode: str, fail_after_switch: bool = False):
    rank = _rank0()
    rank.runner = types.SimpleNamespace(vocab_size=8)
    old = rank.drafter = _Drafter("old:1", key="group-key", lease_s=30.0)
    rank.engine = _Engine(old, fail_after_switch)
    rank.loop = _Loop(rank.engine, mode)
    return rank, old


def test_attach_draft_switches_only_once_the_engine_did(fake_grpc_drafter):
    rank, old = _attaching("run")
    assert rank.attach_draft("new:2") == 3
    assert rank.drafter is rank.engine.drafter and rank.drafter.address == "new:2"
    assert old.closed and not rank.drafter.closed and rank.drafter.timeout_s == 5.0
    assert rank.drafter.key == "group-key"  # the new draft actor checks the group's key
    assert rank.drafter.lease_s == 30.0  # and its sessions get the group's lease

    # the engine loop refused the call: the old drafter stays, the new one is closed
    rank, old = _attaching("stopped")
    from workers.engine_loop import EngineLoopStopped

    with pytest.raises(EngineLoopStopped, match="shut down"):
        rank.attach_draft("new:2")
    assert rank.drafter is old and rank.engine.drafter is old and not old.closed
    assert _Drafter.made[-1].address == "new:2" and _Drafter.made[-1].closed

    # the engine switched, then re-opening a session raised: the new one is in use
    rank, old = _attaching("run", fail_after_switch=True)
    with pytest.raises(RuntimeError, match="re-opening"):
        rank.attach_draft("new:2")
    assert rank.drafter is rank.engine.drafter and rank.drafter.address == "new:2"
    assert old.closed and not rank.drafter.closed


def test_attach_draft_that_timed_out_never_switches_later(fake_grpc_drafter):
    rank, old = _attaching("timeout")
    with pytest.raises(queue.Empty):
        rank.attach_draft("new:2")
    assert rank.drafter is old and not old.closed and _Drafter.made[-1].closed
    (late,) = rank.loop.queued
    with pytest.raises(RuntimeError, match="gave up"):  # the loop runs it afterwards
        late(rank.engine)
    assert rank.engine.drafter is old  # still the drafter the actor holds and closes


class _Recording:
    """A follower's (and rank 0's) runner that records the ops it is given."""

    def __init__(self) -> None:
        self.ops: list = []

    def start(self, seq_id, reserve_tokens=None) -> None:
        self.ops.append(("start", seq_id))

    def check_start(self, seq_id, reserve_tokens=None):
        return reserve_tokens, None


def _gloo_rank(rank: int, port: int, keepalive_s, idle_s: float, ready, out) -> None:
    """One rank of a real two-process gloo group whose collectives time out after 3 s
    (the production group's timeout is DeepSpeed's 10 minutes): rank 0 idles idle_s,
    then mirrors one start and stops the follower; each reports (rank, outcome, detail)
    to `out`, the outcome naming the phase that failed. Both ranks join the group
    together (`ready`, a barrier past their imports), so the 3 s is all the wait's."""
    import datetime

    import torch.distributed as dist

    from workers.tp_verifier import MirroredRunner, follow

    try:
        ready.wait(60)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=3),
        )
    except Exception as err:  # reported to the test
        out.put((rank, "init failed", f"{type(err).__name__}: {err}"[:300]))
        return
    runner = _Recording()
    try:
        if rank == 0:
            mirror = MirroredRunner(runner, 2, keepalive_s=keepalive_s)
            time.sleep(idle_s)
            mirror.start("a", 4)
            mirror.stop_followers()
            out.put((0, "ok", mirror.keepalives))
        else:
            follow(runner)
            out.put((1, "ok", runner.ops))
    except Exception as err:  # reported to the test
        out.put((rank, "failed", f"{type(err).__name__}: {err}"[:300]))


def _idle_group(keepalive_s) -> dict:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Barrier(2)
    port = tp_verifier.free_port()
    procs = [
        ctx.Process(target=_gloo_rank, args=(rank, port, keepalive_s, 5.0, ready, out), daemon=True)
        for rank in (0, 1)
    ]
    for p in procs:
        p.start()
    seen: dict = {}
    try:
        while len(seen) < 2:
            rank, status, detail = out.get(timeout=60)
            seen[rank] = (status, detail)
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return seen


def test_an_idle_tensor_parallel_group_outlives_its_collective_timeout():
    """Followers wait for rank 0's next op inside a broadcast, which times out with the
    process group: a group idle for longer (10 minutes in production) broke, and the
    next request paid a gang restart. rank 0's keep-alive broadcasts keep it whole: after
    5 s idle against a 3 s timeout the follower still applies rank 0's next op. Without
    them (the control) the follower's wait times out."""
    kept = _idle_group(keepalive_s=0.5)
    assert kept.get(1) == ("ok", [("start", "a")]), kept
    assert kept[0][0] == "ok" and kept[0][1] >= 4, kept  # keep-alives sent while idle
    control = _idle_group(keepalive_s=None)
    # the follower's wait in follow() timed out (gloo: "Timed out waiting ... for recv")
    assert control.get(1, ("none",))[0] == "failed", control
    assert "timed out" in control[1][1].lower(), control
