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
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

logger = logging.getLogger("cactus.group")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) from /proc/<pid>/stat (fields 3
    and 22), or None for a pid that does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (/proc/<pid>/stat field 22)."""
    stat = _stat(pid)
    return stat[1] if stat else None


def is_running(ident: dict) -> bool:
    """Whether the process `identity()` reported still exists (not a zombie): a
    stopped one counts, a pid reused by another process does not."""
    stat = _stat(ident["pid"])
    return stat is not None and stat[0] not in ("Z", "X") and stat[1] == ident["start"]


def identity() -> dict:
    """This process, as `kill_processes` finds it again on its node."""
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
def _sigkill_on_node(idents: list[dict]) -> int:
    return sum(sigkill_if_same(i["pid"], i["start"]) for i in idents)


def kill_processes(
    where: list[tuple[str | None, dict | None]],
    *,
    timeout_s: float = 30.0,
    here: str | None = None,
) -> int:
    """SIGKILL each process (node id, `identity()`) that still runs: directly on this
    node (`here`, by default this process's), else by one zero-CPU task per node,
    pinned to it, all at once. Returns how many were killed; never raises."""
    by_node: dict[str, list[dict]] = {}
    for node_id, ident in where:
        if node_id and ident:
            by_node.setdefault(node_id, []).append(ident)
    if not by_node:
        return 0
    killed, refs = 0, {}
    try:
        here = here or ray.get_runtime_context().get_node_id()
        for node_id, idents in by_node.items():
            if node_id == here:
                killed += sum(sigkill_if_same(i["pid"], i["start"]) for i in idents)
            else:
                strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
                refs[node_id] = _sigkill_on_node.options(scheduling_strategy=strategy).remote(
                    idents
                )
    except Exception:
        logger.warning("could not end processes %s", by_node, exc_info=True)
    for node_id, ref in refs.items():
        try:
            killed += ray.get(ref, timeout=timeout_s)
        except Exception:  # the node is gone with its processes, or unreachable
            logger.warning("could not end processes on node %s", node_id, exc_info=True)
    return killed


def remove_with_prefix(prefix: str) -> list[str]:
    """Remove the files whose path starts with `prefix` (on this node); returns them."""
    folder, base = os.path.split(prefix)
    removed = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.startswith(base):
            path = os.path.join(folder, name)
            try:
                os.remove(path)
                removed.append(path)
            except OSError:  # another process removed it first
                pass
    return removed


@ray.remote(num_cpus=0, max_retries=0)
def _remove_on_node(prefix: str) -> list[str]:
    return remove_with_prefix(prefix)


def remove_files(
    prefix: str, node_ids: list[str], *, timeout_s: float = 30.0, here: str | None = None
) -> list[str]:
    """`remove_with_prefix` on each node (a killed rank's shm buffers lie on its node):
    here directly, elsewhere by a zero-CPU task pinned to the node. Never raises."""
    removed, refs = [], []
    try:
        here = here or ray.get_runtime_context().get_node_id()
        for node_id in dict.fromkeys(n for n in node_ids if n):
            if node_id == here:
                removed += remove_with_prefix(prefix)
            else:
                strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
                refs.append(_remove_on_node.options(scheduling_strategy=strategy).remote(prefix))
    except Exception:
        logger.warning("could not remove %s* on nodes %s", prefix, node_ids, exc_info=True)
    deadline = time.monotonic() + timeout_s  # for all the nodes together
    for ref in refs:
        try:
            removed += ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # the node is gone (its /dev/shm with it), or slow to answer
            logger.warning("could not remove %s* on a node", prefix, exc_info=True)
    return removed
