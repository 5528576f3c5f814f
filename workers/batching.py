"""Small helpers shared by the batched engine and the batched drafter: per-row sampling
processing and per-row uniforms, arranged so a row's numbers do not depend on its batch.

`processed_probs` takes per-row parameters, but it picks its code path (top-k by
`topk` when every row has one, else a full sort) from the whole batch, which can move
the last bits of a row. Rows are therefore processed in groups of identical parameters,
each group on the same path a solo request takes: a row's probabilities are
bit-identical whatever shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cactus.params import SamplingParams
from kernels import processed_probs


def processed_rows(
    logits: torch.Tensor,  # [N, V]
    params: Sequence[SamplingParams],  # [N]
) -> torch.Tensor:  # [N, V] float32
    """processed_probs row by row, grouped by identical (temperature, top_k, top_p,
    logit_bias); a row's logit_bias is added to its logits first (ids past this model's
    vocabulary are left out: a draft's may be smaller than the verifier's)."""
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(params):
        groups.setdefault((s.temperature, s.top_k, s.top_p, s.logit_bias), []).append(i)
    if len(groups) == 1:
        (t, k, p, bias), _ = next(iter(groups.items()))
        return processed_probs(_biased(logits, bias), temperature=t, top_k=k, top_p=p)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for (t, k, p, bias), rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        out[index] = processed_probs(_biased(logits[index], bias), temperature=t, top_k=k, top_p=p)
    return out


def _biased(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """logits [N, V] + the bias on its tokens, in float32 (a new tensor; none: as is)."""
    vocab = logits.shape[-1]
    pairs = [(tok, value) for tok, value in bias if tok < vocab]
    if not pairs:
        return logits
    ids = torch.tensor([tok for tok, _ in pairs], device=logits.device)
    values = torch.tensor([value for _, value in pairs], dtype=torch.float32, device=logits.device)
    out = logits.float().clone()
    out[:, ids] += values
    return out


def padded_uniforms(
    generators: Sequence[torch.Generator], counts: Sequence[int], *, device="cpu"
) -> torch.Tensor:  # [B, max(counts)] float64, zero past each row's count
    """Row i: counts[i] float64 uniforms from generators[i] (what a solo step draws)."""
    width = max(counts, default=0)
    out = torch.zeros(len(counts), width, dtype=torch.float64)
    for i, (gen, n) in enumerate(zip(generators, counts, strict=True)):
        if n:
            out[i, :n] = torch.rand(n, dtype=torch.float64, generator=gen)
    return out.to(device)
