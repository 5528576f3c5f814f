"""`make serve`: the Cactus app on Ray Serve, gRPC on PORT (every interface).

It runs on the Ray cluster `ray.init()` finds (RAY_ADDRESS, else the last `ray start` on
this machine) or on a new local head (see `ray_address`).

    python -m deployments.serve [--config configs/default.yaml] [--port 9000]

Prints a READY line and a client example, then serves until Ctrl-C / SIGTERM (or
`make stop`), and shuts Serve and Ray down cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from cactus import environment

CACHE = Path(__file__).resolve().parent.parent / ".cache"


WAITING_REPORT_S = 10.0  # how often a start that waits says what it waits for


def _waiting_for(app) -> str:
    """Serve's own account of a start in progress (its replicas' scheduling messages
    name the resources they wait for)."""
    notes = [app.message] if app.message else []
    for name, deployment in app.deployments.items():
        if deployment.message:
            notes.append(f"{name}: {deployment.message}")
    return "; ".join(notes) or app.status.value


def lacking(bundles: list[dict], totals: dict) -> str:
    """What one replica's bundles need that the whole cluster does not have (a custom
    resource no node declares, more GPUs than there are); "" when the cluster has it
    all (a replica then waits only for some of it to be free, or for a node with
    enough of it at once)."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    short = [
        f"{name} {amount:g} (the cluster has {totals.get(name, 0.0):g})"
        for name, amount in sorted(need.items())
        if totals.get(name, 0.0) < amount
    ]
    return "; a replica needs " + ", ".join(short) if short else ""


def wait_running(
    serve, app_name: str, stop: threading.Event, start: float, lacks=lambda: ""
) -> str:
    """Wait until the application is RUNNING; returns "RUNNING", "DEPLOY_FAILED" (with
    Serve's message printed) or "stopped" (SIGINT / SIGTERM / `make stop` meanwhile).
    Every WAITING_REPORT_S it prints what Serve says it waits for, and `lacks()`: what
    the cluster lacks altogether (a placement that the cluster cannot satisfy waits for
    ever: Serve expects an autoscaler)."""
    reported = time.monotonic()
    while True:
        app = serve.status().applications.get(app_name)
        status = app.status if app is not None else None  # ApplicationStatus: a str Enum
        if status == "RUNNING":
            return "RUNNING"
        if status == "DEPLOY_FAILED":
            print(f"deploy failed: {_waiting_for(app)}", file=sys.stderr, flush=True)
            return "DEPLOY_FAILED"
        if stop.wait(timeout=1.0):
            return "stopped"
        if time.monotonic() - reported >= WAITING_REPORT_S:
            reported = time.monotonic()
            waiting = _waiting_for(app) if app is not None else "the application to register"
            print(f"starting for {reported - start:.0f}s, waiting: {waiting}{lacks()}", flush=True)


def _missing_model_folders(config) -> list[str]:
    """models.verifier / models.draft that are not folders on this machine, resolved as
    the replicas resolve them (a relative path against the repository, not the shell's
    current directory: ServeConfig.model_path)."""
    return [
        f"models.{name}: no such folder: {folder}"
        for name in ("verifier", "draft")
        if not Path(folder := config.model_path(name)).is_dir()
    ]


def _started_head(ray) -> bool:
    """ray.init started the Ray head in this process (no cluster to join). Ray's private
    node object (ray._private.worker._global_node) is the only place that says so."""
    node = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(node, "_global_node", None)
    return bool(getattr(node, "head", False))


def pidfile(grpc_port: int) -> Path:
    """One pid file per gRPC port: `make stop PORT=...` stops that server only."""
    return CACHE / f"serve-{grpc_port}.pid"


def with_resolved_token(config):
    """The config with its token resolved here, once (`auth.token`, else the launcher's
    `auth.token_env` variable): a replica on another node of a cluster does not see
    this shell's environment, and would otherwise serve without auth while the
    launcher, which sees the variable, printed no warning."""
    token = config.auth.resolved_token()
    if not token or token == config.auth.token:
        return config
    return config.model_copy(update={"auth": config.auth.model_copy(update={"token": token})})


def ray_address() -> str | None:
    """The address `ray.init` gets: None (Ray's own choice: RAY_ADDRESS, else the cluster
    the last `ray start` on this machine recorded, else a new local head), or "local"
    when that record names a GCS that does not answer. A record outlives a cluster
    stopped without `ray stop` (a crash, a killed test run); `ray.init()` would dial its
    dead GCS for minutes. Call after `environment.apply()`, before `ray.init`."""
    if os.environ.get("RAY_ADDRESS"):
        return None
    from ray._common.utils import get_ray_address_file
    from ray._private.services import find_bootstrap_address

    recorded = find_bootstrap_address(None)
    if not recorded or _answers(recorded):
        return None
    print(
        f"WARNING: the Ray cluster recorded in {get_ray_address_file(None)} "
        f"({recorded}) does not answer: starting a local head instead (export "
        "RAY_ADDRESS=<head>:<port> to join a cluster)",
        file=sys.stderr,
        flush=True,
    )
    return "local"


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    """A TCP connection to host:port opens (what a GCS that runs does at once)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        return True
    except (OSError, ValueError):
        return False


def unreachable_ray_address() -> str | None:
    """Why RAY_ADDRESS cannot be joined, or None: a host:port where nothing answers, or
    "auto" while the cluster `ray start` recorded does not answer (`ray.init` would dial
    either for minutes, printing GCS timeouts), or an address with no port. "local" and
    ray:// client addresses are left to Ray. Call after `environment.apply()`."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if not address or address == "local" or "://" in address:
        return None
    if address == "auto":
        from ray._private.services import find_bootstrap_address

        recorded = find_bootstrap_address(None)
        if recorded and not _answers(recorded):
            return (
                f"RAY_ADDRESS=auto: the cluster `ray start` recorded ({recorded}) does not answer"
            )
        return None  # nothing recorded: Ray's own ConnectionError, below
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return f"RAY_ADDRESS={address}: expected <head host>:<GCS port>"
    if not _answers(address):
        return f"RAY_ADDRESS={address}: no Ray cluster answers there"
    return None


def _whole_cpus(text: str) -> int:
    """--num-cpus: Ray sizes a head in whole CPUs, >= 1 (0 would place no actor, for
    ever); refused by argparse (exit 2, naming the flag) before a head starts."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def running_server(path: Path) -> int | None:
    """The pid in a server's pid file, if that process is alive and is a launcher (`make
    stop`'s own check: a pid left by a SIGKILLed server may have been reused)."""
    try:
        pid = int(path.read_text().strip())
        os.kill(pid, 0)
        args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except (OSError, ValueError):
        return None
    return pid if pid != os.getpid() and b"deployments.serve" in args else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--port", type=int, default=None, help="gRPC port (overrides config)")
    parser.add_argument("--http-port", type=int, default=None, help="HTTP port (overrides config)")
    parser.add_argument(
        "--num-cpus",
        type=_whole_cpus,
        default=None,
        help="CPUs of the Ray head it starts, a whole number >= 1 (default: all; not when "
        "joining a cluster)",
    )
    args = parser.parse_args(argv)

    from configs.schema import load_config

    try:
        overrides = {}
        if args.port is not None:  # 0 too: the schema refuses it, naming grpc_port
            overrides["grpc_port"] = args.port
        if args.http_port is not None:
            overrides["http_port"] = args.http_port
        config = load_config(args.config, overrides or None)
        environment.grpc_message_size(config.limits.max_message_bytes)
        config = with_resolved_token(config)  # a token_env no client could send: exit 2
    except (ValueError, OSError) as err:  # ConfigError is a ValueError
        print(f"config error: {err}", file=sys.stderr)
        return 2
    other = running_server(pidfile(config.grpc_port))
    if other is not None:
        # its pid file would be overwritten (and removed when this one exits): `make
        # stop` could no longer reach it, and this one could not bind its port anyway
        print(
            f"config error: a server already runs on gRPC port {config.grpc_port} (pid "
            f"{other}): stop it with `make stop PORT={config.grpc_port}`, or give this one "
            "another --port",
            file=sys.stderr,
        )
        return 2
    environment.apply()
    import ray
    from ray import serve

    from deployments.app import build_app, replica_bundles, start_serve
    from deployments.drain import clear_drain, start_drain, wait_drained

    # (with --num-cpus, Ray's own refusal to size a cluster it joins comes first, below)
    unreachable = unreachable_ray_address() if args.num_cpus is None else None
    if unreachable is not None:
        print(
            f"config error: {unreachable}; start the cluster with `ray start --head`, fix "
            "RAY_ADDRESS, or run with RAY_ADDRESS=local to start a head of its own",
            file=sys.stderr,
        )
        return 2
    address = ray_address()
    try:
        ray.init(
            address=address,
            num_cpus=args.num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    except ConnectionError as err:
        # RAY_ADDRESS=auto with no cluster recorded on this machine (a host:port or a
        # recorded cluster that does not answer was refused above)
        if os.environ.get("RAY_ADDRESS", "").strip() != "auto":
            raise
        print(
            f"config error: RAY_ADDRESS=auto: {err}; start a cluster with `ray start "
            "--head`, or run with RAY_ADDRESS=local to start a head of its own",
            file=sys.stderr,
        )
        return 2
    except ValueError as err:
        # Ray refuses num_cpus when it joins a cluster rather than start a head
        if args.num_cpus is None or "num_cpus" not in str(err):
            raise
        joined = os.environ.get("RAY_ADDRESS") or "the one `ray start` recorded"
        print(
            f"config error: --num-cpus sets the CPUs of a Ray head this launcher starts, "
            f"and it is joining an existing cluster ({joined}): leave --num-cpus out "
            "(the cluster's own `ray start --num-cpus` counts), or run with "
            "RAY_ADDRESS=local to start a head of its own",
            file=sys.stderr,
        )
        return 2
    missing = _missing_model_folders(config) if _started_head(ray) else []
    if missing:
        # on its own head every actor runs here: a folder that is not here fails every
        # replica later, with transformers' "couldn't connect to huggingface.co"
        # (offline mode); on a joined cluster the folders need only be on the nodes
        print(f"config error: {'; '.join(missing)}", file=sys.stderr)
        ray.shutdown()
        return 2
    # After ray.init, which replaces a driver's SIGTERM handler with sys.exit: SIGTERM
    # (docker stop, Kubernetes, systemd) must drain as Ctrl-C and `make stop` do.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    running = False
    try:
        start = time.monotonic()
        # the pid file first: `make stop` (and Ctrl-C) must reach a server that is still
        # starting, which may wait for resources for as long as the cluster lacks them
        pid_path = pidfile(config.grpc_port)
        pid_path.parent.mkdir(exist_ok=True)
        pid_path.write_text(str(os.getpid()))
        # a drain key left by a launcher that was SIGKILLed mid-drain would make this
        # application's replicas refuse every request (deployments/drain.py)
        clear_drain(config.app_name)
        start_serve(config)
        serve._run(build_app(config), name=config.app_name, route_prefix="/", _blocking=False)
        bundles = replica_bundles(config)
        outcome = wait_running(
            serve, config.app_name, stop, start, lambda: lacking(bundles, ray.cluster_resources())
        )
        if outcome != "RUNNING":
            print(
                f"{outcome}: the application {config.app_name!r} did not start "
                f"(after {time.monotonic() - start:.1f}s)",
                file=sys.stderr,
                flush=True,
            )
            # not waited for: Serve's delete of an application whose replicas were never
            # placed waits for them for ever (and serve.shutdown for it, 30 s)
            serve.delete(config.app_name, _blocking=False)
            return 1
        running = True
        print(
            f"READY cactus gRPC on 127.0.0.1:{config.grpc_port} "
            f"HTTP on {config.http_host}:{config.http_port} "
            f"(app {config.app_name!r}, tp_size {config.tp_size}, "
            f"started in {time.monotonic() - start:.1f}s, "
            f"ray {ray.get_runtime_context().gcs_address})",
            flush=True,
        )
        print(
            f"  try: .venv/bin/cactus client --address 127.0.0.1:{config.grpc_port} "
            "--prompt 'def fibonacci(n):' --stream",
            flush=True,
        )
        print(
            f"  listening: gRPC on every interface ([::]:{config.grpc_port}; Ray Serve's "
            f"gRPC proxy cannot bind one), OpenAI HTTP on {config.http_host}:"
            f"{config.http_port} (base_url http://127.0.0.1:{config.http_port}/v1)",
            flush=True,
        )
        if not config.auth.resolved_token():
            print(
                "WARNING: auth is off and the gRPC port is reachable from other hosts"
                + (
                    " (and so is HTTP)"
                    if config.http_host not in ("127.0.0.1", "localhost")
                    else ""
                )
                + f"; set auth.token in the config or export {config.auth.token_env}=<token>",
                flush=True,
            )
        while not stop.wait(timeout=1.0):
            pass
        # Drain first: deleting the app stops its replicas gracefully (they take no new
        # requests and running ones get recovery.drain_timeout_s to finish) while the
        # proxies still carry their streams. serve.shutdown() alone kills the proxies at
        # once, cutting every stream in flight.
        print(
            f"shutting down: draining running requests (up to "
            f"{config.recovery.drain_timeout_s:g}s)",
            flush=True,
        )
        # The replicas refuse new requests (UNAVAILABLE, retried elsewhere) while their
        # running ones finish; the application is deleted once none runs, or at the
        # deadline, when each replica has cut what was left (deployments/drain.py).
        try:
            deadline = start_drain(config.app_name, config.recovery.drain_timeout_s)
            wait_drained(config.app_name, deadline)
        except Exception as err:  # the GCS does not answer: Serve's deletion drains
            print(f"warning: no drain through Ray's KV store ({err})", file=sys.stderr)
        serve.delete(config.app_name)
        with contextlib.suppress(Exception):  # the next launcher clears it anyway
            clear_drain(config.app_name)
        print("drained", flush=True)
    finally:
        # A head this launcher started goes with ray.shutdown (Serve's controller too);
        # after a start that never ran, serve.shutdown would wait 30 s on its delete.
        if running or not _started_head(ray):
            serve.shutdown()
        ray.shutdown()
        _remove_own_pidfile(pidfile(config.grpc_port))
    return 0


def _remove_own_pidfile(path: Path) -> None:
    """Removes the pid file if it is still this process's (never another server's)."""
    try:
        if path.read_text().strip() == str(os.getpid()):
            path.unlink()
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
