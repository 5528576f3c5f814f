"""The Triton kernel against the torch path: same tokens for the same uniforms.

Without a GPU the kernel runs on CPU tensors through TRITON_INTERPRET=1 (set here,
before the kernel module is imported, because Triton reads it at decoration). The real
CUDA code generation is checked too: the kernel is compiled ahead of time to an sm_90
cubin, which needs no GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# triton is a dev pin (requirements-dev.txt): an import that fails is a failure, not a skip
import kernels.triton_accept as triton_accept
from kernels import RULES, AcceptMetadata, speculative_accept
from tests.kernels.cases import (
    edge_case,
    empty_residual_case,
    off_support_empty_residual_case,
    random_case,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(3, 4, 50), (2, 1, 2), (4, 3, 2100), (6, 5, 17)]


def _both(ids, draft, target, uniforms, **kw):
    want = speculative_accept(ids, draft, target, uniforms=uniforms, backend="torch", **kw)
    dev = [t.to(DEVICE) for t in (ids, draft, target, uniforms)]
    budget = kw.pop("divergence_budget", None)
    meta = AcceptMetadata(
        uniforms=dev[3], divergence_budget=None if budget is None else budget.to(DEVICE), **kw
    )
    return want, triton_accept.speculative_accept_triton(*dev[:3], meta)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_torch_path(rule, shape):
    batch, k, vocab = shape
    ids, draft, target, uniforms = random_case(sum(shape), batch=batch, k=k, vocab=vocab)
    delta = torch.linspace(0.0, 2.0, batch, dtype=torch.float64)
    budget = torch.linspace(0.0, 1.0, batch, dtype=torch.float64) if k > 2 else None
    want, got = _both(
        ids, draft, target, uniforms, rule=rule, delta=delta, divergence_budget=budget
    )
    assert torch.equal(want.output_token_ids, got.output_token_ids.cpu())
    assert torch.equal(want.num_accepted, got.num_accepted.cpu())
    torch.testing.assert_close(
        want.divergence_nats, got.divergence_nats.cpu(), rtol=1e-9, atol=1e-12
    )
    assert torch.equal(want.budget_exhausted, got.budget_exhausted.cpu())


@pytest.mark.parametrize("delta", [0.0, 0.5, 50.0])
@pytest.mark.parametrize("rule", RULES)
def test_triton_edge_rows(rule, delta):
    ids, draft, target, uniforms = edge_case()
    budget = torch.linspace(0.0, 0.5, ids.shape[0], dtype=torch.float64)
    for kw in ({}, {"divergence_budget": budget}):
        want, got = _both(ids, draft, target, uniforms, rule=rule, delta=delta, **kw)
        assert torch.equal(want.output_token_ids, got.output_token_ids.cpu())
        assert torch.equal(want.num_accepted, got.num_accepted.cpu())
        torch.testing.assert_close(
            want.divergence_nats, got.divergence_nats.cpu(), rtol=1e-9, atol=1e-12
        )
        assert torch.equal(want.budget_exhausted, got.budget_exhausted.cpu())
        if kw and delta == 50.0 and rule in ("cactus", "cactus_exact"):
            assert want.budget_exhausted.any()  # the budgets bind: the flag is compared


@pytest.mark.parametrize("rule", ["sps", "cactus", "cactus_exact"])
def test_triton_empty_residual(rule):
    want, got = _both(*empty_residual_case(), rule=rule, delta=0.0)
    assert (got.num_accepted.cpu() == 0).all()
    assert torch.equal(want.output_token_ids, got.output_token_ids.cpu())
    # q_0 = 0 < p_0: the empty residual samples h, never token 0
    want, got = _both(*off_support_empty_residual_case(), rule=rule, delta=0.0)
    assert int(got.output_token_ids[0, 0]) == int(want.output_token_ids[0, 0]) == 1


def test_triton_delta_zero_equals_sps():
    ids, draft, target, uniforms = random_case(77, batch=5, k=4, vocab=40)
    dev = [t.to(DEVICE) for t in (ids, draft, target, uniforms)]
    sps = triton_accept.speculative_accept_triton(
        *dev[:3], AcceptMetadata(rule="sps", uniforms=dev[3])
    )
    for rule in ("cactus", "cactus_exact"):
        ours = triton_accept.speculative_accept_triton(
            *dev[:3], AcceptMetadata(rule=rule, uniforms=dev[3])
        )
        assert torch.equal(sps.output_token_ids, ours.output_token_ids)


def test_triton_counts_a_probability_rounded_above_one_as_one():
    """The torch path's clamp of q_n and p_n, in the kernel: the same tokens, a
    divergence of 0 (not NaN), and cactus at delta 0 equal to sps."""
    from tests.kernels.test_rejection import above_one_case

    ids, draft, target, uniforms = above_one_case()
    for rule in ("sps", "cactus", "cactus_exact"):
        want, got = _both(ids, draft, target, uniforms, rule=rule, delta=0.0)
        assert torch.equal(want.output_token_ids, got.output_token_ids.cpu()), rule
        assert int(got.num_accepted[0]) == 1, rule
        assert float(got.divergence_nats[0]) == 0.0, rule


def test_triton_rejects_bad_input():
    ids, draft, target, _ = random_case(0, batch=2, k=3, vocab=5)
    with pytest.raises(ValueError, match="delta"):
        triton_accept.speculative_accept_triton(
            ids, draft, target, AcceptMetadata(rule="cactus", delta=-1.0)
        )


AOT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels.triton_accept import accept_kernel
    sig = {"ids_ptr": "*i64", "draft_ptr": "*fp32", "target_ptr": "*fp32", "uni_ptr": "*fp64",
           "delta_ptr": "*fp64", "budget_ptr": "*fp64", "out_ptr": "*i64", "num_ptr": "*i64",
           "div_ptr": "*fp64", "capped_ptr": "*i32", "K": "i32", "V": "i32",
           "tas_threshold": "fp32", "tas_alpha": "fp32", "RULE": "constexpr",
           "HAS_BUDGET": "constexpr", "BLOCK": "constexpr", "STEPS": "constexpr"}
    for rule in range(4):
        src = ASTSource(fn=accept_kernel, signature=sig,
                        constexprs={"RULE": rule, "HAS_BUDGET": True, "BLOCK": 1024, "STEPS": 64})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        assert len(compiled.asm["cubin"]) > 1000
        print("compiled", rule)
    """
)


@pytest.mark.slow
def test_kernel_compiles_for_cuda_sm90_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", AOT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == 4
