"""One thread that runs every engine step of a process, round-robin over its requests.

Callers (Ray actor methods, each on one of the actor's pool threads) submit a request
and read its chunks from a queue; all model work happens on the loop's own thread.
This is vLLM's engine-loop/output-queue split (AsyncLLMEngine) in miniature, and it
matters on CPU: a Ray threaded actor hands consecutive calls to different pool threads,
and the first forwards on a fresh thread page-fault in new per-thread buffers (measured:
a 32-token verifier prefill took 55 ms on fresh threads against 33 ms on a warm one,
~2,000 minor faults each). Requests interleave at step granularity, so a long request
does not hold up a short one.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator

_END = object()


class EngineLoopStopped(RuntimeError):
    """The loop was shut down before the request finished."""


class EngineLoop:
    def __init__(self, engine, *, name: str = "engine-loop") -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request, *, cancelled: Callable[[], bool] | None = None) -> Iterator:
        """Iterate the request's GenerationChunk objects; the engine's exceptions
        (invalid request, cancellation, ...) are raised here."""
        if self._stopped.is_set():
            raise EngineLoopStopped("the engine loop is shut down")
        out: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox.put((request, cancelled, out))
        return self._drain(out)

    def generate(self, request, *, cancelled: Callable[[], bool] | None = None):
        last = None
        for last in self.submit(request, cancelled=cancelled):  # noqa: B007
            pass
        return last.result

    @staticmethod
    def _drain(out: queue.SimpleQueue) -> Iterator:
        while True:
            item = out.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _run(self) -> None:
        active: deque = deque()  # (chunk iterator, output queue)
        while not self._stopped.is_set():
            try:  # take new requests; block only when there is nothing to step
                item = self._inbox.get(block=not active)
                while item is not _END:
                    request, cancelled, out = item
                    active.append((self.engine.stream(request, cancelled=cancelled), out))
                    item = self._inbox.get(block=False)
            except queue.Empty:
                pass
            if not active:
                continue
            chunks, out = active.popleft()
            try:
                out.put(next(chunks))  # one engine step
            except StopIteration:
                out.put(_END)
                continue
            except BaseException as err:  # the request ends; the loop goes on
                out.put(err)
                continue
            active.append((chunks, out))
        for chunks, out in active:  # shut down: free every request's caches
            with contextlib.suppress(BaseException):
                chunks.close()
            out.put(EngineLoopStopped("the engine loop was shut down"))
        while True:  # requests submitted while it was shutting down
            try:
                item = self._inbox.get(block=False)
            except queue.Empty:
                return
            if item is not _END:
                item[2].put(EngineLoopStopped("the engine loop was shut down"))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._stopped.set()
        self._inbox.put(_END)
        self._thread.join(timeout_s)
