"""kernels.sampling: processing of logits and per-row seeded sampling."""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.stats import chisquare

from kernels import draw_uniforms, inverse_cdf_sample, processed_probs, sample


def _slow_processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """One row, spelled out: greedy, or temperature -> top-k -> top-p -> renormalise."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[0]).float()
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    sub = probs[kept] / probs[kept].sum()
    chosen, mass = [], 0.0
    for idx, pr in zip(kept, sub.tolist(), strict=True):
        chosen.append(idx)
        mass += pr
        if mass >= top_p:
            break
    out = torch.zeros_like(probs)
    out[chosen] = probs[chosen]
    return out / out.sum()


def test_processed_probs_per_row_parameters():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3, 50, generator=gen) * 3
    temps = [0.0, 0.6, 1.0, 1.5, 0.6, 2.0]
    ks = [0, 20, -1, 5, 1, 50]
    ps = [1.0, 0.95, 0.5, 1.0, 0.9, 0.3]
    got = processed_probs(
        logits, temperature=torch.tensor(temps), top_k=torch.tensor(ks), top_p=torch.tensor(ps)
    )
    assert got.dtype == torch.float32 and got.shape == logits.shape
    for b in range(6):
        for r in range(3):
            want = _slow_processed(logits[b, r], temps[b], ks[b], ps[b])
            torch.testing.assert_close(got[b, r], want, atol=1e-6, rtol=1e-5)


def test_processed_probs_all_rows_top_k_take_the_topk_path():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 300, generator=gen) * 2
    temps, ks, ps = [0.6, 1.0, 0.0], [20, 7, 3], [0.95, 1.0, 0.5]
    got = processed_probs(
        logits, temperature=torch.tensor(temps), top_k=torch.tensor(ks), top_p=torch.tensor(ps)
    )
    for b in range(3):
        for r in range(5):
            want = _slow_processed(logits[b, r], temps[b], ks[b], ps[b])
            torch.testing.assert_close(got[b, r], want, atol=1e-6, rtol=1e-5)
    scalar = processed_probs(logits, temperature=0.6, top_k=20, top_p=0.95)
    assert ((scalar > 0).sum(-1) <= 20).all()


def test_processed_probs_scalar_parameters_and_no_truncation():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(65))
    torch.testing.assert_close(processed_probs(logits), torch.softmax(logits, -1))
    greedy = processed_probs(logits, temperature=0.0)
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1)) and torch.equal(
        greedy.sum(-1), torch.ones(4)
    )


def test_seeded_rows_are_independent_of_the_batch():
    probs = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(74)), -1)
    alone = sample(probs[2:3], [torch.Generator().manual_seed(42)])
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 42, 3, 4)]
    batched = sample(probs, gens)
    assert batched[2] == alone[0]
    again = sample(probs, [torch.Generator().manual_seed(s) for s in (1, 2, 42, 3, 4)])
    assert torch.equal(batched, again)
    u = draw_uniforms([torch.Generator().manual_seed(9), None], 3)
    assert u.shape == (2, 3) and u.dtype == torch.float64


def test_inverse_cdf_law_and_zero_weights_across_blocks():
    vocab = 3000  # three sampling blocks plus a partial one
    weights = torch.zeros(vocab)
    support = torch.tensor([0, 1023, 1024, 2047, 2048, 2999])
    weights[support] = torch.tensor([1.0, 2.0, 3.0, 0.5, 0.5, 3.0])
    n = 120_000
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = torch.cat([inverse_cdf_sample(weights.expand(len(c), vocab), c) for c in u.split(10_000)])
    assert torch.isin(got, support).all()
    observed = np.array([(got == s).sum().item() for s in support.tolist()], dtype=np.float64)
    expected = weights[support].double().numpy() / float(weights.sum()) * n
    assert chisquare(observed, expected).pvalue > 1e-3


def test_inverse_cdf_edges():
    weights = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.0, 0.3, 0.0, 0.7]])
    u0 = torch.zeros(3, dtype=torch.float64)
    u1 = torch.full((3,), 1 - 2**-53, dtype=torch.float64)
    assert inverse_cdf_sample(weights, u0).tolist() == [2, 0, 1]
    assert inverse_cdf_sample(weights, u1).tolist() == [2, 1, 3]


def test_a_temperature_below_greedy_eps_is_greedy_not_an_overflow():
    """logits / 1e-40 overflow float32 (inf - inf = NaN in the softmax): a temperature
    below GREEDY_EPS (vLLM's _SAMPLING_EPS) samples the argmax, as temperature 0 does."""
    from kernels.sampling import GREEDY_EPS

    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, 0.1, 0.2, 0.3]])
    for temperature in (1e-40, GREEDY_EPS / 2, torch.tensor([1e-40, 0.0])):
        probs = processed_probs(logits, temperature=temperature)
        assert torch.isfinite(probs).all(), temperature
        assert torch.equal(probs, torch.eye(4)[[1, 0]]), (temperature, probs)
    warm = processed_probs(logits, temperature=GREEDY_EPS * 10)  # sampled, not one-hot
    assert torch.isfinite(warm).all() and torch.equal(warm.argmax(-1), torch.tensor([1, 0]))


def test_top_p_one_keeps_every_token_top_k_keeps():
    """A tail below ~3e-8 made the mass before it round to 1.0 in float32, and `< top_p`
    dropped it at top_p 1: the spec keeps all top-k tokens when top-p is off."""
    logits = torch.tensor([[0.0, -20.0, -30.0]])
    probs = processed_probs(logits, temperature=1.0, top_k=2, top_p=1.0)
    assert float(probs[0, 1]) > 0 and float(probs[0, 2]) == 0.0


def test_a_greedy_row_of_non_finite_logits_is_nan_not_one_hot():
    """argmax picks a NaN and hid it in a one-hot row: the drafter's check of each row's
    sum let a greedy row of NaN logits through (the verifier checks the logits' amax).
    Now such a row is NaN at any temperature; a finite row beside it is unchanged."""
    logits = torch.tensor([[0.0, math.nan, 1.0], [0.0, 2.0, 1.0], [math.inf, 0.0, 0.0]])
    probs = processed_probs(logits, temperature=0.0)
    assert not torch.isfinite(probs[0].sum()) and not torch.isfinite(probs[2].sum())
    assert torch.equal(probs[1], torch.tensor([0.0, 1.0, 0.0]))
