"""workers/processes.py: the SIGKILL that ends a hung engine actor's process (the
end-to-end case, a SIGSTOPped draft actor and rank 0, is in test_recovery.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from workers.processes import _start_time, kill_processes, sigkill_if_same


def _stopped_child() -> subprocess.Popen:
    """A process that cannot act on anything asked of it: started, then SIGSTOPped."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    proc.send_signal(signal.SIGSTOP)
    return proc


def test_only_the_process_that_reported_is_killed():
    proc = _stopped_child()
    try:
        start = _start_time(proc.pid)
        assert start is not None
        # the same pid with another start time: a reused pid, left alone
        assert not sigkill_if_same(proc.pid, start + 1) and proc.poll() is None
        assert not sigkill_if_same(proc.pid, None) and proc.poll() is None
        assert sigkill_if_same(proc.pid, start)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert not sigkill_if_same(proc.pid, start)  # gone: nothing to end
    finally:
        proc.kill()
        proc.wait()


def test_kill_processes_ends_stopped_processes_on_this_node(ray_session):
    import ray

    here = ray.get_runtime_context().get_node_id()
    procs = [_stopped_child() for _ in range(2)]
    try:
        where = [(here, {"pid": p.pid, "start": _start_time(p.pid)}) for p in procs]
        where.append((None, None))  # an actor that never reported: skipped
        started = time.monotonic()
        assert kill_processes(where) == 2
        assert all(p.wait(timeout=10) == -signal.SIGKILL for p in procs)
        assert time.monotonic() - started < 10
        assert kill_processes(where) == 0  # already gone
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_kill_processes_ends_processes_of_another_node_by_a_task_pinned_there(ray_session):
    """The path for an actor on another node (a multi-node cluster): told that it runs
    elsewhere, kill_processes must not signal the processes itself but send one task,
    pinned to their node, which checks each identity there and kills."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    procs = [_stopped_child() for _ in range(2)]
    try:
        ident = [{"pid": p.pid, "start": _start_time(p.pid)} for p in procs]
        reused = {"pid": procs[0].pid, "start": ident[0]["start"] + 1}  # left alone
        where = [(node, reused), (node, ident[0]), (node, ident[1])]
        assert kill_processes(where, here="another-node") == 2
        assert all(p.wait(timeout=10) == -signal.SIGKILL for p in procs)
        assert kill_processes(where, here="another-node") == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_gang_restart_removes_the_killed_ranks_shm_buffers_and_only_theirs(
    ray_session, tmp_path, monkeypatch
):
    """With `shm_allreduce`, DeepSpeed gives each rank a shared-memory buffer (about 66
    MiB of node memory) named after its group's master port. A rank that shuts down
    removes its own; a killed one (a gang restart, a failed start) never did, so every
    restart left tp_size buffers behind for the node's life. The group now removes the
    ended ranks' buffers, on their node (here directly, elsewhere by a pinned task), and
    a rank's own shutdown removes its group's only, not another engine's on the node."""
    import ray

    from workers import tp_verifier
    from workers.group import EngineGroup, GroupConfig
    from workers.processes import remove_files
    from workers.tp_verifier import shm_prefix, shutdown_rank

    monkeypatch.setattr(tp_verifier, "SHM_PREFIX", str(tmp_path / "deepspeed_allreduce_buffer"))
    node = ray.get_runtime_context().get_node_id()

    def buffers(port, ranks=(0, 1)):
        paths = [tmp_path / f"{Path(shm_prefix(port)).name}{r}" for r in ranks]
        for path in paths:
            path.write_bytes(b"x")
        return paths

    ours, theirs = buffers(29500), buffers(29501)  # another engine's group on the node
    group = EngineGroup(GroupConfig("verifier", "draft", tp_size=2, shm_allreduce=True))
    group._shm = (29500, [node, node])
    monkeypatch.setattr(group, "_end", lambda actors, where: None)
    monkeypatch.setattr(group, "_start_ranks", lambda **_: None)
    group._restart_ranks()
    assert not any(p.exists() for p in ours) and all(p.exists() for p in theirs)
    assert group._shm is None  # the new ranks' buffers are the new start's to record
    # on another node: one task pinned to it removes them there
    again = buffers(29502)
    removed = remove_files(shm_prefix(29502), [node], here="another-node")
    assert sorted(removed) == sorted(str(p) for p in again)
    # a rank's shutdown removes its group's buffers only (it matched any buffer made
    # after the rank started, another engine's included)
    mine = buffers(29503)
    assert sorted(shutdown_rank(1, master_port=29503)) == sorted(str(p) for p in mine)
    assert all(p.exists() for p in theirs)
    assert shutdown_rank(1, master_port=None) == []


def test_the_draft_actor_gets_the_groups_kv_budget_and_key(monkeypatch):
    """configs/cluster.yaml's kv_budget_tokens bounds the draft actor's cache too (its
    sessions are the verifier's requests): the draft actor was started without it, so its
    cache could grow to max_num_seqs x the draft model's context. It also gets the key
    its service checks (the group's)."""
    import ray

    from workers import actors
    from workers.group import EngineGroup, GroupConfig

    seen = {}

    class Handle:
        class serve:
            @staticmethod
            def remote():
                return "serve"

        class status:
            @staticmethod
            def remote():
                return "status"

    def options(**kw):
        def remote(*args, **kwargs):
            seen.update(kwargs)
            return Handle()

        return type("Opts", (), {"remote": staticmethod(remote)})

    monkeypatch.setattr(actors.DraftActor, "options", options)
    answers = {"serve": "127.0.0.1:1", "status": {"node_id": "n1", "process": {"pid": 1}}}
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: answers[ref])
    group = EngineGroup(GroupConfig("verifier", "draft", kv_budget_tokens=4096))
    monkeypatch.setattr(group, "_in_bundle", lambda index: None)
    group._launch_draft()
    group._await_draft()
    assert seen["kv_budget_tokens"] == 4096 and seen["max_num_seqs"] == group.config.max_num_seqs
    assert seen["key"] == group._draft_key and len(group._draft_key) == 32
    assert group.draft_address == "127.0.0.1:1"
