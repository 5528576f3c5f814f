"""The `cactus` command line, in-process, on the embedded models."""

from __future__ import annotations

import json

from client.cli import main


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
