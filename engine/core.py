"""The acceptance rules of speculative decoding, for the rows of a verify pass.

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

from contract.limits import MAX_DRAFT_TOKENS

from . import sampling
from .types import InvalidRequestError

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
    source: str = "model"  # "model", "lookup", "forced" (by a grammar) or "none" (K = 0)
    #: With logprobs: per emitted token, (its raw log-probability, [(token, logprob)]).
    logprobs: list | None = None


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
    p: mx.array, q: mx.array | None, drafts: mx.array | None, lengths: list[int], u, noise
) -> list[tuple[int, int]]:
    """Speculative sampling over rows at once: [(accepted count, next token)] per row.

    p: (R, W, V) target laws, row r's position i scoring draft i (position lengths[r]:
    the bonus); q: (R, W - 1, V) the laws row r's drafts were drawn from (one-hot for a
    deterministic drafter; anything past lengths[r] is ignored); drafts: (R, W - 1)
    token ids, padded; u: (R, W - 1) uniforms for the accept tests; noise: (R, W, V)
    Gumbel noise for the token that follows. q, drafts and u are None when W == 1.
    """
    k = mx.array(lengths)[:, None]
    if p.shape[1] == 1:
        n = mx.zeros((p.shape[0],), mx.int32)
        dist = p
    else:
        x = drafts[..., None]
        px = mx.take_along_axis(p[:, :-1], x, axis=-1)[..., 0]
        qx = mx.take_along_axis(q, x, axis=-1)[..., 0]
        drafted = mx.arange(p.shape[1] - 1)[None, :] < k
        accept = (u * qx < px) & drafted
        n = mx.sum(mx.cumprod(accept.astype(mx.int32), axis=1), axis=1)
        residual = mx.maximum(p[:, :-1] - q, 0.0)
        mass = residual.sum(axis=-1, keepdims=True)
        # p == q leaves no residual; rejection then has probability 0, but guard it.
        residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:, :-1])
        dist = mx.concatenate([mx.where(drafted[..., None], residual, p[:, :-1]), p[:, -1:]], 1)
    candidates = sampling.sample_rows(dist, noise)  # (R, W): a candidate per position
    token = mx.take_along_axis(candidates, n[:, None], axis=1)[:, 0]
    return list(zip(n.tolist(), token.tolist(), strict=True))
