"""The per-row logits pipeline: what a request does to the target's distribution
before a token is chosen, at every position a verify pass scores.

In this order (as vLLM applies them): `logit_bias`; `repetition_penalty` (vLLM's: over
the prompt's and the output's tokens, a positive logit divided by it, a negative one
multiplied); `frequency_penalty` and `presence_penalty` (OpenAI's formula over the
output's tokens: logit[t] -= count[t] * frequency + (count[t] > 0) * presence); the
grammar's mask (tokens the constraint does not allow get -inf). Then the sampling law
(temperature, top-p...) of sampling.py, or the argmax.

Exact under speculation because verified position i of a row sees the state after
every token before it: the row's output so far and the draft tokens d[:i] of the same
pass (penalty counts, grammar state). The grammar's matcher itself only ever consumes
emitted tokens (`RowLogits.commit`); the masks of draft positions come from llguidance
walking the drafts and rolling back, so a rejection leaves nothing to undo. Drafts are
cut at the first token the grammar refuses (`trim`), and where the grammar allows
exactly one continuation those tokens are proposed for free (`forced`): the target
verifies them like any draft.

Thinking models: where the prompt opens a thinking section (the target's think-start
token after its last think-end), the constraint applies from the token after the
think-end token on; penalties and biases apply throughout.

Log-probabilities are read from the raw logits (before all of this), as OpenAI and
vLLM's default report them (`logprobs_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import llguidance
import mlx.core as mx
import numpy as np
from llguidance.numpy import (
    fill_next_token_bitmask,
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)

from .types import EngineError


class GrammarStateError(EngineError):
    """The grammar refused a token the decoder emitted: its state and the text are out
    of step (a bug: every emitted token was chosen under the grammar's mask)."""


@dataclass
class RowLogits:
    """One row's processors and the state they read: token counts and the grammar."""

    vocab: int
    eos: tuple[int, ...]
    bias: dict[int, float] | None = None
    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    matcher: llguidance.LLMatcher | None = None
    #: The think-end token while the row is inside a thinking section, else None.
    gate: int | None = None
    #: How many top log-probabilities to report per token (None: no logprobs).
    top_logprobs: int | None = None
    prompt: list[int] = field(default_factory=list, repr=False)
    counts: np.ndarray | None = field(default=None, repr=False)
    seen: np.ndarray | None = field(default=None, repr=False)
    _bias: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.frequency or self.presence:
            self.counts = np.zeros(self.vocab, np.float32)
        if self.repetition != 1.0:
            self.seen = np.zeros(self.vocab, bool)
            self.seen[[t for t in self.prompt if 0 <= t < self.vocab]] = True
        if self.bias:
            self._bias = np.zeros(self.vocab, np.float32)
            for t, b in self.bias.items():
                self._bias[t] = b
        self.prompt = []

    @property
    def transforms(self) -> bool:
        """Whether this row's logits differ from the raw ones at all."""
        return (
            self.matcher is not None
            or self.counts is not None
            or self.seen is not None
            or self._bias is not None
        )

    @property
    def constrained(self) -> bool:
        """A grammar applies at the row's next position."""
        return self.matcher is not None and self.gate is None

    def forced(self, budget: int) -> list[int]:
        """Tokens the grammar allows as the only continuation (up to budget)."""
        if not self.constrained or budget <= 0 or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens()[:budget])

    def trim(self, drafts: list[int]) -> list[int]:
        """The longest prefix of drafts the grammar allows (drafts past a refused token
        cannot pass verification and would leave the grammar nothing to mask with)."""
        if self.matcher is None or not drafts:
            return drafts
        head, tail = self._split(drafts)
        if head is None:
            return drafts
        return head + tail[: self.matcher.validate_tokens(tail)]

    def _split(self, tokens: list[int]) -> tuple[list[int] | None, list[int]]:
        """(tokens before the grammar applies, tokens it applies to); (None, []) when
        the grammar applies to none of them (still thinking)."""
        if self.gate is None:
            return [], tokens
        if self.gate in tokens:
            g = tokens.index(self.gate)
            return tokens[: g + 1], tokens[g + 1 :]
        return None, []

    def commit(self, emitted: list[int]) -> None:
        """The tokens the step emitted: counts grow and the grammar consumes them."""
        if self.counts is not None:
            np.add.at(self.counts, [t for t in emitted if 0 <= t < self.vocab], 1)
        if self.seen is not None:
            self.seen[[t for t in emitted if 0 <= t < self.vocab]] = True
        if self.matcher is None:
            return
        head, tail = self._split(emitted)
        if head is None:
            return
        self.gate = None
        for t in tail:
            if self.matcher.is_stopped() and t in self.eos:
                break  # the grammar ended; its EOS ends the row
            if not self.matcher.consume_token(t):
                raise GrammarStateError(
                    f"the grammar refused emitted token {t}: {self.matcher.get_error()}"
                )

    def _fill_thinking(self, drafts: list[int], bitmask: np.ndarray, base: int) -> None:
        # A draft that ends the thinking: the positions after its think-end token are
        # masked by the grammar walked over the drafts after it (then rolled back).
        head, tail = self._split(drafts)
        if head is None:
            return
        # (A refused token is not consumed: a refusal leaves the matcher in error.)
        valid = self.matcher.validate_tokens(tail)
        for i in range(valid + 1):
            fill_next_token_bitmask(self.matcher, bitmask, base + len(head) + i)
            if i < valid:
                self.matcher.consume_token(tail[i])
        self.matcher.rollback(valid)


def process(logits: mx.array, rows: list, drafts: list[list[int]], executor) -> mx.array:
    """The logits every row's sampler reads: rows with processors (`RowLogits`)
    transformed at each verified position, the others as they are.

    logits: (R, W, V) the target's raw logits (position i of row r scores the token
    after its pending token and drafts[r][:i]); rows[r]: RowLogits or None; drafts:
    each row's draft tokens (already `trim`med)."""
    idx = [r for r, p in enumerate(rows) if p is not None and p.transforms]
    if not idx:
        return logits
    _, width, vocab = logits.shape
    logits = logits.astype(mx.float32)
    part = logits[mx.array(idx)]
    procs = [rows[r] for r in idx]
    if any(p._bias is not None for p in procs):
        part = part + mx.array(np.stack([_or_zero(p._bias, vocab) for p in procs]))[:, None, :]
    if any(p.seen is not None for p in procs):
        seen = np.zeros((len(idx), width, vocab), bool)
        rp = np.ones((len(idx), 1, 1), np.float32)
        for j, (p, r) in enumerate(zip(procs, idx, strict=True)):
            if p.seen is not None:
                seen[j] = p.seen[:vocab]
                _cumulate(seen[j], drafts[r], lambda s, t: s.__setitem__(t, True))
                rp[j] = p.repetition
        rp_m = mx.array(rp)
        part = mx.where(mx.array(seen), mx.where(part > 0, part / rp_m, part * rp_m), part)
    if any(p.counts is not None for p in procs):
        counts = np.zeros((len(idx), width, vocab), np.float32)
        weights = np.zeros((len(idx), 2), np.float32)
        for j, (p, r) in enumerate(zip(procs, idx, strict=True)):
            if p.counts is not None:
                counts[j] = p.counts[:vocab]
                _cumulate(counts[j], drafts[r], lambda c, t: c.__setitem__(t, c[t] + 1))
                weights[j] = (p.frequency, p.presence)
        c = mx.array(counts)
        w = mx.array(weights)
        part = part - c * w[:, 0, None, None] - (c > 0).astype(mx.float32) * w[:, 1, None, None]
    if any(p.matcher is not None for p in procs):
        part = mx.where(
            mx.array(_masks(procs, [drafts[r] for r in idx], width, vocab, executor)), part, -mx.inf
        )
    logits[mx.array(idx)] = part
    return logits


def _or_zero(values: np.ndarray | None, vocab: int) -> np.ndarray:
    return values[:vocab] if values is not None else np.zeros(vocab, np.float32)


def _cumulate(rows: np.ndarray, drafts: list[int], add) -> None:
    # Position i sees the drafts before it: row i+1 onwards gains draft i.
    for i, t in enumerate(drafts):
        if i + 1 < rows.shape[0] and 0 <= t < rows.shape[1]:
            for k in range(i + 1, rows.shape[0]):
                add(rows[k], t)


def _masks(procs, drafts, width: int, vocab: int, executor) -> np.ndarray:
    """(rows, width, vocab) booleans: the tokens each row's grammar allows at each
    verified position (all, where no grammar applies)."""
    words = (vocab + 31) // 32
    bitmask = np.full((len(procs) * width, words), -1, dtype=np.int32)
    par, plain = [], []  # (llguidance takes rows with drafts and rows without apart)
    for j, (p, d) in enumerate(zip(procs, drafts, strict=True)):
        if p.matcher is None:
            continue
        if p.gate is not None:
            p._fill_thinking(list(d), bitmask, j * width)
        elif d:
            par.append((p.matcher, j * width, list(d)))
        else:
            plain.append((p.matcher, j * width))
    if par:
        fill_next_token_bitmask_par_with_draft_tokens(executor, par, bitmask)
    if plain:
        fill_next_token_bitmask_par(executor, plain, bitmask)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    allowed = allowed.astype(bool).reshape(len(procs), width, vocab)
    # A position where nothing is allowed (the grammar ended, or refused the text):
    # end the row rather than sample from nothing.
    empty = ~allowed.any(axis=-1)
    if empty.any():
        for j, p in enumerate(procs):
            for i in np.nonzero(empty[j])[0]:
                allowed[j, i, [t for t in p.eos if t < vocab]] = True
    return allowed


def logprobs_of(
    logits: mx.array, rows: list, emitted: list[list[int]]
) -> dict[int, list[tuple[float, list[tuple[int, float]]]]]:
    """For each row r that asks for them: per emitted token (at positions 0..), its
    log-probability under the raw target distribution and the top `top_logprobs`
    (token, log-probability) pairs, ties broken by the lower token id."""
    idx = [r for r, p in enumerate(rows) if p is not None and p.top_logprobs is not None]
    if not idx:
        return {}
    n = max(len(emitted[r]) for r in idx)
    raw = logits[mx.array(idx), :n].astype(mx.float32)
    lp = np.array(raw - mx.logsumexp(raw, axis=-1, keepdims=True))
    out = {}
    for j, r in enumerate(idx):
        k = rows[r].top_logprobs
        entries = []
        for i, t in enumerate(emitted[r]):
            row = lp[j, i]
            top: list[tuple[int, float]] = []
            if k:
                cand = (
                    np.argpartition(-row, k - 1)[:k]
                    if k < row.shape[0]
                    else np.arange(row.shape[0])
                )
                # Ties at the k-th value: take every token tied with it, then the lowest ids.
                cut = row[cand].min()
                cand = np.nonzero(row >= cut)[0]
                order = np.lexsort((cand, -row[cand]))[:k]
                top = [(int(cand[o]), float(row[cand[o]])) for o in order]
            entries.append((float(row[t]), top))
        out[r] = entries
    return out
