"""Acceptance of each rule through the real engine on held-out prompts.

`python -m benchmarks.bench_acceptance [--rules sps,cactus:1] [--prompts 32] [--tokens 64]`

The prompts are the model card's: 32 windows of 64 tokens at evenly spaced offsets of
the held-out token stream (models/measure.py). Sampling: temperature 0.6, top_k 20,
top_p 0.95, K = 4, fixed seeds. Printed per rule:
    acceptance_rate     accepted / drafted tokens (vLLM's definition)
    alpha (pos 0)       accepted at the first drafted position / steps: the per-token
                        acceptance probability the model card's alpha estimates
    mean acc. length    1 + accepted / steps (vLLM's definition)
    nats/token          divergence_nats per generated token
"""

from __future__ import annotations

import argparse
import time

import torch

from cactus.params import GenerationRequest, SamplingParams, SpeculationParams


def run(rules, n_prompts: int, tokens: int) -> None:
    from cactus.environment import DEFAULT_DRAFT, DEFAULT_VERIFIER
    from models.measure import heldout_stream, prompts
    from workers.local import local_engine
    from workers.scheduler import SchedulerConfig

    engine = local_engine(  # acceptance of each rule at K = 4, not the policy's k
        str(DEFAULT_VERIFIER), str(DEFAULT_DRAFT), scheduler=SchedulerConfig(policy="fixed")
    )
    windows = prompts(heldout_stream(engine.tokenizer), n=n_prompts, length=64)
    print(f"# {n_prompts} held-out prompts x {tokens} tokens, T 0.6 top_k 20 top_p 0.95, K=4")
    print(
        "| rule | delta | acceptance_rate | alpha (pos 0) | mean acc. length | nats/token | tok/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for rule, delta in rules:
        drafts = drafted = accepted = first = gen = 0
        div = 0.0
        start = time.perf_counter()
        for i, window in enumerate(windows):
            res = engine.generate(
                GenerationRequest(
                    prompt_token_ids=tuple(int(t) for t in window),
                    sampling=SamplingParams(
                        max_tokens=tokens, temperature=0.6, top_k=20, top_p=0.95, seed=i
                    ),
                    speculation=SpeculationParams(rule=rule, delta=delta, num_speculative_tokens=4),
                )
            )
            st = res.stats
            drafts += st.num_drafts
            drafted += st.num_draft_tokens
            accepted += st.num_accepted_tokens
            first += st.accepted_per_position[0]
            div += st.divergence_nats
            gen += len(res.token_ids)
        wall = time.perf_counter() - start
        print(
            f"| {rule} | {delta:g} | {accepted / drafted:.3f} | {first / drafts:.3f} | "
            f"{1 + accepted / drafts:.2f} | {div / gen:.3f} | {gen / wall:.1f} |",
            flush=True,
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", default="sps:0,cactus:0.5,cactus:1,cactus_exact:1,tas:0")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rules = [
        (r.split(":")[0], float(r.split(":")[1]) if ":" in r else 0.0)
        for r in args.rules.split(",")
    ]
    run(rules, args.prompts, args.tokens)


if __name__ == "__main__":
    main()
