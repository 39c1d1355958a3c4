"""Streaming text of generated tokens: deltas that never split a character, and stop strings.

Text that could still become a stop string (its last len(stop)-1 characters) or an unfinished UTF-8
sequence is held back until it cannot; the final delta flushes the rest.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # emitted so far
        self.stopped = False  # a stop string appeared; `text` ends right before it

    def push(self, tokens: list[int], final: bool) -> str:
        """The new text delta after `tokens` (all generated ids so far)."""
        if self.tokenizer is None or self.stopped:
            return ""
        full = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for s in self.stop:
            at = full.find(s, max(0, len(self.text) - len(s)))
            if at >= 0:
                full, self.stopped, final = full[:at], True, True
        if final:
            end = len(full)
        else:
            end = len(full) - self.hold
            while end > 0 and full[end - 1] == "\ufffd":
                end -= 1
        if end <= len(self.text):
            return ""
        delta, self.text = full[len(self.text) : end], full[:end]
        return delta
