"""What the drafting heads share: heads that read the target's hidden states and draft one
token per pass (a native MTP head, engine.mtp; an EAGLE-3 head, engine.eagle3).

A head reads a pair per position i: features of the target at i (its final hidden state,
or several layers' outputs) and the token x_{i+1} after it, and predicts x_{i+2}; further
drafts chain the head's own output in place of the target's features. So K drafts cost K
head passes, priced like a draft LM. The head's KV cache holds only pairs built from the
target's features: after a verify pass the chained entries are dropped and the accepted
tokens are read again with the target's features of the verify pass, as heads are trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from .drafters import PREFILL_CHUNK, ModelProposer, _Member
from .interfaces import Joining


class PrefillHidden:
    """Features of rows being prefilled, collected pass by pass (`extend`)."""

    def __init__(self, batch: int):
        self.parts: list[list[mx.array]] = [[] for _ in range(batch)]

    def extend(self, features: mx.array, keep: list[int]) -> None:
        for i, k in enumerate(keep):
            if k:
                self.parts[i].append(features[i, :k])


@dataclass
class _HeadMember(_Member):
    """A row: `pending` tokens not read yet, each with the target hidden state before it."""

    hidden: list = field(default_factory=list)


class HeadProposer(ModelProposer):
    """Batched drafting with a head (`needs_features`: it reads the target's hidden
    states of every prefill and verify pass). Per row, the head has read the pairs
    (h_i, x_{i+1}) up to the one before the row's pending tokens; one step reads those and
    chains K - 1 more passes on its own outputs, then drops the chained entries.

    The drafter gives `head` (its layers, for the cache), `capture`, `new_state`,
    `feature_size`, `step(tokens, hidden, cache)` and `logits(out)` over the target's
    vocabulary."""

    needs_features = True
    block = False
    masks_drafts = False  # its drafts are cut at a grammar's refusal instead
    stops_early = False  # it drafts its block to the K asked

    def __init__(self, drafter, target_vocab: int):
        super().__init__(drafter.head, target_vocab, target_vocab)
        self.drafter = drafter
        self.kind = drafter.kind
        self._fresh: dict = {}  # key -> hidden states of the accepted verify positions

    def capture(self, target):
        return self.drafter.capture(target)

    def new_context(self, batch: int) -> PrefillHidden:
        return self.drafter.new_state(batch)

    def admit(self, joining: list[Joining], context: PrefillHidden | None = None) -> None:
        """Every decoder row joins (the head reads the features of every row), with the
        hidden states of its prefill (of every prompt token but the newest): pending
        pairs (h_i, x_{i+1})."""
        for parts, row in zip(context.parts, joining, strict=True):
            hidden = [mx.concatenate(parts)] if parts else []
            self.members.append(
                _HeadMember(row.key, list(row.ids[1:]), row.params, row.seed, hidden=hidden)
            )
        self.rows.append(_empty_rows(self.model, len(joining)))

    def observe_target(self, features: mx.array, keep: list[int]) -> None:
        """After a verify pass: row i's first keep[i] hidden states are the accepted ones."""
        for i, m in enumerate(self.members):
            self._fresh[m.key] = features[i, : keep[i]]

    def _feed(self, members, take) -> tuple[mx.array, mx.array, list[int]]:
        # Right-padded token ids and hidden states of each member's pending pairs.
        chunks = [(m.pending[:take], _stack(m.hidden)[:take]) for m in members]
        width = max(len(t) for t, _ in chunks)
        h_dim = self.drafter.feature_size
        tokens = mx.array([t + [0] * (width - len(t)) for t, _ in chunks], dtype=mx.int32)
        hidden = mx.stack(
            [
                mx.pad(h, [(0, width - h.shape[0]), (0, 0)])
                if h.shape[0]
                else mx.zeros((width, h_dim))
                for _, h in chunks
            ]
        )
        return tokens, hidden, [len(t) for t, _ in chunks]

    def _read_ahead(self) -> None:
        """Read all but the newest pending pair of long rows in chunks (bounded memory)."""
        while max(len(m.pending) for m in self.members) > PREFILL_CHUNK:
            take = [min(PREFILL_CHUNK, max(0, len(m.pending) - 1)) for m in self.members]
            tokens, hidden, _ = self._feed(self.members, PREFILL_CHUNK)
            width = max(take)
            self.drafter.step(tokens[:, :width], hidden[:, :width], self.cache)
            self.rows.advance(width, take)
            mx.eval([c.state for c in self.cache])
            for m, n in zip(self.members, take, strict=True):
                h = _stack(m.hidden)
                m.pending, m.hidden = m.pending[n:], [h[n:]]

    def propose(self, want: dict, positions: dict, last: dict | None = None) -> tuple[dict, dict]:
        """Draft want[key] tokens per member key from K head passes. Returns ({key:
        tokens}, {key: (k, V) law}) with laws only for sampled rows."""
        depth = max((want.get(m.key, 0) for m in self.members), default=0)
        self.depth = depth
        for m in self.members:
            m.used = want.get(m.key, 0) > 0 and bool(m.pending)
            m.position = positions.get(m.key, 0)
        if depth == 0:
            return {}, {}
        self.rows.checkpoint()
        self._read_ahead()
        members = self.members
        tokens, hidden, lengths = self._feed(members, PREFILL_CHUNK)
        last = mx.array([max(n - 1, 0) for n in lengths])
        drafted, laws = [], []
        for step in range(depth):
            out = self.drafter.step(tokens, hidden, self.cache)
            if step == 0:
                out = mx.take_along_axis(out, last[:, None, None], axis=1)
                self.rows.advance(tokens.shape[1], lengths)
            else:
                self.rows.advance(1, [1] * len(members))
            tok, law = self._sample(self.drafter.logits(out[:, -1]), step)
            drafted.append(tok)
            laws.append(law)
            tokens, hidden = tok[:, None].astype(mx.int32), out[:, -1:]
        mx.eval(drafted)
        table = mx.stack(drafted, axis=1).tolist()
        sampled = {m.key: j for j, m in enumerate(self._sampled)}
        stacked = mx.stack(laws, axis=1) if sampled else None
        drafts, q = {}, {}
        for j, m in enumerate(members):
            k = want.get(m.key, 0)
            if not (k and m.used):
                continue
            drafts[m.key] = table[j][:k]
            if m.key in sampled:
                q[m.key] = stacked[sampled[m.key], :k]
        return drafts, q

    def commit(self, emitted: dict, accepted: dict) -> None:
        """After verification: the chained entries go; the accepted tokens, each with the
        target hidden state before it, wait to be read at the next step."""
        depth = self.depth
        for m in self.members:
            out = emitted.get(m.key, [])
            fresh = self._fresh.pop(m.key, None)
            if depth:  # the step read every pending pair
                m.pending, m.hidden = [], []
            m.pending = m.pending + out
            if fresh is not None and fresh.shape[0]:
                m.hidden = [*m.hidden, fresh[: len(out)]]
        if depth:
            self.rows.drop_last([depth - 1] * len(self.members))
        self.depth = 0


def _stack(parts: list) -> mx.array:
    if not parts:
        return mx.zeros((0, 0))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def _empty_rows(model, batch: int):
    from .families import make_ragged_cache

    rows, _ = make_ragged_cache(model, batch)
    return rows
