"""The embedded models: the shipped pair is consistent, and `python -m models.build`
repeats itself and replaces a pair only whole (its smoke plan, in a few seconds)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from models import build as builder

MODELS = Path(builder.__file__).resolve().parent
FILES = ("model.safetensors", "tokenizer.json", "config.json")


def _params(folder: Path) -> int:
    with safe_open(folder / "model.safetensors", framework="pt") as weights:
        names = weights.keys()  # (the handle itself is not iterable)
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in names)


def test_the_shipped_pair_shares_one_tokenizer_and_matches_its_model_card():
    measured = json.loads((MODELS / "measured.json").read_text())
    tokenizers = {
        name: (MODELS / name / "tokenizer.json").read_bytes() for name in ("verifier", "draft")
    }
    assert tokenizers["verifier"] == tokenizers["draft"]
    for name in ("verifier", "draft"):
        folder = MODELS / name
        config = AutoConfig.from_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        generation = GenerationConfig.from_pretrained(folder)
        assert config.vocab_size == len(tokenizer) == 8192
        assert config.max_position_embeddings == tokenizer.model_max_length == 1024
        eos = tokenizer.eos_token_id
        assert eos == 0 and config.eos_token_id == generation.eos_token_id == eos
        assert _params(folder) == measured[f"{name}_params"], name


def _tree(folder: Path) -> dict[str, bytes]:
    return {f"{m}/{f}": (folder / m / f).read_bytes() for m in ("verifier", "draft") for f in FILES}


def test_a_build_repeats_itself_and_replaces_a_pair_only_whole(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    stats = builder.build(builder.SMOKE, first)
    builder.build(builder.SMOKE, second)
    built = _tree(first)
    assert built == _tree(second)  # byte for byte: seeds, data order and steps are fixed
    assert built["verifier/tokenizer.json"] == built["draft/tokenizer.json"]
    assert json.loads((first / "build_stats.json").read_text()) == stats
    assert stats["python"] and stats["torch"]
    assert sorted(p.name for p in first.iterdir()) == ["build_stats.json", "draft", "verifier"]

    # a run that fails while training the draft (interrupted, say) leaves the old pair
    train = builder.run_training

    def fails_on_the_draft(model, blocks, spec, loss, name):
        if name == "draft":
            raise KeyboardInterrupt
        return train(model, blocks, spec, loss, name)

    monkeypatch.setattr(builder, "run_training", fails_on_the_draft)
    monkeypatch.setattr(
        builder, "SMOKE", builder.BuildPlan(**{**vars(builder.SMOKE), "vocab_size": 300})
    )
    with pytest.raises(KeyboardInterrupt):
        builder.build(builder.SMOKE, first)
    assert _tree(first) == built
