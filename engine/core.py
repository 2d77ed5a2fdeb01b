"""The token-level speculative decoder: ids in, verified tokens and counters out.

One step: the drafter proposes K tokens, the target scores the pending token plus
all K in one pass, and the longest acceptable prefix is kept, followed by one
token from the target (the correction at the first rejection, or a bonus token
when all K pass). Greedy: a draft token is accepted iff it is the target's
argmax. Sampling: accept x_i while u_i * q_i(x_i) < p_i(x_i); at the first
rejection draw from normalize(max(0, p_i - q_i)); p is exactly mlx-lm's sampling
law (see sampling.py) and q the law the draft token was drawn from (one-hot for
prompt lookup). K = 0 is plain target decoding through the same code.

Both KV caches hold exactly the accepted text after every step, minus the one
pending token that the next step feeds; rejected positions are trimmed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from . import sampling
from .drafters import LookupIndex
from .sampling import DRAW_DRAFT, DRAW_TARGET, SamplingParams
from .types import CacheError, InvalidRequestError

PREFILL_CHUNK = 512
MAX_DRAFT_TOKENS = 16
# A hybrid request drafts by lookup when its last HYBRID_MIN_NGRAM tokens occurred before:
# single-token matches are too often chance (measured on code: 2.1 tokens accepted per
# 1-gram proposal against 2.9 per 2-gram one).
HYBRID_MIN_NGRAM = 2


@dataclass(frozen=True)
class Step:
    """What one verify step produced: emitted tokens and how many drafts passed."""

    tokens: list[int]
    proposed: int
    accepted: int
    draft_s: float
    verify_s: float
    source: str = "model"  # where the drafts came from: "model", "lookup" or "none" (K = 0)


def _new_cache(model, role: str) -> list:
    cache = make_prompt_cache(model)
    if not can_trim_prompt_cache(cache):
        kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
        raise CacheError(
            f"the {role} model's KV cache ({', '.join(kinds)}) cannot be rolled back, "
            "so speculative decoding would corrupt output; use drafter 'none'"
        )
    return cache


def _prefill(model, cache, ids: list[int]) -> None:
    for i in range(0, len(ids), PREFILL_CHUNK):
        model(mx.array([ids[i : i + PREFILL_CHUNK]]), cache=cache)
        mx.eval([c.state for c in cache])


def _trim(cache, n: int) -> None:
    if n > 0 and trim_prompt_cache(cache, n) != n:
        raise CacheError(f"KV cache rollback of {n} tokens failed")


def _cache_len(cache) -> int:
    return cache[0].offset if cache else 0


class SpeculativeDecoder:
    """Decode one sequence; iterate `steps()` for verified blocks of tokens.

    num_draft_tokens is an int (0..16; 0 means plain decoding) or "auto", in
    which case `plan` (an adaptive.DraftPlan) picks K before every step.
    """

    def __init__(
        self,
        pair,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        seed: int = 0,
        drafter: str = "model",
        num_draft_tokens: int | str = "auto",
        max_tokens: int = 256,
        plan=None,
    ):
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        if drafter == "model" and pair.draft is None:
            raise InvalidRequestError(
                "drafter 'model' needs a draft model, but this worker has none; "
                "use drafter 'lookup' or 'none'"
            )
        self.pair = pair
        self.params = params
        self.seed = seed
        self.drafter = drafter
        self.fixed_k = None if num_draft_tokens == "auto" else int(num_draft_tokens)
        self.plan = plan
        self.max_tokens = max_tokens
        self.generated = 0
        self.vocab = pair.target_vocab

        self.target_cache = _new_cache(pair.target, "target")
        _prefill(pair.target, self.target_cache, prompt_ids[:-1])
        self.target_pending = [prompt_ids[-1]]
        self.draft_cache = None
        self.draft_pending: list = []
        self.lookup = None
        # Greedy "auto" with the model drafter: lookup drafts on steps where the text repeats.
        self.hybrid = self.fixed_k is None and getattr(plan, "lookup", None) is not None
        if drafter == "model":
            self.draft_cache = _new_cache(pair.draft, "draft")
            _prefill(pair.draft, self.draft_cache, prompt_ids[:-1])
            self.draft_pending = [prompt_ids[-1]]
            if self.hybrid:
                self.lookup = LookupIndex(list(prompt_ids), min_ngram=HYBRID_MIN_NGRAM)
        elif drafter == "lookup":
            self.lookup = LookupIndex(list(prompt_ids))
        self.prompt_len = len(prompt_ids)

    def cache_lengths(self) -> tuple[int, int | None]:
        """(target, draft) KV cache lengths; each equals accepted tokens - pending."""
        draft = _cache_len(self.draft_cache) if self.draft_cache is not None else None
        return _cache_len(self.target_cache), draft

    def _choose_k(self, plan=None) -> int:
        if self.drafter == "none":
            return 0
        k = self.fixed_k if self.fixed_k is not None else (plan or self.plan).choose()
        # Never draft past max_tokens: the step's own target token is the last one.
        return max(0, min(k, MAX_DRAFT_TOKENS, self.max_tokens - self.generated - 1))

    def steps(self) -> Iterator[Step]:
        """Yield verify steps until max_tokens tokens have been emitted."""
        while self.generated < self.max_tokens:
            step = self.step()
            yield step

    def step(self) -> Step:
        """Run one draft + verify step and roll the caches back to what was accepted."""
        t0 = time.perf_counter()
        plan, drafts, q = self._hybrid_lookup()
        if plan is None:
            plan = self.plan
            k = self._choose_k()
            t0 = time.perf_counter()
            drafts, q = self._draft(k)
        t1 = time.perf_counter()
        k = len(drafts)
        logits = self.pair.target(
            mx.array([self.target_pending + drafts]), cache=self.target_cache
        )[0]
        if self.params.greedy:
            n, nxt = self._accept_greedy(logits, drafts)
        else:
            n, nxt = self._accept_sampled(logits, drafts, q)
        t2 = time.perf_counter()
        self._rollback(k, n, drafts, nxt, from_model=plan is self.plan)
        emitted = drafts[:n] + [nxt]
        self.generated += len(emitted)
        if plan is not None and self.fixed_k is None:
            plan.observe(k, n, t2 - t1, t1 - t0)
        source = "lookup" if plan is not self.plan or self.drafter == "lookup" else "model"
        return Step(emitted, k, n, t1 - t0, t2 - t1, source if k else "none")

    def _hybrid_lookup(self):
        """(lookup plan, drafts, None) when a free lookup draft is worth verifying on this
        step of a hybrid request, else (None, [], None): the model drafts as usual."""
        if not self.hybrid:
            return None, [], None
        k = self._choose_k(self.plan.lookup)
        drafts = self.lookup.propose(k) if k else []
        return (self.plan.lookup, drafts, None) if drafts else (None, [], None)

    def _draft(self, k: int) -> tuple[list[int], mx.array | None]:
        if k == 0:
            return [], None
        if self.drafter == "lookup":
            return self.lookup.propose(k), None
        return self._draft_model(k)

    def _draft_model(self, k: int) -> tuple[list[int], mx.array | None]:
        dv = self.pair.draft_vocab
        inputs = mx.array([self.draft_pending])
        tokens, rows = [], []
        for i in range(k):
            logits = self.pair.draft(inputs, cache=self.draft_cache)[0, -1, :dv]
            if self.params.greedy:
                tok = mx.argmax(logits)
            else:
                q = sampling.probs(logits, self.params)
                noise = sampling.gumbel_rows(self.seed, self.generated + i, 1, dv, DRAW_DRAFT)
                tok = sampling.sample_rows(q[None], noise)[0]
                rows.append(q)
            tokens.append(tok)
            inputs = tok.reshape(1, 1).astype(mx.uint32)
        mx.eval(tokens, rows)
        drafts = [t.item() for t in tokens]
        if self.params.greedy:
            return drafts, None
        q = mx.stack(rows)
        if dv < self.vocab:  # padded target rows get draft probability 0
            q = mx.concatenate([q, mx.zeros((k, self.vocab - dv), mx.float32)], axis=-1)
        return drafts, q

    def _accept_greedy(self, logits: mx.array, drafts: list[int]) -> tuple[int, int]:
        return accept_greedy(mx.argmax(logits, axis=-1).tolist(), drafts)

    def _accept_sampled(self, logits: mx.array, drafts: list[int], q) -> tuple[int, int]:
        return accept_sampled(logits, drafts, q, self.params, self.seed, self.generated)

    def _rollback(
        self, k: int, n: int, drafts: list[int], nxt: int, from_model: bool = True
    ) -> None:
        # Target saw pending + k drafts; keep pending + n accepted, feed nxt next.
        _trim(self.target_cache, k - n)
        self.target_pending = [nxt]
        if self.draft_cache is not None:
            if k == 0 or not from_model:  # the draft model did not run: it owes these
                self.draft_pending = self.draft_pending + drafts[:n] + [nxt]
            elif n == k:  # the draft never saw its own last token
                self.draft_pending = [drafts[-1], nxt]
            else:
                _trim(self.draft_cache, k - 1 - n)
                self.draft_pending = [nxt]
        if self.lookup is not None:
            self.lookup.extend(drafts[:n] + [nxt])


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
