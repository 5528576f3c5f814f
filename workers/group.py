"""Start, health-check and shut down one distributed engine on a Ray cluster.

One engine = a draft actor + tp_size verifier ranks, in two bundles of one placement
group (engine_bundles): every rank in one bundle, which always lies on one node (tensor
parallelism wants one node) whatever the group's strategy (PACK for a group the engine
makes itself, the operator's for a Serve replica's); the draft actor's bundle is sized
by its own resources, which may name a custom resource to put it on another node.
Callers talk to rank 0: `generate`, `stream`, `cancel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cactus.errors import EngineStartError, RequestCancelledError
from workers.processes import kill_processes
from workers.scheduler import SchedulerConfig

logger = logging.getLogger("cactus.group")

NAMESPACE = "cactus"


def engine_cache_counts() -> dict[str, dict]:
    """Cache counts of every engine on the connected cluster, by engine name."""
    out: dict[str, dict] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, ns = entry["name"], entry["namespace"]
        if ns != NAMESPACE or not name.startswith("engine-"):
            continue
        engine, role = name.rsplit("-", 1)
        engine = engine.split(".")[0]  # engine-<id>.d<n> / .r<n>: restarted actors
        actor = ray.get_actor(name, namespace=NAMESPACE)
        if role == "draft":
            status = ray.get(actor.status.remote(), timeout=30)
            out.setdefault(engine, {})["draft"] = status["cached_sequences"]
            out[engine]["draft_sessions"] = status["open_sessions"]
        elif role == "rank0":
            out.setdefault(engine, {})["rank0"] = ray.get(actor.cache_count.remote(), timeout=30)
    return out


@dataclass(frozen=True)
class ActorResources:
    num_cpus: float = 0.25
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom resources

    def bundle(self) -> dict[str, float]:
        out = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            out["GPU"] = self.num_gpus
        return out


@dataclass(frozen=True)
class GroupConfig:
    verifier_dir: str
    draft_dir: str
    tp_size: int = 1
    dtype: str = "float32"
    device: str = "cpu"  # "cuda" on GPU nodes (nccl)
    threads: int = 1  # torch intra-op threads per actor
    draft: ActorResources = field(default_factory=ActorResources)
    rank: ActorResources = field(default_factory=ActorResources)
    shm_allreduce: bool = False  # DeepSpeed's shared-memory all-reduce (see tp_verifier)
    lease_s: float = 120.0
    rpc_timeout_s: float = 30.0
    # an actor that does not answer a control call (the draft actor's reset in a gang
    # restart, rank 0's ping) this long is dead or hung: the supervisor's probe timeout
    probe_timeout_s: float = 10.0
    start_timeout_s: float = 300.0
    max_concurrency: int = 64  # calls rank 0 takes at once (running + waiting requests)
    max_num_seqs: int = 32  # rows in the batch (see workers/scheduler.py)
    max_num_batched_tokens: int = 512  # tokens per step, decode first, then prompt chunks
    batch_wait_ms: float = 2.0  # an idle engine's wait for further arrivals (engine_loop)
    kv_budget_tokens: int | None = None  # verifier KV slots (None: max_num_seqs * context)
    speculation_policy: str = "goodput"  # fixed | goodput (workers/policy.py)


def engine_bundles(config: GroupConfig) -> list[dict[str, float]]:
    """The engine's share of a placement group, derived here only: bundle 0 the draft
    actor, bundle 1 every verifier rank together (tp_size x the rank's resources). One
    bundle always lies on one node, so the ranks share a node whatever the group's
    strategy, while the draft actor's bundle may land on another (a custom resource)."""
    ranks: dict[str, float] = {}
    for key, value in config.rank.bundle().items():
        ranks[key] = value * config.tp_size
    return [config.draft.bundle(), ranks]


class EngineGroup:
    """`placement_group`: the group to start in (a Serve replica's): the draft actor
    takes bundle `first_bundle`, every rank bundle first_bundle + 1 (engine_bundles).
    Without one the engine makes its own with the same two bundles (PACK). Nothing is
    reserved twice, and a restarted actor goes back into its own bundle."""

    def __init__(
        self, config: GroupConfig, *, limits=None, placement_group=None, first_bundle: int = 0
    ) -> None:
        if config.tp_size < 1:
            raise ValueError(f"tp_size: must be >= 1, got {config.tp_size}")
        if config.dtype == "float16" and config.device == "cpu" and config.tp_size > 1:
            raise ValueError(
                "dtype: float16 tensor parallelism is not supported on CPU (DeepSpeed's CPU "
                "accelerator refuses it); use bfloat16 or float32, or tp_size 1"
            )
        self.config = config
        self.limits = limits
        self.draft = None
        self.ranks: list = []
        self.pg = placement_group
        self.own_pg = placement_group is None
        self.first_bundle = 0 if placement_group is None else first_bundle
        # Named (namespace "cactus") so operators and tests can find an engine's actors.
        self.name = f"engine-{uuid.uuid4().hex[:8]}"
        # the draft service's key: only this group's rank 0 may call its draft actor
        # (the service listens on the node's address; workers/draft_service.py)
        self._draft_key = secrets.token_hex(16)
        self.followers: list = []
        self.draft_address = ""
        self._draft_serving = None  # the new draft actor's serve() call (_launch_draft)
        self._loading_draft = None  # a replacement draft actor still loading (replace_draft)
        # the rank generation whose rank 0 drafts with `draft` (None: none does yet), and
        # whether a replacement's attach failed with rank 0 silent (the next replace_draft
        # only attaches, unless a gang restart connected the new ranks to it meanwhile)
        self._draft_user: int | None = None
        self._attach_owed = False
        # the rank generation whose ranks started and whose rank 0 connected (None: a
        # gang restart has not finished): only such a rank 0 can attach a draft actor
        self._ranks_ready: int | None = 0
        self.placement: dict = {}
        # request id -> its calls to rank 0 in flight (refs): `cancel` drops one still
        # queued for a rank-0 thread, which rank 0's cancel flag cannot reach
        self._calls: dict[str, list] = {}
        # "draft" / "ranks": [(node id, process identity)] of their actors, for _end
        self._processes: dict = {}
        # replace_draft, restart_ranks (the supervisor's threads) and shutdown: one at a time
        self._restarting = threading.Lock()
        self.closed = False  # shut down: restarts and replacements are refused
        self._shut_without_lock = False  # shutdown gave up waiting for a restart
        # (master port, rank nodes) of the ranks' DeepSpeed shm buffers (shm_allreduce):
        # a killed rank never removes its own, so the group does once they are ended
        self._shm: tuple[int, list[str]] | None = None
        self.rank_generation = 0  # bumped by every gang restart of the ranks
        self.draft_generation = 0  # bumped by every replacement of the draft actor

    def _in_bundle(self, offset: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=self.first_bundle + offset
        )

    def start(self) -> EngineGroup:
        """Create the actors, join the TP group, connect rank 0 to the draft actor. If
        any of it fails or outlasts limits.start_timeout_s, what had started is stopped
        (actors, processes, an own placement group) before the error is raised: a
        caller that gives up or tries again leaks nothing."""
        try:
            if self.pg is None:
                self.pg = placement_group(engine_bundles(self.config), strategy="PACK")
            self._wait(
                self.pg.ready(),
                f"the engine's placement group {engine_bundles(self.config)} was not granted",
                lambda: f"; free on the cluster now: {ray.available_resources()}",
            )
            # The draft actor loads while the ranks start and load: each is a process
            # start, imports and a model load (5-6 s apiece on 2 cores), which ran one
            # after the other; rank 0 needs the draft's address only to connect.
            self._launch_draft()
            self._start_ranks(draft_loading=True)
            self._ranks_ready = self._draft_user = self.rank_generation
        except BaseException:
            self._abandon()
            raise
        return self

    def _wait(self, refs, what: str, more=lambda: "", since: float | None = None):
        """ray.get within start_timeout_s (counted from `since`, a monotonic time, when
        given); a timeout is an EngineStartError saying what did not happen in time and
        which setting bounds it."""
        timeout = self.config.start_timeout_s
        if since is not None:
            timeout = max(timeout - (time.monotonic() - since), 0.0)
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            raise EngineStartError(
                f"{what} within limits.start_timeout_s = {timeout:g} s{more()}"
            ) from None

    def _abandon(self) -> None:
        """Stop whatever a failed start had started."""
        actors = [a for a in (*self.ranks, self.draft) if a is not None]
        where = [p for procs in self._processes.values() for p in procs]
        with contextlib.suppress(Exception):
            self._end(actors, where)
        with contextlib.suppress(Exception):
            self._remove_shm()
        if self.pg is not None and self.own_pg:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None
        self.ranks, self.followers, self.draft, self._processes = [], [], None, {}

    def _launch_draft(self) -> None:
        """Create the draft actor; `_await_draft` waits for it to load."""
        from workers.actors import DraftActor

        c = self.config
        self.draft = DraftActor.options(
            name=f"{self.name}.d{self.draft_generation}-draft",
            namespace=NAMESPACE,
            num_cpus=c.draft.num_cpus,
            num_gpus=c.draft.num_gpus,
            resources=c.draft.resources or None,
            scheduling_strategy=self._in_bundle(0),
        ).remote(
            c.draft_dir,
            dtype=c.dtype,
            device=c.device,
            threads=c.threads,
            lease_s=c.lease_s,
            max_num_seqs=c.max_num_seqs,
            key=self._draft_key,
            kv_budget_tokens=c.kv_budget_tokens,
        )
        self._draft_serving = self.draft.serve.remote()
        self._draft_launched = time.monotonic()

    def _await_draft(self) -> None:
        self.draft_address = self._wait(
            self._draft_serving, "the draft actor did not load", since=self._draft_launched
        )
        status = self._wait(self.draft.status.remote(), "the draft actor did not answer")
        self.placement["draft"] = status["node_id"]
        self._processes["draft"] = [(status["node_id"], status["process"])]

    def _start_ranks(self, draft_alive: bool = True, draft_loading: bool = False) -> None:
        """`draft_alive` False: rank 0 does not wait for the draft actor's Status (it
        is gone; the supervisor attaches its replacement). `draft_loading`: the draft
        actor was just launched (a first start) and loads beside the ranks; a failure
        of it ends the start at once, and rank 0 connects once it has loaded."""
        from workers.actors import VerifierRank

        c = self.config
        self.ranks = [
            VerifierRank.options(
                name=f"{self.name}.r{self.rank_generation}-rank{i}",
                namespace=NAMESPACE,
                num_cpus=c.rank.num_cpus,
                num_gpus=c.rank.num_gpus,
                resources=c.rank.resources or None,
                max_concurrency=c.max_concurrency,
                scheduling_strategy=self._in_bundle(1),
            ).remote(i, c.tp_size)
            for i in range(c.tp_size)
        ]
        port = self._wait(self.ranks[0].pick_port.remote(), "verifier rank 0 did not start")
        if c.shm_allreduce and c.tp_size > 1:  # known before the ranks make the buffers,
            # so a start that fails half way removes them too (_abandon)
            nodes = self._wait([r.node_id.remote() for r in self.ranks], "a rank did not start")
            self._shm = (port, nodes)
        began = time.monotonic()
        loading = [
            r.init.remote(
                port,
                c.verifier_dir,
                dtype=c.dtype,
                device=c.device,
                threads=c.threads,
                shm_allreduce=c.shm_allreduce,
                max_num_seqs=c.max_num_seqs,
                kv_budget_tokens=c.kv_budget_tokens,
            )
            for r in self.ranks
        ]
        if draft_loading:
            self._unless_draft_fails(loading)
        infos = self._wait(
            loading,
            f"the {c.tp_size} verifier ranks did not load and join their group",
            since=began,
        )
        # recorded before rank 0 connects, so that a failure from here on kills them
        self.placement["ranks"] = [info["node_id"] for info in infos]
        self._processes["ranks"] = [(info["node_id"], info["process"]) for info in infos]
        self.followers = [r.follow.remote() for r in self.ranks[1:]]
        if draft_loading:
            self._await_draft()
        self._wait(
            self.ranks[0].connect.remote(
                self.draft_address,
                limits=self.limits,
                scheduler=SchedulerConfig(
                    max_num_seqs=c.max_num_seqs,
                    max_num_batched_tokens=c.max_num_batched_tokens,
                    batch_wait_ms=c.batch_wait_ms,
                    policy=c.speculation_policy,
                ),
                timeout_s=c.rpc_timeout_s,
                draft_key=self._draft_key,
                lease_s=c.lease_s,
                draft_alive=draft_alive,
            ),
            "rank 0 did not connect to the draft actor",
        )

    def _unless_draft_fails(self, loading: list) -> None:
        """Wait for the ranks' loads (`loading`) unless the draft actor, loading beside
        them, fails first: its error is raised at once, not after the verifier has
        loaded (minutes of a large model) and in place of no error at all when the
        ranks then fail too. A timeout is left to the wait that follows."""
        pending = list(loading)
        deadline = time.monotonic() + self.config.start_timeout_s
        while pending and (left := deadline - time.monotonic()) > 0:
            ready, _ = ray.wait([self._draft_serving, *pending], num_returns=1, timeout=left)
            if not ready:
                return
            if ready[0] == self._draft_serving:
                ray.get(self._draft_serving)  # raises the draft actor's failure, if any
                return  # it loaded: the ranks are waited for as usual
            pending = [ref for ref in pending if ref != ready[0]]

    def replace_draft(self) -> None:
        """A new draft actor in the old one's bundle; rank 0 switches to it and re-opens
        the draft sessions of its running requests, which then speculate again.

        The restart lock is held only to end the old actor and launch the new one, then
        to record it: the load (a process start and a model load, up to
        start_timeout_s) and the attach to rank 0 run outside it, so a rank that dies or
        hangs meanwhile is restarted at once, not after them. While it loads `draft` is
        None (a gang restart then starts rank 0 without a draft actor, and does not wait
        for a loading actor's reset); a shutdown meanwhile ends the loading actor too.
        Once recorded, a gang restart connects the new ranks to it; an attach that
        fails while rank 0 does not answer (or was restarted meanwhile) keeps the loaded
        actor, and the next call only attaches it (or finds that a gang restart
        connected the new ranks to it): no second load. A draft actor on a fraction of
        a GPU may share that GPU with a rank: it loads under the lock, so its load and a
        restarted rank's do not need their memory at once."""
        with self._restarting:
            self._refuse_if_closed()
            owed, self._attach_owed = self._attach_owed, False
            kept = self.draft if owed else None  # a try whose attach is owed
        if kept is not None and self._answers(kept, "status"):  # (dead: replaced below)
            with self._restarting:
                self._refuse_if_closed()
                connected = self.draft is kept and self._draft_user == self.rank_generation
            if connected:
                return  # a gang restart connected the new ranks to it meanwhile
            self._attach_draft(kept)
            return
        with self._restarting:
            self._refuse_if_closed()
            old, self.draft, self._draft_user = self.draft, None, None
            # (a replacement abandoned while it loaded, its caller gone: it ends too)
            stale, self._loading_draft = self._loading_draft, None
            ended = [a for a in (old, stale) if a is not None]
            self._end(ended, self._processes.pop("draft", []))
            self.draft_generation += 1
            try:
                self._launch_draft()
            except BaseException:
                failed, self.draft = self.draft, None
                self._end([failed] if failed is not None else [], [])
                raise
            new, serving, launched = self.draft, self._draft_serving, self._draft_launched
            self.draft = None
            shared = 0 < self.config.draft.num_gpus < 1  # the shared-GPU case above
            if shared:
                self._record_draft(new, *self._loaded(new, serving, launched))
            else:
                self._loading_draft = new
        if not shared:
            loaded = self._loaded(new, serving, launched)
            with self._restarting:
                if self._loading_draft is not new:  # shutdown, or a newer replacement
                    self._end([new], [(loaded[1]["node_id"], loaded[1]["process"])])
                    self._refuse_if_closed()
                    raise EngineStartError("the draft actor was ended while it loaded")
                self._loading_draft = None
                self._record_draft(new, *loaded)
        self._attach_draft(new)

    def _loaded(self, new, serving, launched) -> tuple[str, dict]:
        """Wait for the new draft actor to load: (its address, its status). A failure
        ends it."""
        try:
            address = self._wait(serving, "the draft actor did not load", since=launched)
            status = self._wait(new.status.remote(), "the draft actor did not answer")
        except BaseException:
            if self._loading_draft is new:
                self._loading_draft = None
            self._end([new], [])
            raise
        return address, status

    def _record_draft(self, new, address: str, status: dict) -> None:
        """(Under the restart lock.) The loaded actor becomes the group's draft actor:
        gang restarts from now on connect rank 0 to it."""
        if self.closed:  # shut down while it loaded (shutdown ended it already)
            self._end([new], [(status["node_id"], status["process"])])
            self._refuse_if_closed()
        self.draft, self.draft_address = new, address
        self.placement["draft"] = status["node_id"]
        self._processes["draft"] = [(status["node_id"], status["process"])]
        self._undo_if_closed()

    def _attach_draft(self, new) -> None:
        """Rank 0 switches to the recorded draft actor `new`, outside the restart lock.
        An attach that fails while rank 0 answers is the replacement's failure: the new
        actor is ended (it must not hold the draft bundle, nor answer the health probe
        as if rank 0 drafted with it). One that fails because the ranks were restarted
        meanwhile is not, if the restart connected the new rank 0 to it. One that fails
        while rank 0 does not answer keeps the new actor and raises: the attach is owed,
        and the supervisor's next try makes it, or finds that the gang restart which a
        dead rank 0 gets connected the new ranks to it."""
        with self._restarting:
            if self.draft is not new:  # shut down meanwhile
                self._refuse_if_closed()
                raise EngineStartError("the draft actor was ended before it was attached")
            generation = self.rank_generation
            if self._draft_user == generation:
                return  # a gang restart connected rank 0 to it already
            ready = self.ranks and self._ranks_ready == generation
            rank0, address = (self.ranks[0] if ready else None), self.draft_address
        if rank0 is None:  # no started ranks (a gang restart failed part way): the next
            return  # one connects the new rank 0 to it
        try:
            self._wait(
                rank0.attach_draft.remote(address),
                "rank 0 did not attach the new draft actor",
            )
        except Exception as err:  # (an interrupt leaves it recorded: shutdown ends it)
            failure = err
        else:
            with self._restarting:
                if self.draft is not new:  # ended meanwhile (a restart found it dead)
                    self._refuse_if_closed()
                    raise EngineStartError("the draft actor was ended while it was attached")
                if self.rank_generation == generation:
                    self._draft_user = generation
                elif self._draft_user != self.rank_generation:  # restarted meanwhile,
                    self._attach_owed = True  # without it
                    raise EngineStartError(
                        "the ranks were restarted while the new draft actor was attached: "
                        "it is attached by the next try"
                    )
            return
        rank0_answers = self._answers(rank0)
        with self._restarting:
            self._refuse_if_closed()
            if self.draft is not new:
                raise EngineStartError("the draft actor was ended before it was attached")
            if self._draft_user == self.rank_generation:
                return  # the ranks were restarted meanwhile, connected to it
            if self.rank_generation != generation or not rank0_answers:
                self._attach_owed = True
                raise EngineStartError(
                    f"rank 0 did not attach the new draft actor ({failure}) and "
                    + ("was restarted" if self.rank_generation != generation else "does not answer")
                    + ": the loaded actor is kept, and attached by the next try"
                ) from failure
            failed, self.draft = self.draft, None
            self._end([failed], self._processes.pop("draft", []))
            raise failure

    def _answers(self, actor, method: str = "ping") -> bool:
        """Does an actor answer its health call (a rank's ping, the draft actor's
        status) within the probe's timeout?"""
        try:
            ray.get(getattr(actor, method).remote(), timeout=self.config.probe_timeout_s)
            return True
        except Exception:
            return False

    def _refuse_if_closed(self) -> None:
        if self.closed:
            raise EngineStartError("the engine was shut down: nothing is restarted")

    def _undo_if_closed(self) -> None:
        """A restart that outlasted shutdown's wait for it (shutdown went on without
        it): stop what it started. One that shutdown waited for is shut down by it."""
        if self._shut_without_lock:
            self._abandon()
            self._refuse_if_closed()

    def _end(self, actors: list, where: list) -> None:
        """ray.kill each actor, then SIGKILL those of their processes (`where`: node id
        and identity) that still run: a stopped or wedged process outlives ray.kill and
        holds its bundle (workers/processes.py)."""
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        kill_processes(where, timeout_s=self.config.rpc_timeout_s)

    def abandon_draft(self) -> None:
        """The supervisor gave up replacing the draft actor: one that loaded but that
        rank 0 never attached (kept for an owed attach) is ended. Left, it held its
        bundle (on a shared GPU, memory beside the ranks) and answered the draft probe,
        and the next gang restart connected the new rank 0 to it: drafting again while
        the replica reported no speculation for good (the README's promise: an actor
        rank 0 could not attach is ended)."""
        with self._restarting:
            if self.draft is None:
                return
            # rank 0 drafts with the recorded actor and no attach is owed: it is the one
            # that failed its probe (a dead one is found so at the next restart). An
            # owed attach marks the last try's actor even where the gang restart that
            # its failure started has connected the new rank 0 to it meanwhile
            if self._draft_user == self.rank_generation and not self._attach_owed:
                return
            gone, self.draft = self.draft, None
            self._attach_owed = False
            self._end([gone], self._processes.pop("draft", []))

    def restart_ranks(self) -> bool:
        """Gang restart: every rank is killed and started again in the same bundle (a
        broken TP group cannot take a new member); the draft actor drops the old
        engine's sessions. In-flight requests are resumed by the caller. Returns whether
        the draft actor was alive (False: none, dead or hung; rank 0 drafts with nothing
        until a replacement is attached)."""
        with self._restarting:
            self._refuse_if_closed()
            draft_alive = self._restart_ranks()
            self._undo_if_closed()
            return draft_alive

    def _remove_shm(self) -> None:
        """Remove the ended ranks' shm buffers (about 66 MiB of node memory per rank,
        which would outlive every gang restart); nothing when none were made."""
        if self._shm is None:
            return
        from workers.processes import remove_files
        from workers.tp_verifier import shm_prefix

        (port, nodes), self._shm = self._shm, None
        # a short bound: this runs inside a gang restart, which requests wait for
        remove_files(shm_prefix(port), nodes, timeout_s=min(10.0, self.config.rpc_timeout_s))

    def _restart_ranks(self) -> bool:
        self._end(self.ranks, self._processes.pop("ranks", []))
        self._remove_shm()
        self.ranks, self.followers = [], []
        self.rank_generation += 1
        self._ranks_ready = None  # until the new ranks have started and rank 0 connected
        draft_alive = self.draft is not None  # None: a failed replacement left none
        if draft_alive:
            try:
                # (a hung draft actor held every such restart for rpc_timeout_s, 30 s)
                ray.get(self.draft.reset.remote(), timeout=self.config.probe_timeout_s)
            except (RayActorError, GetTimeoutError):
                # dead, hung, or too slow to count as alive: it is ended (a reset that ran
                # late would drop the new rank 0's sessions while the probe, answered,
                # saw nothing wrong) and forgotten, and the supervisor's probe replaces it
                draft_alive = False
                gone, self.draft = self.draft, None
                self._end([gone], self._processes.pop("draft", []))
            except Exception:  # it answered, with an error: it runs
                logger.exception("the draft actor's reset failed")
        self._start_ranks(draft_alive=draft_alive)
        self._ranks_ready = self.rank_generation
        # the new rank 0 drafts with the recorded draft actor (an attach owed is made)
        self._draft_user = self.rank_generation if draft_alive else None
        return draft_alive

    @property
    def rank0(self):
        return self.ranks[0]

    def generate(self, request):
        return ray.get(self.rank0.generate.remote(request))

    def stream(self, request):
        """Iterate GenerationChunk objects as rank 0 produces them."""
        for ref in self.rank0.stream.options(num_returns="streaming").remote(request):
            yield ray.get(ref)

    @contextlib.contextmanager
    def _in_flight(self, request_id: str, ref):
        """Registers a call to rank 0 for `cancel`: [ref, dropped by `cancel`, started
        (a stream that has sent a chunk, which rank 0's cancel flag reaches)]."""
        call = [ref, False, False]
        calls = self._calls.setdefault(request_id, [])
        calls.append(call)
        try:
            yield call
        finally:
            calls.remove(call)
            if not calls and self._calls.get(request_id) is calls:
                del self._calls[request_id]

    async def agenerate(self, request):
        """A caller that is cancelled (its client went away or its deadline passed)
        cancels the request on rank 0: awaiting a Ray call does not stop it there."""
        ref = self.rank0.generate.remote(request)
        with self._in_flight(request.request_id, ref) as call:
            try:
                return await ref
            except asyncio.CancelledError:
                self.cancel(request.request_id)
                raise
            except ray.exceptions.TaskCancelledError:
                if call[1]:  # dropped by `cancel` before a rank-0 thread took it
                    raise RequestCancelledError(
                        f"request {request.request_id} was cancelled"
                    ) from None
                raise

    async def astream(self, request):
        """Async iteration of GenerationChunk objects (for the Serve ingress); a caller
        that stops early (cancelled, or closing the iterator) cancels it on rank 0."""
        finished = False
        chunks = self.rank0.stream.options(num_returns="streaming").remote(request)
        with self._in_flight(request.request_id, chunks) as call:
            try:
                async for ref in chunks:
                    chunk = await ref
                    call[2] = True
                    finished = chunk.result is not None
                    yield chunk
            except (asyncio.CancelledError, GeneratorExit):
                if not finished:
                    self.cancel(request.request_id)
                raise
            except ray.exceptions.TaskCancelledError:
                if finished:  # the whole stream came: nothing was lost
                    return
                if call[1]:
                    raise RequestCancelledError(
                        f"request {request.request_id} was cancelled"
                    ) from None
                raise

    def model_info(self) -> dict:
        return ray.get(self.rank0.model_info.remote())

    async def ahealthy(self, timeout_s: float = 10.0) -> bool:
        try:
            await asyncio.wait_for(
                asyncio.gather(self.draft.status.remote(), *[r.ping.remote() for r in self.ranks]),
                timeout_s,
            )
            return True
        except Exception:
            return False

    def cancel(self, request_id: str) -> None:
        """Cancel on rank 0. A call still queued for a thread of rank 0 (more calls
        than its max_concurrency: a batch of prompts) must never start: Ray drops it
        (ray.cancel: Ray answers it TaskCancelledError when it reaches the front of the
        queue). One that has started (its cancel flag registered first thing) stops by
        the flag at its next step; a stream that has sent a chunk has started, and is
        left to the flag alone (Ray's cancel of a running stream could drop chunks it
        already made). A unary call cannot be told started from queued here: it gets
        both, and one that finished in the very step of the cancel may end cancelled.
        During a gang restart there is no rank 0 for a moment (`ranks` is empty):
        nothing to cancel then, the old ranks are being killed with their requests, and
        a cancel (a drain's cut, a client's) must not raise."""
        for call in list(self._calls.get(request_id, ())):
            if call[2]:
                continue
            call[1] = True
            with contextlib.suppress(Exception):
                ray.cancel(call[0])
        ranks = self.ranks
        if ranks:
            ranks[0].cancel.remote(request_id)

    def healthy(self, timeout_s: float = 10.0) -> bool:
        """True when the draft actor and every verifier rank answer."""
        try:
            ray.get(
                [self.draft.status.remote(), *[r.ping.remote() for r in self.ranks]],
                timeout=timeout_s,
            )
            return True
        except Exception:
            return False

    def cache_counts(self) -> dict:
        draft = ray.get(self.draft.status.remote())
        return {
            "draft": draft["cached_sequences"],
            "draft_sessions": draft["open_sessions"],
            "rank0": ray.get(self.rank0.cache_count.remote()),
        }

    def shutdown(self) -> None:
        """Stop the followers, leave the process group, kill the actors. Refuses every
        later restart, and waits for one in progress (at most start_timeout_s: one that
        takes longer stops what it started when it ends) rather than racing it."""
        self.closed = True
        locked = self._restarting.acquire(timeout=self.config.start_timeout_s)
        self._shut_without_lock = not locked
        try:
            self._shutdown()
        finally:
            if locked:
                self._restarting.release()

    def _shutdown(self) -> None:
        loading, self._loading_draft = self._loading_draft, None
        if loading is not None:  # a replacement still loading (replace_draft waits for
            with contextlib.suppress(Exception):  # it outside the lock): it dies now
                ray.kill(loading)
        if not self.ranks and self.draft is None and self.pg is None:
            return
        steps = []
        if self.ranks:
            steps += [
                ("ranks", lambda: ray.get(self.rank0.shutdown.remote(), timeout=30)),
                ("ranks", lambda: ray.get(self.followers, timeout=30)),
                (
                    "ranks",
                    lambda: ray.get([r.shutdown.remote() for r in self.ranks[1:]], timeout=30),
                ),
            ]
        if self.draft is not None:
            steps.append(("draft", lambda: ray.get(self.draft.shutdown.remote(), timeout=30)))
        failed = set()
        for role, step in steps:  # each best effort: a dead actor must not block the rest
            try:
                step()
            except (RayError, GetTimeoutError, AttributeError):
                failed.add(role)
        # A role whose shutdown failed may be hung: its processes are ended for sure.
        where = [p for role in failed for p in self._processes.pop(role, [])]
        self._end([a for a in (*self.ranks, self.draft) if a is not None], where)
        self._remove_shm()  # (ranks that shut down cleanly removed theirs already)
        if self.pg is not None and self.own_pg:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
        self.ranks, self.followers, self.draft, self.pg = [], [], None, None
