"""In-process Drafter and Verifier around a ModelRunner (gpt-fast style bookkeeping).

Both keep the committed text in the model's KV cache except its last token or two,
the "pending" tokens the next forward consumes. Rolling back is a cache crop.
"""

from __future__ import annotations

import torch

from cactus.errors import StaleBlockError
from cactus.params import SamplingParams
from kernels import draw_uniforms, inverse_cdf_sample, processed_probs
from workers.interfaces import DraftBlock
from workers.model_runner import ModelRunner


class _Request:
    def __init__(self, pending: list[int], sampling: SamplingParams | None, seed: int) -> None:
        self.pending = pending  # committed tokens not yet in the cache
        self.sampling = sampling
        self.generator = torch.Generator().manual_seed(seed)
        self.committed = 0  # prompt + generated tokens
        self.drafted: list[int] = []  # the last proposed block


class LocalDrafter:
    """Draft model in this process; samples each drafted token from the processed p."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._reqs: dict[str, _Request] = {}

    def start(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, seed: int
    ) -> None:
        self.runner.start(request_id)
        self.runner.forward(request_id, list(prompt_ids[:-1]))
        req = _Request([prompt_ids[-1]], sampling, seed)
        req.committed = len(prompt_ids)
        self._reqs[request_id] = req

    def propose(self, request_id: str, k: int) -> DraftBlock:
        req = self._reqs[request_id]
        if req.drafted:
            raise StaleBlockError(f"{request_id}: the previous block was never committed")
        s = req.sampling
        feed, tokens, rows = req.pending, [], []
        for i in range(k):
            logits = self.runner.forward(request_id, feed)[-1:]  # [1, V]
            probs = processed_probs(logits, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
            token = int(inverse_cdf_sample(probs, draw_uniforms([req.generator], 1)[:, 0])[0])
            tokens.append(token)
            rows.append(probs[0])
            feed = [token] if i < k - 1 else []
        req.pending, req.drafted = [], tokens
        return DraftBlock(request_id, req.committed, tuple(tokens), torch.stack(rows))

    def commit(
        self, request_id: str, epoch: int, num_accepted: int, next_token: int, *, next_k: int = 0
    ) -> None:
        req = self._reqs[request_id]
        if epoch != req.committed:
            raise StaleBlockError(f"{request_id}: commit for length {epoch}, at {req.committed}")
        k = len(req.drafted)
        # The cache holds the old pending tokens and drafted[:k-1]; keep drafted[:m].
        if k == 0:  # nothing was drafted (the engine decoded plainly this step)
            req.pending.append(next_token)
        elif num_accepted < k:
            self.runner.rollback(request_id, k - 1 - num_accepted)
            req.pending = [next_token]
        else:
            req.pending = [req.drafted[-1], next_token]
        req.committed = epoch + num_accepted + 1
        req.drafted = []

    def release(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)
        self.runner.release(request_id)


class LocalVerifier:
    """Verifier model in this process: scores [last committed token] + drafted tokens."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.max_context = runner.max_context
        self._pending: dict[str, int] = {}
        self._scored: dict[str, int] = {}

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        self.runner.start(request_id)
        self.runner.forward(request_id, list(prompt_ids[:-1]))
        self._pending[request_id] = prompt_ids[-1]

    def score(self, request_id: str, draft_token_ids: list[int]) -> torch.Tensor:
        tokens = [self._pending[request_id], *draft_token_ids]
        self._scored[request_id] = len(draft_token_ids)
        return self.runner.forward(request_id, tokens)

    def commit(self, request_id: str, num_accepted: int, next_token: int) -> None:
        self.runner.rollback(request_id, self._scored.pop(request_id) - num_accepted)
        self._pending[request_id] = next_token

    def release(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._scored.pop(request_id, None)
        self.runner.release(request_id)


def local_engine(
    verifier_dir: str, draft_dir: str, *, dtype: str = "float32", device: str = "cpu", limits=None
):
    """An in-process SpeculativeEngine over two local checkpoint folders."""
    from workers.engine import SpeculativeEngine

    verifier = ModelRunner(verifier_dir, dtype=dtype, device=device)
    draft = ModelRunner(draft_dir, dtype=dtype, device=device)
    if draft.vocab_size != verifier.vocab_size:
        raise ValueError(
            f"draft_dir: vocabulary {draft.vocab_size} differs from the verifier's "
            f"{verifier.vocab_size}; the pair must share a tokenizer"
        )
    return SpeculativeEngine(
        LocalDrafter(draft), LocalVerifier(verifier), verifier.tokenizer, limits=limits
    )
