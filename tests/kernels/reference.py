"""Slow, obviously-correct references for the acceptance rules (tests only).

Everything is materialised: h is built as a full [V] vector at every position, the
acceptance test reads h[n] from it, KL(h || q) is summed over the whole vocabulary, and
the loops walk sequences and positions one by one as the spec describes them. The
random draws follow the kernel's contract (uniforms [B, K + 1]: column i decides
position i, column K samples the recovered or bonus token by inverse CDF), so the fast
path must agree token for token.
"""

from __future__ import annotations

import math

import torch


def scalar_binary_kl(a: float, b: float) -> float:
    def xlogy(x: float, y: float) -> float:
        return 0.0 if x == 0 else x * math.log(y)

    return xlogy(a, a) - xlogy(a, b) + xlogy(1 - a, 1 - a) - xlogy(1 - a, 1 - b)


def scalar_exact_boost(q: float, delta: float) -> float:
    """Largest a in [q, 1] with d(a || q) <= delta, by plain scalar bisection."""
    if delta <= 0 or q <= 0 or q >= 1:
        return q
    if -math.log(q) <= delta:
        return 1.0
    lo, hi = q, 1.0
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        if scalar_binary_kl(mid, q) <= delta:
            lo = mid
        else:
            hi = mid
    return lo


def adjusted_target(q: torch.Tensor, n: int, delta: float, rule: str) -> torch.Tensor:
    """h as a full [V] float64 vector around drafted token n."""
    q = q.to(torch.float64)
    q_n = float(q[n])
    if rule == "sps" or delta == 0 or q_n >= 1.0:
        return q.clone()
    if rule == "cactus":
        h_n = min(1.0, q_n + math.sqrt(2 * delta * q_n * (1 - q_n)))
    else:
        h_n = scalar_exact_boost(q_n, delta)
    h = q * ((1 - h_n) / (1 - q_n))
    h[n] = h_n
    return h


def typical_set(q: torch.Tensor, threshold: float, alpha: float | None) -> torch.Tensor:
    """Tokens tas accepts at a row q [V]: q(x) > min(eps, alpha exp(-H(q)))."""
    q = q.to(torch.float64)
    alpha = math.sqrt(threshold) if alpha is None else alpha
    entropy = -float((q[q > 0] * q[q > 0].log()).sum())
    return q > min(threshold, alpha * math.exp(-entropy))


def full_kl(h: torch.Tensor, q: torch.Tensor) -> float:
    """KL(h || q) summed over the vocabulary."""
    q = q.to(torch.float64)
    mask = h > 0
    return float((h[mask] * (h[mask] / q[mask]).log()).sum())


def icdf(weights: torch.Tensor, u: float) -> int:
    """First index whose running sum exceeds u * total."""
    cdf = weights.to(torch.float64).cumsum(0)
    target = u * float(cdf[-1])
    idx = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True))
    positive = torch.nonzero(weights > 0).flatten()
    return min(idx, int(positive[-1]))


def reference_accept(
    ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    rule: str,
    delta: torch.Tensor | float,
    uniforms: torch.Tensor,
    tas_threshold: float = 0.09,
    tas_alpha: float | None = None,
    budget: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (output_token_ids [B, K+1], num_accepted [B], divergence_nats [B])."""
    batch, k = ids.shape
    deltas = torch.as_tensor(delta, dtype=torch.float64).expand(batch)
    out = torch.full((batch, k + 1), -1, dtype=torch.int64)
    num = torch.zeros(batch, dtype=torch.int64)
    div = torch.zeros(batch, dtype=torch.float64)
    for b in range(batch):
        row = _reference_row(
            ids[b],
            draft_probs[b],
            target_probs[b],
            rule=rule,
            delta=float(deltas[b]),
            uniforms=uniforms[b],
            tas=(tas_threshold, tas_alpha),
            budget=math.inf if budget is None else float(budget[b]),
        )
        tokens, num[b], div[b] = row
        out[b, : len(tokens)] = torch.tensor(tokens)
    return out, num, div


def _reference_row(ids, p, q, *, rule, delta, uniforms, tas, budget):
    k = ids.shape[0]
    tokens: list[int] = []
    used = 0.0
    for i in range(k):
        n = int(ids[i])
        q_i = q[i].to(torch.float64)
        if rule == "tas":
            if typical_set(q_i, *tas)[n]:
                tokens.append(n)
                used += -math.log(float(q_i[n]))
                continue
            x = int(q_i.argmax())
            return [*tokens, x], i, used - math.log(float(q_i[x]))
        h = adjusted_target(q_i, n, delta, rule)
        if used + full_kl(h, q_i) > budget:
            budget = -math.inf  # from here on delta = 0
            h = adjusted_target(q_i, n, 0.0, rule)
        used += full_kl(h, q_i)
        p_n = float(p[i, n])
        if p_n > 0 and float(uniforms[i]) * p_n < float(h[n]):
            tokens.append(n)
            continue
        residual = torch.clamp(h - p[i].to(torch.float64), min=0)
        if float(residual.sum()) <= 0:  # h == p up to rounding: sample h (q's support)
            residual = h
        return [*tokens, icdf(residual, float(uniforms[k]))], i, used
    return [*tokens, icdf(q[k], float(uniforms[k]))], k, used


def emitted_distribution(
    p: torch.Tensor,
    q: torch.Tensor,
    *,
    rule: str,
    delta: float = 0.0,
    tas_threshold: float = 0.09,
    tas_alpha: float | None = None,
) -> torch.Tensor:
    """Exact law of the first emitted token at one position (spec): [V] float64.

    cactus/cactus_exact: o(x) = sum_n p_n (a_n [x == n] + (1 - a_n) r^(n)(x)),
    a_n = min(1, h^(n)_n / p_n), r^(n) = normalised max(0, h^(n) - p).
    tas: o(x) = p(x)[x in A] + (sum_{n not in A} p(n)) [x == argmax q].
    """
    p = p.to(torch.float64)
    q = q.to(torch.float64)
    vocab = p.shape[0]
    out = torch.zeros(vocab, dtype=torch.float64)
    if rule == "tas":
        keep = typical_set(q, tas_threshold, tas_alpha)
        out[keep] = p[keep]
        out[int(q.argmax())] += float(p[~keep].sum())
        return out
    for n in range(vocab):
        if p[n] == 0:
            continue
        h = adjusted_target(q, n, delta, rule)
        a_n = min(1.0, float(h[n] / p[n]))
        out[n] += p[n] * a_n
        residual = torch.clamp(h - p, min=0)
        if a_n < 1:
            out += p[n] * (1 - a_n) * residual / residual.sum()
    return out


def acceptance_probability(
    p: torch.Tensor,
    q: torch.Tensor,
    *,
    rule: str,
    delta: float = 0.0,
    tas_threshold: float = 0.09,
    tas_alpha: float | None = None,
) -> float:
    """P(accept) at one position = sum_n p_n min(1, h^(n)_n / p_n) (tas: p of the set A)."""
    p = p.to(torch.float64)
    q = q.to(torch.float64)
    if rule == "tas":
        return float(p[typical_set(q, tas_threshold, tas_alpha)].sum())
    total = 0.0
    for n in range(p.shape[0]):
        if p[n] > 0:
            total += min(float(p[n]), float(adjusted_target(q, n, delta, rule)[n]))
    return total
