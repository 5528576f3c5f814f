"""The acceptance step of speculative decoding: sps, cactus, cactus_exact, tas.

Glossary (vLLM's, ../shared/spec/acceptance.md):
    accepted tokens:  drafted tokens the rule keeps, in order, up to the first rejection.
    recovered token:  the token emitted at the first rejected position, sampled from the
                      residual max(0, h - p) (argmax q for tas).
    bonus token:      sampled from q at row K when all K drafted tokens are accepted.
    output tokens:    accepted + (recovered | bonus); [B, K + 1], padded with -1.

Rules (q: verifier probs, p: draft probs, n: drafted token, h: adjusted target):
    sps           accept iff u * p_n < q_n                (Leviathan et al.; lossless)
    cactus        accept iff u * p_n < h_n, h_n = min(1, q_n + sqrt(2 delta q_n (1 - q_n)))
                  (Hao & Mou, ICLR 2026, arXiv 2604.04987)
    cactus_exact  as cactus with h_n the exact KL-constrained maximum (ours)
    tas           accept iff q_n > min(eps, alpha exp(-H(q))); ignores p (Medusa, vLLM V0)

Fast path, as the spec requires: acceptance uses only the gathered [B, K] values q_n
and p_n; h is never materialised as [B, K, V]. Each sequence builds exactly one [V] row:
the residual of its first rejected position, or q at the bonus row.

Randomness: uniforms [B, K + 1] float64. Column i < K decides position i; column K
samples the one recovered-or-bonus token by inverse CDF. A rule therefore consumes the
same draws whatever it decides, which is what makes delta = 0 bit-identical to sps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import validation
from kernels.divergence import binary_kl, cactus_boost, cactus_exact_boost, rest_scale
from kernels.sampling import inverse_cdf_sample

PLACEHOLDER_TOKEN_ID = -1
RULES = validation.RULES


@dataclass(frozen=True)
class AcceptResult:
    output_token_ids: torch.Tensor  # [B, K + 1] int64, PLACEHOLDER_TOKEN_ID after the end
    num_accepted: torch.Tensor  # [B] int64, accepted drafted tokens (bonus not counted)
    divergence_nats: torch.Tensor  # [B] float64, sum of d(h_n || q_n) over emitted positions


def speculative_accept(
    draft_token_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K + 1, V]
    *,
    rule: str,
    delta: float | torch.Tensor = 0.0,  # nats; float or [B]
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,  # [B, K + 1] float64, injected draws
    tas_threshold: float = 0.09,
    tas_alpha: float | None = None,  # None = sqrt(tas_threshold), the paper's code
    divergence_budget: torch.Tensor | None = None,  # [B] nats left before delta drops to 0
    validate: bool = True,
) -> AcceptResult:
    """Verify K drafted tokens per sequence and emit the accepted, recovered or bonus tokens.

    `divergence_budget` implements max_divergence_nats: positions whose running
    divergence would exceed a sequence's budget use delta = 0 from there on (tas ignores
    delta and the budget). Raises ValueError naming the argument on bad input.
    """
    validation.check_rule(rule)
    batch, k, vocab = validation.check_shapes(draft_token_ids, draft_probs, target_probs)
    validation.check_delta(delta, batch)
    if rule == "tas":
        validation.check_tas(tas_threshold, tas_alpha)
    if validate:
        validation.check_uniforms(uniforms, batch, k)
        validation.check_budget(divergence_budget, batch)
        validation.check_values(draft_token_ids, draft_probs, target_probs, vocab)

    device = target_probs.device
    if uniforms is None:
        uniforms = torch.rand(batch, k + 1, dtype=torch.float64, generator=generator, device=device)
    ids = draft_token_ids.to(torch.int64)
    q_n = target_probs[:, :k].gather(-1, ids[..., None])[..., 0]  # [B, K]
    p_n = draft_probs.gather(-1, ids[..., None])[..., 0]  # [B, K]

    if rule == "tas":
        alpha = math.sqrt(tas_threshold) if tas_alpha is None else tas_alpha
        accepted = typical_accept(target_probs[:, :k], q_n, threshold=tas_threshold, alpha=alpha)
        h_n = q_n.to(torch.float64)
    else:
        delta_t = torch.as_tensor(delta, dtype=torch.float64, device=device).expand(batch)
        h_n = adjusted_target_mass(q_n, delta_t[:, None].expand(batch, k), rule, divergence_budget)
        # p_n = 0 means reject: the draft could not have sampled n (spec). No division.
        accepted = (p_n > 0) & (uniforms[:, :k] * p_n.to(torch.float64) < h_n)

    num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B]
    final_row_q = _row(target_probs, num_accepted)  # [B, V]: rejected row, or bonus row K
    last = _final_tokens(
        final_row_q,
        draft_probs,
        ids,
        h_n,
        q_n,
        num_accepted=num_accepted,
        u_final=uniforms[:, k],
        typical=rule == "tas",
    )
    output = _assemble(ids, num_accepted, last)
    if rule == "tas":
        divergence = _typical_divergence(q_n, final_row_q, num_accepted)
    else:
        divergence = _emitted_sum(binary_kl(h_n, q_n), num_accepted)
    return AcceptResult(output, num_accepted, divergence)


def adjusted_target_mass(
    q_n: torch.Tensor,  # [B, K]
    delta: torch.Tensor,  # [B, K] float64
    rule: str,
    budget: torch.Tensor | None = None,  # [B]
) -> torch.Tensor:  # [B, K] float64
    """h_n for each drafted token; with a budget, delta drops to 0 from the first position
    whose cumulative d(h_n || q_n) would exceed it."""
    boost = {"sps": lambda q, d: q.to(torch.float64), "cactus": cactus_boost}.get(
        rule, cactus_exact_boost
    )
    h_n = boost(q_n, delta)
    if budget is None or rule == "sps":
        return h_n
    running = binary_kl(h_n, q_n).cumsum(-1)  # [B, K]
    within = (running <= budget.to(torch.float64)[:, None]).to(torch.int64).cumprod(-1).bool()
    return boost(q_n, torch.where(within, delta, torch.zeros_like(delta)))


def typical_accept(
    target_probs: torch.Tensor,  # [B, K, V]
    q_n: torch.Tensor,  # [B, K]
    *,
    threshold: float,
    alpha: float,
) -> torch.Tensor:  # [B, K] bool
    """Typical acceptance: q_n > min(threshold, alpha * exp(-H(q))). Deterministic."""
    entropy = -torch.xlogy(target_probs, target_probs).sum(-1)  # [B, K]
    cutoff = torch.clamp(alpha * torch.exp(-entropy), max=threshold)
    return q_n > cutoff


def _row(probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """probs[b, index[b], :] for each b. probs: [B, R, V], index: [B] -> [B, V]."""
    vocab = probs.shape[-1]
    return probs.gather(1, index[:, None, None].expand(-1, 1, vocab))[:, 0]


def _final_tokens(
    q_row: torch.Tensor,  # [B, V] q at the first rejected position, or at the bonus row
    draft_probs: torch.Tensor,  # [B, K, V]
    ids: torch.Tensor,  # [B, K]
    h_n: torch.Tensor,  # [B, K] float64
    q_n: torch.Tensor,  # [B, K]
    *,
    num_accepted: torch.Tensor,  # [B]
    u_final: torch.Tensor,  # [B] float64
    typical: bool,
) -> torch.Tensor:  # [B] int64
    """The recovered token (first rejected position) or the bonus token (all accepted)."""
    k = ids.shape[1]
    rejected = num_accepted < k  # [B]
    j = num_accepted.clamp(max=k - 1)[:, None]  # [B, 1]
    if typical:
        bonus = inverse_cdf_sample(q_row, u_final)
        return torch.where(rejected, q_row.argmax(-1), bonus)
    p_row = _row(draft_probs, j[:, 0]).to(q_row.dtype)  # [B, V]
    h_j, q_j = h_n.gather(1, j), q_n.gather(1, j)  # [B, 1]
    # h around the rejected token: the rest scaled by s, the drafted token set to h_n.
    scale = rest_scale(q_j, h_j).to(q_row.dtype)
    h_row = (q_row * scale).scatter_(-1, ids.gather(1, j), h_j.to(q_row.dtype))
    residual = torch.clamp(h_row - p_row, min=0.0)
    # max(0, h - p) is all zero only when h == p up to rounding: then h itself is exact.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, h_row)
    weights = torch.where(rejected[:, None], residual, q_row)
    return inverse_cdf_sample(weights, u_final)


def _assemble(ids: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[B, K + 1]: accepted ids, then the recovered/bonus token, then placeholders."""
    batch, k = ids.shape
    pos = torch.arange(k + 1, device=ids.device)[None, :]
    drafted = torch.cat([ids, ids.new_zeros(batch, 1)], dim=1)
    out = torch.where(pos < num_accepted[:, None], drafted, PLACEHOLDER_TOKEN_ID)
    return torch.where(pos == num_accepted[:, None], last[:, None], out)


def _emitted_sum(per_position: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """Sum over verified positions whose token is emitted: i <= num_accepted, i < K."""
    k = per_position.shape[1]
    emitted = torch.arange(k, device=per_position.device)[None, :] <= num_accepted[:, None]
    return torch.where(emitted, per_position, 0.0).sum(-1)


def _typical_divergence(
    q_n: torch.Tensor, q_row: torch.Tensor, num_accepted: torch.Tensor
) -> torch.Tensor:
    """tas has no h: its target at an emitted position is a point mass on the emitted token
    x, whose KL to q is -ln q(x) (ours; the same d(1 || q_x) Cactus would charge)."""
    k = q_n.shape[1]
    pos = torch.arange(k, device=q_n.device)[None, :]
    accepted_cost = -torch.log(q_n.to(torch.float64))  # [B, K], used where pos < accepted
    recovered_cost = -torch.log(q_row.max(-1).values.to(torch.float64))[:, None]  # [B, 1]
    per_position = torch.where(pos < num_accepted[:, None], accepted_cost, recovered_cost)
    return _emitted_sum(per_position, num_accepted)
