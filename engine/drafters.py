"""Draft sources that need no model: prompt lookup.

Prompt lookup proposes the tokens that followed the most recent earlier
occurrence of the last n-gram of prompt + output (longest n first). It costs no
model pass, so it pays wherever the output repeats its input: summaries,
extraction, code edits.
"""

from __future__ import annotations

DRAFTERS = ("model", "lookup", "none")


class LookupIndex:
    """Incremental n-gram index over a growing token sequence."""

    def __init__(self, tokens: list[int], max_ngram: int = 3, min_ngram: int = 1):
        self.tokens: list[int] = []
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        # (n-gram) -> index of the token that followed its latest occurrence
        self._follower: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens, indexing each n-gram once a token follows it."""
        for tok in new_tokens:
            end = len(self.tokens)
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    self._follower[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(tok)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest suffix."""
        if k <= 0:
            return []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(self.tokens) < n:
                continue
            start = self._follower.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start : start + k]
        return []
