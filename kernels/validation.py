"""Argument checks for `speculative_accept`: every failure is a ValueError naming the argument.

Shape, rule and scalar checks are cheap and always run. The checks that scan the
[B, K, V] probability tensors (finite, non-negative) and the token-id range run when
`validate=True` (the default); a caller that produced the tensors itself (the engine,
after its own request validation) may turn them off. Bad numbers are never repaired
silently (no nan_to_num): they are reported.
"""

from __future__ import annotations

import math

import torch

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
    for name, t in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating dtype, got {t.dtype}")
    return batch, k, vocab


def check_values(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    vocab: int,
) -> None:
    """The scans over [B, K, V]: finite, non-negative probabilities; ids in [0, V).

    One reduction pass per tensor (min and max; NaN propagates into both), and the
    elementwise checks only to word the error once something is wrong.
    """
    for name, t in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        low, high = torch.aminmax(t)
        if bool(low >= 0) and bool(high < math.inf):
            continue
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: contains NaN or inf")
        raise ValueError(f"{name}: contains negative probabilities")
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


def check_budget(budget: torch.Tensor | None, batch: int) -> None:
    if budget is None:
        return
    if not isinstance(budget, torch.Tensor) or tuple(budget.shape) != (batch,):
        raise ValueError(f"divergence_budget: expected a [{batch}] tensor")
    if bool(torch.isnan(budget).any()) or bool((budget < 0).any()):
        raise ValueError("divergence_budget: must be >= 0 (inf = no ceiling), not NaN")


def check_uniforms(uniforms: torch.Tensor | None, batch: int, k: int) -> None:
    if uniforms is None:
        return
    if tuple(uniforms.shape) != (batch, k + 1):
        raise ValueError(
            f"uniforms: expected shape [{batch}, {k + 1}] (K acceptance draws + one for the "
            f"recovered or bonus token), got {tuple(uniforms.shape)}"
        )
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
    draft_token_ids,
    draft_probs,
    target_probs,
    *,
    rule,
    delta,
    uniforms,
    tas_threshold,
    tas_alpha,
    divergence_budget,
    validate,
) -> tuple[int, int, int]:
    """Every check of the `speculative_accept` contract (torch and Triton paths alike).
    Returns (B, K, V); the [B, K, V] scans run only when `validate`."""
    check_rule(rule)
    batch, k, vocab = check_shapes(draft_token_ids, draft_probs, target_probs)
    check_delta(delta, batch)
    if rule == "tas":
        check_tas(tas_threshold, tas_alpha)
    if validate:
        check_uniforms(uniforms, batch, k)
        check_budget(divergence_budget, batch)
        check_values(draft_token_ids, draft_probs, target_probs, vocab)
    return batch, k, vocab
