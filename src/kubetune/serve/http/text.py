"""Tokens to text, as they arrive: what a streamed answer sends at each step.

Incremental detokenization as vLLM and TGI do it: each step decodes only the last few tokens
(from `prefix` on) and sends the text they add beyond what the tokens before `read` gave, so
the cost per token does not grow with the answer. A half-decoded UTF-8 character (a byte-level
token that completes in the next one) is held back, and so is text that may be the start of
a stop string, until the next token tells.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stops: list[str], eos_token_id: int | None) -> None:
        self.tokenizer, self.stops, self.eos = tokenizer, stops, eos_token_id
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text that was already produced
        self.read = 0
        self.text = ""  # the answer so far
        self.sent = 0  # of which sent
        self.hold = max((len(s) for s in stops), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def push(self, token: int) -> tuple[str, bool]:
        """(text to send now, whether a stop string ended the answer)."""
        if token == self.eos:
            return "", False
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return "", False
        self.text += now[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.sent - len(stop) + 1))
            if at >= 0:
                self.text = self.text[:at]
                return self.flush(), True
        ready = len(self.text) - self.hold
        if ready <= self.sent:
            return "", False
        delta = self.text[self.sent : ready]
        self.sent = ready
        return delta, False

    def flush(self) -> str:
        """Everything not sent yet (at the end of the answer)."""
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta
