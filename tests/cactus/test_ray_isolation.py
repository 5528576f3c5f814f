"""The tests and benchmarks start fresh local Ray heads, whatever cluster this machine's
/tmp/ray/ray_current_cluster names (conftest sets RAY_ADDRESS=local), and `make serve`
skips a record whose GCS does not answer.

Why: `ray.init()` with no address joins the cluster named in that file: the last
`ray start` on the machine (how the README's multi-node `make serve` finds its cluster),
or a `ray.cluster_utils.Cluster` whose test run was killed before its shutdown removed the
file. A CI run once failed so: its servers dialled such a dead GCS for five minutes. The
files here live in a private temp dir, never in the machine's /tmp/ray."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest


@contextlib.contextmanager
def stale_ray_record():
    """A folder for RAY_TMPDIR whose Ray temp dir (`<folder>/ray`) holds a
    ray_current_cluster naming a GCS port nobody listens on; yields (folder, address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    folder = tempfile.mkdtemp(prefix="/tmp/rayiso-")  # short: Ray's socket paths
    os.makedirs(os.path.join(folder, "ray"))
    with open(os.path.join(folder, "ray", "ray_current_cluster"), "w") as f:
        f.write(dead)
    try:
        yield folder, dead
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def stale_temp_dir():
    """A Ray temp dir (as `_temp_dir`) with a dead cluster record."""
    with stale_ray_record() as (folder, dead):
        yield os.path.join(folder, "ray"), dead


def test_ray_joins_the_address_file_unless_ray_address_is_local(stale_temp_dir, monkeypatch):
    """Pins the Ray behaviour the suite relies on: without RAY_ADDRESS, ray.init() would
    dial the file's (dead) address; with RAY_ADDRESS=local it starts its own head."""
    from ray._private import services

    folder, dead = stale_temp_dir
    assert os.environ["RAY_ADDRESS"] == "local"
    assert services.canonicalize_bootstrap_address(None, folder) is None  # a new head
    monkeypatch.delenv("RAY_ADDRESS")
    assert services.canonicalize_bootstrap_address(None, folder) == dead


def test_a_fresh_head_starts_beside_a_stale_address_file(stale_temp_dir):
    """A real `ray.init()` in a process with the suite's environment (as every server the
    tests spawn gets it) starts at once instead of dialling the dead GCS."""
    folder, dead = stale_temp_dir
    code = (
        "import sys, ray;"
        "ray.init(_temp_dir=sys.argv[1], num_cpus=1, include_dashboard=False,"
        " log_to_driver=False, configure_logging=False);"
        "print('GCS', ray.get_runtime_context().gcs_address); ray.shutdown()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, folder], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    gcs = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("GCS ")]
    assert gcs and gcs[0] != dead


def test_the_launcher_starts_its_own_head_when_the_recorded_cluster_is_dead(monkeypatch, capsys):
    """deployments.serve.ray_address: a record naming a GCS that does not answer ->
    "local" with a warning naming it; a live one, or RAY_ADDRESS set -> None (Ray's own
    choice: join it). The server e2e of this is the timeout server (test_timeout_e2e)."""
    from deployments.serve import ray_address

    monkeypatch.delenv("RAY_ADDRESS")
    with stale_ray_record() as (folder, dead):
        record = os.path.join(folder, "ray", "ray_current_cluster")
        monkeypatch.setenv("RAY_TMPDIR", folder)
        assert ray_address() == "local"
        assert dead in capsys.readouterr().err
        with socket.socket() as live:
            live.bind(("127.0.0.1", 0))
            live.listen()
            with open(record, "w") as f:
                f.write(f"127.0.0.1:{live.getsockname()[1]}")
            assert ray_address() is None
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
        assert ray_address() is None
        monkeypatch.delenv("RAY_ADDRESS")
        os.remove(record)
        assert ray_address() is None  # no record: a new head, Ray's default
