"""The launcher while it starts: a server whose placement the cluster cannot satisfy
waits (Serve expects an autoscaler to add the resources), says what it waits for, and
`make stop` reaches it through its pid file, written before the start."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import yaml

from deployments.serve import pidfile
from tests.conftest import embedded_dirs
from tests.deployments.test_serve_e2e import REPO, make
from workers.tp_verifier import free_port

pytestmark = pytest.mark.slow


def _serve(config_path, **env: str) -> subprocess.Popen:
    """The launcher on `config_path`, its output (stdout and stderr) on a text pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "deployments.serve", "--config", str(config_path)],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_server_that_cannot_be_placed_says_so_and_make_stop_ends_it(tmp_path):
    verifier, draft = embedded_dirs()
    port, http_port = free_port(), free_port()
    config = {
        "models": {"verifier": verifier, "draft": draft},
        "grpc_port": port,
        "http_port": http_port,
        # a custom resource no node has: the replica's placement group waits for ever
        "resources": {"draft": {"num_cpus": 0.25, "resources": {"nowhere": 1}}},
    }
    path = tmp_path / "unplaceable.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = _serve(path)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    # reap it as soon as it exits, or make stop's `kill -0` would see a zombie
    reaper = threading.Thread(target=proc.wait, daemon=True)
    reaper.start()
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("starting for") for line in lines):
            assert proc.poll() is None, "".join(lines[-30:])
            assert time.monotonic() < deadline, "".join(lines[-30:])
            time.sleep(0.5)
        assert pidfile(port).exists()  # written before the start: make stop finds it
        # README: it says what it waits for, naming what no node of the cluster has
        waiting = next(line for line in lines if line.startswith("starting for"))
        assert "a replica needs nowhere 1 (the cluster has 0)" in waiting, waiting
        stopping = time.monotonic()
        stop = make("stop", f"PORT={port}")
        stop_out, _ = stop.communicate(timeout=120)
        took = time.monotonic() - stopping
        assert stop.returncode == 0, stop_out + "".join(lines[-20:])
        assert f"stopped the server on port {port}" in stop_out, stop_out
        assert took < 30, took  # no drain to wait for, and no 30 s Serve shutdown
        reaper.join(timeout=60)
        assert proc.returncode == 1
        out = "".join(lines)
        assert "READY" not in out
        assert "stopped: the application 'cactus' did not start" in out, out[-3000:]
        assert "Controller failed to shut down" not in out
        assert not pidfile(port).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        pidfile(port).unlink(missing_ok=True)


def test_a_replica_that_cannot_start_fails_the_deploy_with_exit_1(tmp_path):
    """README: a deploy that fails (a replica's constructor raising) exits 1 with Serve's
    message, rather than retrying for ever. The verifier folder exists (the launcher's
    own check passes) but holds no model: every replica's engine start raises, Serve
    gives up after its constructor retries (DEPLOY_FAILED), and the launcher says so,
    with Serve's message naming the error, and exits 1 leaving no pid file."""
    _, draft = embedded_dirs()
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    port, http_port = free_port(), free_port()
    config = {
        "models": {"verifier": str(empty), "draft": draft},
        "tp_size": 1,
        "grpc_port": port,
        "http_port": http_port,
        "limits": {"start_timeout_s": 60.0},
    }
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(config))
    # one constructor try instead of Serve's 3 per replica: the same DEPLOY_FAILED, 2
    # failed engine starts sooner (the server's own Ray head inherits the variable)
    proc = _serve(path, RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT="1")
    try:
        out, _ = proc.communicate(timeout=420)
        assert proc.returncode == 1, out[-3000:]
        assert "READY" not in out
        assert "deploy failed:" in out, out[-3000:]
        failed = out[out.index("deploy failed:") :]  # Serve's message, the error's lines
        assert "failed to start" in failed and f"Unrecognized model in {empty}" in failed, failed
        assert "DEPLOY_FAILED: the application 'cactus' did not start" in out, out[-3000:]
        assert not pidfile(port).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pidfile(port).unlink(missing_ok=True)


def test_lacking_names_what_the_whole_cluster_does_not_have():
    from deployments.serve import lacking

    bundles = [{"CPU": 0.25}, {"CPU": 0.25, "nowhere": 1.0}, {"CPU": 1.0, "GPU": 2.0}]
    totals = {"CPU": 2.0, "GPU": 1.0}
    assert lacking(bundles, totals) == (
        "; a replica needs GPU 2 (the cluster has 1), nowhere 1 (the cluster has 0)"
    )
    assert lacking(bundles, {"CPU": 1.5, "GPU": 2.0, "nowhere": 1.0}) == ""


def test_wait_running_reports_a_failed_deploy_with_serves_message(capsys, monkeypatch):
    """README: a deploy that fails (a replica's constructor raising) exits 1 with Serve's
    message. The launcher's wait, on Serve's own status objects: DEPLOYING (reported
    with what the cluster lacks), then DEPLOY_FAILED with the deployment's message;
    RUNNING ends the wait; a stop ends it at once."""
    from types import SimpleNamespace

    from ray.serve.schema import ApplicationStatus

    import deployments.serve as launcher

    monkeypatch.setattr(launcher, "WAITING_REPORT_S", 0.0)

    def app(status, message=""):
        deployment = SimpleNamespace(message=message)
        return SimpleNamespace(status=status, message="", deployments={"CactusIngress": deployment})

    class FakeServe:
        def __init__(self, *apps):
            self.apps = list(apps)

        def status(self):
            current = self.apps.pop(0) if len(self.apps) > 1 else self.apps[0]
            return SimpleNamespace(applications={"cactus": current})

    boom = "the replica's constructor raised: OSError: no weights in models/verifier"
    serve = FakeServe(app(ApplicationStatus.DEPLOYING), app(ApplicationStatus.DEPLOY_FAILED, boom))
    outcome = launcher.wait_running(
        serve, "cactus", threading.Event(), time.monotonic(), lambda: "; a replica needs x 1"
    )
    out, err = capsys.readouterr()
    assert outcome == "DEPLOY_FAILED"
    assert f"deploy failed: CactusIngress: {boom}" in err, err
    assert "waiting: DEPLOYING; a replica needs x 1" in out, out
    running = FakeServe(app(ApplicationStatus.RUNNING))
    assert launcher.wait_running(running, "cactus", threading.Event(), 0.0) == "RUNNING"
    stop = threading.Event()
    stop.set()
    waiting = FakeServe(app(ApplicationStatus.DEPLOYING))
    assert launcher.wait_running(waiting, "cactus", stop, 0.0) == "stopped"
