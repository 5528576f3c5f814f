"""`make bench`: what Cactus buys and what it costs, in one report with plots.

    python -m benchmarks.run [--quick | --tiny] [--out benchmarks/results]
                             [--skip-micro] [--skip-quality] [--skip-load]
                             [--skip-policy] [--skip-chaos]

Writes benchmarks/results/<date>-<host>.md and PNG plots beside it (regenerated data,
never hand-edited). Phases:
  1. micro-benchmarks: kernels, engine acceptance, distributed, the batch sweep on the
     embedded pair and on a Qwen3-shaped pair with a 151,936-token vocabulary
  2. quality vs speed on held-out function completions (benchmarks/quality.py)
  3. serving load: 1/4/8/16 concurrent streaming gRPC clients (benchmarks/load.py)
  4. speculation policy: goodput vs fixed K = 0..8, served (benchmarks/bench_policy.py)
  5. chaos: engine actors killed under streaming load (benchmarks/bench_chaos.py)
  6. plots
--quick finishes in under 10 minutes on 2 cores (8.6 here; the report's first line gives
each phase's time); --tiny (used by the test suite) in
well under a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# load_warmup_s: each rule under the top level's load before the first measured cell;
# load_settle_s: unmeasured seconds at a cell's own load before its window
SETTINGS = {
    "full": {
        "tasks": 60,
        "max_tokens": 96,
        "levels": [1, 4, 8, 16],
        "seconds": 20.0,
        "load_warmup_s": 5.0,
        "load_settle_s": 2.0,
    },
    "quick": {
        "tasks": 6,
        "max_tokens": 48,
        "levels": [1, 4, 8, 16],
        "seconds": 3.0,
        "load_warmup_s": 2.0,
        "load_settle_s": 1.0,
    },
    "tiny": {
        "tasks": 2,
        "max_tokens": 8,
        "levels": [1],
        "seconds": 2.0,
        # a stream shorter than the window, so the window always sees one start (a 64-token
        # plain stream at 25 tok/s outlasted the 2 s window: 0 requests, once in CI)
        "load_max_tokens": 16,
        "load_warmup_s": 1.0,
        "load_settle_s": 0.5,
    },
}


class Progress:
    """A one-line progress bar on stderr with an ETA."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total, self.done, self.start = name, max(total, 1), 0, time.monotonic()

    def __call__(self) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        bar = "#" * int(30 * self.done / self.total)
        end = "\n" if self.done >= self.total else ""
        print(
            f"\r[{self.name}] [{bar:<30}] {self.done}/{self.total} eta {eta:5.0f}s",
            end=end,
            file=sys.stderr,
            flush=True,
        )


def micro(mode: str, stem: Path) -> tuple[str, list[str]]:
    """Run the micro-benchmarks as they are and collect their tables (and the batch
    sweep's plots, written beside the report)."""
    quick = ["--quick"] if mode != "full" else []
    plots = [Path(f"{stem}-batch-embedded.png"), Path(f"{stem}-batch-qwen3.png")]
    commands = [
        [sys.executable, "-m", "benchmarks.bench_kernels", *quick],
        [
            sys.executable,
            "-m",
            "benchmarks.bench_acceptance",
            *(["--prompts", "4", "--tokens", "32"] if mode != "full" else []),
        ],
        [sys.executable, "-m", "benchmarks.bench_distributed", *quick],
        [sys.executable, "-m", "benchmarks.bench_http", *quick],
        [sys.executable, "-m", "benchmarks.bench_batch", *quick, "--plot", str(plots[0])],
        [
            sys.executable,
            "-m",
            "benchmarks.bench_batch",
            "--pair",
            "qwen3",
            "--batches",
            "1,4,16,32" if mode == "full" else "1,4,16",
            "--max-tokens",
            "32",
            *quick,
            "--plot",
            str(plots[1]),
        ],
    ]
    out = []
    progress = Progress("micro", len(commands))
    for cmd in commands:
        t0 = time.monotonic()
        proc = _run(cmd)
        took = time.monotonic() - t0
        table = [ln for ln in proc.stdout.splitlines() if ln.startswith(("|", "#"))]
        shown = ["python", *[str(Path(c).name) if c.endswith(".png") else c for c in cmd[1:]]]
        out.append(
            f"`{' '.join(shown)}` ({took:.0f} s)\n\n"
            + "\n".join(
                table
                or [f"(failed, exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]})"]
            )
        )
        progress()
    return "\n\n".join(out), [p.name for p in plots if p.exists()]


def quality_phase(mode: str):
    import torch

    from benchmarks.quality import Method, default_methods, evaluate, function_tasks
    from cactus.environment import DEFAULT_DRAFT, DEFAULT_VERIFIER
    from workers.local import local_engine
    from workers.scheduler import SchedulerConfig

    torch.set_num_threads(2)
    s = SETTINGS[mode]
    # every method at its own K: quality vs speed of the rules, not of the policy
    engine = local_engine(
        str(DEFAULT_VERIFIER), str(DEFAULT_DRAFT), scheduler=SchedulerConfig(policy="fixed")
    )
    tasks = function_tasks(s["tasks"])
    methods = (
        [Method("verifier-only", "none"), Method("cactus d=1", "cactus", 1.0)]
        if mode == "tiny"
        else default_methods(quick=mode == "quick")
    )
    progress = Progress("quality", len(tasks) * len(methods))
    return tasks, evaluate(engine, tasks, methods, max_tokens=s["max_tokens"], progress=progress)


def load_phase(mode: str):
    from benchmarks.load import run_load, summary

    s = SETTINGS[mode]
    rules = ["cactus", "none"]
    progress = Progress("load", len(s["levels"]) * len(rules))
    results = run_load(
        s["levels"],
        rules,
        s["seconds"],
        max_tokens=s.get("load_max_tokens", 64),
        warmup_s=s["load_warmup_s"],
        settle_s=s["load_settle_s"],
        progress=progress,
    )
    return [summary(r) for r in results]


# Each sub-benchmark's time limit: bench_policy's full run takes about 65 minutes here
PHASE_LIMIT_S = 2 * 3600


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run one sub-benchmark in its own process group. Past PHASE_LIMIT_S the group (the
    benchmark and any server it started) gets SIGTERM, which drains and stops a server,
    then SIGKILL; the result says so (exit code "timed out") instead of raising, so the
    report of the phases that ran is still written."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=PHASE_LIMIT_S)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        out, err = _stop_group(proc)
        note = f"# (timed out after {PHASE_LIMIT_S} s: what it printed above is partial)"
        err = f"{err}\ntimed out after {PHASE_LIMIT_S} s"
        return subprocess.CompletedProcess(cmd, "timed out", f"{out}\n{note}\n", err)
    except BaseException:  # Ctrl-C or SIGTERM on make bench: its own group goes too
        _stop_group(proc)
        raise


def _stop_group(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM the process group (a server drains and stops), SIGKILL it after 120 s."""
    out = err = ""
    for sig, wait_s in ((signal.SIGTERM, 120), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            out, err = proc.communicate(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    return out or "", err or ""


def policy_phase(mode: str, stem: Path) -> tuple[str, list[str]]:
    """The policy benchmark as `make bench-policy` runs it (--quick in quick mode)."""
    plot = stem.with_name(stem.name + "-policy.png")
    quick = ["--quick"] if mode != "full" else []
    cmd = [sys.executable, "-m", "benchmarks.bench_policy", *quick, "--plot", str(plot)]
    proc = _run(cmd)
    table = [ln for ln in proc.stdout.splitlines() if ln.startswith(("|", "#"))]
    if not table:
        tail = proc.stderr.strip().splitlines()[-1:]
        return f"(failed, exit {proc.returncode}: {tail})", []
    text = f"`python -m benchmarks.bench_policy{' --quick' if quick else ''}`\n\n"
    return text + "\n".join(table), [plot.name] if plot.exists() else []


def chaos_phase(mode: str) -> str:
    """The chaos benchmark as `make bench-chaos` runs it (--quick in quick mode)."""
    cmd = [sys.executable, "-m", "benchmarks.bench_chaos", *(["--quick"] if mode != "full" else [])]
    proc = _run(cmd)
    table = [ln for ln in proc.stdout.splitlines() if ln.startswith(("|", "#"))]
    if not table:
        tail = proc.stderr.strip().splitlines()[-1:]
        return f"(failed, exit {proc.returncode}: {tail})"
    return f"`python -m benchmarks.bench_chaos{' --quick' if mode != 'full' else ''}`\n\n" + (
        "\n".join(table)
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="smoke run, under 10 minutes")
    group.add_argument("--tiny", action="store_true", help="harness self-test, seconds")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--skip-micro", action="store_true")
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-policy", action="store_true")
    parser.add_argument("--skip-chaos", action="store_true")
    args = parser.parse_args(argv)
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    from benchmarks.load import exit_on_sigterm
    from cactus import environment

    environment.apply()
    exit_on_sigterm()  # SIGTERM runs the `finally` that stops a phase's server too
    skips = {
        "micro": args.skip_micro,
        "quality": args.skip_quality,
        "load": args.skip_load,
        "policy": args.skip_policy or mode == "tiny",
        "chaos": args.skip_chaos or mode == "tiny",
    }
    ran = [name for name, skip in skips.items() if not skip]
    # a run that skips a phase its mode has gets the phases it ran in its name, so it
    # never replaces the whole run's report of the same day (README: the load section alone)
    applicable = [n for n in skips if not (mode == "tiny" and n in ("policy", "chaos"))]
    partial = "" if ran == applicable else "-" + "-".join(ran or ["none"])

    started = time.monotonic()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    host = socket.gethostname().split(".")[0] or "host"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{stamp}-{host}{'' if mode == 'full' else '-' + mode}{partial}.md"
    phases: dict[str, float] = {}  # seconds each phase took, for the report's first line
    failures: dict[str, str] = {}  # a phase that raised: the report says so, the rest stays

    def timed(name, run, empty):
        if skips[name]:
            return empty
        t0 = time.monotonic()
        try:
            result = run()
        except Exception as err:  # (not SystemExit / KeyboardInterrupt: those stop the run)
            traceback.print_exc()
            failures[name] = f"(failed: {type(err).__name__}: {err})"
            return empty
        phases[name] = time.monotonic() - t0
        return result

    stem = path.with_suffix("")
    micro_text, micro_plots = timed("micro", lambda: micro(mode, stem), ("", []))
    tasks, quality = timed("quality", lambda: quality_phase(mode), ([], []))
    load = timed("load", lambda: load_phase(mode), [])
    policy, policy_plots = timed("policy", lambda: policy_phase(mode, stem), ("", []))
    chaos = timed("chaos", lambda: chaos_phase(mode), "")

    from benchmarks.report import write_report

    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    write_report(
        path,
        mode=mode,
        machine=machine,
        micro=micro_text,
        tasks=tasks,
        quality=quality,
        load=load,
        seconds=time.monotonic() - started,
        settings=SETTINGS[mode],
        extra_plots=[*micro_plots, *policy_plots],
        command=" ".join(sys.argv[1:]),
        chaos=chaos,
        policy=policy,
        phases=phases,
        failures=failures,
    )
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
