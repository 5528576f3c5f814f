"""Rebuild the embedded default models from scratch.

    python -m models.build                      # verifier + draft into models/
    python -m models.build --smoke --out DIR    # tiny pair, a few steps, under a minute

Steps: train a byte-level BPE tokenizer on the stdlib corpus, pretrain the
verifier on next-token prediction, save it (bfloat16), reload it and distill the
draft on the verifier's full softmax over the same training text, save the draft.
Seeds, data order and step counts are fixed, so a rerun repeats the same run. Both
models are built in a staging folder and moved into place together at the end, so an
interrupted run leaves the old pair, never a new verifier beside an old draft.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

from models import arch, corpus
from models.train import TrainSpec, distill_loss, heldout_loss, lm_loss, run_training

MODELS_DIR = Path(__file__).resolve().parent
SAVE_DTYPE = torch.bfloat16


@dataclass
class BuildPlan:
    """Everything that differs between the real build and the smoke build."""

    verifier_shape: str
    draft_shape: str
    vocab_size: int
    seq_len: int
    verifier: TrainSpec
    draft: TrainSpec
    max_train_files: int | None = None
    max_heldout_blocks: int | None = None


FULL = BuildPlan(
    verifier_shape="verifier",
    draft_shape="draft",
    vocab_size=corpus.VOCAB_SIZE,
    seq_len=256,
    verifier=TrainSpec(steps=600, batch=8, lr=1e-3, warmup=40, seed=1234),
    draft=TrainSpec(steps=480, batch=8, lr=2e-3, warmup=30, seed=4321),
)

SMOKE = BuildPlan(
    verifier_shape="smoke-verifier",
    draft_shape="smoke-draft",
    vocab_size=512,
    seq_len=64,
    verifier=TrainSpec(steps=4, batch=2, lr=1e-3, warmup=1, seed=1234, log_every=1),
    draft=TrainSpec(steps=4, batch=2, lr=1e-3, warmup=1, seed=4321, log_every=1),
    max_train_files=20,
    max_heldout_blocks=4,
)


def prepare_data(plan: BuildPlan):
    """Tokenizer plus train / held-out blocks of ``plan.seq_len + 1`` tokens."""
    train = [text for _, text in corpus.load_texts("train")][: plan.max_train_files]
    heldout = [text for _, text in corpus.load_texts("heldout")]
    tokenizer = corpus.train_tokenizer(train, plan.vocab_size)
    train_blocks = corpus.make_blocks(corpus.encode_stream(tokenizer, train), plan.seq_len)
    heldout_blocks = corpus.make_blocks(corpus.encode_stream(tokenizer, heldout), plan.seq_len)
    heldout_blocks = heldout_blocks[: plan.max_heldout_blocks]
    print(
        f"corpus: {len(train)} train files, {train_blocks.numel()} train tokens in "
        f"{len(train_blocks)} blocks; {len(heldout_blocks)} held-out blocks",
        flush=True,
    )
    return tokenizer, train_blocks, heldout_blocks


def save_model(model, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Save weights in SAVE_DTYPE, config, sampling defaults and the tokenizer."""
    eos = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        top_k=20,
        top_p=0.95,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    model.to(SAVE_DTYPE).save_pretrained(out)
    model.float()
    tokenizer.save_pretrained(out)


def load_float32(path: Path):
    """A saved model reloaded for float32 CPU compute."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def build(plan: BuildPlan, out: Path) -> dict:
    """Train and save the verifier / draft pair under ``out``; return build stats."""
    staging = out / ".build"
    shutil.rmtree(staging, ignore_errors=True)  # an interrupted run's
    stats = _build(plan, staging)
    _publish(staging, out)
    return stats


def _publish(staging: Path, out: Path) -> None:
    """Replace out/verifier, out/draft and out/build_stats.json by the staged ones."""
    for name in ("verifier", "draft"):
        old = out / f".old-{name}"
        shutil.rmtree(old, ignore_errors=True)
        if (out / name).exists():
            (out / name).rename(old)
    for name in ("verifier", "draft", "build_stats.json"):
        (staging / name).rename(out / name)
    for name in ("verifier", "draft"):
        shutil.rmtree(out / f".old-{name}", ignore_errors=True)
    staging.rmdir()


def _build(plan: BuildPlan, out: Path) -> dict:
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    tokenizer, train_blocks, heldout_blocks = prepare_data(plan)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id

    torch.manual_seed(plan.verifier.seed)
    verifier = arch.build_model(plan.verifier_shape, vocab, eos)
    print(f"verifier: {arch.param_count(verifier) / 1e6:.2f}M params", flush=True)
    v_stats = run_training(
        verifier, train_blocks, plan.verifier, lambda b: _twice(lm_loss(verifier, b)), "verifier"
    )
    save_model(verifier, tokenizer, out / "verifier")
    verifier = load_float32(out / "verifier")  # distill against the weights as shipped
    v_stats["heldout_loss"] = round(heldout_loss(verifier, heldout_blocks), 4)
    print(f"verifier held-out loss {v_stats['heldout_loss']:.4f} nats/token", flush=True)

    torch.manual_seed(plan.draft.seed)
    draft = arch.build_model(plan.draft_shape, vocab, eos)
    print(f"draft: {arch.param_count(draft) / 1e6:.2f}M params", flush=True)
    d_stats = run_training(
        draft, train_blocks, plan.draft, lambda b: distill_loss(draft, verifier, b), "draft"
    )
    save_model(draft, tokenizer, out / "draft")
    d_stats["heldout_loss"] = round(heldout_loss(load_float32(out / "draft"), heldout_blocks), 4)
    print(f"draft held-out loss {d_stats['heldout_loss']:.4f} nats/token", flush=True)

    stats = {
        "verifier": v_stats,
        "draft": d_stats,
        "train_tokens_available": train_blocks.numel(),
        "total_wall_s": round(time.perf_counter() - t0, 1),
        # what the corpus and the arithmetic came from: another Python has another
        # stdlib (so another tokenizer and weights)
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    (out / "build_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def _twice(loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapt a single loss to run_training's (loss, reported ce) pair."""
    return loss, loss.detach()


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny pair, a few steps")
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    args = parser.parse_args(argv)
    from cactus import environment

    environment.apply()
    if args.smoke and args.out is None:
        parser.error("--smoke needs --out (the smoke pair never replaces models/)")
    out = args.out or MODELS_DIR
    if args.smoke and out.resolve() == MODELS_DIR:
        parser.error("--smoke must not write into models/")
    stats = build(SMOKE if args.smoke else FULL, out)
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
