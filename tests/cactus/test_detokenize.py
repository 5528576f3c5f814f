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
