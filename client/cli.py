"""`cactus` command line: generate text with speculative decoding, or call a server.

Lives beside the client library, apart from `cactus/` (request parameters and errors,
which the workers import): the CLI imports workers, the client and Ray.

    cactus generate --prompt "def add(a, b):" [--rule cactus --delta 1 -K 4 ...]
                    [--stream] [--json] [--verifier DIR --draft DIR]
    cactus client --prompt "def add(a, b):" [--address HOST:PORT] [--stream] [--json] ...

`generate` runs the in-process engine on the embedded models (models/verifier,
models/draft) unless other checkpoint folders are given; `client` calls a running server
(`make serve`) over gRPC.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from cactus import environment
from cactus.environment import DEFAULT_DRAFT, DEFAULT_VERIFIER


def _generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a completion",
        # its sampling defaults (temperature 0.6, top-p 0.95, top-k 20: the benchmarks')
        # are not a server's (`cactus client` leaves them to the server): --help says so
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
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
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0 = default)")
    p.add_argument(
        "--backend",
        choices=["local", "ray"],
        default="local",
        help="local: in-process engine; ray: draft actor + TP verifier on a local Ray",
    )
    p.add_argument("--tp", type=int, default=1, help="verifier tensor-parallel ranks (ray)")
    p.add_argument(
        "--policy",
        choices=["goodput", "fixed"],
        default="goodput",
        help="speculation policy, as the server's speculation.policy: fixed drafts the "
        "request's K every step, so a --seed repeats its text under a lossy rule too",
    )


def _client_parser(sub) -> None:
    p = sub.add_parser("client", help="call a running server over gRPC")
    p.add_argument("--address", default="127.0.0.1:9000", help="host:port (default 127.0.0.1:9000)")
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--token",
        default=os.environ.get("CACTUS_AUTH_TOKEN"),
        help="bearer token, sent as `authorization: Bearer <token>` metadata "
        "(default: the CACTUS_AUTH_TOKEN environment variable, if set; prefer it: a "
        "--token value shows in other users' `ps`)",
    )
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
    p.add_argument("--stop-token-id", action="append", type=int, default=None, help="(repeatable)")
    p.add_argument("--max-divergence-nats", type=float, default=None, help="unset: none")
    p.add_argument(
        "--stream", action="store_true", help="print text as it is produced (GenerateStream)"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object, as `cactus generate --json` does (after the text with "
        "--stream; text and token ids gathered over the whole stream)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="the call's deadline in seconds, retries included (default 120); past it "
        "the call fails with DEADLINE_EXCEEDED",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        dest="time_limit_s",
        help="the server's time limit for the request in seconds (time_limit_s): past "
        "it the text so far comes back with finish_reason TIME_LIMIT (exit 0); keep it "
        "under --timeout (unset: what is left of --timeout)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="connect over TLS, checking the server's certificate against the system's "
        "root certificates (a TLS-terminating proxy in front of the server)",
    )
    p.add_argument(
        "--ca-cert",
        default=None,
        metavar="PEM",
        help="connect over TLS, checking the server's certificate against this PEM file "
        "of root certificates (implies --tls)",
    )


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
        "stop_token_ids": args.stop_token_id,
        "rule": args.rule,
        "delta": args.delta,
        "num_speculative_tokens": args.k,
        "max_divergence_nats": args.max_divergence_nats,
        "time_limit_s": args.time_limit_s,
    }


def reply_json(replies) -> dict:
    """`cactus client --json`: a GenerateResponse, or a stream's chunks gathered (text and
    token ids over all of them; the last carries finish_reason, usage, seed and stats),
    as the dict `cactus generate --json` prints (result_json), less the stats the gRPC API
    does not carry (divergence_capped and the draft, verify and kernel times)."""
    from protos.cactus.v1 import cactus_pb2 as pb

    replies = list(replies)
    last = replies[-1] if replies else pb.GenerateResponse()
    token_ids = [int(t) for reply in replies for t in reply.token_ids]
    stats = last.stats
    return {
        "request_id": next((r.request_id for r in replies if r.request_id), ""),
        "text": "".join(reply.text for reply in replies),
        "token_ids": token_ids,
        "finish_reason": last.finish_reason,
        "seed": last.seed,
        "usage": {"prompt_tokens": last.usage.prompt_tokens, "completion_tokens": len(token_ids)},
        "stats": {
            "num_drafts": stats.num_drafts,
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "accepted_per_position": list(stats.accepted_per_position),
            "mean_acceptance_length": stats.mean_acceptance_length,
            "acceptance_rate": stats.acceptance_rate,
            "divergence_nats": stats.divergence_nats,
            "draft_failures": stats.draft_failures,
            "resumed": stats.resumed,
            "degraded": stats.degraded,
        },
    }


def _credentials(args):
    """`--tls` / `--ca-cert`: TLS channel credentials; None: a plain-text channel."""
    import grpc

    if args.ca_cert is None:
        return grpc.ssl_channel_credentials() if args.tls else None
    try:
        with open(args.ca_cert, "rb") as f:
            roots = f.read()
    except OSError as err:
        raise ValueError(f"--ca-cert: cannot read {args.ca_cert!r}: {err.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in roots:
        raise ValueError(f"--ca-cert: {args.ca_cert!r} holds no PEM certificate")
    return grpc.ssl_channel_credentials(root_certificates=roots)


def client(args) -> int:
    """Exit status: 0 done; 2 a bad value, found here (ValueError) or by the server
    (INVALID_ARGUMENT), as `cactus generate` exits for a bad field; 1 any other error."""
    import grpc

    from client import CactusClient

    c = None
    try:
        c = CactusClient(
            args.address, token=args.token, timeout=args.timeout, credentials=_credentials(args)
        )
        kw = client_kwargs(args)
        if args.stream:
            chunks = []
            for chunk in c.stream(args.prompt, **kw):
                print(chunk.text, end="", flush=True)
                chunks.append(chunk)
            print()
            if args.json:
                print(json.dumps(reply_json(chunks)))
            finish = chunks[-1].finish_reason if chunks else ""
        else:
            reply = c.generate(args.prompt, **kw)
            print(json.dumps(reply_json([reply])) if args.json else reply.text)
            finish = reply.finish_reason
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 2 if err.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    except ValueError as err:  # a value the request cannot hold (a negative max_tokens)
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if c is not None:
            c.close()
    return _cut_short(finish)


def _cut_short(finish_reason: str) -> int:
    """The exit status of a result: a text the server cut short says so on stderr (the
    text printed is what there was); ABORT, an engine that ended it without a result, is
    1, a time limit 0 (the request's own limit, as "length" over HTTP)."""
    if finish_reason == "TIME_LIMIT":
        print(
            "note: finish_reason TIME_LIMIT: the request's time limit (--time-limit) "
            "ended the text early",
            file=sys.stderr,
        )
    elif finish_reason == "ABORT":
        print("error: finish_reason ABORT: the server ended the text early", file=sys.stderr)
        return 1
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
    from safetensors import SafetensorError

    from cactus.errors import CactusError, InvalidRequestError, unwrap
    from cactus.params import Limits, validate_request
    from workers.local import local_engine
    from workers.scheduler import SchedulerConfig

    if args.threads < 0:
        print(f"error: --threads: must be >= 0 (0 = default), got {args.threads}", file=sys.stderr)
        return 2
    if args.tp < 1 or (args.tp != 1 and args.backend != "ray"):
        print(
            f"error: --tp: must be >= 1, and above 1 only with --backend ray, got {args.tp}",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in ("verifier", "draft"):
        if not Path(getattr(args, name)).is_dir():
            # else transformers, offline, says it "couldn't connect to huggingface.co"
            print(f"error: --{name}: no such folder: {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        request = build_request(args)
        # the fields' own ranges before a Ray head, an engine group or the models start
        # (the context checks need the model's limits: the engine makes them)
        validate_request(request, Limits(max_context=sys.maxsize, vocab_size=sys.maxsize))
        if args.backend == "ray":
            result = _run_ray(args, request)
        else:
            try:
                engine = local_engine(
                    args.verifier,
                    args.draft,
                    dtype=args.dtype,
                    scheduler=SchedulerConfig(policy=args.policy),
                )
            except SafetensorError as err:  # a corrupt or truncated weights file
                print(
                    f"error: --verifier / --draft: cannot load the models "
                    f"({args.verifier}, {args.draft}): {type(err).__name__}: {_first_line(err)}",
                    file=sys.stderr,
                )
                return 2
            result = _consume(engine.stream(request), args.stream)
    except BrokenPipeError:  # stdout's reader went away: main ends quietly
        raise
    except Exception as raised:
        # an error raised in a Ray actor arrives wrapped, its text the remote traceback
        err = unwrap(raised)
        if isinstance(err, (InvalidRequestError, ValueError, OSError)):
            print(f"error: {err}", file=sys.stderr)
            return 2
        if isinstance(err, CactusError):  # the engine did not start (EngineStartError), ...
            print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
            return 1
        if args.backend == "ray" and (_is_ray_error(raised) or _is_ray_error(err)):
            # README: an actor's error as its one line (the wrapper's text is the
            # remote traceback; what it wraps, any error, says it in its first line)
            print(f"error: {type(err).__name__}: {_first_line(err)}", file=sys.stderr)
            return 1
        raise
    if args.stream:
        print()
    if args.json:
        print(json.dumps(result_json(result)))
    elif not args.stream:
        print(result.text)
    return _cut_short(result.finish_reason)


def _is_ray_error(err: BaseException) -> bool:
    from ray.exceptions import RayError

    return isinstance(err, RayError)


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else ""


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
            GroupConfig(
                args.verifier,
                args.draft,
                tp_size=args.tp,
                dtype=args.dtype,
                speculation_policy=args.policy,
                **({"threads": args.threads} if args.threads else {}),
            )
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
    # a command is required: `cactus` alone prints the usage and exits 2 (argparse's error)
    sub = p.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _client_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done; 2 a bad value; 1 any other error; 130 Ctrl-C; 141 stdout's
    reader went away (`| head`), as a shell reports a process SIGPIPE ended."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _replace_unencodable(sys.stdout)
    try:
        if args.command == "generate":
            return generate(args)
        if args.command == "client":
            return client(args)
    except BrokenPipeError:
        _stdout_to_devnull()
        return 141
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command!r}")  # exits 2; argparse refuses it first


def _replace_unencodable(stream) -> None:
    """Text the terminal's encoding cannot show (PYTHONIOENCODING=ascii, a C locale) is
    printed escaped (\\xe9), not an error halfway through a stream."""
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None:
        with contextlib.suppress(OSError, ValueError):
            reconfigure(errors="backslashreplace")


def _stdout_to_devnull() -> None:
    """After a broken pipe, what is left in stdout's buffer cannot be written: point the
    descriptor at /dev/null so that Python's flush at exit neither fails nor says so (the
    recipe in Python's documentation of SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real descriptor (a test's capture)
        pass


if __name__ == "__main__":
    sys.exit(main())
