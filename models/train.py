"""Training loops: next-token pretraining of the verifier, distillation of the draft.

Both loops use AdamW with linear warmup and a cosine decay to 10 % of the peak
learning rate, float32 on CPU, and a seeded block order so a rerun repeats the
same updates.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM


@dataclass
class TrainSpec:
    """Hyper-parameters of one training run."""

    steps: int
    batch: int
    lr: float
    warmup: int
    seed: int
    weight_decay: float = 0.1
    log_every: int = 10


def batch_order(n_blocks: int, spec: TrainSpec) -> Iterator[torch.Tensor]:
    """Block indices for each step: seeded permutations, reshuffled every epoch."""
    gen = torch.Generator().manual_seed(spec.seed)
    perm = torch.randperm(n_blocks, generator=gen)
    pos = 0
    for _ in range(spec.steps):
        if pos + spec.batch > n_blocks:
            perm, pos = torch.randperm(n_blocks, generator=gen), 0
        yield perm[pos : pos + spec.batch]
        pos += spec.batch


def make_optimizer(model: torch.nn.Module, spec: TrainSpec):
    """AdamW (no decay on norms) and a warmup + cosine LambdaLR schedule."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": spec.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=spec.lr,
        betas=(0.9, 0.95),
    )

    def factor(step: int) -> float:
        if step < spec.warmup:
            return (step + 1) / spec.warmup
        progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def lm_loss(model: LlamaForCausalLM, block: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of ``model`` on (batch, T + 1) blocks."""
    logits = model(input_ids=block[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), block[:, 1:].reshape(-1))


def distill_loss(
    draft: LlamaForCausalLM, teacher: LlamaForCausalLM, block: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(teacher || draft), draft cross-entropy on the text), both mean nats per token.

    The gradient of the KL is that of the cross-entropy to the teacher's softmax.
    """
    inputs = block[:, :-1]
    with torch.no_grad():
        teacher_logp = F.log_softmax(teacher(input_ids=inputs).logits.float(), dim=-1)
    logp = F.log_softmax(draft(input_ids=inputs).logits, dim=-1)
    kl = (teacher_logp.exp() * (teacher_logp - logp)).sum(-1).mean()
    with torch.no_grad():
        ce = F.nll_loss(logp.reshape(-1, logp.size(-1)), block[:, 1:].reshape(-1))
    return kl, ce


def run_training(
    model: torch.nn.Module,
    blocks: torch.Tensor,
    spec: TrainSpec,
    loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    name: str,
) -> dict:
    """Optimise ``loss_fn(batch) -> (loss, reported ce)``; print progress; return stats."""
    torch.manual_seed(spec.seed)
    model.train()
    opt, sched = make_optimizer(model, spec)
    tokens_per_step = spec.batch * (blocks.size(1) - 1)
    start = time.perf_counter()
    loss_avg = ce_avg = None
    for step, idx in enumerate(batch_order(len(blocks), spec), start=1):
        loss, ce = loss_fn(blocks[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        ce_avg = ce.item() if ce_avg is None else 0.95 * ce_avg + 0.05 * ce.item()
        if step % spec.log_every == 0 or step == spec.steps:
            _log_progress(name, step, spec.steps, tokens_per_step, start, loss_avg, ce_avg)
    model.eval()
    return {
        "steps": spec.steps,
        "batch": spec.batch,
        "seq_len": blocks.size(1) - 1,
        "tokens": spec.steps * tokens_per_step,
        "wall_s": round(time.perf_counter() - start, 1),
        "peak_lr": spec.lr,
        "final_train_loss_ema": round(loss_avg, 4),
    }


def _log_progress(name, step, steps, tokens_per_step, start, loss, ce) -> None:
    """One progress line: step, smoothed loss / cross-entropy, tokens/s and ETA."""
    elapsed = time.perf_counter() - start
    tok_s = step * tokens_per_step / elapsed
    eta = elapsed / step * (steps - step)
    print(
        f"[{name}] step {step}/{steps} loss {loss:.4f} ce {ce:.4f} "
        f"{tok_s:.0f} tok/s elapsed {elapsed / 60:.1f} min ETA {eta / 60:.1f} min",
        flush=True,
    )


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, blocks: torch.Tensor, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats/token) over all held-out blocks."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(blocks), batch):
        chunk = blocks[i : i + batch]
        n = chunk[:, 1:].numel()
        total += lm_loss(model, chunk).item() * n
        count += n
    return total / count
