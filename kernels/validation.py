"""Argument checks for `speculative_accept` and `ragged_accept`: every failure is a
ValueError naming the argument.

Shape, rule and scalar checks are cheap and always run. The checks that scan the
[B, K, V] probability tensors (finite, non-negative) and the token-id range run when
`validate=True` (the default); a caller that produced the tensors itself (the engine,
after its own request validation) may turn them off. Bad numbers are never repaired
silently (no nan_to_num): they are reported.
"""

from __future__ import annotations

import math

import torch

from kernels.metadata import AcceptMetadata, RaggedMetadata

RULES = ("sps", "cactus", "cactus_exact", "tas")


def check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"rule: unknown acceptance rule {rule!r}; expected one of {RULES}")


def check_shapes(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
) -> tuple[int, int, int]:
    """Returns (B, K, V) after checking the vLLM tensor contract."""
    if draft_token_ids.dim() != 2:
        raise ValueError(
            f"draft_token_ids: expected shape [B, K], got {tuple(draft_token_ids.shape)}"
        )
    batch, k = draft_token_ids.shape
    if k < 1:
        raise ValueError("draft_token_ids: K (num_speculative_tokens) must be >= 1, got 0")
    if draft_token_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_token_ids: expected int64 or int32, got {draft_token_ids.dtype}")
    if draft_probs.dim() != 3 or tuple(draft_probs.shape[:2]) != (batch, k):
        raise ValueError(
            f"draft_probs: expected shape [{batch}, {k}, V], got {tuple(draft_probs.shape)}"
        )
    vocab = draft_probs.shape[2]
    if vocab < 1:
        raise ValueError("draft_probs: vocabulary size V must be >= 1")
    if tuple(target_probs.shape) != (batch, k + 1, vocab):
        raise ValueError(
            f"target_probs: expected shape [{batch}, {k + 1}, {vocab}] (K + 1 rows, the last "
            f"is the bonus position), got {tuple(target_probs.shape)}"
        )
    _check_floating(draft_probs, target_probs)
    return batch, k, vocab


def check_values(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    vocab: int,
) -> None:
    """The scans over [B, K, V]: finite, non-negative probabilities, every target row
    with mass; ids in [0, V).

    One reduction pass per tensor (min and max; NaN propagates into both) and one over
    the target rows' sums, and the elementwise checks only to word the error once
    something is wrong.
    """
    for name, t in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if t.numel() == 0:
            continue
        low, high = torch.aminmax(t)
        if bool(low >= 0) and bool(high < math.inf):
            continue
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: contains NaN or inf")
        raise ValueError(f"{name}: contains negative probabilities")
    if target_probs.numel() and not bool(target_probs.sum(-1).amin() > 0):
        # every rule samples from q (or its residual, whose fallback is q): a row with no
        # mass would emit token 0, which q gives probability 0
        raise ValueError("target_probs: a row has no probability mass (all zeros)")
    if draft_token_ids.numel() and not bool(
        ((draft_token_ids >= 0) & (draft_token_ids < vocab)).all()
    ):
        raise ValueError(f"draft_token_ids: token ids must lie in [0, {vocab})")


def check_delta(delta: float | torch.Tensor, batch: int) -> None:
    if isinstance(delta, torch.Tensor):
        if delta.dim() > 1 or (delta.dim() == 1 and delta.shape[0] != batch):
            raise ValueError(
                f"delta: expected a float or a [{batch}] tensor, got {tuple(delta.shape)}"
            )
        if not bool(torch.isfinite(delta).all()) or bool((delta < 0).any()):
            raise ValueError("delta: must be finite and >= 0")
    elif not isinstance(delta, (int, float)) or not math.isfinite(delta) or delta < 0:
        raise ValueError(f"delta: must be a finite number >= 0, got {delta!r}")


def check_budget(budget: torch.Tensor | None, batch: int, *, values: bool = True) -> None:
    """The shape always (a wrong one broadcasts in torch and reads past the end in
    Triton); the values (a device sync) only when `values`."""
    if budget is None:
        return
    if not isinstance(budget, torch.Tensor) or tuple(budget.shape) != (batch,):
        raise ValueError(f"divergence_budget: expected a [{batch}] tensor")
    if not values:
        return
    if bool(torch.isnan(budget).any()) or bool((budget < 0).any()):
        raise ValueError("divergence_budget: must be >= 0 (inf = no ceiling), not NaN")


def check_uniforms(
    uniforms: torch.Tensor | None, batch: int, k: int, *, values: bool = True
) -> None:
    """The shape always (Triton would read a missing column past the end); the values
    only when `values`."""
    if uniforms is None:
        return
    if not isinstance(uniforms, torch.Tensor) or tuple(uniforms.shape) != (batch, k + 1):
        raise ValueError(
            f"uniforms: expected shape [{batch}, {k + 1}] (K acceptance draws + one for the "
            f"recovered or bonus token), got {tuple(getattr(uniforms, 'shape', ()))}"
        )
    if not values:
        return
    if not bool(((uniforms >= 0) & (uniforms < 1)).all()):
        raise ValueError("uniforms: values must lie in [0, 1)")


def check_tas(threshold: float, alpha: float | None) -> None:
    if not isinstance(threshold, (int, float)) or not (0 < threshold <= 1):
        raise ValueError(f"tas_threshold: must lie in (0, 1], got {threshold!r}")
    if alpha is not None and (
        not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0
    ):
        raise ValueError(f"tas_alpha: must be a finite number >= 0, got {alpha!r}")


def check_arguments(
    draft_token_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K + 1, V]
    metadata: AcceptMetadata,
) -> tuple[int, int, int]:
    """Every check of the `speculative_accept` contract (torch and Triton paths alike).
    Returns (B, K, V); the [B, K, V] scans run only when `metadata.validate`."""
    check_rule(metadata.rule)
    batch, k, vocab = check_shapes(draft_token_ids, draft_probs, target_probs)
    check_delta(metadata.delta, batch)
    if metadata.rule == "tas":
        check_tas(metadata.tas_threshold, metadata.tas_alpha)
    # shapes always (the docstring of AcceptMetadata.validate), values when asked
    check_uniforms(metadata.uniforms, batch, k, values=metadata.validate)
    check_budget(metadata.divergence_budget, batch, values=metadata.validate)
    if metadata.validate:
        check_values(draft_token_ids, draft_probs, target_probs, vocab)
    return batch, k, vocab


def check_ragged(
    draft_token_ids: torch.Tensor,  # [sum K_i]
    draft_probs: torch.Tensor,  # [sum K_i, V]
    target_probs: torch.Tensor,  # [sum (K_i + 1), V]
    metadata: RaggedMetadata,
    *,
    validate: bool,
) -> int:
    """The `ragged_accept` contract; returns V. Per-group rule arguments (tas_threshold,
    tas_alpha) are checked again by the `speculative_accept` call of each group."""
    counts = metadata.num_draft_tokens
    batch = len(counts)
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in counts):
        raise ValueError(f"num_draft_tokens: expected ints >= 0, got {counts!r}")
    for name in ("rules", "tas_threshold"):
        if len(getattr(metadata, name)) != batch:
            raise ValueError(
                f"{name}: expected {batch} entries (one per row of num_draft_tokens), "
                f"got {len(getattr(metadata, name))}"
            )
    if isinstance(metadata.tas_alpha, tuple) and len(metadata.tas_alpha) != batch:
        raise ValueError(
            f"tas_alpha: expected one value or {batch} entries (one per row), "
            f"got {len(metadata.tas_alpha)}"
        )
    for i, (k, rule) in enumerate(zip(counts, metadata.rules, strict=True)):
        if k > 0 and rule not in RULES:
            raise ValueError(f"rules: unknown acceptance rule {rule!r} at row {i}; {RULES}")
    vocab = _check_flat_shapes(draft_token_ids, draft_probs, target_probs, counts)
    _check_row_tensors(metadata, batch, max(counts, default=0) + 1, validate=validate)
    if validate:
        check_values(draft_token_ids, draft_probs, target_probs, vocab)
    return vocab


def _check_flat_shapes(draft_token_ids, draft_probs, target_probs, counts) -> int:
    """Flattened tensors against sum K_i and B; returns V."""
    total, batch = sum(counts), len(counts)
    if draft_token_ids.dim() != 1 or draft_token_ids.shape[0] != total:
        raise ValueError(
            f"draft_token_ids: expected shape [{total}] (sum of num_draft_tokens), "
            f"got {tuple(draft_token_ids.shape)}"
        )
    if draft_token_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_token_ids: expected int64 or int32, got {draft_token_ids.dtype}")
    if draft_probs.dim() != 2 or draft_probs.shape[0] != total or draft_probs.shape[1] < 1:
        raise ValueError(
            f"draft_probs: expected shape [{total}, V] (sum of num_draft_tokens), "
            f"got {tuple(draft_probs.shape)}"
        )
    vocab = draft_probs.shape[1]
    if tuple(target_probs.shape) != (total + batch, vocab):
        raise ValueError(
            f"target_probs: expected shape [{total + batch}, {vocab}] (sum of "
            f"num_draft_tokens + 1 per row), got {tuple(target_probs.shape)}"
        )
    _check_floating(draft_probs, target_probs)
    return vocab


def _check_row_tensors(metadata: RaggedMetadata, batch: int, width: int, *, validate) -> None:
    """delta, divergence_budget [B]; uniforms [B, >= max K_i + 1]."""
    for name in ("delta", "divergence_budget"):
        t = getattr(metadata, name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (batch,):
            raise ValueError(f"{name}: expected a [{batch}] float64 tensor")
    check_delta(metadata.delta, batch)
    uniforms = metadata.uniforms
    if not isinstance(uniforms, torch.Tensor) or uniforms.dim() != 2:
        raise ValueError(f"uniforms: expected a [{batch}, {width}] float64 tensor")
    if uniforms.shape[0] != batch or uniforms.shape[1] < width:
        raise ValueError(
            f"uniforms: expected shape [{batch}, >= {width}] (max K_i + 1 columns), "
            f"got {tuple(uniforms.shape)}"
        )
    if validate:
        check_budget(metadata.divergence_budget, batch)
        # Only row i's first K_i + 1 draws are read; the padding after them may be anything.
        counts = torch.tensor(metadata.num_draft_tokens, dtype=torch.int64, device=uniforms.device)
        used = torch.arange(width, device=uniforms.device)[None, :] <= counts[:, None]
        inside = (uniforms[:, :width] >= 0) & (uniforms[:, :width] < 1)
        if not bool((inside | ~used).all()):
            raise ValueError("uniforms: values must lie in [0, 1)")


def _check_floating(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> None:
    """float32 (or float64) probabilities, as acceptance.md asks even of a bf16 model: a
    bfloat16 row's block sums round to 8 bits, and a token of mass 2^-9 beside two of
    0.5 was never sampled."""
    for name, t in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if t.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{name}: expected float32 probabilities, got {t.dtype}")
