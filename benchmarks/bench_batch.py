"""In-process batch sweep: tokens/s of the batched engine at B = 1, 2, 4, ... 32 concurrent
requests, per rule, with the step-time split; where plain decoding overtakes each rule.

    python -m benchmarks.bench_batch [--quick] [--pair embedded|qwen3] [--plot PATH]

B requests (held-out prompts, fixed seeds, T 0.6 / top_k 20 / top_p 0.95, K = 4) are
added at once and the engine is stepped until all end; tokens/s = generated tokens /
wall time. Every batch size runs every rule back to back, so the machine's noise hits
them alike. Columns (ms per decode step): draft = the batched draft pass, verify = the
verifier forward, accept = sampling processing of every row + the ragged kernel,
book = commits, stop handling, detokenising; prefill = prompt chunks (total s).

--pair qwen3: a random-weight Qwen3-shaped pair with a real 151,936-token vocabulary
(verifier 4 x 256, draft 1 x 64, built on the fly like the tests' tiny checkpoints), to
show that the vocabulary-sized passes do not grow faster than the batch. Its random
weights accept few drafts; only the costs are meaningful there.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

from cactus.params import GenerationRequest, SamplingParams, SpeculationParams

RULES = (("none", 0.0), ("sps", 0.0), ("cactus", 1.0), ("cactus_exact", 1.0))


def _prompts(tokenizer, n: int, length: int = 32) -> list[list[int]]:
    from models.corpus import load_texts

    out = []
    for _path, text in load_texts("heldout"):
        body = text.lstrip()
        if len(body) >= 400:
            out.append(tokenizer.encode(body, add_special_tokens=False)[:length])
        if len(out) == n:
            break
    return out


def _request(ids, rid: str, rule: str, delta: float, max_tokens: int, seed: int):
    return GenerationRequest(
        prompt_token_ids=tuple(ids),
        request_id=rid,
        sampling=SamplingParams(
            max_tokens=max_tokens, temperature=0.6, top_k=20, top_p=0.95, seed=seed
        ),
        speculation=SpeculationParams(rule=rule, delta=delta, num_speculative_tokens=4),
    )


def run_batch(engine, reqs) -> dict:
    """All requests at once; returns tokens/s, acceptance length and the step split."""
    before = engine.timing.as_dict()
    results: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r, results[r.request_id].append)
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - start
    after = engine.timing.as_dict()
    finals = [items[-1].result for items in results.values()]
    tokens = sum(len(f.token_ids) for f in finals)
    steps = max(after["steps"] - before["steps"], 1)
    split = {
        k: (after[k] - before[k]) / steps * 1e3
        for k in ("draft_s", "verify_s", "accept_s", "bookkeeping_s")
    }
    drafted = [f.stats for f in finals if f.stats.num_drafts]
    return {
        "tokens_per_s": tokens / wall,
        "accept_len": statistics.mean(s.mean_acceptance_length for s in drafted)
        if drafted
        else 1.0,
        "steps": steps,
        "prefill_s": after["prefill_s"] - before["prefill_s"],
        **split,
    }


def qwen3_pair(root: Path) -> tuple[str, str]:
    """Random Qwen3-shaped checkpoints with a 151,936-token vocabulary (seconds to build)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from tests.tiny_models import train_tokenizer

    vocab = 151_936
    small = train_tokenizer(root / "tok")  # real ids stay < 400; the rest is vocabulary
    tok = PreTrainedTokenizerFast(
        tokenizer_object=small.backend_tokenizer, eos_token="<|endoftext|>"
    )
    dirs = []
    for name, layers, hidden in (("verifier", 4, 256), ("draft", 1, 64)):
        torch.manual_seed(len(dirs))
        config = AutoConfig.for_model(
            "qwen3",
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=3 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            max_position_embeddings=512,
            eos_token_id=tok.eos_token_id,
            tie_word_embeddings=True,
        )
        AutoModelForCausalLM.from_config(config).float().save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs.append(str(root / name))
    return dirs[0], dirs[1]


def sweep(engine, prompts, batches, rules, max_tokens: int, progress=None) -> list[dict]:
    rows = []
    n = 0
    for b in batches:
        for rule, delta in rules:
            reqs = []
            for i in range(b):
                n += 1
                reqs.append(
                    _request(
                        prompts[i % len(prompts)], f"b{n}", rule, delta, max_tokens, seed=1000 + i
                    )
                )
            rows.append({"rule": rule, "delta": delta, "batch": b, **run_batch(engine, reqs)})
            if progress:
                progress()
    return rows


def crossover(rows: list[dict]) -> dict[str, int | None]:
    """Per rule: the smallest batch size at which plain decoding is at least as fast."""
    plain = {r["batch"]: r["tokens_per_s"] for r in rows if r["rule"] == "none"}
    out = {}
    for rule in dict.fromkeys(r["rule"] for r in rows if r["rule"] != "none"):
        over = [
            r["batch"]
            for r in rows
            if r["rule"] == rule and plain.get(r["batch"], 0) >= r["tokens_per_s"]
        ]
        out[rule] = min(over) if over else None
    return out


def table(rows: list[dict], title: str) -> str:
    base = {
        r["rule"]: r["tokens_per_s"] for r in rows if r["batch"] == min(x["batch"] for x in rows)
    }
    lines = [
        title,
        "| rule | B | tok/s | vs B=1 | accept len | steps | draft ms | verify ms | accept ms "
        "| book ms | prefill s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rule']} | {r['batch']} | {r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_s'] / base[r['rule']]:.2f}x | {r['accept_len']:.2f} | {r['steps']} | "
            f"{r['draft_s']:.1f} | {r['verify_s']:.1f} | {r['accept_s']:.1f} | "
            f"{r['bookkeeping_s']:.1f} | {r['prefill_s']:.2f} |"
        )
    cross = crossover(rows)
    lines.append(
        "\n# plain decoding overtakes: "
        + ", ".join(
            f"{k} at B={v}" if v else f"{k}: not up to B={max(r['batch'] for r in rows)}"
            for k, v in cross.items()
        )
    )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for rule in dict.fromkeys(r["rule"] for r in rows):
        pts = [(r["batch"], r["tokens_per_s"]) for r in rows if r["rule"] == rule]
        ax.plot(*zip(*pts, strict=True), marker="o", label=rule)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests in the batch (B)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def kv_report(engine) -> str:
    runner = engine.verifier.runner
    cfg = runner.config
    heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_slot = cfg.num_hidden_layers * 2 * heads * head_dim * 4
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gpu = ""
    if runner.device.type == "cuda":
        import torch

        gpu = f"peak CUDA allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB; "
    return (
        f"# memory: peak resident {peak:.0f} MiB (this process: verifier + draft + sweep); "
        f"{gpu}"
        f"verifier KV budget {runner.kv_budget_tokens} slots x {per_slot / 1024:.1f} KiB = "
        f"{runner.kv_budget_tokens * per_slot / 2**20:.0f} MiB; allocated at the end "
        f"{runner.kv_slots} slots = {runner.kv_slots * per_slot / 2**20:.0f} MiB"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B = 1, 4, 16; 24 tokens")
    parser.add_argument("--pair", choices=("embedded", "qwen3"), default="embedded")
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (make gpu-check)")
    args = parser.parse_args(argv)
    import torch

    from cactus.environment import DEFAULT_DRAFT, DEFAULT_VERIFIER
    from workers.local import local_engine
    from workers.scheduler import SchedulerConfig

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        batches, args.max_tokens = [b for b in batches if b in (1, 4, 16)], 24
    with tempfile.TemporaryDirectory() as tmp:
        if args.pair == "qwen3":
            verifier, draft = qwen3_pair(Path(tmp))
        else:
            verifier, draft = str(DEFAULT_VERIFIER), str(DEFAULT_DRAFT)
        # each rule at its own K (the sweep shows where each K stops paying; the
        # goodput policy that chooses K per step is benchmarks/bench_policy.py)
        engine = local_engine(
            verifier, draft, device=args.device, scheduler=SchedulerConfig(policy="fixed")
        )
        prompts = (
            _prompts(engine.tokenizer, 32)
            if args.pair == "embedded"
            else [list(range(10 + i, 42 + i)) for i in range(32)]
        )
        run_batch(engine, [_request(prompts[0], "warm", "cactus", 1.0, 8, 0)])
        rows = sweep(engine, prompts, batches, RULES, args.max_tokens)
        title = (
            f"# in-process batch sweep, {args.pair} pair, {args.max_tokens} tokens per request, "
            f"T 0.6 top_k 20 top_p 0.95, K=4, {args.threads} thread(s), {args.device}"
        )
        print(table(rows, title))
        print(kv_report(engine), flush=True)
        if args.plot:
            plot(rows, args.plot, f"batched engine, {args.pair} pair")


if __name__ == "__main__":
    main()
