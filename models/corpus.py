"""Training corpus and tokenizer for the embedded default models.

The corpus is the Python standard library that ships with the interpreter
(``sysconfig.get_paths()["stdlib"]``), so building needs no download. Files are
read in sorted relative-path order and split into train / held-out by a hash of
the relative path, which keeps the split stable across machines and runs.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
VOCAB_SIZE = 8192
HELDOUT_PERCENT = 5
MAX_FILE_BYTES = 300_000

# Directory names whose files are test data, generated tables or vendored code.
_SKIP_DIRS = {
    "site-packages",
    "test",
    "tests",
    "idle_test",
    "encodings",
    "__pycache__",
    "turtledemo",
}


def stdlib_root() -> Path:
    """Directory holding this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def _keep(rel: Path, size: int) -> bool:
    """Whether a stdlib file belongs in the corpus."""
    if any(part in _SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
        return False
    if rel.name.startswith("_sysconfigdata"):
        return False
    return 0 < size <= MAX_FILE_BYTES


def list_files(root: Path | None = None) -> list[str]:
    """Sorted relative paths (POSIX style) of the corpus files."""
    root = root or stdlib_root()
    rels = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if path.is_file() and _keep(rel, path.stat().st_size):
            rels.append(rel.as_posix())
    return sorted(rels)


def is_heldout(rel: str) -> bool:
    """Held-out split: about HELDOUT_PERCENT % of files, chosen by path hash."""
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


def load_texts(split: str, root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) pairs of one split, "train" or "heldout", in path order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    root = root or stdlib_root()
    want_heldout = split == "heldout"
    out = []
    for rel in list_files(root):
        if is_heldout(rel) == want_heldout:
            text = (root / rel).read_bytes().decode("utf-8", errors="replace")
            out.append((rel, text))
    return out


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Byte-level BPE over ``texts``, wrapped for transformers with EOS as BOS/EOS/PAD."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All texts tokenised and joined into one stream, each file followed by EOS."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def make_blocks(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping (n, seq_len + 1) windows: inputs are [:, :-1], targets [:, 1:]."""
    n = (len(stream) - 1) // seq_len
    starts = torch.arange(n) * seq_len
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])
