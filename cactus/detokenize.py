"""Incremental detokenisation that never splits a multi-byte character.

The offsets scheme vLLM uses: decode a short window of recent tokens twice (with and
without the newest ones) and release only the difference, and only once it no longer
ends in U+FFFD (an incomplete UTF-8 sequence still waiting for its next byte-token).
The window starts inside the prompt (`context`: its last few tokens), as vLLM's does: a
SentencePiece tokenizer (Llama 2, Mistral) strips the leading space of whatever it
decodes, so the first generated token decoded alone would lose its space ("Paris"
after "is" for "▁Paris").
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A text prompt's ids, with the special tokens the tokenizer adds by default (a
    Llama or Mistral checkpoint's BOS), as vLLM's completions API encodes one; both
    APIs and the in-process engine encode text through this. A chat conversation is
    not: its template writes its own BOS (deployments/openai_api.py)."""
    return tokenizer.encode(text)


# prompt tokens the first window starts with (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """`text` is what the tokens added since construction decode to; `context` (the
    prompt, or its end) only gives the first of them their left neighbours."""

    def __init__(self, tokenizer, context=()) -> None:
        self._tok = tokenizer
        self.ids: list[int] = [int(t) for t in list(context)[-CONTEXT_TOKENS:]]
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = len(self.ids)  # tokens already turned into released text

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (possibly empty)."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: release whatever is left (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        fits = len(new_text) > len(prefix_text) and new_text.startswith(prefix_text)
        delta = new_text[len(prefix_text) :] if fits else ""
        self.text += delta
        self._prefix = self._read = len(self.ids)
        return delta
