"""The tensor-parallel verifier: tp_size Ray actors sharing one DeepSpeed AutoTP model.

Every rank loads the checkpoint and lets `deepspeed.init_inference` (AutoTP, kernel
injection off) shard it; a forward then all-reduces across ranks. Rank 0 is the only
one anybody talks to: it hosts the engine (workers/engine.py) with a GrpcDrafter for the
draft actor, and a `MirroredRunner` that broadcasts the step's cache operations (one
batched forward, with the rollbacks and releases queued since the last one) to the
other ranks before running them itself, so all ranks run the same forwards in the same
order. The acceptance kernel runs on rank 0's device.

DeepSpeed's shared-memory all-reduce op is disabled unless asked for: on CPU it is
JIT-compiled on first use (a minute or more with g++), crashes unless LOCAL_SIZE equals
the world size, and leaves 66 MB per rank in /dev/shm. With it off, all-reduce is plain
gloo (CPU) or NCCL (GPU) and nothing is left behind in /dev/shm.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import random
import socket
import threading
import time
from contextlib import closing

import torch

from cactus.errors import EngineFailedError, is_engine_failure
from workers.batch_runner import BatchRunner
from workers.processes import remove_with_prefix

SHM_PREFIX = "/dev/shm/deepspeed_allreduce_buffer"

logger = logging.getLogger("cactus.tp")


# Ports picked for a later bind come from below the kernel's ephemeral range and above
# Ray's worker ports (10002-19999 by default): a port from the ephemeral range can be
# given to any outgoing connection (Ray opens hundreds while it starts) between the pick
# and the bind, and the bind then fails ("Failed to bind to address").
PICKED_PORTS_FROM = 20000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port free now, for a server (or a rendezvous) that binds it later: chosen
    at random below the ephemeral range (above), or picked by the kernel where that
    range leaves no room below it."""
    stop = _ephemeral_start()
    if stop - PICKED_PORTS_FROM >= 1000:
        rng = random.Random()  # seeded from the OS: not the program's seeded global one
        for _ in range(64):
            port = rng.randrange(PICKED_PORTS_FROM, stop)
            with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
                try:  # every address: the server may listen on 0.0.0.0
                    sock.bind(("", port))
                except OSError:
                    continue
                return port
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# An idle rank 0's keep-alive broadcast: well inside the process group's timeout.
KEEPALIVE_S = 60.0


def keepalive_period() -> float:
    """KEEPALIVE_S, or a quarter of the group's collective timeout where that is shorter
    (DeepSpeed's, which init_distributed takes: DEEPSPEED_TIMEOUT minutes, default 10)."""
    try:
        from deepspeed.constants import default_pg_timeout
    except ImportError:  # (tests without DeepSpeed's group)
        return KEEPALIVE_S
    return min(KEEPALIVE_S, default_pg_timeout.total_seconds() / 4)


class MirroredRunner:
    """A BatchRunner whose cache operations are replayed on the follower ranks.

    Followers mirror one batched operation per step: rollbacks and releases are pure
    bookkeeping, so they are queued and travel in the same broadcast as the next
    forward (or start), which is then the only collective message of the step.

    Followers wait for rank 0 inside that collective, and a collective times out with
    its process group (DeepSpeed's default, 10 minutes): a group left idle that long
    broke, its followers' loops ended, and the next request paid a gang restart. So an
    idle rank 0 sends a keep-alive broadcast (the queued ops, often none) once no
    broadcast went out for `keepalive_s`."""

    def __init__(
        self, runner: BatchRunner, world_size: int, *, keepalive_s: float | None = KEEPALIVE_S
    ) -> None:  # keepalive_s None: no keep-alives (tests)
        self.runner = runner
        self.world_size = world_size
        self._lock = threading.Lock()
        self._queued: list[tuple] = []  # bookkeeping ops for the next broadcast
        self.broadcast_s = 0.0
        self.broadcasts = 0
        self.keepalives = 0
        self.failed: BaseException | None = None  # the group broke: nothing more runs
        # the followers have waited since they started (before rank 0 connected, which on
        # a first start waits for the draft model to load): the first tick sends one
        self._last_sent = -math.inf
        self._stopped = threading.Event()
        if world_size > 1 and keepalive_s is not None:
            threading.Thread(
                target=self._keep_alive, args=(keepalive_s,), name="tp-keepalive", daemon=True
            ).start()

    def _keep_alive(self, period_s: float) -> None:
        while not self._stopped.wait(period_s / 4):
            with self._lock:
                if self._stopped.is_set() or self.failed is not None:
                    return
                if time.monotonic() - self._last_sent < period_s:
                    continue
                try:
                    self._broadcast([])
                except Exception as err:  # the group is gone: the next op reports it
                    self.failed = err
                    logger.warning("the tensor-parallel keep-alive failed: %s", err)
                    return
                self.keepalives += 1

    def _broadcast(self, ops: list[tuple]) -> None:
        """(Under the lock.) Send the queued bookkeeping ops, then `ops`, to the
        followers."""
        ops, self._queued = [*self._queued, *ops], []
        torch.distributed.broadcast_object_list([ops], src=0)
        self._last_sent = time.monotonic()

    def _check(self) -> None:
        if self.failed is not None:
            raise EngineFailedError(f"tensor-parallel group is down: {self.failed}")

    def _broke(self, err: BaseException) -> BaseException:
        """A mirrored op failed on rank 0: the ranks are out of step from here on (the
        followers ran it, or wait in its collective), so the group is done whatever the
        cause, and `failed` makes rank 0's ping fail, so the supervisor's probe restarts
        it. What the step's requests get depends on the cause: a collective failure (a
        rank died) or an out-of-memory is EngineFailedError, so they are resumed on the
        restarted group (workers/supervisor.py); anything else (a bug) is raised as it
        is, so they end INTERNAL once instead of failing every restarted group in turn.
        (Bad arguments to a forward are refused before the broadcast: `forward`.)"""
        self.failed = err
        if is_engine_failure(err):
            return EngineFailedError(f"tensor-parallel group failed: {type(err).__name__}: {err}")
        logger.error("a mirrored operation failed on rank 0", exc_info=err)
        if isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower():
            return EngineFailedError(f"tensor-parallel group failed: {type(err).__name__}: {err}")
        return err

    def __getattr__(self, name):  # read-only properties: vocab_size, max_context, ...
        return getattr(self.runner, name)

    def _mirror(self, op: str, *args, refuse=None, **kwargs):
        """Broadcast `op` to the followers, then run it here. `refuse()`, under the same
        lock, raises first what the op would raise here: a follower whose op raises ends
        its loop, and with it the group."""
        with self._lock:
            if self.world_size == 1:
                return getattr(self.runner, op)(*args, **kwargs)
            self._check()
            if refuse is not None:
                refuse()
            try:
                start = time.perf_counter()
                self._broadcast([(op, args, kwargs)])
                self.broadcast_s += time.perf_counter() - start
                self.broadcasts += 1  # (the step's own: keep-alives are counted apart)
                return getattr(self.runner, op)(*args, **kwargs)
            except Exception as err:
                broken = self._broke(err)
                if broken is err:
                    raise
                raise broken from err

    def _later(self, op: str, *args):
        """Apply a bookkeeping op here now; followers get it with the next broadcast."""
        with self._lock:
            result = getattr(self.runner, op)(*args)
            if self.world_size > 1:
                self._queued.append((op, args, {}))
            return result

    def start(self, seq_id: str, reserve_tokens: int | None = None) -> None:
        # a reserve that does not fit (CapacityError) or is bad (ValueError) is refused
        # here, before any follower sees it
        self._mirror(
            "start",
            seq_id,
            reserve_tokens,
            refuse=lambda: self.runner.check_start(seq_id, reserve_tokens),
        )

    def forward(self, seq_ids, token_ids, *, logits: str = "all") -> list[torch.Tensor]:
        seq_ids, token_ids = list(seq_ids), [list(t) for t in token_ids]
        # bad arguments raise here, before any follower sees them
        return self._mirror(
            "forward",
            seq_ids,
            token_ids,
            logits=logits,
            refuse=lambda: self.runner._rows_for(seq_ids, token_ids, logits),
        )

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        self._later("rollback", seq_id, num_tokens)

    def release(self, seq_id: str) -> bool:
        return self._later("release", seq_id)

    def stop_followers(self) -> None:
        self._stopped.set()
        with self._lock:
            if self.world_size > 1 and self.failed is None:
                torch.distributed.broadcast_object_list([[("stop", (), {})]], src=0)


def follow(runner: BatchRunner) -> int:
    """Follower loop (ranks >= 1): apply rank 0's operations until told to stop."""
    applied = 0
    while True:
        box = [None]
        torch.distributed.broadcast_object_list(box, src=0)
        for op, args, kwargs in box[0]:
            if op == "stop":
                return applied
            getattr(runner, op)(*args, **kwargs)
            applied += 1


def rank_environment(rank: int, world_size: int, master_port: int, device: str) -> dict:
    """The variables torch.distributed and DeepSpeed read in a rank's process.

    On CUDA, Ray gives each rank actor its own GPU (with TP > 1 the config requires
    whole `resources.verifier_rank.num_gpus`) and hides the others (CUDA_VISIBLE_DEVICES), so the
    rank's device is index 0 of what it sees: DeepSpeed calls
    `torch.cuda.set_device(LOCAL_RANK)`, and LOCAL_RANK = rank would name a GPU the
    actor cannot see. DeepSpeed's accelerator follows the device: the environment's
    default is `cpu` (cactus.environment), which on a GPU rank would leave the shard on
    the CPU and give NCCL CPU tensors."""
    cuda = device.startswith("cuda")
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0" if cuda else str(rank),
        "LOCAL_SIZE": str(world_size),  # the shm op segfaults unless this equals the world
        "DS_ACCELERATOR": "cuda" if cuda else "cpu",  # read at DeepSpeed's first import
    }


def init_rank(
    *,
    rank: int,
    world_size: int,
    master_port: int,
    verifier_dir: str,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int = 1,
    shm_allreduce: bool = False,
    max_num_seqs: int = 32,
    kv_budget_tokens: int | None = None,
) -> BatchRunner:
    """Join the process group and load this rank's shard of the verifier."""
    os.environ.update(rank_environment(rank, world_size, master_port, device))
    torch.set_num_threads(threads)
    rows = {"max_num_seqs": max_num_seqs, "kv_budget_tokens": kv_budget_tokens}
    if world_size == 1:
        return BatchRunner(verifier_dir, dtype=dtype, device=device, **rows)
    import deepspeed

    if not shm_allreduce:
        # Import by string: `import deepspeed.comm.torch as x` binds the wrong module.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if device.startswith("cuda"):
        torch.cuda.set_device(0)  # the one GPU Ray gave this actor (rank_environment)
    deepspeed.init_distributed(dist_backend="nccl" if device.startswith("cuda") else "gloo")
    from transformers import AutoModelForCausalLM

    from workers.model_runner import DTYPES

    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=DTYPES[dtype])
    engine = deepspeed.init_inference(
        model,
        tensor_parallel={"tp_size": world_size},
        dtype=DTYPES[dtype],
        replace_with_kernel_inject=False,
    )
    return BatchRunner(verifier_dir, dtype=dtype, device=device, model=engine.module, **rows)


def shm_prefix(master_port: int) -> str:
    """The path prefix of one tensor-parallel group's DeepSpeed shm buffers: DeepSpeed
    names them `<SHM_PREFIX>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>` (its shm.cpp),
    and every group has its own master port (rank_environment)."""
    return f"{SHM_PREFIX}_{os.getuid()}_127.0.0.1_{master_port}_"


def shutdown_rank(world_size: int, *, master_port: int | None) -> list[str]:
    """Leave the process group; remove this group's DeepSpeed shm buffers (they exist
    only when the shm all-reduce was enabled), and only this group's: another engine's
    on the same node keeps its own. Returns the removed paths."""
    if world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if master_port is None:  # never joined a group
        return []
    return remove_with_prefix(shm_prefix(master_port))
