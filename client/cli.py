"""`cactus` command line: generate text with speculative decoding, or call a server.

Lives beside the client library, apart from `cactus/` (request parameters and errors,
which the workers import): the CLI imports workers, the client and Ray.

    cactus generate --prompt "def add(a, b):" [--rule cactus --delta 1 -K 4 ...]
                    [--stream] [--json] [--verifier DIR --draft DIR]

Runs the in-process engine on the embedded models (models/verifier, models/draft) unless
other checkpoint folders are given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from cactus import environment
from cactus.environment import DEFAULT_DRAFT, DEFAULT_VERIFIER


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion")
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--rule", default="cactus", help="none, sps, cactus, cactus_exact or tas (default cactus)"
    )
    p.add_argument("--delta", type=float, default=1.0, help="divergence budget, nats")
    p.add_argument("-K", "--num-speculative-tokens", type=int, default=4, dest="k")
    p.add_argument("--max-divergence-nats", type=float, default=None)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=int, default=[])
    p.add_argument("--stream", action="store_true", help="print text as it is produced")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verifier", default=str(DEFAULT_VERIFIER))
    p.add_argument("--draft", default=str(DEFAULT_DRAFT))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument(
        "--backend",
        choices=["local", "ray"],
        default="local",
        help="local: in-process engine; ray: draft actor + TP verifier on a local Ray",
    )
    p.add_argument("--tp", type=int, default=1, help="verifier tensor-parallel ranks (ray)")


def _client_parser(sub) -> None:
    p = sub.add_parser("client", help="call a running server over gRPC")
    p.add_argument("--address", default="127.0.0.1:9000")
    p.add_argument("--prompt", required=True)
    p.add_argument("--token", default=os.environ.get("CACTUS_AUTH_TOKEN"))
    # every field's default is None: unset, the server's default (README, Python client)
    p.add_argument("--rule", default=None, help="unset: speculation.default_rule")
    p.add_argument("--delta", type=float, default=None)
    p.add_argument(
        "-K",
        "--num-speculative-tokens",
        type=int,
        default=None,
        dest="k",
        help="unset: server default",
    )
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None, help="unset: off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--max-tokens", type=int, default=None, help="unset: sampling.default_max_tokens"
    )
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0)


def client_kwargs(args) -> dict:
    """`cactus client`'s arguments as CactusClient.request's keywords: None is unset (the
    server's default); a 0 for max_tokens or -K is read as unset too, with the request's
    FutureWarning."""
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "rule": args.rule,
        "delta": args.delta,
        "num_speculative_tokens": args.k,
    }


def client(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from client import CactusClient

    c = CactusClient(args.address, token=args.token, timeout=args.timeout)
    kw = client_kwargs(args)
    try:
        if args.stream:
            last = None
            for chunk in c.stream(args.prompt, **kw):
                print(chunk.text, end="", flush=True)
                last = chunk
            print()
            if args.json and last is not None:
                print(json.dumps(MessageToDict(last)))
        else:
            reply = c.generate(args.prompt, **kw)
            print(json.dumps(MessageToDict(reply)) if args.json else reply.text)
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except ValueError as err:  # a value protobuf cannot hold (a negative max_tokens)
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def build_request(args):
    from cactus.params import GenerationRequest, SamplingParams, SpeculationParams

    return GenerationRequest(
        prompt=args.prompt,
        sampling=SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
            stop_token_ids=tuple(args.stop_token_id),
        ),
        speculation=SpeculationParams(
            rule=args.rule,
            delta=args.delta,
            num_speculative_tokens=args.k,
            max_divergence_nats=args.max_divergence_nats,
        ),
    )


def result_json(result) -> dict:
    return {
        "request_id": result.request_id,
        "text": result.text,
        "token_ids": list(result.token_ids),
        "finish_reason": result.finish_reason,
        "seed": result.seed,
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.token_ids),
        },
        "stats": result.stats.as_dict(),
    }


def _quiet() -> None:
    environment.apply()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def generate(args) -> int:
    _quiet()
    import torch

    from cactus.errors import CactusError, InvalidRequestError
    from workers.local import local_engine

    if args.threads:
        torch.set_num_threads(args.threads)
    for name in ("verifier", "draft"):
        if not Path(getattr(args, name)).is_dir():
            # else transformers, offline, says it "couldn't connect to huggingface.co"
            print(f"error: --{name}: no such folder: {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        request = build_request(args)
        if args.backend == "ray":
            result = _run_ray(args, request)
        else:
            engine = local_engine(args.verifier, args.draft, dtype=args.dtype)
            result = _consume(engine.stream(request), args.stream)
    except (InvalidRequestError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except CactusError as err:  # the engine did not start (EngineStartError), ...
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    if args.stream:
        print()
    if args.json:
        print(json.dumps(result_json(result)))
    elif not args.stream:
        print(result.text)
    return 0


def _consume(chunks, stream: bool):
    result = None
    for chunk in chunks:
        if stream and chunk.text:
            print(chunk.text, end="", flush=True)
        result = chunk.result or result
    return result


def _run_ray(args, request):
    """A local Ray started for this call: draft actor + args.tp verifier ranks."""
    environment.apply()
    import ray

    from workers.group import EngineGroup, GroupConfig

    # address "local": a head of its own, never a `ray start` cluster recorded on this
    # machine (which may be gone: Ray would dial it for minutes)
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    group = None
    try:
        group = EngineGroup(
            GroupConfig(args.verifier, args.draft, tp_size=args.tp, dtype=args.dtype)
        ).start()
        if not request.request_id:
            from dataclasses import replace

            request = replace(request, request_id="cli-0")
        return _consume(group.stream(request), args.stream)
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cactus", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command")
    _generate_parser(sub)
    _client_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        return generate(args)
    if args.command == "client":
        return client(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
