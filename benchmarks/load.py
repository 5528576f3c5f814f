"""Serving load: N concurrent streaming gRPC clients against the server `make serve` runs.

The server is started as a subprocess (python -m deployments.serve, loopback only) with
the embedded models; for each rule and each concurrency level, N client threads stream
requests back to back for a fixed duration. Measured: output tokens/s over the window,
time to first token and inter-token latency (p50/p99), errors (must be 0).
"""

from __future__ import annotations

import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml

from client import CactusClient
from workers.tp_verifier import free_port

REPO = Path(__file__).resolve().parent.parent


@dataclass
class LoadResult:
    rule: str
    clients: int
    seconds: float
    tokens: int = 0
    requests: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit in a benchmark's main thread, so its `finally` blocks
    stop the server (and the Ray head) it started: a benchmark killed by pid, or by
    `benchmarks.run`'s group stop, leaves no server behind."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def speculation(**changes) -> dict:
    """The default config's speculation section with `changes` (ServerProcess's
    overrides replace whole top-level sections)."""
    spec = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())["speculation"]
    return {**spec, **changes}


class ServerProcess:
    """`python -m deployments.serve` with a temporary config; stopped with SIGINT."""

    def __init__(self, overrides: dict) -> None:
        self.port = free_port()
        config = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
        config.update(overrides)
        config["grpc_port"] = self.port
        self.http_port = config["http_port"] = free_port()
        self._dir = tempfile.TemporaryDirectory()
        path = Path(self._dir.name) / "serve.yaml"
        path.write_text(yaml.safe_dump(config))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deployments.serve", "--config", str(path)],
            cwd=REPO,
            # a fresh local Ray head, never a cluster this machine's last `ray start` (or
            # a killed test run) left in /tmp/ray/ray_current_cluster
            env={**os.environ, "RAY_ADDRESS": "local"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.address = f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300) -> None:
        """Wait for the server's READY line. The output is read on a thread, so a server
        that hangs before READY without printing anything still fails at the deadline
        (the process is then stopped by `stop`, which the callers run in `finally`)."""
        lines: queue.Queue[str | None] = queue.Queue()
        ready = threading.Event()

        def read() -> None:  # then drains the pipe for the server's life, keeping nothing
            for line in self.proc.stdout:
                if not ready.is_set():
                    lines.put(line)
                    if line.startswith("READY"):
                        ready.set()
            lines.put(None)  # end of output: the server exited

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        seen: list[str] = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            if line.startswith("READY"):
                self.ready_line = line
                return
            seen = [*seen[-29:], line]
        raise RuntimeError(
            f"server not READY within {timeout_s:.0f} s; its last output:\n" + "".join(seen)
        )

    def ray_address(self) -> str:
        """The server's Ray head, from its READY line ("... (ray ADDRESS)")."""
        import re

        return re.search(r"ray (\S+)\)", self.ready_line).group(1)

    def stop(self) -> None:
        self.proc.send_signal(2)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._dir.cleanup()


def run_level(
    address: str,
    rule: str,
    clients: int,
    seconds: float,
    *,
    max_tokens: int,
    warmup_s: float = 0.0,
    **request,
) -> LoadResult:
    """`clients` threads streaming back to back for `warmup_s` + `seconds`; only the
    last `seconds` are measured (tokens, TTFT, ITL of requests started in them), so a
    warm-up lets the server settle into this load after whatever ran before it.
    `request`: more request fields (num_speculative_tokens, delta)."""
    result = LoadResult(rule, clients, seconds)
    lock = threading.Lock()
    begin_at = time.monotonic() + warmup_s
    stop_at = begin_at + seconds

    def worker(idx: int) -> None:
        client = CactusClient(address, timeout=300)
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            start = last = time.monotonic()
            ttft, itl, tokens = None, [], 0
            try:
                for chunk in client.stream(
                    "def parse(text):",
                    max_tokens=max_tokens,
                    temperature=0.6,
                    top_k=20,
                    top_p=0.95,
                    seed=idx * 10_000 + n,
                    rule=rule,
                    **request,
                ):
                    now = time.monotonic()
                    if chunk.token_ids:
                        if ttft is None:
                            ttft = now - start
                        else:
                            itl.append((now - last) / len(chunk.token_ids))
                        last = now
                        # count only tokens produced inside the window
                        if begin_at <= now <= stop_at:
                            tokens += len(chunk.token_ids)
            except grpc.RpcError:
                with lock:
                    result.errors += 1
                continue
            with lock:
                result.tokens += tokens
                if start >= begin_at:  # latencies of the requests the window started
                    result.requests += 1
                    if ttft is not None:
                        result.ttft.append(ttft)
                    result.itl.extend(itl)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result


def run_load(
    levels: list[int],
    rules: list[str],
    seconds: float,
    *,
    max_tokens: int = 64,
    tp_size: int = 1,
    warmup_s: float = 5.0,
    settle_s: float = 2.0,
    progress=None,
) -> list[LoadResult]:
    server = ServerProcess(
        {
            "tp_size": tp_size,
            "limits": {"max_ongoing_requests": max(levels), "max_queued_requests": 4 * max(levels)},
        }
    )
    results = []
    try:
        server.wait_ready()
        # Warm-up: each rule under load before the first measured level, so the 1-client
        # cell (every ratio's denominator) does not carry the goodput policy's first
        # steps (PolicyConfig.warmup_steps, k cycled before its cost fits are used) or
        # the server's first requests; then every cell settles for `settle_s` at its own
        # load before its window, as bench_policy's cells do.
        for rule in rules:
            run_level(server.address, rule, max(levels), warmup_s, max_tokens=max_tokens)
        for clients in levels:
            for rule in rules:  # interleaved: the same load level back to back
                results.append(
                    run_level(
                        server.address,
                        rule,
                        clients,
                        seconds,
                        max_tokens=max_tokens,
                        warmup_s=settle_s,
                    )
                )
                if progress:
                    progress()
    finally:
        server.stop()
    return results


def summary(r: LoadResult) -> dict:
    return {
        "rule": r.rule,
        "clients": r.clients,
        "tokens_per_s": r.tokens_per_s,
        "requests": r.requests,
        "errors": r.errors,
        "ttft_p50": percentile(r.ttft, 0.5),
        "ttft_p99": percentile(r.ttft, 0.99),
        "itl_p50": percentile(r.itl, 0.5),
        "itl_p99": percentile(r.itl, 0.99),
        "itl_mean": statistics.mean(r.itl) if r.itl else float("nan"),
    }
