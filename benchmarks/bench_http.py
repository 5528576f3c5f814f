"""HTTP (OpenAI API) vs gRPC: single-stream tokens/s through the same server, side by side.

    python -m benchmarks.bench_http [--quick] [--rounds 8] [--max-tokens 64]

One `make serve` server (python -m deployments.serve, embedded models, TP = 1); each
round streams the same seeded request once over gRPC (CactusClient.stream) and once
over HTTP (the official openai client, stream=True), in alternating order. Reported:
median tokens/s per path over the rounds and the HTTP/gRPC ratio. Both paths produce
the same tokens (checked), so only the transport differs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.load import ServerProcess, exit_on_sigterm, speculation
from client import CactusClient

PROMPTS = ["def parse(text):", "class Stack:", "def fibonacci(n):", "def merge(a, b):"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 32 tokens")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.max_tokens = 3, 32
    from cactus import environment

    environment.apply()
    exit_on_sigterm()
    import openai

    # policy fixed: the same seed must give the same text over both paths (under the
    # goodput policy k, and so the sampled text, depends on timings)
    server = ServerProcess({"tp_size": 1, "speculation": speculation(policy="fixed")})
    rates: dict[str, list[float]] = {"grpc": [], "http": []}
    try:
        server.wait_ready()
        grpc_client = CactusClient(server.address, timeout=300)
        http_client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0
        )
        kw = {"max_tokens": args.max_tokens, "temperature": 0.6, "top_p": 0.95}
        extra = {"rule": "cactus", "delta": 1.0, "top_k": 20}

        def over_grpc(prompt: str, seed: int) -> tuple[float, str]:
            start = time.perf_counter()
            chunks = list(
                grpc_client.stream(prompt, seed=seed, top_k=20, rule="cactus", delta=1.0, **kw)
            )
            wall = time.perf_counter() - start
            return sum(len(c.token_ids) for c in chunks) / wall, "".join(c.text for c in chunks)

        def over_http(prompt: str, seed: int) -> tuple[float, str]:
            start = time.perf_counter()
            stream = http_client.completions.create(
                model="verifier",
                prompt=prompt,
                seed=seed,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
                **kw,
            )
            text, tokens = "", 0
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            return tokens / (time.perf_counter() - start), text

        over_grpc("x", 0), over_http("x", 0)  # warm-up
        for rnd in range(args.rounds):
            prompt = PROMPTS[rnd % len(PROMPTS)]
            order = [("grpc", over_grpc), ("http", over_http)]
            if rnd % 2:
                order.reverse()
            texts = {}
            for name, run in order:
                rate, texts[name] = run(prompt, 100 + rnd)
                rates[name].append(rate)
            if texts["grpc"] != texts["http"]:
                raise SystemExit(f"round {rnd}: the two paths produced different text")
    finally:
        server.stop()
    grpc_rate, http_rate = (statistics.median(rates[k]) for k in ("grpc", "http"))
    print(
        f"# single stream, cactus delta 1, {args.max_tokens} tokens, {args.rounds} rounds, "
        "same seeded requests over both paths (identical text checked)"
    )
    print("| path | median tok/s | vs gRPC |")
    print("|---|---|---|")
    print(f"| gRPC | {grpc_rate:.1f} | 1.00x |")
    print(f"| HTTP (OpenAI API, SSE) | {http_rate:.1f} | {http_rate / grpc_rate:.2f}x |")


if __name__ == "__main__":
    main()
