"""The acceptance rules of speculative decoding, for one row of a verify pass.

One step: the drafter proposes K tokens, the target scores the pending token plus
all K in one pass, and the longest acceptable prefix is kept, followed by one
token from the target (the correction at the first rejection, or a bonus token
when all K pass). Greedy: a draft token is accepted iff it is the target's
argmax. Sampling: accept x_i while u_i * q_i(x_i) < p_i(x_i); at the first
rejection draw from normalize(max(0, p_i - q_i)); p is exactly mlx-lm's sampling
law (see sampling.py) and q the law the draft token was drawn from (one-hot for
prompt lookup). K = 0 is plain target decoding through the same code.

The decoder that runs these steps over one or many rows is batch.BatchDecoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from . import sampling
from .sampling import DRAW_TARGET, SamplingParams
from .types import InvalidRequestError

MAX_DRAFT_TOKENS = 16

__all__ = ["MAX_DRAFT_TOKENS", "InvalidRequestError", "Step", "accept_greedy", "accept_sampled"]


@dataclass(frozen=True)
class Step:
    """What one verify step produced for one row: emitted tokens and how many drafts
    passed, the step's draft and verify seconds, and where the drafts came from."""

    tokens: list[int]
    proposed: int
    accepted: int
    draft_s: float
    verify_s: float
    source: str = "model"  # "model", "lookup" or "none" (K = 0)


def accept_greedy(best: list[int], drafts: list[int]) -> tuple[int, int]:
    """Greedy verification: accept drafts while they equal the target's argmax.

    best[i] is the target's argmax after draft i (best[0]: after the pending
    token). Returns (accepted count, the target's token that follows them).
    """
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return n, best[n]


def accept_sampled(
    logits: mx.array, drafts: list[int], q, params: SamplingParams, seed: int, position: int
) -> tuple[int, int]:
    """Speculative sampling over one row: (accepted count, next token).

    logits: (k + 1, V) target rows; q: (k, V) draft laws, or None for a
    deterministic drafter (one-hot). Randomness is keyed by (seed, position + i).
    """
    k = len(drafts)
    p = sampling.probs(logits, params)  # (k + 1, V), float32
    noise = sampling.gumbel_rows(seed, position, k + 1, p.shape[-1], DRAW_TARGET)
    if k == 0:
        return 0, sampling.sample_rows(p, noise)[0].item()
    x = mx.array(drafts)
    if q is None:
        q = (mx.arange(p.shape[-1])[None, :] == x[:, None]).astype(mx.float32)
    rows = mx.arange(k)
    px, qx = p[rows, x], q[rows, x]
    accept = sampling.uniforms(seed, position, k) * qx < px
    residual = mx.maximum(p[:k] - q, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    # p == q leaves no residual; rejection then has probability 0, but guard it.
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:k])
    candidates = sampling.sample_rows(mx.concatenate([residual, p[k:]]), noise)
    accept, candidates = accept.tolist(), candidates.tolist()
    n = 0
    while n < k and accept[n]:
        n += 1
    return n, candidates[n]
