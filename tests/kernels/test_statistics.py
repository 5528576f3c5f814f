"""Exact statistical tests: the emitted-token law and the accepted-count law.

Fixed seeds, >= 1e5 samples per test, chi-square goodness of fit with the threshold
p > 1e-3 (../shared/spec/acceptance.md, "What the tests must prove"). Categories whose
exact probability is 0 are checked separately: they must never be observed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from kernels import speculative_accept
from tests.kernels.cases import random_probs
from tests.kernels.reference import acceptance_probability, emitted_distribution

SAMPLES = 200_000
P_THRESHOLD = 1e-3


def _goodness_of_fit(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of a chi-square test; impossible categories must be empty."""
    impossible = expected_probs <= 0
    assert observed[impossible].sum() == 0, "emitted a token of probability 0"
    obs = observed[~impossible].astype(np.float64)
    exp = expected_probs[~impossible] / expected_probs[~impossible].sum() * obs.sum()
    return float(chisquare(obs, exp).pvalue)


def _position_pair(seed: int, vocab: int, zero_frac: float):
    gen = torch.Generator().manual_seed(seed)
    p = random_probs((vocab,), gen=gen, sharp=1.5)
    q = random_probs((vocab,), gen=gen, sharp=1.5, zero_frac=zero_frac)
    return p, q


CASES = [
    ("sps", 0.0, 6, 0.0),
    ("sps", 0.0, 12, 0.4),
    ("cactus", 0.5, 8, 0.0),
    ("cactus", 2.0, 16, 0.3),
    ("cactus_exact", 0.5, 8, 0.0),
    ("cactus_exact", 2.0, 16, 0.3),
    ("tas", 0.0, 10, 0.0),
    ("tas", 0.0, 6, 0.3),
]


@pytest.mark.parametrize(("rule", "delta", "vocab", "zero_frac"), CASES)
def test_first_emitted_token_follows_the_exact_law(rule, delta, vocab, zero_frac):
    p, q = _position_pair(CASES.index((rule, delta, vocab, zero_frac)), vocab, zero_frac)
    k = 2  # the first position of a K = 2 block; later rows are irrelevant to token 0
    gen = torch.Generator().manual_seed(1234)
    draft_probs = p.expand(SAMPLES, k, vocab)
    target_probs = q.expand(SAMPLES, k + 1, vocab)
    ids = torch.multinomial(p, SAMPLES * k, replacement=True, generator=gen).reshape(SAMPLES, k)
    res = speculative_accept(
        ids,
        draft_probs,
        target_probs,
        rule=rule,
        delta=delta,
        generator=gen,
        tas_alpha=0.3 if rule == "tas" else None,
    )
    observed = np.bincount(res.output_token_ids[:, 0].numpy(), minlength=vocab)
    expected = emitted_distribution(
        p, q, rule=rule, delta=delta, tas_alpha=0.3 if rule == "tas" else None
    ).numpy()
    if rule == "sps":  # o = q exactly
        np.testing.assert_allclose(expected, q.double().numpy(), atol=1e-7)
    assert _goodness_of_fit(observed, expected) > P_THRESHOLD


@pytest.mark.parametrize(
    ("rule", "delta"), [("sps", 0.0), ("cactus", 1.0), ("cactus_exact", 1.0), ("tas", 0.0)]
)
def test_accepted_count_follows_the_chain_law(rule, delta):
    k, vocab = 4, 8
    gen = torch.Generator().manual_seed(99)
    p = torch.stack([random_probs((vocab,), gen=gen, sharp=1.2) for _ in range(k)])
    q = torch.stack([random_probs((vocab,), gen=gen, sharp=1.2) for _ in range(k + 1)])
    ids = torch.stack(
        [torch.multinomial(p[i], SAMPLES, replacement=True, generator=gen) for i in range(k)], dim=1
    )
    res = speculative_accept(
        ids,
        p.expand(SAMPLES, k, vocab),
        q.expand(SAMPLES, k + 1, vocab),
        rule=rule,
        delta=delta,
        generator=gen,
    )
    a = [acceptance_probability(p[i], q[i], rule=rule, delta=delta) for i in range(k)]
    law = np.array([np.prod(a[:m]) * (1 - a[m]) for m in range(k)] + [np.prod(a)])
    np.testing.assert_allclose(law.sum(), 1.0, atol=1e-12)
    observed = np.bincount(res.num_accepted.numpy(), minlength=k + 1)
    assert _goodness_of_fit(observed, law) > P_THRESHOLD


def test_acceptance_probability_is_higher_with_cactus():
    """The point of the rule: at delta > 0 it accepts more than sps (exact values)."""
    gen = torch.Generator().manual_seed(5)
    p = random_probs((12,), gen=gen, sharp=2.0)
    q = random_probs((12,), gen=gen, sharp=2.0)
    sps = acceptance_probability(p, q, rule="sps")
    assert acceptance_probability(p, q, rule="cactus", delta=0.5) > sps + 0.01
    assert acceptance_probability(p, q, rule="cactus_exact", delta=0.5) > sps + 0.01
