"""Shared fixtures: quiet, offline, deterministic; tiny checkpoints built once per session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest
import torch
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from tests.tiny_models import train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tiny_tokenizer):
    """family -> folder of a tiny random model of that family."""
    from tests.tiny_models import FAMILIES, build_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {f: build_tiny(root / f, f, tiny_tokenizer, seed=i) for i, f in enumerate(FAMILIES)}
