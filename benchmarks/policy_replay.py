"""How close can a per-row speculation policy get to the best fixed K on this model pair?
A counterfactual replay that separates the goodput policy's acceptance model from the
served benchmark's noise (issue 13).

    python -m benchmarks.policy_replay [--batches 40] [--max-tokens 64]

1. Traces: the in-process engine (policy fixed, every row drafting K = 8) runs batches
   of 8 requests of `make bench-policy`'s workload (prompt "def parse(text):", T 0.6 /
   top_k 20 / top_p 0.95, 64 tokens, one seed per request), for sps and cactus delta 1;
   every step's accepted count per row is recorded.
2. Replay. Acceptance is sequential, so a step that drafted 8 and accepted a would have
   emitted min(a, k) + 1 tokens had it drafted k <= 8 (the same uniforms decide the same
   first k positions). Each policy is charged a one-row step time T(k) = 1 + r k (in
   units of a plain decoding step; r = a drafted token's cost relative to it: about 0.27
   served at 1 client, 0.5 at 16, from the fixed-K columns of run 18), and its goodput
   is emitted tokens / sum of T over the same steps:
   - every fixed K in 0..8;
   - `policy`: workers.policy.AcceptanceModel as the engine uses it (the group's average
     warmed on a quarter of the requests, then each request's own counts), k = argmax
     E(k) / T(k) per step, fed back the counts it would have seen;
   - `state oracle`: the best k for each of three states (a request's first step, after
     a fully accepted step, after a rejection), chosen on the same traces (in-sample: an
     upper bound for a policy that conditions on them).
   Ratios are to the best fixed K at that r. The replay leaves out what the served
   benchmark adds: the cost model's fit, exploration, dense steps (a row pays for the
   batch's largest k) and the machine's noise.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

GROUPS = (("sps", 0.0, "sps"), ("cactus", 1.0, "cactus:1"))
K_MAX = 8
RATIOS = (0.1, 0.27, 0.5)


def collect(batches: int, max_tokens: int, rows: int = 8) -> dict[str, list[list[int]]]:
    """group -> per request, the accepted counts of its steps that drafted K_MAX."""
    from cactus.environment import DEFAULT_DRAFT, DEFAULT_VERIFIER
    from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
    from workers.local import local_engine
    from workers.scheduler import SchedulerConfig

    engine = local_engine(
        str(DEFAULT_VERIFIER), str(DEFAULT_DRAFT), scheduler=SchedulerConfig(policy="fixed")
    )
    seen: dict[tuple[str, str], list[int]] = defaultdict(list)
    observe = engine.policy.observe_rows

    def record(prows, ks, accepted, expected):  # what each step's acceptance gave
        for r, k, a in zip(prows, ks, accepted, strict=True):
            if k == K_MAX:
                seen[r.group, r.request_id].append(int(a))
        return observe(prows, ks, accepted, expected)

    engine.policy.observe_rows = record
    n = 0
    for _ in range(batches):
        for rule, delta, _group in GROUPS:
            for _ in range(rows):
                n += 1
                request = GenerationRequest(
                    prompt="def parse(text):",
                    request_id=f"{rule}-{n}",
                    sampling=SamplingParams(
                        max_tokens=max_tokens, temperature=0.6, top_k=20, top_p=0.95, seed=n
                    ),
                    speculation=SpeculationParams(
                        rule=rule, delta=delta, num_speculative_tokens=K_MAX
                    ),
                )
                engine.add_request(request, lambda _item: None)
            while engine.has_work():
                engine.step()
    out: dict[str, list[list[int]]] = {group: [] for *_, group in GROUPS}
    for (group, _rid), counts in seen.items():
        out[group].append(counts)
    return out


def _cost(k: int, r: float) -> float:
    return 1.0 + r * k


def replay(traces: list[list[int]], group: str, r: float) -> dict[str, float]:
    """Goodput of each policy over the traces, as a ratio to the best fixed K."""
    from workers.policy import AcceptanceModel, PolicyConfig, expected_tokens

    steps = [a for counts in traces for a in counts]
    rates = {
        f"K={k}": sum(min(a, k) + 1 for a in steps) / (len(steps) * _cost(k, r))
        for k in range(K_MAX + 1)
    }
    model = AcceptanceModel(PolicyConfig())
    warm = traces[: max(1, len(traces) // 4)]
    for i, counts in enumerate(warm):
        for a in counts:
            model.observe(f"warm-{i}", group, K_MAX, a)
        model.forget(f"warm-{i}")
    tokens = time_ = 0.0
    for i, counts in enumerate(traces):
        for a in counts:
            gain = expected_tokens(model.alphas(f"r{i}", group, K_MAX))
            k = int(np.argmax([gain[j] / _cost(j, r) for j in range(K_MAX + 1)]))
            tokens += min(a, k) + 1
            time_ += _cost(k, r)
            model.observe(f"r{i}", group, k, min(a, k))
        model.forget(f"r{i}")
    rates["policy"] = tokens / time_
    states: dict[str, list[int]] = defaultdict(list)
    for counts in traces:
        for t, a in enumerate(counts):
            states["first" if t == 0 else "full" if counts[t - 1] == K_MAX else "rejected"].append(
                a
            )
    tokens = time_ = 0.0
    for accepted in states.values():
        arr = np.array(accepted)
        k = int(
            np.argmax([(np.minimum(arr, j).mean() + 1) / _cost(j, r) for j in range(K_MAX + 1)])
        )
        tokens += float((np.minimum(arr, k) + 1).sum())
        time_ += _cost(k, r) * len(arr)
    rates["state oracle"] = tokens / time_
    best = max(v for name, v in rates.items() if name.startswith("K="))
    return {name: v / best for name, v in rates.items()}


def report(traces: dict[str, list[list[int]]], ratios=RATIOS) -> list[str]:
    names = [f"K={k}" for k in range(K_MAX + 1)] + ["policy", "state oracle"]
    lines = [
        "| group | r | steps | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for *_, group in GROUPS:
        steps = sum(len(c) for c in traces[group])
        for r in ratios:
            got = replay(traces[group], group, r)
            lines.append(
                f"| {group} | {r:g} | {steps} | "
                + " | ".join(f"{got[n]:.3f}" for n in names)
                + " |"
            )
    for *_, group in GROUPS:
        first = [c[0] for c in traces[group] if c]
        later = [a for c in traces[group] for a in c[1:]]
        lines.append(
            f"# {group}: mean accepted of 8, first step {np.mean(first):.2f}, "
            f"later steps {np.mean(later):.2f}; requests {len(traces[group])}"
        )
    return lines


def main(argv=None) -> None:
    from cactus import environment

    environment.apply()
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.monotonic()
    traces = collect(args.batches, args.max_tokens)
    print(
        f"# counterfactual replay, in-process engine, K = {K_MAX} traces, "
        f"{args.batches} batches of 8 per group; goodput / best fixed K at step cost 1 + r k"
    )
    for line in report(traces):
        print(line)
    print(f"# {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
