"""Ending an engine actor's process for sure.

`ray.kill` asks the actor's worker to exit. A process that is stopped (SIGSTOP, a
debugger, a frozen container) or wedged never handles that request, keeps running
calls open and keeps its bundle's resources: measured here, a SIGSTOPped rank 0
outlived `ray.kill` by about five minutes, so the gang restart waited its whole
`start_timeout_s` for the bundle and the streams on the old rank stalled as long
(tests/workers/test_recovery.py, the hung-actor test). The supervisor declares such an
actor dead when it misses a probe (`recovery.probe_timeout_s`); the group then SIGKILLs
its process on its node, as a Kubernetes liveness probe ends a container that stops
answering. The process is named by its pid and its start time, so a pid the kernel has
since given to another process is left alone.
"""

from __future__ import annotations

import logging
import os
import signal

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

logger = logging.getLogger("cactus.group")


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (/proc/<pid>/stat field 22)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def identity() -> dict:
    """This process, as `kill_process` finds it again on its node."""
    pid = os.getpid()
    return {"pid": pid, "start": _start_time(pid)}


def sigkill_if_same(pid: int, start: int | None) -> bool:
    """SIGKILL `pid` if it is still the process that reported (pid, start)."""
    if start is None or _start_time(pid) != start:
        return False  # gone (or its pid reused): nothing to end
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


@ray.remote(num_cpus=0, max_retries=0)
def _sigkill_on_node(pid: int, start: int | None) -> bool:
    return sigkill_if_same(pid, start)


def kill_process(node_id: str | None, ident: dict | None, *, timeout_s: float = 30.0) -> bool:
    """SIGKILL the process `ident` (from `identity`) on node `node_id` if it still runs:
    directly when it is this node, else by a zero-CPU task pinned to its node. True
    when a process was killed; never raises."""
    if not node_id or not ident:
        return False
    try:
        if node_id == ray.get_runtime_context().get_node_id():
            return sigkill_if_same(ident["pid"], ident["start"])
        strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
        ref = _sigkill_on_node.options(scheduling_strategy=strategy).remote(
            ident["pid"], ident["start"]
        )
        return bool(ray.get(ref, timeout=timeout_s))
    except Exception:  # the node is gone with its processes, or unreachable
        logger.warning("could not end process %s on node %s", ident, node_id, exc_info=True)
        return False
