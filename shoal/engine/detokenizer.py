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
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.matchers = [PrefixMatcher(s) for s in stop]
        self.window = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.window)
        self.text = ""
        self.emitted = 0
        self.stopped_by: str | None = None
        # Stop strings count only from the min_tokens-th output token on, as EOS and stop ids do.
        self.min_tokens = min_tokens
        self.num_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token_id: int) -> str | None:
        """Adds a token; returns the stop string it completed, if any."""
        if self.stopped_by is not None:
            return self.stopped_by
        self.num_tokens += 1
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
        for m in self.matchers:
            m.feed(new)
        if self.num_tokens < self.min_tokens:
            return None
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx >= 0:
                self.text = self.text[: idx + (len(s) if self.include_stop else 0)]
                self.stopped_by = s
                return s
        return None

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted; while running, a tail that is the start of a stop string waits
        (only such a tail: a long stop string must not hold back text that cannot begin it)."""
        end = len(self.text)
        if not (finished or self.stopped_by):
            end = max(self.emitted, end - self._partial_stop())
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _partial_stop(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        return max((m.state for m in self.matchers), default=0)


class PrefixMatcher:
    """Tracks, as text streams in, the longest tail of it that is a proper prefix of `pattern`
    (a Knuth-Morris-Pratt automaton): amortised O(1) per character, whatever the pattern's length."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.fail = [0] * len(pattern)
        k = 0
        for i in range(1, len(pattern)):
            while k and pattern[i] != pattern[k]:
                k = self.fail[k - 1]
            if pattern[i] == pattern[k]:
                k += 1
            self.fail[i] = k
        self.state = 0

    def feed(self, text: str) -> None:
        p, fail, k = self.pattern, self.fail, self.state
        for ch in text:
            while k and p[k] != ch:
                k = fail[k - 1]
            if p[k] == ch:
                k += 1
            if k == len(p):  # a whole match is the caller's to find; keep only a proper prefix
                k = fail[k - 1]
        self.state = k
