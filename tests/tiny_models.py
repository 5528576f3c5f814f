"""Tiny randomly initialised checkpoints of several families, built on the fly (tests).

Each is saved with save_pretrained next to a small byte-level BPE tokenizer, so the
runner loads it exactly as it would load a user's Qwen or Llama folder.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedTokenizerFast,
)

from models import corpus

EOS = corpus.EOS
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def train_tokenizer(out_dir: Path, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few standard-library files (deterministic)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "glob.py")]
    fast = corpus.train_tokenizer(texts, vocab_size=vocab_size)  # the embedded models' recipe
    fast.save_pretrained(out_dir)
    return fast


def tiny_config(
    family: str,
    vocab_size: int,
    eos_id: int,
    *,
    layers: int = 2,
    hidden: int = 32,
    max_position_embeddings: int = 256,
):
    return AutoConfig.for_model(
        family,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=True,
    )


def build_tiny(
    out_dir: Path,
    family: str,
    tokenizer: PreTrainedTokenizerFast,
    *,
    seed: int,
    layers: int = 2,
    hidden: int = 32,
    max_position_embeddings: int = 256,
) -> Path:
    torch.manual_seed(seed)
    config = tiny_config(
        family,
        len(tokenizer),
        tokenizer.eos_token_id,
        layers=layers,
        hidden=hidden,
        max_position_embeddings=max_position_embeddings,
    )
    model = AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
