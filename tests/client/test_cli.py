"""The `cactus` command line: `generate` in-process on the embedded models; `client`
against a stand-in gRPC server that records what it receives."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import pytest

from client import CactusClient
from client.cli import build_parser, client_kwargs, main
from protos.cactus.v1 import cactus_pb2 as pb
from protos.cactus.v1 import cactus_pb2_grpc as pb_grpc


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


class Recorder(pb_grpc.CactusServicer):
    """Answers every request, keeping each as received."""

    def __init__(self) -> None:
        self.received: list[pb.GenerateRequest] = []

    def Generate(self, request, context):
        self.received.append(request)
        return pb.GenerateResponse(request_id="r", text="ok", token_ids=[1])

    def GenerateStream(self, request, context):
        self.received.append(request)
        yield pb.GenerateResponse(request_id="r", text="ok", token_ids=[1], finish_reason="EOS")


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
