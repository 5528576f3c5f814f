"""Ray actors: the draft actor (gRPC server) and the verifier ranks (rank 0 hosts the engine).

Actors set torch to `threads` intra-op threads and ask for fractional CPUs, so a draft
actor, two TP ranks and a Serve replica fit on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import ray

from cactus.errors import RequestCancelledError
from workers.processes import identity


def _quiet_hf() -> None:
    from cactus import environment

    environment.apply()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _whereabouts() -> dict:
    """Where an engine actor runs (its status): node, process (pid and start time, for
    workers/processes.py) and actor id. Fixed for the actor's life, so each actor reads
    it once (the supervisor probes the draft actor's status twice a second)."""
    context = ray.get_runtime_context()
    return {
        "node_id": context.get_node_id(),
        "process": identity(),
        "actor_id": context.get_actor_id(),
    }


def _threads() -> int:
    """The torch intra-op threads this thread computes with (`resources.threads_per_actor`)."""
    import torch

    return torch.get_num_threads()


@ray.remote
class DraftActor:
    """Hosts the draft model and serves the speculation service on its node's address."""

    def __init__(
        self,
        draft_dir: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        threads: int = 1,
        lease_s: float = 120.0,
        max_num_seqs: int = 32,
        key: str | None = None,
        kv_budget_tokens: int | None = None,
    ) -> None:
        """key: every call to its speculation service must carry it (the group's).
        kv_budget_tokens: its KV cache's slots, as the verifier's (batching.kv_budget_tokens:
        the sessions are the verifier's requests, with the same reservations)."""
        import torch

        _quiet_hf()
        torch.set_num_threads(threads)
        from workers.batch_runner import BatchRunner
        from workers.draft_service import DraftServicer
        from workers.local import LocalDrafter

        self.runner = BatchRunner(
            draft_dir,
            dtype=dtype,
            device=device,
            max_num_seqs=max_num_seqs,
            kv_budget_tokens=kv_budget_tokens,
        )
        self.servicer = DraftServicer(LocalDrafter(self.runner), default_lease_s=lease_s)
        self.server = None
        self.port = 0
        self._key = key
        self.whereabouts = _whereabouts()

    async def serve(self, port: int = 0) -> str:
        """Start the gRPC server (idempotent); returns host:port. It listens on this
        node's Ray address (`ray.util.get_node_ip_address()`, the interface the cluster's
        own traffic uses: 127.0.0.1 for a local head, the host's address on a multi-node
        cluster, where rank 0 may run on another node), not on every interface."""
        from workers.draft_service import host_port, start_server

        host = ray.util.get_node_ip_address()
        if self.server is None:
            self.server, self.port = await start_server(
                self.servicer, host=host, port=port, key=self._key
            )
            self._leases = asyncio.get_running_loop().create_task(self.servicer.expire_leases())
        return host_port(host, self.port)

    async def status(self) -> dict:
        return {
            **self.whereabouts,
            "threads": _threads(),  # on the event loop, where the draft model runs
            "open_sessions": len(self.servicer.sessions),
            "cached_sequences": self.runner.num_sequences,
            "vocab_size": self.runner.vocab_size,
            "blocks_proposed": self.servicer.blocks_proposed,
        }

    async def reset(self) -> int:
        """Drop every draft session (rank 0 was restarted: its requests are new ones)."""
        return await self.servicer.reset()

    async def shutdown(self) -> None:
        if self.server is not None:
            self._leases.cancel()
            await self.server.stop(grace=1.0)
            self.server = None


# Requests hold a thread of the default group (max_concurrency) for as long as they
# run; the supervisor's probe, cancels and the ingress's load questions must never queue
# behind them (a probe that times out restarts the whole group), so they have their own.
CONTROL = "control"


@ray.remote(concurrency_groups={CONTROL: 8})
class VerifierRank:
    """One tensor-parallel verifier rank. Rank 0 also runs the engine for its callers;
    `generate`, `stream`, `follow` and `logits` run in the default concurrency group,
    every short control call in its own (CONTROL)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.runner = None
        self.engine = None
        self.loop = None
        # request id -> the cancel flags of the calls running under it (a second call
        # with a running id, refused by the engine, must not unhook the first's)
        self._cancel_flags: dict[str, list[threading.Event]] = {}
        self._flags_lock = threading.Lock()  # request threads and cancels change them
        self._master_port: int | None = None  # its group's (names its shm buffers)
        self.follow_failed: str | None = None  # why this follower's loop ended early

    def pick_port(self) -> int:
        from workers.tp_verifier import free_port

        return free_port()

    def init(
        self,
        master_port: int,
        verifier_dir: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        threads: int = 1,
        shm_allreduce: bool = False,
        max_num_seqs: int = 32,
        kv_budget_tokens: int | None = None,
    ) -> dict:
        """Join the group and load the shard (blocks until every rank has joined)."""
        _quiet_hf()
        from workers.tp_verifier import init_rank

        self._master_port = master_port
        self.runner = init_rank(
            rank=self.rank,
            world_size=self.world_size,
            master_port=master_port,
            verifier_dir=verifier_dir,
            dtype=dtype,
            device=device,
            threads=threads,
            shm_allreduce=shm_allreduce,
            max_num_seqs=max_num_seqs,
            kv_budget_tokens=kv_budget_tokens,
        )
        self.whereabouts = _whereabouts()
        return {**self.status(), "vocab_size": self.runner.vocab_size}

    @ray.method(concurrency_group=CONTROL)
    def status(self) -> dict:
        return {"rank": self.rank, **self.whereabouts, "threads": _threads()}

    def follow(self) -> int:
        """Ranks >= 1: replay rank 0's cache operations until shutdown. An operation that
        raises here (and not on rank 0: an out-of-memory on one GPU) leaves rank 0
        waiting in its next collective; `ping` then fails, so the supervisor's probe
        restarts the group instead of that wait lasting the collective's timeout."""
        from workers.tp_verifier import follow

        try:
            return follow(self.runner)
        except BaseException as err:
            self.follow_failed = f"{type(err).__name__}: {err}"
            raise

    def connect(
        self,
        draft_address: str,
        *,
        limits=None,
        scheduler=None,
        timeout_s: float = 30.0,
        draft_key: str | None = None,
        lease_s: float = 120.0,
        draft_alive: bool = True,
    ) -> None:
        """Rank 0: build the engine over the draft actor and the mirrored verifier; one
        engine-loop thread steps the whole batch. `lease_s`: the draft sessions' lease
        (the group's, as the draft actor has it). `draft_alive` False (a gang restart
        while the draft actor is gone or hung): its Status is not waited for; requests
        decode without drafts until the supervisor's replacement is attached."""
        from workers.engine import SpeculativeEngine
        from workers.engine_loop import EngineLoop
        from workers.grpc_drafter import GrpcDrafter
        from workers.local import LocalVerifier
        from workers.tp_verifier import MirroredRunner, keepalive_period

        if isinstance(limits, dict):  # the operator's limits; the model adds its own
            from cactus.params import Limits

            limits = Limits(
                max_context=self.runner.max_context, vocab_size=self.runner.vocab_size, **limits
            )
        self.mirror = MirroredRunner(self.runner, self.world_size, keepalive_s=keepalive_period())
        self.drafter = GrpcDrafter(
            draft_address,
            vocab_size=self.runner.vocab_size,
            timeout_s=timeout_s,
            key=draft_key,
            lease_s=lease_s,
            check=draft_alive,
        )
        self.engine = SpeculativeEngine(
            self.drafter,
            LocalVerifier(self.mirror),
            self.runner.tokenizer,
            limits=limits,
            eos_token_id=self.runner.eos_token_ids,
            scheduler=scheduler,
        )
        from workers.engine_metrics import EngineMetrics

        self.metrics = EngineMetrics()
        self.loop = EngineLoop(self.engine, on_step=self.metrics.record)

    @ray.method(concurrency_group=CONTROL)
    def attach_draft(self, draft_address: str) -> int:
        """Rank 0: switch to a new draft actor (the old one died); the engine re-opens
        the draft sessions of its requests there. Returns how many it re-opened."""
        from workers.grpc_drafter import GrpcDrafter

        old = self.drafter
        new = GrpcDrafter(
            draft_address,
            vocab_size=self.runner.vocab_size,
            timeout_s=old.timeout_s,
            key=old.key,  # the group's, as the first drafter had it
            lease_s=old.lease_s,
        )
        # The engine takes the new drafter on its loop's thread; if the call fails here
        # (it raised, or outlasted loop.call's wait), `gate` settles whether the engine
        # switched: a call still queued then never switches, one running is waited for.
        gate, gave_up = threading.Lock(), []

        def attach(engine) -> int:
            with gate:
                if gave_up:
                    raise RuntimeError("attach_draft gave up on this call")
                return engine.attach_drafter(new)

        try:
            reopened = self.loop.call(attach)
        except BaseException:
            with gate:
                gave_up.append(True)
                switched = getattr(self.engine, "drafter", None) is new
            if switched:  # it switched, then a re-open raised: the new one is in use
                self.drafter = new
                old.close()
            else:  # never attached: the engine (and self.drafter) keep the old one
                new.close()
            raise
        self.drafter = new  # only now: timings, a later attach and shutdown use this one
        old.close()
        return reopened

    @ray.method(concurrency_group=CONTROL)
    def model_info(self) -> dict:
        r = self.runner
        return {
            "vocab_size": r.vocab_size,
            "max_context": r.max_context,
            "verifier": r.path,
            "tp_size": self.world_size,
        }

    def generate(self, request):
        with self._cancel_flag(request.request_id) as flag:
            return self.loop.generate(request, cancelled=flag.is_set)

    def stream(self, request):
        """Streaming generator (call with num_returns="streaming")."""
        with self._cancel_flag(request.request_id) as flag:
            try:
                yield from self.loop.submit(request, cancelled=flag.is_set)
            except RequestCancelledError:
                return

    @ray.method(concurrency_group=CONTROL)
    def cancel(self, request_id: str) -> None:
        """Stop a running request at its next step (no-op for an unknown id)."""
        with self._flags_lock:
            flags = list(self._cancel_flags.get(request_id, ()))
        for flag in flags:
            flag.set()

    @contextlib.contextmanager
    def _cancel_flag(self, request_id: str):
        """A per-call cancel flag; set on the way out too, so a caller that went away
        (a closed stream) stops its request instead of leaving it running."""
        flag = threading.Event()
        if request_id:
            with self._flags_lock:
                self._cancel_flags.setdefault(request_id, []).append(flag)
        try:
            yield flag
        finally:
            flag.set()
            with self._flags_lock:
                flags = self._cancel_flags.get(request_id)
                if flags is not None:
                    flags.remove(flag)
                    if not flags:
                        del self._cancel_flags[request_id]

    def logits(self, token_ids: list[int]) -> torch.Tensor:  # noqa: F821
        """Verifier logits [n, V] for a token sequence, through the sharded model. On the
        engine loop's thread, between two steps, once the engine runs: it takes a row of
        the runner, which the loop's admission must not race for (CapacityError when
        every row is in use)."""

        def run(_engine=None):
            seq = f"logits-{time.monotonic_ns()}"
            self.mirror.start(seq, len(token_ids))
            try:
                return self.mirror.forward([seq], [token_ids])[0]
            finally:
                self.mirror.release(seq)

        return run() if self.loop is None else self.loop.call(run)

    @ray.method(concurrency_group=CONTROL)
    def timings(self) -> dict:
        return {
            "broadcast_s": self.mirror.broadcast_s,
            "broadcasts": self.mirror.broadcasts,
            "rpc_s": self.drafter.rpc_s,
            "remote_draft_s": self.drafter.remote_draft_s,
            "propose_batches": self.drafter.batches,
            "prefetched_batches": self.drafter.prefetched_batches,
            **self.engine.timing.as_dict(),
            "policy": self.engine.policy.describe(),
        }

    @ray.method(concurrency_group=CONTROL)
    def load(self) -> dict:
        """Running and waiting requests of the engine (the ingress exports them)."""
        sched = self.engine.scheduler
        return {"running": sched.num_rows, "waiting": len(sched.waiting)}

    @ray.method(concurrency_group=CONTROL)
    def cache_count(self) -> int:
        return self.runner.num_sequences

    @ray.method(concurrency_group=CONTROL)
    def ping(self) -> int:
        """Fails once this rank's part of the tensor-parallel group broke: a follower's
        loop ended, or a mirrored op failed on rank 0 (MirroredRunner.failed). The
        supervisor's probe then restarts the group."""
        if self.follow_failed is not None:
            raise RuntimeError(f"rank {self.rank}: its follow loop failed ({self.follow_failed})")
        failed = getattr(getattr(self, "mirror", None), "failed", None)
        if failed is not None:
            raise RuntimeError(f"rank {self.rank}: the tensor-parallel group broke ({failed!r})")
        loop = getattr(self, "loop", None)
        if loop is not None and not loop.alive:
            # rank 0's engine loop failed (it could not end a failed step's requests) or
            # its thread is gone: nothing steps, so the group must be rebuilt
            raise RuntimeError(f"rank {self.rank}: its engine loop stopped ({loop.failed!r})")
        return self.rank

    @ray.method(concurrency_group=CONTROL)
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    @ray.method(concurrency_group=CONTROL)
    def shutdown(self) -> list[str]:
        from workers.tp_verifier import shutdown_rank

        if self.rank == 0 and self.engine is not None:
            self.loop.shutdown()
            self.mirror.stop_followers()
            self.drafter.close()
        return shutdown_rank(self.world_size, master_port=self._master_port)
