"""Acceptance for a continuous batch whose rows draft different numbers of tokens.

A continuous-batching engine verifies, in one step, rows that drafted K_i tokens under
their own rule, delta, typical-acceptance threshold and divergence budget; rows with
K_i = 0 are plain decoding steps. Drafts travel flattened with per-row counts, as in
vLLM V1 (`cu_num_draft_tokens`); see `kernels.metadata.RaggedMetadata` for the layout.

`ragged_accept` groups the rows that share (K, rule, tas threshold and alpha), runs ONE
`speculative_accept` per group on [G, K, V] tensors (a view, not a copy, when the
group's rows are consecutive) and scatters the results back in row order. Every row's
result is bit-identical to verifying that row alone with the same uniforms, and a
K_i = 0 row samples q with `inverse_cdf_sample` from its first uniform, exactly what
a plain decoding step does. Grouping reads only host tuples, plus one [B] host copy
of which budgets are finite (to skip the budget pass where no row of a group has one).
"""

from __future__ import annotations

import itertools

import torch

from kernels import validation
from kernels.metadata import AcceptMetadata, AcceptResult, RaggedMetadata
from kernels.rejection import PLACEHOLDER_TOKEN_ID, speculative_accept
from kernels.sampling import inverse_cdf_sample

# Rules that read delta and the divergence budget (sps and tas ignore both).
BOOSTED_RULES = ("cactus", "cactus_exact")
PLAIN = (0, None, None)  # the group key of K_i = 0 rows, whatever their rule


def ragged_accept(
    draft_token_ids: torch.Tensor,  # [sum K_i] flattened, row-major
    draft_probs: torch.Tensor,  # [sum K_i, V]
    target_probs: torch.Tensor,  # [sum (K_i + 1), V]: row i's K_i positions, then its bonus
    metadata: RaggedMetadata,
    *,
    validate: bool = True,  # the value scans (finite probabilities, ids, uniforms, budget);
    # the engine, which checks its own rows' finiteness, turns them off
) -> AcceptResult:  # output_token_ids [B, max K_i + 1] (-1 padded), num_accepted, divergence
    """Verify every row of a ragged batch under its own rule; results in row order.

    Raises ValueError naming the field on bad metadata or tensor shapes.
    """
    validation.check_ragged(draft_token_ids, draft_probs, target_probs, metadata, validate=validate)
    counts = metadata.num_draft_tokens
    batch, device = len(counts), target_probs.device
    out = torch.full(
        (batch, max(counts, default=0) + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device
    )
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    divergence = torch.zeros(batch, dtype=torch.float64, device=device)
    exhausted = torch.zeros(batch, dtype=torch.bool, device=device)
    flat = _Flat(draft_token_ids, draft_probs, target_probs, counts)
    groups = _groups(metadata)
    has_ceiling = _finite_budgets(metadata, groups)
    for key, rows in groups.items():
        index = torch.tensor(rows, dtype=torch.int64, device=device)  # [G]
        if key == PLAIN:
            q = flat.target(rows, 1)[:, 0]  # [G, V]: the bonus row is the only row
            u = metadata.uniforms.index_select(0, index.to(metadata.uniforms.device))[:, 0]
            u = u.to(q.device)
            out[index, 0] = inverse_cdf_sample(q, u)
            continue
        result = _accept_group(flat, rows, index, key, metadata, has_ceiling)
        out[index, : key[0] + 1] = result.output_token_ids
        num_accepted[index] = result.num_accepted
        divergence[index] = result.divergence_nats
        exhausted[index] = result.budget_exhausted
    return AcceptResult(out, num_accepted, divergence, exhausted)


def _groups(metadata: RaggedMetadata) -> dict[tuple, list[int]]:
    """Rows by (K, rule, tas threshold and alpha), in order of first appearance. The
    threshold and alpha are part of the key only for tas; every K_i = 0 row is in the
    PLAIN group."""
    groups: dict[tuple, list[int]] = {}
    rows = zip(metadata.num_draft_tokens, metadata.rules, metadata.tas_threshold, strict=True)
    for i, (k, rule, threshold) in enumerate(rows):
        tas = (threshold, metadata.alpha(i)) if rule == "tas" else None
        key = PLAIN if k == 0 else (k, rule, tas)
        groups.setdefault(key, []).append(i)
    return groups


def _finite_budgets(metadata: RaggedMetadata, groups: dict[tuple, list[int]]) -> list[bool]:
    """[B] host flags: row i has a divergence ceiling. Read (one device-to-host copy)
    only when some group's rule uses the budget."""
    if not any(key[1] in BOOSTED_RULES for key in groups):
        return [False] * len(metadata.num_draft_tokens)
    return torch.isfinite(metadata.divergence_budget).tolist()


def _accept_group(
    flat: _Flat,
    rows: list[int],  # [G] row numbers sharing `key`
    index: torch.Tensor,  # [G] int64, the same rows as a tensor
    key: tuple,  # (K, rule, (tas threshold, alpha) or None)
    metadata: RaggedMetadata,
    has_ceiling: list[bool],  # [B]
) -> AcceptResult:  # [G, K + 1] tokens, [G] accepted, [G] divergence
    """One `speculative_accept` call on the group's [G, K, V] / [G, K + 1, V] tensors.

    A budget of +inf never stops the running-divergence test (running <= inf), so rows
    without a ceiling give the same bits with or without a budget; a group where no row
    has one skips the budget pass (None)."""
    k, rule, _ = key

    def rows_of(t: torch.Tensor) -> torch.Tensor:  # [B, ...] -> [G, ...]
        return t.index_select(0, index.to(t.device))

    boosted = rule in BOOSTED_RULES
    budget = boosted and any(has_ceiling[i] for i in rows)
    group = AcceptMetadata(
        rule=rule,
        delta=rows_of(metadata.delta) if boosted else 0.0,
        uniforms=rows_of(metadata.uniforms)[:, : k + 1],
        tas_threshold=metadata.tas_threshold[rows[0]],  # read by tas only: one per group
        tas_alpha=metadata.alpha(rows[0]),
        divergence_budget=rows_of(metadata.divergence_budget) if budget else None,
        validate=False,  # ragged_accept has checked the whole batch
    )
    return speculative_accept(
        flat.ids(rows, k), flat.draft(rows, k), flat.target(rows, k + 1), group
    )


class _Flat:
    """The flattened tensors and each row's first draft and target row (host ints)."""

    def __init__(self, draft_token_ids, draft_probs, target_probs, counts: tuple[int, ...]):
        self.draft_token_ids = draft_token_ids  # [sum K_i]
        self.draft_probs = draft_probs  # [sum K_i, V]
        self.target_probs = target_probs  # [sum (K_i + 1), V]
        self.draft_start = [0, *itertools.accumulate(counts)][:-1]  # [B]
        self.target_start = [s + i for i, s in enumerate(self.draft_start)]  # [B]

    def ids(self, rows: list[int], k: int) -> torch.Tensor:  # [G, K]
        return _gather(self.draft_token_ids, [self.draft_start[i] for i in rows], k)

    def draft(self, rows: list[int], k: int) -> torch.Tensor:  # [G, K, V]
        return _gather(self.draft_probs, [self.draft_start[i] for i in rows], k)

    def target(self, rows: list[int], width: int) -> torch.Tensor:  # [G, width, V]
        return _gather(self.target_probs, [self.target_start[i] for i in rows], width)


def _gather(flat: torch.Tensor, starts: list[int], width: int) -> torch.Tensor:
    """flat [N, ...] -> [G, width, ...]: rows starts[g] .. starts[g] + width - 1.

    Back-to-back blocks (the rows of a group are consecutive, as in a uniform batch) are
    a view; anything else is one index_select copy."""
    tail = flat.shape[1:]
    first = starts[0]
    if all(s == first + g * width for g, s in enumerate(starts)):
        return flat.narrow(0, first, len(starts) * width).reshape(len(starts), width, *tail)
    index = torch.tensor(
        [s + c for s in starts for c in range(width)], dtype=torch.int64, device=flat.device
    )
    return flat.index_select(0, index).reshape(len(starts), width, *tail)
