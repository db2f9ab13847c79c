"""Incremental detokenization with stop strings.

Each token decodes only a short window (vLLM's prefix/read offsets), so a long answer costs linear work:
the text of ids[prefix:read] is already decoded, and what ids[prefix:] adds beyond it is the new text.
With stop strings, the last len(longest stop) - 1 characters are held back until the next token shows
they do not begin a stop string.
"""

from __future__ import annotations

from mvllm.model.tokenizer import Tokenizer


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.decoded = ""
        self.sent = 0
        self.prefix = self.read = 0

    @property
    def text(self) -> str:
        return self.decoded[:self.sent]

    def add(self, token: int, final: bool = False) -> tuple[str, bool]:
        """Add one token; returns (text to send now, whether a stop string ended the output)."""
        self.ids.append(token)
        if self.tokenizer.hf is None:
            return "", False
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        window = self.tokenizer.decode(self.ids[self.prefix:])
        if len(window) > len(done) and (final or not window.endswith("\ufffd")):
            self.decoded += window[len(done):]
            self.prefix, self.read = self.read, len(self.ids)
        for s in self.stop:
            at = self.decoded.find(s, max(self.sent - len(s) + 1, 0))
            if at != -1:
                return self._send(at), True
        return self._send(len(self.decoded) if final else max(len(self.decoded) - self.hold, self.sent)), False

    def flush(self) -> str:
        """The text held back (a possible start of a stop string, an incomplete character) once the output
        ended without a token of its own (a remote's last chunk may carry only its finish_reason)."""
        if self.tokenizer.hf is None:
            return ""
        window = self.tokenizer.decode(self.ids[self.prefix:])
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        if len(window) > len(done):
            self.decoded += window[len(done):]
            self.prefix = self.read = len(self.ids)
        return self._send(len(self.decoded))

    def _send(self, upto: int) -> str:
        out = self.decoded[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out
