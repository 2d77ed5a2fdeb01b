"""Batched speculation across requests: one target pass verifies every row's draft.

Rows join (`add`) and leave (`remove`) between steps. Each row keeps its own
drafter, sampling settings, seed and draft length; inputs are right-padded to a
common width and each row keeps exactly the positions it accepted (ragged.py),
so every row's output is what it would be alone: greedy rows equal their
single-request output, and sampled rows use the same acceptance rule and the
same (seed, position)-keyed randomness as the single-request decoder.

Greedy rows under "auto" share one draft length chosen for the whole batch from
measured batched costs (on a saturated device, batching and speculation compete
for the same compute; K = 0 is batched plain decoding). Sampled rows follow
their own deterministic schedule, so their output does not depend on the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from . import core, sampling
from .adaptive import MAX_AUTO_DRAFT, CostModel, expected_tokens
from .core import MAX_DRAFT_TOKENS, PREFILL_CHUNK, Step
from .drafters import LookupIndex
from .ragged import make_ragged_cache
from .sampling import DRAW_DRAFT

COMPACT_WASTE = 0.5
EMA = 0.2


@dataclass
class _Row:
    key: object
    params: sampling.SamplingParams
    seed: int
    drafter: str
    fixed_k: int | None
    plan: object
    max_tokens: int
    target_pending: int
    draft_pending: list[int] = field(default_factory=list)
    lookup: LookupIndex | None = None
    generated: int = 0


class BatchCosts:
    """Measured seconds of batched steps, by batch size and draft length."""

    def __init__(self, single: CostModel):
        self.single = single
        self.table: dict[tuple[int, int], float] = {}
        self.draft: dict[int, float] = {}

    def estimate(self, batch: int, k: int) -> float:
        if (batch, k) in self.table:
            return self.table[(batch, k)]
        # Before measuring: cost grows with the tokens verified, as for one row.
        tokens = batch * (k + 1)
        per = self.single.verify
        extra = max(tokens - len(per), 0) * (per[-1] - per[-2])
        return (
            per[min(tokens, len(per)) - 1]
            + extra
            + k * self.draft.get(batch, self.single.draft_step)
        )

    def observe(self, batch: int, k: int, seconds: float, draft_s: float) -> None:
        old = self.table.get((batch, k), self.estimate(batch, k))
        self.table[(batch, k)] = old + EMA * (seconds - old)
        if k:
            d = self.draft.get(batch, self.single.draft_step)
            self.draft[batch] = d + EMA * (draft_s / k - d)


class BatchDecoder:
    """Decode many requests together. `add` rows, call `step` until they finish."""

    def __init__(self, pair):
        self.pair = pair
        self.rows: list[_Row] = []
        self.t_rows, self.t_cache = make_ragged_cache(pair.target, 0)
        self.d_rows, self.d_cache = (None, None)
        if pair.draft is not None:
            self.d_rows, self.d_cache = make_ragged_cache(pair.draft, 0)
        self.d_members: list[_Row] = []  # rows in the draft cache, in its row order
        self._joining: list[tuple[_Row, list[int]]] = []  # added, not yet prefilled
        controller = pair.controller
        self.costs = BatchCosts(controller.live) if controller else None
        self.greedy_probe = 0

    def __len__(self) -> int:
        return len(self.rows) + len(self._joining)

    # -- rows joining and leaving ------------------------------------------------
    def add(
        self,
        key,
        prompt_ids: list[int],
        params,
        *,
        seed: int,
        drafter: str,
        num_draft_tokens,
        max_tokens: int,
        plan=None,
    ) -> None:
        """Queue a new row; it is prefilled, with every row joining at the same
        time in one batched pass, at the start of the next step."""
        fixed = None if num_draft_tokens == "auto" else int(num_draft_tokens)
        row = _Row(key, params, seed, drafter, fixed, plan, max_tokens, prompt_ids[-1])
        row.draft_pending = [prompt_ids[-1]] if drafter == "model" else []
        if drafter == "lookup":
            row.lookup = LookupIndex(list(prompt_ids))
        self._joining.append((row, prompt_ids[:-1]))

    def _admit_joining(self) -> None:
        joining, self._joining = self._joining, []
        self.t_rows.append(_prefill_rows(self.pair.target, [ids for _, ids in joining]))
        self.rows += [row for row, _ in joining]
        drafted = [(row, ids) for row, ids in joining if row.drafter == "model"]
        if drafted:
            self.d_rows.append(_prefill_rows(self.pair.draft, [ids for _, ids in drafted]))
            self.d_members += [row for row, _ in drafted]

    def remove(self, key) -> None:
        """Drop a finished (or cancelled) row."""
        self._joining = [(row, ids) for row, ids in self._joining if row.key != key]
        keep = [i for i, r in enumerate(self.rows) if r.key != key]
        if len(keep) == len(self.rows):
            return
        self.t_rows.select(keep)
        self.rows = [self.rows[i] for i in keep]
        d_keep = [i for i, r in enumerate(self.d_members) if r.key != key]
        if len(d_keep) != len(self.d_members):
            self.d_rows.select(d_keep)
            self.d_members = [self.d_members[i] for i in d_keep]

    # -- one step ------------------------------------------------------------------
    def _greedy_k(self) -> int:
        """One draft length for all greedy "auto" rows: the best tokens/s for the batch."""
        auto = [r for r in self.rows if r.params.greedy and r.fixed_k is None and r.plan]
        if not auto or self.costs is None:
            return 0
        a = sum(r.plan.acceptance.rate for r in auto) / len(auto)
        b = len(self.rows)
        best = max(
            range(MAX_AUTO_DRAFT + 1),
            key=lambda k: (b * expected_tokens(a, k) / self.costs.estimate(b, k), -k),
        )
        if best == 0:  # probe now and then so acceptance stays measured
            self.greedy_probe += 1
            if self.greedy_probe % 16 == 0:
                return 1
        return best

    def _row_k(self, row: _Row, greedy_k: int) -> int:
        if row.drafter == "none":
            return 0
        if row.fixed_k is not None:
            k = row.fixed_k
        elif row.params.greedy:
            k = greedy_k
        else:
            k = row.plan.choose()
        return max(0, min(k, MAX_DRAFT_TOKENS, row.max_tokens - row.generated - 1))

    def step(self) -> dict:
        """One draft + verify step for every row: {row key: Step}."""
        if self._joining:
            self._admit_joining()
        greedy_k = self._greedy_k()
        ks = [self._row_k(r, greedy_k) for r in self.rows]
        t0 = time.perf_counter()
        drafts, q = self._draft(ks)
        t1 = time.perf_counter()
        ks = [len(d) for d in drafts]
        width = max(ks) + 1
        inputs = [
            [r.target_pending] + d + [0] * (width - 1 - len(d))
            for r, d in zip(self.rows, drafts, strict=True)
        ]
        logits = self.pair.target(mx.array(inputs), cache=self.t_cache)
        results = self._verify(logits, drafts, q)
        t2 = time.perf_counter()
        self.t_rows.advance(width, [1 + n for n, _ in results])
        self._rollback_draft(drafts, results)
        steps = {}
        for row, d, (n, nxt) in zip(self.rows, drafts, results, strict=True):
            row.target_pending = nxt
            if row.lookup is not None:
                row.lookup.extend(d[:n] + [nxt])
            emitted = d[:n] + [nxt]
            row.generated += len(emitted)
            if row.plan is not None and row.fixed_k is None:
                if row.params.greedy:  # batched timings stay out of the single-row costs
                    row.plan.acceptance.observe(len(d), n)
                    row.plan.shared.observe(len(d), n)
                else:
                    row.plan.observe(len(d), n, 0.0, 0.0)
            steps[row.key] = Step(emitted, len(d), n, t1 - t0, t2 - t1)
        if self.costs is not None:
            self.costs.observe(len(self.rows), width - 1, t2 - t0, t1 - t0)
        for rows in (self.t_rows, self.d_rows):
            if rows is not None and rows.waste() > COMPACT_WASTE:
                rows.compact()
        return steps

    def _draft(self, ks: list[int]) -> tuple[list[list[int]], dict]:
        drafts: list[list[int]] = [[] for _ in self.rows]
        q: dict[int, mx.array] = {}
        for i, (row, k) in enumerate(zip(self.rows, ks, strict=True)):
            if row.drafter == "lookup" and k:
                drafts[i] = row.lookup.propose(k)
        members = self.d_members
        depth = max(
            (k for r, k in zip(self.rows, ks, strict=True) if r.drafter == "model"), default=0
        )
        if not members or depth == 0:
            return drafts, q
        index = {id(r): i for i, r in enumerate(self.rows)}
        want = {id(r): ks[index[id(r)]] for r in members}
        width = max(len(r.draft_pending) for r in members)
        feed = mx.array([r.draft_pending + [0] * (width - len(r.draft_pending)) for r in members])
        last = mx.array([len(r.draft_pending) - 1 for r in members])
        dv = self.pair.draft_vocab
        tokens, laws = [], []
        for step in range(depth):
            out = self.pair.draft(feed, cache=self.d_cache)
            if step == 0:
                logits = mx.take_along_axis(out, last[:, None, None], axis=1)[:, 0, :dv]
                self.d_rows.advance(width, [len(r.draft_pending) for r in members])
            else:
                logits = out[:, -1, :dv]
                self.d_rows.advance(1, [1] * len(members))
            tok, law = self._draft_sample(logits, members, step)
            tokens.append(tok)
            laws.append(law)
            feed = tok[:, None].astype(mx.uint32)
        mx.eval(tokens)
        table = mx.stack(tokens, axis=1).tolist()
        for j, row in enumerate(members):
            i = index[id(row)]
            k = want[id(row)]
            drafts[i] = table[j][:k]
            if not row.params.greedy and k:
                law = mx.stack([laws[s][j] for s in range(k)])
                if dv < self.pair.target_vocab:
                    law = mx.concatenate([law, mx.zeros((k, self.pair.target_vocab - dv))], axis=-1)
                q[i] = law
        return drafts, q

    def _draft_sample(self, logits, members, step):
        greedy = mx.argmax(logits, axis=-1)
        if all(r.params.greedy for r in members):
            return greedy, None
        toks, laws = [], []
        for j, row in enumerate(members):
            if row.params.greedy:
                toks.append(greedy[j])
                laws.append(None)
                continue
            law = sampling.probs(logits[j], row.params)
            noise = sampling.gumbel_rows(
                row.seed, row.generated + step, 1, logits.shape[-1], DRAW_DRAFT
            )
            toks.append(sampling.sample_rows(law[None], noise)[0])
            laws.append(law)
        return mx.stack(toks), laws

    def _verify(self, logits, drafts, q) -> list[tuple[int, int]]:
        best = mx.argmax(logits, axis=-1).tolist()
        results = []
        for i, (row, d) in enumerate(zip(self.rows, drafts, strict=True)):
            if row.params.greedy:
                results.append(core.accept_greedy(best[i], d))
            else:
                results.append(
                    core.accept_sampled(
                        logits[i, : len(d) + 1], d, q.get(i), row.params, row.seed, row.generated
                    )
                )
        return results

    def _rollback_draft(self, drafts, results) -> None:
        if not self.d_members:
            return
        index = {id(r): i for i, r in enumerate(self.rows)}
        depth = max((len(drafts[index[id(r)]]) for r in self.d_members), default=0)
        drop = []
        for row in self.d_members:
            i = index[id(row)]
            n, nxt = results[i]
            if depth == 0:  # the draft did not run: it still owes these tokens
                row.draft_pending = row.draft_pending + [nxt]
                drop.append(0)
            elif n == depth:  # the draft never saw its own last token
                row.draft_pending = [drafts[i][-1], nxt]
                drop.append(0)
            else:
                row.draft_pending = [nxt]
                drop.append(depth - 1 - n)
        self.d_rows.drop_last(drop)


def _prefill_rows(model, prompts: list[list[int]]):
    """Prefill several prompts in one batched pass (right-padded; pads masked out)."""
    rows, cache = make_ragged_cache(model, len(prompts))
    longest = max(map(len, prompts), default=0)
    for start in range(0, longest, PREFILL_CHUNK):
        width = min(PREFILL_CHUNK, longest - start)
        chunks = [p[start : start + width] for p in prompts]
        model(mx.array([c + [0] * (width - len(c)) for c in chunks]), cache=cache)
        rows.advance(width, [len(c) for c in chunks])
        mx.eval([c.state for c in cache])
    return rows
