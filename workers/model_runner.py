"""One causal LM with a KV cache per sequence: prefill, block forward, roll back.

Loads any local Hugging Face causal-LM folder (Llama, Qwen2, Qwen3, Mistral, ...) through
the Auto classes; nothing here branches on the model type. transformers 5.24 API: the
cache is passed as `cache=`, and `DynamicCache.crop` takes a negative count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    GenerationConfig,
)
from transformers.utils import logging as hf_logging

from cactus import environment

environment.apply()  # also in Ray workers: offline Hugging Face
hf_logging.disable_progress_bar()  # a server's logs are not a terminal

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Sequence:
    cache: DynamicCache
    length: int = 0  # tokens in the cache


class LoadedModel:
    """A local checkpoint folder loaded through the Auto classes: the model (or one given,
    such as a DeepSpeed AutoTP shard), its config and tokenizer. Both runners build on it."""

    def __init__(
        self, path: str, *, dtype: str | torch.dtype = "float32", device: str = "cpu", model=None
    ) -> None:
        self.path = str(path)
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.config = AutoConfig.from_pretrained(self.path)
        if model is not None:
            # A model handed in (a DeepSpeed shard) is not moved: it must already be on
            # this device, or every forward would mix devices.
            on = next(model.parameters()).device
            if on.type != self.device.type:
                raise ValueError(f"device: the model is on {on}, the runner on {self.device}")
        self.model = (
            model
            if model is not None
            else AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype).to(self.device)
        )
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a text: the tokenizer's EOS and the checkpoint's
        generation_config.json's (a list in many instruct checkpoints; vLLM stops at
        those too), else the model config's."""
        ids = set() if self.tokenizer.eos_token_id is None else {self.tokenizer.eos_token_id}
        try:
            extra = GenerationConfig.from_pretrained(self.path).eos_token_id
        except OSError:  # no generation_config.json
            extra = None
        if extra is None and not ids:
            extra = getattr(self.config, "eos_token_id", None)
        ids.update([extra] if isinstance(extra, int) else extra or ())
        return tuple(sorted(int(t) for t in ids))


class ModelRunner(LoadedModel):
    """A model, its tokenizer and one KV cache per sequence id (the reference the batched
    runner is tested against)."""

    def __init__(
        self, path: str, *, dtype: str | torch.dtype = "float32", device: str = "cpu", model=None
    ) -> None:
        super().__init__(path, dtype=dtype, device=device, model=model)
        self._seqs: dict[str, _Sequence] = {}

    @property
    def num_sequences(self) -> int:
        """Caches currently held (tests check it returns to 0)."""
        return len(self._seqs)

    def length(self, seq_id: str) -> int:
        return self._seqs[seq_id].length

    def start(self, seq_id: str) -> None:
        """Open an empty cache for a sequence (replacing any old one with the same id)."""
        self._seqs[seq_id] = _Sequence(DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def forward(self, seq_id: str, token_ids: list[int]) -> torch.Tensor:
        """Append tokens to the sequence; return float32 logits [n, V] at those positions."""
        seq = self._seqs[seq_id]
        if not token_ids:
            return torch.empty(0, self.vocab_size, device=self.device)
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(seq.length, seq.length + len(token_ids), device=self.device)
        out = self.model(
            input_ids=ids, cache=seq.cache, position_ids=positions[None], use_cache=True
        )
        seq.length += len(token_ids)
        return out.logits[0].float()

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        """Drop the last `num_tokens` tokens from the sequence's cache."""
        if num_tokens <= 0:
            return
        seq = self._seqs[seq_id]
        if num_tokens > seq.length:
            raise ValueError(f"num_tokens: cannot roll back {num_tokens} of {seq.length}")
        seq.cache.crop(-num_tokens)
        seq.length -= num_tokens

    def release(self, seq_id: str) -> bool:
        """Free a sequence's cache; True if it existed."""
        return self._seqs.pop(seq_id, None) is not None
