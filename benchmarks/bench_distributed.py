"""Single-stream throughput: in-process engine vs distributed TP=1 vs TP=2.

`make bench-distributed` (or `python -m benchmarks.bench_distributed [--quick]`).
Every configuration runs the same requests (held-out prompts, fixed seeds), interleaved
round by round in one run, so the machine's noise hits all of them alike. Every actor
and the in-process engine use the same number of torch threads (--threads, default 1).
Prints tokens/s (median over requests), the ratio to the in-process engine, and the
per-step breakdown in milliseconds:

    draft      draft-model compute (on the draft actor for the distributed engine)
    grpc       ProposeBatch round trip minus the draft compute: transport,
               serialisation, the draft side's commits
    verify     verifier forward (for TP: including the all-reduces), minus broadcast
    bcast      rank 0 broadcasting the step's operations to the other ranks
    kernel     sampling processing + the acceptance kernel
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

from cactus.detokenize import encode_prompt
from cactus.params import GenerationRequest, SamplingParams, SpeculationParams

RULES = (("sps", 0.0), ("cactus", 1.0))


def _prompts(tokenizer, n: int) -> list[str]:
    from models.corpus import load_texts

    out = []
    for _path, text in load_texts("heldout"):
        body = text.lstrip()
        if len(body) >= 400:
            out.append(tokenizer.decode(tokenizer.encode(body, add_special_tokens=False)[:32]))
        if len(out) == n:
            return out
    return out


def _request(prompt: str, rid: str, rule: str, delta: float, max_tokens: int, seed: int):
    return GenerationRequest(
        prompt=prompt,
        request_id=rid,
        sampling=SamplingParams(
            max_tokens=max_tokens, temperature=0.6, top_k=20, top_p=0.95, seed=seed
        ),
        speculation=SpeculationParams(rule=rule, delta=delta, num_speculative_tokens=4),
    )


class _Runner:
    """One configuration: runs a request, returns (seconds, result, extra timings)."""

    def __init__(self, name: str, run, timings=None) -> None:
        self.name = name
        self._run = run
        self._timings = timings or (lambda: {})

    def __call__(self, request):
        before = self._timings()
        start = time.perf_counter()
        result = self._run(request)
        wall = time.perf_counter() - start
        after = self._timings()
        numbers = [k for k, v in after.items() if isinstance(v, (int, float))]
        return wall, result, {k: after[k] - before.get(k, 0.0) for k in numbers}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts, 1 round, 24 tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--concurrent-rounds", type=int, default=7, help="rounds of the 8-request comparison"
    )
    parser.add_argument("--verifier", default=None)
    parser.add_argument("--draft", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.prompts, args.max_tokens, args.concurrent_rounds = 1, 2, 24, 1
    from cactus import environment
    from cactus.environment import DEFAULT_DRAFT, DEFAULT_VERIFIER

    environment.apply()
    import ray
    import torch

    from workers.group import EngineGroup, GroupConfig
    from workers.local import local_engine
    from workers.scheduler import SchedulerConfig

    verifier = args.verifier or str(DEFAULT_VERIFIER)
    draft = args.draft or str(DEFAULT_DRAFT)
    torch.set_num_threads(args.threads)
    # a fresh local head: a benchmark never joins a cluster found in /tmp/ray
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    # Ray starts its worker processes at nice 15 (below raylet/GCS); run the in-process
    # engine at the same priority so only the transport differs.
    niceness = os.nice(0)
    worker_nice = int(os.environ.get("RAY_worker_niceness", "15"))  # noqa: SIM112 (Ray spells it so)
    if niceness < worker_nice:
        niceness = os.nice(worker_nice - niceness)
    groups = {}
    try:
        # both sides draft every row's K (policy fixed): only the transport differs
        local = local_engine(verifier, draft, scheduler=SchedulerConfig(policy="fixed"))
        runners = [_Runner("in-process", local.generate)]
        for tp in (1, 2):
            groups[tp] = EngineGroup(
                GroupConfig(
                    verifier, draft, tp_size=tp, threads=args.threads, speculation_policy="fixed"
                )
            ).start()
            rank0 = groups[tp].rank0
            runners.append(
                _Runner(
                    f"distributed TP={tp}",
                    groups[tp].generate,
                    lambda r=rank0: ray.get(r.timings.remote()),
                )
            )
        prompts = _prompts(local.tokenizer, args.prompts)
        for runner in runners:  # warm-up
            runner(_request(prompts[0], f"warm-{runner.name}", "cactus", 1.0, 8, 0))
        samples = _measure(runners, prompts, args)
        _report(samples, args)
        _concurrent(groups[1], local, prompts, args)
    finally:
        for group in groups.values():
            group.shutdown()
        ray.shutdown()


def _measure(runners, prompts, args) -> dict:
    samples: dict[tuple[str, str], list[tuple]] = {}
    n = 0
    for rnd in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for rule, delta in RULES:
                for runner in runners:
                    n += 1
                    req = _request(prompt, f"b{n}", rule, delta, args.max_tokens, 100 * rnd + i)
                    samples.setdefault((runner.name, rule), []).append(runner(req))
    return samples


def _set_pipeline(actor, on: bool, batch_wait_s: float | None = None) -> float:
    """Runs inside rank 0 (ray __ray_call__): the end-of-step ProposeBatch on or off, and
    the idle engine's batch wait (None: unchanged); returns the batch wait before."""
    actor.drafter.pipeline = on
    before = actor.loop.batch_wait_s
    if batch_wait_s is not None:
        actor.loop.batch_wait_s = batch_wait_s
    return before


def _concurrent(group, local, prompts, args, n: int = 8) -> None:
    """n requests at once: distributed TP=1 (rank 0's engine loop batches them), with and
    without the next step's ProposeBatch sent at the end of each step, and without the
    idle engine's batch wait (the n calls reach rank 0 over a few ms; without the wait
    the first request starts a step ahead of the rest), vs the in-process engine stepping
    the same batch (all added before its clock starts). Interleaved round by round, each
    round in a different order; tokens/s over each batch's wall time."""
    import ray

    from benchmarks.bench_batch import run_batch

    wait_s = ray.get(group.rank0.__ray_call__.remote(_set_pipeline, True))

    def distributed(reqs, mode: tuple[bool, bool]) -> float:
        pipeline, wait = mode
        ray.get(group.rank0.__ray_call__.remote(_set_pipeline, pipeline, wait_s if wait else 0.0))
        before = ray.get(group.rank0.timings.remote())["steps"]
        start = time.perf_counter()
        results = ray.get([group.rank0.generate.remote(r) for r in reqs])
        rate = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
        return rate, ray.get(group.rank0.timings.remote())["steps"] - before

    modes = {
        "distributed": (True, True),
        "distributed, no prefetch": (False, True),
        "distributed, no batch wait": (True, False),
    }
    names = (*modes, "in-process")
    rates: dict[str, list[float]] = {name: [] for name in names}
    steps: dict[str, list[int]] = {name: [] for name in names}  # decode steps per batch
    count = 0
    for rnd in range(args.concurrent_rounds):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            reqs = []
            for i in range(n):
                count += 1
                prompt = prompts[i % len(prompts)]
                reqs.append(
                    _request(prompt, f"c{count}", "cactus", 1.0, args.max_tokens, rnd * 10 + i)
                )
            if name == "in-process":
                ids = [
                    replace(
                        r,
                        prompt=None,
                        prompt_token_ids=tuple(encode_prompt(local.tokenizer, r.prompt)),
                    )
                    for r in reqs
                ]
                batch = run_batch(local, ids)
                rates[name].append(batch["tokens_per_s"])
                steps[name].append(batch["steps"])
            else:
                rate, n_steps = distributed(reqs, modes[name])
                rates[name].append(rate)
                steps[name].append(n_steps)
    ray.get(group.rank0.__ray_call__.remote(_set_pipeline, True, wait_s))
    med = {name: statistics.median(v) for name, v in rates.items()}
    base = med["in-process"]
    print(
        f"\n# {n} concurrent cactus requests x {args.max_tokens} tokens, "
        f"{args.concurrent_rounds} rounds "
        "(median tok/s): "
        + ", ".join(f"{name} {v:.1f} ({v / base:.2f}x)" for name, v in med.items()),
        flush=True,
    )
    # each round's ratio to the in-process batch of the same round (the machine's slow
    # spells hit both), median over rounds
    paired = {
        name: statistics.median(
            d / i for d, i in zip(rates[name], rates["in-process"], strict=True)
        )
        for name in modes
    }
    print(
        "# paired by round (median of per-round ratios): "
        + ", ".join(f"{name} {v:.3f}x" for name, v in paired.items()),
        flush=True,
    )
    print(
        "# decode steps per batch (mean): "
        + ", ".join(f"{name} {statistics.mean(v):.2f}" for name, v in steps.items()),
        flush=True,
    )


def _report(samples: dict, args) -> None:
    print(
        f"# single stream, temperature 0.6 top_k 20 top_p 0.95, K=4, {args.max_tokens} tokens, "
        f"{args.prompts} prompts x {args.rounds} rounds, {args.threads} thread(s) per process, "
        f"every process at nice {os.nice(0)} (Ray's worker niceness)"
    )
    print(
        "| engine | rule | tok/s | vs in-process | accept len | draft | grpc | verify | bcast "
        "| kernel | ms/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = {}
    for (name, rule), runs in samples.items():
        tps = statistics.median(len(r.token_ids) / wall for wall, r, _ in runs)
        if name == "in-process":
            base[rule] = tps
        steps = sum(r.stats.num_drafts for _, r, _ in runs) or 1
        st = [r.stats for _, r, _ in runs]
        extra = {
            k: sum(x.get(k, 0.0) for _, _, x in runs)
            for k in ("rpc_s", "remote_draft_s", "broadcast_s")
        }
        draft = extra["remote_draft_s"] if extra["rpc_s"] else sum(s.draft_s for s in st)
        grpc_ms = (extra["rpc_s"] - extra["remote_draft_s"]) / steps * 1e3
        verify = sum(s.verify_s for s in st) - extra["broadcast_s"]
        kernel = sum(s.kernel_s for s in st)
        wall = sum(w for w, _, _ in runs)
        accept = statistics.mean(s.mean_acceptance_length for s in st)
        print(
            f"| {name} | {rule} | {tps:.1f} | {tps / base[rule]:.2f}x | {accept:.2f} | "
            f"{draft / steps * 1e3:.1f} | {grpc_ms:.1f} | {verify / steps * 1e3:.1f} | "
            f"{extra['broadcast_s'] / steps * 1e3:.1f} | {kernel / steps * 1e3:.1f} | "
            f"{wall / steps * 1e3:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
