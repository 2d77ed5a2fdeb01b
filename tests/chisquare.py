"""The statistical test of speculative sampling, shared by the engine, family and DFlash
tests: enumerate the exact law of the first few tokens under target-only sampling on a
model with a tiny vocabulary, draw sequences from the engine, Pearson chi-square.

Draws go through the one decoder (engine.batch.BatchDecoder). `draw(..., rows=R)` keeps
up to R rows decoding together, new rows joining as others finish, with mixed drafters
and draft lengths: the batched path. `rows=1` runs each sequence alone through
SpeculativeDecoder, which is what `engine.generate` runs: the single path. One row costs
a few MLX calls per token, so the single path is checked two ways: seed for seed it must
draw exactly what the batched path draws (`single_equals_batched`: then its law is the
batched path's law, which the large chi-square test checks), and a smaller chi-square
test of its own.
"""

from __future__ import annotations

import functools
import itertools

import mlx.core as mx
import numpy as np
from scipy.stats import chisquare

from engine import sampling
from engine.batch import BatchDecoder, SpeculativeDecoder

P_FAIL = 1e-6
#: Rows decoding together in the batched draws: the fastest per sequence on a CPU.
ROWS = 50
#: (drafter, num_draft_tokens) cycled over the draws.
SETUPS = (("model", 1), ("model", 2), ("model", 3), ("lookup", 2), ("none", 1))


def exact_law(target, prompt: list[int], params, length: int, vocab: int) -> dict:
    """P(first `length` tokens) under target-only sampling, by enumeration (fresh mlx-lm
    caches for every prefix)."""

    @functools.cache
    def next_law(prefix: tuple[int, ...]) -> np.ndarray:
        cache = target.make_cache() if hasattr(target, "make_cache") else None
        logits = target(mx.array([prompt + list(prefix)]), cache=cache)[0, -1]
        return np.array(sampling.probs(logits, params), dtype=np.float64)

    law = {}
    for seq in itertools.product(range(vocab), repeat=length):
        p = 1.0
        for i in range(length):
            p *= next_law(seq[:i])[seq[i]]
        law[seq] = p
    return law


def chi_square_p(law: dict, counts: dict) -> float:
    """Pearson chi-square p-value of the counts against the law (0 if a draw is impossible)."""
    n = sum(counts.values())
    if any(law.get(s, 0) == 0 for s in counts):
        return 0.0
    keys = [s for s, p in law.items() if p > 0]
    observed = np.array([counts.get(s, 0) for s in keys], dtype=np.float64)
    expected = np.array([law[s] for s in keys]) * n
    return float(chisquare(observed, expected * n / expected.sum()).pvalue)


def _sequences(pair, seeds, prompt, params, length, rows, setups):
    """{seed: first `length` tokens}, drawn `rows` at a time (1: the single path)."""
    out: dict[int, list[int]] = {}
    if rows == 1:
        for i, seed in enumerate(seeds):
            drafter, k = setups[i % len(setups)]
            dec = SpeculativeDecoder(
                pair,
                prompt,
                params,
                seed=seed,
                drafter=drafter,
                num_draft_tokens=k,
                max_tokens=length,
            )
            out[seed] = [t for step in dec.steps() for t in step.tokens][:length]
        return out
    batch = BatchDecoder(pair)
    running: dict[int, list[int]] = {}
    todo = list(enumerate(seeds))
    taken, left = 0, len(todo)
    while left:
        while taken < len(todo) and len(running) < rows:
            i, seed = todo[taken]
            taken += 1
            drafter, k = setups[i % len(setups)]
            batch.add(
                seed,
                prompt,
                params,
                seed=seed,
                drafter=drafter,
                num_draft_tokens=k,
                max_tokens=length,
            )
            running[seed] = []
        for seed, step in batch.step().items():
            running[seed].extend(step.tokens)
            if len(running[seed]) >= length:
                out[seed] = running.pop(seed)[:length]
                batch.remove(seed)
                left -= 1
    return out


def draw(pair, n, seed0, prompt, params, length, rows=ROWS, setups=SETUPS) -> dict:
    """Counts of the first `length` tokens over n sequences (seeds seed0, seed0 + 1, ...)."""
    counts: dict[tuple[int, ...], int] = {}
    seqs = _sequences(pair, range(seed0, seed0 + n), prompt, params, length, rows, setups)
    for seq in seqs.values():
        counts[tuple(seq)] = counts.get(tuple(seq), 0) + 1
    return counts


def single_equals_batched(pair, n, seed0, prompt, params, length, setups=SETUPS) -> None:
    """Asserts that n seeds draw the same tokens alone and in a batch of ROWS rows."""
    seeds = range(seed0, seed0 + n)
    single = _sequences(pair, seeds, prompt, params, length, 1, setups)
    batched = _sequences(pair, seeds, prompt, params, length, ROWS, setups)
    differ = [s for s in seeds if single[s] != batched[s]]
    assert not differ, f"{len(differ)} of {n} seeds differ, e.g. {differ[0]}"
