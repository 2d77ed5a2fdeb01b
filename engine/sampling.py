"""The target's sampling law, and randomness keyed by (seed, position).

`probs()` returns exactly the distribution that mlx-lm's `make_sampler` draws from
for the same temperature/top_p/min_p/top_k: it reuses mlx-lm's own filters, in
mlx-lm's order, on log-probabilities, then divides by the temperature.

Random draws are keyed by the request seed and the absolute output position, not
by how many draws came before, so an output does not depend on what the process
ran earlier or on how requests were batched together.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
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


def _mix64(x: int) -> int:
    # splitmix64 finaliser: spreads nearby (seed, position) pairs far apart.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_key(seed: int, position: int, purpose: int) -> mx.array:
    """An MLX PRNG key that depends only on (seed, position, purpose)."""
    h = _mix64(_mix64(_mix64(seed & _MASK64) ^ position) ^ purpose)
    return mx.array([h >> 32, h & 0xFFFFFFFF], dtype=mx.uint32)


def gumbel_rows(seed: int, start: int, n: int, vocab: int, purpose: int) -> mx.array:
    """(n, vocab) Gumbel noise, row i keyed by output position start + i."""
    return mx.stack(
        [
            mx.random.gumbel(shape=(vocab,), key=position_key(seed, start + i, purpose))
            for i in range(n)
        ]
    )


def uniforms(seed: int, start: int, n: int) -> mx.array:
    """n uniforms in [0, 1), one per output position, for accept/reject tests."""
    return mx.concatenate(
        [
            mx.random.uniform(shape=(1,), key=position_key(seed, start + i, DRAW_ACCEPT))
            for i in range(n)
        ]
    )


def sample_rows(p: mx.array, noise: mx.array) -> mx.array:
    """Draw one token per row of probabilities p using Gumbel noise (Gumbel-max)."""
    return mx.argmax(mx.log(p) + noise, axis=-1)
