"""Chat completions end to end: a copy of the embedded pair whose tokenizer has a chat
template (added here), served as `make serve` serves it, the official openai client
against its HTTP port. The reply must be the verifier's greedy continuation of exactly
the prompt the template renders."""

from __future__ import annotations

import shutil

import pytest

from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
from tests.conftest import embedded_dirs
from tests.deployments.test_serve_e2e import serving
from workers.tp_verifier import free_port

pytestmark = pytest.mark.slow
TEMPLATE = (
    "{% for m in messages %}### {{ m.role }}\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chat-pair")
    dirs = {}
    for name, src in zip(("verifier", "draft"), embedded_dirs(), strict=True):
        dirs[name] = root / name
        shutil.copytree(src, dirs[name])
        tok = AutoTokenizer.from_pretrained(dirs[name])
        tok.chat_template = TEMPLATE
        tok.save_pretrained(dirs[name])
    port, http_port = free_port(), free_port()
    config = {
        "models": {"verifier": str(dirs["verifier"]), "draft": str(dirs["draft"])},
        "tp_size": 1,
        "grpc_port": port,
        "http_port": http_port,
    }
    with serving(config, root):
        yield f"http://127.0.0.1:{http_port}/v1", dirs["verifier"]


def test_chat_completions_render_the_template_and_stream(chat_server, embedded_engine):
    import openai
    from transformers import AutoTokenizer

    base_url, verifier_dir = chat_server
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
    ]
    reply = client.chat.completions.create(
        model="verifier", messages=messages, max_completion_tokens=16, temperature=0.0
    )
    ids = AutoTokenizer.from_pretrained(verifier_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    want = embedded_engine.generate(
        GenerationRequest(
            prompt_token_ids=tuple(ids),
            sampling=SamplingParams(max_tokens=16, temperature=0.0),
            speculation=SpeculationParams(rule="none"),
        )
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert reply.usage.prompt_tokens == len(ids) and reply.object == "chat.completion"
    chunks = list(
        client.chat.completions.create(
            model="verifier",
            messages=messages,
            max_completion_tokens=16,
            temperature=0.0,
            stream=True,
            logprobs=True,
            top_logprobs=2,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == len(want.token_ids) and all(e.logprob == 0.0 for e in entries)
    assert all(len(e.top_logprobs) == 2 for e in entries)
