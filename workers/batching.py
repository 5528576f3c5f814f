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
    """processed_probs row by row, grouped by identical (temperature, top_k, top_p); each
    row's logit_bias is added to its logits first (an element-wise float32 add, so a
    row's numbers stay the same whatever shares its batch)."""
    logits = _biased(logits, params)
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(params):
        groups.setdefault((s.temperature, s.top_k, s.top_p), []).append(i)
    if len(groups) == 1:
        (t, k, p), _ = next(iter(groups.items()))
        return processed_probs(logits, temperature=t, top_k=k, top_p=p)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for (t, k, p), rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        out[index] = processed_probs(logits[index], temperature=t, top_k=k, top_p=p)
    return out


def _biased(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [N, V] with every row's logit_bias added, in float32 (a new tensor; no row
    with a bias: `logits` as is). A request's rows share one bias object (its params):
    each bias is turned into tensors once per call, whatever its rows. Ids outside this
    model's vocabulary are left out."""
    rows_of: dict[int, tuple[tuple, list[int]]] = {}
    for i, s in enumerate(params):
        if s.logit_bias:
            rows_of.setdefault(id(s.logit_bias), (s.logit_bias, []))[1].append(i)
    if not rows_of:
        return logits
    vocab, dev = logits.shape[-1], logits.device
    out = logits.to(torch.float32, copy=True)
    for bias, rows in rows_of.values():
        pairs = [(tok, value) for tok, value in bias if 0 <= tok < vocab]
        if pairs:
            ids = torch.tensor([tok for tok, _ in pairs], device=dev)
            values = torch.tensor([value for _, value in pairs], dtype=torch.float32, device=dev)
            index = torch.tensor(rows, device=dev)
            out[index[:, None], ids[None, :]] += values  # ids and rows distinct: no overlap
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
