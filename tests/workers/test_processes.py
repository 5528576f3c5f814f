"""workers/processes.py: the SIGKILL that ends a hung engine actor's process (the
end-to-end case, a SIGSTOPped draft actor and rank 0, is in test_recovery.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

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
