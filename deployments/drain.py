"""The end of a replica's drain: streams still running get a clear status, not a cut.

When Serve stops a replica (the launcher's Ctrl-C / SIGTERM / `make stop`, which delete
the application), the replica takes no new requests and running ones get
`recovery.drain_timeout_s` to finish (Serve's `graceful_shutdown_timeout_s`). Serve then
kills the replica, and the proxy ends whatever still runs with INTERNAL ("The actor died
unexpectedly ..."): the client cannot tell a shutdown from a bug. So the replica watches
for its application being deleted and, `drain_timeout_s` after it saw that, ends its
running requests itself with `ServerShuttingDownError`: UNAVAILABLE with a readable
message over gRPC (the status a client retries elsewhere; our client never retries a
stream that already sent tokens), an OpenAI error event with status 503 over HTTP,
after the tokens already sent. Serve's kill stays the backstop, `CUT_MARGIN_S` later.

Kubernetes gives a pod the same shape: SIGTERM, `terminationGracePeriodSeconds` to
finish, then SIGKILL; a server that handles the first ends its requests itself.

Before it deletes the application, the launcher drains it itself (`start_drain`):
it writes the drain's deadline (now + drain_timeout_s) under the application's key in
Ray's KV store; every replica polls that key (every FLAG_POLL_S) from its first
request or health check on, and once it sees it it refuses new requests with
UNAVAILABLE ("the server is shutting down ... retry on another replica"; HTTP 503 with
Retry-After: serving.md's status for a server that is draining, which clients retry
elsewhere), says NOT_SERVING, lets its running requests finish until the deadline,
cuts the rest then, and says in the KV store whether it still runs requests. The
launcher deletes the application once no replica does, or at the deadline: a request
that arrives during the drain gets UNAVAILABLE rather than the NOT_FOUND of Serve's
proxy for an application already deleted (the short moment of the deletion itself
excepted). An application deleted by other means (`serve delete`, a redeploy) is
drained as before, from the moment a replica sees it DELETING.

Serve gives a replica's code no sign that its own stop has begun, so a scale-down or a
replica Serve replaces (the application is not being deleted then) still ends with
Serve's kill after the drain time (README).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from cactus.errors import ServerShuttingDownError

logger = logging.getLogger("cactus.ingress")

# Serve's kill comes this long after the drain time: enough for the watcher to see the
# deletion (POLL_S), cut, and for the cut streams' last messages to reach the clients.
CUT_MARGIN_S = 3.0
POLL_S = 1.0
# How often a replica reads the launcher's drain key (a small GCS read): a request that
# reaches a replica this long after the drain began may still be admitted, and runs.
FLAG_POLL_S = 0.25
# Ray KV namespace of the drain keys: `<app>/deadline` (the launcher's), `<app>/busy/<replica>`
KV_NAMESPACE = "cactus_drain"


class DrainingEngine:
    """The ServingEngine protocol over another engine, plus `cut`: every running request
    then ends with ServerShuttingDownError (a stream after the chunks already sent), and
    so does every request that arrives later. Everything else is the inner engine's."""

    def __init__(
        self,
        engine,
        *,
        drain_s: float = 0.0,
        deleting: Callable[[], bool] | None = None,
        poll_s: float = POLL_S,
        drain_length: Callable[[], float | None] | None = None,
        mark_busy: Callable[[bool], None] | None = None,
        flag_poll_s: float = FLAG_POLL_S,
    ) -> None:
        """`deleting`: asks whether the application is being deleted; `drain_length`:
        the launcher's drain (its length in seconds) or None; `mark_busy`: says whether
        this replica still runs requests during that drain. With either, the first
        request, health Watch or health check starts `_watch_for_shutdown` on the
        replica's event loop."""
        self.inner = engine
        self.running: set[str] = set()
        self.watches = 0  # open health Watch calls (they hold the drain too)
        self.draining = False  # the application is being drained or deleted
        self.refusing = False  # the launcher's drain: new requests are refused
        self.cut_reason: str | None = None
        self._cut: set[str] = set()
        self._drain_s = drain_s
        self._deleting = deleting
        self._poll_s = poll_s
        self._drain_length = drain_length
        self._mark_busy = mark_busy
        self._flag_poll_s = flag_poll_s
        self._watch: asyncio.Task | None = None
        # called when `draining` changes (the ingress: `cactus_engine_serving` is 0
        # while the replica drains)
        self.on_change: Callable[[], None] | None = None

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # a gauge must not stop the drain
                logger.exception("drain: the change callback failed")

    def __getattr__(self, name):  # model_info, cancel, ahealthy, stats, alive, group, ...
        return getattr(self.inner, name)

    def cut(self, reason: str) -> int:
        """End every running request (and refuse new ones) with `reason`; returns how
        many were running."""
        self.cut_reason = reason
        running = list(self.running)
        for request_id in running:
            self._cut.add(request_id)
            try:
                self.inner.cancel(request_id)
            except Exception:  # the others are cut all the same (the stream's own check)
                logger.exception("drain: cancelling %s failed", request_id)
        return len(running)

    def _admit(self) -> None:
        if self.cut_reason is not None:
            raise ServerShuttingDownError(self.cut_reason, refused=True)
        if self.refusing:
            raise ServerShuttingDownError(
                "the server is shutting down: it takes no new requests while its running "
                "ones finish; retry on another replica",
                refused=True,
            )
        self.start_watch()

    def start_watch(self) -> None:
        """From the first request or health Watch, and from Serve's health check: a
        replica no request reached yet reads the launcher's drain key from then on (its
        first request then meets a drain). A watch that failed is started again."""
        watched = self._deleting is not None or self._drain_length is not None
        if watched and (self._watch is None or self._watch.done()):
            if self._watch is not None and not self._watch.cancelled():
                failure = self._watch.exception()
                if failure is not None:  # restarted: a replica must keep seeing a drain
                    logger.error("the shutdown watch failed; restarted", exc_info=failure)
            self._watch = asyncio.get_running_loop().create_task(self._watch_for_shutdown())

    @contextlib.contextmanager
    def watching(self):
        """Around a health Watch call: an open Watch never ends by itself, so it would
        hold the drain for its whole time; the watch for the deletion runs while one is
        open, and the Watch ends once `draining` is set (deployments/ingress.py)."""
        self.start_watch()
        self.watches += 1
        try:
            yield
        finally:
            self.watches -= 1

    @contextlib.contextmanager
    def _tracked(self, request_id: str):
        # A second request with a running one's id is refused by the engine; it must
        # not untrack the first (a cut would then miss it at shutdown).
        owner = request_id not in self.running
        if owner:
            self.running.add(request_id)
        try:
            yield
        except Exception:
            if owner and request_id in self._cut:
                raise ServerShuttingDownError(self.cut_reason) from None
            raise
        finally:
            if owner:
                self.running.discard(request_id)
                self._cut.discard(request_id)

    async def agenerate(self, request):
        self._admit()
        with self._tracked(request.request_id):
            return await self.inner.agenerate(request)

    async def astream(self, request) -> AsyncIterator:
        self._admit()
        with self._tracked(request.request_id):
            finished = False
            async with contextlib.aclosing(self.inner.astream(request)) as chunks:
                async for chunk in chunks:
                    if request.request_id in self._cut and chunk.result is None:
                        # the engine's cancel was lost (the supervisor's reaches a
                        # request between two attempts too, this is the safety net):
                        # end here; closing the stream cancels it
                        raise ServerShuttingDownError(self.cut_reason)
                    finished = chunk.result is not None
                    yield chunk
            # a cancelled stream ends without its result: say why it ended
            if not finished and request.request_id in self._cut:
                raise ServerShuttingDownError(self.cut_reason)

    async def _watch_for_shutdown(self) -> None:
        """Every flag_poll_s (the first time at once), read the launcher's drain key
        (`_drain_for` while it is there); while requests or health Watch calls run, ask
        every poll_s whether the application is being deleted by other means, and once
        it is, set `draining` and cut the requests still running drain_s later. Runs for
        the replica's life (a task on its event loop); asks Serve's controller nothing
        while the replica is idle."""
        tick = self._flag_poll_s if self._drain_length is not None else self._poll_s
        next_status = time.monotonic() + self._poll_s
        first = True
        while True:
            if not first:
                await asyncio.sleep(tick)
            first = False
            if self._drain_length is not None:
                drain_s = await self._ask(self._drain_length)
                if drain_s is not None:
                    await self._drain_for(drain_s)
                    continue  # the key is gone: serving again (below)
            if self._deleting is None or time.monotonic() < next_status:
                continue
            next_status = time.monotonic() + self._poll_s
            if not self.running and not self.watches:
                continue
            if not await self._ask(self._deleting):
                continue
            self.draining = True  # open health Watch calls say NOT_SERVING and end
            self._changed()
            logger.info("application deleted: requests get %.1f s to finish", self._drain_s)
            await asyncio.sleep(self._drain_s)
            self._cut_the_rest()
            return

    @staticmethod
    async def _ask(question: Callable, unanswered=None):
        """A blocking question to Ray (the KV store, Serve's controller), off the event
        loop; `unanswered` when it cannot be answered now (asked again at the next poll)."""
        try:
            return await asyncio.to_thread(question)
        except Exception:  # the GCS or the controller is busy or going away
            logger.debug("shutdown watch: no answer", exc_info=True)
            return unanswered

    async def _drain_for(self, drain_s: float) -> None:
        """The launcher's drain: refuse new requests, let running ones finish for
        `drain_s` (counted on this replica's own clock from when it saw the key: clocks
        of a cluster's nodes need not agree), cut the rest then; say whether this
        replica still runs requests (the launcher deletes the application once none
        does). Returns once the key is gone (a launcher that cleared it, or a new one
        that deploys the application again: this replica serves again)."""
        deadline = time.monotonic() + drain_s
        self.refusing = self.draining = True
        self._changed()
        logger.info("the server drains: requests get %.1f s to finish", drain_s)
        published = None
        cut_at = None
        while True:
            busy = bool(self.running)
            if busy != published and await self._publish(busy):
                published = busy
            now = time.monotonic()
            if busy and cut_at is None and now >= deadline:
                self._cut_the_rest()
                cut_at = now
            if not busy or (cut_at is not None and now >= cut_at + CUT_MARGIN_S):
                break  # (a cut request whose cancel was lost: Serve's kill is the backstop)
            await asyncio.sleep(self._flag_poll_s)
        if published is not False:
            await self._publish(False)
        while await self._ask(self._drain_length, unanswered=True) is not None or self.running:
            await asyncio.sleep(self._flag_poll_s)  # refusing until the key goes
        self.refusing = self.draining = False
        self.cut_reason = None
        self._changed()
        logger.info("the drain key is gone: serving again")

    async def _publish(self, busy: bool) -> bool:
        if self._mark_busy is None:
            return True
        try:
            await asyncio.to_thread(self._mark_busy, busy)
            return True
        except Exception:  # the launcher then waits for the deadline: nothing is lost
            logger.debug("drain: could not say busy=%s", busy, exc_info=True)
            return False

    def _cut_the_rest(self) -> None:
        cut = self.cut(
            "the server is shutting down: requests still running after the drain time "
            f"(recovery.drain_timeout_s = {self._drain_s:g} s) are ended; retry on "
            "another replica"
        )
        if cut:
            logger.info("drain time is up: ended %d running requests", cut)


def _namespace(app_name: str) -> str:
    """One KV namespace per application: no application's keys can be another's."""
    return f"{KV_NAMESPACE}:{app_name}"


def drain_length(app_name: str) -> float | None:
    """The launcher's drain of `app_name`: its length in seconds, or None (no drain)."""
    from ray.experimental.internal_kv import _internal_kv_get

    value = _internal_kv_get("drain_s", namespace=_namespace(app_name))
    return float(value) if value else None


def mark_busy(app_name: str, replica: str, busy: bool) -> None:
    """A replica's answer during the launcher's drain: it still runs requests or not."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    key = f"busy/{replica}"
    if busy:
        _internal_kv_put(key, b"1", namespace=_namespace(app_name))
    else:
        _internal_kv_del(key, namespace=_namespace(app_name))


def start_drain(app_name: str, drain_s: float) -> float:
    """The launcher: every replica of `app_name` refuses new requests from when it sees
    this (within FLAG_POLL_S) and has `drain_s` to finish its running ones. Returns the
    launcher's own deadline (time.monotonic())."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put("drain_s", repr(float(drain_s)), namespace=_namespace(app_name))
    return time.monotonic() + drain_s


def busy_replicas(app_name: str) -> int:
    from ray.experimental.internal_kv import _internal_kv_list

    return len(_internal_kv_list("busy/", namespace=_namespace(app_name)))


def wait_drained(app_name: str, deadline: float, *, settle_s: float = 4 * FLAG_POLL_S) -> None:
    """The launcher: wait until every replica has seen the drain (`settle_s`, four of
    their polls: a replica that has not said it is busy by then is drained by Serve's
    deletion instead, as before) and none still runs a request, or until the deadline
    (time.monotonic()), the replicas' poll and the cut's margin have passed. A KV read
    that fails is tried again until then."""
    time.sleep(settle_s)
    bound = deadline + FLAG_POLL_S + CUT_MARGIN_S
    while time.monotonic() < bound:
        try:
            if not busy_replicas(app_name):
                return
        except Exception:  # the GCS is busy: ask again
            logger.debug("drain: no answer from the KV store", exc_info=True)
        time.sleep(0.1)


def clear_drain(app_name: str) -> None:
    """Every drain key of `app_name`: before a start (a SIGKILLed launcher's would make
    the new replicas refuse everything) and after the application's deletion."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del("", del_by_prefix=True, namespace=_namespace(app_name))


def application_deleting(app_name: str) -> bool:
    """Whether Serve is deleting the application (a blocking controller call)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    return app is not None and app.status == "DELETING"
