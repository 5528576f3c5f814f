"""Logits -> processed probabilities, and sampling rows with explicit randomness.

Both the draft and the verifier go through `processed_probs` with the SAME per-request
parameters (temperature, top_k, top_p), so the acceptance rules compare like with like
(../shared/spec/acceptance.md, "Sampling processing"). Order follows vLLM: temperature,
then top-k, then top-p. Probabilities are float32 even when the model runs in bf16;
uniforms are float64. A request's `logit_bias` is added to its logits before any of this,
on both models' rows, by `workers.batching.processed_rows` (every caller's way in).

Randomness is explicit: a row is sampled by inverse CDF from ONE float64 uniform, drawn
from that row's own `torch.Generator`. A seeded request therefore samples the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Rows are sampled by a two-level inverse CDF: float64 sums of fixed-size blocks, then
# a cumulative sum inside the one chosen block. One pass over [B, V], no [B, V] float64
# cumsum (V = 151936 made that the slowest step of a Cactus step on CPU).
SAMPLE_BLOCK = 1024


def _per_row(value: float | torch.Tensor, rows: int, *, dtype, device) -> torch.Tensor:
    """A scalar or [rows] tensor as a [rows] tensor."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    return t.expand(rows) if t.dim() == 0 else t


GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily


def processed_probs(
    logits: torch.Tensor,  # [B, ..., V]
    *,
    temperature: float | torch.Tensor = 1.0,  # scalar or [B]; 0 (below GREEDY_EPS) = greedy
    top_k: int | torch.Tensor = 0,  # scalar or [B]; 0 or -1 = off
    top_p: float | torch.Tensor = 1.0,  # scalar or [B]; in (0, 1]
) -> torch.Tensor:  # [B, ..., V] float32
    """Turn logits into the distribution a request samples from.

    Temperature 0 gives a one-hot row at the argmax (greedy), and so does any temperature
    below GREEDY_EPS, as in vLLM: logits / 1e-40 overflow float32. top_p keeps the smallest
    prefix of the sorted probabilities whose sum reaches top_p.
    """
    batch, vocab = logits.shape[0], logits.shape[-1]
    flat = logits.reshape(batch, -1, vocab).float()  # [B, R, V]
    dev = flat.device
    temp = _per_row(temperature, batch, dtype=torch.float32, device=dev)
    k = _per_row(top_k, batch, dtype=torch.int64, device=dev)
    p = _per_row(top_p, batch, dtype=torch.float32, device=dev)
    # Whether any row truncates is decided on the host copy of the request parameters
    # (they come from request objects), so the common no-truncation case skips the sort
    # without a device sync.
    host_k = torch.as_tensor(top_k).cpu()
    host_p = torch.as_tensor(top_p).cpu()
    host_k_on = (host_k > 0) & (host_k < vocab)
    truncate = bool((host_k_on | (host_p < 1.0)).any())
    # When every row has a top-k, only the k_max largest logits can survive: take them
    # with topk instead of sorting the whole vocabulary (3.0 ms -> 0.19 ms for
    # [1, 5, 8192] on one thread, the per-step cost of K = 4 at top_k 20).
    width = int(host_k.max()) if bool(host_k_on.all()) else vocab

    greedy = temp < GREEDY_EPS  # [B]
    safe_temp = torch.where(greedy, torch.ones_like(temp), temp)[:, None, None]
    if truncate:
        probs = _truncate(flat, safe_temp, top_k=k, top_p=p, width=width)
    else:
        probs = torch.softmax(flat / safe_temp, dim=-1)
    # Two more [B, R, V] passes only when some row is greedy (decided on the host copy).
    if bool((torch.as_tensor(temperature).cpu() < GREEDY_EPS).any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, flat.argmax(-1, keepdim=True), 1.0)
        # a row whose logits hold NaN or inf is NaN, as softmax makes it for any other
        # temperature (argmax would pick the NaN and hide it: the callers' checks of the
        # row's sum must see it)
        bad = ~torch.isfinite(flat.amax(-1, keepdim=True))  # [B, R, 1]
        one_hot = one_hot.masked_fill(bad, float("nan"))
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs.reshape(logits.shape)


def _truncate(
    logits: torch.Tensor,  # [B, R, V]
    temperature: torch.Tensor,  # [B, 1, 1], > 0
    *,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    width: int,
) -> torch.Tensor:  # [B, R, V]
    """Softmax at a temperature with top-k then top-p masking.

    Only the `width` largest logits per row are candidates (width >= every row's k).
    Dividing by a positive temperature keeps the order, so with width < V the division
    touches only the candidates, and the rest of the row is never read again."""
    vocab = logits.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)  # [B]
    if width < vocab:
        sorted_logits, order = logits.topk(width, dim=-1)  # [B, R, width], descending
        sorted_logits = sorted_logits / temperature
    else:
        scaled = logits / temperature
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, R, V]
    rank = torch.arange(width, device=logits.device)
    k_eff = torch.where(k_on, top_k, torch.full_like(top_k, vocab))
    keep = rank[None, None, :] < k_eff[:, None, None]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Keep token i if the mass strictly before it is below top_p: the smallest prefix
    # whose sum is >= top_p. The first token is always kept.
    # A row with top_p 1 keeps every token top-k kept: in float32 the mass before a
    # token of a tail below ~3e-8 rounds to 1.0, which `< 1.0` would drop.
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep_p = (
        (mass_before < top_p[:, None, None])
        | (rank[None, None, :] == 0)
        | (top_p[:, None, None] >= 1.0)
    )
    sorted_logits = sorted_logits.masked_fill(~keep_p, float("-inf"))
    if width < vocab:  # only the candidates can have mass: softmax them, scatter into zeros
        kept = torch.softmax(sorted_logits, dim=-1)  # [B, R, width]
        return torch.zeros_like(logits).scatter_(-1, order, kept)
    masked = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(masked, dim=-1)


def draw_uniforms(
    generators: Sequence[torch.Generator | None],
    columns: int,
    *,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [B, columns] float64 in [0, 1)
    """One row of float64 uniforms per request, each from that request's generator.

    A request without a generator (None) draws from torch's default generator.
    """
    rows = [
        torch.rand(columns, dtype=torch.float64, generator=g, device=_gen_device(g, device))
        for g in generators
    ]
    if not rows:
        return torch.empty(0, columns, dtype=torch.float64, device=device)
    return torch.stack(rows).to(device)


def _gen_device(generator: torch.Generator | None, default) -> torch.device | str:
    return generator.device if generator is not None else default


def inverse_cdf_sample(
    weights: torch.Tensor,  # [B, V] non-negative, rows need not be normalised
    uniforms: torch.Tensor,  # [B] float64 in [0, 1)
) -> torch.Tensor:  # [B] int64
    """Sample index x of each row with probability weights[x] / sum(weights).

    Returns the first index whose running sum exceeds u * total, so a zero-weight index
    is never returned while the row has positive mass. Accumulation is float64.
    """
    block = min(SAMPLE_BLOCK, weights.shape[1])
    return sample_from_blocks(
        block_sums(weights, block),
        uniforms,
        lambda blk: gather_block(weights, blk, block),
        block=block,
    )


def block_sums(weights: torch.Tensor, block: int) -> torch.Tensor:
    """Sums of consecutive `block`-wide column blocks: [B, C] -> [B, ceil(C / block)] float64.

    Reads the tensor once and copies nothing (splitting the last dim is a view). Each
    block is summed in the input dtype (1024 float32 terms: relative error ~1e-7, far
    below anything a sampler can see; a float64 sum would first copy the whole row to
    float64, which cost more than the rest of the Cactus step); blocks are combined in
    float64.
    """
    batch, cols = weights.shape
    full = cols // block * block
    sums = weights[:, :full].reshape(batch, -1, block).sum(-1).to(torch.float64)
    if full < cols:
        sums = torch.cat([sums, weights[:, full:].sum(-1).to(torch.float64)[:, None]], dim=1)
    return sums


def gather_block(weights: torch.Tensor, blk: torch.Tensor, block: int) -> torch.Tensor:
    """Row b's columns [blk[b] * block, (blk[b] + 1) * block), zero past the end: [B, block]."""
    cols = block_columns(blk, block)
    valid = cols < weights.shape[1]
    vals = weights.gather(1, cols.clamp(max=weights.shape[1] - 1))
    return torch.where(valid, vals, torch.zeros_like(vals))


def block_columns(blk: torch.Tensor, block: int) -> torch.Tensor:
    """Column indices of each row's chosen block: [B] -> [B, block]."""
    return blk[:, None] * block + torch.arange(block, device=blk.device)[None, :]


def sample_from_blocks(
    sums: torch.Tensor,  # [B, NB] float64 block masses
    uniforms: torch.Tensor,  # [B] float64 in [0, 1)
    block_weights: Callable[[torch.Tensor], torch.Tensor],  # blk [B] -> [B, block]
    *,
    block: int,
) -> torch.Tensor:  # [B] int64
    """Two-level inverse CDF: pick the block from its masses, then the index inside it.

    `block_weights` produces the weights of one block per row on demand, so a caller can
    stream a row it never materialises (the Cactus residual) and recompute one block.
    """
    block_cdf = sums.cumsum(-1)  # [B, NB]
    target = uniforms.to(torch.float64) * block_cdf[:, -1]  # [B]
    # First block whose cumulative mass exceeds the target (never past the last block
    # with mass, should rounding put the target at the very end).
    blk = torch.searchsorted(block_cdf, target[:, None], right=True).squeeze(-1)
    blk = torch.minimum(blk, _last_positive(sums))
    before = torch.where(blk > 0, block_cdf.gather(-1, (blk - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inner = block_weights(blk)  # [B, BLOCK]
    inner_cdf = inner.to(torch.float64).cumsum(-1) + before[:, None]
    pos = torch.searchsorted(inner_cdf, target[:, None], right=True).squeeze(-1)
    # Rounding can leave the target at/after the block's last cdf value: step back to the
    # last positive-weight index of the block so we never land on padding or a zero.
    pos = torch.minimum(pos, _last_positive(inner))
    return (blk * block + pos).to(torch.int64)


def _last_positive(rows: torch.Tensor) -> torch.Tensor:
    """Index of the last strictly positive entry of each row (0 if none). rows: [B, N]."""
    idx = torch.arange(rows.shape[-1], device=rows.device)
    return torch.where(rows > 0, idx, -1).amax(-1).clamp(min=0)


def sample(
    probs: torch.Tensor,  # [B, V]
    generators: Sequence[torch.Generator | None] | None = None,
    *,
    uniforms: torch.Tensor | None = None,  # [B] float64
) -> torch.Tensor:  # [B] int64
    """Sample one token per row, each row with its own generator (or injected uniforms)."""
    if uniforms is None:
        gens = list(generators) if generators is not None else [None] * probs.shape[0]
        uniforms = draw_uniforms(gens, 1, device=probs.device)[:, 0]
    return inverse_cdf_sample(probs, uniforms)
