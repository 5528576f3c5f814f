"""What crosses the acceptance kernels' boundary: the per-call metadata and the result.

Shaped after vLLM's SpecDecodeMetadata / SamplingMetadata: the tensors a step verifies
are positional arguments, everything that says HOW to verify them travels in one frozen
object. Both backends (kernels.rejection, kernels.triton_accept) and the ragged entry
point (kernels.ragged) import from here; this module imports nothing from kernels, so
there is no cycle.

Glossary: ../shared/spec/acceptance.md. B: sequences, K: drafted tokens per sequence,
V: vocabulary size.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AcceptResult:
    output_token_ids: torch.Tensor  # [B, K + 1] int64, PLACEHOLDER_TOKEN_ID after the end
    num_accepted: torch.Tensor  # [B] int64, accepted drafted tokens (bonus not counted)
    divergence_nats: torch.Tensor  # [B] float64, sum of d(h_n || q_n) over emitted positions
    # [B] bool: a position this call reached (i <= num_accepted, i < K) had its delta
    # dropped to 0 by the divergence budget. The budget is then spent for good: the caller
    # verifies that sequence with delta = 0 from now on (acceptance.md, "once a request's
    # running sum would exceed it, that request's remaining positions use delta = 0").
    budget_exhausted: torch.Tensor


# eq=False: fields are tensors, whose == is elementwise; identity equality is what is meant.
@dataclass(frozen=True, eq=False)
class AcceptMetadata:
    """How `speculative_accept` verifies one [B, K] batch (one rule for every row)."""

    rule: str  # sps / cactus / cactus_exact / tas
    delta: float | torch.Tensor = 0.0  # nats; float, or [B] float64 per sequence
    uniforms: torch.Tensor | None = None  # [B, K + 1] float64 in [0, 1); None: drawn
    generator: torch.Generator | None = None  # draws the uniforms when they are None
    tas_threshold: float = 0.09  # tas epsilon (posterior_threshold)
    tas_alpha: float | None = None  # tas alpha; None = sqrt(tas_threshold), the paper's code
    divergence_budget: torch.Tensor | None = None  # [B] float64 nats left; inf = no ceiling
    validate: bool = True  # run the [B, K, V] value scans (shape checks always run)
    backend: str = "auto"  # "torch", "triton", or "auto" (triton for CUDA float32)


@dataclass(frozen=True, eq=False)
class RaggedMetadata:
    """How `ragged_accept` verifies a continuous batch whose rows draft different K_i.

    Drafts travel flattened row-major with per-row counts, as in vLLM V1. Row i owns
    draft rows [cu_i, cu_i + K_i) and target rows [cu_i + i, cu_i + i + K_i], the last of
    which is its bonus position (cu = cu_num_draft_tokens).
    """

    num_draft_tokens: tuple[int, ...]  # [B] K_i >= 0; K_i = 0: plain decoding row
    rules: tuple[str, ...]  # [B] sps / cactus / cactus_exact / tas (ignored for K_i = 0)
    delta: torch.Tensor  # [B] float64 nats (used by cactus / cactus_exact rows)
    tas_threshold: tuple[float, ...]  # [B] (used by tas rows)
    divergence_budget: torch.Tensor  # [B] float64 nats left; +inf = no ceiling
    uniforms: torch.Tensor  # [B, max_i K_i + 1] float64; row i uses its first K_i + 1
    # tas alpha: one for every tas row, or [B] per row; None = sqrt(that row's threshold)
    tas_alpha: float | tuple[float | None, ...] | None = None

    def alpha(self, i: int) -> float | None:
        """Row i's tas alpha (None: sqrt of its threshold)."""
        return self.tas_alpha[i] if isinstance(self.tas_alpha, tuple) else self.tas_alpha

    @property
    def cu_num_draft_tokens(self) -> torch.Tensor:  # [B + 1] int64, on the host
        """Exclusive prefix sums of num_draft_tokens (vLLM's name): row i's drafts start
        at cu[i] of the flattened draft tensors."""
        return torch.tensor((0, *itertools.accumulate(self.num_draft_tokens)), dtype=torch.int64)
