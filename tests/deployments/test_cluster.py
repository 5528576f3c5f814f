"""Multi-node placement and autoscaling, each on a Ray cluster of its own (subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
from tests.conftest import embedded_dirs

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 600) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.deployments.cluster_scripts", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ.copy(),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_draft_and_verifier_on_different_nodes(embedded_engine, heldout_prompts):
    verifier, draft = embedded_dirs()
    prompt = heldout_prompts[7]
    got = _run("multinode", verifier, draft, prompt)
    nodes, placement = got["nodes"], got["placement"]
    assert nodes["draft_node"] != nodes["verifier_node"]
    assert placement["draft"] == [nodes["draft_node"]]
    assert placement["ranks"] == [nodes["verifier_node"]] * 2
    want = embedded_engine.generate(
        GenerationRequest(
            prompt=prompt,
            sampling=SamplingParams(max_tokens=24, temperature=0.0),
            speculation=SpeculationParams(rule="none"),
        )
    )
    assert got["token_ids"] == list(want.token_ids)
    # the draft link worked across the nodes (a dead link degrades silently), and the
    # draft service listens on its node's Ray address, which other nodes reach
    assert got["num_drafts"] > 0 and got["draft_failures"] == 0, got
    host = got["draft_address"].rsplit(":", 1)[0].strip("[]")
    assert host == got["node_ips"][nodes["draft_node"]], got


def test_autoscaling_up_under_load_and_back_down():
    verifier, draft = embedded_dirs()
    got = _run("autoscale", verifier, draft)
    assert got["start"] == 1 and got["peak"] == 2 and got["end"] == 1, got
    assert got["stream_results"] == ["OK"] * 4, got


def test_a_node_with_exactly_one_replicas_resources_serves_it():
    """TP = 2 with one GPU per rank declared to Ray (models on CPU): a node declaring
    exactly the replica's bundles starts it (nothing is reserved twice) and a second
    such node takes a second replica, with nothing left over; scaling back to one (a
    redeploy: both old replicas drain, one new one starts) cuts no stream."""
    verifier, draft = embedded_dirs()
    got = _run("exact", verifier, draft)
    assert got["need"] == {"CPU": 1.0, "GPU": 2.0}, got
    assert got["one"] == {"replicas": 1, "tokens": 8, "free_cpu": 0.0, "free_gpu": 0.0}, got
    assert got["two"]["replicas"] == 2 and got["two"]["streams"] == [8] * 4, got
    assert got["two"]["free_cpu"] == 0.0 and got["two"]["free_gpu"] == 0.0, got
    # Scaling back to one replica drained the old ones: every running stream finished.
    # The streams were running when the scale-down started (each had tokens, none had
    # finished), so the drain had streams to wait for.
    at_scale_down = got["drain"]["at_scale_down"]
    assert all(received and not done for received, done in at_scale_down), got
    assert got["drain"]["replicas"] == 1, got
    assert got["drain"]["streams"] == ["LENGTH"] * 4, got
