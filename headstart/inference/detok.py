"""Incremental detokenisation: each new token costs a decode of a few tokens, not of the whole output.

Streaming text follows the usual two-offset scheme: decode a short window of already-shown tokens
and the window plus the new ones, and append the difference, holding back text that ends in an
incomplete UTF-8 character (U+FFFD). The final text of a finished request is one full decode, so it
is exactly what decoding all ids at once gives.
"""

from __future__ import annotations

from typing import Any


class IncrementalText:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self.prefix = 0  # ids[prefix:read] were shown already: the context of the next piece
        self.read = 0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: list[int]) -> str:
        """The output ids so far -> the text newly shown (possibly empty)."""
        shown = self.decode(ids[self.prefix:self.read])
        full = self.decode(ids[self.prefix:])
        if len(full) <= len(shown) or full.endswith("\ufffd") or not full.startswith(shown):
            return ""
        piece = full[len(shown):]
        self.text += piece
        self.prefix, self.read = self.read, len(ids)
        return piece

    def add(self, ids: list[int], stops: list[str] | None) -> bool:
        """Show the text of the output ids so far; True if a stop string appeared, the text then being
        the full decode cut before the first listed stop string found. A stop string can only start in
        the tail that grew; while text is held back (an incomplete character) it may hide there, so
        then a full decode is searched."""
        piece = self.update(ids)
        if not stops:
            return False
        held = self.read < len(ids)
        if not held and not (piece and any(s in self.text[-(len(piece) + max(map(len, stops))):] for s in stops)):
            return False
        full = self.decode(ids)
        for s in stops:
            cut = full.find(s)
            if cut >= 0:
                self.text = full[:cut]
                self.prefix = self.read = len(ids)
                return True
        return False

    def final(self, ids: list[int]) -> str:
        self.text = self.decode(ids)
        self.prefix = self.read = len(ids)
        return self.text
