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
