"""Plain decoding for a target whose layers the speculative decoder cannot keep exact.

Some mlx-lm families keep layer state in kinds that have no ragged form here
(`CacheList` in falcon_h1, chunked attention in llama4, quantized KV caches...):
their rows cannot roll back or share a batch exactly. Plain decoding never rolls
back, so such a target still runs, through mlx-lm's own cache, one row per forward
pass: every request is answered, with the text target-only decoding gives, drafters
and batching aside (statistics say drafter "none").

`PlainDecoder` is an interfaces.Decoder, as BatchDecoder is (`add`, `remove`, `step`),
declared not `speculative`, so the text layer, `generate_many` and the workers drive it unchanged; rows added together are
decoded in turn, each with the sampling law and (seed, position)-keyed randomness
the speculative decoder uses for a row that drafts nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from . import processors, sampling
from .core import InvalidRequestError, Step
from .interfaces import Decoder


@dataclass
class _PlainRow:
    key: object
    params: sampling.SamplingParams
    seed: int
    pending: int  # the newest token, not yet fed to the target
    cache: list = field(repr=False, default_factory=list)
    generated: int = 0
    logits: processors.RowLogits | None = None


class PlainDecoder(Decoder):
    """Decode rows one forward pass at a time each, on mlx-lm's own caches."""

    speculative = False

    def __init__(self, pair):
        self.pair = pair
        self.rows: list[_PlainRow] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(
        self,
        key,
        prompt_ids: list[int],
        params,
        *,
        seed: int,
        drafter: str = "none",
        num_draft_tokens=1,
        max_tokens: int = 0,
        logits: processors.RowLogits | None = None,
    ) -> None:
        """Queue a row (drafter, num_draft_tokens, and max_tokens are not used:
        nothing drafts here, and the caller stops the row)."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        model = self.pair.target
        cache = model.make_cache()
        if len(prompt_ids) > 1:
            model(mx.array([prompt_ids[:-1]]), cache=cache)
            mx.eval([c.state for c in cache])
        self.rows.append(_PlainRow(key, params, seed, prompt_ids[-1], cache, 0, logits))

    def remove(self, key) -> None:
        self.rows = [r for r in self.rows if r.key != key]

    def cached_tokens(self, key) -> int:
        """Plain decoding keeps no prefixes: always 0."""
        return 0

    def step(self) -> dict:
        """One token for every row: {row key: Step}."""
        steps = {}
        for row in self.rows:
            t0 = time.perf_counter()
            raw = self.pair.target(mx.array([[row.pending]]), cache=row.cache)[:, -1:]
            logits = raw[:, -1]
            if row.logits is not None and row.logits.transforms:
                grammars = getattr(self.pair, "_grammars", None)
                executor = grammars.executor if grammars is not None else None
                logits = processors.process(raw, [row.logits], [[]], executor)[:, -1]
            if row.params.greedy:
                token = mx.argmax(logits, axis=-1)
            else:
                p = sampling.probs(logits, row.params)
                keys = sampling.position_keys([row.seed], [row.generated], 1, sampling.DRAW_TARGET)
                token = sampling.sample_rows(p, sampling.gumbel_table(keys, p.shape[-1])[:, 0])
            row.pending = int(token.item())
            row.generated += 1
            logprobs = None
            if row.logits is not None:
                logprobs = processors.logprobs_of(raw, [row.logits], [[row.pending]]).get(0)
                row.logits.commit([row.pending])
            t = time.perf_counter() - t0
            steps[row.key] = Step([row.pending], 0, 0, 0.0, t, "none", logprobs)
        return steps
