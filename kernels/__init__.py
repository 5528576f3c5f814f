"""Pure tensor functions for the acceptance step (no Ray, gRPC, logging or host syncs
in the hot path). See ../shared/spec/acceptance.md for the maths."""

from kernels.rejection import (
    PLACEHOLDER_TOKEN_ID,
    RULES,
    AcceptResult,
    adjusted_target_mass,
    speculative_accept,
)
from kernels.sampling import draw_uniforms, inverse_cdf_sample, processed_probs, sample

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "RULES",
    "AcceptResult",
    "adjusted_target_mass",
    "draw_uniforms",
    "inverse_cdf_sample",
    "processed_probs",
    "sample",
    "speculative_accept",
]
