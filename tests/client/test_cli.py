"""The `cactus` command line: `generate` in-process on the embedded models; `client`
against a stand-in gRPC server that records what it receives."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from client import CactusClient
from client.cli import build_parser, client_kwargs, main, result_json
from deployments.ingress import result_pb  # the server's own reply of a result
from protos.cactus.v1 import cactus_pb2 as pb
from protos.cactus.v1 import cactus_pb2_grpc as pb_grpc
from workers.request import GenerationChunk, GenerationResult, SpecStats


def test_generate_prints_one_json_result(capsys):
    argv = ["generate", "--prompt", "def add(a, b):", "--max-tokens", "8"]
    assert main([*argv, "--temperature", "0", "--json", "--rule", "sps"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["finish_reason"] == "LENGTH" and len(out["token_ids"]) == 8


def test_bad_field_exits_2_naming_it(capsys):
    assert main(["generate", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_the_quickstart_generate_command_and_its_stream(capsys):
    """README Quickstart: `cactus generate --prompt 'def add(a, b):' --rule cactus
    --delta 1 --json` prints one JSON result of a Cactus request; `--stream` prints the
    text as it is produced, the same text a non-streamed greedy run gives."""
    argv = ["generate", "--prompt", "def add(a, b):"]
    assert main([*argv, "--rule", "cactus", "--delta", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["finish_reason"] in ("LENGTH", "EOS") and out["token_ids"] and out["text"]
    assert out["usage"]["completion_tokens"] == len(out["token_ids"])
    assert out["stats"]["num_draft_tokens"] > 0  # it speculated
    greedy = [*argv, "--max-tokens", "24", "--temperature", "0"]
    assert main([*greedy, "--json"]) == 0
    text = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]
    assert main([*greedy, "--stream"]) == 0
    assert capsys.readouterr().out == text + "\n"


# what the stand-in server answers: the engine's result, as the server sends it
RESULT = GenerationResult(
    request_id="r-1",
    text="ok",
    token_ids=(1, 2),
    finish_reason="LENGTH",
    prompt_tokens=3,
    seed=(1 << 63) + 5,  # past int64: MessageToDict wrote it as a string
    stats=SpecStats(
        num_drafts=1,
        num_draft_tokens=4,
        num_accepted_tokens=1,
        accepted_per_position=[1, 0, 0, 0],
        divergence_nats=0.25,
    ),
)


# the prompts the stand-in refuses, with the status it answers
REFUSED = {
    "invalid": (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: 5000 does not fit"),
    "denied": (grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token"),
}


# the prompts answered with another text and finish_reason
SPECIAL = {"accent": ("café", "LENGTH"), "late": ("cut", "TIME_LIMIT"), "abort": ("a", "ABORT")}


class Recorder(pb_grpc.CactusServicer):
    """Answers every request with RESULT (streamed in two chunks, as the server splits
    it: the last carries finish_reason, usage, seed and stats), keeping each as received;
    refuses the prompts in REFUSED."""

    def __init__(self) -> None:
        self.received: list[pb.GenerateRequest] = []
        self.metadata: list[dict] = []

    def _refuse(self, request, context) -> None:
        self.received.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if request.prompt in REFUSED:
            context.abort(*REFUSED[request.prompt])

    def Generate(self, request, context):
        self._refuse(request, context)
        reply = result_pb(RESULT)
        if request.prompt in SPECIAL:
            reply.text, reply.finish_reason = SPECIAL[request.prompt]
        return reply

    def GenerateStream(self, request, context):
        self._refuse(request, context)
        full = result_pb(RESULT)
        if request.prompt == "slow":  # 50 chunks over about 2.5 s
            for i in range(50):
                time.sleep(0.05)
                yield pb.GenerateResponse(request_id=full.request_id, text=f"chunk {i}\n")
            return
        if request.prompt in SPECIAL:
            text, finish = SPECIAL[request.prompt]
            yield pb.GenerateResponse(request_id=full.request_id, text=text, finish_reason=finish)
            return
        yield pb.GenerateResponse(request_id=full.request_id, text="o", token_ids=[1])
        last = pb.GenerateResponse(request_id=full.request_id, text="k", token_ids=[2])
        last.finish_reason = full.finish_reason
        last.usage.CopyFrom(full.usage)
        last.seed = full.seed
        last.stats.CopyFrom(full.stats)
        yield last


@pytest.fixture()
def recorder():
    servicer = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_CactusServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


def _unset(msg: pb.GenerateRequest) -> None:
    """Every sampling and speculation field unset: the server's defaults."""
    s, sp = msg.sampling, msg.speculation
    for name in ("max_tokens", "temperature", "top_p", "seed", "logprobs"):
        assert not s.HasField(name), name
    for name in ("delta", "num_speculative_tokens", "max_divergence_nats"):
        assert not sp.HasField(name), name
    assert (s.top_k, list(s.stop), list(s.stop_token_ids), sp.rule) == (0, [], [], "")


def test_client_zero_max_tokens_and_k_are_unset_with_a_future_warning():
    """README: `cactus client` reads a 0 for max_tokens or num_speculative_tokens as unset
    (its meaning before 2026-12-05), with a FutureWarning; the arguments, as the command
    turns them into a request."""
    for flag, name in (("--max-tokens", "max_tokens"), ("-K", "num_speculative_tokens")):
        args = build_parser().parse_args(["client", "--prompt", "x", flag, "0"])
        with pytest.warns(FutureWarning, match=f"{name}=0"):
            msg = CactusClient.request(args.prompt, **client_kwargs(args))
        _unset(msg)
    # a value given is sent
    args = build_parser().parse_args(["client", "--prompt", "x", "--max-tokens", "5", "-K", "3"])
    msg = CactusClient.request(args.prompt, **client_kwargs(args))
    assert (msg.sampling.max_tokens, msg.speculation.num_speculative_tokens) == (5, 3)


@pytest.mark.parametrize("stream", [False, True])
def test_client_command_sends_unset_fields_and_reads_zero_as_unset(recorder, capsys, stream):
    """The whole `cactus client` command: with no field given every field reaches the
    server unset; `--max-tokens 0 -K 0` warns and reaches it unset too."""
    servicer, address = recorder
    argv = ["client", "--address", address, "--prompt", "x", *(["--stream"] * stream)]
    assert main(argv) == 0
    with pytest.warns(FutureWarning) as warned:
        assert main([*argv, "--max-tokens", "0", "-K", "0"]) == 0
    assert sorted(str(w.message).split("=")[0] for w in warned) == [
        "max_tokens",
        "num_speculative_tokens",
    ]
    assert capsys.readouterr().out.split() == ["ok", "ok"]
    assert len(servicer.received) == 2
    for msg in servicer.received:
        assert msg.prompt == "x"
        _unset(msg)
    # flags given are sent
    assert main([*argv, "--top-k", "7", "--rule", "sps", "--stop", "\n", "--max-tokens", "9"]) == 0
    msg = servicer.received[-1]
    assert (msg.sampling.top_k, msg.speculation.rule, list(msg.sampling.stop)) == (
        7,
        "sps",
        ["\n"],
    )
    assert msg.sampling.max_tokens == 9


def test_client_token_defaults_to_the_environment_variable(recorder, monkeypatch, capsys):
    """README: `--token` defaults to $CACTUS_AUTH_TOKEN (sent as `authorization: Bearer`
    metadata); the flag wins over it, and with neither no authorization is sent."""
    servicer, address = recorder
    argv = ["client", "--address", address, "--prompt", "x"]
    monkeypatch.setenv("CACTUS_AUTH_TOKEN", "from-env")
    assert main(argv) == 0
    assert servicer.metadata[-1].get("authorization") == "Bearer from-env"
    assert main([*argv, "--token", "from-flag"]) == 0
    assert servicer.metadata[-1].get("authorization") == "Bearer from-flag"
    monkeypatch.delenv("CACTUS_AUTH_TOKEN")
    assert main(argv) == 0
    assert "authorization" not in servicer.metadata[-1]
    assert capsys.readouterr().out.split() == ["ok"] * 3


def test_client_values_protobuf_cannot_hold_are_an_error_not_a_traceback(capsys):
    """A negative max_tokens, K or seed cannot go into the message's unsigned fields:
    `cactus client` says so and exits 2 (no server is needed to find out)."""
    from client.cli import main

    for flags in (["--max-tokens", "-1"], ["-K", "-1"], ["--seed", "-1"]):
        code = main(["client", "--address", "127.0.0.1:1", "--prompt", "x", *flags])
        err = capsys.readouterr().err
        assert code == 2, (flags, err)
        assert err.startswith("error: ") and "Traceback" not in err, err


def test_generate_names_a_model_folder_that_is_not_there(tmp_path, capsys):
    from client.cli import main

    missing = tmp_path / "nope"
    assert main(["generate", "--prompt", "x", "--verifier", str(missing)]) == 2
    assert f"--verifier: no such folder: {missing}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, named",
    [(["--threads", "-1"], "--threads"), (["--tp", "2"], "--tp"), (["--tp", "0"], "--tp")],
)
def test_generate_refuses_threads_and_tp_it_cannot_use(flags, named, capsys):
    """--threads -1 reached torch.set_num_threads (a RuntimeError traceback, exit 1);
    --tp 2 without --backend ray was silently one process. Both exit 2 naming the flag,
    before any model loads."""
    from client.cli import main

    assert main(["generate", "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}:") and "Traceback" not in err, err


@pytest.mark.parametrize("stream", [False, True])
def test_client_json_is_the_dict_generate_json_prints(recorder, capsys, stream):
    """`cactus client --json` prints the dict `cactus generate --json` prints
    (result_json: snake_case, ints as ints, defaults kept), less the stats the gRPC API
    does not carry; with --stream, after the text, with text and token ids gathered over
    every chunk (it printed the last chunk alone, as protobuf's MessageToDict)."""
    _, address = recorder
    argv = ["client", "--address", address, "--prompt", "x", "--json", *(["--stream"] * stream)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:-1] == (["ok"] if stream else [])
    out = json.loads(lines[-1])
    want = result_json(RESULT)
    for name in ("divergence_capped", "draft_s", "verify_s", "kernel_s"):  # not in the API
        del want["stats"][name]
    assert out == want
    assert out["seed"] == (1 << 63) + 5 and out["token_ids"] == [1, 2] and out["text"] == "ok"


def test_client_exit_status_invalid_argument_is_2_other_errors_1(recorder, capsys):
    """A field the server refuses (INVALID_ARGUMENT) exits 2, as a bad field does in
    `cactus generate` and in the client's own checks; any other error exits 1."""
    _, address = recorder
    for stream in ([], ["--stream"]):
        base = ["client", "--address", address, *stream, "--prompt"]
        assert main([*base, "invalid"]) == 2
        assert "error: INVALID_ARGUMENT: max_tokens:" in capsys.readouterr().err
        assert main([*base, "denied"]) == 1
        assert "error: UNAUTHENTICATED:" in capsys.readouterr().err
        # refused before any call: a --timeout that is no deadline
        assert main([*base, "x", "--timeout", "0"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: timeout: ") and "Traceback" not in err, err


def test_client_closes_its_channel_whatever_the_outcome(recorder, monkeypatch, capsys):
    _, address = recorder
    closed = []
    monkeypatch.setattr(CactusClient, "close", lambda self: closed.append(self))
    base = ["client", "--address", address, "--prompt"]
    assert main([*base, "x"]) == 0
    assert main([*base, "x", "--stream"]) == 0
    assert main([*base, "denied"]) == 1
    assert main([*base, "x", "--seed", "-1"]) == 2  # refused by the client's own check
    assert len(closed) == 4 and len(set(map(id, closed))) == 4


def test_client_flags_say_what_they_do():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {opt: a.help for a in sub.choices["client"]._actions for opt in a.option_strings}
    for flag in ("--stream", "--json", "--timeout", "--token"):
        assert flags[flag], flag
    assert "CACTUS_AUTH_TOKEN" in flags["--token"]  # its default, when exported


def test_cactus_without_a_command_exits_2_with_its_usage(capsys):
    """argparse's convention for a missing argument: the usage and an error on stderr,
    exit status 2 (it printed the help and exited 0)."""
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: cactus") and "generate" in err and "client" in err


REPO = Path(__file__).resolve().parents[2]


def _cli(*argv: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "client.cli", *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )


def test_a_stream_piped_to_head_ends_quietly_with_141(recorder):
    """`cactus client --stream | head -c 1`: the reader goes away after a byte; the
    command ends without a traceback or Python's "Exception ignored" at exit, with 141,
    the status a shell gives a process SIGPIPE ended (it gave a BrokenPipeError
    traceback and 120)."""
    _, address = recorder
    proc = _cli("client", "--address", address, "--prompt", "slow", "--stream")
    assert proc.stdout.read(1) == b"c"
    proc.stdout.close()  # the pipe's reader is gone; the stream goes on for ~2 s
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_generate_whose_stdout_breaks_ends_with_141(monkeypatch, capsys):
    """`cactus generate --stream | head`: a write to the closed pipe ends the command
    with 141, not 2 and "error: [Errno 32] Broken pipe" (it was caught as a bad field's
    OSError)."""
    import workers.local

    class Engine:
        def stream(self, request):
            for text in ("a", "b", "c"):
                yield GenerationChunk(request_id="r", token_ids=(1,), text=text)

    class Broken:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr(workers.local, "local_engine", lambda *a, **k: Engine())
    monkeypatch.setattr(sys, "stdout", Broken())
    assert main(["generate", "--prompt", "x", "--stream"]) == 141


def test_ctrl_c_during_a_stream_says_interrupted_and_exits_130(recorder, monkeypatch, capsys):
    _, address = recorder

    def stream(self, prompt, **kw):
        yield pb.GenerateResponse(text="partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(CactusClient, "stream", stream)
    assert main(["client", "--address", address, "--prompt", "x", "--stream"]) == 130
    captured = capsys.readouterr()
    assert captured.out == "partial" and captured.err == "\ninterrupted\n", captured


def test_text_the_terminal_cannot_encode_is_printed_escaped(recorder):
    """PYTHONIOENCODING=ascii (a C locale): "café" is printed as caf\\xe9, exit 0 (it was
    a UnicodeEncodeError reported as a bad field, exit 2), unary and stream."""
    _, address = recorder
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    for stream in ([], ["--stream"]):
        proc = _cli("client", "--address", address, "--prompt", "accent", *stream, env=env)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        assert out == b"caf\\xe9\n", out


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_cut_short_says_so(recorder, capsys, stream):
    """A time limit ends the text early: printed, a note on stderr, exit 0 (as
    "length"); ABORT (an engine that ended it without a result) exits 1."""
    _, address = recorder
    base = ["client", "--address", address, *(["--stream"] * stream), "--prompt"]
    assert main([*base, "late"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "cut" and "finish_reason TIME_LIMIT" in captured.err
    assert main([*base, "abort"]) == 1
    assert "error: finish_reason ABORT" in capsys.readouterr().err
    assert main([*base, "x"]) == 0
    assert capsys.readouterr().err == ""


def test_client_time_limit_is_the_requests_own_and_timeout_bounds_it(recorder, capsys):
    """`--time-limit` is the request's server-side time_limit_s (what ends a text
    early with TIME_LIMIT, exit 0); without it the request carries what is left of
    `--timeout` (the client library's safety net for a lost cancel)."""
    servicer, address = recorder
    base = ["client", "--address", address, "--prompt", "x"]
    assert main([*base, "--time-limit", "2.5", "--timeout", "30"]) == 0
    assert servicer.received[-1].time_limit_s == pytest.approx(2.5)
    assert main([*base, "--timeout", "30"]) == 0
    assert 25.0 < servicer.received[-1].time_limit_s <= 30.0
    capsys.readouterr()
    assert main([*base, "--time-limit", "nan"]) == 2  # (ranges are the server's to check)
    assert "time_limit_s" in capsys.readouterr().err


def test_client_sends_stop_token_ids_and_a_divergence_ceiling(recorder, capsys):
    """The two fields `cactus generate` had and `cactus client` did not."""
    servicer, address = recorder
    argv = ["client", "--address", address, "--prompt", "x"]
    flags = ["--stop-token-id", "7", "--stop-token-id", "9", "--max-divergence-nats", "2.5"]
    assert main([*argv, *flags]) == 0
    msg = servicer.received[-1]
    assert list(msg.sampling.stop_token_ids) == [7, 9]
    assert msg.speculation.max_divergence_nats == 2.5


def test_generate_with_ray_refuses_a_bad_field_before_ray_starts(monkeypatch, capsys):
    """`cactus generate --backend ray --temperature 5` started a Ray head and the whole
    engine group, then printed the actor's remote traceback: now one line naming the
    field, and nothing starts."""
    import client.cli as cli

    monkeypatch.setattr(cli, "_run_ray", lambda *a: pytest.fail("Ray started"))
    assert main(["generate", "--backend", "ray", "--prompt", "x", "--temperature", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: temperature") and err.count("\n") == 1, err


def test_generate_with_ray_prints_the_remote_error_not_its_traceback(monkeypatch, capsys):
    """An error raised in an actor arrives wrapped (a RayTaskError whose text is the
    remote traceback, its `cause` the error): the command prints the error's own line."""
    import client.cli as cli
    from cactus.errors import InvalidRequestError

    class Wrapped(Exception):
        def __init__(self, cause):
            super().__init__("ray::Rank0.stream()\nTraceback (most recent call last):\n ...")
            self.cause = cause

    def run(args, request):
        raise Wrapped(InvalidRequestError("max_tokens", "does not fit"))

    monkeypatch.setattr(cli, "_run_ray", run)
    assert main(["generate", "--backend", "ray", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: max_tokens") and "Traceback" not in err, err


@pytest.mark.parametrize("policy", ["fixed", "goodput"])
def test_generate_takes_the_speculation_policy(policy, monkeypatch, capsys):
    """README: seeded repeats under a lossy rule need `speculation.policy: fixed`; the
    in-process command had no way to ask for it (always goodput)."""
    import workers.local

    seen = {}

    class Engine:
        def stream(self, request):
            yield GenerationChunk("r", (1, 2), "ok", "LENGTH", RESULT)

    def engine(*args, **kw):
        seen.update(kw)
        return Engine()

    monkeypatch.setattr(workers.local, "local_engine", engine)
    assert main(["generate", "--prompt", "x", "--stream", "--policy", policy]) == 0
    assert seen["scheduler"].policy == policy


def test_generate_refuses_a_prompt_that_is_not_unicode(capsys):
    """Undecodable bytes in argv become lone surrogates, which reached the tokenizer
    (a TypeError traceback, exit 1); `cactus client` and the HTTP API refused them
    already. Now exit 2 naming the prompt, before a model loads."""
    assert main(["generate", "--prompt", "def \udcff"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: prompt: must be valid Unicode text") and "Traceback" not in err
    assert main(["generate", "--prompt", "x", "--stop", "\udcff"]) == 2
    assert capsys.readouterr().err.startswith("error: stop: must be valid Unicode text")


def test_generate_names_the_model_folders_when_a_weights_file_is_corrupt(tmp_path, capsys):
    """A truncated model.safetensors raised safetensors' own error (not an OSError): a
    traceback. Now one line naming both folders, exit 2."""
    import shutil

    from tests.conftest import embedded_dirs

    _, draft = embedded_dirs()
    broken = tmp_path / "draft"
    shutil.copytree(draft, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["generate", "--prompt", "x", "--draft", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --verifier / --draft: cannot load the models"), err
    assert str(broken) in err and "Traceback" not in err and err.count("\n") == 1


def test_generate_with_ray_prints_any_remote_errors_first_line(monkeypatch, capsys):
    """README: with --backend ray an actor's error is printed as its one line. Only
    errors that were Ray's own after unwrapping were: an actor's TypeError or torch
    RuntimeError printed the whole remote traceback."""
    from ray.exceptions import RayTaskError

    import client.cli as cli

    def run(args, request):
        raise RayTaskError(
            "Rank0.stream", "Traceback (most recent call last):\n ...", TypeError("bad tensor")
        )

    monkeypatch.setattr(cli, "_run_ray", run)
    assert main(["generate", "--backend", "ray", "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err == "error: TypeError: bad tensor\n", err
