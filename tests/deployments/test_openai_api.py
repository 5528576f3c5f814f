"""The OpenAI-compatible routes, in-process: the official `openai` client (its async
client over an ASGI transport) against the FastAPI app of a shim with a fake engine.
The end-to-end tests against `make serve`'s HTTP port are in test_serve_e2e.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import httpx2
import openai
import pytest

from cactus.errors import WorkerUnavailableError
from cactus.params import GenerationRequest
from client import CactusClient
from deployments.ingress import tokenize
from deployments.openai_api import build_routes
from tests.deployments.test_ingress import FakeEngine, _shim
from workers.request import GenerationChunk

TOKEN = "tok-123"


def _app(engine=None, **config):
    shim = _shim(engine or FakeEngine(), **config)
    return shim, build_routes(shim, tokenize, logging.getLogger("test"))


def _client(app, token=TOKEN) -> openai.AsyncOpenAI:
    transport = httpx2.ASGITransport(app=app)
    return openai.AsyncOpenAI(
        base_url="http://cactus.test/v1",
        api_key=token,
        http_client=httpx2.AsyncClient(transport=transport, base_url="http://cactus.test"),
        max_retries=0,
    )


def _raw(app, method, path, **kw):
    async def go():
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://cactus.test") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_models_completions_and_extras_with_the_official_client(ray_session):
    shim, app = _app()
    client = _client(app)

    async def go():
        models = await client.models.list()
        model = models.data[0].id
        reply = await client.completions.create(
            model=model,
            prompt="def f():",
            max_tokens=5,
            temperature=0.5,
            seed=7,
            stop=["\n\n"],
            extra_body={
                "rule": "sps",
                "delta": 0.0,
                "top_k": 20,
                "num_speculative_tokens": 3,
                "stop_token_ids": [5, 9],
                "time_limit_s": 30.0,
            },
        )
        return model, reply

    model, reply = asyncio.run(go())
    assert model == "verifier"
    assert reply.choices[0].text == "abc" and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3 and reply.model == model
    cactus = reply.model_extra["cactus"]
    assert cactus["num_accepted_tokens"] == 2 and isinstance(cactus["seed"], int)
    assert isinstance(cactus["accepted_per_position"], list)
    # the README's quick start reads these
    assert isinstance(cactus["mean_acceptance_length"], float)
    assert isinstance(cactus["divergence_nats"], float)
    req = shim.engine.seen[-1]
    assert req.sampling.stop_token_ids == (5, 9) and req.time_limit_s == 30.0
    assert req.sampling.max_tokens == 5 and req.sampling.seed == 7 and req.sampling.top_k == 20
    assert req.sampling.stop == ("\n\n",) and req.speculation.rule == "sps"
    assert req.speculation.num_speculative_tokens == 3 and req.prompt_token_ids


def test_the_server_request_timeout_caps_an_http_time_limit(ray_session):
    shim, app = _app(limits={"request_timeout_s": 5.0})
    cases = [({}, 5.0), ({"time_limit_s": 2.0}, 2.0), ({"time_limit_s": 30.0}, 5.0)]
    # 0 is none, as the proto has it over gRPC (it was a 400 over HTTP): the ceiling
    cases.append(({"time_limit_s": 0}, 5.0))
    for extra, want in cases:
        body = {"model": "verifier", "prompt": "def f():", "max_tokens": 3, **extra}
        assert _raw(app, "POST", "/v1/completions", json=body).status_code == 200
        assert shim.engine.seen[-1].time_limit_s == want, (extra, shim.engine.seen[-1])
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x", "time_limit_s": -1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "time_limit_s"
    # Infinity (Python's json writes and reads it) is refused under a ceiling, not capped
    seen = len(shim.engine.seen)
    for bad in ("Infinity", "NaN", "1" + "0" * 400):
        reply = _raw(
            app,
            "POST",
            "/v1/completions",
            content=b'{"prompt": "x", "time_limit_s": ' + bad.encode() + b"}",
            headers={"content-type": "application/json"},
        )
        assert reply.status_code == 400, (bad, reply.text)
        assert reply.json()["error"]["param"] == "time_limit_s"
    assert len(shim.engine.seen) == seen


def test_an_empty_rule_is_the_servers_default(ray_session):
    """As on gRPC, where proto3 cannot tell rule "" from unset (test_ingress.py)."""
    shim, app = _app(speculation={"default_rule": "sps"})
    for rule in ("", None):
        body = {"prompt": "def f():", "max_tokens": 3, "rule": rule}
        assert _raw(app, "POST", "/v1/completions", json=body).status_code == 200
        assert shim.engine.seen[-1].speculation.rule == "sps"
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x", "rule": " "})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "rule"


def test_streaming_is_sse_ending_in_done_with_usage_when_asked(ray_session):
    _, app = _app()
    client = _client(app)

    async def go():
        stream = await client.completions.create(
            model="verifier",
            prompt="x",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        return [chunk async for chunk in stream]

    chunks = asyncio.run(go())
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "xxx"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    raw = _raw(
        app,
        "POST",
        "/v1/completions",
        json={"prompt": "x", "stream": True},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_chat_uses_the_chat_template_and_says_when_there_is_none(ray_session):
    shim, app = _app()
    client = _client(app)
    messages = [{"role": "user", "content": "hello"}]
    with pytest.raises(openai.BadRequestError) as err:
        asyncio.run(client.chat.completions.create(model="verifier", messages=messages))
    assert "chat template" in err.value.body["message"] and err.value.body["param"] == "messages"
    shim.tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    reply = asyncio.run(client.chat.completions.create(model="verifier", messages=messages))
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == "abc" and reply.object == "chat.completion"
    want = shim.tokenizer.encode("<user>hello\n<assistant>", add_special_tokens=False)
    assert list(shim.engine.seen[-1].prompt_token_ids) == want

    async def stream():
        s = await client.chat.completions.create(model="verifier", messages=messages, stream=True)
        return [c async for c in s]

    chunks = asyncio.run(stream())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "xxx"


def test_a_batch_of_prompts_is_a_choice_each(ray_session):
    """prompt as a list of strings or id lists (OpenAI's API and vLLM take it; LangChain
    sends up to 20): one engine request each, a choice each in order with its own
    `cactus` object, usage summed. An empty batch and one over 64 prompts are 400s; a
    failing request fails the response, OpenAI-shaped (streamed batches: below)."""
    shim, app = _app()
    client = _client(app)
    reply = asyncio.run(
        client.completions.create(model="verifier", prompt=["ab", "cd"], max_tokens=3)
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == ["abc", "abc"]
    seen = shim.engine.seen[-2:]
    assert sorted(tuple(r.prompt_token_ids) for r in seen) == sorted(
        tuple(shim.tokenizer.encode(p, add_special_tokens=False)) for p in ("ab", "cd")
    )
    assert len({r.request_id for r in seen}) == 2
    assert all(c.model_extra["cactus"]["num_accepted_tokens"] == 2 for c in reply.choices)
    assert "cactus" not in reply.model_extra  # README: per choice, none at the top
    assert reply.usage.completion_tokens == 6
    assert reply.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in seen)
    ids = _raw(app, "POST", "/v1/completions", json={"prompt": [[5, 6], [7], "x"]})
    assert ids.status_code == 200 and len(ids.json()["choices"]) == 3, ids.text
    x = tuple(shim.tokenizer.encode("x", add_special_tokens=False))
    got = sorted(tuple(r.prompt_token_ids) for r in shim.engine.seen[-3:])
    assert got == sorted([(5, 6), (7,), x])
    for body, param in (
        ({"prompt": []}, "prompt"),
        ({"prompt": ["x"] * 65}, "prompt"),
        ({"prompt": ["a", 5]}, "prompt"),
    ):
        reply = _raw(app, "POST", "/v1/completions", json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, body

    # one prompt's request fails: the response fails at once (500, with the batch's
    # request id), and the other, still running, is cancelled in the engine
    class OneFails(FakeEngine):
        async def agenerate(self, req):
            self.seen.append(req)
            if req.request_id.endswith("-0"):
                raise RuntimeError("boom")
            await asyncio.sleep(60)

    shim, broken = _app(OneFails())
    reply = _raw(broken, "POST", "/v1/completions", json={"prompt": ["a", "b"]})
    assert reply.status_code == 500, reply.text
    failed, running = (r.request_id for r in shim.engine.seen)
    assert failed.rsplit("-", 1)[0] in reply.json()["error"]["message"]
    assert shim.engine.cancelled == [running] and running.endswith("-1")


def test_served_model_names_are_what_the_api_answers_to(ray_session):
    """models.served_model_name (vLLM's --served-model-name): /v1/models lists each, a
    request may name any and its response carries that one (the first when it names
    none), and the folder's name is then unknown."""
    _, app = _app(models={"served_model_name": ["coder", "org/Coder-8B"]})
    listed = _raw(app, "GET", "/v1/models").json()["data"]
    assert [card["id"] for card in listed] == ["coder", "org/Coder-8B"]
    assert _raw(app, "GET", "/v1/models/org/Coder-8B").json()["id"] == "org/Coder-8B"
    for sent, echoed in (("org/Coder-8B", "org/Coder-8B"), ("coder", "coder"), (None, "coder")):
        body = {"prompt": "x", "max_tokens": 2, "model": sent}
        reply = _raw(app, "POST", "/v1/completions", json=body)
        assert reply.status_code == 200 and reply.json()["model"] == echoed, reply.text
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x", "model": "verifier"})
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and "'org/Coder-8B'" in error["message"]
    assert _raw(app, "GET", "/v1/models/verifier").status_code == 404


def test_a_negative_seed_is_its_twos_complement(ray_session):
    """vLLM takes signed 64-bit seeds; the engine's are unsigned: the same 64 bits."""
    shim, app = _app()
    for sent, used in ((-1, 2**64 - 1), (-(2**63), 2**63), (7, 7), (2**64 - 1, 2**64 - 1)):
        reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x", "seed": sent})
        assert reply.status_code == 200, reply.text
        assert shim.engine.seen[-1].sampling.seed == used
    for sent in (-(2**63) - 1, 2**64):
        reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x", "seed": sent})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "seed", sent


def test_an_unset_max_tokens_fits_the_context_over_http(ray_session):
    """As over gRPC (test_ingress): the server's default shrinks to what the prompt
    leaves of the context (1024 here), a value the client sent does not, for both routes
    and both of chat's names for it."""
    shim, app = _app(sampling={"default_max_tokens": 64})
    shim.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    ids = [5] * 1000
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": ids, "max_tokens": None})
    assert reply.status_code == 200, reply.text
    assert shim.engine.seen[-1].sampling.max_tokens == 24
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": ids, "max_tokens": 30})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
    text = shim.tokenizer.decode(ids)
    chat_ids = shim.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    room = 1024 - len(chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"])
    assert 1 <= room < 64, room
    messages = [{"role": "user", "content": text}]
    reply = _raw(app, "POST", "/v1/chat/completions", json={"messages": messages})
    assert reply.status_code == 200, reply.text
    assert shim.engine.seen[-1].sampling.max_tokens == room
    for name in ("max_tokens", "max_completion_tokens"):
        body = {"messages": messages, name: 64}
        reply = _raw(app, "POST", "/v1/chat/completions", json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == name, reply.text
    # under a KV budget tighter than the context, the default fits the budget
    shim, app = _app(sampling={"default_max_tokens": 64}, batching={"kv_budget_tokens": 64})
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": [5] * 10})
    assert reply.status_code == 200, reply.text
    assert shim.engine.seen[-1].sampling.max_tokens == 54
    # default_max_tokens null: OpenAI's and vLLM's default, all the prompt leaves
    shim, app = _app(sampling={"default_max_tokens": None})
    shim.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": [5] * 10})
    assert reply.status_code == 200, reply.text
    assert shim.engine.seen[-1].sampling.max_tokens == 1014
    reply = _raw(app, "POST", "/v1/chat/completions", json={"messages": messages})
    assert reply.status_code == 200, reply.text
    assert shim.engine.seen[-1].sampling.max_tokens == room
    shim, app = _app(sampling={"default_max_tokens": None}, batching={"kv_budget_tokens": 64})
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": [5] * 10})
    assert reply.status_code == 200, reply.text
    assert shim.engine.seen[-1].sampling.max_tokens == 54


def test_a_prompt_the_context_cannot_hold_is_context_length_exceeded(ray_session):
    """OpenAI's and vLLM's code and wording for it, which clients (LangChain, LiteLLM,
    agent frameworks) match to trim the conversation and retry: a completions prompt,
    a chat conversation, a max_tokens that does not fit, a prompt over the KV budget."""
    shim, app = _app()
    shim.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    text = shim.tokenizer.decode([5] * 1100)
    for path, body, param in (
        ("/v1/completions", {"prompt": [5] * 1100}, "prompt"),
        ("/v1/completions", {"prompt": text}, "prompt"),
        ("/v1/completions", {"prompt": [5] * 1000, "max_tokens": 30}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2000},
            "max_completion_tokens",
        ),
    ):
        reply = _raw(app, "POST", path, json=body)
        error = reply.json()["error"]
        assert reply.status_code == 400, (path, reply.text)
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
        assert "This model's maximum context length is 1024 tokens" in error["message"]
    shim, app = _app(batching={"kv_budget_tokens": 64})
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": [5] * 70})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded", reply.text
    # other 400s keep a null code
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x", "temperature": 3})
    assert reply.status_code == 400 and reply.json()["error"]["code"] is None, reply.text


def test_logprobs_carry_the_bytes_of_tokens_that_split_a_character(ray_session):
    """The embedded tokenizer is byte-level BPE: "é" and "你" are tokens of one byte
    each. Each token decoded alone is U+FFFD, so chat's `bytes` could not rebuild the
    text and completions' text_offset drifted by one per split character. Now `bytes`
    are the token's own, a partial token's text is OpenAI's "bytes:\\xNN", and each
    offset counts the text's characters before the token."""
    from deployments.openai_api import Shape
    from workers.request import TokenLogprob

    shim, _ = _app()
    tok = shim.tokenizer
    text = "é 你x"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 4  # the two characters are split
    entries = [TokenLogprob(t, -0.5, ((t, -0.5),)) for t in ids]
    chat = Shape(True, "m", "r", tok).logprobs(entries)["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat).decode() == text
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in chat)
    assert "\ufffd" not in "".join(e["token"] for e in chat)
    assert chat[0]["token"] == "bytes:\\xc3" and chat[-1]["token"] == "x"
    shape = Shape(False, "m", "r", tok)
    # streamed in two pieces, split inside "你": the offsets run on across them
    first, second = shape.logprobs(entries[:4]), shape.logprobs(entries[4:])
    offsets = first["text_offset"] + second["text_offset"]
    tokens = first["tokens"] + second["tokens"]
    assert tokens[-1] == "x" and text[offsets[-1]] == "x"
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert text[offsets[tokens.index(" ")]] == " "
    # ASCII tokens are their text, as before
    code = tok.encode("def f(x):", add_special_tokens=False)
    plain = Shape(False, "m", "r", tok).logprobs([TokenLogprob(t, -1.0) for t in code])
    assert "".join(plain["tokens"]) == "def f(x):"


def _sentencepiece_tokenizer():
    """A tiny Llama-2-style tokenizer: Metaspace pieces ("\u2581world"), byte fallback,
    and the decoder that strips the leading space of whatever it decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    special = ["<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special)
    tok.train_from_iterator(["hello world, the world says hello to the whole world"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def test_sentencepiece_tokens_keep_their_leading_space(ray_session):
    """Decoding "\u2581world" alone gives "world" (Llama 2's and Mistral's decoders strip a
    leading space), so logprobs' tokens did not join into the text and completions'
    text_offset fell a character behind per word. Now a piece's text is the piece with
    its marker as a space, as OpenAI and vLLM give it; the completion's text is the
    detokenizer's, which keeps the space after the prompt."""
    from cactus.detokenize import IncrementalDetokenizer
    from deployments.openai_api import Shape, TokenText
    from workers.request import TokenLogprob

    tok = _sentencepiece_tokenizer()
    prompt = tok.encode("the world says", add_special_tokens=False)
    out = tok.encode("hello to the whole world", add_special_tokens=False)
    assert tok.decode(out[1:2]) == tok.decode(out[1:2]).lstrip()  # the stripping decoder
    words = TokenText(tok)
    assert words.bytes(tok.convert_tokens_to_ids("\u2581world")) == b" world"
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.add(t) for t in out) + detok.flush()
    assert text == " hello to the whole world"
    lp = Shape(False, "m", "r", tok).logprobs([TokenLogprob(t, -1.0) for t in out])
    assert "".join(lp["tokens"]) == text
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[offset:].startswith(token), (token, offset)
    chat = Shape(True, "m", "r", tok).logprobs([TokenLogprob(t, -1.0) for t in out])["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat).decode() == text
    # a byte-level tokenizer (the embedded one) is unchanged: no marker in its decoder
    shim, _ = _app()
    assert not TokenText(shim.tokenizer).metaspace


def test_a_text_prompt_gets_the_tokenizers_bos_as_vllm_encodes_it(ray_session):
    """A Llama or Mistral checkpoint's tokenizer adds BOS to a text prompt; vLLM's
    completions keep it, and a model fed no BOS gives worse text. Completions and gRPC
    text prompts now get it; ids are taken as sent; a chat conversation gets the one its
    template writes, not a second. (The shipped tokenizers add nothing.)"""
    from tokenizers import processors

    from tests.deployments.test_ingress import Ctx

    shim, app = _app()
    tok = _sentencepiece_tokenizer()
    bos = tok.convert_tokens_to_ids("<s>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tok.chat_template = "<s>{% for m in messages %}{{ m.content }}{% endfor %}"
    words = tok.encode("hello world", add_special_tokens=False)
    shim.tokenizer = tok
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": "hello world", "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    assert shim.engine.seen[-1].prompt_token_ids == (bos, *words)
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": words, "max_tokens": 2})
    assert shim.engine.seen[-1].prompt_token_ids == tuple(words)
    body = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 2}
    reply = _raw(app, "POST", "/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert shim.engine.seen[-1].prompt_token_ids.count(bos) == 1
    msg = CactusClient.request("hello world", max_tokens=2)
    asyncio.run(shim.Generate(msg, Ctx()))
    assert shim.engine.seen[-1].prompt_token_ids == (bos, *words)


def test_completions_top_logprobs_include_the_sampled_token(ray_session):
    """OpenAI's legacy completions "always return the logprob of the sampled token, so
    there may be up to logprobs+1 elements" (vLLM too); chat's top_logprobs stay N."""
    from deployments.openai_api import Shape, token_text
    from workers.request import TokenLogprob

    shim, _ = _app()
    tok = shim.tokenizer
    words = token_text(tok)
    a, b, c = tok.encode("def f(x):", add_special_tokens=False)[:3]
    entries = [TokenLogprob(a, -2.0, ((b, -0.1),)), TokenLogprob(c, -0.3, ((c, -0.3),))]
    top = Shape(False, "m", "r", tok).logprobs(entries)["top_logprobs"]
    assert top[0] == {words.text(b): -0.1, words.text(a): -2.0}
    assert top[1] == {words.text(c): -0.3}  # already among the alternatives: once
    alone = Shape(False, "m", "r", tok).logprobs([TokenLogprob(a, -2.0, ())])
    assert alone["top_logprobs"] == [{words.text(a): -2.0}]  # logprobs: 0, not [{}]
    chat = Shape(True, "m", "r", tok).logprobs(entries)["content"]
    assert [len(e["top_logprobs"]) for e in chat] == [1, 1]


def test_openai_fields_sent_with_their_off_value_are_accepted(ray_session):
    """Frameworks send tools: [], tool_choice "none", response_format {"type": "text"}
    and the like by default; each means what leaving it out means, so it is accepted
    (as vLLM does), where any other value is a 400 naming it (the table above). A chat
    message's name and tool_call_id reach the template; tool calls are refused."""
    shim, app = _app()
    off = {
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": False,
        "response_format": {"type": "text"},
        "store": False,
        "metadata": {"team": "a"},
    }
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x", **off})
    assert reply.status_code == 200, reply.text
    shim.tokenizer.chat_template = (
        "{% for m in messages %}{{ m.name or '' }}{{ m.tool_call_id or '' }}:"
        "{{ m.content }}{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "hi", "name": "ann"},
        # replayed replies of other servers carry keys of their own: left out, as before
        {"role": "assistant", "content": None, "tool_calls": [], "reasoning_content": "x"},
        {"role": "tool", "content": "42", "tool_call_id": "call_7"},
    ]
    reply = _raw(app, "POST", "/v1/chat/completions", json={"messages": messages, **off})
    assert reply.status_code == 200, reply.text
    rendered = shim.tokenizer.decode(shim.engine.seen[-1].prompt_token_ids)
    assert "ann:hi" in rendered and "call_7:42" in rendered, rendered
    for message, param in (
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}, "tool_calls"),
        ({"role": "user", "content": "x", "function_call": {"name": "f"}}, "function_call"),
        ({"role": "user", "content": "x", "name": 3}, "name"),
    ):
        reply = _raw(app, "POST", "/v1/chat/completions", json={"messages": [message]})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == f"messages[0].{param}", reply.text


@pytest.mark.parametrize(
    "route, raw, param",
    [
        ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "a\\udfffb"]}', "prompt[1]"),
        ("/v1/completions", b'{"prompt": "x", "\\ud800": 1}', "body"),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "stop[0]"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages[0].content",
        ),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "body"),
    ],
)
def test_lone_surrogates_and_huge_integers_are_400s_naming_where(ray_session, route, raw, param):
    """JSON's \\ud800 escape is a lone surrogate in Python: the tokenizer raised a
    TypeError (500), and a key holding one broke the error reply itself (Starlette's
    plain-text 500). An integer past Python's 4,300 digits was "must be a JSON object"."""
    shim, app = _app()
    reply = _raw(app, "POST", route, content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert ("surrogate" in error["message"] or "not valid Unicode" in error["message"]) or (
        "too many digits" in error["message"]
    ), error
    assert shim.engine.seen == []
    # a surrogate pair is one character (an emoji): fine
    ok = _raw(app, "POST", "/v1/completions", content=b'{"prompt": "\\ud83d\\ude00"}')
    assert ok.status_code == 200, ok.text


def test_chat_content_parts_null_assistant_content_and_template_refusals(ray_session):
    """Content as a list of text parts (openai-python's and LangChain's form) is joined
    with newlines, as vLLM does; an assistant's null content is empty; other part types
    and a template's own raise_exception are 400s naming the field, not 500s."""
    shim, app = _app()
    shim.tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('system must come first') }}{% endif %}"
        "<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    messages = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "again"},
    ]
    body = {"model": "verifier", "messages": messages, "max_tokens": 3}
    reply = _raw(app, "POST", "/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    want = "<user>hello\nthere\n<assistant>\n<user>again\n<assistant>"
    assert list(shim.engine.seen[-1].prompt_token_ids) == shim.tokenizer.encode(
        want, add_special_tokens=False
    )
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    late_system = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    for messages, param, words in (
        ([{"role": "user", "content": [parts[0], image]}], "messages[0].content[1]", "image_url"),
        ([{"role": "user", "content": None}], "messages[0].content", "string"),
        ([{"role": "user", "content": []}], "messages[0].content", "text parts"),
        (late_system, "messages", "system must come first"),
    ):
        body = {"model": "verifier", "messages": messages}
        reply = _raw(app, "POST", "/v1/chat/completions", json=body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": "x", "temperature": float("nan")}, 400, "temperature"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "rule": "nope"}, 400, "rule"),
        ({"prompt": "x", "delta": 99.0}, 400, "delta"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "n": 65}, 400, "n"),
        ({"prompt": "x", "n": 1.5}, 400, "n"),
        ({"prompt": "x", "n": "2"}, 400, "n"),
        ({"prompt": "x", "n": True}, 400, "n"),
        ({"prompt": ["x"] * 33, "n": 2}, 400, "n"),  # 66 choices: over 64
        ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ({"prompt": "x", "tools": [{"type": "function"}]}, 400, "tools"),
        ({"prompt": "x", "tool_choice": "required"}, 400, "tool_choice"),
        ({"prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"prompt": "x", "store": True}, 400, "store"),
        ({"prompt": "x", "model": 5}, 400, "model"),  # a type error, not "no such model"
        ({"prompt": "x", "model": ["verifier"]}, 400, "model"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "x", "logprobs": True}, 400, "logprobs"),
        ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": -1}, 400, "frequency_penalty"),
        ({"prompt": "x", "logit_bias": {"17": 100.5}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"x": 5}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"-1": 5}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"9000": 5}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"17": "5"}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": [17, 5]}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"17": 1, "017": 2}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"17": 10**400}}, 400, "logit_bias"),  # beyond a float
        ({"prompt": "x", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias"),  # past int()'s digits
        ({"prompt": "x", "stream": "false"}, 400, "stream"),  # a string must not stream
        ({"prompt": "x", "stream": 1}, 400, "stream"),  # nor a number (1 == True in Python)
        ({"prompt": "x", "stream": 0.0}, 400, "stream"),
        (
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
            400,
            "stream_options.include_usage",
        ),
        ({"prompt": [10**9]}, 400, "prompt"),  # token ids: named as sent, not prompt_token_ids
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "num_speculative_tokens": 0}, 400, "num_speculative_tokens"),
        ({"prompt": "x", "echo": True}, 400, "echo"),  # README: refused, not ignored
        ({"prompt": "x", "best_of": 2}, 400, "best_of"),
        ({"prompt": "x", "best_of": True}, 400, "best_of"),  # equal to 1 in Python, no int
        ({"prompt": "x", "presence_penalty": False}, 400, "presence_penalty"),  # equal to 0
        ({"prompt": "x", "suffix": "}"}, 400, "suffix"),
        ({"prompt": "x", "rule": "tas", "max_divergence_nats": 1.0}, 400, "max_divergence_nats"),
        ({"prompt": "x", "stop_token_ids": [True]}, 400, "stop_token_ids"),
        ({"prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
        ({"prompt": "x", "time_limit_s": -1}, 400, "time_limit_s"),
        # integers beyond any float (float() raises OverflowError): a 400, not a 500
        ({"prompt": "x", "temperature": 10**400}, 400, "temperature"),
        ({"prompt": "x", "top_p": -(10**400)}, 400, "top_p"),
        ({"prompt": "x", "delta": 10**400}, 400, "delta"),
        ({"prompt": "x", "time_limit_s": 10**400}, 400, "time_limit_s"),
        # stream_options: only beside stream: true (as vLLM), known keys, a bool
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        (
            {"prompt": "x", "stream": False, "stream_options": {"include_usage": False}},
            400,
            "stream_options",
        ),
        (
            {"prompt": "x", "stream": True, "stream_options": {"include_usge": True}},
            400,
            "stream_options.include_usge",
        ),
        (
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}},
            400,
            "stream_options.include_usage",
        ),
        ({"prompt": "x", "stream": True, "stream_options": []}, 400, "stream_options"),
    ],
)
def test_bad_input_gets_an_openai_shaped_error(ray_session, body, status, param):
    _, app = _app()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if body.get("temperature") != body.get("temperature"):  # NaN is not JSON: send it raw
        reply = _raw(
            app,
            "POST",
            "/v1/completions",
            content=json.dumps(body).encode(),
            headers={**headers, "content-type": "application/json"},
        )
    else:
        reply = _raw(app, "POST", "/v1/completions", json=body, headers=headers)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert error["type"] == "invalid_request_error"


def test_null_fields_are_unset_whatever_their_name(ray_session):
    """Some OpenAI clients send every field they know, the unset ones as null: those
    pass (a field with a value that this server does not know still gets a 400)."""
    shim, app = _app(speculation={"default_rule": "sps", "default_delta": 0.5})
    body = {"prompt": "x", "max_tokens": 3, "tools": None, "response_format": None}
    body |= {"logit_bias": None, "presence_penalty": None, "n": None, "suffix": None}
    # this server's own fields too: null takes the config's default
    ours = ("rule", "delta", "num_speculative_tokens", "max_divergence_nats", "top_k")
    ours += ("temperature", "top_p", "seed", "stop", "stop_token_ids", "time_limit_s")
    body |= dict.fromkeys(ours)
    reply = _raw(app, "POST", "/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    seen = shim.engine.seen[-1]
    assert seen.sampling.max_tokens == 3
    assert seen.speculation.rule == "sps" and seen.speculation.delta == 0.5
    assert seen.sampling.temperature == shim.config.sampling.default_temperature
    assert seen.speculation.max_divergence_nats is None and seen.sampling.seed is None


def test_auth_and_engine_failures_map_to_statuses(ray_session):
    from cactus.errors import EngineFailedError

    _, app = _app(auth={"token": TOKEN})
    for token in ("wrong", ""):
        reply = _raw(
            app,
            "POST",
            "/v1/completions",
            json={"prompt": "x"},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
    assert _raw(app, "GET", "/v1/models").status_code == 401
    for err, status in ((EngineFailedError("rank 1"), 503), (KeyError("bug"), 500)):
        _, failing = _app(FakeEngine(fail=err), auth={"token": TOKEN})
        reply = _raw(
            failing,
            "POST",
            "/v1/completions",
            json={"prompt": "x"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert reply.status_code == status and "rank 1" not in reply.text
        assert reply.json()["error"]["type"] == "server_error"
        # a restart passes: when to retry (not for a bug)
        assert reply.headers.get("retry-after") == ("1" if status == 503 else None)


def test_a_stream_that_fails_after_its_first_token_ends_with_an_error_event(ray_session):
    from cactus.errors import EngineFailedError

    _, app = _app(FakeEngine(fail=EngineFailedError("gone")))
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x", "stream": True})
    events = [ln[len("data: ") :] for ln in reply.text.splitlines() if ln.startswith("data: ")]
    assert reply.status_code == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    # the status the response could no longer send is the event's code (as vLLM's)
    assert error["type"] == "server_error" and error["code"] == 503, error


def test_a_stream_that_fails_in_our_code_after_its_headers_is_logged(ray_session, caplog):
    """The client gets "internal error (request X)" as an event; an operator handed X
    finds its traceback in the replica's log, as for a failure before the headers (and
    as the gRPC path logs it). A 503 (a restart) is no bug: not logged."""
    _, app = _app(FakeEngine(fail=RuntimeError("a bug")))
    with caplog.at_level(logging.ERROR):
        reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x", "stream": True})
    events = [ln[len("data: ") :] for ln in reply.text.splitlines() if ln.startswith("data: ")]
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "internal error (request " in error["message"]
    rid = error["message"].rsplit("request ", 1)[1].rstrip(")")
    logged = [r for r in caplog.records if rid in r.getMessage() and r.exc_info]
    assert logged and "a bug" in str(logged[0].exc_info[1]), caplog.text


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": 1}, "logprobs"),  # true/false only: 1 == True in Python
        # the shared validator checks max_tokens and the prompt; a 400 names what was sent
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "def f(x): " * 3000}]}, "messages"),
    ],
)
def test_chat_fields_are_named_as_sent(ray_session, extra, param):
    shim, app = _app()
    shim.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    reply = _raw(
        app, "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_an_http_stream_is_counted_in_the_latency_and_running_metrics(ray_session):
    """An SSE stream records its first-token latency, one inter-token latency per later
    chunk with tokens, and counts as running while it streams, as a gRPC stream does."""
    shim, app = _app()
    seen: list = []

    def token_latency(request, start, first):
        seen.append(("first" if first else "next", shim.metrics._running))

    shim.metrics.token_latency = token_latency
    reply = _raw(
        app,
        "POST",
        "/v1/completions",
        json={"prompt": "x", "stream": True},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert reply.status_code == 200 and reply.text.rstrip().endswith("data: [DONE]")
    # FakeEngine streams three one-token chunks, then the result alone: a first-token
    # latency, two inter-token latencies, all taken while the stream counted as running
    assert seen == [("first", 1), ("next", 1), ("next", 1)], seen
    assert shim.metrics._running == 0


def test_an_http_stream_counts_as_running_while_it_waits_for_its_first_chunk(ray_session):
    """A stream that waits for an engine row or a restart before its first chunk is a
    running request, as over gRPC (the ingress counts it before astream): the gauge
    shows it, and admit()'s bound for a batch of choices counts it. Whatever ends it,
    the count goes back to 0."""
    waiting: list = []

    class Waits(FakeEngine):
        async def astream(self, req):
            waiting.append(shim.metrics._running)  # before its first chunk
            if req.sampling.max_tokens == 7:  # the second call: fails before any chunk
                raise WorkerUnavailableError("the engine restarts")
            async for chunk in super().astream(req):
                yield chunk

    shim, app = _app(Waits())
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = {"prompt": "x", "stream": True}
    reply = _raw(app, "POST", "/v1/completions", json=body, headers=auth)
    assert reply.status_code == 200 and reply.text.rstrip().endswith("data: [DONE]")
    failed = _raw(app, "POST", "/v1/completions", json={**body, "max_tokens": 7}, headers=auth)
    assert failed.status_code == 503, failed.text
    assert waiting == [1, 1], waiting
    assert shim.metrics._running == 0


def test_a_model_is_retrieved_by_name_and_unknown_routes_are_openai_shaped(ray_session):
    """`client.models.retrieve` (GET /v1/models/{id}) answers the served model and 404
    `model_not_found` for another; an unknown route or method gets the OpenAI error
    shape, not FastAPI's `{"detail": ...}`."""
    shim, app = _app(auth={"token": TOKEN})
    client = _client(app)
    card = asyncio.run(client.models.retrieve(shim.model_name))
    assert card.id == shim.model_name and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        asyncio.run(client.models.retrieve("gpt-4"))
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    assert _raw(app, "GET", f"/v1/models/{shim.model_name}").status_code == 401  # needs the token
    for method, path, status in (("GET", "/v1/embeddings", 404), ("GET", "/v1/completions", 405)):
        reply = _raw(app, method, path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and path in error["message"]
        assert error["type"] == "invalid_request_error"
        # without the token: 401, whether the route exists or not (README: every HTTP
        # request needs the token)
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            reply = _raw(app, method, path, headers=headers)
            assert reply.status_code == 401, reply.text
            assert reply.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_logit_bias_reaches_the_request_as_sorted_token_ids(ray_session, route):
    """OpenAI's logit_bias, {"<token id>": bias}: the request gets (id, bias) pairs in
    id order; an empty object is no bias."""
    shim, app = _app()
    shim.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    base = (
        {"messages": [{"role": "user", "content": "hi"}]}
        if route.endswith("chat/completions")
        else {"prompt": "x"}
    )
    for bias, want in (({"50": -100, "7": 2.5}, ((7, 2.5), (50, -100.0))), ({}, ())):
        reply = _raw(app, "POST", route, json={**base, "logit_bias": bias})
        assert reply.status_code == 200, reply.text
        assert shim.engine.seen[-1].sampling.logit_bias == want


def test_top_p_and_max_divergence_nats_reach_the_request(ray_session):
    """README: `top_p` and the Cactus extra `max_divergence_nats` are accepted and reach
    the engine's request (completions through the official client, chat as raw JSON);
    left unset, top_p is 1 and there is no divergence budget."""
    shim, app = _app()
    shim.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    client = _client(app)
    reply = asyncio.run(
        client.completions.create(
            model="verifier",
            prompt="def f():",
            max_tokens=3,
            top_p=0.9,
            extra_body={"max_divergence_nats": 0.75},
        )
    )
    assert reply.choices[0].text == "abc"
    req = shim.engine.seen[-1]
    assert req.sampling.top_p == 0.9 and req.speculation.max_divergence_nats == 0.75
    body = {"messages": [{"role": "user", "content": "hi"}], "top_p": 0.5}
    body["max_divergence_nats"] = 0
    reply = _raw(app, "POST", "/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    req = shim.engine.seen[-1]
    assert req.sampling.top_p == 0.5 and req.speculation.max_divergence_nats == 0.0
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    req = shim.engine.seen[-1]
    assert req.sampling.top_p == 1.0 and req.speculation.max_divergence_nats is None


def _events(reply) -> list[dict]:
    """A stream's events, checked to end in `data: [DONE]`."""
    data = [ln[len("data: ") :] for ln in reply.text.splitlines() if ln.startswith("data: ")]
    assert reply.status_code == 200 and data[-1] == "[DONE]", reply.text
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_carries_a_usage_chunk_only_when_asked(ray_session, route):
    """README: `stream_options.include_usage` adds a usage chunk (no choices, before
    `[DONE]`); without it, or with it false, no chunk carries usage and the chunk with
    the finish_reason is the last."""
    shim, app = _app()
    shim.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    if route.endswith("chat/completions"):
        base = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    else:
        base = {"prompt": "x", "stream": True}
    for options in (None, {}, {"include_usage": False}):
        body = base if options is None else {**base, "stream_options": options}
        events = _events(_raw(app, "POST", route, json=body))
        assert all("usage" not in e and len(e["choices"]) == 1 for e in events), events
        finishes = [e["choices"][0]["finish_reason"] for e in events]
        assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    asked = {**base, "stream_options": {"include_usage": True}}
    events = _events(_raw(app, "POST", route, json=asked))
    # OpenAI's shape: every chunk before the usage chunk has `"usage": null`
    assert all("usage" in e and e["usage"] is None for e in events[:-1]), events
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    # null stream_options and null keys in them are unset, like any null field
    for options in (None, {"include_usage": None, "include_obfuscation": None}):
        events = _events(_raw(app, "POST", route, json={**base, "stream_options": options}))
        assert all("usage" not in e for e in events), events
        # ...also beside a request that does not stream (only a set key needs stream)
        plain = _raw(app, "POST", route, json={**base, "stream": False, "stream_options": options})
        assert plain.status_code == 200, plain.text


def test_configured_temperature_and_k_fill_unset_http_fields(ray_session):
    """README: `sampling.default_temperature` and
    `speculation.default_num_speculative_tokens` are what an HTTP request that leaves
    the field unset (or sends it as null) gets, on both routes; a field that is set,
    temperature 0 included (greedy), is kept."""
    shim, app = _app(
        sampling={"default_temperature": 0.3},
        speculation={"default_num_speculative_tokens": 6},
    )
    shim.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for route, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/completions", {"prompt": "x", "temperature": None}),
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True}),
    ):
        reply = _raw(app, "POST", route, json=body)
        assert reply.status_code == 200, reply.text
        req = shim.engine.seen[-1]
        assert req.sampling.temperature == 0.3, (route, body)
        assert req.speculation.num_speculative_tokens == 6, (route, body)
    for route, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", chat),
    ):
        reply = _raw(
            app, "POST", route, json={**body, "temperature": 0, "num_speculative_tokens": 2}
        )
        assert reply.status_code == 200, reply.text
        req = shim.engine.seen[-1]
        assert req.sampling.temperature == 0.0 and req.speculation.num_speculative_tokens == 2


def test_json_nested_too_deep_is_a_400_naming_the_body(ray_session):
    """Python's json parser raises RecursionError, not ValueError, on deep nesting."""
    _, app = _app()
    reply = _raw(
        app,
        "POST",
        "/v1/completions",
        content=b"[" * 100_000 + b"]" * 100_000,
        headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "body"


def test_response_ids_have_openai_prefixes(ray_session):
    """Chat completion ids start with `chatcmpl-`, completion ids with `cmpl-` (OpenAI's
    and vLLM's), in whole responses and in every chunk of a stream."""
    shim, app = _app()
    shim.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for route, body, prefix in (
        ("/v1/chat/completions", chat, "chatcmpl-"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 3}, "cmpl-"),
    ):
        reply = _raw(app, "POST", route, json=body)
        assert reply.status_code == 200 and reply.json()["id"].startswith(prefix), reply.text
        events = _events(_raw(app, "POST", route, json={**body, "stream": True}))
        ids = {e["id"] for e in events}
        assert len(ids) == 1 and ids.pop().startswith(prefix), events


def test_a_body_over_the_limit_is_413_before_it_is_parsed(ray_session):
    """limits.max_message_bytes bounds an HTTP body too: a declared Content-Length over
    it is refused before the body is read, a body without one (chunked) once the bytes
    read pass it; 413, OpenAI-shaped, naming `body`. A body at the limit passes."""
    shim, app = _app(limits={"max_message_bytes": 2048})
    headers = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    small = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    at_limit = small[:-1] + b" " * (2048 - len(small)) + b"}"
    assert len(at_limit) == 2048
    reply = _raw(app, "POST", "/v1/completions", content=at_limit, headers=headers)
    assert reply.status_code == 200, reply.text
    big = json.dumps({"prompt": "x" * 4000}).encode()

    async def chunked():  # no Content-Length: Transfer-Encoding chunked
        for i in range(0, len(big), 500):
            yield big[i : i + 500]

    for route in ("/v1/completions", "/v1/chat/completions"):
        for content in (big, chunked()):
            reply = _raw(app, "POST", route, content=content, headers=headers)
            assert reply.status_code == 413, reply.text
            error = reply.json()["error"]
            assert error["param"] == "body" and error["type"] == "invalid_request_error"
            assert "2048" in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert len(shim.engine.seen) == 1


def test_chat_content_is_held_to_max_prompt_chars_before_the_template(ray_session):
    """limits.max_prompt_chars bounds chat content as it bounds a completions prompt,
    before the chat template renders it: one message over it names its content, several
    over it together name `messages`."""
    shim, app = _app(limits={"max_prompt_chars": 50})
    shim.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    rendered: list = []
    render = shim.tokenizer.apply_chat_template
    shim.tokenizer.apply_chat_template = lambda *a, **kw: rendered.append(1) or render(*a, **kw)
    parts = [{"type": "text", "text": "y" * 30}, {"type": "text", "text": "y" * 30}]
    for messages, param in (
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": "x" * 51}],
            "messages[1].content",
        ),
        ([{"role": "user", "content": parts}], "messages[0].content"),
        (
            [{"role": "system", "content": "x" * 30}, {"role": "user", "content": "x" * 30}],
            "messages",
        ),
    ):
        reply = _raw(app, "POST", "/v1/chat/completions", json={"messages": messages})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and "50 characters" in error["message"], error
    assert rendered == [] and shim.engine.seen == []
    ok = [{"role": "system", "content": "x" * 25}, {"role": "user", "content": "x" * 25}]
    reply = _raw(app, "POST", "/v1/chat/completions", json={"messages": ok, "max_tokens": 2})
    assert reply.status_code == 200, reply.text


def test_a_full_queue_over_http_is_429_with_retry_after():
    """Past max_queued_requests Serve's proxy answers HTTP 429 with `Retry-After: 1`
    (BackpressureConfig; its default is a 503 without one); gRPC is unaffected."""
    from ray import serve

    from configs.schema import from_dict
    from deployments.app import deployment_options
    from deployments.ingress import CactusIngress

    options = deployment_options(from_dict({}), own_engine=False)
    pressure = options["backpressure_config"]
    assert pressure.status_code == 429 and pressure.retry_after_s == 1.0
    deployment = serve.deployment(serve.ingress()(CactusIngress)).options(**options)
    assert deployment.backpressure_config.status_code == 429  # Serve takes the option
    assert deployment.backpressure_config.retry_after_s == 1.0


def test_an_engine_error_names_the_field_the_client_sent(ray_session):
    """The engine's own InvalidRequestError names its field (max_tokens,
    prompt_token_ids); the 400, or a stream's error event, names the one the client sent
    (max_completion_tokens, messages, prompt), as the validator's errors do."""
    from cactus.errors import InvalidRequestError

    engine = FakeEngine(fail=InvalidRequestError("max_tokens", "over the KV budget"))
    shim, app = _app(engine)
    shim.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}
    reply = _raw(app, "POST", "/v1/chat/completions", json=chat)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "max_completion_tokens" and "KV budget" in error["message"], error
    events = _events(_raw(app, "POST", "/v1/chat/completions", json={**chat, "stream": True}))
    assert events[-1]["error"]["param"] == "max_completion_tokens", events
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 5})
    assert reply.json()["error"]["param"] == "max_tokens", reply.text
    engine.fail = InvalidRequestError("prompt_token_ids", "too long for the KV cache")
    reply = _raw(app, "POST", "/v1/chat/completions", json=chat)
    assert reply.json()["error"]["param"] == "messages", reply.text
    for prompt in ("x", ["x", [5, 6]]):
        reply = _raw(app, "POST", "/v1/completions", json={"prompt": prompt})
        assert reply.json()["error"]["param"] == "prompt", reply.text


def test_a_stream_that_fails_in_our_own_code_cancels_and_closes_the_engine_stream(
    ray_session, monkeypatch
):
    """A failure that is not the engine's (here: formatting the second chunk) ends the
    stream with an error event, cancels the request in the engine (it is still
    running), counts it as an error once, and closes the engine's stream."""
    from deployments import openai_api

    shim, app = _app()
    streams: list = []  # held here, so only an aclose (not the GC) closes the stream
    astream = shim.engine.astream
    shim.engine.astream = lambda req: streams.append(astream(req)) or streams[-1]
    ended: list = []
    shim.metrics.ended = lambda req, reason: ended.append(reason)
    calls = []
    delta = openai_api.Shape.delta

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a formatting bug")
        return delta(self, *args, **kwargs)

    monkeypatch.setattr(openai_api.Shape, "delta", flaky)

    async def go():
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://cactus.test") as c:
            reply = await c.post("/v1/completions", json={"prompt": "x", "stream": True})
            # checked while the loop runs (asyncio.run would close it at its end)
            return reply, streams[0].ag_frame is None

    reply, closed = asyncio.run(go())
    events = _events(reply)
    assert events[-1]["error"]["type"] == "server_error", events
    assert shim.engine.cancelled == [shim.engine.seen[-1].request_id]
    assert ended == ["ERROR"] and closed


class _RefusingEngine(FakeEngine):
    """Refuses before the first chunk, as rank 0 refuses a running id or a request over
    the KV budget (unary and streamed alike)."""

    async def astream(self, req):
        self.seen.append(req)
        raise self.fail
        yield  # an async generator


def _counted(engine, body) -> tuple[list, list]:
    """(reasons given to metrics.ended, first-token flags given to token_latency)."""
    shim, app = _app(engine)
    ended, ttft = [], []
    shim.metrics.ended = lambda req, reason: ended.append(reason)
    shim.metrics.token_latency = lambda req, start, first: ttft.append(first)
    _raw(app, "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    return ended, ttft


def test_http_counts_a_request_the_engine_refused_as_no_failure(ray_session):
    """As the gRPC path does (test_ingress): a request rank 0 refuses before it runs
    (its id already running, max_tokens over the KV budget) is no accepted request, so
    `cactus_request_failure` does not count it; HTTP counted it as ERROR."""
    from cactus.errors import InvalidRequestError

    refusal = InvalidRequestError("max_tokens", "needs more KV slots than the budget")
    for body in ({"prompt": "x"}, {"prompt": "x", "stream": True}, {"prompt": ["x", "y"]}):
        ended, _ = _counted(_RefusingEngine(fail=refusal), body)
        assert ended == [] or (len(body["prompt"]) == 2 and set(ended) == {"CANCELLED"}), (
            body,
            ended,
        )
    # an engine failure is still a failure
    from cactus.errors import EngineFailedError

    ended, _ = _counted(_RefusingEngine(fail=EngineFailedError("gone")), {"prompt": "x"})
    assert ended == ["ERROR"]


def test_http_counts_a_drain_cut_as_cancelled_and_a_late_refusal_not_at_all(ray_session):
    """A drain's cut stops a request by a cancel, which rank 0 counts among the cancelled
    (`cactus_cancelled_*`): the replica counts it CANCELLED, not ERROR, so the two agree.
    A request that arrives after the cut never ran: not counted. gRPC alike."""
    from cactus.errors import ServerShuttingDownError
    from tests.deployments.test_ingress import Ctx

    cut = ServerShuttingDownError("the server is shutting down")
    late = ServerShuttingDownError("the server is shutting down", refused=True)
    for body in ({"prompt": "x"}, {"prompt": "x", "stream": True}):
        assert _counted(_RefusingEngine(fail=cut), body)[0] == ["CANCELLED"], body
        assert _counted(_RefusingEngine(fail=late), body)[0] == [], body
    # mid-stream (FakeEngine fails after its first chunk)
    assert _counted(FakeEngine(fail=cut), {"prompt": "x", "stream": True})[0] == ["CANCELLED"]
    from client import CactusClient

    for fail, want in ((cut, ["CANCELLED"]), (late, [])):
        shim = _shim(FakeEngine(fail=fail))
        ended = []
        shim.metrics.ended = lambda req, reason, ended=ended: ended.append(reason)
        asyncio.run(shim.Generate(CactusClient.request("x"), Ctx()))
        assert ended == want, (fail, ended)


def test_an_http_stream_whose_first_chunk_has_no_token_times_no_first_token(ray_session):
    """A request whose time ran out while it waited for a row sends its result alone: no
    token, so no time to first token (the gRPC path skipped it; HTTP recorded the wait)."""
    from dataclasses import replace

    from workers.request import GenerationChunk

    class NoTokenEngine(FakeEngine):
        async def astream(self, req):
            res = replace(self._result(req), text="", token_ids=(), finish_reason="TIME_LIMIT")
            yield GenerationChunk(req.request_id, (), "", result=res)

    class LateTokenEngine(FakeEngine):  # a first chunk without a token, then tokens
        async def astream(self, req):
            yield GenerationChunk(req.request_id, (), "")
            async for chunk in super().astream(req):
                yield chunk

    assert _counted(NoTokenEngine(), {"prompt": "x", "stream": True})[1] == []
    # the first chunk with a token is the one timed as the first token
    assert _counted(LateTokenEngine(), {"prompt": "x", "stream": True})[1] == [
        True,
        False,
        False,
    ]


def test_an_http_stream_left_during_its_final_event_counts_as_finished():
    """The result was counted only after the final event (and the usage chunk) went out:
    a client that left during that write made a finished request CANCELLED, its tokens
    counted nowhere (the engine does not count a finished request as cancelled)."""
    from deployments.openai_api import Shape, sse_events
    from workers.request import GenerationChunk

    engine = FakeEngine()
    req = GenerationRequest(prompt_token_ids=(5, 6), request_id="r1")
    result = engine._result(req)
    done, ended, cancelled = [], [], []

    async def rest():
        yield GenerationChunk("r1", (2,), "b")
        yield GenerationChunk("r1", (), "", "LENGTH", result)

    async def go():
        events = sse_events(
            Shape(False, "m", "r1"),
            req,
            GenerationChunk("r1", (1,), "a"),
            rest(),
            include_usage=True,
            on_done=done.append,
            cancel=cancelled.append,
            on_end=ended.append,
        )
        while '"finish_reason": "length"' not in await events.__anext__():
            pass
        await events.aclose()  # the client leaves before the usage chunk

    asyncio.run(go())
    assert done == [result] and ended == [] and cancelled == []


def test_a_batch_of_prompts_cannot_push_a_replica_past_what_serve_would_admit(ray_session):
    """Serve admits an HTTP request as one request, whatever its prompts: 32 calls of 64
    prompts put 2,048 requests in rank 0's queue. A batch is now 429 (Retry-After) when
    its prompts would take the replica's requests past max_ongoing_requests +
    max_queued_requests; within it, every prompt runs."""
    shim, app = _app(limits={"max_ongoing_requests": 4, "max_queued_requests": 4})
    headers = {"Authorization": f"Bearer {TOKEN}"}
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": ["x"] * 8}, headers=headers)
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 8, reply.text
    shim.metrics._running = 3  # three requests already running on the replica
    seen = len(shim.engine.seen)
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": ["x"] * 6}, headers=headers)
    assert reply.status_code == 429 and reply.headers["Retry-After"] == "1", reply.text
    assert "limits.max_ongoing_requests" in reply.json()["error"]["message"]
    assert len(shim.engine.seen) == seen  # none of its prompts reached the engine
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": ["x"] * 5}, headers=headers)
    assert reply.status_code == 200, reply.text
    # more prompts than the bound itself: no retry can help, so a 400 naming the field
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": ["x"] * 9}, headers=headers)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt", reply.text
    # choices of n > 1 count as prompts do, streamed or not; the 400 then names n
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x", "n": 9}, headers=headers)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n", reply.text
    shim.metrics._running = 3
    seen = len(shim.engine.seen)
    for stream in (False, True):
        body = {"prompt": "x", "n": 6, "stream": stream}
        reply = _raw(app, "POST", "/v1/completions", json=body, headers=headers)
        assert reply.status_code == 429 and reply.headers["Retry-After"] == "1", reply.text
    assert len(shim.engine.seen) == seen
    shim.metrics._running = 0

    # two batches at once: the check and the prompts' counting happen before any await,
    # so they cannot both pass one check (5 + 5 > 8)
    class Slow(FakeEngine):
        async def agenerate(self, req):
            await asyncio.sleep(0.3)
            return await super().agenerate(req)

    shim.engine.inner = Slow()

    async def both():
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://cactus.test") as c:
            body = {"prompt": ["x"] * 5}
            calls = [c.post("/v1/completions", json=body, headers=headers) for _ in range(2)]
            return sorted(r.status_code for r in await asyncio.gather(*calls))

    assert asyncio.run(both()) == [200, 429]
    assert shim.metrics._running == 0  # every prompt's slot released


def test_a_chat_request_has_at_most_openais_2048_messages(ray_session):
    """The content limit alone let a 4 MiB body carry about 140,000 empty messages, which
    the template rendered and the tokenizer encoded on the replica's event loop."""
    from deployments.openai_api import MAX_CHAT_MESSAGES

    shim, app = _app()
    shim.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    many = [{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1)
    reply = _raw(app, "POST", "/v1/chat/completions", json={"messages": many}, headers=headers)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages", reply.text
    assert str(MAX_CHAT_MESSAGES) in reply.json()["error"]["message"]
    ok = [{"role": "user", "content": "hi"}] * 3
    reply = _raw(app, "POST", "/v1/chat/completions", json={"messages": ok}, headers=headers)
    assert reply.status_code == 200, reply.text


def _by_index(events: list[dict]) -> dict[int, list[dict]]:
    """A stream's choices, each chunk's one choice filed under its index, in order."""
    out: dict[int, list[dict]] = {}
    for event in events:
        if event["choices"]:
            assert len(event["choices"]) == 1, event
            choice = event["choices"][0]
            out.setdefault(choice["index"], []).append(choice)
    return out


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_n_choices_are_a_request_each_seeded_seed_plus_j_unary_and_streamed(ray_session, route):
    """README: `n` up to 64 (prompts x n): a request each, choice i * n + j being prompt
    i's j-th sample, seeded seed + j (its `cactus.seed` repeats it alone); streamed, each
    chunk carries one choice's index, every choice ends with its finish_reason and its
    own `cactus` object, and the usage chunk sums them."""
    shim, app = _app()
    shim.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    chat = route.endswith("chat/completions")
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": ["ab", "cd"]}
    prompts = 1 if chat else 2
    body = {**base, "n": 3, "seed": 2**64 - 2, "max_tokens": 3}
    reply = _raw(app, "POST", route, json=body)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == list(range(3 * prompts))
    seen = shim.engine.seen[-3 * prompts :]
    # prompt-major, each prompt's samples seeded seed, seed + 1, seed + 2 (mod 2^64)
    assert [r.sampling.seed for r in seen] == [2**64 - 2, 2**64 - 1, 0] * prompts
    assert len({r.request_id for r in seen}) == 3 * prompts
    if not chat:
        ab, cd = (tuple(shim.tokenizer.encode(p, add_special_tokens=False)) for p in ("ab", "cd"))
        assert [tuple(r.prompt_token_ids) for r in seen] == [ab] * 3 + [cd] * 3
    assert reply.json()["usage"]["completion_tokens"] == 3 * 3 * prompts
    # each prompt's tokens count once, whatever n (as OpenAI and vLLM count them)
    once = sum(len(r.prompt_token_ids) for r in seen[::3])
    assert reply.json()["usage"]["prompt_tokens"] == once
    assert reply.json()["usage"]["total_tokens"] == once + 9 * prompts
    assert shim.metrics._running == 0

    asked = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = _events(_raw(app, "POST", route, json=asked))
    streamed = shim.engine.seen[-3 * prompts :]
    assert [r.sampling.seed for r in streamed] == [2**64 - 2, 2**64 - 1, 0] * prompts
    assert all("usage" in e and e["usage"] is None for e in events[:-1]), events
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 9 * prompts
    assert events[-1]["usage"]["prompt_tokens"] == once
    by_index = _by_index(events)
    assert sorted(by_index) == list(range(3 * prompts))
    for chunks in by_index.values():
        text = "".join(c["delta"]["content"] if chat else c["text"] for c in chunks)
        assert text == "xxx", chunks
        assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        if chat:  # each choice's first delta names the role
            assert chunks[0]["delta"].get("role") == "assistant"
            assert all("role" not in c["delta"] for c in chunks[1:])
    finishing = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finishing) == 3 * prompts and all("cactus" in e for e in finishing)
    assert shim.metrics._running == 0 and shim.engine.cancelled == []


def test_a_streamed_choice_that_fails_ends_the_response_and_cancels_the_rest(ray_session):
    """Several choices streamed: one that fails after its first token sends its error
    event, then `[DONE]`; the others, still running, are cancelled in the engine and
    counted CANCELLED, and every running slot is released. A failure that comes before
    any choice's first token makes the response that status, and the others are
    cancelled."""
    from cactus.errors import EngineFailedError

    class OneFails(FakeEngine):
        def __init__(self, before_first: bool) -> None:
            super().__init__()
            self.before_first = before_first

        async def astream(self, req):
            self.seen.append(req)
            if req.request_id.endswith("-1"):
                if self.before_first:
                    raise EngineFailedError("gone")
                yield GenerationChunk(req.request_id, (1,), "x")
                await asyncio.sleep(0.05)  # the others have sent their first chunks
                raise EngineFailedError("gone")
            if self.before_first:
                await asyncio.sleep(0.05)  # the failure comes first
            yield GenerationChunk(req.request_id, (1,), "y")
            await asyncio.sleep(60)  # still running when the other fails

    body = {"prompt": "x", "n": 3, "stream": True, "max_tokens": 8}
    for before_first in (False, True):
        shim, app = _app(OneFails(before_first))
        failures = []
        shim.metrics.ended = lambda req, reason, f=failures: f.append((req.request_id[-2:], reason))
        reply = _raw(app, "POST", "/v1/completions", json=body)
        if before_first:
            assert reply.status_code == 503 and reply.headers["Retry-After"] == "1", reply.text
        else:
            events = _events(reply)
            assert events[-1]["error"]["code"] == 503, events
            assert sorted(i for i in _by_index(events[:-1])) == [0, 1, 2]
        # the failed one's cancel too (after its first token), as a single stream's
        # failure sends one; a no-op in the engine
        ids = [r.request_id for r in shim.engine.seen]
        others = sorted([ids[0], ids[2]])
        assert sorted(set(shim.engine.cancelled)) == (others if before_first else sorted(ids))
        assert sorted(failures) == [("-0", "CANCELLED"), ("-1", "ERROR"), ("-2", "CANCELLED")]
        assert shim.metrics._running == 0


def test_a_stream_of_several_choices_starts_before_a_slow_choice_has_a_token(ray_session):
    """A choice may wait for an engine row while others run (n up to 64, max_num_seqs
    32): the response must not wait for every choice's first chunk. Here choice 1's
    first token comes only after choice 0's stream has been read to its end, which a
    response that waited for both would never do (choice 1 then fails after 5 s)."""
    read_to_end = asyncio.Event()

    class Waits(FakeEngine):
        async def astream(self, req):
            self.seen.append(req)
            if req.request_id.endswith("-1"):
                await asyncio.wait_for(read_to_end.wait(), 5.0)
            async for chunk in super().astream(req):
                if chunk.result is not None and req.request_id.endswith("-0"):
                    read_to_end.set()  # its last chunk is asked for
                yield chunk

    shim, app = _app(Waits())
    body = {"prompt": "x", "n": 2, "stream": True, "max_tokens": 3}
    events = _events(_raw(app, "POST", "/v1/completions", json=body))
    assert all("error" not in e for e in events), events
    order = [e["choices"][0]["index"] for e in events]
    assert order == [0] * 4 + [1] * 4, order  # all of choice 0, then choice 1
    assert shim.metrics._running == 0 and shim.engine.cancelled == []


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize(
    "how", ["disconnect (ASGI 2.3)", "send fails at the start (2.4)", "send fails mid-stream (2.4)"]
)
def test_a_client_that_leaves_a_stream_cancels_every_choice(ray_session, n, how):
    """The client goes away: as Serve's uvicorn reports it (ASGI 2.3: an http.disconnect,
    on which Starlette cancels the task reading the response), or as a 2.4 server does
    (its send raises OSError), before the response began or mid-stream. Every choice
    still running is cancelled in the engine and counted CANCELLED, once, and its
    running slot released, by the time the response's task has ended (Starlette never
    closes a body; one that never began has no `finally` of its own)."""

    class Forever(FakeEngine):
        async def astream(self, req):
            self.seen.append(req)
            yield GenerationChunk(req.request_id, (1,), "y")
            yield GenerationChunk(req.request_id, (2,), "z")
            await asyncio.sleep(0.2)  # a third chunk: the send that finds the client gone
            yield GenerationChunk(req.request_id, (3,), "w")
            await asyncio.sleep(60)

    shim, app = _app(Forever())
    ended = []
    shim.metrics.ended = lambda req, reason: ended.append(reason)
    body = json.dumps({"prompt": "x", "n": n, "stream": True, "max_tokens": 8}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3" if "2.3" in how else "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"authorization", f"Bearer {TOKEN}".encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("cactus.test", 80),
    }
    leave_after = {"disconnect (ASGI 2.3)": 2 * n, "send fails at the start (2.4)": -1}
    leave_after = leave_after.get(how, 2 * n)

    async def go():
        leave = asyncio.Event()
        sent = []
        requests = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive():
            message = next(requests, None)
            if message is not None:
                return message
            await leave.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            bodies = sum(m["type"] == "http.response.body" for m in sent)
            if "2.4" in how and (leave_after < 0 or bodies >= leave_after):
                raise OSError("the client is gone")
            sent.append(message)
            if bodies + (message["type"] == "http.response.body") == leave_after:
                leave.set()  # each choice's "y" and "z" went out: the client leaves

        from starlette.requests import ClientDisconnect

        began = time.monotonic()
        with contextlib.suppress(ClientDisconnect, OSError):  # how 2.4's send failure ends
            await asyncio.wait_for(app(scope, receive, send), 10.0)
        assert time.monotonic() - began < 5.0  # ended by the client's leaving, not a timeout
        # checked as the response's task ends, not after asyncio.run's own clean-up
        return sent, sorted(set(shim.engine.cancelled)), list(ended), shim.metrics._running

    sent, cancelled, ended_then, running = asyncio.run(go())
    ids = sorted(r.request_id for r in shim.engine.seen)
    assert len(ids) == n and cancelled == ids, (cancelled, sent)
    assert ended_then == ["CANCELLED"] * n
    assert running == 0
    if leave_after > 0:
        assert sent[0]["status"] == 200 and len(sent) == 1 + leave_after


def test_a_choice_that_fails_before_its_first_chunk_after_the_stream_began(ray_session):
    """The response began with choice 0's chunks; choice 1 then fails before its first
    chunk: its error event ends the stream, choice 0 is cancelled."""
    from cactus.errors import EngineFailedError

    class Late(FakeEngine):
        async def astream(self, req):
            self.seen.append(req)
            if req.request_id.endswith("-1"):
                await asyncio.sleep(0.1)
                raise EngineFailedError("gone")
            yield GenerationChunk(req.request_id, (1,), "y")
            await asyncio.sleep(60)

    shim, app = _app(Late())
    failures = []
    shim.metrics.ended = lambda req, reason: failures.append((req.request_id[-2:], reason))
    body = {"prompt": "x", "n": 2, "stream": True}
    events = _events(_raw(app, "POST", "/v1/completions", json=body))
    assert events[0]["choices"][0]["index"] == 0 and events[-1]["error"]["code"] == 503
    assert sorted(failures) == [("-0", "CANCELLED"), ("-1", "ERROR")]
    assert shim.metrics._running == 0


def test_the_readme_lists_every_finish_reason_a_metric_label_takes():
    """`cactus_request_success{finished_reason}` carries the gRPC API's reasons: the
    README lists each with the OpenAI value a vLLM dashboard filters on (FINISH)."""
    import re
    from pathlib import Path

    from deployments.openai_api import FINISH

    text = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    listed = re.search(r"`finished_reason` is the gRPC API's own, in capitals: ([A-Z_, ]+),", text)
    assert listed, "the README's finished_reason sentence moved"
    assert set(listed.group(1).split(", ")) == set(FINISH)
    assert {FINISH[r] for r in ("EOS", "STOP", "STOP_SEQUENCE")} == {"stop"}
    assert FINISH["LENGTH"] == FINISH["TIME_LIMIT"] == "length" and FINISH["ABORT"] == "abort"


def test_a_request_that_failed_the_engine_every_time_is_a_500_not_to_be_retried(ray_session):
    """OpenAI's clients retry a 500, twice by default, unless the answer carries
    `x-should-retry: false`: a request that brought the engine down on every attempt
    would bring it down again. An unavailable engine stays a 503 with Retry-After."""
    from cactus.errors import RequestAttemptsExhaustedError

    why = "request r: the engine failed 4 times while running it; not retried"
    _, app = _app(FakeEngine(fail=RequestAttemptsExhaustedError(why)))
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x"})
    assert reply.status_code == 500 and reply.json()["error"]["message"] == why
    assert reply.headers["x-should-retry"] == "false" and "retry-after" not in reply.headers
    _, app = _app(FakeEngine(fail=WorkerUnavailableError("down")))
    reply = _raw(app, "POST", "/v1/completions", json={"prompt": "x"})
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert "x-should-retry" not in reply.headers
