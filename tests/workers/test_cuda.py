"""The CUDA paths, on a GPU machine only: `pytest -m gpu` (the default run deselects the
`gpu` marker, pyproject.toml; without CUDA these skip). The engine, the acceptance
kernels and a distributed TP = 1 group on one GPU must keep the properties the CPU
tests prove: every rule's greedy tokens are the verifier's, a request gives its solo
tokens in a mixed batch, and the Triton kernel gives the torch path's tokens at a real
vocabulary. One prepared run on a lent GPU: `pytest -m gpu tests/workers/test_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch

from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
from tests.conftest import embedded_dirs
from tests.workers import test_batched_engine as batched

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cuda_engine():
    from workers.local import local_engine
    from workers.scheduler import SchedulerConfig

    verifier, draft = embedded_dirs()
    return local_engine(verifier, draft, device="cuda", scheduler=SchedulerConfig(policy="fixed"))


def test_the_engine_on_cuda_keeps_solo_tokens_in_a_mixed_batch(cuda_engine, heldout_prompts):
    assert cuda_engine.verifier.runner.device.type == "cuda"
    batched.test_mixed_batch_gives_each_request_its_solo_tokens(cuda_engine, heldout_prompts)


def test_every_rules_greedy_on_cuda_is_the_verifiers_greedy(cuda_engine, heldout_prompts):
    batched.test_greedy_batch_of_every_rule_equals_verifier_greedy(cuda_engine, heldout_prompts)


@pytest.mark.parametrize("rule", ["sps", "cactus", "cactus_exact", "tas"])
def test_triton_gives_the_torch_paths_tokens_at_a_real_vocabulary(rule):
    from kernels import AcceptMetadata, speculative_accept

    batch, k, vocab = 32, 4, 151_936
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.softmax(3 * torch.randn(batch, k, vocab, device="cuda", generator=gen), -1)
    q = torch.softmax(3 * torch.randn(batch, k + 1, vocab, device="cuda", generator=gen), -1)
    ids = torch.multinomial(p.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    uniforms = torch.rand(batch, k + 1, dtype=torch.float64, device="cuda", generator=gen)
    out = {}
    for backend in ("torch", "triton"):
        meta = AcceptMetadata(rule=rule, delta=1.0, uniforms=uniforms, backend=backend)
        out[backend] = speculative_accept(ids, p, q, meta)
    assert torch.equal(out["torch"].num_accepted, out["triton"].num_accepted)
    assert torch.equal(out["torch"].output_token_ids, out["triton"].output_token_ids)
    torch.testing.assert_close(
        out["torch"].divergence_nats, out["triton"].divergence_nats, rtol=1e-9, atol=1e-12
    )


def test_a_distributed_group_on_one_gpu_gives_the_in_process_tokens(
    ray_session, cuda_engine, heldout_prompts
):
    """TP = 1: rank 0 and the draft actor share the one GPU (fractions of it)."""
    from workers.group import ActorResources, EngineGroup, GroupConfig

    verifier, draft = embedded_dirs()
    share = ActorResources(num_cpus=0.25, num_gpus=0.5)
    group = EngineGroup(
        GroupConfig(
            verifier, draft, device="cuda", draft=share, rank=share, speculation_policy="fixed"
        )
    ).start()
    try:
        for rule in ("cactus", "sps"):
            req = GenerationRequest(
                prompt=heldout_prompts[3],
                sampling=SamplingParams(max_tokens=48, temperature=0.7, seed=7),
                speculation=SpeculationParams(rule=rule, delta=1.0),
            )
            assert group.generate(req).token_ids == cuda_engine.generate(req).token_ids, rule
    finally:
        group.shutdown()
