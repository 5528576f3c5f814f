"""Model shapes of the embedded verifier / draft pair (and the tiny smoke pair)."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

MAX_POSITIONS = 1024

# name -> (layers, hidden, heads, intermediate)
SHAPES = {
    "verifier": (16, 384, 6, 1024),
    "draft": (1, 256, 4, 688),
    "smoke-verifier": (2, 64, 2, 128),
    "smoke-draft": (1, 32, 2, 64),
}


def llama_config(name: str, vocab_size: int, eos_id: int) -> LlamaConfig:
    """LlamaConfig for one of SHAPES, with tied embeddings and EOS as BOS/EOS/PAD."""
    layers, hidden, heads, inter = SHAPES[name]
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def build_model(name: str, vocab_size: int, eos_id: int) -> LlamaForCausalLM:
    """Randomly initialised float32 LlamaForCausalLM of the named shape."""
    return LlamaForCausalLM(llama_config(name, vocab_size, eos_id)).float()


def param_count(model: LlamaForCausalLM) -> int:
    """Number of distinct parameters (tied embedding counted once)."""
    return sum(p.numel() for p in model.parameters())
