"""One thread that owns a batched engine and steps it while it has work.

Callers (Ray actor methods, each on one of the actor's pool threads) submit a request
and read its chunks from a queue; all model work happens on the loop's own thread,
and new requests join the batch between two steps. This is vLLM's engine-loop /
output-queue split (AsyncLLM) in miniature. It matters on CPU too: a Ray threaded
actor hands consecutive calls to different pool threads, and the first forwards on a
fresh thread page-fault in new per-thread buffers (measured: a 32-token verifier
prefill took 55 ms on fresh threads against 33 ms on a warm one).

An idle engine does not step the moment its first request arrives: requests that come
as a burst (8 calls from one client reach a Ray actor 2-10 ms apart) would otherwise
start one step apart, the first running a step ahead of the rest to the end, which
costs the whole batch an extra step. So after each arrival it waits up to
`batch_wait_ms` (SchedulerConfig, default 2 ms) for the next, for at most
`_WAIT_ARRIVALS` x `batch_wait_ms` in all, then steps (Ray Serve's `batch_wait_timeout_s` and
Triton's queue delay do the same for their batches). A busy engine never waits: new
requests join between two steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

from cactus.errors import EngineFailedError, WorkerUnavailableError

_END = object()
log = logging.getLogger("cactus.engine")
_WAIT_ARRIVALS = 5  # an idle engine's wait for a burst lasts at most this many batch waits


def _final_only(put: Callable) -> Callable:
    def sink(item) -> None:
        if isinstance(item, BaseException) or item.result is not None:
            put(item)

    return sink


class _Call:
    """A function to run on the loop's thread (between steps), with its answer box; one
    whose caller gave up waiting before it started never runs."""

    def __init__(self, fn: Callable, done: queue.SimpleQueue) -> None:
        self.fn, self.done = fn, done
        self._lock = threading.Lock()
        self._state = "queued"  # -> "running" or "cancelled"

    def cancel(self) -> bool:
        """Whether it will never run (it had not started)."""
        with self._lock:
            if self._state == "queued":
                self._state = "cancelled"
            return self._state == "cancelled"

    def run(self, engine) -> None:
        with self._lock:
            if self._state == "cancelled":
                return
            self._state = "running"
        try:
            self.done.put((True, self.fn(engine)))
        except BaseException as err:
            self.done.put((False, err))


class EngineLoopStopped(WorkerUnavailableError):
    """The loop was shut down before the request finished (the replica is being torn
    down: a scale-down, a replaced replica): retry elsewhere, UNAVAILABLE, as for a
    request still waiting for a row then, not a bug (INTERNAL)."""


def _broken(err: BaseException) -> EngineFailedError:
    return EngineFailedError(f"the engine loop failed and stopped ({type(err).__name__}: {err})")


class EngineLoop:
    """`on_step(engine, batch_size)`: called after every step (metrics), a failed one too
    (batch_size 0, after its admitted requests ended), so gauges of the rows and the waiting
    requests never keep a failed step's values."""

    def __init__(
        self,
        engine,
        *,
        name: str = "engine-loop",
        on_step: Callable | None = None,
        batch_wait_ms: float | None = None,
    ):
        """batch_wait_ms: None = the engine's SchedulerConfig.batch_wait_ms."""
        self.engine = engine
        self.on_step = on_step
        if batch_wait_ms is None:
            batch_wait_ms = engine.scheduler.config.batch_wait_ms
        self.batch_wait_s = batch_wait_ms / 1000.0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        # Set when the engine could not even end a failed step's requests (freeing their
        # rows raised too: a broken device, a bug in a release). The loop then stops,
        # every request gets an EngineFailedError (the supervisor rebuilds the engine and
        # resumes them), and `alive` turns False for the rank's ping.
        self.failed: BaseException | None = None
        # set by the loop's thread just before its last look at the inbox: a caller
        # whose item may have arrived after that look answers it itself (_late)
        self._closed = threading.Event()
        self._ending: BaseException = EngineLoopStopped("the engine loop was shut down")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, request, *, cancelled: Callable[[], bool] | None = None, final_only: bool = False
    ) -> Iterator:
        """Iterate the request's GenerationChunk objects; the engine's exceptions
        (invalid request, cancellation, ...) are raised here. final_only: only the last
        chunk (a unary caller then is not woken at every step)."""
        self._refuse_if_stopped()
        out: queue.SimpleQueue = queue.SimpleQueue()
        sink = _final_only(out.put) if final_only else out.put
        self._inbox.put((request, cancelled, sink))
        self._late()
        return self._drain(out)

    def call(self, fn: Callable, timeout_s: float = 60.0):
        """Run fn(engine) on the loop's thread between two steps; return its result.
        TimeoutError after timeout_s (a call not started by then never runs)."""
        self._refuse_if_stopped()
        done: queue.SimpleQueue = queue.SimpleQueue()
        call = _Call(fn, done)
        self._inbox.put(call)
        self._late()
        try:
            ok, value = done.get(timeout=timeout_s)
        except queue.Empty:
            ran = "never runs" if call.cancel() else "had started"
            raise TimeoutError(
                f"the engine loop did not answer within {timeout_s} s (the call {ran})"
            ) from None
        if not ok:
            raise value
        return value

    @property
    def alive(self) -> bool:
        """The loop's thread runs and has not failed (a shut-down loop is not alive)."""
        return self.failed is None and self._thread.is_alive()

    def _late(self) -> None:
        """An item put after the loop's last look at its inbox would wait for ever:
        once the loop has closed, the caller answers what is left (each item is taken
        from the queue once, by whichever side takes it)."""
        if self._closed.is_set():
            self._answer_queued(self._ending)

    def _answer_queued(self, ending: BaseException) -> None:
        while True:
            try:
                item = self._inbox.get(block=False)
            except queue.Empty:
                return
            if isinstance(item, _Call):
                item.done.put((False, ending))
            elif item is not _END:
                item[2](ending)

    def _refuse_if_stopped(self) -> None:
        if self.failed is not None:
            raise _broken(self.failed)
        if self._stopped.is_set():
            raise EngineLoopStopped("the engine loop is shut down")

    def generate(self, request, *, cancelled: Callable[[], bool] | None = None):
        last = None
        for last in self.submit(request, cancelled=cancelled, final_only=True):  # noqa: B007
            pass
        return last.result

    @staticmethod
    def _drain(out: queue.SimpleQueue) -> Iterator:
        while True:
            item = out.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.result is not None:
                return

    def _intake(self) -> None:
        """Add new requests; block only when there is nothing to step. An idle engine
        that gets a request waits a little for more (see the module's docstring)."""
        idle = not self.engine.has_work()
        deadline = None  # of an idle engine's wait for a burst
        try:
            item = self._inbox.get(block=idle)
            while item is not _END:
                if isinstance(item, _Call):
                    item.run(self.engine)
                else:
                    request, cancelled, sink = item
                    try:
                        self.engine.add_request(request, sink, cancelled=cancelled)
                    except BaseException as err:  # a bad request fails alone
                        sink(err)
                    if idle and deadline is None and self.batch_wait_s > 0:
                        deadline = time.monotonic() + _WAIT_ARRIVALS * self.batch_wait_s
                left = deadline - time.monotonic() if deadline is not None else 0.0
                if left > 0 and self.engine.has_work():
                    item = self._inbox.get(timeout=min(self.batch_wait_s, left))
                else:
                    item = self._inbox.get(block=False)
        except queue.Empty:
            pass

    def _run(self) -> None:
        try:
            self._serve()
            ending: BaseException = EngineLoopStopped("the engine loop was shut down")
            try:  # shut down: free every request's rows
                self.engine.abort_all(ending)
            except Exception as err:
                log.exception("freeing the requests' rows at shutdown failed")
                self.failed = err
        except BaseException as err:  # ending the requests of a failed step failed too
            log.exception("the engine loop failed and stops; its requests end")
            self.failed = err
        if self.failed is not None:
            ending = _broken(self.failed)
            self.engine.abandon_all(ending)  # answers them without touching their rows
        self._ending = ending
        self._stopped.set()
        self._closed.set()
        self._answer_queued(ending)  # everything still queued

    def _serve(self) -> None:
        while not self._stopped.is_set():
            self._intake()
            if self._stopped.is_set() or not self.engine.has_work():
                continue
            try:
                batch = self.engine.step()
            except Exception as err:  # a bug: end what was admitted, keep serving
                log.exception("an engine step failed: its admitted requests end")
                self.engine.abort_admitted(err)  # (if this raises too, the loop fails)
                batch = 0  # no decode step to record; the rows and waiting ones changed
            if self.on_step is not None:
                try:
                    self.on_step(self.engine, batch)
                except Exception:  # the step's bookkeeping (metrics): no request's fault
                    log.exception("the step's on_step callback failed")

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._stopped.set()
        self._inbox.put(_END)
        self._thread.join(timeout_s)
