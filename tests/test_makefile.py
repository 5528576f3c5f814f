"""`make stop` is per port: it stops the server on PORT only, says when none runs, and
waits a bounded time."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _dry_run(*args: str) -> str:
    """`make -n ARGS`: what make would run (it must resolve)."""
    out = subprocess.run(
        ["make", "-n", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=60,
    )
    assert out.returncode == 0, (args, out.stderr)
    return out.stdout


def _make_stop(port: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "stop", f"PORT={port}", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=60,
    )


def test_make_stop_reports_when_no_server_runs_on_the_port(tmp_path):
    port = "59931"
    pid = REPO / ".cache" / f"serve-{port}.pid"
    pid.parent.mkdir(exist_ok=True)
    # A stale pid file (its process is gone) is cleaned up, not signalled.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    pid.write_text(str(dead.pid))
    out = _make_stop(port)
    assert out.returncode == 0, out.stderr
    assert f"no server running on port {port}" in out.stdout
    assert not pid.exists()


def test_make_stop_stops_only_the_server_on_its_port():
    port = "59932"
    pid = REPO / ".cache" / f"serve-{port}.pid"
    other = REPO / ".cache" / "serve-59933.pid"
    # Like deployments.serve, the stand-in server handles SIGINT itself and only then
    # has its pid file written: a process started in the background by a non-interactive
    # shell (`make test &`) inherits SIGINT ignored, so a signal sent earlier is lost.
    sleeper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "print('ready', flush=True); time.sleep(60)  # stands in for deployments.serve",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert sleeper.stdout.readline().strip() == "ready"
        pid.write_text(str(sleeper.pid))
        other.write_text(str(bystander.pid))
        # Reap the child as soon as it exits, or make's `kill -0` would see a zombie.
        reaper = threading.Thread(target=sleeper.wait)
        reaper.start()
        out = _make_stop(port)
        assert f"stopped the server on port {port}" in out.stdout, out.stdout + out.stderr
        reaper.join(timeout=10)
        assert sleeper.returncode not in (None, 0)  # ended by SIGINT
        assert bystander.poll() is None  # the server on another port runs on
    finally:
        bystander.kill()
        sleeper.kill()
        pid.unlink(missing_ok=True)
        other.unlink(missing_ok=True)


def test_make_stop_kills_a_server_that_outlasts_stop_timeout():
    """A server that does not exit after SIGINT (a wedged shutdown) is SIGKILLed after
    STOP_TIMEOUT seconds, and make stop fails saying so, rather than wait for ever."""
    port = "59937"
    pid = REPO / ".cache" / f"serve-{port}.pid"
    stuck = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(120)  # stands in for deployments.serve",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stuck.stdout.readline().strip() == "ready"
        pid.parent.mkdir(exist_ok=True)
        pid.write_text(str(stuck.pid))
        reaper = threading.Thread(target=stuck.wait)
        reaper.start()
        t0 = time.monotonic()
        out = _make_stop(port, "STOP_TIMEOUT=2")
        took = time.monotonic() - t0
        assert out.returncode != 0, out.stdout + out.stderr
        assert (
            f"the server on port {port} (pid {stuck.pid}) did not stop within 2s of SIGINT: "
            "killed it (SIGKILL)" in out.stderr
        ), out.stderr
        reaper.join(timeout=10)
        assert stuck.returncode == -signal.SIGKILL
        assert not pid.exists()
        assert 2 <= took < 30, took
    finally:
        stuck.kill()
        pid.unlink(missing_ok=True)


STUCK_RAY_SERVER = """
import signal, sys, time
sys.path.insert(0, ".")
from cactus import environment
environment.apply()
import ray
ray.init(address="local", num_cpus=1, include_dashboard=False)
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(300)  # stands in for deployments.serve, with the Ray head it started
"""


def test_make_stop_takes_the_ray_head_a_killed_server_started_with_it():
    """README: a server that outlasts STOP_TIMEOUT is SIGKILLed "with the Ray head it
    started": the head's GCS and raylet (started by the server's ray.init, which ties
    them to it) are gone soon after, none left holding the node's ports and resources
    (the raylet's workers go with it; Ray's agent processes notice the raylet's end by
    themselves, about 70 s later here: neither asserted here)."""
    import psutil

    port = "59938"
    pid = REPO / ".cache" / f"serve-{port}.pid"
    stuck = subprocess.Popen(
        [sys.executable, "-c", STUCK_RAY_SERVER], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert stuck.stdout.readline().strip() == "ready"
        head = psutil.Process(stuck.pid).children(recursive=True)
        # the head proper, named now (a process reaped later has no name to read)
        core = [p for p in head if p.name() in ("gcs_server", "raylet")]
        assert sorted(p.name() for p in core) == ["gcs_server", "raylet"], head
        pid.parent.mkdir(exist_ok=True)
        pid.write_text(str(stuck.pid))
        out = _make_stop(port, "STOP_TIMEOUT=2")
        assert out.returncode != 0 and "killed it (SIGKILL)" in out.stderr, out.stderr
        stuck.wait(timeout=10)

        def gone(p) -> bool:
            try:
                return p.status() == psutil.STATUS_ZOMBIE  # ended, not reaped
            except psutil.NoSuchProcess:
                return True

        deadline = time.monotonic() + 30
        while not all(gone(p) for p in core) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert all(gone(p) for p in core), [(p.pid, p.name()) for p in core if not gone(p)]
    finally:
        stuck.kill()
        stuck.wait(timeout=10)
        pid.unlink(missing_ok=True)


def test_make_clean_refuses_while_a_server_runs(tmp_path):
    """make clean removes the cache, where make stop finds a server's pid: it refuses
    while the server runs, and cleans once it has gone (in a scratch directory, cache
    and virtual environment, so that a failure cannot remove the real ones)."""
    cache, venv = tmp_path / "cache", tmp_path / "venv"
    cache.mkdir()
    venv.mkdir()
    port = "59939"
    server = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)  # stands in for deployments.serve"]
    )

    def clean() -> subprocess.CompletedProcess:
        return subprocess.run(
            ["make", "-s", "-f", str(REPO / "Makefile"), "clean", f"CACHE={cache}", f"VENV={venv}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env=os.environ.copy(),
        )

    try:
        (cache / f"serve-{port}.pid").write_text(str(server.pid))
        refused = clean()
        assert refused.returncode != 0
        assert f"a server is running on port {port} (pid {server.pid})" in refused.stderr
        assert f"make stop PORT={port} first" in refused.stderr
        assert cache.exists() and venv.exists()
        server.kill()
        server.wait(timeout=10)
        done = clean()
        assert done.returncode == 0, done.stderr
        assert not cache.exists() and not venv.exists()
    finally:
        server.kill()


def test_make_stop_never_signals_a_process_that_is_not_a_server():
    """A pid file left by a server that was SIGKILLed (or a reboot) may name a pid some
    other process has since taken: make stop removes it and signals nothing."""
    port = "59938"
    pid = REPO / ".cache" / f"serve-{port}.pid"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid.parent.mkdir(exist_ok=True)
        pid.write_text(str(bystander.pid))
        out = _make_stop(port)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"pid {bystander.pid} is not a cactus server" in out.stderr, out.stderr
        assert f"no server running on port {port}" in out.stdout, out.stdout
        assert bystander.poll() is None and not pid.exists()
    finally:
        bystander.kill()
        pid.unlink(missing_ok=True)


def test_make_stop_with_a_config_it_cannot_read_refuses(tmp_path):
    """`make stop CONFIG=<typo>` fell back to port 9000 and stopped the server there,
    which may be another one than meant: it now fails (exit 2) naming the config, and
    signals nothing."""
    missing = tmp_path / "nope.yaml"
    out = subprocess.run(
        ["make", "-s", "stop", f"CONFIG={missing}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"CONFIG={missing} cannot be read" in out.stderr, out.stderr
    assert "config error:" in out.stderr and "port" not in out.stdout, out.stdout


def test_make_stops_wait_is_bounded_by_the_configs_drain_time(tmp_path):
    """STOP_TIMEOUT's default is the config's recovery.drain_timeout_s + 60, read after
    the SIGINT is sent (make expands a recipe before running it: a $(shell) bound delayed
    the signal, and so the drain, by a Python start and a config load)."""
    cfg = tmp_path / "short-drain.yaml"
    cfg.write_text("grpc_port: 59938\nrecovery:\n  drain_timeout_s: 5\n")

    def default_bound(path) -> str:
        return subprocess.run(
            [sys.executable, "-m", "configs.schema", "--stop-timeout", str(path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()

    recipe = _dry_run("stop", f"CONFIG={cfg}")
    signal_at = recipe.index("kill -INT")
    assert recipe.index(f'-m configs.schema --stop-timeout "{cfg}"') > signal_at
    assert "-ge $bound ]" in recipe
    assert default_bound(cfg) == "65"
    assert default_bound(REPO / "configs" / "default.yaml") == "90"  # drain 30 s
    assert "bound=7;" in _dry_run("stop", f"CONFIG={cfg}", "STOP_TIMEOUT=7")


@pytest.mark.parametrize("timeout", ["1.5", "abc", "-3"])
def test_make_stop_refuses_a_stop_timeout_that_is_not_whole_seconds(timeout):
    """A STOP_TIMEOUT the shell's -ge cannot compare failed that test every second, so
    the SIGKILL bound never came and make stop could wait for ever: it is refused (exit
    2, named) before anything is signalled."""
    out = _make_stop("59936", f"STOP_TIMEOUT={timeout}")
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"STOP_TIMEOUT must be a whole number of seconds, got '{timeout}'" in out.stderr
    assert "no server running" not in out.stdout


@pytest.mark.parametrize("prompt", ['print("hi") $x `date` it\'s', "-x", "--json"])
def test_make_generate_passes_the_prompt_as_written(prompt):
    """`make generate PROMPT=...` with quotes, $ and backticks (code prompts have them),
    or starting with "-": `cactus generate` gets the prompt unchanged (make expanded $x,
    the shell split on quotes and ran backticks; argparse took "-x" for an option)."""
    import shlex

    from client.cli import build_parser

    recipe = _dry_run("generate", f"PROMPT={prompt}")
    line = next(ln for ln in recipe.splitlines() if "client.cli generate" in ln)
    argv = shlex.split(line)
    assert argv[argv.index("client.cli") + 1 :][:2] == ["generate", f"--prompt={prompt}"], line
    args = build_parser().parse_args(argv[argv.index("client.cli") + 1 :])
    assert args.prompt == prompt


def test_serve_and_stop_take_the_configs_grpc_port_unless_port_is_given(tmp_path):
    """`make serve CONFIG=x.yaml` serves on x.yaml's grpc_port (no --port overriding it),
    and `make stop CONFIG=x.yaml` stops that server; PORT= overrides both."""
    config = tmp_path / "x.yaml"
    config.write_text("grpc_port: 59934\nhttp_port: 59935\n")

    def dry(*args: str) -> str:
        return _dry_run(*args, f"CONFIG={config}")

    serve = [ln for ln in dry("serve").splitlines() if "deployments.serve" in ln]
    assert serve and "--port" not in serve[-1] and "--http-port" not in serve[-1], serve
    assert "--http-port 59937" in dry("serve", "HTTP_PORT=59937")  # README: HTTP_PORT=
    assert "serve-59934.pid" in dry("stop")
    assert "--port 59936" in dry("serve", "PORT=59936")
    assert "serve-59936.pid" in dry("stop", "PORT=59936")


def test_every_make_target_the_readme_names_exists_and_its_benchmark_takes_its_flags():
    """Each `make X` in the README is a Makefile target (a dry run resolves it), and
    every `python -m benchmarks.*` command those targets run (QUICK=1 too) names a
    module whose --help lists each flag the Makefile passes."""
    import re

    readme = (REPO / "README.md").read_text()
    targets = sorted(set(re.findall(r"`make ([a-z][a-z-]*[a-z])", readme)))
    assert {"serve", "stop", "bench", "bench-chaos", "gpu-check"} <= set(targets), targets
    commands: set[tuple[str, tuple[str, ...]]] = set()
    for target in targets:
        for quick in ([], ["QUICK=1"]):
            for line in _dry_run(target, *quick).splitlines():
                if m := re.search(r"-m (benchmarks\.\w+)(.*)", line):
                    flags = tuple(re.findall(r"(?<!\S)--[a-z][a-z-]*", m.group(2)))
                    commands.add((m.group(1), flags))
    modules = {module for module, _ in commands}
    assert {"benchmarks.bench_chaos", "benchmarks.run", "benchmarks.bench_batch"} <= modules
    helps: dict[str, str] = {}
    for module, flags in sorted(commands):
        if module not in helps:
            shown = subprocess.run(
                [sys.executable, "-m", module, "--help"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert shown.returncode == 0, (module, shown.stderr[-2000:])
            helps[module] = shown.stdout
        for flag in flags:
            assert flag in helps[module], (module, flag)


def test_quick_is_on_only_when_set_to_a_yes():
    """`QUICK=1` (or yes / true) runs a benchmark in its quick mode; `QUICK=0` and an
    unset QUICK do not (make's `$(if ...)` alone took any value, 0 included, for on)."""
    for quick, want in (([], False), (["QUICK=0"], False), (["QUICK=1"], True)):
        dry = _dry_run("bench-policy", *quick)
        assert ("--quick" in dry) == want, (quick, dry)
