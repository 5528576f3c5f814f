"""Incremental detokenisation never splits a multi-byte character."""

from __future__ import annotations

from cactus.detokenize import REPLACEMENT, IncrementalDetokenizer

TEXT = "def café():\n    return 'naïve 日本語 ✓ 🙂 — done'\n"


def test_deltas_reassemble_the_text_without_broken_characters(tiny_tokenizer):
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 4  # the tiny vocabulary splits multi-byte characters
    detok = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == TEXT == detok.text
    assert any(d == "" for d in deltas)  # some tokens were held back mid-character


def test_flush_releases_an_incomplete_tail(tiny_tokenizer):
    ids = tiny_tokenizer.encode("ok 🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny_tokenizer)
    for t in ids[:-1]:
        detok.add(t)
    tail = detok.flush()
    assert detok.text.startswith("ok") and tail.endswith(REPLACEMENT)


def _sentencepiece_tokenizer():
    """A Llama (SentencePiece-style) tokenizer built in memory: its decoder strips the
    leading space of whatever it decodes."""
    from transformers import LlamaTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁The": 3, "▁capital": 4, "▁is": 5}
    vocab.update({"▁Paris": 6, ".": 7, "▁It": 8})
    return LlamaTokenizer(vocab=vocab, merges=[])


def test_a_sentencepiece_first_token_keeps_its_space_after_the_prompt():
    """Decoded alone, "▁Paris" is "Paris": the completion of "The capital is" read
    "isParis". The first window starts inside the prompt, as vLLM's does."""
    tok = _sentencepiece_tokenizer()
    prompt, generated = [3, 4, 5], [6, 7, 8]
    whole = tok.decode(prompt + generated)
    assert whole == "The capital is Paris. It" and tok.decode([6]) == "Paris"
    detok = IncrementalDetokenizer(tok, context=prompt)
    deltas = [detok.add(t) for t in generated] + [detok.flush()]
    assert "".join(deltas) == detok.text == whole[len(tok.decode(prompt)) :] == " Paris. It"
    assert deltas[0] == " Paris"
    # without a context (a request given no prompt text) nothing changes: as before
    alone = IncrementalDetokenizer(tok)
    assert "".join([alone.add(t) for t in generated] + [alone.flush()]) == "Paris. It"


def test_a_request_streams_the_space_of_its_first_token():
    """The same through a request's bookkeeping (workers/request.py), stop strings
    included: " Paris" matches at the first token."""
    from cactus.params import GenerationRequest, SamplingParams
    from workers.request import RequestState

    tok = _sentencepiece_tokenizer()
    req = GenerationRequest(
        prompt_token_ids=(3, 4, 5),
        request_id="sp",
        sampling=SamplingParams(max_tokens=8, temperature=0.0, stop=(" Paris",)),
    )
    state = RequestState(
        req, [3, 4, 5], seed=0, eos=(2,), tokenizer=tok, max_context=64, sink=lambda _: None
    )
    state.emit([6, 7])
    assert state.finish_reason == "STOP_SEQUENCE" and state.generated == [6]
