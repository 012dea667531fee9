"""Incremental detokenization and stop strings.

Text is decoded from a small window of recent tokens; a window ending in an incomplete UTF-8
sequence (decoded as U+FFFD) is held back until the next token completes it, so no character is
ever split. While a stop string could still be forming, its possible prefix is held back too.
"""

from __future__ import annotations

from shoal.models.tokenizer import Tokenizer

# Prompt tokens decoded as left context, so the first output token gets the right spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.window = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.window)
        self.text = ""
        self.emitted = 0
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token_id: int) -> str | None:
        """Adds a token; returns the stop string it completed, if any."""
        if self.stopped_by is not None:
            return self.stopped_by
        self.window.append(token_id)
        prefix = self._decode(self.window[self.prefix_offset : self.read_offset])
        full = self._decode(self.window[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.window)
        # Keep the decode window short: older tokens no longer affect new text.
        if self.prefix_offset > 64:
            self.window = self.window[self.prefix_offset :]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        search_from = max(0, len(self.text) - self.hold)
        self.text += new
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx >= 0:
                self.text = self.text[: idx + (len(s) if self.include_stop else 0)]
                self.stopped_by = s
                return s
        return None

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted; while running, the tail that might start a stop string waits."""
        end = len(self.text) if finished or self.stopped_by else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
