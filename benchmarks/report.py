"""The bench report: one markdown file and its PNG plots, written side by side."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.quality import two_proportion_p, wilson


def _plots(path: Path, quality, load) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = path.with_suffix("")
    names = []

    def save(fig, suffix):
        out = Path(f"{stem}-{suffix}.png")
        fig.tight_layout()
        fig.savefig(out, dpi=110)
        plt.close(fig)
        names.append(out.name)

    swept = [r for r in quality if r.method.rule in ("cactus", "cactus_exact")]
    if swept:
        for metric, label, suffix in (
            ("acceptance_length", "mean acceptance length", "acceptance-vs-delta"),
            ("tokens_per_s", "tokens/s", "speed-vs-delta"),
        ):
            fig, ax = plt.subplots(figsize=(5.5, 3.6))
            for rule in ("cactus", "cactus_exact"):
                pts = sorted(
                    (r.method.delta, getattr(r, metric)) for r in swept if r.method.rule == rule
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=rule)
            for r in quality:
                if r.method.rule in ("sps", "none"):
                    ax.axhline(getattr(r, metric), ls="--", lw=1, color="grey")
                    ax.annotate(r.method.label, (0, getattr(r, metric)), fontsize=7)
            ax.set_xscale("log")
            ax.set_xlabel("delta (nats)")
            ax.set_ylabel(label)
            ax.legend()
            save(fig, suffix)
    for metric, label, suffix in (
        (
            ("compile_rate", "compile rate", "frontier-compile"),
            ("nll", "verifier NLL / token (lower is better)", "frontier-nll"),
        )
        if quality
        else ()
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in quality:
            ax.scatter(r.tokens_per_s, getattr(r, metric))
            ax.annotate(r.method.label, (r.tokens_per_s, getattr(r, metric)), fontsize=7)
        ax.set_xlabel("tokens/s (single stream, 2 threads)")
        ax.set_ylabel(label)
        save(fig, suffix)
    if load:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
        for rule in sorted({x["rule"] for x in load}):
            pts = sorted(
                (x["clients"], x["tokens_per_s"], x["ttft_p50"]) for x in load if x["rule"] == rule
            )
            a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=rule)
            a2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=rule)
        a1.set_xlabel("concurrent streams")
        a1.set_ylabel("output tokens/s")
        a2.set_xlabel("concurrent streams")
        a2.set_ylabel("time to first token p50 (s)")
        a1.legend()
        save(fig, "load")
    return names


def _quality_table(quality) -> list[str]:
    base = next((r for r in quality if r.method.rule == "none"), None)
    rows = [
        "| method | compile rate [95% CI] | vs verifier-only | NLL/token | nats/token "
        "| accept len | tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in quality:
        lo, hi = wilson(r.compiled, r.n)
        if base is None or r is base:
            versus = "reference"
        else:
            p = two_proportion_p(r.compiled, r.n, base.compiled, base.n)
            versus = f"p={p:.2f} ({'differs' if p < 0.05 else 'no significant difference'})"
        rows.append(
            f"| {r.method.label} | {r.compile_rate:.2f} [{lo:.2f}, {hi:.2f}] "
            f"({r.compiled}/{r.n}) | {versus} | {r.nll:.3f} | "
            f"{r.divergence_per_token:.3f} | {r.acceptance_length:.2f} | "
            f"{r.tokens_per_s:.1f} |"
        )
    return rows


def _load_table(load) -> list[str]:
    rows = [
        "| clients | rule | tokens/s | vs 1 client | requests | errors | TTFT p50 / p99 (ms) "
        "| ITL p50 / p99 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    one = {x["rule"]: x["tokens_per_s"] for x in load if x["clients"] == 1}
    for x in sorted(load, key=lambda x: (x["clients"], x["rule"])):
        ratio = f"{x['tokens_per_s'] / one[x['rule']]:.2f}x" if one.get(x["rule"]) else "-"

        def ms(v):
            return (
                "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1e3:.0f}"
            )

        rows.append(
            f"| {x['clients']} | {x['rule']} | {x['tokens_per_s']:.1f} | {ratio} | "
            f"{x['requests']} | {x['errors']} | {ms(x['ttft_p50'])} / "
            f"{ms(x['ttft_p99'])} | {ms(x['itl_p50'])} / {ms(x['itl_p99'])} |"
        )
    return rows


def write_report(
    path: Path,
    *,
    mode,
    machine,
    micro,
    tasks,
    quality,
    load,
    seconds,
    settings,
    extra_plots=(),
    command="",
    chaos="",
    policy="",
    phases=None,
    failures=None,
) -> None:
    """phases: phase name -> seconds, shown beside the wall time; failures: phase name ->
    the error that stopped it, shown in its section instead of "(skipped)"."""
    failures = failures or {}
    spent = (
        " (" + ", ".join(f"{name} {sec:.0f} s" for name, sec in phases.items()) + ")"
        if phases
        else ""
    )
    plots = [*extra_plots, *_plots(path, quality, load)]
    lines = [
        f"# Cactus benchmark report ({mode})",
        "",
        f"Machine: {machine}. Wall time {seconds / 60:.1f} min{spent}. Command: "
        f"`python -m benchmarks.run{' ' + command if command else ''}`. "
        "Generated; do not edit by hand.",
        "",
        "## 1. Micro-benchmarks",
        "",
        micro or failures.get("micro", "(skipped)"),
        "",
        "## 2. Quality vs speed on held-out function completions",
        "",
        f"{len(tasks)} held-out functions (signature + docstring as the prompt), "
        f"{settings['max_tokens']} tokens sampled at temperature 0.6, top_k 20, top_p 0.95, "
        "K = 4, seeds 1000 + task index, identical for every method. Compile rate: the "
        "completion cut at the end of the function must have a non-empty body and the "
        "function must pass Python `compile`; 95% Wilson interval; "
        "vs verifier-only: two-proportion z-test. NLL: the verifier's raw (T = 1) "
        "negative log-likelihood of the generated tokens. nats/token: divergence_nats "
        "per generated token.",
        "",
        *(_quality_table(quality) if quality else [failures.get("quality", "(skipped)")]),
        "",
        "## 3. Serving load",
        "",
        "Streaming gRPC clients against `python -m deployments.serve` (embedded models, "
        f"TP = 1), back-to-back {settings.get('load_max_tokens', 64)}-token requests, "
        f"{settings['seconds']:g} s per level, levels interleaved by rule; each rule first "
        f"runs {settings.get('load_warmup_s', 0):g} s unmeasured at the top level's load, and "
        f"every cell settles {settings.get('load_settle_s', 0):g} s at its own load before "
        "its window.",
        "",
        *(_load_table(load) if load else [failures.get("load", "(skipped)")]),
        "",
        "## 4. Speculation policy: goodput vs fixed K, served",
        "",
        policy or failures.get("policy", "(skipped)"),
        "",
        "## 5. Chaos: engine actors killed under streaming load",
        "",
        chaos or failures.get("chaos", "(skipped)"),
        "",
        "## 6. Plots",
        "",
        *[f"![{name}]({name})" for name in plots],
        "",
    ]
    path.write_text("\n".join(lines))
