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

import torch

from kernels import validation
from kernels.divergence import binary_kl, cactus_boost, cactus_exact_boost, rest_scale
from kernels.metadata import AcceptMetadata, AcceptResult
from kernels.sampling import (
    SAMPLE_BLOCK,
    block_columns,
    block_sums,
    draw_uniforms,
    inverse_cdf_sample,
    sample_from_blocks,
)

PLACEHOLDER_TOKEN_ID = -1
# The final row is streamed in chunks of this many sampling blocks (64 KiB of float32
# per row): each chunk is computed, reduced and dropped while it is still in cache.
RESIDUAL_CHUNK_BLOCKS = 16
RULES = validation.RULES


def speculative_accept(
    draft_token_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K + 1, V]
    metadata: AcceptMetadata | None = None,
    **kwargs,  # or AcceptMetadata's fields as keywords: rule=..., delta=..., ...
) -> AcceptResult:
    """Verify K drafted tokens per sequence and emit the accepted, recovered or bonus tokens.

    How to verify comes as one `AcceptMetadata` or as its fields in keywords (not both).
    `divergence_budget` implements max_divergence_nats: positions whose running
    divergence would exceed a sequence's budget use delta = 0 from there on (tas ignores
    delta and the budget). Raises ValueError naming the argument on bad input.
    """
    if metadata is None:
        metadata = AcceptMetadata(**kwargs)
    elif kwargs:
        raise ValueError(
            "metadata: pass an AcceptMetadata or keyword arguments, not both "
            f"(got keywords {sorted(kwargs)})"
        )
    elif not isinstance(metadata, AcceptMetadata):
        raise ValueError(f"metadata: expected an AcceptMetadata, got {type(metadata).__name__}")
    backend = metadata.backend
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "triton" or (
        backend == "auto" and target_probs.is_cuda and target_probs.dtype == torch.float32
    ):
        from kernels.triton_accept import speculative_accept_triton  # needs triton

        return speculative_accept_triton(draft_token_ids, draft_probs, target_probs, metadata)
    return _accept_torch(draft_token_ids, draft_probs, target_probs, metadata)


def _accept_torch(
    draft_token_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K + 1, V]
    metadata: AcceptMetadata,
) -> AcceptResult:
    """The torch path: gathered [B, K] acceptance, then one streamed [V] row per sequence."""
    batch, k, vocab = validation.check_arguments(
        draft_token_ids, draft_probs, target_probs, metadata
    )
    device = target_probs.device
    uniforms = metadata.uniforms  # [B, K + 1] float64
    if uniforms is None:
        # drawn on the generator's own device (a CPU generator cannot fill CUDA memory);
        # the same values as torch.rand(batch, k + 1) from it
        uniforms = draw_uniforms([metadata.generator], batch * (k + 1), device=device)
        uniforms = uniforms.view(batch, k + 1)
    # The verifier's probabilities set the device (drafts may arrive on the CPU).
    ids = draft_token_ids.to(device=device, dtype=torch.int64)
    draft_probs, uniforms = draft_probs.to(device), uniforms.to(device)
    # at most 1: a probability rounded just above it (a caller's own softmax) would make
    # d(q || q) NaN and cactus at delta 0 differ from sps (both backends clamp alike)
    q_n = target_probs[:, :k].gather(-1, ids[..., None])[..., 0].clamp(max=1.0)  # [B, K]
    p_n = draft_probs.gather(-1, ids[..., None])[..., 0].clamp(max=1.0)  # [B, K]
    if metadata.rule == "tas":
        return _accept_typical(target_probs, ids, q_n, uniforms[:, k], metadata)

    delta = torch.as_tensor(metadata.delta, dtype=torch.float64, device=device).expand(batch)
    budget = metadata.divergence_budget
    h_n, capped = adjusted_target_mass(
        q_n,
        delta[:, None].expand(batch, k),
        metadata.rule,
        None if budget is None else budget.to(device),
    )
    # p_n = 0 means reject: the draft could not have sampled n (spec). No division.
    accepted = (p_n > 0) & (uniforms[:, :k] * p_n.to(torch.float64) < h_n)
    num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B]
    row = _FinalRow(target_probs, draft_probs, ids, h_n, q_n, num_accepted)
    last = _final_tokens(row, uniforms[:, k], vocab)
    divergence = _emitted_sum(binary_kl(h_n, q_n), num_accepted)
    exhausted = _emitted_sum(capped.to(torch.float64), num_accepted) > 0
    return AcceptResult(_assemble(ids, num_accepted, last), num_accepted, divergence, exhausted)


def _accept_typical(
    target_probs: torch.Tensor,  # [B, K + 1, V]
    ids: torch.Tensor,  # [B, K] int64
    q_n: torch.Tensor,  # [B, K]
    u_final: torch.Tensor,  # [B] float64
    metadata: AcceptMetadata,
) -> AcceptResult:
    """tas: deterministic acceptance (ignores p, delta and the budget), argmax recovery."""
    k = ids.shape[1]
    threshold = metadata.tas_threshold
    alpha = math.sqrt(threshold) if metadata.tas_alpha is None else metadata.tas_alpha
    accepted = typical_accept(target_probs[:, :k], q_n, threshold=threshold, alpha=alpha)
    num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B]
    last, q_best = _typical_final(target_probs, num_accepted, u_final)
    divergence = _typical_divergence(q_n, q_best, num_accepted)
    exhausted = torch.zeros_like(num_accepted, dtype=torch.bool)  # tas has no budget
    return AcceptResult(_assemble(ids, num_accepted, last), num_accepted, divergence, exhausted)


def adjusted_target_mass(
    q_n: torch.Tensor,  # [B, K]
    delta: torch.Tensor,  # [B, K] float64
    rule: str,
    budget: torch.Tensor | None = None,  # [B]
) -> tuple[torch.Tensor, torch.Tensor]:  # h_n [B, K] float64, capped [B, K] bool
    """h_n for each drafted token; with a budget, delta drops to 0 from the first position
    whose cumulative d(h_n || q_n) would exceed it (`capped` marks those positions)."""
    boost = {"sps": lambda q, d: q.to(torch.float64), "cactus": cactus_boost}.get(
        rule, cactus_exact_boost
    )
    h_n = boost(q_n, delta)
    if budget is None or rule == "sps":
        return h_n, torch.zeros_like(h_n, dtype=torch.bool)
    running = binary_kl(h_n, q_n).cumsum(-1)  # [B, K]
    within = (running <= budget.to(torch.float64)[:, None]).to(torch.int64).cumprod(-1).bool()
    return boost(q_n, torch.where(within, delta, torch.zeros_like(delta))), ~within


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


def _typical_final(
    target_probs: torch.Tensor,  # [B, K + 1, V]
    num_accepted: torch.Tensor,  # [B]
    u_final: torch.Tensor,  # [B] float64
) -> tuple[torch.Tensor, torch.Tensor]:  # token [B], q of the argmax at that row [B]
    """tas: argmax q at the first rejected position, else a bonus sample from q row K."""
    k = target_probs.shape[1] - 1
    q_row = target_probs[
        torch.arange(target_probs.shape[0], device=target_probs.device), num_accepted
    ]  # [B, V]
    best, arg = q_row.max(-1)
    token = torch.where(num_accepted < k, arg, inverse_cdf_sample(q_row, u_final))
    return token, best


class _FinalRow:
    """The one [V] row each sequence samples from, computed on demand for any columns.

    Rejected at position j: the residual max(0, h - p) with h built around drafted n_j
    (h_x = q_x * s, h_{n_j} = h_n). All accepted: q at the bonus row K (s = 1, no p).
    Both cases are the same arithmetic, so delta = 0 is bit-identical to sps.
    """

    def __init__(self, target_probs, draft_probs, ids, h_n, q_n, num_accepted):
        batch, k = ids.shape
        vocab = target_probs.shape[-1]
        dtype = target_probs.dtype
        b = torch.arange(batch, device=ids.device)
        j = num_accepted.clamp(max=k - 1)
        # Flattened rows: the first rejected position (or K, the bonus row) of q, and j of p.
        self.q_rows = target_probs.reshape(-1, vocab)
        self.p_rows = draft_probs.reshape(-1, vocab)
        self.q_index = b * (k + 1) + num_accepted
        self.p_index = b * k + j
        rejected = num_accepted < k
        self.n_j = ids[b, j][:, None]  # [B, 1]
        h_j, q_j = h_n[b, j], q_n[b, j]
        q_at_n = self.q_rows[self.q_index, self.n_j[:, 0]].to(torch.float64)
        self.scale = torch.where(rejected, rest_scale(q_j, h_j), 1.0).to(dtype)[:, None]
        self.h_val = torch.where(rejected, h_j, q_at_n).to(dtype)[:, None]
        self.minus_p = rejected.to(dtype)[:, None]  # 1: subtract p (residual); 0: plain q

    def weights(
        self,
        cols: slice | torch.Tensor,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        residual: bool = True,
    ) -> torch.Tensor:
        """The row's weights at `cols`: a column slice, or per-row indices [B, C] (< V).
        `residual=False`: h itself (q at the bonus row), not max(0, h - p).

        `out`: two [B, >= C] buffers to write into. Reusing them across chunks matters on
        CPU: a fresh multi-MB tensor per chunk costs more in page faults than the maths.
        """
        if isinstance(cols, slice):
            src_q, src_p = self.q_rows[:, cols], self.p_rows[:, cols]
            width = src_q.shape[1]
            q = torch.index_select(src_q, 0, self.q_index, out=out[0][:, :width])
            p = torch.index_select(src_p, 0, self.p_index, out=out[1][:, :width])
            local = self.n_j - cols.start  # n_j's column inside this chunk
        else:
            q = self.q_rows[self.q_index[:, None], cols]
            p = self.p_rows[self.p_index[:, None], cols].to(q.dtype)
            local = (cols == self.n_j).to(torch.int64).argmax(-1, keepdim=True)
            local = torch.where((cols == self.n_j).any(-1, keepdim=True), local, -1)
        h = q.mul_(self.scale)
        # Set h at n_j where n_j falls in these columns (elsewhere write back what is there).
        inside = (local >= 0) & (local < h.shape[1])
        at = local.clamp(0, h.shape[1] - 1)
        h.scatter_(1, at, torch.where(inside, self.h_val, h.gather(1, at)))
        if not residual:
            return h
        return h.addcmul_(p, self.minus_p, value=-1.0).clamp_(min=0.0)


def _final_tokens(row: _FinalRow, u_final: torch.Tensor, vocab: int) -> torch.Tensor:
    """Sample each sequence's recovered or bonus token from its `_FinalRow`.

    The row is streamed in cache-sized column chunks and reduced to float64 block
    masses; only the one block the inverse CDF lands in is recomputed. Should the
    residual be empty (h <= p everywhere, so h == p up to rounding), h is sampled
    instead: p's rounding-sized mass outside q's support must never be emitted (spec).
    """
    block = min(SAMPLE_BLOCK, vocab)
    chunk = min(RESIDUAL_CHUNK_BLOCKS * block, vocab)
    batch = u_final.shape[0]
    buffers = (row.q_rows.new_empty(batch, chunk), row.p_rows.new_empty(batch, chunk))

    def masses(residual: bool) -> torch.Tensor:  # [B, blocks] float64
        sums = [
            block_sums(
                row.weights(slice(s, min(s + chunk, vocab)), out=buffers, residual=residual),
                block,
            )
            for s in range(0, vocab, chunk)
        ]
        return torch.cat(sums, dim=1)

    mass = masses(residual=True)
    empty = (mass.sum(-1) <= 0)[:, None]  # [B, 1]
    # Rare (rounding only): pay a second pass over the vocabulary only when it happens.
    any_empty = bool(empty.any())
    if any_empty:
        mass = torch.where(empty, masses(residual=False), mass)

    def block_weights(blk: torch.Tensor) -> torch.Tensor:
        cols = block_columns(blk, block)
        valid, cols = cols < vocab, cols.clamp(max=vocab - 1)
        w = row.weights(cols)
        if any_empty:
            w = torch.where(empty, row.weights(cols, residual=False), w)
        return torch.where(valid, w, 0.0)

    return sample_from_blocks(mass, u_final, block_weights, block=block)


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
    q_n: torch.Tensor, q_best: torch.Tensor, num_accepted: torch.Tensor
) -> torch.Tensor:
    """tas has no h: its target at an emitted position is a point mass on the emitted token
    x, whose KL to q is -ln q(x) (ours; the same d(1 || q_x) Cactus would charge)."""
    k = q_n.shape[1]
    pos = torch.arange(k, device=q_n.device)[None, :]
    accepted_cost = -torch.log(q_n.to(torch.float64))  # [B, K], used where pos < accepted
    recovered_cost = -torch.log(q_best.to(torch.float64))[:, None]  # [B, 1]
    per_position = torch.where(pos < num_accepted[:, None], accepted_cost, recovered_cost)
    return _emitted_sum(per_position, num_accepted)
