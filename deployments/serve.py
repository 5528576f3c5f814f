"""`make serve`: a local Ray head on loopback, the Cactus app, gRPC on 127.0.0.1:PORT.

    python -m deployments.serve [--config configs/default.yaml] [--port 9000]

Prints a READY line and a client example, then serves until Ctrl-C / SIGTERM (or
`make stop`), and shuts Serve and Ray down cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from cactus.environment import RAY_ENV

PIDFILE = Path(__file__).resolve().parent.parent / ".cache" / "serve.pid"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--port", type=int, default=None, help="gRPC port (overrides config)")
    parser.add_argument("--num-cpus", type=float, default=None, help="Ray CPUs (default: all)")
    args = parser.parse_args(argv)

    from configs.schema import ConfigError, load_config

    try:
        overrides = {"grpc_port": args.port} if args.port else None
        config = load_config(args.config, overrides)
    except (ConfigError, OSError) as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(config.limits.max_message_bytes))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray
    from ray import serve

    from deployments.app import build_app, start_serve

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(
        num_cpus=args.num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        start = time.monotonic()
        start_serve(config)
        serve.run(build_app(config), name=config.app_name, route_prefix="/", blocking=False)
        PIDFILE.parent.mkdir(exist_ok=True)
        PIDFILE.write_text(str(os.getpid()))
        print(
            f"READY cactus gRPC on 127.0.0.1:{config.grpc_port} "
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
        while not stop.wait(timeout=1.0):
            pass
        print("shutting down", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        PIDFILE.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
