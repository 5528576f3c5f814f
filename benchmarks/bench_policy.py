"""The goodput speculation policy against every fixed K, served, side by side.

    python -m benchmarks.bench_policy [--quick] [--seconds S] [--rounds R]
                                      [--levels 1 4 8 16] [--plot PATH] [--settle S]
                                      [--race-after N] [--race-margin X]

One server runs as `make serve` runs it (TP = 1, embedded pair, `speculation.policy:
goodput`), and before each cell the bench sets its rank 0 engine's policy: `fixed`, or
the goodput policy with all it has learned so far (kept aside while fixed cells run).
Both are so measured on the same processes. (Two servers side by side, one per policy,
were not even: an A/A run of two fixed servers gave the second 0.982x +- 0.017 of the
first at 1 client and 0.984x +- 0.021 at 8, the size of the effect being measured.)

For each load level (concurrent streaming clients, 64-token completions of "def
parse(text):" as in the load section) and each rule (cactus delta 1, sps), fixed is
measured at K = 2, 4, 6, 8 (the request's num_speculative_tokens) and K = 0 (rule
none), and goodput with K = 8 as its ceiling, cell after cell, `--rounds` times in
rotated order (default 20 at 1 and 4 clients, 10 at 8 and 16: `ROUNDS_AT`); tokens/s
is the mean over rounds. One round of a cell moves by 3-8% on a shared 2-core machine
(the most with few clients), so the rounds are many and short, and after
`--race-after` rounds a fixed K that is clearly slower than its rule's best (below
`--race-margin` x) is not measured again: it cannot be the best, and the time goes to
the cells that decide the comparison. The table gives the ratio's standard error next
to it. Rank 0 reports what the goodput policy chose (mean k, histogram) and predicted
(tokens and step time) against what the steps gave, in the measured windows only (its
statistics are read as each window starts and ends). The last lines say how often a
policy exactly as fast as the best fixed K would reach 0.97x of it, measured this way
with this run's spread: the largest of several noisy fixed means overstates the best.

Each cell's clients first run `--settle` seconds unmeasured, then its measured window
starts while they go on. A cell right after a different one (another rule, K or
policy) runs slower for a while: two cells of the same kind back to back measured
1.046x +- 0.011 (fixed K = 8) and 1.031x +- 0.020 (goodput) the second time against
the first, cactus at 16 clients, 8 rounds (benchmarks/results/2026-12-01-vm-policy.md,
"Carry-over between cells"). Every cell of the rotation follows a different one, and
what it inherits depends on which (the goodput cell always follows fixed K = 8, which
follows fixed K = 6); with 2 s of unmeasured load first, a second cell of the same kind
no longer measured faster than the first.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from benchmarks.load import ServerProcess, exit_on_sigterm, run_level, speculation

FIXED_KS = (0, 2, 4, 6, 8)
RULES = ("cactus", "sps")
CEILING = 8
MAX_TOKENS = 64
# Rounds per cell by load level when --rounds is not given. With few concurrent clients
# a 5 s window holds few requests, and one round of a cell moved about twice as much
# as at 8 and 16 clients (median round-to-round spread of a cell in runs 19 and 20:
# 6.4-8.3% at 1 and 4 clients, 3.1-4.1% at 8 and 16; benchmarks/results/
# 2026-12-01-vm-policy.md, "Run 21"), so those levels get twice the rounds.
ROUNDS = 10
ROUNDS_AT = {1: 20, 4: 20}


def _server(policy: str, levels: list[int]) -> ServerProcess:
    return ServerProcess(
        {
            "tp_size": 1,
            "speculation": speculation(policy=policy),
            "limits": {"max_ongoing_requests": max(levels), "max_queued_requests": 4 * max(levels)},
        }
    )


def _rank0():
    """The server's verifier rank 0 (this process is its Ray driver)."""
    import ray

    names = [
        e["name"]
        for e in ray.util.list_named_actors(all_namespaces=True)
        if e["namespace"] == "cactus" and e["name"].endswith("-rank0")
    ]
    return ray.get_actor(names[0], namespace="cactus")


def _rank0_policy() -> dict:
    """The goodput policy's statistics."""
    import ray

    return ray.get(_rank0().timings.remote(), timeout=60)["policy"]


def _use_policy(actor, kind: str) -> str:  # runs inside rank 0 (ray __ray_call__)
    """Give the engine the `kind` policy between two steps; each kind's policy object
    is kept, so goodput goes on with what it learned."""
    from workers.policy import PolicyConfig, SpeculationPolicy

    def swap(engine) -> str:
        kept = engine.__dict__.setdefault("_bench_policies", {engine.policy.kind: engine.policy})
        engine.policy = kept.setdefault(kind, SpeculationPolicy(PolicyConfig(kind=kind)))
        return engine.policy.kind

    return actor.loop.call(swap)


def _set_policy(kind: str) -> None:
    import ray

    got = ray.get(_rank0().__ray_call__.remote(_use_policy, kind), timeout=60)
    if got != kind:
        raise RuntimeError(f"rank 0 runs the {got} policy, asked for {kind}")


def _delta(after: dict, before: dict) -> dict:
    """Policy statistics of the window between two snapshots, per group."""
    out = {
        "predicted_time_s": after["predicted_time_s"] - before["predicted_time_s"],
        "realised_time_s": after["realised_time_s"] - before["realised_time_s"],
        "steps": after["steps"] - before["steps"],
        "groups": {},
    }
    for group, g in after["groups"].items():
        b = before["groups"].get(
            group, {"rows": 0, "chosen_k": {}, "predicted_tokens": 0.0, "realised_tokens": 0}
        )
        ks = {int(k): n - b["chosen_k"].get(k, 0) for k, n in g["chosen_k"].items()}
        rows = g["rows"] - b["rows"]
        if rows:
            out["groups"][group] = {
                "rows": rows,
                "chosen_k": {k: n for k, n in sorted(ks.items()) if n},
                "mean_k": sum(k * n for k, n in ks.items()) / rows,
                "predicted_tokens": g["predicted_tokens"] - b["predicted_tokens"],
                "realised_tokens": g["realised_tokens"] - b["realised_tokens"],
            }
    return out


def _in_window(run, settle_s: float, seconds: float, snapshot) -> tuple:
    """`run()` (a run_level call: `settle_s` unmeasured, then a `seconds` window, then
    until its streams end) and the policy statistics of its measured window only:
    `snapshot()` is taken when the settle time ends and when the window ends (a timer
    thread from the same start as run_level's), not before the settle time and after
    the streams drained, so mean k, chosen k and the predicted / realised ratios cover
    the steps the tokens/s counts. Returns (run's result, _delta of the two)."""
    start = time.monotonic()
    taken: dict = {}

    def take() -> None:
        try:
            for name, at in (("before", settle_s), ("after", settle_s + seconds)):
                time.sleep(max(0.0, start + at - time.monotonic()))
                taken[name] = snapshot()
        except Exception as err:  # raised in the caller's thread below
            taken["error"] = err

    timer = threading.Thread(target=take, daemon=True)
    timer.start()
    try:
        result = run()
    finally:
        timer.join()
    if "error" in taken:
        raise taken["error"]
    return result, _delta(taken["after"], taken["before"])


def _started(policy: str, levels: list[int]) -> ServerProcess:
    """A ready server; one more try if the first did not start (two local Ray
    clusters started back to back can race for a port)."""
    for attempt in (1, 2):
        server = _server(policy, levels)
        try:
            server.wait_ready()
            return server
        except RuntimeError as err:
            server.stop()
            if attempt == 2:
                raise
            print(f"# the {policy} server did not start, once more: {err}", file=sys.stderr)
    raise AssertionError("unreachable")


def measure(args) -> list[dict]:
    server = _started("goodput", args.levels)
    rows: list[dict] = []
    try:
        import ray

        ray.init(address=server.ray_address(), log_to_driver=False, configure_logging=False)
        for rule in RULES:  # warm-up: compile paths, and let the policy learn a little
            _set_policy("fixed")
            run_level(server.address, rule, 2, 2.0, max_tokens=16)
            _set_policy("goodput")
            run_level(
                server.address,
                rule,
                4,
                args.warmup,
                max_tokens=MAX_TOKENS,
                num_speculative_tokens=CEILING,
            )
        for clients in args.levels:
            cells: dict[tuple, list[float]] = {}
            policy: dict[str, dict] = {}
            active = [("none", 0)] + [(r, k) for r in RULES for k in (*FIXED_KS[1:], "goodput")]
            for rnd in range(args.rounds_at[clients]):
                if rnd == args.race_after:
                    active = _race(active, cells, args.race_margin)
                plan = active[rnd % len(active) :] + active[: rnd % len(active)]
                for rule, k in plan:
                    _set_policy("goodput" if k == "goodput" else "fixed")

                    def cell(rule=rule, clients=clients, k=k):
                        return run_level(
                            server.address,
                            rule,
                            clients,
                            args.seconds,
                            max_tokens=MAX_TOKENS,
                            warmup_s=args.settle,
                            num_speculative_tokens=CEILING if k == "goodput" else max(k, 1),
                        )

                    if k == "goodput":
                        res, window = _in_window(cell, args.settle, args.seconds, _rank0_policy)
                        _merge(policy.setdefault(rule, {}), window)
                    else:
                        res = cell()
                    if res.errors:
                        raise RuntimeError(
                            f"{res.errors} failed requests at {clients} x {rule} K={k}"
                        )
                    cells.setdefault((rule, k), []).append(res.tokens_per_s)
                    print(
                        f"# {clients} clients {rule} K={k}: {res.tokens_per_s:.1f} tok/s",
                        file=sys.stderr,
                        flush=True,
                    )
            mean = {key: statistics.mean(v) for key, v in cells.items()}
            se = {key: _se(v) for key, v in cells.items()}
            for rule in RULES:
                keys = {0: ("none", 0), **{k: (rule, k) for k in FIXED_KS[1:]}}
                fixed_tps = {k: mean[key] for k, key in keys.items()}
                best_k = max(fixed_tps, key=fixed_tps.get)
                good_tps, best = mean[rule, "goodput"], fixed_tps[best_k]
                ratio = good_tps / best
                # the same comparison paired by round: a round's goodput window over the
                # best fixed K's window of that round (slow spells of the shared machine
                # that last a round hit both)
                per_round = [
                    g / b for g, b in zip(cells[rule, "goodput"], cells[keys[best_k]], strict=False)
                ]
                held_out = _held_out_best({k: cells[key] for k, key in keys.items()})
                tie_pass = _tie_pass_chance(
                    {k: cells[key] for k, key in keys.items()}, len(cells[rule, "goodput"])
                )
                p = policy[rule]
                groups = p.get("groups", {})
                g = next(iter(groups.values()), {})
                rows.append(
                    {
                        "clients": clients,
                        "rule": rule,
                        "fixed": fixed_tps,
                        "rounds": {k: len(cells[key]) for k, key in keys.items()},
                        "goodput": good_tps,
                        "goodput_rounds": len(cells[rule, "goodput"]),
                        "best_k": best_k,
                        "ratio": ratio,
                        # the ratio's standard error, from both cells' round-to-round spread
                        "ratio_se": ratio
                        * math.hypot(se[rule, "goodput"] / good_tps, se[keys[best_k]] / best),
                        "paired_ratio": statistics.mean(per_round),
                        "paired_se": _se(per_round),
                        "held_out_ratio": good_tps / held_out if held_out else None,
                        "tie_pass": tie_pass,
                        "group": next(iter(groups), rule),
                        "mean_k": g.get("mean_k", 0.0),
                        "chosen_k": g.get("chosen_k", {}),
                        "tokens_ratio": g.get("predicted_tokens", 0.0)
                        / max(g.get("realised_tokens", 0), 1e-9),
                        "time_ratio": p.get("predicted_time_s", 0.0)
                        / max(p.get("realised_time_s", 0.0), 1e-9),
                    }
                )
    finally:
        server.stop()
    return rows


def _held_out_best(series: dict) -> float | None:
    """The best fixed K's tokens/s without the winner's curse: taking the largest of
    several noisy means overstates the best (near-tied Ks make it worse), so the K is
    chosen on the even rounds and measured on the odd ones, and the other way round,
    and the two are averaged (cross-fitting). `series`: K -> that cell's per-round
    tokens/s, round i at index i (a K dropped by the race has the first rounds only).
    None with fewer than two rounds."""
    value = []
    for pick, measure in ((0, 1), (1, 0)):
        picked = {
            k: statistics.mean(v[pick::2])
            for k, v in series.items()
            if v[pick::2] and v[measure::2]
        }
        if not picked:
            return None
        value.append(statistics.mean(series[max(picked, key=picked.get)][measure::2]))
    return statistics.mean(value)


def _tie_pass_chance(
    series: dict, goodput_rounds: int, threshold: float = 0.97, trials: int = 2000
) -> float:
    """How often a policy whose true tokens/s equals the best fixed K's would reach
    `threshold` x the best fixed K in this cell, measured as the table measures it (the
    largest of the fixed Ks' means over their rounds): a Monte Carlo with every round
    drawn around its K's mean with this cell's round-to-round spread (the median
    coefficient of variation of its fixed Ks). Near-tied Ks and a large spread make
    the largest mean overstate the best (the winner's curse), so even a policy that
    ties can fail; this says how often. Fixed seed: the same run gives the same figure."""
    rng = random.Random(0)
    means = {k: statistics.mean(v) for k, v in series.items() if v}
    spreads = [statistics.stdev(v) / statistics.mean(v) for v in series.values() if len(v) > 2]
    cv = statistics.median(spreads) if spreads else 0.0
    best = max(means.values())
    passed = 0
    for _ in range(trials):
        fixed = max(
            statistics.mean(m * rng.gauss(1.0, cv) for _ in series[k]) for k, m in means.items()
        )
        policy = statistics.mean(best * rng.gauss(1.0, cv) for _ in range(goodput_rounds))
        passed += policy >= threshold * fixed
    return passed / trials


def _se(values: list[float]) -> float:
    """Standard error of a cell's mean over its rounds (0 with one round)."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def _race(active: list[tuple], cells: dict, margin: float) -> list[tuple]:
    """The cells still worth measuring: a fixed K whose mean so far is below `margin` x
    its rule's best fixed K cannot be the best one (it keeps the rounds it has); rule
    none stays while it is within the margin for either rule; goodput always stays."""
    mean = {key: statistics.mean(v) for key, v in cells.items()}
    keep = set()
    for rule in RULES:
        keys = [("none", 0)] + [(rule, k) for k in FIXED_KS[1:]]
        best = max(mean[key] for key in keys)
        keep |= {key for key in keys if mean[key] >= margin * best}
        keep.add((rule, "goodput"))
    return [key for key in active if key in keep]


def _merge(into: dict, d: dict) -> None:
    """Add one window's policy statistics to the level's."""
    for key in ("predicted_time_s", "realised_time_s", "steps"):
        into[key] = into.get(key, 0) + d[key]
    groups = into.setdefault("groups", {})
    for name, g in d["groups"].items():
        t = groups.setdefault(
            name, {"rows": 0, "chosen_k": {}, "predicted_tokens": 0.0, "realised_tokens": 0}
        )
        t["rows"] += g["rows"]
        t["predicted_tokens"] += g["predicted_tokens"]
        t["realised_tokens"] += g["realised_tokens"]
        for k, n in g["chosen_k"].items():
            t["chosen_k"][k] = t["chosen_k"].get(k, 0) + n
        t["mean_k"] = sum(k * n for k, n in t["chosen_k"].items()) / t["rows"]


def _rounds_text(args) -> str:
    """ "10" or "20 (1, 4 clients) / 10 (8, 16 clients)": the rounds of each level."""
    by: dict[int, list[int]] = {}
    for level, n in args.rounds_at.items():
        by.setdefault(n, []).append(level)
    if len(by) == 1:
        return str(next(iter(by)))
    return " / ".join(
        f"{n} ({', '.join(map(str, levels))} clients)"
        for n, levels in sorted(by.items(), reverse=True)
    )


def table(rows: list[dict], args) -> str:
    head = " | ".join(f"K={k}" for k in FIXED_KS)
    lines = [
        f"# speculation policy, served (TP = 1, embedded pair), {args.seconds:g} s x up to "
        f"{_rounds_text(args)} rounds per cell (mean over rounds), {MAX_TOKENS}-token streams, "
        f"goodput ceiling K = {CEILING}; each cell's clients ran {args.settle:g} s unmeasured "
        "before its window",
        f"# after {args.race_after} rounds a fixed K below {args.race_margin:g}x its rule's best "
        "fixed K is not measured again; its figure (in parentheses) is the mean of the rounds "
        "it had. s.e.: the ratio's standard error from both cells' round-to-round spread",
        "",
        f"| Clients | Rule | {head} | goodput | vs best fixed | s.e. | mean k | k chosen (rows) "
        "| predicted / realised tokens | predicted / realised step time |",
        "|---|---|" + "---|" * len(FIXED_KS) + "---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for k in FIXED_KS:
            v = f"{r['fixed'][k]:.1f}"
            if k == r["best_k"]:
                v = f"**{v}**"
            elif r["rounds"][k] < r["goodput_rounds"]:
                v = f"({v})"
            cells.append(v)
        hist = ", ".join(f"{k}: {n}" for k, n in r["chosen_k"].items())
        lines.append(
            f"| {r['clients']} | {r['group']} | {' | '.join(cells)} | {r['goodput']:.1f} | "
            f"{r['ratio']:.3f}x (K={r['best_k']}) | {r['ratio_se']:.3f} | {r['mean_k']:.2f} | "
            f"{hist} | {r['tokens_ratio']:.3f} | {r['time_ratio']:.3f} |"
        )
    worst = min(rows, key=lambda r: r["ratio"])
    paired = min(rows, key=lambda r: r["paired_ratio"])
    lines += [
        "",
        f"# lowest goodput / best fixed K: {worst['ratio']:.3f}x +- {worst['ratio_se']:.3f} "
        f"({worst['rule']}, {worst['clients']} clients); predicted / realised tokens "
        f"{min(r['tokens_ratio'] for r in rows):.3f}-{max(r['tokens_ratio'] for r in rows):.3f}",
        "# paired by round (mean of each round's goodput / best fixed K, +- its s.e.): "
        + ", ".join(
            f"{r['clients']} {r['rule']} {r['paired_ratio']:.3f}x +- {r['paired_se']:.3f}"
            for r in rows
        ),
        f"# lowest paired: {paired['paired_ratio']:.3f}x ({paired['rule']}, "
        f"{paired['clients']} clients)",
    ]
    every = math.prod(r["tie_pass"] for r in rows)
    lines.append(
        "# a policy exactly as fast as the best fixed K would reach 0.97x of it, measured "
        "this way with this run's round-to-round spread (Monte Carlo), with chance: "
        + ", ".join(f"{r['clients']} {r['rule']} {r['tie_pass']:.2f}" for r in rows)
        + f"; in every cell at once {every:.3f}"
    )
    if all(r["held_out_ratio"] for r in rows):
        lines.append(
            "# against the best fixed K chosen on half the rounds and measured on the other "
            "half (no winner's curse): "
            + ", ".join(f"{r['clients']} {r['rule']} {r['held_out_ratio']:.3f}x" for r in rows)
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(RULES), figsize=(11, 4), sharey=True)
    for ax, rule in zip(axes, RULES, strict=True):
        mine = [r for r in rows if r["rule"] == rule]
        levels = [r["clients"] for r in mine]
        for k in FIXED_KS:
            ax.plot(
                levels,
                [r["fixed"][k] for r in mine],
                marker="o",
                alpha=0.6,
                label=f"fixed K={k}" + (" (plain)" if k == 0 else ""),
            )
        ax.plot(
            levels,
            [r["goodput"] for r in mine],
            marker="s",
            color="black",
            linewidth=2.5,
            label="goodput policy",
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(v) for v in levels])
        ax.set_xlabel("concurrent streaming clients")
        ax.set_title(mine[0]["group"] if mine else rule)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("output tokens/s")
    axes[-1].legend(fontsize=8)
    fig.suptitle("Served tokens/s: fixed K vs the goodput policy (TP = 1, embedded pair)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 clients, one round of 3 s")
    parser.add_argument("--levels", type=int, nargs="+", default=None)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds per cell at every level (default: ROUNDS_AT)",
    )
    parser.add_argument("--warmup", type=float, default=None, help="seconds (8; 4 with --quick)")
    parser.add_argument(
        "--race-after", type=int, default=2, help="rounds before clearly slower fixed K drop out"
    )
    parser.add_argument("--race-margin", type=float, default=0.9)
    parser.add_argument(
        "--settle", type=float, default=None, help="unmeasured seconds before each cell's window"
    )
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    args.levels = args.levels or ([8] if args.quick else [1, 4, 8, 16])
    args.seconds = args.seconds or (3.0 if args.quick else 5.0)
    args.rounds_at = {
        level: args.rounds or (1 if args.quick else ROUNDS_AT.get(level, ROUNDS))
        for level in args.levels
    }
    if args.settle is None:
        args.settle = 1.0 if args.quick else 2.0
    if args.warmup is None:
        args.warmup = 4.0 if args.quick else 8.0
    from cactus import environment

    environment.apply()
    exit_on_sigterm()
    started = time.monotonic()
    rows = measure(args)
    print(table(rows, args))
    print(f"# {time.monotonic() - started:.0f} s")
    if args.plot:
        plot(rows, args.plot)
        print(f"# plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
