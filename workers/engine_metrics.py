"""Engine-side metrics, recorded on rank 0 after every step (Ray exports them to
Prometheus with its `ray_` prefix). Names follow vLLM's scheduler gauges
(num_requests_running / num_requests_waiting) with our `cactus_` prefix; the
speculation policy's (workers/policy.py) are ours: the k it chose per row, by rule, and
the tokens it predicted against those the step gave. The work of cancelled requests is
counted here too: they end without a result, so the replica's per-request counters
(deployments/metrics.py) never see it."""

from __future__ import annotations

from collections import Counter

BATCH_BOUNDS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 128]
ROUND_TRIP_BOUNDS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0]


class EngineMetrics:
    def __init__(self) -> None:
        from ray.util import metrics

        self.running = metrics.Gauge(
            "cactus_num_requests_running", description="requests holding a batch row"
        )
        self.waiting = metrics.Gauge(
            "cactus_num_requests_waiting", description="requests waiting for a row or KV budget"
        )
        self.batch = metrics.Histogram(
            "cactus_batch_size",
            boundaries=BATCH_BOUNDS,
            description="rows in each decode step (one draft pass, one verifier forward)",
        )
        self.chosen_k = metrics.Counter(
            "cactus_spec_chosen_k",
            description="rows decoded with k drafted tokens (the policy's choice), by rule and k",
            tag_keys=("rule", "k"),
        )
        self.predicted = metrics.Counter(
            "cactus_spec_predicted_tokens",
            description="tokens the policy expected the decode steps to emit, by rule",
            tag_keys=("rule",),
        )
        self.realised = metrics.Counter(
            "cactus_spec_realised_tokens",
            description="tokens the decode steps' acceptance gave (accepted + 1 per row, as the "
            "policy predicts them; a stop may then cut a block), by rule",
            tag_keys=("rule",),
        )
        self.round_trip = metrics.Histogram(
            "cactus_draft_round_trip_seconds",
            boundaries=ROUND_TRIP_BOUNDS,
            description="draft<->verifier ProposeBatch round trips, send to reply (seconds)",
        )
        self.cancelled = {
            key: metrics.Counter(
                name,
                description=f"{text} of requests cancelled before a result, by rule",
                tag_keys=("rule",),
            )
            for key, name, text in (
                ("requests", "cactus_cancelled_requests", "count"),
                ("generated", "cactus_cancelled_generation_tokens", "tokens generated"),
                ("drafted", "cactus_cancelled_draft_tokens", "drafted tokens"),
                ("accepted", "cactus_cancelled_accepted_tokens", "accepted drafted tokens"),
            )
        }
        self.steps = 0

    def record(self, engine, batch_size: int) -> None:
        """After every step; after a failed one too (batch_size 0, its admitted requests
        ended): the gauges then drop the rows it held."""
        self.steps += 1
        take = getattr(engine.drafter, "take_round_trips", None)  # a remote drafter
        for seconds in take() if take is not None else ():
            self.round_trip.observe(seconds)
        # taken whatever the step did: a step that failed after its decode (batch 0) must
        # not leave its record to be counted as the next step's
        step, engine.last_step = engine.last_step, None
        if step is not None and batch_size:
            self.batch.observe(batch_size)
            chosen: Counter = Counter()
            predicted: Counter = Counter()
            realised: Counter = Counter()
            for rule, k, a, p in zip(
                step.rules, step.ks, step.accepted, step.predicted, strict=True
            ):
                chosen[rule, k] += 1
                predicted[rule] += p
                realised[rule] += a + 1
            for (rule, k), n in chosen.items():
                self.chosen_k.inc(n, tags={"rule": rule, "k": str(k)})
            for rule, n in predicted.items():
                self.predicted.inc(n, tags={"rule": rule})
                self.realised.inc(realised[rule], tags={"rule": rule})
        if engine.cancelled_work:  # rare: no new Counter on every step
            for (rule, key), n in engine.take_cancelled_work().items():
                if n:
                    self.cancelled[key].inc(n, tags={"rule": rule})
        sched = engine.scheduler
        self.running.set(sched.num_rows)
        self.waiting.set(len(sched.waiting))
