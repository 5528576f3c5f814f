"""`make bench` cannot rot: run the harness on its tiny setting (quality + load + plots)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_tiny_bench_writes_a_report_with_plots(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--tiny", "--skip-micro", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # micro skipped: the phases that ran are in the name, so a partial run never
    # replaces the whole run's report
    reports = list(tmp_path.glob("*-tiny-quality-load.md"))
    assert len(reports) == 1 and len(list(tmp_path.glob("*.md"))) == 1
    text = reports[0].read_text()
    # the first line gives the time of each phase that ran (micro was skipped)
    spent = re.search(r"Wall time [\d.]+ min \(quality (\d+) s, load (\d+) s\)\.", text)
    assert spent, text.splitlines()[2]
    rows = [
        ln
        for ln in text.splitlines()
        if ln.startswith("| verifier-only") or ln.startswith("| cactus d=1")
    ]
    assert len(rows) == 2
    load_rows = re.findall(
        r"^\| 1 \| (cactus|none) \| ([\d.]+) \| 1.00x \| (\d+) \| (\d+) \|", text, re.MULTILINE
    )
    assert {r[0] for r in load_rows} == {"cactus", "none"}
    assert all(float(r[1]) > 0 and int(r[2]) > 0 and r[3] == "0" for r in load_rows)
    pngs = sorted(p.name.split("-tiny-quality-load-")[1] for p in tmp_path.glob("*.png"))
    assert pngs == [
        "acceptance-vs-delta.png",
        "frontier-compile.png",
        "frontier-nll.png",
        "load.png",
        "speed-vs-delta.png",
    ]


def test_batch_sweep_prints_every_rule_and_batch_size():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_batch", "--batches", "1,2", "--max-tokens", "6"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(
        r"^\| (none|sps|cactus|cactus_exact) \| (\d+) \| ([\d.]+) \|", proc.stdout, re.M
    )
    assert {(r[0], r[1]) for r in rows} == {
        (rule, b) for rule in ("none", "sps", "cactus", "cactus_exact") for b in ("1", "2")
    }
    assert all(float(r[2]) > 0 for r in rows)
    assert "# plain decoding overtakes" in proc.stdout and "peak resident" in proc.stdout


def test_policy_bench_measures_every_fixed_k_and_the_policy(tmp_path):
    """`make bench-policy` cannot rot: a real server (its policy switched between fixed
    and goodput), one level, every cell measured with 0 errors, the table and the plot
    written."""
    plot = tmp_path / "policy.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_policy",
            *(
                "--levels",
                "1",
                "--seconds",
                "0.8",
                "--rounds",
                "1",
                "--warmup",
                "0.8",
                "--settle",
                "0.3",
            ),
            *("--plot", str(plot)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = re.findall(
        r"^\| 1 \| (cactus:1|sps) \| ([^|]+)\|([^|]+)\|([^|]+)\|([^|]+)\|([^|]+)\| ([\d.]+) \| "
        r"([\d.]+)x \(K=(\d)\) \| [\d.]+ \| ([\d.]+) \|",
        proc.stdout,
        re.M,
    )
    assert {r[0] for r in rows} == {"cactus:1", "sps"}, proc.stdout
    for r in rows:
        fixed = [float(c.strip().strip("*()")) for c in r[1:6]]
        assert all(v > 0 for v in fixed) and float(r[6]) > 0
        # the table shows tokens/s to 0.1 and the ratio to 0.001: the ratio of the shown
        # figures may differ from the shown ratio by their rounding (0.05 each, relative)
        goodput, best = float(r[6]), max(fixed)
        slack = 6e-4 + goodput / best * 0.05 * (1 / goodput + 1 / best)
        assert float(r[7]) == pytest.approx(goodput / best, abs=slack)
        assert int(r[8]) in (0, 2, 4, 6, 8) and 0 <= float(r[9]) <= 8
    paired = re.findall(r"(\d+) (cactus|sps) ([\d.]+)x \+- ([\d.]+)", proc.stdout)
    assert {p[1] for p in paired} == {"cactus", "sps"}, proc.stdout
    for p in paired:  # one round: the paired ratio is that round's ratio
        row = next(r for r in rows if r[0].startswith(p[1]))
        assert float(p[2]) == pytest.approx(float(row[7]), abs=2e-3)
    assert plot.exists() and plot.stat().st_size > 10_000


def test_the_held_out_best_fixed_k_is_chosen_and_measured_on_different_rounds():
    """K is picked on the even rounds and measured on the odd ones, and the other way
    round: a K that led by luck on one half does not carry its lucky rounds along."""
    from benchmarks.bench_policy import _held_out_best

    series = {2: [100.0, 90.0, 100.0, 90.0], 4: [95.0, 97.0, 95.0, 97.0], 6: [50.0, 60.0]}
    # even rounds pick K=2 (100 > 95), measured on odd: 90; odd rounds pick K=4 (97 > 90),
    # measured on even: 95
    assert _held_out_best(series) == pytest.approx((90.0 + 95.0) / 2)
    # the plain best mean (K=4, 96) is higher: the maximum of noisy means overstates
    assert max(sum(v) / len(v) for v in series.values()) == pytest.approx(96.0)
    assert _held_out_best({2: [100.0], 4: [90.0]}) is None


def test_the_chance_that_a_tying_policy_passes_falls_with_the_noise():
    """Without round-to-round spread a policy as fast as the best fixed K always passes
    0.97x; with near-tied Ks and a large spread the largest fixed mean overstates the
    best and the same policy often fails."""
    from benchmarks.bench_policy import _tie_pass_chance

    quiet = {6: [100.0] * 10, 8: [100.0] * 10, 4: [90.0] * 2}
    assert _tie_pass_chance(quiet, 10) == 1.0
    noisy = {
        6: [100.0 + (20.0 if i % 2 else -20.0) for i in range(10)],
        8: [100.0 + (20.0 if i % 2 else -20.0) for i in range(10)],
    }
    chance = _tie_pass_chance(noisy, 10)
    assert 0.2 < chance < 0.8
    # the same spread on one K only (no rival to be lucky) passes more often
    assert _tie_pass_chance({8: noisy[8]}, 10) > chance
    assert _tie_pass_chance(noisy, 10) == chance  # fixed seed


def test_policy_bench_gives_the_noisier_low_load_levels_more_rounds():
    """By default 1 and 4 clients get twice the rounds of 8 and 16 (their rounds move
    about twice as much); --rounds sets every level, and the header says which."""
    import argparse

    from benchmarks.bench_policy import ROUNDS, ROUNDS_AT, _rounds_text

    assert ROUNDS_AT[1] == ROUNDS_AT[4] == 2 * ROUNDS and 8 not in ROUNDS_AT
    ns = argparse.Namespace(rounds_at={1: 20, 4: 20, 8: 10, 16: 10})
    assert _rounds_text(ns) == "20 (1, 4 clients) / 10 (8, 16 clients)"
    assert _rounds_text(argparse.Namespace(rounds_at={1: 3, 8: 3})) == "3"


def test_policy_bench_stops_measuring_only_clearly_slower_fixed_ks():
    """The race keeps goodput, every fixed K within the margin of its rule's best, and
    rule none while either rule keeps it; what drops out keeps the rounds it had."""
    from benchmarks.bench_policy import _race

    active = [("none", 0)] + [(r, k) for r in ("cactus", "sps") for k in (2, 4, 6, 8, "goodput")]
    means = {
        ("none", 0): 50.0,
        ("cactus", 2): 80.0,
        ("cactus", 4): 95.0,
        ("cactus", 6): 99.0,
        ("cactus", 8): 100.0,
        ("sps", 2): 56.0,
        ("sps", 4): 60.0,
        ("sps", 6): 53.0,
        ("sps", 8): 50.0,
        ("cactus", "goodput"): 10.0,
        ("sps", "goodput"): 10.0,
    }
    cells = {key: [v * 0.98, v * 1.02] for key, v in means.items()}
    kept = _race(active, cells, 0.9)
    assert kept == [
        ("cactus", 4),
        ("cactus", 6),
        ("cactus", 8),
        ("cactus", "goodput"),
        ("sps", 2),
        ("sps", 4),
        ("sps", "goodput"),
    ]
    cells["none", 0] = [57.0, 57.0]  # within 0.9x of sps's best: measured on
    assert ("none", 0) in _race(active, cells, 0.9)


def test_a_load_level_measures_only_the_window_after_its_settle_time():
    """`run_level(warmup_s=...)`: the clients stream from the start, but only tokens
    that arrive after the settle time count. Against a real gRPC server on 127.0.0.1
    that sends one token per 20 ms (it cannot go faster), two clients can deliver at
    most 2 x 0.6 s / 20 ms = 60 tokens in the 0.6 s window (plus one in flight each),
    where counting from the start would allow up to 110."""
    import threading
    import time
    from concurrent import futures

    import grpc

    from benchmarks.load import run_level
    from protos.cactus.v1 import cactus_pb2 as pb
    from protos.cactus.v1 import cactus_pb2_grpc as pb_grpc

    class Paced(pb_grpc.CactusServicer):
        def __init__(self) -> None:
            self.started: list[float] = []
            self.lock = threading.Lock()

        def GenerateStream(self, request, context):
            with self.lock:
                self.started.append(time.monotonic())
            for i in range(8):
                time.sleep(0.02)
                yield pb.GenerateResponse(
                    request_id="r",
                    text="x",
                    token_ids=[i],
                    finish_reason="LENGTH" if i == 7 else "",
                )

    servicer = Paced()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_CactusServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        begin = time.monotonic()
        res = run_level(f"127.0.0.1:{port}", "sps", 2, 0.6, max_tokens=8, warmup_s=0.5)
    finally:
        server.stop(grace=None)
    assert res.errors == 0 and res.seconds == 0.6
    # at most 2 clients x 0.6 s / 20 ms = 60, with room for a stalled client (the
    # settle time's tokens counted would make it about 110)
    assert 0 < res.tokens <= 70, res.tokens
    # the clients were streaming during the settle time already
    assert min(servicer.started) < begin + 0.45  # (the settle time is 0.5 s)
    # latencies come from the requests the window started only
    assert 0 < res.requests < len(servicer.started) and len(res.ttft) == res.requests


def test_the_policy_statistics_cover_the_measured_window_only():
    """bench_policy reads rank 0's policy statistics as a cell's settle time ends and as
    its window ends, not before the settle time and after the streams drained: the
    mean k and predicted / realised ratios then cover the steps the tokens/s counts.
    A stub cell: 0.4 s of settle time at k = 1, a 0.6 s window at k = 8, then 0.4 s
    of draining streams at k = 1; the window's statistics show k = 8 only."""
    import threading
    import time

    from benchmarks.bench_policy import _in_window

    lock = threading.Lock()
    stats = {"steps": 0, "predicted_time_s": 0.0, "realised_time_s": 0.0, "chosen_k": {}}

    def snapshot():
        with lock:
            rows = stats["steps"]
            return {
                "steps": stats["steps"],
                "predicted_time_s": stats["predicted_time_s"],
                "realised_time_s": stats["realised_time_s"],
                "groups": {
                    "cactus:1": {
                        "rows": rows,
                        "chosen_k": dict(stats["chosen_k"]),
                        "predicted_tokens": 2.0 * rows,
                        "realised_tokens": rows,
                    }
                }
                if rows
                else {},
            }

    def cell():  # a step every 10 ms: k = 1, but k = 8 in the window [0.4 s, 1.0 s)
        start = time.monotonic()
        while (now := time.monotonic() - start) < 1.4:
            k = 8 if 0.4 <= now < 1.0 else 1
            with lock:
                stats["steps"] += 1
                stats["chosen_k"][k] = stats["chosen_k"].get(k, 0) + 1
                stats["predicted_time_s"] += 0.01
                stats["realised_time_s"] += 0.02
            time.sleep(0.01)
        return "result"

    result, window = _in_window(cell, 0.4, 0.6, snapshot)
    assert result == "result"
    g = window["groups"]["cactus:1"]
    assert set(g["chosen_k"]) <= {1, 8}
    # a timer thread's sleeps may end a few steps late on a busy machine; the whole run
    # (settle time and drain included) gives mean k near 4 (80 steps at 1, 60 at 8)
    ones, eights = g["chosen_k"].get(1, 0), g["chosen_k"].get(8, 0)
    assert eights >= 20 and ones <= 0.2 * (ones + eights), g["chosen_k"]
    assert g["mean_k"] > 6.0, g
    assert 20 <= window["steps"] <= 70, window["steps"]
    assert window["realised_time_s"] == pytest.approx(2 * window["predicted_time_s"])

    def broken():
        raise RuntimeError("rank 0 is gone")

    with pytest.raises(RuntimeError, match="rank 0 is gone"):
        _in_window(lambda: None, 0.0, 0.0, broken)


def test_the_policy_replay_charges_each_policy_its_counterfactual_tokens():
    """benchmarks.policy_replay on made-up traces: a row that accepts all 8 wants K = 8
    at every cost, one that accepts none wants K = 0; the replayed policy learns either
    (its group warmed on a quarter of the requests) and the fixed-K ratios follow
    min(a, k) + 1 tokens per step of cost 1 + r k."""
    from benchmarks.policy_replay import replay

    always = [[8] * 10 for _ in range(8)]
    got = replay(always, "sps", 0.27)
    assert got["K=8"] == 1.0 and got["policy"] > 0.97 and got["state oracle"] == 1.0
    assert got["K=4"] == pytest.approx((5 / (1 + 0.27 * 4)) / (9 / (1 + 0.27 * 8)))
    never = [[0] * 10 for _ in range(8)]
    got = replay(never, "sps", 0.27)
    assert got["K=0"] == 1.0 and got["policy"] > 0.97
    assert got["K=8"] == pytest.approx(1 / (1 + 0.27 * 8))


def test_the_policy_replay_collects_real_traces():
    """One batch of 8 short requests per group on the embedded pair: every request left
    its steps' accepted counts, each in 0..8, and the report has a row per group and
    cost ratio."""
    from benchmarks.policy_replay import GROUPS, RATIOS, collect, report

    traces = collect(1, 24)
    for *_, group in GROUPS:
        assert len(traces[group]) == 8  # every request's first step drafts K = 8
        assert all(0 <= a <= 8 for counts in traces[group] for a in counts)
    rows = [ln for ln in report(traces) if ln.startswith("| sps") or ln.startswith("| cactus")]
    assert len(rows) == len(GROUPS) * len(RATIOS)


def test_the_chaos_bench_tells_a_stopped_process_from_an_ended_one():
    """bench_chaos's hang faults (workers.processes.is_running): a SIGSTOPped process is
    still alive (the engine must
    end it), a killed and reaped one is not, nor a pid with another start time; the
    report's table shows each hang's outcome and how many stopped processes were left."""
    import signal

    from benchmarks.bench_chaos import markdown
    from workers.processes import _start_time, identity, is_running

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        ident = {"pid": proc.pid, "start": _start_time(proc.pid)}
        start = ident["start"]
        proc.send_signal(signal.SIGSTOP)
        assert is_running(ident)
        assert not is_running({**ident, "start": start + 1})
        proc.kill()
        proc.wait()
        assert not is_running(ident)
    finally:
        proc.kill()
        proc.wait()
    assert is_running(identity())
    report = {
        "clients": 2,
        "duration_s": 10.0,
        "requests": 3,
        "ok": 3,
        "resumed": 1,
        "degraded": 1,
        "failed": {},
        "greedy_equal": 1,
        "greedy_checked": 1,
        "tokens_lost": 0,
        "tokens_duplicated": 0,
        "longest_check_s": 0.1,
        "stopped_processes_left": 0,
        "kills": [
            {"role": "rank0", "at_s": 1.0, "recovered_s": 7.0, "health_left_serving": True},
            {"role": "rank1", "at_s": 5.0, "recovered_s": None, "health_left_serving": True},
            {"role": "draft", "at_s": 9.0, "recovered_s": 12.0},
            {
                "role": "hang-draft",
                "at_s": 20.0,
                "recovered_s": 18.0,
                "health_left_serving": False,
                "stopped_process_ended": True,
            },
            {
                "role": "draft+rank0",
                "at_s": 40.0,
                "recovered_s": 16.5,
                "rank0_after_s": 0.4,
                "serving_s": 9.1,
                "drafting_s": 16.5,
                "health_left_serving": True,
            },
            {
                "role": "draft+hang-rank0",
                "at_s": 70.0,
                "recovered_s": None,
                "rank0_after_s": 0.3,
                "serving_s": None,
                "drafting_s": 30.2,
                "health_left_serving": True,
                "stopped_process_ended": False,
            },
        ],
    }
    text = markdown(report)
    assert (
        "| draft+hang-rank0 | 70.0 | not recovered (rank 0 stopped at 0.3; serving at None, "
        "drafting at 30.2) | True | False |" in text
    )
    # the compound fault gives both parts of its recovery
    assert (
        "| draft+rank0 | 40.0 | 16.5 (rank 0 killed at 0.4; serving at 9.1, drafting at 16.5) "
        "| True |  |" in text
    )
    assert "| hang-draft | 20.0 | 18.0 | False | True |" in text
    assert "| rank0 | 1.0 | 7.0 | True |  |" in text
    # a fault it did not recover from within the deadline is not given a time, and a
    # health outcome not measured is not printed as one
    assert "| rank1 | 5.0 | not recovered | True |  |" in text
    assert "| draft | 9.0 | 12.0 | - |  |" in text
    assert "sampled streams by count" in text
    assert "stopped processes left at the end: 0" in text


def test_a_sub_benchmark_past_its_limit_is_stopped_with_what_it_started(monkeypatch):
    """`make bench` runs each sub-benchmark with a time limit (bench_policy alone takes
    about 65 minutes): one that passes it is reported as timed out, with the processes it
    started (a server) stopped, instead of an exception that loses the whole report."""
    import os
    import time

    from benchmarks import run

    monkeypatch.setattr(run, "PHASE_LIMIT_S", 2)
    child = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print('| started', p.pid, flush=True); time.sleep(120)"
    )
    t0 = time.monotonic()
    proc = run._run([sys.executable, "-c", child])
    assert time.monotonic() - t0 < 60
    assert proc.returncode == "timed out" and "timed out after 2 s" in proc.stderr
    assert "| started" in proc.stdout  # what it printed, then the report's note
    assert proc.stdout.splitlines()[-1].startswith("# (timed out after 2 s")
    (started,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("| started")]
    grandchild = int(started.split()[-1])
    deadline = time.monotonic() + 10
    stat = Path(f"/proc/{grandchild}/stat")
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
            # a zombie (ended, not yet reaped by whoever adopted it) counts as gone
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except (ProcessLookupError, FileNotFoundError):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the sub-benchmark's own child {grandchild} outlived it")
