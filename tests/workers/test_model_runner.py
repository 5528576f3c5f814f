"""ModelRunner on tiny random checkpoints of four families: cache, block forward, rollback."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import embedded_dirs
from tests.tiny_models import FAMILIES
from workers.model_runner import ModelRunner


def _full_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return runner.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_then_continue_equals_full_recompute(family, tiny_checkpoints):
    runner = ModelRunner(tiny_checkpoints[family])
    assert runner.model.config.model_type == family
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, runner.vocab_size, (12,), generator=gen).tolist()
    block = torch.randint(0, runner.vocab_size, (5,), generator=gen).tolist()
    more = torch.randint(0, runner.vocab_size, (4,), generator=gen).tolist()

    runner.start("a")
    runner.forward("a", prompt)
    runner.forward("a", block)  # verify K + 1 ...
    runner.rollback("a", 3)  # ... reject the last 3
    got = runner.forward("a", more)
    assert runner.length("a") == 12 + 2 + 4
    want = _full_logits(runner, prompt + block[:2] + more)[-4:]
    assert float((got - want).abs().max()) < 1e-5

    # A second sequence does not disturb the first.
    runner.start("b")
    runner.forward("b", prompt[:3])
    assert runner.num_sequences == 2
    nxt = runner.forward("a", [7])
    want = _full_logits(runner, [*prompt, *block[:2], *more, 7])[-1:]
    assert float((nxt - want).abs().max()) < 1e-5
    assert runner.release("a") and runner.release("b") and not runner.release("b")
    assert runner.num_sequences == 0


def test_rollback_bounds(tiny_checkpoints):
    runner = ModelRunner(tiny_checkpoints["llama"])
    runner.start("s")
    runner.forward("s", [1, 2, 3])
    with pytest.raises(ValueError, match="num_tokens"):
        runner.rollback("s", 4)
    runner.rollback("s", 0)
    assert runner.length("s") == 3
    assert runner.forward("s", []).shape == (0, runner.vocab_size)


def test_a_model_handed_in_must_already_be_on_the_runners_device():
    """A DeepSpeed shard is handed to the runner, not moved by it: one left on another
    device (DeepSpeed's CPU accelerator on a GPU rank) is a clear error, not a forward
    that mixes devices."""
    from workers.model_runner import LoadedModel

    verifier, _ = embedded_dirs()
    cpu = LoadedModel(verifier)
    with pytest.raises(ValueError, match="device: the model is on cpu"):
        LoadedModel(verifier, device="meta", model=cpu.model)
    assert LoadedModel(verifier, model=cpu.model).model is cpu.model
