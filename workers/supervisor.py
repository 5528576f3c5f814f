"""The engine's supervisor inside a Serve replica: it keeps the replica serving when an
engine actor dies, and no streamed token is lost.

- Dead draft actor: running requests go on without drafts (the engine degrades them);
  a new draft actor starts in the same bundle and rank 0 re-opens the draft sessions
  of its requests from their committed tokens, so they speculate again. The Cactus
  service's health stays SERVING (a degraded request is a statistic, `draft_failures`,
  not an outage); the server's (`""`) says NOT_SERVING until the new draft actor
  drafts, and for good once its replacement is given up (deployments/ingress.py).
- Dead verifier rank (rank 0 or a follower), or a broken tensor-parallel group: the
  ranks are torn down and started again in their bundle (gang restart). Health answers
  NOT_SERVING while that runs, at once (it reads a state, it never calls an actor).
- Requests in flight then are migrated (NVIDIA Dynamo's term): a stream resumes on the
  rebuilt engine from the tokens it already sent (prompt + those tokens, same
  parameters, a fresh seed for what follows), so the client sees a pause, not an error;
  a unary request runs again from the start with the same seed. Requests that arrive
  meanwhile wait for the engine within their deadline. Only when recovery fails does it
  end, with WorkerUnavailableError (UNAVAILABLE), or when it ran out of attempts, with
  RequestAttemptsExhaustedError (INTERNAL, which clients do not retry: the request may be
  what brings the engine down).
  A stream whose result was sent is never resumed (its client has all of it), and a
  cancelled request (a drain's cut included) is never started again.
- A draft actor that cannot be replaced in `restart_attempts` tries in a row is given
  up on (each try starts a process and loads the draft model): requests go on without
  drafts for the rest of the replica's life, and `speculating` stays False. A try needs
  a live rank 0 (it attaches the new actor): none is made while the ranks are being
  restarted, and one that failed because they died is not counted (`restart_attempts`
  such tries at most). A gang restart that found no live draft actor clears
  `draft_ok` at once.
- Once stopped (`shutdown`, or its group shut down), the supervisor restarts and
  replaces nothing, and requests waiting for a restart end UNAVAILABLE.

Which errors mean "the engine is gone" is decided in one place: cactus.errors.
Serve's own replica restart stays the last resort: check_health fails only once the
supervisor gave up (state FAILED).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from cactus.errors import (
    InvalidRequestError,
    RequestAttemptsExhaustedError,
    RequestCancelledError,
    ServerShuttingDownError,
    WorkerUnavailableError,
    is_engine_failure,
    unwrap,
)
from cactus.params import GenerationRequest
from workers.engine_loop import EngineLoopStopped
from workers.request import GenerationChunk, GenerationResult, resumed_seed

logger = logging.getLogger("cactus.supervisor")

SERVING, RECOVERING, FAILED = "SERVING", "RECOVERING", "FAILED"


@dataclass(frozen=True)
class RecoveryConfig:
    max_attempts: int = 3  # resumptions of one request before it fails (INTERNAL)
    restart_attempts: int = 3  # gang restarts tried in a row before giving up
    check_period_s: float = 0.5  # how often the actors are probed
    probe_timeout_s: float = 10.0  # an actor that does not answer a probe is dead
    recovery_timeout_s: float = 120.0  # the longest a request waits for a restart


class EngineSupervisor:
    """The ServingEngine protocol (agenerate / astream / cancel / ahealthy / model_info)
    over an EngineGroup that survives the death of its actors."""

    def __init__(self, group, config: RecoveryConfig | None = None) -> None:
        self.group = group
        self.config = config or RecoveryConfig()
        self.state = SERVING
        self.generation = 0  # bumped by every gang restart
        self.counters: Counter = Counter()  # draft_restarts, rank_restarts, resumed, ...
        self.degraded_since: float | None = None  # the draft actor is being replaced
        self.draft_ok = True  # the draft actor answered its last probe (or replaced it)
        self.last_recovery_s: float | None = None
        self._ready: asyncio.Event | None = None
        self._monitor: asyncio.Task | None = None
        self._recovery: asyncio.Task | None = None
        self._replacing_draft: asyncio.Task | None = None
        self._inner: dict[str, str] = {}  # request id -> the id of its current attempt
        self._cancelled: dict[str, asyncio.Event] = {}  # request id -> set by cancel
        self.draft_given_up = False  # replacing the draft actor failed: no more tries
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._info = group.model_info()
        # called on every change of state or restart counter (the replica's metrics
        # follow at once rather than at Serve's next health check)
        self.listeners: list = []

    def _changed(self) -> None:
        for listener in self.listeners:
            try:
                listener()
            except Exception:
                logger.exception("a supervisor listener failed")

    # ---- lifecycle -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Stopped (`shutdown`), or its group was shut down (the ingress's __del__ shuts
        the group down directly): nothing is restarted or replaced any more."""
        return self._stopped or getattr(self.group, "closed", False) is True

    def shutdown(self) -> None:
        """Stop watching and restarting the engine, then shut its group down (that
        waits for a restart in progress, and refuses later ones). Requests waiting for a
        restart end UNAVAILABLE. Callable from any thread; idempotent."""
        self._stopped = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is shutting down
                loop.call_soon_threadsafe(self._wake)
        self.group.shutdown()

    def _wake(self) -> None:
        """On the event loop, once closed: requests waiting for a restart see it."""
        if self._ready is not None:
            self._ready.set()
        if self._monitor is not None and self._monitor is not asyncio.current_task():
            self._monitor.cancel()

    def _ensure_started(self) -> None:
        """Start the monitor on the caller's event loop (the replica's)."""
        if self._ready is None:
            self._ready = asyncio.Event()
            self._ready.set()
        self._loop = asyncio.get_running_loop()
        if self.closed:
            return
        if self._monitor is None or self._monitor.done():
            self._monitor = self._loop.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.check_period_s)
            if self.closed:
                self._wake()
                return
            if self.state != SERVING:
                continue
            generation = self.generation
            probed_draft = self.group.draft
            ranks_ok, draft_ok = await self._probe()
            if self.closed:  # shut down during the probe: its answers mean nothing
                continue
            # a probe that outlasted a draft replacement asked the old draft actor
            current = self._replacing_draft is None and self.group.draft is probed_draft
            if current:
                self.draft_ok = draft_ok
            if not ranks_ok:
                self.engine_failed(generation, "a verifier rank does not answer")
            elif not draft_ok and current and not self.draft_given_up:
                self._replacing_draft = asyncio.get_running_loop().create_task(
                    self._replace_draft()
                )

    async def _probe(self) -> tuple[bool, bool]:
        group, timeout = self.group, self.config.probe_timeout_s

        async def answers(ref) -> bool:
            try:
                await asyncio.wait_for(ref, timeout)
                return True
            except Exception:
                return False

        members = list(group.ranks)  # (a gang restart replaces the list)
        ranks = [answers(r.ping.remote()) for r in members]
        # read once: a draft replacement (another thread) sets it to None and back, and
        # a None between two reads raised here, ending the monitor until its restart
        actor = group.draft
        draft = answers(actor.status.remote()) if actor is not None else None
        results = await asyncio.gather(*ranks, *([draft] if draft is not None else []))
        ranks_ok = bool(members) and all(results[: len(ranks)])
        return ranks_ok, draft is not None and results[-1]

    async def _replace_draft(self) -> None:
        """Replace the draft actor, `restart_attempts` failed tries in a row at most. A
        try attaches the new actor to rank 0: while the ranks are being restarted it
        waits for them, and a try that failed because a rank died under it is not
        counted (that death starts a gang restart, then the try is made again; a new
        actor that had loaded is kept, and the next try only attaches it or finds the
        gang restart connected it, EngineGroup.replace_draft), `restart_attempts` such
        tries at most."""
        self.degraded_since = time.monotonic()
        self.counters["draft_restarts"] += 1
        self._changed()
        failures = interrupted = 0
        try:
            while failures < self.config.restart_attempts:
                if self.closed or self.state == FAILED:  # FAILED: Serve replaces the replica
                    return
                if self.state != SERVING:
                    await self._ready.wait()
                    continue
                generation = self.generation
                try:
                    await asyncio.to_thread(self.group.replace_draft)
                    self.draft_ok = True
                    logger.warning(
                        "draft actor replaced in %.1f s", time.monotonic() - self.degraded_since
                    )
                    return
                except Exception:
                    if self.closed:
                        return
                    # not counted, up to restart_attempts times (a replacement that
                    # itself brings the ranks down, memory on a shared device, must
                    # still end)
                    if await self._ranks_failed(generation):
                        interrupted += 1
                        if interrupted <= self.config.restart_attempts:
                            logger.warning(
                                "replacing the draft actor failed as the verifier ranks "
                                "failed: it is tried again once they are restarted"
                            )
                            continue
                    failures += 1
                    logger.exception("replacing the draft actor failed (attempt %d)", failures)
                    await asyncio.sleep(min(8.0, 0.5 * 2 ** (failures - 1)))
            if not self.closed:
                # each try starts an actor process and loads the draft model: no endless
                # round of them; requests decode without drafts (the degraded mode)
                self.draft_given_up = True
                try:  # a loaded actor rank 0 never attached goes too
                    await asyncio.to_thread(self.group.abandon_draft)
                except Exception:
                    logger.exception("ending the unattached draft actor failed")
                logger.error(
                    "the draft actor could not be replaced in %d attempts: requests go on "
                    "without speculation for the rest of this replica's life",
                    self.config.restart_attempts,
                )
        finally:
            self.degraded_since = None
            self._replacing_draft = None

    async def _ranks_failed(self, generation: int) -> bool:
        """After a failed draft replacement: did the ranks of `generation` fail (a gang
        restart began or ran meanwhile, or a rank does not answer now: one is started)?"""
        if self.generation != generation or self.state != SERVING:
            return True
        ranks_ok, _ = await self._probe()
        if ranks_ok:
            return False
        self.engine_failed(generation, "a verifier rank does not answer")
        return True

    def engine_failed(self, generation: int, why: str) -> None:
        """Start a gang restart, once per engine generation."""
        self._ensure_started()
        if generation != self.generation or self.state != SERVING or self.closed:
            return
        logger.warning("engine generation %d failed (%s): restarting the ranks", generation, why)
        self.state = RECOVERING
        self._ready.clear()
        self._recovery = asyncio.get_running_loop().create_task(self._restart_ranks())
        self._changed()

    async def _restart_ranks(self) -> None:
        start = time.monotonic()
        self.counters["rank_restarts"] += 1
        self._changed()
        for attempt in range(self.config.restart_attempts):
            if self.closed:  # shut down meanwhile: the group refuses restarts
                self._ready.set()
                return
            try:
                draft_alive = await asyncio.to_thread(self.group.restart_ranks)
                if draft_alive is False and self._replacing_draft is None:
                    # the draft actor died or hung during the restart (or none was
                    # left): "" says so now, not at the next probe (up to
                    # probe_timeout_s later); that probe starts its replacement
                    self.draft_ok = False
                self.generation += 1
                self.state = SERVING
                self.last_recovery_s = time.monotonic() - start
                logger.warning("engine restarted in %.1f s", self.last_recovery_s)
                self._ready.set()
                self._changed()
                return
            except Exception:
                logger.exception("gang restart failed (attempt %d)", attempt + 1)
                await asyncio.sleep(min(8.0, 0.5 * 2**attempt))
        self.state = FAILED  # Serve's health check now replaces the replica
        self._ready.set()
        self._changed()

    async def _wait_ready(
        self, deadline: float | None, request_id: str = "", attempt: int = 0
    ) -> int:
        """The engine generation to run on, once it serves; UNAVAILABLE if it does not
        within the request's deadline (or the recovery timeout). A request cancelled
        before or during the wait (a drain's cut) ends at once, RequestCancelledError.
        Shut down: a request that ran or waited ends as one of a stopped engine loop
        (a cut, CANCELLED in the metrics); a new one is refused (counted nowhere)."""
        self._ensure_started()
        cancelled = self._cancelled.get(request_id)
        limit = self.config.recovery_timeout_s
        if deadline is not None:
            limit = min(limit, deadline - time.monotonic())
        until = time.monotonic() + max(0.0, limit)
        # a loop: a restart that succeeded may fail again before this request runs (the
        # new engine died at once), and the request then waits for the next one
        waited = False
        while self.state == RECOVERING and not self.closed:
            waited = True
            if cancelled is not None and cancelled.is_set():
                break
            left = until - time.monotonic()
            if left <= 0:
                break
            waits = [asyncio.ensure_future(self._ready.wait())]
            if cancelled is not None:
                waits.append(asyncio.ensure_future(cancelled.wait()))
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        if cancelled is not None and cancelled.is_set():
            raise RequestCancelledError(f"request {request_id} cancelled")
        if self.closed:  # the replica is torn down
            message = "the engine was shut down; retry on another replica"
            if waited or attempt:  # an accepted request: counted as a cut, CANCELLED
                raise EngineLoopStopped(message)
            raise ServerShuttingDownError(message, refused=True)
        if self.state != SERVING:
            raise WorkerUnavailableError("the engine is restarting; retry later")
        return self.generation

    # ---- the ServingEngine protocol --------------------------------------------------

    def model_info(self) -> dict:
        return self._info

    async def ahealthy(self, timeout_s: float = 1.0) -> bool:
        """SERVING unless the ranks are being restarted (or could not be): never calls
        an actor, so it answers at once (`timeout_s`, the ServingEngine protocol's, has
        nothing to bound). A dead draft actor leaves it True (requests go on by plain
        decoding); `speculating` tells that case."""
        self._ensure_started()
        return self.state == SERVING and not self.closed

    def speculating(self) -> bool:
        """The draft actor answered the last probe, or a new one has taken over since
        one did not: False from a failed draft probe until its replacement is up (the
        health service's "" is NOT_SERVING meanwhile, serving.md). False for good once
        replacing it was given up: rank 0 has no drafter then, whatever answers."""
        return self.draft_ok and self._replacing_draft is None and not self.draft_given_up

    def alive(self) -> bool:
        """False once recovery gave up: Serve then replaces the replica."""
        return self.state != FAILED

    def cancel(self, request_id: str) -> None:
        """Stop a request: its running attempt on rank 0, and every later one. One that
        waits for a restart (between attempts) ends at once with RequestCancelledError;
        a drain's cut relies on that (deployments/drain.py)."""
        inner = self._inner.get(request_id)
        if inner is None:  # not running (any more)
            return
        self._cancelled[request_id].set()
        if inner:  # "" while between attempts
            self.group.cancel(inner)

    def stats(self) -> dict:
        return {
            "state": self.state,
            "generation": self.generation,
            "degraded": self.degraded_since is not None,
            **self.counters,
        }

    def _claim(self, request_id: str) -> None:
        """A request id names one running request: a second one with the id would take
        over the first's cancellation (the engine refuses it anyway). Held from the
        first attempt to the end, across the waits for a restart."""
        # a resumed attempt's id (`<id>~<n>`, in the values) runs on rank 0 under that
        # name: a client request with it would be refused there as a duplicate
        if request_id in self._inner or request_id in self._inner.values():
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        self._inner[request_id] = ""  # no attempt running yet: nothing to cancel
        self._cancelled[request_id] = asyncio.Event()

    def _inner_id(self, request: GenerationRequest, attempt: int) -> str | None:
        """The id of a resumed attempt on rank 0 (None for the first, which runs under
        the request's own): `<id>~<attempt>`, or with more `~` where a client's own
        request or another attempt holds that id: rank 0 would refuse the resumed
        attempt as a duplicate, ending a stream INVALID_ARGUMENT after its tokens."""
        if attempt == 0:
            return None
        inner = f"{request.request_id}~{attempt}"
        taken = {*self._inner, *self._inner.values()}
        while inner in taken:
            inner += "~"
        return inner

    def _release(self, request_id: str) -> None:
        self._inner.pop(request_id, None)
        self._cancelled.pop(request_id, None)

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """Unary: nothing was sent, so a failed attempt runs again from the start with
        the same seed (the result is the one an uninterrupted run gives)."""
        self._claim(request.request_id)
        try:
            request = _with_seed(request)
            deadline = _deadline(request)
            attempt = 0
            while True:
                generation = await self._wait_ready(deadline, request.request_id, attempt)
                inner = _attempt(
                    request, attempt, deadline, inner_id=self._inner_id(request, attempt)
                )
                self._inner[request.request_id] = inner.request_id
                try:
                    result = await self.group.agenerate(inner)
                    return _as_original(result, request, attempt)
                except Exception as err:
                    self._inner[request.request_id] = ""
                    attempt = self._failed_attempt(err, generation, attempt, request)
        finally:
            self._release(request.request_id)

    async def astream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Streaming: resume after the last token sent (same request, fresh seed)."""
        self._claim(request.request_id)
        try:
            request = _with_seed(request)
            deadline = _deadline(request)
            sent: list[int] = []
            sent_chars = 0
            stats = None  # the statistics as of the last chunk sent
            attempt = 0
            while True:
                generation = await self._wait_ready(deadline, request.request_id, attempt)
                inner = _attempt(
                    request,
                    attempt,
                    deadline,
                    sent,
                    sent_chars,
                    stats,
                    inner_id=self._inner_id(request, attempt),
                )
                self._inner[request.request_id] = inner.request_id
                finished = False  # the result was sent: the stream is complete
                try:
                    # closed with this generator: a stream the caller leaves is cancelled
                    # on rank 0 at once (EngineGroup.astream), not when it is collected
                    async with contextlib.aclosing(self.group.astream(inner)) as chunks:
                        async for chunk in chunks:
                            sent += chunk.token_ids
                            sent_chars += len(chunk.text)
                            stats = chunk.stats or stats
                            result = chunk.result
                            if result is not None:
                                result = _as_original(result, request, attempt)
                                finished = True
                            yield replace(chunk, request_id=request.request_id, result=result)
                    return
                except Exception as err:
                    self._inner[request.request_id] = ""
                    if finished:
                        # rank 0 failed after the result went out (before Ray's stream
                        # ended): the client has the whole stream; resuming it would
                        # decode past its end (a second result) or refuse it
                        self._failed_after_result(err, generation, request)
                        return
                    attempt = self._failed_attempt(err, generation, attempt, request)
        finally:
            self._release(request.request_id)

    def _failed_after_result(self, err, generation: int, request) -> None:
        """An error once the stream's result was sent ends nothing more: an engine
        failure starts recovery (for the next requests), anything else is logged."""
        if is_engine_failure(err):
            self.engine_failed(generation, f"{type(unwrap(err)).__name__} after a result")
        else:
            logger.warning(
                "request %s: %r after its result was sent (ignored)", request.request_id, err
            )

    def _failed_attempt(self, err, generation: int, attempt: int, request) -> int:
        """Re-raise what is not an engine failure; else start recovery and count the
        attempt (UNAVAILABLE once they are used up)."""
        if not is_engine_failure(err):
            raise err
        self.engine_failed(generation, f"{type(unwrap(err)).__name__} in {request.request_id}")
        if attempt + 1 > self.config.max_attempts:
            raise RequestAttemptsExhaustedError(
                f"request {request.request_id}: the engine failed {attempt + 1} times while "
                f"running it (recovery.max_attempts = {self.config.max_attempts}); not "
                "retried: it may be what brings the engine down"
            ) from None
        self.counters["resumed"] += 1
        return attempt + 1


def _with_seed(request: GenerationRequest) -> GenerationRequest:
    """Fix the seed here, so every attempt of the request draws from the same one."""
    if request.sampling.seed is not None:
        return request
    return replace(request, sampling=replace(request.sampling, seed=secrets.randbits(63)))


def _deadline(request: GenerationRequest) -> float | None:
    return time.monotonic() + request.time_limit_s if request.time_limit_s else None


def _attempt(
    request, attempt: int, deadline, sent=(), sent_chars: int = 0, stats=None, inner_id=None
):
    """The request as the engine runs it this time: its own id (the old engine may
    still know the old one), the time left, and for a resumed stream the tokens sent.
    The time left is counted from the request's arrival: a first attempt that waited
    for a restart gets what the wait left of its time_limit_s, not all of it again."""
    left = None if deadline is None else max(1e-3, deadline - time.monotonic())
    if attempt == 0:
        return request if left is None else replace(request, time_limit_s=left)
    resumed = replace(
        request,
        request_id=inner_id or f"{request.request_id}~{attempt}",
        time_limit_s=left,
        resume_token_ids=tuple(sent),
        resume_text_chars=sent_chars,
        resume_stats=stats.as_dict() if stats is not None and sent else None,
    )
    if sent:  # new tokens from a fresh seed; the first ones are not drawn again
        seed = resumed_seed(request.sampling.seed, attempt)
        resumed = replace(resumed, sampling=replace(request.sampling, seed=seed))
    return resumed


def _as_original(result: GenerationResult, request, attempt: int) -> GenerationResult:
    stats = replace(result.stats, resumed=attempt)
    return replace(result, request_id=request.request_id, seed=request.sampling.seed, stats=stats)
