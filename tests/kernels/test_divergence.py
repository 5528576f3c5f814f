"""h_n, d(h_n || q_n) and the monotonicity of acceptance in delta."""

from __future__ import annotations

import math

import torch

from kernels.divergence import binary_kl, cactus_boost, cactus_exact_boost, rest_scale
from tests.kernels.cases import random_probs

Q_SWEEP = torch.cat(
    [
        torch.logspace(-9, -1, 200, dtype=torch.float64),
        torch.linspace(0.1, 0.9, 200, dtype=torch.float64),
        1 - torch.logspace(-1, -9, 200, dtype=torch.float64),
    ]
)
DELTA_SWEEP = torch.tensor(
    [1e-6, 1e-4, 1e-2, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 10.0, 30.0], dtype=torch.float64
)


def _grid():
    q = Q_SWEEP[:, None].expand(-1, len(DELTA_SWEEP))
    d = DELTA_SWEEP[None, :].expand(len(Q_SWEEP), -1)
    return q, d


def test_cactus_exact_respects_the_budget_everywhere():
    q, d = _grid()
    h = cactus_exact_boost(q, d)
    assert ((h >= q) & (h <= 1)).all()
    assert (binary_kl(h, q) <= d + 1e-9).all()


def test_cactus_exact_is_the_largest_feasible_mass():
    q, d = _grid()
    h = cactus_exact_boost(q, d)
    # Either all the mass went to n, or one step further breaks the budget.
    bigger = torch.clamp(h + 1e-9 * (1 - q) + 1e-15, max=1.0)
    assert ((h == 1) | (binary_kl(bigger, q) > d)).all()


def test_cactus_taylor_overshoots_kl_somewhere():
    """Documents why cactus_exact exists: the paper's rule can exceed delta in KL."""
    q, d = _grid()
    excess = binary_kl(cactus_boost(q, d), q) - d
    assert float(excess.max()) > 0.05
    # The spec's worst case: ln(1 + 2 delta) at q = 1 / (1 + 2 delta).
    delta = torch.tensor([0.5], dtype=torch.float64)
    q_star = 1 / (1 + 2 * delta)
    got = float(binary_kl(cactus_boost(q_star, delta), q_star))
    assert math.isclose(got, math.log(2.0), rel_tol=1e-9)


def test_delta_zero_and_degenerate_q_are_identity():
    q = torch.tensor([0.0, 1e-12, 0.3, 1 - 1e-12, 1.0], dtype=torch.float64)
    zero = torch.zeros_like(q)
    for boost in (cactus_boost, cactus_exact_boost):
        assert torch.equal(boost(q, zero), q)
        big = torch.full_like(q, 3.0)
        assert boost(q, big)[0] == 0 and boost(q, big)[-1] == 1
    assert torch.equal(rest_scale(q, q)[:-1], torch.ones(4, dtype=torch.float64))
    assert rest_scale(q, q)[-1] == 1.0


def _acceptance(p: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Exact P(accept) = sum_n min(p_n, h_n) from the gathered values (rows of [R, V])."""
    return torch.minimum(p.double(), h).sum(-1)


def test_acceptance_is_non_decreasing_in_delta():
    gen = torch.Generator().manual_seed(21)
    p = random_probs((64, 32), gen=gen, sharp=2.0, zero_frac=0.3)
    q = random_probs((64, 32), gen=gen, sharp=2.0, zero_frac=0.3)
    deltas = torch.linspace(0, 5, 51, dtype=torch.float64)
    for boost in (cactus_boost, cactus_exact_boost):
        rates = torch.stack(
            [_acceptance(p, q, boost(q, torch.full_like(q, float(d)).double())) for d in deltas]
        )  # [D, 64]
        assert (rates[1:] >= rates[:-1] - 1e-12).all()
        assert torch.allclose(rates[0], torch.minimum(p, q).double().sum(-1))
        assert (rates[-1] > rates[0]).any()


def test_cactus_boost_of_a_q_a_rounding_above_one_is_one_not_nan():
    """A float32 row whose largest entry rounds just above 1: sqrt of a negative 1 - q
    gave NaN, and the kernel then rejected the token and sampled a NaN residual."""
    q = torch.tensor([[1.0000001, 1.0 + 2**-23, 1.0]], dtype=torch.float32)
    h = cactus_boost(q, torch.tensor([[1.0]], dtype=torch.float64))
    assert torch.isfinite(h).all() and (h == 1.0).all(), h
