"""Re-measure the model-card figures of the embedded verifier / draft pair.

    python -m models.measure [--verifier DIR] [--draft DIR] [--json FILE]

Figures: parameter counts, held-out loss (nats/token), the verifier / draft
cost ratio of one cached single-token decode step, and the speculative-sampling
acceptance rate alpha at temperature 0.6, top_k 20, top_p 0.95.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from models import corpus
from models.train import heldout_loss

MODELS_DIR = Path(__file__).resolve().parent
TEMPERATURE, TOP_K, TOP_P, K = 0.6, 20, 0.95, 4


def process(logits: torch.Tensor) -> torch.Tensor:
    """Sampling distribution after temperature, top-k and top-p, renormalised (last dim)."""
    probs = F.softmax(logits.float() / TEMPERATURE, dim=-1)
    top, idx = probs.topk(TOP_K, dim=-1)
    mass_before = top.cumsum(-1) - top
    top = torch.where(mass_before < TOP_P * top.sum(-1, keepdim=True), top, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, idx, top)
    return out / out.sum(-1, keepdim=True)


def heldout_stream(tokenizer) -> torch.Tensor:
    """The held-out split as one token stream (files joined by EOS)."""
    texts = [text for _, text in corpus.load_texts("heldout")]
    return corpus.encode_stream(tokenizer, texts)


def prompts(stream: torch.Tensor, n: int = 32, length: int = 64) -> list[torch.Tensor]:
    """``n`` windows of ``length`` tokens at evenly spaced offsets of the held-out stream."""
    step = (len(stream) - length) // n
    return [stream[i * step : i * step + length] for i in range(n)]


@torch.no_grad()
def sample(model, prompt: torch.Tensor, new_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Prompt plus ``new_tokens`` sampled from ``model`` with the processed distribution."""
    cache = DynamicCache(config=model.config)
    ids = prompt.unsqueeze(0)
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
    out = [ids]
    for _ in range(new_tokens):
        nxt = torch.multinomial(process(logits), 1, generator=gen)
        out.append(nxt)
        logits = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
    return torch.cat(out, dim=1)[0]


@torch.no_grad()
def acceptance(verifier, draft, prompt_list, new_tokens: int = 64, seed: int = 0) -> float:
    """alpha: mean over generated positions of sum_x min(p_draft(x), q_verifier(x))."""
    gen = torch.Generator().manual_seed(seed)
    overlaps = []
    for prompt in prompt_list:
        seq = sample(verifier, prompt, new_tokens, gen).unsqueeze(0)
        positions = slice(len(prompt) - 1, seq.size(1) - 1)  # predict the generated tokens
        q = process(verifier(input_ids=seq).logits[0, positions])
        p = process(draft(input_ids=seq).logits[0, positions])
        overlaps.append(torch.minimum(p, q).sum(-1))
    return torch.cat(overlaps).mean().item()


def _decode_stepper(model, context: torch.Tensor):
    """A closure running one cached single-token decode step at a fixed context length."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=context.unsqueeze(0), cache=cache, use_cache=True).logits
    token = logits[:, -1:].argmax(-1)

    def step() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=token, cache=cache, use_cache=True)
        elapsed = time.perf_counter() - start
        cache.crop(-1)
        return elapsed

    return step


def decode_costs(verifier, draft, context: torch.Tensor, steps: int = 300, warmup: int = 30):
    """Median seconds of one decode step of each model, measured alternately."""
    v_step, d_step = _decode_stepper(verifier, context), _decode_stepper(draft, context)
    v_times, d_times = [], []
    for i in range(warmup + steps):
        v, d = v_step(), d_step()
        if i >= warmup:
            v_times.append(v)
            d_times.append(d)
    return statistics.median(v_times), statistics.median(d_times)


def measure(verifier_dir: Path, draft_dir: Path) -> dict:
    """All model-card figures for one verifier / draft pair."""
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)
    verifier = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    stream = heldout_stream(tokenizer)
    prompt_list = prompts(stream)
    v_cost, d_cost = decode_costs(verifier, draft, stream[:100])
    alpha = acceptance(verifier, draft, prompt_list)
    blocks = corpus.make_blocks(stream, 256)
    return {
        "verifier_params": sum(p.numel() for p in verifier.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "verifier_decode_ms": round(v_cost * 1e3, 3),
        "draft_decode_ms": round(d_cost * 1e3, 3),
        "decode_cost_ratio": round(v_cost / d_cost, 2),
        "alpha": round(alpha, 4),
        "expected_accepted_per_step": round(sum(alpha**i for i in range(1, K + 1)), 3),
        "expected_tokens_per_step": round(sum(alpha**i for i in range(K + 1)), 3),
        "heldout_tokens": blocks[:, 1:].numel(),
        "verifier_heldout_loss": round(heldout_loss(verifier, blocks), 4),
        "draft_heldout_loss": round(heldout_loss(draft, blocks), 4),
    }


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: print the figures as JSON (and optionally save them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verifier", type=Path, default=MODELS_DIR / "verifier")
    parser.add_argument("--draft", type=Path, default=MODELS_DIR / "draft")
    parser.add_argument("--json", type=Path, default=None, help="also write figures here")
    args = parser.parse_args(argv)
    from cactus import environment

    environment.apply()
    figures = measure(args.verifier, args.draft)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
