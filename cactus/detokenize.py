"""Incremental detokenisation that never splits a multi-byte character.

The offsets scheme vLLM uses: decode a short window of recent tokens twice (with and
without the newest ones) and release only the difference, and only once it no longer
ends in U+FFFD (an incomplete UTF-8 sequence still waiting for its next byte-token).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens already turned into released text

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
        full = self._decode(self.ids)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        self._prefix = self._read = len(self.ids)
        return delta
