"""Shared fixtures: quiet, offline, deterministic; tiny checkpoints built once per session."""

from __future__ import annotations

import os

from cactus import environment

environment.apply()  # before Ray, transformers and DeepSpeed are imported
# Every Ray head the tests start (here, in servers and scripts they spawn) is a fresh local
# one. Without this, `ray.init()` joins the cluster named in /tmp/ray/ray_current_cluster:
# the last `ray start` on this machine, or a multi-node test run killed before its
# shutdown, whose dead GCS a server then dials for minutes. Explicit addresses still win.
os.environ["RAY_ADDRESS"] = "local"

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from tests.tiny_models import train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tiny_tokenizer):
    """family -> folder of a tiny random model of that family."""
    from tests.tiny_models import FAMILIES, build_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {f: build_tiny(root / f, f, tiny_tokenizer, seed=i) for i, f in enumerate(FAMILIES)}


def embedded_dirs() -> tuple[str, str]:
    """The embedded verifier and draft folders (overridable for development only)."""
    from cactus.environment import DEFAULT_DRAFT, DEFAULT_VERIFIER

    return (
        os.environ.get("CACTUS_TEST_VERIFIER", str(DEFAULT_VERIFIER)),
        os.environ.get("CACTUS_TEST_DRAFT", str(DEFAULT_DRAFT)),
    )


@pytest.fixture(scope="session")
def embedded_engine():
    """In-process engine on the embedded models, shared by the engine tests. Its policy
    is `fixed`: the seeded equalities these tests check (solo vs batched, delta 0 vs
    sps, in-process vs distributed) need a k schedule that does not depend on timings
    (the goodput policy's own tests: tests/workers/test_policy.py)."""
    from workers.local import local_engine
    from workers.scheduler import SchedulerConfig

    verifier, draft = embedded_dirs()
    return local_engine(verifier, draft, scheduler=SchedulerConfig(policy="fixed"))


@pytest.fixture(scope="session")
def heldout_prompts(embedded_engine):
    """16 held-out prompts: the first ~24 tokens of held-out standard-library files that
    start with code (not a licence comment), decoded back to text."""
    from models.corpus import load_texts

    tok = embedded_engine.tokenizer
    prompts = []
    for _path, text in load_texts("heldout"):
        body = text.lstrip()
        if len(body) < 400:
            continue
        ids = tok.encode(body, add_special_tokens=False)[:24]
        prompts.append(tok.decode(ids))
        if len(prompts) == 16:
            break
    assert len(prompts) == 16
    return prompts


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """A real local Ray head for the whole test session (loopback, auth off)."""
    import ray

    tmp = f"/tmp/ray-cactus-{os.getpid()}"
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=tmp,
        log_to_driver=False,
        configure_logging=False,
    )
    yield ray
    ray.shutdown()


class CharTokenizer:
    """Token i decodes to one letter: enough for RequestState's detokeniser."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


def request_state(request, *, seed: int = 0, max_context: int = 512):
    """A RequestState as the engine admits `request`, without a model."""
    from workers.request import RequestState

    return RequestState(
        request,
        list(request.prompt_token_ids),
        seed=seed,
        eos=None,
        tokenizer=CharTokenizer(),
        max_context=max_context,
        sink=lambda _item: None,
    )
