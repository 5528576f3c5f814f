"""Random and edge-case inputs for the acceptance tests (fixed seeds)."""

from __future__ import annotations

import torch


def random_probs(
    shape: tuple[int, ...], *, gen: torch.Generator, sharp: float = 1.0, zero_frac: float = 0.0
) -> torch.Tensor:
    """Softmax of random logits; optionally zero out a fraction of entries (truncation)."""
    logits = torch.randn(shape, generator=gen) * sharp
    if zero_frac > 0:
        drop = torch.rand(shape, generator=gen) < zero_frac
        keep_one = torch.nn.functional.one_hot(logits.argmax(-1), shape[-1]).bool()
        logits = logits.masked_fill(drop & ~keep_one, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample_ids(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Draft token ids n ~ p for probs [B, K, V] -> [B, K]."""
    batch, k, vocab = probs.shape
    return torch.multinomial(probs.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)


def random_case(seed: int, *, batch: int, k: int, vocab: int):
    """(ids, draft_probs, target_probs, uniforms) with a mix of row kinds."""
    gen = torch.Generator().manual_seed(seed)
    sharp = float(torch.empty(1).uniform_(0.5, 4.0, generator=gen))
    zero_frac = float(torch.rand(1, generator=gen)) * 0.6
    draft = random_probs((batch, k, vocab), gen=gen, sharp=sharp, zero_frac=zero_frac)
    target = random_probs((batch, k + 1, vocab), gen=gen, sharp=sharp, zero_frac=zero_frac)
    # Make the target resemble the draft sometimes, as a real pair does.
    mix = torch.rand(batch, 1, 1, generator=gen)
    target[:, :k] = mix * target[:, :k] + (1 - mix) * draft
    ids = sample_ids(draft, gen)
    uniforms = torch.rand(batch, k + 1, dtype=torch.float64, generator=gen)
    return ids, draft, target, uniforms


def edge_case():
    """Hand-built rows covering the spec's edge cases, K = 3, V = 5.

    row 0: q_n = 0 at position 0 (never accepted, whatever delta)
    row 1: q_n = 1 everywhere (always accepted; h = q)
    row 2: p_n = 0 at position 1 (drafted token the draft could not sample: rejected)
    row 3: everything accepted (p == q, uniforms 0) -> bonus from row K
    row 4: everything rejected at position 0 (u close to 1, q_n tiny)
    row 5: q one-hot on a different token (greedy disagreement)
    """
    k, vocab = 3, 5
    base = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    draft = base.repeat(6, k, 1).clone()
    target = base.flip(0).repeat(6, k + 1, 1).clone()
    ids = torch.tensor([[0, 1, 2]] * 6)
    uniforms = torch.full((6, k + 1), 0.5, dtype=torch.float64)
    target[0, 0] = torch.tensor([0.0, 0.4, 0.3, 0.2, 0.1])
    target[1, :k] = torch.nn.functional.one_hot(ids[1], vocab).float()
    draft[2, 1] = torch.tensor([0.0, 0.0, 0.5, 0.3, 0.2])
    ids[2, 1] = 0
    target[3, :k] = draft[3]
    uniforms[3, :k] = 0.0
    target[4, 0] = torch.tensor([0.001, 0.3, 0.3, 0.3, 0.099])
    draft[4, 0] = torch.tensor([0.9, 0.025, 0.025, 0.025, 0.025])
    uniforms[4, 0] = 0.999
    target[5, :] = torch.nn.functional.one_hot(torch.tensor(3), vocab).float()
    return ids, draft, target, uniforms


def off_support_empty_residual_case():
    """K = 1, V = 4: p = [1e-6, .3, .3, .4 - 1e-6], q = p (1 - 2^-23) with q_0 = 0, so
    q <= p everywhere and max(0, q - p) is empty. Drafted token 1 is rejected (u0 just
    under 1); the final uniform 0 picks the first token with any mass of the row sampled."""
    draft = torch.tensor([[[1e-6, 0.3, 0.3, 0.4 - 1e-6]]])
    target = torch.cat([draft * (1 - 2**-23), draft], dim=1)
    target[0, 0, 0] = 0.0
    ids = torch.tensor([[1]])
    uniforms = torch.tensor([[1 - 1e-9, 0.0]], dtype=torch.float64)
    return ids, draft, target, uniforms


def empty_residual_case():
    """Rejected with max(0, h - p) == 0 everywhere: q = p scaled down by rounding-size
    amounts (q <= p elementwise), u just under 1 at position 0. The kernel must then
    sample h (= p up to rounding, on q's support) instead of dividing by zero."""
    gen = torch.Generator().manual_seed(12)
    batch, k, vocab = 4, 2, 37
    draft = random_probs((batch, k, vocab), gen=gen, sharp=2.0)
    target = torch.cat([draft, draft[:, :1]], dim=1) * (1 - 1e-7)
    ids = sample_ids(draft, gen)
    uniforms = torch.rand(batch, k + 1, dtype=torch.float64, generator=gen)
    uniforms[:, 0] = 1 - 1e-9
    return ids, draft, target, uniforms
