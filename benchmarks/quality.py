"""Quality vs speed on held-out work: complete functions from their signature + docstring.

Tasks: every function or method with a docstring in the held-out split of the corpus
(models/corpus.py), dedented so it stands alone; the prompt is the source up to the end
of the docstring. A method samples up to `max_tokens` tokens; the completion is cut
where the function ends (the first non-empty line back at column 0). For every method
the same tasks and the same seeds are used.

Per method: compile rate of the cut functions (a non-empty body that Python `compile`
accepts; see `completes`) with a Wilson 95% interval and a two-proportion z-test
against verifier-only sampling; the verifier's
negative log-likelihood per generated token (its raw T = 1 distribution); divergence
nats per generated token; mean acceptance length; tokens/s.
"""

from __future__ import annotations

import ast
import math
import textwrap
import time
from dataclasses import dataclass

import torch

from cactus.detokenize import encode_prompt
from cactus.params import GenerationRequest, SamplingParams, SpeculationParams


@dataclass(frozen=True)
class Task:
    path: str
    name: str
    prompt: str


@dataclass(frozen=True)
class Method:
    label: str
    rule: str
    delta: float = 0.0
    tas_threshold: float = 0.09


@dataclass
class MethodResult:
    method: Method
    n: int = 0
    compiled: int = 0
    tokens: int = 0
    nll_sum: float = 0.0
    divergence: float = 0.0
    drafts: int = 0
    accepted: int = 0
    seconds: float = 0.0

    @property
    def compile_rate(self) -> float:
        return self.compiled / self.n if self.n else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def nll(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else 0.0

    @property
    def divergence_per_token(self) -> float:
        return self.divergence / self.tokens if self.tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 1.0


def default_methods(quick: bool = False) -> list[Method]:
    deltas = (0.1, 1.0, 4.0) if quick else (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
    thresholds = (0.09,) if quick else (0.05, 0.09, 0.2)
    return [
        Method("verifier-only", "none"),
        Method("sps", "sps"),
        *[Method(f"tas eps={t:g}", "tas", tas_threshold=t) for t in thresholds],
        *[Method(f"cactus d={d:g}", "cactus", d) for d in deltas],
        *[Method(f"cactus_exact d={d:g}", "cactus_exact", d) for d in deltas],
    ]


def function_tasks(n: int, *, max_prompt_chars: int = 600) -> list[Task]:
    """n held-out functions with docstrings, taken round-robin across files."""
    from models.corpus import load_texts

    per_file: list[list[Task]] = []
    for path, text in load_texts("heldout"):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and ast.get_docstring(node):
                start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
                prompt = textwrap.dedent("".join(lines[start : node.body[0].end_lineno]))
                if len(prompt) <= max_prompt_chars and _compiles(prompt):
                    found.append(Task(path, node.name, prompt))
        if found:
            per_file.append(found)
    tasks: list[Task] = []
    while len(tasks) < n and any(per_file):
        for found in per_file:
            if found and len(tasks) < n:
                tasks.append(found.pop(0))
    return tasks


def cut_function(completion: str) -> str:
    """The completion up to the end of the function body (first line at column 0)."""
    out = []
    for line in completion.splitlines(keepends=True):
        if line.strip() and not line[0].isspace() and out:
            break
        out.append(line)
    return "".join(out)


def completes(prompt: str, completion: str) -> bool:
    """The function was written: a non-empty body after the docstring, and the prompt
    plus that body compiles. (A bare docstring compiles too, but is no completion: the
    embedded verifier often closes the function at once and starts another.)"""
    body = cut_function(completion)
    return bool(body.strip()) and _compiles(prompt + body)


def _compiles(source: str) -> bool:
    try:
        compile(source, "<completion>", "exec")
        return True
    except (SyntaxError, ValueError):
        return False


def verifier_nll(runner, prompt_ids: list[int], completion_ids: list[int]) -> float:
    """Sum of -log q(token) under the verifier's raw distribution."""
    if not completion_ids:
        return 0.0
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.inference_mode():
        logits = runner.model(input_ids=ids, use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return float(-logp.gather(1, torch.tensor(completion_ids)[:, None]).sum())


def evaluate(
    engine, tasks: list[Task], methods: list[Method], *, max_tokens: int, progress=None
) -> list[MethodResult]:
    """Every method on every task, side by side: after one unmeasured warm-up request per
    method, the tasks run one after another, and each task's methods in an order that
    rotates from task to task, so no method's speed is measured minutes apart from the
    others' or always first after another one."""
    runner = engine.verifier.runner
    results = [MethodResult(method) for method in methods]

    def request(method: Method, prompt: str, seed: int, tokens: int) -> GenerationRequest:
        return GenerationRequest(
            prompt=prompt,
            sampling=SamplingParams(
                max_tokens=tokens, temperature=0.6, top_k=20, top_p=0.95, seed=seed
            ),
            speculation=SpeculationParams(
                rule=method.rule,
                delta=method.delta,
                num_speculative_tokens=4,
                tas_threshold=method.tas_threshold,
            ),
        )

    if tasks:
        for method in methods:  # warm-up, not measured
            engine.generate(request(method, tasks[0].prompt, 0, min(8, max_tokens)))
    for i, task in enumerate(tasks):
        prompt_ids = encode_prompt(engine.tokenizer, task.prompt)
        for j in range(len(methods)):
            res = results[(i + j) % len(methods)]
            start = time.perf_counter()
            out = engine.generate(request(res.method, task.prompt, 1000 + i, max_tokens))
            res.seconds += time.perf_counter() - start
            res.n += 1
            res.compiled += completes(task.prompt, out.text)
            res.tokens += len(out.token_ids)
            res.nll_sum += verifier_nll(runner, prompt_ids, list(out.token_ids))
            res.divergence += out.stats.divergence_nats
            res.drafts += out.stats.num_drafts
            res.accepted += out.stats.num_accepted_tokens
            if progress:
                progress()
    return results


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def two_proportion_p(a: int, n_a: int, b: int, n_b: int) -> float:
    """Two-sided p-value of H0: equal proportions (pooled z-test)."""
    if n_a == 0 or n_b == 0:
        return 1.0
    pooled = (a + b) / (n_a + n_b)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
    if se == 0:
        return 1.0
    z = (a / n_a - b / n_b) / se
    return math.erfc(abs(z) / math.sqrt(2))
