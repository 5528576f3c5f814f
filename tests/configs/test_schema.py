"""Typed config: the shipped YAML loads; unknown keys and bad values name their path."""

from __future__ import annotations

from pathlib import Path

import pytest

from configs.schema import ConfigError, from_dict, load_config, to_dict

REPO = Path(__file__).resolve().parents[2]


def _serve_refused(*args: str, env: dict | None = None, timeout: int = 120):
    """`python -m deployments.serve ARGS` (what `make serve` runs) with `env` added to
    this environment, expected to refuse to start: exit 2, no traceback."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "deployments.serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    return out


@pytest.mark.parametrize("name", ["default.yaml", "cluster.yaml"])
def test_shipped_configs_load(name):
    config = load_config(REPO / "configs" / name)
    assert from_dict(to_dict(config)) == config  # round-trips


@pytest.mark.parametrize("name", ["default.yaml", "cluster.yaml"])
def test_the_readme_gives_each_shipped_configs_sampling_defaults(name):
    """README (`cactus client` leaves unset fields to the server): the temperature it
    names for each shipped config, and top-p 1 / top-k off in both."""
    config = load_config(REPO / "configs" / name)
    text = " ".join((REPO / "README.md").read_text().split())
    assert f"{config.sampling.default_temperature:g} in `configs/{name}`" in text
    # no config sets another default: top-p and top-k are the request builders' own
    assert set(config.sampling.model_dump()) == {"default_temperature", "default_max_tokens"}
    assert "top-p 1 and top-k off in both" in text


def test_default_points_at_the_embedded_models():
    config = load_config(REPO / "configs" / "default.yaml")
    assert Path(config.model_path("verifier")).joinpath("config.json").exists()
    assert Path(config.model_path("draft")).joinpath("config.json").exists()
    assert config.grpc_port == 9000 and config.models.device == "cpu"
    # Every request a replica admits can share one batch.
    assert config.limits.max_ongoing_requests <= config.batching.max_num_seqs


def test_cluster_example_is_multi_node():
    config = load_config(REPO / "configs" / "cluster.yaml")
    assert config.resources.draft.resources == {"draft_node": 1.0}
    assert config.resources.verifier_rank.num_gpus == 1 and config.tp_size == 4
    assert config.autoscaling.max_replicas > config.autoscaling.min_replicas


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ({"tp_sise": 2}, "tp_sise"),
        ({"speculation": {"delta_cieling": 1}}, "speculation.delta_cieling"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": 2, "models": {"dtype": "float16"}}, "models.dtype"),
        ({"tp_size": "2"}, "tp_size"),
        ({"speculation": {"delta_ceiling": -1}}, "speculation.delta_ceiling"),
        ({"speculation": {"default_delta": 9.0}}, "speculation.default_delta"),
        ({"speculation": {"allowed_rules": ["cactus", "magic"]}}, "speculation.allowed_rules"),
        (
            {"speculation": {"default_rule": "tas", "allowed_rules": ["sps"]}},
            "speculation.default_rule",
        ),
        ({"limits": {"max_ongoing_requests": 0}}, "limits.max_ongoing_requests"),
        # wider than any drafter's block: every request asking for it would degrade
        (
            {"speculation": {"max_num_speculative_tokens": 65}},
            "speculation.max_num_speculative_tokens",
        ),
        ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "autoscaling.min_replicas"),
        ({"resources": {"draft": {"num_cpus": "lots"}}}, "resources.draft.num_cpus"),
        ({"resources": {"draft": {"resources": {"x": True}}}}, "resources.draft.resources.x"),
        ({"grpc_port": 70000}, "grpc_port"),
        ({"models": {"dtype": "int8"}}, "models.dtype"),
        ({"models": {"device": "gpu"}}, "models.device"),
        # on CUDA each TP rank reserves whole GPUs of its own, and the draft some GPU
        (
            {"models": {"device": "cuda"}, "resources": {"draft": {"num_gpus": 0.5}}},
            "resources.verifier_rank.num_gpus",
        ),
        (
            {
                "models": {"device": "cuda"},
                "tp_size": 2,
                "resources": {"draft": {"num_gpus": 0.5}, "verifier_rank": {"num_gpus": 0.5}},
            },
            "resources.verifier_rank.num_gpus",
        ),
        (
            {"models": {"device": "cuda"}, "resources": {"verifier_rank": {"num_gpus": 1}}},
            "resources.draft.num_gpus",
        ),
        ({"sampling": {"default_temperature": float("nan")}}, "sampling.default_temperature"),
        # else refused only on rank 0, after the actors loaded, as "policy:"
        ({"speculation": {"policy": "always"}}, "speculation.policy"),
        ({"batching": {"max_num_seqs": 0}}, "batching.max_num_seqs"),
        ({"batching": {"max_num_batched_tokens": -1}}, "batching.max_num_batched_tokens"),
        ({"batching": {"kv_budget_tokens": 10}}, "batching.kv_budget_tokens"),
        ({"batching": {"batch_wait_ms": -2.0}}, "batching.batch_wait_ms"),
        ({"batching": {"max_num_seq": 4}}, "batching.max_num_seq"),
        # ranges the types alone do not express (a negative timeout reached Serve as is)
        ({"limits": {"request_timeout_s": -1.0}}, "limits.request_timeout_s"),
        ({"limits": {"start_timeout_s": 0.0}}, "limits.start_timeout_s"),
        ({"limits": {"max_prompt_chars": 0}}, "limits.max_prompt_chars"),
        ({"limits": {"max_health_watches": -1}}, "limits.max_health_watches"),
        # Watch calls need no token: as many as the request slots would hold every one
        (
            {"limits": {"max_health_watches": 4, "max_ongoing_requests": 4}},
            "limits.max_health_watches",
        ),
        ({"limits": {"max_queued_requests": -1}}, "limits.max_queued_requests"),  # unbounded
        ({"resources": {"draft": {"num_cpus": -0.5}}}, "resources.draft.num_cpus"),
        ({"resources": {"verifier_rank": {"num_gpus": -1.0}}}, "resources.verifier_rank.num_gpus"),
        ({"resources": {"replica": {"resources": {"x": -1.0}}}}, "resources.replica.resources.x"),
        ({"resources": {"draft": {"resources": {"CPU": 1.0}}}}, "resources.draft.resources.CPU"),
        # a bundle of zeros: Ray refuses it at deploy time (a traceback after Ray started)
        ({"resources": {"replica": {"num_cpus": 0}}}, "resources.replica"),
        ({"resources": {"draft": {"num_cpus": 0, "resources": {"x": 0.0}}}}, "resources.draft"),
        ({"autoscaling": {"upscale_delay_s": -1.0}}, "autoscaling.upscale_delay_s"),
        ({"autoscaling": {"downscale_delay_s": -5.0}}, "autoscaling.downscale_delay_s"),
        ({"autoscaling": {"metrics_interval_s": 0.0}}, "autoscaling.metrics_interval_s"),
        ({"autoscaling": {"look_back_period_s": 0.0}}, "autoscaling.look_back_period_s"),
        # a window shorter than one report: Ray Serve 2.60 warns, later releases refuse
        (
            {"autoscaling": {"metrics_interval_s": 10.0, "look_back_period_s": 5.0}},
            "autoscaling.look_back_period_s",
        ),
        # Serve refused these after Ray had started (a traceback), gRPC's limit is a C int
        ({"app_name": ""}, "app_name"),
        ({"app_name": " cactus"}, "app_name"),
        ({"limits": {"max_message_bytes": 2**31}}, "limits.max_message_bytes"),
        # rank 0 holds a thread per request slot (Ray's max_concurrency, a C int)
        ({"limits": {"max_ongoing_requests": 2**30}}, "limits.max_ongoing_requests"),
        ({"limits": {"max_queued_requests": 2**31}}, "limits.max_queued_requests"),
        ({"batching": {"max_num_seqs": 8193}}, "batching.max_num_seqs"),
        # "" would turn auth off silently; a client strips spaces and sends ASCII only
        ({"auth": {"token": ""}}, "auth.token"),
        ({"auth": {"token": " s3cret"}}, "auth.token"),
        ({"auth": {"token": "s3cret\n"}}, "auth.token"),
        ({"auth": {"token": "s\u00e9cret"}}, "auth.token"),
    ],
)
def test_bad_config_names_the_key_path(raw, path):
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert str(err.value).startswith(path + ":"), str(err.value)


def test_the_readme_config_table_is_generated_from_the_models():
    """Every field's description is the README's: regenerate with
    `python -m configs.schema --readme` when a field changes."""
    from configs.schema import README, readme_with_table

    text = README.read_text()
    assert readme_with_table(text) == text


def test_the_config_table_shows_what_make_serve_sets_apart_from_the_defaults(tmp_path):
    """The table's last column: a value of the shipped YAML that differs from the
    schema's default (numerically equal ones, 0 for 0.0, and keys left out stay
    blank), so a reader of the defaults sees what `make serve` runs with."""
    from configs.schema import config_table

    shipped = tmp_path / "shipped.yaml"
    shipped.write_text(
        "tp_size: 3\nlimits: {request_timeout_s: 0, max_queued_requests: 5}\n"
        "speculation: {allowed_rules: [none, sps, cactus, cactus_exact, tas]}\n"
    )
    cells = {
        line.split("|")[1].strip(" `"): line.split("|")[4].strip()
        for line in config_table(shipped).splitlines()[2:]
    }
    assert {key: v for key, v in cells.items() if v} == {
        "tp_size": "`3`",
        "limits.max_queued_requests": "`5`",
    }
    shown = {
        line.split("|")[1].strip(" `")
        for line in config_table().splitlines()[2:]
        if line.split("|")[4].strip()
    }
    assert "tp_size" in shown  # configs/default.yaml runs TP = 2 on one machine


def test_every_field_is_described():
    from configs.schema import config_rows

    rows = config_rows()
    assert len(rows) > 40 and all(description for _, description, _ in rows)
    assert ("grpc_port", rows[[r[0] for r in rows].index("grpc_port")][1], "9000") in rows


def test_one_gpu_can_hold_a_lone_rank_and_the_draft():
    """TP = 1 has no NCCL group: the rank and the draft may share one GPU."""
    config = from_dict(
        {
            "models": {"device": "cuda"},
            "tp_size": 1,
            "resources": {"draft": {"num_gpus": 0.25}, "verifier_rank": {"num_gpus": 0.75}},
        }
    )
    assert config.resources.verifier_rank.num_gpus == 0.75


def test_a_malformed_yaml_file_is_a_config_error_naming_the_file(tmp_path):
    from configs.schema import ConfigError, load_config

    path = tmp_path / "bad.yaml"
    path.write_text("models: {verifier: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        load_config(path)
    assert str(path) in str(err.value)


def test_a_key_given_twice_is_a_config_error_not_the_last_one_silently(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `limits:` block replaced the
    first whole (max_ongoing_requests 8 went back to 32). A YAML merge key (`<<`) may
    still be overridden."""
    from configs.schema import ConfigError, load_config

    path = tmp_path / "twice.yaml"
    path.write_text("limits: {max_ongoing_requests: 8}\nlimits: {max_queued_requests: 8}\n")
    with pytest.raises(ConfigError, match="the key 'limits' is given twice"):
        load_config(path)
    path.write_text("limits: {max_ongoing_requests: 8, max_ongoing_requests: 9}\n")
    with pytest.raises(ConfigError, match="'max_ongoing_requests' is given twice"):
        load_config(path)
    path.write_text(
        "limits: {<<: {max_ongoing_requests: 8, max_queued_requests: 3}, max_ongoing_requests: 9}\n"
    )
    limits = load_config(path).limits
    assert (limits.max_ongoing_requests, limits.max_queued_requests) == (9, 3)


@pytest.mark.parametrize("text", ["42\n", "- tp_size: 2\n", "false\n", "[]\n"])
def test_a_file_that_is_not_a_mapping_is_a_config_error_with_or_without_overrides(tmp_path, text):
    """`make serve PORT=9100 CONFIG=...` merges the port into the file's root: a root
    that is not a mapping raised TypeError (a traceback) there, and a false or empty
    list silently meant every default."""
    from configs.schema import ConfigError, load_config

    path = tmp_path / "root.yaml"
    path.write_text(text)
    for overrides in (None, {"grpc_port": 9100}):
        with pytest.raises(ConfigError, match="<root>: expected a mapping"):
            load_config(path, overrides)
    path.write_text("")  # an empty file is every default
    assert load_config(path, {"grpc_port": 9100}).grpc_port == 9100


@pytest.mark.parametrize(
    "text, where",
    [("models: {verifier: [unclosed\n", "not valid YAML"), ("tp_size: 0\n", "tp_size")],
)
def test_serve_reports_a_bad_config_and_exits_2(tmp_path, text, where):
    """`make serve CONFIG=bad.yaml`: one line naming what is wrong, exit status 2, no
    traceback, before anything starts."""

    path = tmp_path / "bad.yaml"
    path.write_text(text)
    out = _serve_refused("--config", str(path))
    assert out.stderr.startswith("config error:") and where in out.stderr, out.stderr


def test_serve_reports_a_token_no_client_could_send_and_exits_2():
    """`CACTUS_AUTH_TOKEN` with a trailing newline (`export CACTUS_AUTH_TOKEN=$(cat f)`
    keeps none, but an env file may): exit 2 naming the variable, before Ray starts."""

    out = _serve_refused(env={"CACTUS_AUTH_TOKEN": "s3cret\n"})
    assert out.stderr.startswith("config error: auth.token_env (CACTUS_AUTH_TOKEN):"), out.stderr


def test_serve_with_num_cpus_says_it_cannot_join_a_cluster_with_them(tmp_path):
    """Ray refuses num_cpus when ray.init joins a cluster: the launcher says what to do
    instead (exit 2, no traceback) rather than pass Ray's ValueError on. Ray checks this
    before it dials the address, so no cluster has to run at 127.0.0.1:1."""

    out = _serve_refused("--num-cpus", "1", env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert "config error: --num-cpus" in out.stderr and "RAY_ADDRESS=local" in out.stderr
    assert "127.0.0.1:1" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("value", ["1.5", "0", "-1", "nan"])
def test_serve_refuses_num_cpus_that_are_not_a_whole_number_of_cpus(value, capsys):
    """Ray sizes a head in whole CPUs: 1.5 or -1 was Ray's own error after its GCS had
    started (a traceback, exit 1) and 0 a head that placed nothing, for ever. Refused
    first, naming the flag (argparse: exit 2)."""
    from deployments.serve import main

    with pytest.raises(SystemExit) as exited:
        main(["--num-cpus", value])
    assert exited.value.code == 2
    assert "--num-cpus: must be a whole number >= 1" in capsys.readouterr().err


def test_a_second_launcher_on_a_port_in_use_refuses_and_leaves_the_pid_file(capsys, monkeypatch):
    """Two `make serve` on one port: the second overwrote the first's pid file, then
    removed it at exit, and `make stop` could no longer reach the first. It now refuses
    (exit 2, before Ray starts) and leaves the file as it was; a pid file whose process
    is gone or is not a server does not stop a start."""
    import os
    import subprocess
    import sys
    import time

    from deployments.serve import _remove_own_pidfile, main, pidfile, running_server
    from workers.tp_verifier import free_port

    # main() exports the config's gRPC message size for Serve's proxies: in this process,
    # it must not outlive the test (every later server would refuse a different one)
    default = load_config(Path(__file__).resolve().parents[2] / "configs" / "default.yaml")
    monkeypatch.setenv("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(default.limits.max_message_bytes))
    port = free_port()
    path = pidfile(port)
    path.parent.mkdir(exist_ok=True)
    # had the guard missed it, main() would start a whole server in this process and
    # serve for good: an address where no cluster answers makes it stop at once instead
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    first = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)  # stands in for deployments.serve"]
    )
    try:
        # until the child has exec'd (before, its cmdline is this process's)
        cmdline = Path(f"/proc/{first.pid}/cmdline")
        deadline = time.monotonic() + 30
        while b"deployments.serve" not in cmdline.read_bytes():
            assert time.monotonic() < deadline, cmdline.read_bytes()
            time.sleep(0.01)
        path.write_text(str(first.pid))
        assert main(["--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert f"a server already runs on gRPC port {port} (pid {first.pid})" in err, err
        assert f"make stop PORT={port}" in err
        assert path.read_text() == str(first.pid)
        assert os.environ["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == str(
            default.limits.max_message_bytes
        )
        _remove_own_pidfile(path)  # another process's file is never removed
        assert path.read_text() == str(first.pid)
        first.kill()
        first.wait(timeout=10)
        assert running_server(path) is None  # gone: a stale file
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            path.write_text(str(other.pid))
            assert running_server(path) is None  # alive, not a server
        finally:
            other.kill()
            other.wait(timeout=10)
    finally:
        first.kill()
        path.unlink(missing_ok=True)


def test_serve_refuses_a_grpc_message_size_exported_unlike_the_config():
    """Serve's gRPC proxies read RAY_SERVE_GRPC_MAX_MESSAGE_SIZE: exported with a value
    other than `limits.max_message_bytes`, one of the two would be ignored, so the
    launcher says so (exit 2, both named) before anything starts."""

    out = _serve_refused(env={"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": "1000"})
    assert out.stderr.startswith("config error: limits.max_message_bytes is 4194304"), out.stderr
    assert "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE is exported as '1000'" in out.stderr


def test_the_grpc_message_size_variable_follows_the_config(monkeypatch):
    import os

    from cactus.environment import GRPC_MESSAGE_SIZE, grpc_message_size

    # setenv first: monkeypatch then restores the variable (absent, here) afterwards
    monkeypatch.setenv(GRPC_MESSAGE_SIZE, "0")
    monkeypatch.delenv(GRPC_MESSAGE_SIZE)
    grpc_message_size(2048)
    assert os.environ[GRPC_MESSAGE_SIZE] == "2048"
    grpc_message_size(2048)  # exported alike: fine
    with pytest.raises(ValueError, match=r"limits\.max_message_bytes is 4096 .* '2048'"):
        grpc_message_size(4096)
    assert os.environ[GRPC_MESSAGE_SIZE] == "2048"


@pytest.mark.parametrize("names", [["a", "a"], [""], [" a"]])
def test_served_model_names_must_be_distinct_and_plain(names):
    with pytest.raises(ConfigError, match=r"models\.served_model_name"):
        from_dict({"models": {"served_model_name": names}})
    assert from_dict({"models": {"served_model_name": ["a", "b/c"]}}).models.served_model_name


def test_the_readmes_cluster_steps_fit_the_cluster_example():
    """README (Configuration): the message-size variable it exports is the example's
    limits.max_message_bytes, and the draft node's `draft_node` units and the verifier
    GPUs it names hold max_replicas replicas (a short draft node leaves autoscaled
    replicas waiting for ever: Serve has no autoscaler)."""
    import re

    config = load_config(REPO / "configs" / "cluster.yaml")
    readme = (REPO / "README.md").read_text()
    sizes = set(re.findall(r"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE=(\d+)", readme))
    assert sizes == {str(config.limits.max_message_bytes)}, sizes
    units = re.search(r"--resources '\{\"draft_node\": (\d+)\}'", readme)
    replicas = config.autoscaling.max_replicas
    assert (
        units and int(units.group(1)) == replicas * config.resources.draft.resources["draft_node"]
    )
    rank, draft = config.resources.verifier_rank, config.resources.draft
    text = " ".join(readme.split())
    assert (
        f"{config.tp_size * rank.num_gpus:g} GPUs and {config.tp_size * rank.num_cpus:g} CPUs "
        "per replica" in text
    )
    need = f"{draft.num_gpus:g} GPU, {draft.num_cpus:g} CPUs and 1 `draft_node` per replica"
    assert need in text and draft.resources["draft_node"] == 1
    total = (
        f"({replicas * draft.num_gpus:g} GPUs, {replicas * draft.num_cpus:g} CPUs and "
        f"{replicas} `draft_node` for `max_replicas` {replicas}"
    )
    assert total in text, total
    # a GPU config bounds its KV cache (null: max_num_seqs x a 40,960-token context)
    for name in ("default", "cluster"):
        c = load_config(REPO / "configs" / f"{name}.yaml")
        assert c.models.device != "cuda" or c.batching.kv_budget_tokens is not None, name


@pytest.mark.parametrize(
    ("limits", "watches"),
    [
        ({}, 4),
        ({"max_ongoing_requests": 2}, 1),
        ({"max_ongoing_requests": 1}, 0),
        ({"max_ongoing_requests": 8, "max_health_watches": 7}, 7),
    ],
)
def test_health_watches_always_leave_a_request_slot(limits, watches):
    """The Watch cap defaults to 4, or max_ongoing_requests - 1 where lower (an e2e
    server with 2 request slots and 4 Watches let token-less Watch calls take both)."""
    lim = from_dict({"limits": limits}).limits
    assert lim.health_watches == watches < lim.max_ongoing_requests


def test_the_defaults_give_every_ongoing_request_a_row():
    """A config with only `models:` takes the schema's defaults: as many requests in
    flight per replica as the engine batches (a lower max_ongoing_requests left rows
    idle: 8 of 32)."""
    config = from_dict({"models": {"verifier": "v", "draft": "d"}})
    assert config.limits.max_ongoing_requests >= config.batching.max_num_seqs


def test_serve_refuses_model_folders_that_are_not_there_on_its_own_head(tmp_path):
    """On a Ray head the launcher starts, every actor runs on this machine: a model
    folder that is not here is a config error naming it (exit 2), not a replica that
    fails later with transformers' offline "couldn't connect to huggingface.co"."""

    import yaml

    path = tmp_path / "missing.yaml"
    path.write_text(yaml.safe_dump({"models": {"verifier": str(tmp_path / "nope")}}))
    out = _serve_refused(
        "--config", str(path), "--num-cpus", "2", timeout=300, env={"RAY_ADDRESS": "local"}
    )
    assert f"models.verifier: no such folder: {tmp_path / 'nope'}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "READY" not in out.stdout


def test_the_model_folder_check_resolves_paths_as_the_replicas_do(tmp_path, monkeypatch):
    """A relative models.verifier is the repository's folder (ServeConfig.model_path), as
    the replicas load it: the launcher's check, run from another directory, looked for it
    there instead (the shipped config then failed "no such folder")."""
    from deployments.serve import _missing_model_folders

    monkeypatch.chdir(tmp_path)
    assert _missing_model_folders(load_config(REPO / "configs" / "default.yaml")) == []
    (tmp_path / "here").mkdir()  # in the current directory only: not what replicas load
    config = from_dict({"models": {"verifier": "here", "draft": "models/draft"}})
    assert _missing_model_folders(config) == [f"models.verifier: no such folder: {REPO / 'here'}"]


@pytest.mark.parametrize("flag, field", [("--port", "grpc_port"), ("--http-port", "http_port")])
def test_serve_refuses_port_0_naming_the_field(flag, field, capsys):
    """`make serve PORT=0` used to serve on the config's port (a 0 override was read as
    none), and `make stop PORT=0` then found no server: it is a config error."""
    from deployments.serve import main

    assert main([flag, "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: {field}: must be a TCP port, got 0"), err


def test_serve_says_when_no_ray_cluster_answers_at_ray_address():
    """RAY_ADDRESS naming a cluster that does not answer: one line saying so and what to
    do (exit 2), not ray.init dialling it for minutes."""

    out = _serve_refused(
        env={"RAY_ADDRESS": "127.0.0.1:1"}
    )  # it used to dial for minutes, printing GCS timeouts
    assert "config error: RAY_ADDRESS=127.0.0.1:1: no Ray cluster answers" in out.stderr, out.stderr
    assert "RAY_ADDRESS=local" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "address, recorded, words",
    [
        ("127.0.0.1:1", None, "RAY_ADDRESS=127.0.0.1:1: no Ray cluster answers there"),
        ("10.0.0.5", None, "RAY_ADDRESS=10.0.0.5: expected <head host>:<GCS port>"),
        ("auto", "127.0.0.1:1", "the cluster `ray start` recorded (127.0.0.1:1) does not"),
        ("auto", None, None),  # nothing recorded: Ray's own ConnectionError, at once
        ("local", None, None),
        ("ray://head:10001", None, None),
    ],
)
def test_which_ray_addresses_the_launcher_refuses_before_dialling(
    monkeypatch, address, recorded, words
):
    """ray.init dials a RAY_ADDRESS (or, for "auto", the cluster `ray start` recorded)
    for minutes when nothing answers there; the launcher refuses those at once."""
    import ray._private.services as services

    from deployments.serve import unreachable_ray_address

    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setattr(services, "find_bootstrap_address", lambda _temp_dir: recorded)
    got = unreachable_ray_address()
    assert (got is None) if words is None else (words in got), got


def test_the_token_budget_is_documented_as_the_scheduler_spends_it():
    """The budget never cuts decode (32 rows at K = 8 run their 288 tokens even with a
    budget of 128; tests/workers/test_scheduler.py pins that), and a waiting prompt still
    gets min_prefill_chunk (32) tokens: the description says so rather than promising a
    bound on what a step computes."""
    from configs.schema import BatchingConfig
    from workers.scheduler import SchedulerConfig

    text = BatchingConfig.model_fields["max_num_batched_tokens"].description
    assert "decode is never cut" in text and "at least 32 prompt tokens" in text
    assert "tokens one engine step computes" not in text
    assert SchedulerConfig().min_prefill_chunk == 32  # the "32" above


@pytest.mark.parametrize("name", ["default.yaml", "cluster.yaml"])
def test_shipped_configs_compute_with_no_more_threads_than_their_actors_reserve(name):
    """An actor computing with more torch threads than the CPUs Ray reserved for it
    oversubscribes its node (cluster.yaml had 4 threads on 2-CPU actors). A fractional
    reservation (the embedded pair's 0.25 on a laptop) still computes with one."""
    c = load_config(REPO / "configs" / name)
    for actor in (c.resources.draft, c.resources.verifier_rank):
        assert c.resources.threads_per_actor <= max(1, actor.num_cpus), (name, actor)


def test_a_token_from_the_environment_is_checked_naming_the_variable(monkeypatch):
    """The launcher resolves `auth.token_env` once (deployments/serve.py): a token no
    client could send is a config error naming the variable, not a server nobody can
    call; an unset or empty variable is no auth, as documented."""
    config = from_dict({"auth": {"token_env": "CACTUS_TEST_TOKEN"}})
    monkeypatch.setenv("CACTUS_TEST_TOKEN", "good-token")
    assert config.auth.resolved_token() == "good-token"
    monkeypatch.setenv("CACTUS_TEST_TOKEN", "bad token ")
    with pytest.raises(ConfigError, match=r"^auth.token_env \(CACTUS_TEST_TOKEN\):.*unset or"):
        config.auth.resolved_token()
    monkeypatch.setenv("CACTUS_TEST_TOKEN", "")
    assert config.auth.resolved_token() is None
    assert from_dict({"auth": {"token": "x y"}}).auth.resolved_token() == "x y"
