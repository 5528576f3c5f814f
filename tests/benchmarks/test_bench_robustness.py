"""`make bench` and its parts end cleanly and say what they measured: a silent server
fails its start at the deadline, SIGTERM stops what a benchmark started, a phase that
raises leaves the rest of the report, a partial run never replaces the whole run's
report, and the quality arms run side by side. Fast: no model is loaded."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _server(script: str):
    """A ServerProcess around `python -c script` (no config, no Ray): wait_ready alone."""
    from benchmarks.load import ServerProcess

    server = ServerProcess.__new__(ServerProcess)
    server.proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return server


def test_a_server_silent_before_ready_fails_at_the_deadline():
    """`ServerProcess.wait_ready` used to check its deadline only when the server printed
    a line, so a server that hung before READY without output blocked the benchmark for
    ever."""
    server = _server("print('starting', flush=True); import time; time.sleep(60)")
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="not READY within 1 s") as info:
            server.wait_ready(timeout_s=1.0)
        assert time.monotonic() - t0 < 10
        assert "starting" in str(info.value)  # its last output comes with the error
    finally:
        server.proc.kill()
        server.proc.wait()


def test_a_server_that_exits_before_ready_fails_at_once():
    server = _server("print('bad config')")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="bad config"):
        server.wait_ready(timeout_s=60)
    assert time.monotonic() - t0 < 30
    server.proc.wait()


def test_a_ready_server_is_found_and_its_output_drained():
    # READY, then more output than a pipe holds: the reader must keep draining it
    server = _server(
        "print('READY 127.0.0.1:1 (ray 127.0.0.1:2)', flush=True); print('x' * 200_000)"
    )
    server.wait_ready(timeout_s=60)
    assert server.ray_address() == "127.0.0.1:2"
    assert server.proc.wait(timeout=30) == 0


def test_sigterm_runs_a_benchmarks_finally_blocks(tmp_path):
    """A benchmark killed by pid (or by `benchmarks.run`'s group stop) stops the server
    it started: `exit_on_sigterm` turns SIGTERM into SystemExit, so `finally` runs."""
    marker = tmp_path / "stopped"
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from benchmarks.load import exit_on_sigterm
        exit_on_sigterm()
        try:
            print("running", flush=True)
            time.sleep(60)
        finally:
            open({str(marker)!r}, "w").write("server stopped")
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "running"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert marker.read_text() == "server stopped"


def _run_main(tmp_path, argv):
    from benchmarks import run

    previous = signal.getsignal(signal.SIGTERM)
    try:
        return run.main([*argv, "--out", str(tmp_path)])
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_phase_that_raises_leaves_the_rest_of_the_report(monkeypatch, tmp_path):
    """An exception in one phase used to stop `make bench` before the report was written,
    losing every phase that had run. Now the report is written, the failed phase's
    section says why, and the run exits 1."""
    from benchmarks import run

    def broken(mode):
        raise RuntimeError("no server")

    monkeypatch.setattr(run, "quality_phase", broken)
    monkeypatch.setattr(run, "load_phase", lambda mode: [])
    code = _run_main(tmp_path, ["--tiny", "--skip-micro"])
    assert code == 1
    (report,) = tmp_path.glob("*.md")
    text = report.read_text()
    assert "(failed: RuntimeError: no server)" in text
    assert "## 1. Micro-benchmarks\n\n(skipped)" in text


def test_a_partial_run_is_named_after_the_phases_it_ran(monkeypatch, tmp_path):
    """README: `python -m benchmarks.run --skip-micro --skip-quality --skip-policy
    --skip-chaos` runs the load section alone; its report used to take the full run's
    name (`<date>-<host>.md`) and replace that day's whole report."""
    from benchmarks import run

    monkeypatch.setattr(run, "load_phase", lambda mode: [])
    argv = ["--skip-micro", "--skip-quality", "--skip-policy", "--skip-chaos"]
    assert _run_main(tmp_path, argv) == 0
    (report,) = tmp_path.glob("*.md")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-.+-load\.md", report.name), report.name


def test_the_quality_arms_run_side_by_side_in_rotated_order(monkeypatch):
    """Each method used to run all its tasks before the next method started (about 17
    methods over 20 minutes), so its tokens/s and the verifier-only denominator were
    measured minutes apart. Now every method gets a warm-up, then the tasks run one by
    one with their methods in an order that rotates; each method still sees every task
    with the task's own seed."""
    from benchmarks import quality
    from benchmarks.quality import Method, Task, evaluate

    calls = []

    class Out:
        text = "    return 1\n"
        token_ids = (1, 2)

        class stats:
            divergence_nats = 0.0
            num_drafts = 1
            num_accepted_tokens = 1

    class Engine:
        class verifier:
            runner = None

        class tokenizer:
            @staticmethod
            def encode(text, add_special_tokens=False):
                return [0]

        @staticmethod
        def generate(req):
            calls.append((req.speculation.rule, req.sampling.seed, req.sampling.max_tokens))
            return Out()

    monkeypatch.setattr(quality, "verifier_nll", lambda runner, prompt, out: 1.0)
    monkeypatch.setattr(quality, "completes", lambda prompt, text: True)
    methods = [Method("verifier-only", "none"), Method("sps", "sps"), Method("c", "cactus", 1.0)]
    tasks = [Task("m.py", f"f{i}", f"def f{i}():\n") for i in range(3)]
    results = evaluate(Engine, tasks, methods, max_tokens=32)
    warm, timed = calls[:3], calls[3:]
    assert [c[0] for c in warm] == ["none", "sps", "cactus"] and {c[2] for c in warm} == {8}
    # task by task, the methods' order rotating: none first, then sps first, then cactus
    assert [c[0] for c in timed] == [
        *("none", "sps", "cactus"),
        *("sps", "cactus", "none"),
        *("cactus", "none", "sps"),
    ]
    assert [c[1] for c in timed] == [1000] * 3 + [1001] * 3 + [1002] * 3
    assert [r.method.label for r in results] == ["verifier-only", "sps", "c"]
    assert all(r.n == 3 and r.tokens == 6 and r.compiled == 3 for r in results)
