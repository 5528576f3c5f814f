"""Engine-side metrics, recorded on rank 0 after every step (Ray exports them to
Prometheus with its `ray_` prefix). Names follow vLLM's scheduler gauges
(num_requests_running / num_requests_waiting) with our `cactus_` prefix."""

from __future__ import annotations

BATCH_BOUNDS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 128]


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
        self.steps = 0

    def record(self, engine, batch_size: int) -> None:
        self.steps += 1
        if batch_size:
            self.batch.observe(batch_size)
        sched = engine.scheduler
        self.running.set(sched.num_rows)
        self.waiting.set(len(sched.waiting))
