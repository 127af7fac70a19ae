"""Tokens to text, as they arrive: what a streamed answer sends at each step.

Each step decodes the whole answer so far (a token can change how the text before it
decodes) and sends what is new. Text that may be the start of a stop string, or a
half-decoded UTF-8 character, is held back until the next token tells.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stops: list[str], eos_token_id: int | None) -> None:
        self.tokenizer, self.stops, self.eos = tokenizer, stops, eos_token_id
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, token: int) -> tuple[str, bool]:
        """(text to send now, whether a stop string ended the answer)."""
        if token == self.eos:
            return "", False
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.text.endswith("\ufffd"):  # an incomplete multi-byte character
            return "", False
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
        text = self.text.removesuffix("\ufffd")
        delta, self.sent = text[self.sent :], len(text)
        return delta
