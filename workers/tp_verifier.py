"""The tensor-parallel verifier: tp_size Ray actors sharing one DeepSpeed AutoTP model.

Every rank loads the checkpoint and lets `deepspeed.init_inference` (AutoTP, kernel
injection off) shard it; a forward then all-reduces across ranks. Rank 0 is the only
one anybody talks to: it hosts the engine (workers/engine.py) with a GrpcDrafter for the
draft actor, and a `MirroredRunner` that broadcasts every cache operation (start,
forward, rollback, release) to the other ranks before running it itself, so all ranks
run the same forwards in the same order. The acceptance kernel runs on rank 0's device.

DeepSpeed's shared-memory all-reduce op is disabled unless asked for: on CPU it is
JIT-compiled on first use (a minute or more with g++), crashes unless LOCAL_SIZE equals
the world size, and leaves 66 MB per rank in /dev/shm. With it off, all-reduce is plain
gloo (CPU) or NCCL (GPU) and nothing is left behind in /dev/shm.
"""

from __future__ import annotations

import importlib
import os
import socket
import threading
import time
from contextlib import closing

import torch

from workers.model_runner import ModelRunner

SHM_PREFIX = "/dev/shm/deepspeed_allreduce_buffer"


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MirroredRunner:
    """A ModelRunner whose cache operations are replayed on the follower ranks."""

    def __init__(self, runner: ModelRunner, world_size: int) -> None:
        self.runner = runner
        self.world_size = world_size
        self._lock = threading.Lock()
        self.broadcast_s = 0.0

    def __getattr__(self, name):  # read-only properties: vocab_size, max_context, ...
        return getattr(self.runner, name)

    def _mirror(self, op: str, *args):
        with self._lock:
            if self.world_size > 1:
                start = time.perf_counter()
                torch.distributed.broadcast_object_list([(op, args)], src=0)
                self.broadcast_s += time.perf_counter() - start
            return getattr(self.runner, op)(*args)

    def start(self, seq_id: str) -> None:
        self._mirror("start", seq_id)

    def forward(self, seq_id: str, token_ids: list[int]) -> torch.Tensor:
        return self._mirror("forward", seq_id, list(token_ids))

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        self._mirror("rollback", seq_id, num_tokens)

    def release(self, seq_id: str) -> bool:
        return self._mirror("release", seq_id)

    def stop_followers(self) -> None:
        with self._lock:
            if self.world_size > 1:
                torch.distributed.broadcast_object_list([("stop", ())], src=0)


def follow(runner: ModelRunner) -> int:
    """Follower loop (ranks >= 1): apply rank 0's operations until told to stop."""
    applied = 0
    while True:
        box = [None]
        torch.distributed.broadcast_object_list(box, src=0)
        op, args = box[0]
        if op == "stop":
            return applied
        getattr(runner, op)(*args)
        applied += 1


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
) -> ModelRunner:
    """Join the process group and load this rank's shard of the verifier."""
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_SIZE": str(world_size),  # the shm op segfaults unless this equals the world
        }
    )
    torch.set_num_threads(threads)
    if world_size == 1:
        return ModelRunner(verifier_dir, dtype=dtype, device=device)
    import deepspeed

    if not shm_allreduce:
        # Import by string: `import deepspeed.comm.torch as x` binds the wrong module.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
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
    return ModelRunner(verifier_dir, dtype=dtype, device=device, model=engine.module)


def shutdown_rank(world_size: int, *, started_at: float) -> list[str]:
    """Leave the process group; remove DeepSpeed shm buffers created since started_at
    (only exist when the shm all-reduce was enabled). Returns the removed paths."""
    if world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    removed = []
    shm = os.path.dirname(SHM_PREFIX)
    for name in os.listdir(shm) if os.path.isdir(shm) else []:
        path = os.path.join(shm, name)
        try:
            if path.startswith(SHM_PREFIX) and os.path.getmtime(path) >= started_at:
                os.remove(path)
                removed.append(path)
        except OSError:
            pass  # another rank removed it first
    return removed
