"""Service metrics through Ray Serve's metrics API (exported to Prometheus by Ray).

Names follow vLLM's spec-decode counters with our `cactus_` prefix; Ray adds its own
`ray_` prefix on export. Counters are labelled by acceptance rule.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict

from ray.serve import metrics

from cactus.errors import InvalidRequestError, ServerShuttingDownError, unwrap
from workers.engine_loop import EngineLoopStopped

LAST_TOKEN_ENTRIES = 4096  # far more than a replica's running requests
# up to an hour: a request may run as long as limits.request_timeout_s (600 s in
# configs/cluster.yaml), and a latency past the last bound is only +Inf
LATENCY_BOUNDS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
LATENCY_BOUNDS_S += [120, 300, 600, 1800, 3600]


def failure_reason(err: BaseException) -> str | None:
    """How `cactus_request_failure` counts a request that ended in `err` without a
    result. None: it was refused before it ran (a field or an id the engine refused, a
    replica past its drain cut), so it was never an accepted request and is not counted
    (nor cancelled by its id, which another request may hold). CANCELLED: a drain's cut
    stopped it; the engine stopped it by a cancel and counts its work among the
    cancelled (`cactus_cancelled_*`), as for a client that went away; a replica torn
    down with requests running (its engine loop stopped) is counted so too. ERROR
    otherwise."""
    err = unwrap(err)
    if isinstance(err, InvalidRequestError):
        return None
    if isinstance(err, ServerShuttingDownError):
        return None if err.refused else "CANCELLED"
    if isinstance(err, EngineLoopStopped):  # the replica torn down under it: as a cut
        return "CANCELLED"
    return "ERROR"


class ServiceMetrics:
    def __init__(self) -> None:
        rule = ("rule",)
        self.drafts = metrics.Counter(
            "cactus_spec_decode_num_drafts",
            description="verify steps with a draft block",
            tag_keys=rule,
        )
        self.draft_tokens = metrics.Counter(
            "cactus_spec_decode_num_draft_tokens", description="drafted tokens", tag_keys=rule
        )
        self.accepted = metrics.Counter(
            "cactus_spec_decode_num_accepted_tokens",
            description="accepted drafted tokens",
            tag_keys=rule,
        )
        self.accepted_pos = metrics.Counter(
            "cactus_spec_decode_num_accepted_tokens_per_pos",
            description="accepted drafted tokens by position",
            tag_keys=("rule", "position"),
        )
        self.divergence = metrics.Counter(
            "cactus_divergence_nats",
            description="summed d(h_n || q_n) of emitted tokens",
            tag_keys=rule,
        )
        self.draft_failures = metrics.Counter(
            "cactus_draft_failures", description="draft actor failures seen by requests"
        )
        self.degraded = metrics.Counter(
            "cactus_degraded_requests",
            description="requests that ran partly without drafts (draft actor failed)",
        )
        self.resumed = metrics.Counter(
            "cactus_resumed_requests",
            description="request resumptions on a rebuilt engine (a verifier rank died)",
        )
        self.engine_restarts = metrics.Counter(
            "cactus_engine_restarts",
            description="engine actor restarts begun by the supervisor (one per failure, "
            "whether it succeeds, is given up or ends the replica)",
            tag_keys=("actor",),
        )
        self.engine_serving = metrics.Gauge(
            "cactus_engine_serving",
            description="1 while the engine serves, 0 while it restarts or the replica drains",
        )
        self.requests = metrics.Counter(
            "cactus_request_success",  # vLLM's request_success{finished_reason}
            description="requests that ended with a result, by finish reason",
            tag_keys=("finished_reason",),
        )
        self.failures = metrics.Counter(
            "cactus_request_failure",
            description="accepted requests that ended without a result: CANCELLED (the "
            "client went away or gave up) or ERROR",
            tag_keys=("reason",),
        )
        self.prompt_tokens = metrics.Counter("cactus_prompt_tokens", description="prompt tokens")
        self.generation_tokens = metrics.Counter(
            "cactus_generation_tokens", description="generated tokens"
        )
        self.ttft = metrics.Histogram(
            "cactus_time_to_first_token_seconds",
            boundaries=LATENCY_BOUNDS_S,
            description="time to first token (a stream's first chunk; a unary call's first "
            "generated token, as its latency less the engine's time after that token)",
        )
        self.itl = metrics.Histogram(
            "cactus_inter_token_latency_seconds",
            boundaries=LATENCY_BOUNDS_S,
            description="time between streamed chunks",
        )
        self.e2e = metrics.Histogram(
            "cactus_e2e_request_latency_seconds",
            boundaries=LATENCY_BOUNDS_S,
            description="request latency",
        )
        self.running_gauge = metrics.Gauge(
            "cactus_running_requests", description="requests running on this replica"
        )
        self._running = 0
        # request id -> when its last token went out; bounded, since a request whose
        # client went away never reaches `finished` to remove its entry
        self._last: OrderedDict[str, float] = OrderedDict()

    def engine(self, stats: dict, seen: dict, *, draining: bool = False) -> None:
        """The supervisor's counters since the last call (`seen` keeps the last);
        `cactus_engine_serving` is 0 while the engine restarts or the replica drains."""
        serving = stats.get("state", "SERVING") == "SERVING" and not draining
        self.engine_serving.set(1 if serving else 0)
        for key, actor in (("draft_restarts", "draft"), ("rank_restarts", "ranks")):
            new = stats.get(key, 0) - seen.get(key, 0)
            if new > 0:
                self.engine_restarts.inc(new, tags={"actor": actor})
            seen[key] = stats.get(key, 0)

    @contextlib.contextmanager
    def running(self):
        self._running += 1
        self.running_gauge.set(self._running)
        try:
            yield
        finally:
            self._running -= 1
            self.running_gauge.set(self._running)

    def token_latency(self, request, start: float, first: bool) -> None:
        now = time.monotonic()
        if first:
            self.ttft.observe(now - start)
        else:
            self.itl.observe(now - self._last.get(request.request_id, now))
        self._last[request.request_id] = now
        self._last.move_to_end(request.request_id)
        while len(self._last) > LAST_TOKEN_ENTRIES:
            self._last.popitem(last=False)

    def ended(self, request, reason: str) -> None:
        """A request that ended without a result: CANCELLED (its client went away or
        gave up) or ERROR (a status other than OK after it was accepted)."""
        self._last.pop(request.request_id, None)
        self.failures.inc(tags={"reason": reason})

    def finished(self, request, result, start: float, unary: bool = False) -> None:
        """A request that ended with a result. `unary`: its tokens went out all at once,
        so no chunk timed its first token: that is its latency less the time the
        engine spent after the first token (one clock per difference, so the
        ingress and the engine need not share one). A resumed request's first token
        came on an earlier engine, whose time is not in the result: not observed."""
        rule = {"rule": request.speculation.rule}
        st = result.stats
        self._last.pop(request.request_id, None)
        if st.num_drafts:
            self.drafts.inc(st.num_drafts, tags=rule)
            self.draft_tokens.inc(st.num_draft_tokens, tags=rule)
        if st.num_accepted_tokens:
            self.accepted.inc(st.num_accepted_tokens, tags=rule)
        for pos, n in enumerate(st.accepted_per_position):
            if n:
                self.accepted_pos.inc(n, tags={**rule, "position": str(pos)})
        if st.divergence_nats > 0:
            self.divergence.inc(st.divergence_nats, tags=rule)
        if st.draft_failures:
            self.draft_failures.inc(st.draft_failures)
            self.degraded.inc()
        if st.resumed:
            self.resumed.inc(st.resumed)
        self.requests.inc(tags={"finished_reason": result.finish_reason})
        self.prompt_tokens.inc(result.prompt_tokens)
        if result.token_ids:
            self.generation_tokens.inc(len(result.token_ids))
        latency = time.monotonic() - start
        self.e2e.observe(latency)
        if unary and result.token_ids and not st.resumed:
            self.ttft.observe(max(latency - st.first_token_to_end_s, 0.0))
