"""speculative_accept: bit-identity at delta = 0, agreement with the slow reference,
edge rows, greedy rows and argument errors."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import (
    PLACEHOLDER_TOKEN_ID,
    RULES,
    inverse_cdf_sample,
    processed_probs,
    speculative_accept,
)
from tests.kernels.cases import (
    edge_case,
    empty_residual_case,
    off_support_empty_residual_case,
    random_case,
)
from tests.kernels.reference import reference_accept

SHAPES = [(1, 1, 2), (3, 1, 7), (2, 4, 2), (5, 3, 11), (8, 4, 50), (4, 10, 64), (16, 5, 1500)]


@pytest.mark.parametrize("rule", ["cactus", "cactus_exact"])
@pytest.mark.parametrize("seed", range(40))
def test_delta_zero_is_bit_identical_to_sps(rule, seed):
    batch, k, vocab = SHAPES[seed % len(SHAPES)]
    ids, draft, target, _ = random_case(seed, batch=batch, k=k, vocab=vocab)
    zero = 0.0 if seed % 2 else torch.zeros(batch, dtype=torch.float64)
    sps = speculative_accept(
        ids, draft, target, rule="sps", generator=torch.Generator().manual_seed(seed)
    )
    ours = speculative_accept(
        ids, draft, target, rule=rule, delta=zero, generator=torch.Generator().manual_seed(seed)
    )
    assert torch.equal(sps.output_token_ids, ours.output_token_ids)
    assert torch.equal(sps.num_accepted, ours.num_accepted)
    assert torch.equal(ours.divergence_nats, torch.zeros(batch, dtype=torch.float64))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("seed", range(12))
def test_fast_path_matches_reference(rule, seed):
    batch, k, vocab = SHAPES[seed % len(SHAPES)]
    ids, draft, target, uniforms = random_case(1000 + seed, batch=batch, k=k, vocab=vocab)
    delta = torch.linspace(0.0, 3.0, batch, dtype=torch.float64)
    budget = None if seed % 3 else torch.linspace(0.0, 2.0, batch, dtype=torch.float64)
    fast = speculative_accept(
        ids, draft, target, rule=rule, delta=delta, uniforms=uniforms, divergence_budget=budget
    )
    out, num, div = reference_accept(
        ids, draft, target, rule=rule, delta=delta, uniforms=uniforms, budget=budget
    )
    assert torch.equal(fast.output_token_ids, out)
    assert torch.equal(fast.num_accepted, num)
    # The reference sums KL over the whole float32 row, whose mass is 1 only to ~1e-7;
    # the kernel's binary KL assumes exact normalisation.
    torch.testing.assert_close(fast.divergence_nats, div, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rule", ["sps", "cactus"])
def test_a_real_vocabulary_size_matches_the_reference(rule):
    """The torch path streams a rejected row's residual in chunks of
    RESIDUAL_CHUNK_BLOCKS sampling blocks (16,384 tokens): only vocabularies beyond that
    (40,000 here, with a partial last chunk) take the chunked pass, which the shapes
    above never reach on the CPU."""
    from kernels.rejection import RESIDUAL_CHUNK_BLOCKS
    from kernels.sampling import SAMPLE_BLOCK

    vocab = 40_000
    assert vocab > RESIDUAL_CHUNK_BLOCKS * SAMPLE_BLOCK and vocab % SAMPLE_BLOCK
    ids, draft, target, uniforms = random_case(77, batch=3, k=3, vocab=vocab)
    delta = torch.tensor([0.0, 0.5, 3.0], dtype=torch.float64)
    fast = speculative_accept(ids, draft, target, rule=rule, delta=delta, uniforms=uniforms)
    out, num, div = reference_accept(ids, draft, target, rule=rule, delta=delta, uniforms=uniforms)
    assert bool((num < 3).any())  # a rejection: a residual was sampled
    assert torch.equal(fast.output_token_ids, out)
    assert torch.equal(fast.num_accepted, num)
    torch.testing.assert_close(fast.divergence_nats, div, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("delta", [0.0, 0.3, 5.0])
def test_edge_rows_match_reference(rule, delta):
    ids, draft, target, uniforms = edge_case()
    fast = speculative_accept(ids, draft, target, rule=rule, delta=delta, uniforms=uniforms)
    out, num, div = reference_accept(ids, draft, target, rule=rule, delta=delta, uniforms=uniforms)
    assert torch.equal(fast.output_token_ids, out)
    assert torch.equal(fast.num_accepted, num)
    torch.testing.assert_close(fast.divergence_nats, div, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rule", ["sps", "cactus", "cactus_exact"])
@pytest.mark.parametrize("delta", [0.0, 0.5, 50.0])
def test_edge_row_semantics(rule, delta):
    ids, draft, target, uniforms = edge_case()
    res = speculative_accept(ids, draft, target, rule=rule, delta=delta, uniforms=uniforms)
    out = res.output_token_ids
    # q_n = 0: never accepted, and the recovered token is inside q's support.
    assert res.num_accepted[0] == 0 and target[0, 0, out[0, 0]] > 0
    # q_n = 1 at every position: all accepted, bonus from row K, no divergence.
    assert res.num_accepted[1] == 3 and res.divergence_nats[1] == 0
    # p_n = 0 at position 1: rejected there.
    assert res.num_accepted[2] == 1
    # p == q and u = 0: all accepted; the bonus is the only extra token.
    assert res.num_accepted[3] == 3 and (out[3] >= 0).all()
    # q_n = 0.001 vs p_n = 0.9, u = 0.999: rejected at position 0 unless delta is so
    # large that h_n reaches 1 (cactus_exact: -ln 0.001 = 6.9 <= delta).
    if delta < 6.9 or rule == "cactus":
        assert res.num_accepted[4] == 0
        assert (out[4, 1:] == PLACEHOLDER_TOKEN_ID).all()
    # one-hot q on token 3 (drafted 0): recovered token is 3.
    assert out[5, 0] == 3 and (out[5, 1:] == PLACEHOLDER_TOKEN_ID).all()


@pytest.mark.parametrize("rule", ["sps", "cactus", "cactus_exact"])
def test_an_empty_residual_samples_h(rule):
    ids, draft, target, uniforms = empty_residual_case()
    res = speculative_accept(ids, draft, target, rule=rule, delta=0.0, uniforms=uniforms)
    out, _num, _ = reference_accept(ids, draft, target, rule=rule, delta=0.0, uniforms=uniforms)
    assert (res.num_accepted == 0).all()
    assert torch.equal(res.output_token_ids, out)
    want = inverse_cdf_sample(target[:, 0], uniforms[:, 2])  # h = q at delta 0
    assert torch.equal(res.output_token_ids[:, 0], want)


@pytest.mark.parametrize("rule", ["sps", "cactus", "cactus_exact"])
def test_an_empty_residual_never_emits_a_token_outside_qs_support(rule):
    """q <= p everywhere (rounding-sized gaps) with q_0 = 0 < p_0: the residual is empty
    and p, the old fallback, put its first mass on token 0, outside q's support."""
    ids, draft, target, uniforms = off_support_empty_residual_case()
    res = speculative_accept(ids, draft, target, rule=rule, delta=0.0, uniforms=uniforms)
    assert int(res.num_accepted[0]) == 0
    token = int(res.output_token_ids[0, 0])
    assert target[0, 0, token] > 0 and token == 1, token


def _budget_case(k: int):
    """Position 0: q_n = 0.3, whose cactus boost at delta 1 costs about 1.2 nats; position
    1: q_n = 0.999, whose boost costs 0.001 nats. Uniforms 0: both drafts are accepted."""
    vocab = 4
    q0 = torch.tensor([0.3, 0.3, 0.2, 0.2])
    q1 = torch.tensor([0.999, 0.0005, 0.0003, 0.0002])
    target = torch.stack([q0, q1, torch.full((vocab,), 0.25)])[None, : k + 1]
    draft = torch.full((1, k, vocab), 0.25)
    ids = torch.zeros(1, k, dtype=torch.int64)
    uniforms = torch.zeros(1, k + 1, dtype=torch.float64)
    return ids, draft, target, uniforms


@pytest.mark.parametrize("rule", ["cactus", "cactus_exact"])
def test_a_spent_divergence_budget_stays_spent(rule):
    """acceptance.md: once the running sum would exceed the ceiling, that request's
    REMAINING positions use delta = 0. Within one call the cheap position 1 after the
    expensive position 0 gets delta 0; the call reports the budget spent, so the caller
    (the engine) keeps delta 0 for the request's later steps, where the same position
    would otherwise fit what is left of the budget and get the full delta again."""
    budget = torch.tensor([0.1], dtype=torch.float64)
    whole = speculative_accept(
        *_budget_case(2)[:3], rule=rule, delta=1.0, uniforms=_budget_case(2)[3],
        divergence_budget=budget,
    )  # fmt: skip
    assert int(whole.num_accepted[0]) == 2 and float(whole.divergence_nats[0]) == 0.0
    assert bool(whole.budget_exhausted[0])
    first = speculative_accept(
        *_budget_case(1)[:3], rule=rule, delta=1.0, uniforms=_budget_case(1)[3],
        divergence_budget=budget,
    )  # fmt: skip
    assert float(first.divergence_nats[0]) == 0.0 and bool(first.budget_exhausted[0])
    # position 1 alone with what is left (0.1): it fits, so only the sticky flag keeps
    # it lossless
    ids, draft, target, uniforms = _budget_case(2)
    alone = speculative_accept(
        ids[:, 1:], draft[:, 1:], target[:, 1:], rule=rule, delta=1.0,
        uniforms=uniforms[:, 1:], divergence_budget=budget,
    )  # fmt: skip
    assert 0 < float(alone.divergence_nats[0]) < 0.1 and not bool(alone.budget_exhausted[0])


def test_a_budget_reached_only_past_the_first_rejection_is_not_spent():
    """Two positions costing about delta = 0.01 nats each, budget 0.015: position 1 would
    exceed it. Reached (position 0 accepted), the budget is spent; with position 0
    rejected, position 1 is never reached and the budget is not spent."""
    row = torch.tensor([0.3, 0.3, 0.2, 0.2])
    target = torch.stack([row, row, row])[None]  # [1, 3, 4]
    draft = torch.tensor([[0.9, 0.05, 0.03, 0.02]]).expand(2, 4)[None].contiguous()
    ids = torch.zeros(1, 2, dtype=torch.int64)
    budget = torch.tensor([0.015], dtype=torch.float64)

    def verify(u0: float):
        uniforms = torch.tensor([[u0, 0.0, 0.5]], dtype=torch.float64)
        return speculative_accept(
            ids, draft, target, rule="cactus", delta=0.01, uniforms=uniforms,
            divergence_budget=budget,
        )  # fmt: skip

    reached = verify(0.0)  # u * p_n = 0 < h_n: both accepted
    assert int(reached.num_accepted[0]) == 2 and bool(reached.budget_exhausted[0])
    assert 0.005 < float(reached.divergence_nats[0]) <= 0.015
    rejected = verify(1 - 1e-12)  # u * p_n = 0.9 > h_n = 0.365: position 0 rejected
    assert int(rejected.num_accepted[0]) == 0 and not bool(rejected.budget_exhausted[0])


def test_cactus_accepts_more_but_never_outside_support():
    ids, draft, target, _ = random_case(7, batch=4000, k=1, vocab=6)
    counts = {}
    for rule in ("sps", "cactus", "cactus_exact"):
        res = speculative_accept(
            ids, draft, target, rule=rule, delta=1.0, generator=torch.Generator().manual_seed(3)
        )
        counts[rule] = int(res.num_accepted.sum())
        emitted = res.output_token_ids[:, 0]
        assert (target[torch.arange(4000), 0, emitted] > 0).all(), rule
    assert counts["cactus"] > counts["sps"] and counts["cactus_exact"] > counts["sps"]


@pytest.mark.parametrize("rule", RULES)
def test_temperature_zero_rows_emit_the_argmax_chain(rule):
    gen = torch.Generator().manual_seed(11)
    batch, k, vocab = 64, 5, 40
    target_logits = torch.randn(batch, k + 1, vocab, generator=gen)
    # The draft agrees with the verifier's argmax most of the time.
    draft_logits = target_logits[:, :k] + 0.8 * torch.randn(batch, k, vocab, generator=gen)
    target = processed_probs(target_logits, temperature=0.0)
    draft = processed_probs(draft_logits, temperature=0.0)
    ids = draft.argmax(-1)
    res = speculative_accept(
        ids, draft, target, rule=rule, delta=2.0, generator=torch.Generator().manual_seed(5)
    )
    want = target_logits.argmax(-1)  # [B, K + 1]
    for b in range(batch):
        m = int(res.num_accepted[b])
        agree = int((ids[b] == want[b, :k]).long().cumprod(0).sum())
        assert m == agree
        assert res.output_token_ids[b, : m + 1].tolist() == want[b, : m + 1].tolist()
    assert torch.equal(res.divergence_nats, torch.zeros(batch, dtype=torch.float64))


def test_per_request_delta_in_one_batch():
    ids, draft, target, uniforms = random_case(3, batch=6, k=4, vocab=30)
    deltas = torch.tensor([0.0, 0.5, 0.0, 2.0, 0.0, 1.0], dtype=torch.float64)
    mixed = speculative_accept(ids, draft, target, rule="cactus", delta=deltas, uniforms=uniforms)
    for b in range(6):
        solo = speculative_accept(
            ids[b : b + 1],
            draft[b : b + 1],
            target[b : b + 1],
            rule="cactus",
            delta=float(deltas[b]),
            uniforms=uniforms[b : b + 1],
        )
        assert torch.equal(mixed.output_token_ids[b], solo.output_token_ids[0])


def test_divergence_budget_caps_the_sum():
    ids, draft, target, uniforms = random_case(4, batch=64, k=6, vocab=20)
    budget = torch.full((64,), 0.3, dtype=torch.float64)
    free = speculative_accept(ids, draft, target, rule="cactus_exact", delta=1.0, uniforms=uniforms)
    capped = speculative_accept(
        ids,
        draft,
        target,
        rule="cactus_exact",
        delta=1.0,
        uniforms=uniforms,
        divergence_budget=budget,
    )
    assert (capped.divergence_nats <= 0.3 + 1e-12).all()
    assert (free.divergence_nats > 0.3).any()
    assert int(capped.num_accepted.sum()) <= int(free.num_accepted.sum())


def _args(**over):
    ids, draft, target, _ = random_case(0, batch=2, k=3, vocab=5)
    base = {
        "draft_token_ids": ids,
        "draft_probs": draft,
        "target_probs": target,
        "rule": "cactus",
        "delta": 0.5,
    }
    base.update(over)
    return base


def _bad(t, idx, value):
    t = t.clone()
    t[idx] = value
    return t


_, _D, _T, _ = random_case(0, batch=2, k=3, vocab=5)
BAD_INPUTS = [
    ("rule", {"rule": "nope"}),
    ("rule", {"rule": "none"}),
    ("draft_token_ids", {"draft_token_ids": torch.zeros(2, 0, dtype=torch.int64)}),
    ("draft_token_ids", {"draft_token_ids": torch.zeros(2, 3)}),
    ("draft_token_ids", {"draft_token_ids": torch.tensor([[0, 1, 5], [0, 0, 0]])}),
    ("draft_token_ids", {"draft_token_ids": torch.tensor([[0, -1, 2], [0, 0, 0]])}),
    ("draft_probs", {"draft_probs": _D[:, :2]}),
    ("target_probs", {"target_probs": _T[:, :3]}),
    ("target_probs", {"target_probs": _T[..., :4]}),
    ("draft_probs", {"draft_probs": _bad(_D, (0, 1, 2), math.nan)}),
    ("target_probs", {"target_probs": _bad(_T, (1, 3, 0), math.inf)}),
    ("target_probs", {"target_probs": _bad(_T, (1, 0, 0), -0.1)}),
    # a q row with no mass: every rule would emit token 0, which q rules out
    ("target_probs", {"target_probs": _T.index_fill(1, torch.tensor([1]), 0.0)}),
    ("target_probs", {"target_probs": _T.index_fill(1, torch.tensor([3]), 0.0)}),
    ("delta", {"delta": -0.1}),
    ("delta", {"delta": math.nan}),
    ("delta", {"delta": math.inf}),
    ("delta", {"delta": torch.tensor([0.1, math.nan])}),
    ("delta", {"delta": torch.tensor([0.1, 0.2, 0.3])}),
    ("uniforms", {"uniforms": torch.zeros(2, 3, dtype=torch.float64)}),
    ("uniforms", {"uniforms": torch.ones(2, 4, dtype=torch.float64)}),
    ("divergence_budget", {"divergence_budget": torch.tensor([math.nan, 1.0])}),
    ("tas_threshold", {"rule": "tas", "tas_threshold": 0.0}),
    ("tas_alpha", {"rule": "tas", "tas_alpha": -1.0}),
]


@pytest.mark.parametrize(("name", "override"), BAD_INPUTS)
def test_bad_input_raises_value_error_naming_the_argument(name, override):
    with pytest.raises(ValueError, match=name):
        speculative_accept(**_args(**override))


@pytest.mark.parametrize(("threshold", "alpha"), [(0.2, None), (0.09, 1.0), (0.5, 0.05)])
@pytest.mark.parametrize("seed", range(4))
def test_tas_thresholds_and_alphas_match_the_reference(threshold, alpha, seed):
    """tas beyond the defaults (threshold 0.09, alpha sqrt(0.09) = 0.3, where a kernel
    that hard-coded alpha 0.3 or ignored tas_alpha would pass): the min(epsilon,
    alpha exp(-H)) cut-off against the slow reference, each term deciding somewhere."""
    batch, k, vocab = SHAPES[3 + seed % 3]
    ids, draft, target, uniforms = random_case(500 + seed, batch=batch, k=k, vocab=vocab)
    kw = {"tas_threshold": threshold, "tas_alpha": alpha}
    fast = speculative_accept(ids, draft, target, rule="tas", uniforms=uniforms, **kw)
    out, num, div = reference_accept(
        ids, draft, target, rule="tas", delta=0.0, uniforms=uniforms, **kw
    )
    assert torch.equal(fast.output_token_ids, out) and torch.equal(fast.num_accepted, num)
    torch.testing.assert_close(fast.divergence_nats, div, rtol=1e-6, atol=1e-7)


def test_tas_alpha_changes_what_is_accepted():
    """The same drafts under alpha 0 (cut-off 0: every drafted token q > 0 accepted),
    the default and a large alpha (cut-off epsilon): the counts differ, so the tests
    above compare something that alpha moves."""
    ids, draft, target, uniforms = random_case(9, batch=64, k=4, vocab=11)
    counts = [
        int(
            speculative_accept(
                ids, draft, target, rule="tas", uniforms=uniforms, tas_alpha=alpha
            ).num_accepted.sum()
        )
        for alpha in (0.0, None, 50.0)
    ]
    assert counts[0] > counts[1] >= counts[2], counts


@pytest.mark.parametrize(
    ("name", "override"),
    [
        ("divergence_budget", {"divergence_budget": torch.tensor([0.1], dtype=torch.float64)}),
        ("uniforms", {"uniforms": torch.zeros(2, 3, dtype=torch.float64)}),  # no bonus column
    ],
)
def test_shapes_are_checked_with_validate_off(name, override):
    """validate=False skips the value scans only (AcceptMetadata's docstring): a [1]
    budget for 2 rows was broadcast silently in torch (and read past the end in Triton),
    a missing bonus column of uniforms read out of bounds."""
    with pytest.raises(ValueError, match=name):
        speculative_accept(**_args(**override), validate=False)


def above_one_case():
    """q_n and p_n a float32 rounding above 1 (a caller's own softmax), and a uniform
    just below 1: u * p_n < q_n, but not < min(q_n, 1)."""
    over = 1.0 + 2.0**-23
    ids = torch.tensor([[0]])
    draft = torch.tensor([[[over, 0.0]]])
    target = torch.tensor([[[over, 0.0], [0.5, 0.5]]])
    uniforms = torch.tensor([[1.0 - 2.0**-30, 0.5]], dtype=torch.float64)
    return ids, draft, target, uniforms


def test_a_probability_rounded_above_one_counts_as_one():
    """sps's divergence was NaN (d(q || q) with 1 - q < 0) and cactus at delta 0 rejected
    what sps accepted; both backends now clamp q_n and p_n to 1."""
    ids, draft, target, uniforms = above_one_case()
    sps = speculative_accept(ids, draft, target, rule="sps", uniforms=uniforms)
    assert torch.equal(sps.divergence_nats, torch.zeros(1, dtype=torch.float64))
    assert int(sps.num_accepted[0]) == 1
    for rule in ("cactus", "cactus_exact"):
        ours = speculative_accept(ids, draft, target, rule=rule, delta=0.0, uniforms=uniforms)
        assert torch.equal(ours.output_token_ids, sps.output_token_ids), rule
        assert torch.equal(ours.divergence_nats, torch.zeros(1, dtype=torch.float64)), rule
