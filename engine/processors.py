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
    each row's draft tokens (already `trim`med).

    The penalties of a row's state before the pass apply to every position as (r, 1, V)
    arrays on the device; the few entries the pass's own drafts change (token d[j] at
    the positions after j) are recomputed from their definition and written over them
    (`_draft_entries`), so nothing of size W x V is built on the host.

    The grammars' masks are filled on the host first, before anything reads the logits:
    a decoder that started the pass with `mx.async_eval` has llguidance's work overlap
    the model's evaluation."""
    idx = [r for r, p in enumerate(rows) if p is not None and p.transforms]
    if not idx:
        return logits
    _, width, vocab = logits.shape
    procs = [rows[r] for r in idx]
    pass_drafts = [drafts[r] for r in idx]
    bitmask = None
    if any(p.matcher is not None for p in procs):
        bitmask = _fill_masks(procs, pass_drafts, width, vocab, executor)
    logits = logits.astype(mx.float32)
    every = len(idx) == logits.shape[0]  # (a dataset job's rows share their request)
    rows_idx = mx.array(idx)
    part = logits if every else logits[rows_idx]
    if any(p._bias is not None for p in procs):
        part = part + mx.array(np.stack([_or_zero(p._bias, vocab) for p in procs]))[:, None, :]
    biased = part
    if any(p.seen is not None for p in procs):
        seen = mx.array(np.stack([_or_false(p.seen, vocab) for p in procs]))[:, None, :]
        rp = mx.array([p.repetition for p in procs], dtype=mx.float32)[:, None, None]
        part = repetition(part, seen, rp)
    if any(p.counts is not None for p in procs):
        counts = mx.array(np.stack([_or_zero(p.counts, vocab) for p in procs]))[:, None, :]
        w = mx.array([(p.frequency, p.presence) for p in procs], dtype=mx.float32)
        part = frequency_presence(part, counts, w[:, 0, None, None], w[:, 1, None, None])
    fix = _draft_entries(procs, pass_drafts, width, vocab)
    if fix is not None:
        j, i, t = fix
        at = (mx.array(j), mx.array(i), mx.array(t))
        values = np.array(biased[at])
        part[at] = mx.array(_penalised(values, procs, pass_drafts, j, i, t))
    if bitmask is not None:
        part = mx.where(_allowed(bitmask, procs, width, vocab), part, -mx.inf)
    if every:
        return part
    logits[rows_idx] = part
    return logits


def repetition(logits: mx.array, seen: mx.array, penalty: mx.array) -> mx.array:
    """vLLM's repetition penalty where `seen`: a positive logit divided by it, a negative
    one multiplied (arrays broadcast; the verify pass and the draft passes share it)."""
    return mx.where(seen, mx.where(logits > 0, logits / penalty, logits * penalty), logits)


def frequency_presence(logits, counts, frequency, presence) -> mx.array:
    """OpenAI's formula: logit[t] -= count[t] * frequency + (count[t] > 0) * presence."""
    return logits - counts * frequency - (counts > 0) * presence


def _or_zero(values: np.ndarray | None, vocab: int) -> np.ndarray:
    return values[:vocab] if values is not None else np.zeros(vocab, np.float32)


def _or_false(values: np.ndarray | None, vocab: int) -> np.ndarray:
    return values[:vocab] if values is not None else np.zeros(vocab, bool)


def _draft_entries(procs, drafts, width: int, vocab: int):
    """(row, position, token) index arrays of the entries a pass's own drafts change:
    token d[k] at every verified position after k, in rows with penalties; None if none.
    Position i sees the drafts before it: the state before the pass plus d[:i]."""
    rows_, positions, tokens = [], [], []
    for j, (p, d) in enumerate(zip(procs, drafts, strict=True)):
        if p.counts is None and p.seen is None:
            continue
        for k, t in enumerate(d):
            if 0 <= t < vocab:
                for i in range(k + 1, min(len(d) + 1, width)):
                    rows_.append(j), positions.append(i), tokens.append(t)
    if not rows_:
        return None
    return np.array(rows_), np.array(positions), np.array(tokens)


def _penalised(values, procs, drafts, rows, positions, tokens) -> np.ndarray:
    """Each entry's penalised value from the definitions (its bias already in `values`):
    the row's counts before the pass plus the drafts before that position."""
    out = np.array(values, np.float32)
    for n, (j, i, t) in enumerate(zip(rows, positions, tokens, strict=True)):
        p = procs[j]
        extra = drafts[j][:i].count(t)
        v = out[n]
        if p.seen is not None and (p.seen[t] or extra):
            v = v / p.repetition if v > 0 else v * p.repetition
        if p.counts is not None:
            c = p.counts[t] + extra
            v = v - c * p.frequency - (c > 0) * p.presence
        out[n] = v
    return out


def _masks(procs, drafts, width: int, vocab: int, executor) -> mx.array:
    """(rows, width, vocab) booleans: the tokens each row's grammar allows at each
    verified position (all, where no grammar applies)."""
    return _allowed(_fill_masks(procs, drafts, width, vocab, executor), procs, width, vocab)


def _fill_masks(procs, drafts, width: int, vocab: int, executor) -> np.ndarray:
    """(rows * width, words) llguidance bitmask of every row's verified positions, filled
    on the host (-1, all allowed, where no grammar applies)."""
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
    return bitmask


def _allowed(bitmask: np.ndarray, procs, width: int, vocab: int) -> mx.array:
    """The bitmask unpacked on the device: bit b of word w allows token 32 * w + b."""
    words = bitmask.shape[1]
    bits = mx.array(bitmask)[:, :, None] >> mx.arange(32, dtype=mx.int32)
    allowed = (bits & 1).astype(mx.bool_).reshape(len(procs), width, words * 32)[..., :vocab]
    # A position where nothing is allowed (the grammar ended, or refused the text):
    # end the row rather than sample from nothing. Read from the host's bitmask (the
    # bits of the vocabulary only), so nothing waits on the device here.
    tail = vocab - 32 * (words - 1)  # bits of the last word inside the vocabulary
    last = np.int32(-1) if tail == 32 else np.int32((1 << tail) - 1)
    some = (bitmask[:, :-1] != 0).any(axis=1) | ((bitmask[:, -1] & last) != 0)
    empty = ~some.reshape(len(procs), width)
    if empty.any():
        eos = np.zeros((len(procs), width, vocab), bool)
        for j, p in enumerate(procs):
            for i in np.nonzero(empty[j])[0]:
                eos[j, i, [t for t in p.eos if t < vocab]] = True
        allowed = allowed | mx.array(eos)
    return allowed


def logprobs_of(
    logits: mx.array, rows: list, emitted: list[list[int]]
) -> dict[int, list[tuple[float, list[tuple[int, float]]]]]:
    """For each row r that asks for them: per emitted token (at positions 0..), its
    log-probability under the raw target distribution and the top `top_logprobs`
    (token, log-probability) pairs, ties broken by the lower token id. The log-softmax
    and the candidates stay on the device; the host reads a few values per token."""
    idx = [r for r, p in enumerate(rows) if p is not None and p.top_logprobs is not None]
    if not idx:
        return {}
    n = max(len(emitted[r]) for r in idx)
    raw = logits[mx.array(idx), :n].astype(mx.float32)
    lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)  # (rows, n, V)
    vocab = lp.shape[-1]
    tokens = mx.array([emitted[r] + [0] * (n - len(emitted[r])) for r in idx])
    chosen = np.array(mx.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0])
    k = max(rows[r].top_logprobs for r in idx)
    seen = min(vocab, k + 8)  # candidates past k, so ties at the k-th value are seen
    if k:
        if seen < vocab:
            cand = mx.argpartition(-lp, kth=seen - 1, axis=-1)[..., :seen]
        else:
            cand = mx.broadcast_to(mx.arange(vocab), lp.shape)
        cand_lp = np.array(mx.take_along_axis(lp, cand, axis=-1))
        cand = np.array(cand)
    out = {}
    for j, r in enumerate(idx):
        want = rows[r].top_logprobs
        entries = []
        for i in range(len(emitted[r])):
            top: list[tuple[int, float]] = []
            if want:
                ids, values = cand[j, i], cand_lp[j, i]
                order = np.lexsort((ids, -values))
                cut = values[order[want - 1]]
                if seen < vocab and np.sum(values >= cut) == seen:  # ties past the candidates
                    row = np.array(lp[j, i])
                    ids = np.nonzero(row >= cut)[0]
                    values = row[ids]
                    order = np.lexsort((ids, -values))
                top = [(int(ids[o]), float(values[o])) for o in order[:want]]
            entries.append((float(chosen[j, i]), top))
        out[r] = entries
    return out
