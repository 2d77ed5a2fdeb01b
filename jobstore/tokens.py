"""Counting a prompt's tokens in bounded memory and time, for the submit-time check
(producer.tokencount) and the worker's check before it runs a line (worker.execute).

The `tokenizers` library holds about 200 bytes per character while it encodes, so a
whole 8 MB prompt would cost ~2 GB: a long text is tokenized WINDOW_CHARS characters at
a time, and counting stops once the count passes what the context leaves.
"""

from __future__ import annotations

import re

#: Characters tokenized per call while counting a long prompt (bounds memory).
WINDOW_CHARS = 1 << 16

_WORD_START = re.compile(r"\s(?=\S)")


def count_tokens(tokenizer, texts: list[str], limit: int) -> int:
    """Tokens of `texts` (no special tokens), counted until the count passes `limit`:
    exact when it is at most `limit`, else a lower bound above `limit`.

    A text longer than WINDOW_CHARS is tokenized a window at a time, each cut made
    before the last space that starts a word (where a byte-level or metaspace
    tokenizer starts a new pre-token anyway), and one token per cut is taken off, so
    the sum stays a lower bound of the whole text's count.
    """
    n = 0
    for text in texts:
        start = 0
        while start < len(text) and n <= limit:
            end = start + WINDOW_CHARS
            if end < len(text):
                last = None
                for last in _WORD_START.finditer(text, start + 1, end + 1):  # noqa: B007
                    pass
                end = last.start() if last is not None else end
            piece = text[start:end]
            n += len(tokenizer.encode(piece, add_special_tokens=False).ids)
            if end < len(text):
                n -= 1
            start = end
    return n


def prompt_texts(job) -> list[str]:
    """The texts of a line's prompt (a JobLine): the prompt, or the messages' contents."""
    if job.endpoint == "completion":
        return [job.params["prompt"]]
    return [m["content"] for m in job.params["messages"]]


def tokens_over(tokenizer, texts: list[str], max_tokens: int, context: int) -> int | None:
    """A lower bound of the prompt's tokens when they and max_tokens cannot fit `context`
    tokens, else None. Bounded: cheap byte bound first (a byte-level token covers at
    least one UTF-8 byte), then count_tokens, which stops past the limit."""
    budget = context - max_tokens
    if sum(len(t) for t in texts) * 4 <= budget:  # at most 4 UTF-8 bytes per character
        return None
    if sum(len(t.encode()) for t in texts) <= budget:
        return None
    n = count_tokens(tokenizer, texts, budget)
    return n if n > budget else None
