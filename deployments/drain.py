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

Serve gives a replica's code no sign that its own stop has begun, so a scale-down or a
replica Serve replaces (the application is not being deleted then) still ends with
Serve's kill after the drain time (README).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from cactus.errors import ServerShuttingDownError

logger = logging.getLogger("cactus.ingress")

# Serve's kill comes this long after the drain time: enough for the watcher to see the
# deletion (POLL_S), cut, and for the cut streams' last messages to reach the clients.
CUT_MARGIN_S = 3.0
POLL_S = 1.0


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
    ) -> None:
        """`deleting`: asks whether the application is being deleted; with it, the
        first request or health Watch starts `_watch_for_shutdown` on the replica's
        event loop."""
        self.inner = engine
        self.running: set[str] = set()
        self.watches = 0  # open health Watch calls (they hold the drain too)
        self.draining = False  # the application is being deleted
        self.cut_reason: str | None = None
        self._cut: set[str] = set()
        self._drain_s = drain_s
        self._deleting = deleting
        self._poll_s = poll_s
        self._watch: asyncio.Task | None = None

    def __getattr__(self, name):  # model_info, cancel, ahealthy, stats, alive, group, ...
        return getattr(self.inner, name)

    def cut(self, reason: str) -> int:
        """End every running request (and refuse new ones) with `reason`; returns how
        many were running."""
        self.cut_reason = reason
        running = list(self.running)
        for request_id in running:
            self._cut.add(request_id)
            self.inner.cancel(request_id)
        return len(running)

    def _admit(self) -> None:
        if self.cut_reason is not None:
            raise ServerShuttingDownError(self.cut_reason, refused=True)
        self._start_watch()

    def _start_watch(self) -> None:
        if self._deleting is not None and self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_for_shutdown())

    @contextlib.contextmanager
    def watching(self):
        """Around a health Watch call: an open Watch never ends by itself, so it would
        hold the drain for its whole time; the watch for the deletion runs while one is
        open, and the Watch ends once `draining` is set (deployments/ingress.py)."""
        self._start_watch()
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
        """While requests or health Watch calls run, ask every poll_s whether the
        application is being deleted; once it is, set `draining` and cut the requests
        still running drain_s later. Runs for the replica's life (a task on its event
        loop); asks nothing while the replica is idle."""
        while True:
            await asyncio.sleep(self._poll_s)
            if not self.running and not self.watches:
                continue
            try:
                if not await asyncio.to_thread(self._deleting):
                    continue
            except Exception:  # the controller is busy or going away: ask again
                logger.debug("shutdown watch: status unavailable", exc_info=True)
                continue
            self.draining = True  # open health Watch calls say NOT_SERVING and end
            logger.info("application deleted: requests get %.1f s to finish", self._drain_s)
            await asyncio.sleep(self._drain_s)
            cut = self.cut(
                "the server is shutting down: requests still running after the drain time "
                f"(recovery.drain_timeout_s = {self._drain_s:g} s) are ended; retry on "
                "another replica"
            )
            if cut:
                logger.info("drain time is up: ended %d running requests", cut)
            return


def application_deleting(app_name: str) -> bool:
    """Whether Serve is deleting the application (a blocking controller call)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    return app is not None and app.status == "DELETING"
