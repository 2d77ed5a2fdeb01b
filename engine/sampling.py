"""The target's sampling law, and randomness keyed by (seed, position).

`probs()` returns exactly the distribution that mlx-lm's `make_sampler` draws from
for the same temperature/top_p/min_p/top_k: it reuses mlx-lm's own filters, in
mlx-lm's order, on log-probabilities, then divides by the temperature.

Random draws are keyed by the request seed and the absolute output position, not
by how many draws came before, so an output does not depend on what the process
ran earlier or on how requests were batched together. The numbers come from a
counter-based hash (splitmix64 keys, murmur3 mixing), so one pass of array
operations draws for every row and position of a batch at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

# Purposes of a random draw at one position; each gets its own stream.
DRAW_DRAFT = 1
DRAW_ACCEPT = 2
DRAW_TARGET = 3

_MASK64 = (1 << 64) - 1
# The largest finite float32: a temperature whose 1/T exceeds it cannot scale logits.
_FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; temperature 0 means greedy (argmax).

    A temperature so small that float32 cannot hold 1/T is the limit of sampling as
    T -> 0, which is greedy decoding, and is run as greedy.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or 1.0 / self.temperature > _FLOAT32_MAX


def probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Rows of logits (..., V) -> float32 probabilities mlx-lm's sampler draws from."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    vocab = logprobs.shape[-1]
    # Same filters, same order and same conditions as mlx_lm.sample_utils.make_sampler.
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, 1)
    if 0 < params.top_k < vocab:
        logprobs = apply_top_k(logprobs, params.top_k)
    # Shift the best to 0 first (softmax is shift-invariant): at tiny temperatures
    # every scaled log-probability would otherwise overflow to -inf and give NaN.
    logprobs = logprobs - mx.max(logprobs, axis=-1, keepdims=True)
    return mx.softmax(logprobs * (1.0 / params.temperature), axis=-1, precise=True)


def _mix64(x: np.ndarray) -> np.ndarray:
    # splitmix64 finaliser, elementwise on uint64: spreads nearby (seed, position)
    # pairs far apart. numpy's uint64 arithmetic wraps modulo 2^64, as intended.
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def position_keys(seeds: Sequence[int], starts: Sequence[int], width: int, purpose: int):
    """(rows, width) uint64 keys: row r, column i keyed by (seeds[r], starts[r] + i,
    purpose) and by nothing else."""
    seed = np.array([s & _MASK64 for s in seeds], dtype=np.uint64)[:, None]
    position = np.array(starts, dtype=np.uint64)[:, None] + np.arange(width, dtype=np.uint64)
    return _mix64(_mix64(_mix64(seed) ^ position) ^ np.uint64(purpose))


_C1, _C2, _C3 = (mx.array(c, dtype=mx.uint32) for c in (0x85EBCA6B, 0xC2B2AE35, 0x9E3779B1))
_S13, _S16, _S8 = (mx.array(c, dtype=mx.uint32) for c in (13, 16, 8))


def _fmix32(h: mx.array) -> mx.array:
    # murmur3's finaliser: a bijection of uint32 with full avalanche.
    h = h ^ (h >> _S16)
    h = h * _C1
    h = h ^ (h >> _S13)
    h = h * _C2
    return h ^ (h >> _S16)


def _hash_uniform(keys: np.ndarray, n: int) -> mx.array:
    """(rows, width, n) uniforms in (0, 1): element j of column (r, i) hashed from
    keys[r, i] and j (a counter-based generator: no state, one pass for every row)."""
    hi = mx.array((keys >> np.uint64(32)).astype(np.uint32))[..., None]
    lo = mx.array((keys & np.uint64(0xFFFFFFFF)).astype(np.uint32))[..., None]
    j = mx.arange(n, dtype=mx.uint32)
    h = _fmix32(_fmix32(j * _C3 + lo) ^ hi)
    h = _fmix32(h + lo)
    return ((h >> _S8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel_table(keys: np.ndarray, vocab: int) -> mx.array:
    """(rows, width, vocab) Gumbel noise, column (r, i) keyed by keys[r, i]."""
    return -mx.log(-mx.log(_hash_uniform(keys, vocab)))


def uniform_table(keys: np.ndarray) -> mx.array:
    """(rows, width) uniforms in (0, 1) for accept/reject tests, keyed like gumbel_table."""
    return _hash_uniform(keys, 1)[..., 0]


def sample_rows(p: mx.array, noise: mx.array) -> mx.array:
    """Draw one token per row of probabilities p using Gumbel noise (Gumbel-max)."""
    return mx.argmax(mx.log(p) + noise, axis=-1)


def probs_rows(logits: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    """probs() for rows (R, ..., V) with their own settings params[r]; rows that share
    settings go through one call."""
    groups: dict[SamplingParams, list[int]] = {}
    for r, prm in enumerate(params):
        groups.setdefault(prm, []).append(r)
    if len(groups) == 1:
        return probs(logits, params[0])
    order, parts = [], []
    for prm, rows in groups.items():
        order += rows
        parts.append(probs(logits[mx.array(rows)], prm))
    inverse = np.argsort(np.array(order))
    return mx.concatenate(parts)[mx.array(inverse)]
