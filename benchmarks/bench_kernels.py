"""Acceptance-kernel benchmark: the fast path vs a reference that materialises h.

`make bench-kernels` (or `python -m benchmarks.bench_kernels [--quick]`). Prints a
table; nothing here is asserted. For every (B, K, V), float32 on CPU, measured
alternately in one run (this machine is shared and noisy, so only ratios taken side by
side mean anything):

    reference   the way the paper's PyTorch code works: h, max(0, h - p) and an
                exponential-race sample for every one of the B x K rows ([B, K, V] each)
    fast        kernels.speculative_accept(rule="cactus", validate=False): gathered [B, K]
                values, one streamed [V] row per sequence
    fast+val    the same with validate=True (scans [B, K, V] for NaN/inf/negatives)
    yardstick   one torch.sum over a [B, V] slice: what reading one row per sequence costs

Between measurements a 400 MB buffer is summed, so every candidate starts with cold
caches, as it would after a model forward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels import speculative_accept
from kernels.divergence import cactus_boost, rest_scale

FULL_GRID = [(b, k, v) for v in (8192, 32000, 151936) for k in (4, 10) for b in (1, 8, 32)]
QUICK_GRID = [(1, 4, 8192), (8, 4, 32000), (32, 10, 32000)]


def paper_style_reference(ids, draft_probs, target_probs, delta, generator):
    """Cactus as a dense PyTorch rejection sampler: everything materialised per row."""
    batch, k, _vocab = draft_probs.shape
    q = target_probs[:, :k]
    q_n = q.gather(-1, ids[..., None])  # [B, K, 1]
    p_n = draft_probs.gather(-1, ids[..., None])
    h_n = cactus_boost(q_n, torch.full_like(q_n, delta, dtype=torch.float64))
    h = (q * rest_scale(q_n, h_n).float()).scatter(-1, ids[..., None], h_n.float())  # [B, K, V]
    u = torch.rand(batch, k, 1, dtype=torch.float64, generator=generator)
    accepted = (u * p_n < h_n)[..., 0]
    residual = torch.clamp(h - draft_probs, min=0)
    residual = residual / residual.sum(-1, keepdim=True)
    race = torch.empty_like(residual).exponential_(generator=generator)
    recovered = (residual / race).argmax(-1)  # [B, K]
    bonus_race = torch.empty_like(target_probs[:, k]).exponential_(generator=generator)
    bonus = (target_probs[:, k] / bonus_race).argmax(-1)
    num = accepted.long().cumprod(-1).sum(-1)
    return recovered, bonus, num


def _inputs(batch, k, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    draft = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 2, -1)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * 2, -1)
    target[:, :k] = 0.5 * target[:, :k] + 0.5 * draft
    ids = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    return ids, draft, target, gen


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def measure(batch, k, vocab, *, reps, evict) -> dict[str, float]:
    ids, draft, target, gen = _inputs(batch, k, vocab)
    delta = 1.0
    candidates = {
        "reference": lambda: paper_style_reference(ids, draft, target, delta, gen),
        "fast": lambda: speculative_accept(
            ids, draft, target, rule="cactus", delta=delta, generator=gen, validate=False
        ),
        "fast+val": lambda: speculative_accept(
            ids, draft, target, rule="cactus", delta=delta, generator=gen, validate=True
        ),
        "yardstick": lambda: target[:, 0].sum(-1),
    }
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():  # warm-up
        fn()
    for _ in range(reps):
        for name, fn in candidates.items():
            evict.sum()
            times[name].append(_timed(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three small shapes only")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--reps", type=int, default=0, help="repetitions (0 = by size)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    grid = QUICK_GRID if args.quick else FULL_GRID
    evict = torch.ones(100_000_000 // (4 if args.quick else 1))
    print(
        f"# acceptance kernels, rule=cactus delta=1, float32, CPU, {args.threads} thread(s), "
        "median microseconds"
    )
    header = ("B", "K", "V", "reference", "fast", "fast+val", "yardstick", "ref/fast", "fast/yard")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for batch, k, vocab in grid:
        size = batch * k * vocab
        reps = args.reps or (5 if size > 20_000_000 else 9 if size > 2_000_000 else 21)
        t = measure(batch, k, vocab, reps=reps, evict=evict)
        row = (
            batch,
            k,
            vocab,
            f"{t['reference']:.0f}",
            f"{t['fast']:.0f}",
            f"{t['fast+val']:.0f}",
            f"{t['yardstick']:.0f}",
            f"{t['reference'] / t['fast']:.1f}x",
            f"{t['fast'] / t['yardstick']:.1f}x",
        )
        print("| " + " | ".join(str(c) for c in row) + " |", flush=True)


if __name__ == "__main__":
    main()
