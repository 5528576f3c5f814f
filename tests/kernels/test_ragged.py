"""ragged_accept: every row of a mixed continuous batch is bit-identical to verifying that
row alone (speculative_accept, or inverse_cdf_sample for K = 0 rows), bad metadata is a
ValueError naming the field; and the AcceptMetadata path of speculative_accept equals the
keyword path."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from kernels import (
    PLACEHOLDER_TOKEN_ID,
    RULES,
    AcceptMetadata,
    RaggedMetadata,
    inverse_cdf_sample,
    ragged_accept,
    speculative_accept,
)
from tests.kernels.cases import random_case, random_probs, sample_ids

if not torch.cuda.is_available():  # as in test_triton: read when triton_accept is imported
    os.environ["TRITON_INTERPRET"] = "1"

INF = math.inf
# (K, rule, delta, tas_threshold, divergence_budget); rows 10 and 11 share a group and are
# consecutive (a view), the other groups are scattered (a gathered copy).
ROWS = [
    (4, "cactus", 0.7, 0.09, INF),
    (0, "sps", 0.0, 0.09, INF),
    (2, "sps", 0.5, 0.09, INF),
    (6, "cactus_exact", 0.4, 0.09, 1.0),
    (1, "tas", 0.0, 0.05, INF),
    (4, "cactus", 0.0, 0.09, INF),
    (6, "cactus_exact", 0.3, 0.09, INF),
    (0, "cactus", 2.0, 0.3, INF),
    (2, "tas", 0.0, 0.2, INF),
    (4, "cactus", 0.3, 0.09, 0.5),
    (2, "cactus_exact", 0.0, 0.09, INF),
    (2, "cactus_exact", 0.5, 0.09, 0.8),
    (1, "tas", 0.0, 0.05, INF),
    (6, "cactus", 3.0, 0.09, INF),
    (0, "tas", 0.0, 0.09, INF),
]


@dataclasses.dataclass
class Batch:
    ids: list[torch.Tensor]  # per row [K_i]
    draft: list[torch.Tensor]  # per row [K_i, V]
    target: list[torch.Tensor]  # per row [K_i + 1, V]
    metadata: RaggedMetadata

    def flat(self):
        return torch.cat(self.ids), torch.cat(self.draft), torch.cat(self.target)


def make_batch(rows, seed: int, *, vocab: int = 50, pad: float | None = None) -> Batch:
    """Random rows (some probabilities truncated to 0); uniforms padded past K_i + 1 with
    `pad` (None: more random draws, which must not be read)."""
    gen = torch.Generator().manual_seed(seed)
    ids, draft, target = [], [], []
    for k, *_ in rows:
        zero_frac = float(torch.rand(1, generator=gen)) * 0.6
        p = random_probs((1, k, vocab), gen=gen, sharp=2.0, zero_frac=zero_frac)
        q = random_probs((1, k + 1, vocab), gen=gen, sharp=2.0, zero_frac=zero_frac)
        q[:, :k] = 0.4 * q[:, :k] + 0.6 * p  # a target that resembles its draft
        ids.append(sample_ids(p, gen)[0] if k else torch.zeros(0, dtype=torch.int64))
        draft.append(p[0])
        target.append(q[0])
    width = max(r[0] for r in rows) + 1
    uniforms = torch.rand(len(rows), width, dtype=torch.float64, generator=gen)
    if pad is not None:
        for i, (k, *_) in enumerate(rows):
            uniforms[i, k + 1 :] = pad
    metadata = RaggedMetadata(
        num_draft_tokens=tuple(r[0] for r in rows),
        rules=tuple(r[1] for r in rows),
        delta=torch.tensor([r[2] for r in rows], dtype=torch.float64),
        tas_threshold=tuple(r[3] for r in rows),
        divergence_budget=torch.tensor([r[4] for r in rows], dtype=torch.float64),
        uniforms=uniforms,
    )
    return Batch(ids, draft, target, metadata)


def solo(batch: Batch, i: int):
    """(tokens [K + 1], num_accepted, divergence, budget_exhausted) of row i verified on
    its own."""
    m = batch.metadata
    k, u = m.num_draft_tokens[i], m.uniforms[i : i + 1, : m.num_draft_tokens[i] + 1]
    if k == 0:
        token = inverse_cdf_sample(batch.target[i], u[:, 0])
        return token, torch.tensor(0), torch.tensor(0.0, dtype=torch.float64), torch.tensor(False)
    budget = m.divergence_budget[i : i + 1]
    res = speculative_accept(
        batch.ids[i][None],
        batch.draft[i][None],
        batch.target[i][None],
        rule=m.rules[i],
        delta=float(m.delta[i]),
        uniforms=u,
        tas_threshold=m.tas_threshold[i],
        divergence_budget=None if math.isinf(budget) else budget,
    )
    return (
        res.output_token_ids[0],
        res.num_accepted[0],
        res.divergence_nats[0],
        res.budget_exhausted[0],
    )


@pytest.mark.parametrize("seed", range(6))
def test_every_row_is_bit_identical_to_verifying_it_alone(seed):
    batch = make_batch(ROWS, seed)
    got = ragged_accept(*batch.flat(), batch.metadata, validate=seed % 2 == 0)
    width = max(r[0] for r in ROWS) + 1
    assert got.output_token_ids.shape == (len(ROWS), width)
    for i, (k, *_) in enumerate(ROWS):
        tokens, num, div, exhausted = solo(batch, i)
        assert torch.equal(got.output_token_ids[i, : k + 1], tokens), i
        assert (got.output_token_ids[i, k + 1 :] == PLACEHOLDER_TOKEN_ID).all(), i
        assert torch.equal(got.num_accepted[i], num), i
        assert torch.equal(got.divergence_nats[i], div), i
        assert torch.equal(got.budget_exhausted[i], exhausted), i
    assert got.num_accepted.dtype == torch.int64 and got.divergence_nats.dtype == torch.float64


def test_finite_budgets_bind_and_infinite_ones_are_no_ceiling():
    """The budgets in ROWS do change results (else the test above proves little)."""
    batch = make_batch(ROWS, 3)
    capped = ragged_accept(*batch.flat(), batch.metadata)
    free = ragged_accept(
        *batch.flat(),
        dataclasses.replace(batch.metadata, divergence_budget=torch.full((len(ROWS),), INF)),
    )
    finite = torch.isfinite(batch.metadata.divergence_budget)
    assert torch.equal(capped.divergence_nats[~finite], free.divergence_nats[~finite])
    assert (capped.divergence_nats[finite] <= batch.metadata.divergence_budget[finite]).all()
    assert (free.divergence_nats[finite] > batch.metadata.divergence_budget[finite]).any()
    # a ceiling that bound says so (the engine then verifies that row losslessly)
    assert capped.budget_exhausted[finite].any() and not free.budget_exhausted.any()
    assert not capped.budget_exhausted[~finite].any()


@pytest.mark.parametrize("seed", range(4))
def test_delta_zero_cactus_rows_equal_sps_rows_in_one_batch(seed):
    """Each draft is verified three times in one batch (same data, same uniforms): by sps,
    by cactus at delta 0 and by cactus_exact at delta 0."""
    shapes = [(1, 0.09, INF), (4, 0.09, 0.5), (2, 0.09, INF), (6, 0.09, 0.0)]
    base = make_batch([(k, "sps", 0.0, t, b) for k, t, b in shapes], seed)
    rows, ids, draft, target, picks = [], [], [], [], []
    for rule in ("sps", "cactus", "cactus_exact"):
        for i, (k, t, b) in enumerate(shapes):
            rows.append((k, rule, 0.0, t, b))
            ids.append(base.ids[i])
            draft.append(base.draft[i])
            target.append(base.target[i])
            picks.append(i)
    m = base.metadata
    metadata = dataclasses.replace(
        m,
        num_draft_tokens=tuple(r[0] for r in rows),
        rules=tuple(r[1] for r in rows),
        delta=torch.zeros(len(rows), dtype=torch.float64),
        tas_threshold=tuple(r[3] for r in rows),
        divergence_budget=m.divergence_budget[picks],
        uniforms=m.uniforms[picks],
    )
    got = ragged_accept(torch.cat(ids), torch.cat(draft), torch.cat(target), metadata)
    n = len(shapes)
    sps = got.output_token_ids[:n], got.num_accepted[:n]
    for block in (1, 2):
        part = slice(block * n, (block + 1) * n)
        assert torch.equal(got.output_token_ids[part], sps[0])
        assert torch.equal(got.num_accepted[part], sps[1])
    assert torch.equal(got.divergence_nats, torch.zeros(len(rows), dtype=torch.float64))


def test_uniform_batch_equals_one_speculative_accept_call():
    """All rows in one group (the consecutive view path): the same as the [B, K, V] call."""
    batch, k, vocab = 6, 4, 64
    ids, draft, target, uniforms = random_case(21, batch=batch, k=k, vocab=vocab)
    delta = torch.linspace(0.0, 2.0, batch, dtype=torch.float64)
    budget = torch.tensor([INF, 0.1, INF, 0.3, INF, INF], dtype=torch.float64)
    want = speculative_accept(
        ids, draft, target, rule="cactus", delta=delta, uniforms=uniforms, divergence_budget=budget
    )
    metadata = RaggedMetadata(
        num_draft_tokens=(k,) * batch,
        rules=("cactus",) * batch,
        delta=delta,
        tas_threshold=(0.09,) * batch,
        divergence_budget=budget,
        uniforms=uniforms,
    )
    got = ragged_accept(
        ids.reshape(-1), draft.reshape(-1, vocab), target.reshape(-1, vocab), metadata
    )
    assert torch.equal(got.output_token_ids, want.output_token_ids)
    assert torch.equal(got.num_accepted, want.num_accepted)
    assert torch.equal(got.divergence_nats, want.divergence_nats)


def test_plain_decoding_only_batch():
    rows = [(0, "none", 0.0, 0.09, INF)] * 3  # the rule of a K = 0 row is never read
    batch = make_batch(rows, 5)
    got = ragged_accept(*batch.flat(), batch.metadata, validate=True)
    q = torch.cat(batch.target)
    assert torch.equal(
        got.output_token_ids[:, 0], inverse_cdf_sample(q, batch.metadata.uniforms[:, 0])
    )
    assert got.output_token_ids.shape == (3, 1)
    assert (got.num_accepted == 0).all() and (got.divergence_nats == 0).all()


def test_uniform_padding_is_never_read():
    batch = make_batch(ROWS, 8)
    padded = make_batch(ROWS, 8, pad=5.0)  # out of [0, 1): validate must not look at it
    want = ragged_accept(*batch.flat(), batch.metadata)
    got = ragged_accept(*padded.flat(), padded.metadata, validate=True)
    for i, (k, *_) in enumerate(ROWS):
        assert torch.equal(
            padded.metadata.uniforms[i, : k + 1], batch.metadata.uniforms[i, : k + 1]
        )
    assert torch.equal(got.output_token_ids, want.output_token_ids)


def test_cu_num_draft_tokens():
    m = make_batch([(2, "sps", 0, 0.09, INF), (0, "sps", 0, 0.09, INF), (3, "tas", 0, 0.1, INF)], 0)
    assert torch.equal(m.metadata.cu_num_draft_tokens, torch.tensor([0, 2, 2, 5]))
    assert m.metadata.cu_num_draft_tokens.dtype == torch.int64


_SMALL = [(2, "cactus", 0.5, 0.09, INF), (0, "sps", 0.0, 0.09, INF), (3, "tas", 0, 0.1, 0.2)]


def _with(field: str, change):
    """The _SMALL batch's flat tensors and metadata with one tensor changed."""
    batch = make_batch(_SMALL, 1)
    names = ("draft_token_ids", "draft_probs", "target_probs")
    tensors = dict(zip(names, batch.flat(), strict=True))
    tensors[field] = change(tensors[field])
    return (*tensors.values(), batch.metadata)


def _poke(t, idx, v):
    t = t.clone()
    t[idx] = v
    return t


BAD_METADATA = [
    ("num_draft_tokens", {"num_draft_tokens": (2, 0)}),
    ("num_draft_tokens", {"num_draft_tokens": (2, -1, 4)}),
    ("num_draft_tokens", {"num_draft_tokens": (2, 0, 4)}),  # sum does not match
    ("rules", {"rules": ("cactus", "sps")}),
    ("rules", {"rules": ("cactus", "sps", "nope")}),
    ("tas_threshold", {"tas_threshold": (0.09, 0.09)}),
    ("tas_threshold", {"tas_threshold": (0.09, 0.09, 0.0)}),
    ("delta", {"delta": torch.zeros(2, dtype=torch.float64)}),
    ("delta", {"delta": 0.5}),
    ("delta", {"delta": torch.tensor([0.1, -0.5, 0.0], dtype=torch.float64)}),
    ("divergence_budget", {"divergence_budget": torch.zeros(4, dtype=torch.float64)}),
    ("divergence_budget", {"divergence_budget": torch.tensor([0.1, math.nan, 0.0])}),
    ("uniforms", {"uniforms": torch.zeros(3, 3, dtype=torch.float64)}),  # K = 3 needs 4
    ("uniforms", {"uniforms": torch.zeros(2, 4, dtype=torch.float64)}),
    ("uniforms", {"uniforms": torch.zeros(3 * 4, dtype=torch.float64)}),
    ("uniforms", {"uniforms": torch.ones(3, 4, dtype=torch.float64)}),
    ("tas_alpha", {"tas_alpha": -1.0}),
    ("tas_alpha", {"tas_alpha": (0.3, None)}),  # one per row, three rows
]
BAD_TENSORS = [
    ("draft_token_ids", "draft_token_ids", lambda t: t[:-1]),
    ("draft_token_ids", "draft_token_ids", lambda t: t[None]),
    ("draft_token_ids", "draft_token_ids", lambda t: _poke(t, 0, 50)),
    ("draft_probs", "draft_probs", lambda t: t[:-1]),
    ("draft_probs", "draft_probs", lambda t: _poke(t, (1, 3), math.nan)),
    ("target_probs", "target_probs", lambda t: t[:, :-1]),
    ("target_probs", "target_probs", lambda t: t[:-1]),
    ("target_probs", "target_probs", lambda t: _poke(t, (6, 0), -0.5)),
    ("target_probs", "target_probs", lambda t: t.index_fill(0, torch.tensor([2]), 0.0)),
]


@pytest.mark.parametrize(("name", "override"), BAD_METADATA)
def test_bad_metadata_raises_value_error_naming_the_field(name, override):
    batch = make_batch(_SMALL, 1)
    metadata = dataclasses.replace(batch.metadata, **override)
    with pytest.raises(ValueError, match=name):
        ragged_accept(*batch.flat(), metadata, validate=True)


@pytest.mark.parametrize(("name", "field", "change"), BAD_TENSORS)
def test_bad_tensors_raise_value_error_naming_the_argument(name, field, change):
    with pytest.raises(ValueError, match=name):
        ragged_accept(*_with(field, change), validate=True)


def test_the_entry_point_checks_values_by_default():
    """acceptance.md: NaN or inf in the inputs is a clear ValueError from the entry point.
    ragged_accept's value scans were off unless asked for, so a NaN draft row came out
    as token 0 (the torch path's NaN residual) without a word; the engine, which checks
    its rows itself, turns them off."""
    with pytest.raises(ValueError, match="draft_probs"):
        ragged_accept(*_with("draft_probs", lambda t: _poke(t, (1, 3), math.nan)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_probabilities_are_refused_naming_the_argument(dtype):
    """Probabilities are float32 (acceptance.md), even for a bf16 model: a bfloat16 row's
    block sums round to 8 bits (a token of mass 2^-9 beside two of 0.5 was never
    sampled)."""
    for field in ("draft_probs", "target_probs"):
        with pytest.raises(ValueError, match=f"{field}: expected float32"):
            ragged_accept(*_with(field, lambda t: t.to(dtype)))


# --- AcceptMetadata path == keyword path -------------------------------------------------


def _keywords(batch: int, rule: str, uniforms: torch.Tensor) -> dict:
    return {
        "rule": rule,
        "delta": torch.linspace(0.0, 2.0, batch, dtype=torch.float64),
        "uniforms": uniforms,
        "tas_threshold": 0.1,
        "tas_alpha": 0.3,
        "divergence_budget": torch.linspace(0.0, 1.0, batch, dtype=torch.float64),
    }


@pytest.mark.parametrize("rule", RULES)
def test_metadata_object_equals_keywords(rule):
    ids, draft, target, uniforms = random_case(31, batch=5, k=3, vocab=40)
    kw = _keywords(5, rule, uniforms)
    by_keywords = speculative_accept(ids, draft, target, **kw)
    by_object = speculative_accept(ids, draft, target, AcceptMetadata(**kw))
    by_name = speculative_accept(ids, draft, target, metadata=AcceptMetadata(**kw))
    for res in (by_object, by_name):
        assert torch.equal(res.output_token_ids, by_keywords.output_token_ids)
        assert torch.equal(res.num_accepted, by_keywords.num_accepted)
        assert torch.equal(res.divergence_nats, by_keywords.divergence_nats)


def test_metadata_and_keywords_together_is_an_error():
    ids, draft, target, _ = random_case(0, batch=2, k=2, vocab=5)
    with pytest.raises(ValueError, match="metadata"):
        speculative_accept(ids, draft, target, AcceptMetadata(rule="sps"), delta=0.5)
    with pytest.raises(ValueError, match="metadata"):
        speculative_accept(ids, draft, target, {"rule": "sps"})
    with pytest.raises(ValueError, match="backend"):
        speculative_accept(ids, draft, target, AcceptMetadata(rule="sps", backend="cuda"))


@pytest.mark.parametrize("rule", RULES)
def test_triton_metadata_object_equals_keywords(rule):
    import kernels.triton_accept  # noqa: F401  (a dev pin: its import failing is a failure)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = random_case(32, batch=3, k=3, vocab=50)
    ids, draft, target, uniforms = (t.to(device) for t in case)
    kw = _keywords(3, rule, uniforms)
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    by_keywords = speculative_accept(ids, draft, target, backend="triton", **kw)
    by_object = speculative_accept(ids, draft, target, AcceptMetadata(backend="triton", **kw))
    assert torch.equal(by_object.output_token_ids, by_keywords.output_token_ids)
    assert torch.equal(by_object.num_accepted, by_keywords.num_accepted)
    assert torch.equal(by_object.divergence_nats, by_keywords.divergence_nats)
    torch_path = speculative_accept(*(t.cpu() for t in case[:3]), rule=rule, **_cpu(kw))
    assert torch.equal(by_object.output_token_ids.cpu(), torch_path.output_token_ids)


def _cpu(kw: dict) -> dict:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items() if k != "rule"}


def test_per_row_tas_alphas_split_their_group_and_each_row_keeps_its_own():
    """tas rows 4 and 12 share K and threshold; given different alphas (a tuple, one per
    row: 50, a cut-off of epsilon, and None) they verify apart, each bit-identical to
    verifying it alone with its alpha."""
    batch = make_batch(ROWS, 0)
    alphas = tuple({4: 50.0, 8: 0.0, 12: None}.get(i) for i in range(len(ROWS)))
    got = ragged_accept(*batch.flat(), dataclasses.replace(batch.metadata, tas_alpha=alphas))
    m = batch.metadata
    for i in (4, 8, 12):
        k = m.num_draft_tokens[i]
        alone = speculative_accept(
            batch.ids[i][None],
            batch.draft[i][None],
            batch.target[i][None],
            rule="tas",
            uniforms=m.uniforms[i : i + 1, : k + 1],
            tas_threshold=m.tas_threshold[i],
            tas_alpha=alphas[i],
        )
        assert torch.equal(got.output_token_ids[i, : k + 1], alone.output_token_ids[0]), i
        assert torch.equal(got.num_accepted[i], alone.num_accepted[0]), i
    same = ragged_accept(*batch.flat(), m)  # one alpha (None) for every row
    for i in range(len(ROWS)):
        if i not in (4, 8):
            assert torch.equal(got.output_token_ids[i], same.output_token_ids[i]), i
    # and the alphas given did change both rows (else a kernel ignoring them would pass)
    for i in (4, 8):
        assert not torch.equal(got.output_token_ids[i], same.output_token_ids[i]), i
