"""Pure tensor functions for the acceptance step (no Ray, gRPC or logging). Host syncs
are few and named where they happen: the torch path's check for an empty residual
(`rejection.py`, one flag per call) and the ragged entry point's read of which rows
carry a divergence budget (`ragged.py`, only when a group's rule uses one). See
../shared/spec/acceptance.md for the maths."""

from kernels.metadata import AcceptMetadata, AcceptResult, RaggedMetadata
from kernels.ragged import ragged_accept
from kernels.rejection import (
    PLACEHOLDER_TOKEN_ID,
    RULES,
    adjusted_target_mass,
    speculative_accept,
)
from kernels.sampling import draw_uniforms, inverse_cdf_sample, processed_probs, sample

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "RULES",
    "AcceptMetadata",
    "AcceptResult",
    "RaggedMetadata",
    "adjusted_target_mass",
    "draw_uniforms",
    "inverse_cdf_sample",
    "processed_probs",
    "ragged_accept",
    "sample",
    "speculative_accept",
]
