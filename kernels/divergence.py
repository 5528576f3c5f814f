"""The adjusted target's boosted mass h_n, and the binary KL that measures it.

Cactus (Hao & Mou, ICLR 2026, arXiv 2604.04987) verifies the drafted token n against
an adjusted target h that raises q_n to h_n and scales every other token by the same
ratio s = (1 - h_n) / (1 - q_n). Because the rest of the mass keeps q's proportions,
KL(h || q) equals the binary KL d(h_n || q_n), so everything here works on the
gathered [B, K] values only. All arithmetic is float64.

- `cactus_boost`: the paper's rule, the second-order (Taylor) solution of
  d(h_n || q_n) <= delta. Exact for half the chi-square divergence; for KL it can
  overshoot delta (up to ln(1 + 2 delta)).
- `cactus_exact_boost` (ours): the largest h_n in [q_n, 1] with d(h_n || q_n) <= delta,
  by bisection, so the KL guarantee holds to solver tolerance.
"""

from __future__ import annotations

import torch

# Bisection halves [q_n, 1] each step: 64 steps take the bracket below float64's
# resolution, and the returned lower end always satisfies d(h_n || q_n) <= delta.
EXACT_BISECTION_STEPS = 64


def binary_kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """d(a || b) = a ln(a/b) + (1-a) ln((1-a)/(1-b)), with 0 ln 0 = 0. Elementwise."""
    a = a.to(torch.float64)
    b = b.to(torch.float64)
    return (
        torch.xlogy(a, a)
        - torch.xlogy(a, b)
        + torch.xlogy(1 - a, 1 - a)
        - torch.xlogy(1 - a, 1 - b)
    )


def cactus_boost(q_n: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Paper's h_n = min(1, q_n + sqrt(2 delta q_n (1 - q_n))). [B, K] -> [B, K] float64.

    delta = 0 returns q_n exactly (bit for bit); q_n in {0, 1} returns q_n. A q_n a
    rounding above 1 (a row normalised in float32) counts as 1: the root of a negative
    1 - q_n was NaN, which the kernel then took for a rejection.
    """
    q = q_n.to(torch.float64)
    d = delta.to(torch.float64)
    return torch.clamp(q + torch.sqrt(2.0 * d * q * torch.clamp(1.0 - q, min=0.0)), max=1.0)


def cactus_exact_boost(q_n: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Largest h_n in [q_n, 1] with d(h_n || q_n) <= delta. [B, K] -> [B, K] float64.

    d(a || q) is increasing in a on [q, 1], so bisection keeps lo feasible and hi
    infeasible. If d(1 || q) = -ln q <= delta the whole mass goes to n (h_n = 1).
    delta = 0 and q_n in {0, 1} return q_n exactly.
    """
    q = q_n.to(torch.float64)
    d = delta.to(torch.float64).expand_as(q)
    lo = q.clone()
    hi = torch.ones_like(q)
    for _ in range(EXACT_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        ok = binary_kl(mid, q) <= d
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    whole = -torch.log(q) <= d  # q > 0 here; q = 0 gives inf > d
    trivial = (d <= 0) | (q <= 0) | (q >= 1)
    return torch.where(trivial, q, torch.where(whole, torch.ones_like(q), lo))


def rest_scale(q_n: torch.Tensor, h_n: torch.Tensor) -> torch.Tensor:
    """s = (1 - h_n) / (1 - q_n), the factor on every token other than n; 1 where q_n = 1.

    q_n = 1 is the 0/0 case the spec defines as h = q. With h_n == q_n (delta = 0)
    s is exactly 1.0, which keeps delta = 0 bit-identical to standard sampling.
    """
    q = q_n.to(torch.float64)
    return torch.where(q < 1.0, (1.0 - h_n) / torch.clamp(1.0 - q, min=1e-300), torch.ones_like(q))
