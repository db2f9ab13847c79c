"""Incremental detokenization with stop strings."""

from __future__ import annotations

from mvllm.llm import Tokenizer


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""

    def add(self, token: int, final: bool = False) -> tuple[str, bool]:
        """Add one token; returns (new text, whether a stop string ended the output)."""
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids)
        if full is None:
            return "", False
        if full.endswith("\ufffd") and not final:
            return "", False  # an incomplete UTF-8 sequence: wait for the next token
        for s in self.stop:
            at = full.find(s, max(len(self.text) - len(s), 0))
            if at != -1:
                full = full[:at]
                delta, self.text = full[len(self.text):], full
                return delta, True
        delta, self.text = full[len(self.text):], full
        return delta, False
