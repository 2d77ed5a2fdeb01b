"""The one speculative decoder: a batch of rows, each its own request (one row is
a single request).

One step: every row gets a draft (from the draft model, prompt lookup, or none),
one target pass scores every row's pending token plus its drafts (right-padded to
the widest row), each row keeps its longest acceptable prefix plus one token from
the target (the correction at the first rejection, or a bonus token when all pass;
see core.py), and every cache rolls back to exactly what its row accepted
(ragged.py: rows roll back on their own). Rows join (`add`) and leave (`remove`)
between steps; joining rows are prefilled together in one batched pass.

Every row's output is what it would be alone: greedy rows equal target-only
decoding, and sampled rows use the same acceptance rule and the same
(seed, position)-keyed randomness wherever they run.

Draft lengths: a row with a number drafts that many; a sampled "auto" row follows
its own fixed schedule (adaptive.DraftPlan), so its output does not depend on the
batch; greedy "auto" rows share one length that the controller picks for the
whole batch from measured pass costs (adaptive.DraftController.choose_batch_k),
K = 0 whenever speculation does not pay. A greedy "auto" row drafted by the model
takes free prompt-lookup drafts instead on steps where its text repeats itself.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import mlx.core as mx

from . import core, sampling
from .adaptive import MAX_AUTO_DRAFT, AutoRow, FixedRow
from .core import MAX_DRAFT_TOKENS, Step
from .drafters import LookupIndex, ModelProposer, prefill_rows
from .families import make_ragged_cache
from .heads import feature_proposer
from .prefix import prefill_cached

COMPACT_WASTE = 0.5
# A hybrid row drafts by lookup when its last HYBRID_MIN_NGRAM tokens occurred before:
# single-token matches are too often chance (measured on code: 2.1 tokens accepted per
# 1-gram proposal against 2.9 per 2-gram one).
HYBRID_MIN_NGRAM = 2
# Each change of a decoder's rows takes a new number: the controller's reused K = 0
# decision (choose_batch_k's key) never outlives the rows it was priced for.
_EPOCHS = itertools.count()


@dataclass
class _Row:
    key: object
    params: sampling.SamplingParams
    seed: int
    drafter: str  # "model", "lookup" or "none"
    fixed_k: int | None
    plan: object  # adaptive.DraftPlan for "auto", else None
    max_tokens: int
    target_pending: int
    lookup: LookupIndex | None = None  # lookup drafter, or greedy auto "model" (hybrid)
    generated: int = 0
    cached_tokens: int = 0  # prompt tokens whose target state came from the prefix cache

    @property
    def greedy_auto(self) -> bool:
        return self.params.greedy and self.fixed_k is None and self.plan is not None

    def budget(self) -> int:
        # Never draft past max_tokens: the step's own target token is the last one.
        return max(0, min(MAX_DRAFT_TOKENS, self.max_tokens - self.generated - 1))


@dataclass
class _Choice:
    """A row's draft for this step: how many tokens, from where, and the tokens of a
    lookup proposal (model drafts come later, in one batched pass)."""

    k: int = 0
    source: str = "none"  # "model", "lookup" or "none"
    tokens: list | None = None


class BatchDecoder:
    """Decode one or many requests together. `add` rows, call `step` until they finish."""

    def __init__(self, pair):
        self.pair = pair
        self.rows: list[_Row] = []
        self.t_rows, self.t_cache = make_ragged_cache(pair.target, 0)
        self.proposer = None
        if getattr(pair, "dflash", None) is not None:
            self.proposer = feature_proposer(pair.dflash, pair.target_vocab)
        elif pair.draft is not None:
            self.proposer = ModelProposer(
                pair.draft, pair.draft_vocab, pair.target_vocab, prefix=_prefix(pair, "draft")
            )
        self._joining: list[tuple[_Row, list[int]]] = []  # added, not yet prefilled
        self.controller = pair.controller
        self._epoch = next(_EPOCHS)

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
        if not prompt_ids:
            raise core.InvalidRequestError("the prompt is empty: give at least one token")
        if drafter == "model" and self.proposer is None:  # no draft model, no DFlash
            raise core.InvalidRequestError(
                "drafter 'model' needs a draft model, but this worker has none; "
                "use drafter 'lookup' or 'none'"
            )
        fixed = None if num_draft_tokens == "auto" else int(num_draft_tokens)
        row = _Row(key, params, seed, drafter, fixed, plan, max_tokens, prompt_ids[-1])
        if drafter == "lookup":
            row.lookup = LookupIndex(list(prompt_ids))
        elif drafter == "model" and row.greedy_auto and getattr(plan, "lookup", None):
            row.lookup = LookupIndex(list(prompt_ids), min_ngram=HYBRID_MIN_NGRAM)
        self._joining.append((row, list(prompt_ids)))

    def _admit_joining(self) -> None:
        joining, self._joining = self._joining, []
        prompts = [ids[:-1] for _, ids in joining]
        if self.proposer is not None and self.proposer.needs_features:
            # A block drafter reads the target's features: every row, drafted or not,
            # so its context rows stay the decoder's rows.
            state = self.proposer.drafter.new_state(len(joining))
            with self.proposer.capture(self.pair.target) as cap:
                rows, _ = prefill_rows(
                    self.pair.target, prompts, lambda keep: state.extend(cap.features, keep)
                )
            self.proposer.admit_state(state, [(r.key, r.params, r.seed, ids) for r, ids in joining])
        else:
            cache = _prefix(self.pair, "target")
            if cache is not None:
                rows, _, reused = prefill_cached(self.pair.target, prompts, cache)
                for (row, _), n in zip(joining, reused, strict=True):
                    row.cached_tokens = n
            else:
                rows, _ = prefill_rows(self.pair.target, prompts)
            if self.proposer is not None:
                self.proposer.admit(
                    [(r.key, ids, r.params, r.seed) for r, ids in joining if r.drafter == "model"]
                )
        self.t_rows.append(rows)
        self.rows += [row for row, _ in joining]
        self._epoch = next(_EPOCHS)

    def remove(self, key) -> None:
        """Drop a finished (or cancelled) row."""
        self._joining = [(row, ids) for row, ids in self._joining if row.key != key]
        keep = [i for i, r in enumerate(self.rows) if r.key != key]
        if len(keep) == len(self.rows):
            return
        self.t_rows.select(keep)
        self.rows = [self.rows[i] for i in keep]
        self._epoch = next(_EPOCHS)
        if self.proposer is not None:
            self.proposer.remove({key})

    # -- choosing drafts ----------------------------------------------------------
    def _choose(self) -> list[_Choice]:
        choices = [_Choice() for _ in self.rows]
        auto, fixed, auto_rows = [], [], []
        # Rows the draft model would run over if it drafted (cold ones included).
        drafted_rows = (
            len(self.proposer.members) + len(getattr(self.proposer, "cold", ()))
            if self.proposer is not None
            else 0
        )
        for row, c in zip(self.rows, choices, strict=True):
            budget = row.budget()
            if row.drafter == "none" or budget == 0:
                continue
            if row.greedy_auto:
                free = self._free_draft(row, budget)
                if free:
                    c.tokens, c.source = free, "lookup"
                    a = (
                        row.plan.lookup.acceptance.rate
                        if row.plan.lookup
                        else row.plan.acceptance.rate
                    )
                    auto.append(AutoRow(a, len(free), free=True))
                else:
                    c.source = "model"
                    auto.append(
                        AutoRow(row.plan.acceptance.rate, min(budget, MAX_AUTO_DRAFT), False)
                    )
                auto_rows.append((row, c))
                continue
            k = row.fixed_k if row.fixed_k is not None else row.plan.choose()
            k = min(k, budget, self._model_cap(fixed=True) if row.drafter == "model" else k)
            c.k, c.source = k, row.drafter if k else "none"
            if k and row.drafter == "lookup":
                c.tokens = row.lookup.propose(k)
                c.k = len(c.tokens)
                c.source = "lookup" if c.k else "none"
            rate = row.plan.acceptance.rate if row.plan is not None else 0.6
            fixed.append(FixedRow(c.k, rate, row.drafter == "model"))
        if auto:
            # What a reused K = 0 depends on: the rows and their acceptance (constant
            # while nothing drafts), not the caps of this step's drafts (see choose_batch_k).
            held = tuple(r.plan.acceptance.rate for r, _ in auto_rows)
            key = (self._epoch, drafted_rows, held, tuple(fixed))
            k = self.controller.choose_batch_k(
                auto, fixed, drafted_rows, lambda: self._cold_cost(auto_rows), key=key
            )
            probe = self._probe_row(auto_rows) if self.controller.probing else None
            for (_, c), a in zip(auto_rows, auto, strict=True):
                # A probe measures acceptance: one row's draft tells it, and costs the
                # draft model at most one cold row's first read.
                c.k = min(k, a.cap) if probe is None or c is probe else 0
                if c.source == "lookup":
                    c.tokens = c.tokens[: c.k]
                if c.k == 0:
                    c.source, c.tokens = "none", None
        return choices

    def _cold_cost(self, auto_rows: list[tuple[_Row, _Choice]]) -> tuple[int, float]:
        """(tokens the draft model has not read of the greedy "auto" rows it would
        draft for, their mean tokens left to generate): what drafting now would first
        cost the draft model, and over how much output that cost is spread."""
        cold = getattr(self.proposer, "cold", None)
        if not cold:
            return 0, 1.0
        waking = [
            (self.proposer.cold_tokens(r.key), r.max_tokens - r.generated)
            for r, c in auto_rows
            if r.key in cold and c.source == "model"
        ]
        if not waking:
            return 0, 1.0
        return sum(n for n, _ in waking), sum(left for _, left in waking) / len(waking)

    def _probe_row(self, auto_rows: list[tuple[_Row, _Choice]]) -> _Choice | None:
        """The row a probe drafts for: one the draft model has read already, else the
        cold one with the shortest text (the cheapest first read)."""
        candidates = [(r, c) for r, c in auto_rows if c.source == "model"] or auto_rows
        if not candidates:
            return None
        cold = getattr(self.proposer, "cold", {})
        row, choice = min(
            candidates,
            key=lambda rc: self.proposer.cold_tokens(rc[0].key) if rc[0].key in cold else -1,
        )
        return choice

    def _model_cap(self, fixed: bool = False) -> int:
        """Most drafts the worker's draft can give a row in one step."""
        block = getattr(self.proposer, "max_draft", None)
        if block is not None:
            return block
        return MAX_DRAFT_TOKENS if fixed else MAX_AUTO_DRAFT

    def _free_draft(self, row: _Row, budget: int) -> list[int]:
        """The lookup proposal of a greedy auto row, where its text repeats itself."""
        if row.lookup is None:
            return []
        cap = row.plan.lookup.k_max if row.plan.lookup is not None else MAX_AUTO_DRAFT
        return row.lookup.propose(min(budget, cap))

    # -- one step ------------------------------------------------------------------
    def step(self) -> dict:
        """One draft + verify step for every row: {row key: Step}."""
        start = time.perf_counter()
        joined = bool(self._joining)
        if joined:
            self._admit_joining()
        # The target never rolls back past this step (advance keeps only what passed), so
        # recurrent layers may forget the passes before it.
        self.t_rows.checkpoint()
        choices = self._choose()
        t0 = time.perf_counter()
        drafts, q = self._draft(choices)
        t1 = time.perf_counter()
        width = max(len(d) for d in drafts) + 1
        inputs = [
            [r.target_pending] + d + [0] * (width - 1 - len(d))
            for r, d in zip(self.rows, drafts, strict=True)
        ]
        features = None
        if self.proposer is not None and self.proposer.needs_features:
            with self.proposer.capture(self.pair.target) as cap:
                logits = self.pair.target(mx.array(inputs), cache=self.t_cache)
            features = cap.features
        else:
            logits = self.pair.target(mx.array(inputs), cache=self.t_cache)
        results = self._verify(logits, drafts, q)
        t2 = time.perf_counter()
        keep = [1 + n for n, _ in results]
        self.t_rows.advance(width, keep)
        if features is not None:
            self.proposer.observe_target(features, keep)
        steps = self._finish(choices, drafts, results, t1 - t0, t2 - t1)
        self._observe(choices, drafts, results, width, t1 - t0, t2 - t1)
        for rows in (self.t_rows, getattr(self.proposer, "rows", None)):
            if rows is not None and rows.waste() > COMPACT_WASTE:
                rows.compact()
        if self.controller is not None and not joined:
            # A step that admitted rows also ran their prefill: not a fair sample.
            emitted = sum(1 + n for n, _ in results)
            seconds = time.perf_counter() - start
            self.controller.observe_realized(len(self.rows), seconds, emitted, width > 1)
        return steps

    def _draft(self, choices: list[_Choice]) -> tuple[list[list[int]], dict]:
        drafts = [list(c.tokens or []) if c.source == "lookup" else [] for c in choices]
        q: dict[int, mx.array] = {}
        want = {r.key: c.k for r, c in zip(self.rows, choices, strict=True) if c.source == "model"}
        if self.proposer is None or not want:
            # Nothing drafts by the model this step: the proposer is not asked (its
            # commit then queues the emitted tokens for its rows, as after depth 0).
            return drafts, q
        positions = {r.key: r.generated for r in self.rows}
        if self.proposer.block:
            last = {r.key: r.target_pending for r in self.rows}
            by_key, laws = self.proposer.propose(want, positions, last)
        else:
            by_key, laws = self.proposer.propose(want, positions)
        for i, row in enumerate(self.rows):
            if row.key in by_key:
                drafts[i] = by_key[row.key]
                if row.key in laws:
                    q[i] = laws[row.key]
        return drafts, q

    def _verify(self, logits, drafts, q) -> list[tuple[int, int]]:
        results: list = [None] * len(self.rows)
        sampled = [i for i, row in enumerate(self.rows) if not row.params.greedy]
        if len(sampled) < len(self.rows):
            best = mx.argmax(logits, axis=-1).tolist()
            for i, (row, d) in enumerate(zip(self.rows, drafts, strict=True)):
                if row.params.greedy:
                    results[i] = core.accept_greedy(best[i], d)
        if sampled:
            outcomes = self._verify_sampled(logits, drafts, q, sampled)
            for i, result in zip(sampled, outcomes, strict=True):
                results[i] = result
        return results

    def _verify_sampled(self, logits, drafts, q, sampled: list[int]) -> list[tuple[int, int]]:
        """Speculative sampling for the sampled rows, all in one set of array operations."""
        rows = [self.rows[i] for i in sampled]
        width = 1 + max(len(drafts[i]) for i in sampled)
        if len(sampled) < len(self.rows):
            logits = logits[mx.array(sampled)]
        p = sampling.probs_rows(logits[:, :width], [r.params for r in rows])
        seeds, starts = [r.seed for r in rows], [r.generated for r in rows]
        lengths = [len(drafts[i]) for i in sampled]
        noise = sampling.gumbel_table(
            sampling.position_keys(seeds, starts, width, sampling.DRAW_TARGET), p.shape[-1]
        )
        if width == 1:
            return core.accept_sampled(p, None, None, lengths, None, noise)
        tokens = mx.array([drafts[i] + [0] * (width - 1 - len(drafts[i])) for i in sampled])
        laws = []
        for i, n in zip(sampled, lengths, strict=True):
            law = q.get(i)
            if law is None:  # a deterministic drafter (lookup), or no drafts: one-hot
                law = (mx.arange(p.shape[-1])[None, :] == tokens[len(laws)][:, None]).astype(
                    mx.float32
                )
            elif n < width - 1:
                law = mx.pad(law, [(0, width - 1 - n), (0, 0)])
            laws.append(law)
        u = sampling.uniform_table(
            sampling.position_keys(seeds, starts, width - 1, sampling.DRAW_ACCEPT)
        )
        return core.accept_sampled(p, mx.stack(laws), tokens, lengths, u, noise)

    def _finish(self, choices, drafts, results, draft_s, verify_s) -> dict:
        emitted_by_key, accepted_by_key, steps = {}, {}, {}
        for row, c, d, (n, nxt) in zip(self.rows, choices, drafts, results, strict=True):
            emitted = d[:n] + [nxt]
            row.target_pending = nxt
            if row.lookup is not None:
                row.lookup.extend(emitted)
            row.generated += len(emitted)
            emitted_by_key[row.key], accepted_by_key[row.key] = emitted, n
            source = c.source if d else "none"
            steps[row.key] = Step(emitted, len(d), n, draft_s, verify_s, source)
        if self.proposer is not None:
            self.proposer.commit(emitted_by_key, accepted_by_key)
        return steps

    def _observe(self, choices, drafts, results, width, draft_s, verify_s) -> None:
        probe = None
        for row, c, d, (n, _) in zip(self.rows, choices, drafts, results, strict=True):
            if row.plan is None or row.fixed_k is not None or not d:
                continue
            plan = row.plan.lookup if (c.source == "lookup" and row.plan.lookup) else row.plan
            plan.observe(len(d), n)
            if row.greedy_auto and c.source == "model":
                probe = (len(d), n) if probe is None else (probe[0] + len(d), probe[1] + n)
        if self.controller is None:
            return
        if self.controller.probing and probe is not None:
            self.controller.probe_result(*probe)
        depth = self.proposer.depth_run if self.proposer is not None else 0
        members = len(self.proposer.members) if self.proposer is not None else 0
        self.controller.observe_step(len(self.rows), width, verify_s, depth, members, draft_s)

    # -- inspection (tests, statistics) ------------------------------------------------
    def cached_tokens(self, key) -> int:
        """Prompt tokens of a row (admitted at a step) that the prefix cache gave."""
        return next((r.cached_tokens for r in self.rows if r.key == key), 0)

    def cache_lengths(self, key) -> tuple[int, int | None]:
        """(target, draft) cache lengths of a row: accepted tokens minus what is pending."""
        i = next(i for i, r in enumerate(self.rows) if r.key == key)
        target = self.t_rows.offset.tolist()[i]
        draft = self.proposer.lengths().get(key) if self.proposer is not None else None
        return target, draft


def _prefix(pair, role: str):
    """The pair's prefix cache for "target" or "draft", or None where none is kept."""
    caches = getattr(pair, "prefix", None)
    cache = getattr(caches, role, None) if caches is not None else None
    return cache if cache is not None and cache.enabled else None


def new_decoder(pair):
    """The decoder for a pair: BatchDecoder, or plain.PlainDecoder for a target whose
    layers the speculative decoder cannot keep exact (`pair.plain_only`)."""
    if getattr(pair, "plain_only", None):
        from .plain import PlainDecoder

        return PlainDecoder(pair)
    return BatchDecoder(pair)


class SpeculativeDecoder:
    """One request through the one decoder (a batch of one); iterate `steps()`.

    num_draft_tokens is an int (1..16), "auto" (then `plan`, an adaptive.DraftPlan,
    holds the request's acceptance), or 0 for plain decoding.
    """

    KEY = 0

    def __init__(
        self,
        pair,
        prompt_ids: list[int],
        params: sampling.SamplingParams,
        *,
        seed: int = 0,
        drafter: str = "model",
        num_draft_tokens: int | str = "auto",
        max_tokens: int = 256,
        plan=None,
    ):
        if num_draft_tokens == 0:
            drafter, num_draft_tokens = "none", 1
        if getattr(pair, "plain_only", None):
            drafter, num_draft_tokens = "none", 1
        if num_draft_tokens == "auto" and plan is None and drafter != "none":
            if pair.controller is None:
                raise core.InvalidRequestError("num_draft_tokens 'auto' needs a calibrated pair")
            plan = pair.controller.plan(drafter, params.greedy)
        self.batch = new_decoder(pair)
        self.batch.add(
            self.KEY,
            list(prompt_ids),
            params,
            seed=seed,
            drafter=drafter,
            num_draft_tokens=num_draft_tokens,
            max_tokens=max_tokens,
            plan=plan,
        )
        self.max_tokens = max_tokens
        self.generated = 0

    def step(self) -> Step:
        """One draft + verify step; the caches then hold exactly the accepted text."""
        step = self.batch.step()[self.KEY]
        self.generated += len(step.tokens)
        return step

    def steps(self):
        """Yield verify steps until max_tokens tokens have been emitted."""
        while self.generated < self.max_tokens:
            yield self.step()

    def cache_lengths(self) -> tuple[int, int | None]:
        """(target, draft) cache lengths; each equals accepted tokens - pending."""
        return self.batch.cache_lengths(self.KEY)

    @property
    def draft_pending(self) -> list[int]:
        """Accepted tokens the draft model has not seen yet (the newest always)."""
        proposer = self.batch.proposer
        return proposer.pending(self.KEY) if proposer and self.KEY in proposer.lengths() else []
