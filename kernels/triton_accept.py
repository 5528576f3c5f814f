"""A Triton kernel of the `speculative_accept` contract, for CUDA tensors.

One program per sequence walks its K positions in order (acceptance needs only the
gathered q_n, p_n, float64 arithmetic), then makes two passes over ONE [V] row: the
residual max(0, h - p) of the first rejected position, or q at the bonus row. Pass one
sums it in float64, pass two finds the first index whose running sum exceeds u * total,
the same inverse CDF as `kernels.sampling.inverse_cdf_sample`. For the same uniforms it
emits the same tokens as the torch path (tested on CPU through TRITON_INTERPRET=1) but
where a uniform lands within rounding of a token's edge: it sums a row's mass in float64,
the torch path per block in float32.

Import this module only when the Triton path is wanted (`kernels.speculative_accept`
does so lazily for CUDA tensors): it imports triton, and TRITON_INTERPRET is read when
the kernels below are decorated. The `rule` codes are internal.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import validation
from kernels.metadata import AcceptMetadata, AcceptResult
from kernels.sampling import draw_uniforms

RULE_CODES = {"sps": 0, "cactus": 1, "cactus_exact": 2, "tas": 3}
BLOCK_V = 1024
EXACT_BISECTION_STEPS = 64


def speculative_accept_triton(
    draft_token_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V] float32
    target_probs: torch.Tensor,  # [B, K + 1, V] float32
    metadata: AcceptMetadata,  # metadata.backend is not read: this is the triton backend
) -> AcceptResult:
    """Same arguments and result as `kernels.speculative_accept`; float32 probabilities."""
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
    threshold = metadata.tas_threshold
    alpha = math.sqrt(threshold) if metadata.tas_alpha is None else metadata.tas_alpha
    delta = torch.as_tensor(metadata.delta, dtype=torch.float64, device=device)
    delta = delta.expand(batch).contiguous()  # [B]
    has_budget = metadata.divergence_budget is not None
    budget = metadata.divergence_budget if has_budget else delta
    budget = budget.to(device=device, dtype=torch.float64).contiguous()
    out = torch.empty(batch, k + 1, dtype=torch.int64, device=device)
    num = torch.empty(batch, dtype=torch.int64, device=device)
    div = torch.empty(batch, dtype=torch.float64, device=device)
    capped = torch.empty(batch, dtype=torch.int32, device=device)
    accept_kernel[(batch,)](
        # every pointer on the verifier's device (drafts may arrive on the CPU)
        draft_token_ids.to(device=device, dtype=torch.int64).contiguous(),
        draft_probs.to(device=device, dtype=torch.float32).contiguous(),
        target_probs.float().contiguous(),
        uniforms.to(device=device, dtype=torch.float64).contiguous(),
        delta,
        budget,
        out,
        num,
        div,
        capped,
        k,
        vocab,
        float(threshold),
        float(alpha),
        RULE=RULE_CODES[metadata.rule],
        HAS_BUDGET=has_budget,
        BLOCK=BLOCK_V,
        STEPS=EXACT_BISECTION_STEPS,
        # No FMA contraction: the same roundings as the torch path, so the same tokens.
        enable_fp_fusion=False,
    )
    return AcceptResult(out, num, div, capped.bool())


@triton.jit
def xlogy(x, y):
    return tl.where(x == 0.0, 0.0, x * tl.log(tl.where(x == 0.0, 1.0, y)))


@triton.jit
def binary_kl(a, b):
    return xlogy(a, a) - xlogy(a, b) + xlogy(1.0 - a, 1.0 - a) - xlogy(1.0 - a, 1.0 - b)


@triton.jit
def boost(q, d, RULE: tl.constexpr, STEPS: tl.constexpr):
    """h_n (float64) for rule codes 0 (sps), 1 (cactus), 2 (cactus_exact)."""
    h = q
    if RULE == 1:
        h = tl.minimum(q + tl.sqrt(2.0 * d * q * tl.maximum(1.0 - q, 0.0)), 1.0)
    if RULE == 2:
        lo = q
        hi = q * 0.0 + 1.0
        for _ in range(STEPS):
            mid = 0.5 * (lo + hi)
            ok = binary_kl(mid, q) <= d
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        whole = -tl.log(tl.where(q > 0.0, q, 1.0)) <= d
        h = tl.where(whole & (q > 0.0), 1.0, lo)
        h = tl.where((d <= 0.0) | (q <= 0.0) | (q >= 1.0), q, h)
    return h


@triton.jit
def entropy(row_ptr, V, BLOCK: tl.constexpr):
    acc = tl.zeros((), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=0.0)
        acc += tl.sum(tl.where(x > 0.0, -x * tl.log(tl.where(x > 0.0, x, 1.0)), 0.0), 0)
    return acc


@triton.jit
def final_weights(q_ptr, p_ptr, offs, V, n_j, h_j, scale, residual_mode):
    """Weights of the one sampled row: q (bonus) or the residual max(0, h - p)."""
    q = tl.load(q_ptr + offs, mask=offs < V, other=0.0)
    p = tl.load(p_ptr + offs, mask=offs < V, other=0.0)
    h = tl.where(offs == n_j, h_j, q * scale)
    res = tl.maximum(h - p, 0.0)
    # residual_mode: 0 = bonus (q), 1 = residual, 2 = empty residual (h == p up to
    # rounding): h, which keeps to q's support where p's rounding mass may not.
    w = tl.where(residual_mode == 1, res, tl.where(residual_mode == 2, h, q))
    return tl.where(offs < V, w, 0.0)


@triton.jit
def accept_kernel(
    ids_ptr,
    draft_ptr,
    target_ptr,
    uni_ptr,
    delta_ptr,
    budget_ptr,
    out_ptr,
    num_ptr,
    div_ptr,
    capped_ptr,
    K,
    V,
    tas_threshold,
    tas_alpha,
    RULE: tl.constexpr,
    HAS_BUDGET: tl.constexpr,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    delta = tl.load(delta_ptr + b)
    budget = tl.load(budget_ptr + b)
    running = tl.zeros((), dtype=tl.float64)
    div = tl.zeros((), dtype=tl.float64)
    within = tl.full((), 1, tl.int32)
    capped = tl.zeros((), dtype=tl.int32)  # a reached position lost its delta to the budget
    alive = tl.full((), 1, tl.int32)
    num = tl.zeros((), dtype=tl.int64)
    n_j = tl.zeros((), dtype=tl.int64)
    h_j = tl.zeros((), dtype=tl.float64)
    q_j = tl.zeros((), dtype=tl.float64)
    for i in range(K):
        n = tl.load(ids_ptr + b * K + i)
        # at most 1, as the torch path clamps them
        q_n = tl.minimum(tl.load(target_ptr + (b * (K + 1) + i) * V + n).to(tl.float64), 1.0)
        p_n = tl.minimum(tl.load(draft_ptr + (b * K + i) * V + n).to(tl.float64), 1.0)
        u = tl.load(uni_ptr + b * (K + 1) + i)
        if RULE == 3:
            ent = entropy(target_ptr + (b * (K + 1) + i) * V, V, BLOCK)
            cutoff = tl.minimum(tas_alpha * tl.exp(-ent), tas_threshold)
            acc = (q_n > cutoff.to(tl.float64)).to(tl.int32)
            h = q_n
            cost = -tl.log(tl.where(q_n > 0.0, q_n, 1.0))
        else:
            h = boost(q_n, delta, RULE, STEPS)
            if HAS_BUDGET:
                running += tl.where(within == 1, binary_kl(h, q_n), 0.0)
                within = within & (running <= budget).to(tl.int32)
                h = tl.where(within == 1, h, q_n)
                capped = capped | (alive & (1 - within))
            acc = ((p_n > 0.0) & (u * p_n < h)).to(tl.int32)
            cost = binary_kl(h, q_n)
        first_reject = (alive == 1) & (acc == 0)
        n_j = tl.where(first_reject, n, n_j)
        h_j = tl.where(first_reject, h, h_j)
        q_j = tl.where(first_reject, q_n, q_j)
        if RULE == 3:  # the recovered token's cost is added with the final row
            div += tl.where((alive == 1) & (acc == 1), cost, 0.0)
        else:
            div += tl.where(alive == 1, cost, 0.0)
        num += ((alive == 1) & (acc == 1)).to(tl.int64)
        alive = alive & acc

    rejected = num < K
    q_ptr = target_ptr + (b * (K + 1) + num) * V
    p_ptr = draft_ptr + (b * K + tl.minimum(num, K - 1)) * V
    u_last = tl.load(uni_ptr + b * (K + 1) + K)
    scale = tl.where(q_j < 1.0, (1.0 - h_j) / tl.maximum(1.0 - q_j, 1e-300), 1.0)
    scale32 = scale.to(tl.float32)
    h32 = h_j.to(tl.float32)
    mode = tl.where(rejected & (RULE != 3), 1, 0)
    # Pass 1: total mass (and, for tas, the argmax of q at the rejected row).
    total = tl.zeros((), dtype=tl.float64)
    best = tl.full((), -1.0, tl.float32)
    best_idx = tl.zeros((), dtype=tl.int64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        w = final_weights(q_ptr, p_ptr, offs, V, n_j, h32, scale32, mode)
        total += tl.sum(w.to(tl.float64), 0)
        qv = tl.load(q_ptr + offs, mask=offs < V, other=-1.0)
        blk_max = tl.max(qv, 0)
        blk_arg = tl.min(tl.where(qv == blk_max, offs, V), 0).to(tl.int64)
        take = blk_max > best
        best_idx = tl.where(take, blk_arg, best_idx)
        best = tl.where(take, blk_max, best)
    mode = tl.where((mode == 1) & (total <= 0.0), 2, mode)
    if RULE != 3:  # max(0, h - p) was all zero: h == p up to rounding, sample h
        total = tl.where(mode == 2, 0.0, total)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            w = final_weights(q_ptr, p_ptr, offs, V, n_j, h32, scale32, mode)
            total += tl.where(mode == 2, tl.sum(w.to(tl.float64), 0), 0.0)
    # Pass 2: the first index whose running sum exceeds u * total.
    target = u_last * total
    carry = tl.zeros((), dtype=tl.float64)
    found = tl.full((), -1, tl.int64)
    last_pos = tl.zeros((), dtype=tl.int64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        w = final_weights(q_ptr, p_ptr, offs, V, n_j, h32, scale32, mode).to(tl.float64)
        cs = tl.cumsum(w, 0) + carry
        hit = tl.min(tl.where((cs > target) & (offs < V), offs, V), 0).to(tl.int64)
        found = tl.where((found < 0) & (hit < V), hit, found)
        last_pos = tl.maximum(last_pos, tl.max(tl.where(w > 0.0, offs, 0), 0).to(tl.int64))
        carry += tl.sum(w, 0)
    token = tl.where(found < 0, last_pos, tl.minimum(found, last_pos))
    if RULE == 3:
        token = tl.where(rejected, best_idx, token)
        div += tl.where(rejected, -tl.log(best.to(tl.float64)), 0.0)
    for i in range(K + 1):
        drafted = tl.load(ids_ptr + b * K + tl.minimum(i, K - 1))
        val = tl.where(i < num, drafted, tl.where(i == num, token, -1))
        tl.store(out_ptr + b * (K + 1) + i, val)
    tl.store(num_ptr + b, num)
    tl.store(div_ptr + b, div)
    tl.store(capped_ptr + b, capped)
