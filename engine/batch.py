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

Draft lengths are the pair's policy's (draft_length.DraftLengthPolicy: `decide`
before a step, `observe` after, handed in as `pair.policy`); `_choose` says which rows
draft and from where, and this module is the mechanism. Model drafts come from the pair's
proposer (interfaces.Proposer, made by drafters.new_proposer); `decoder_class` is the
one place a pair's decoder is picked.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx

from contract.limits import MAX_DRAFT_TOKENS

from . import core, processors, sampling
from .core import Step
from .draft_length import SampledSchedule, StepRecord, expected_tokens
from .drafters import LookupIndex, new_proposer, prefill_rows, prefix_of
from .families import make_ragged_cache
from .interfaces import Decoder, Joining
from .plain import PlainDecoder
from .prefix import prefill_cached
from .processors import RowLogits

# Squeeze holes out of a ragged cache once more than this share of its positions is waste.
COMPACT_WASTE = 0.5
#: Most drafts of a lookup "auto" proposal (free of draft passes, so they may run longer).
LOOKUP_MAX_DRAFT = 12
#: A greedy "auto" row drafted by the model takes a lookup draft instead where its last
#: HYBRID_MIN_NGRAM tokens occurred before (single-token matches are too often chance),
#: in a batch of at most HYBRID_MAX_ROWS rows (in a larger one the draft model reads the
#: tokens it skipped over every row it holds, and rows that jump ahead finish apart:
#: measured at the demo pair, 1.16x at 1 row, 0.92-0.94x at 4).
HYBRID_MIN_NGRAM, HYBRID_MAX_ROWS = 2, 2
#: A verify position's cost over a decode step, as a sampled row's schedule assumes it
#: (static, so its output does not depend on the machine's load): a GPU verifies a few
#: positions for about the price of one, a CPU pays about one pass per position.
VERIFY_COST = {"gpu": 0.03, "cpu": 0.25}
#: What a request for drafter "model" is told where the pair has no draft model.
NO_DRAFT_MODEL = (
    "drafter: 'model' needs a draft model and this engine has none; use 'lookup' or 'none'"
)


@dataclass
class Choice:
    """A row's draft this step: how many tokens, from where ("model", "lookup",
    "forced" or "none"), and the tokens of a lookup or forced proposal (model drafts
    come later, in one batched pass). `offered`: a greedy "auto" row's free (lookup)
    proposal, drafted or not: what the target emits judges it, so its acceptance is
    heard on the steps that do not draft it too."""

    k: int = 0
    source: str = "none"
    tokens: list | None = None
    offered: list | None = None


@dataclass
class _Row:
    key: object
    params: sampling.SamplingParams
    seed: int
    drafter: str  # "model", "lookup" or "none"
    fixed_k: int | None
    plan: SampledSchedule | None  # a sampled "auto" row's own draft lengths
    max_tokens: int
    target_pending: int
    lookup: LookupIndex | None = None  # lookup drafter, or greedy auto "model" (hybrid)
    # Whether the row's last judged lookup proposal passed whole: the text is being
    # copied, and its next proposal passes far more often (0.73 against 0.29 after a
    # miss, on bench.py's input-grounded prompts), so the policy hears the two apart.
    copying: bool = False
    generated: int = 0
    cached_tokens: int = 0  # prompt tokens whose target state came from the prefix cache
    # The request's logits pipeline (penalties, biases, grammar, logprobs), or None.
    logits: RowLogits | None = None
    # A greedy "auto" row (the policy picks its draft length); read every step, so kept.
    greedy_auto: bool = field(init=False)

    def __post_init__(self) -> None:
        self.greedy_auto = self.params.greedy and self.fixed_k is None and self.drafter != "none"

    def budget(self) -> int:
        # Never draft past max_tokens: the step's own target token is the last one.
        return max(0, min(MAX_DRAFT_TOKENS, self.max_tokens - self.generated - 1))


class BatchDecoder(Decoder):
    """Decode one or many requests together. `add` rows, call `step` until they finish."""

    speculative = True
    #: Propose the tokens a grammar forces as free drafts (off only to measure what they earn).
    force_grammar_tokens = True

    def __init__(self, pair):
        self.pair = pair
        self.rows: list[_Row] = []
        self.t_rows, self.t_cache = make_ragged_cache(pair.target, 0)
        self.proposer = new_proposer(pair)
        self._joining: list[tuple[_Row, list[int]]] = []  # added, not yet prefilled
        self._leaving: set = set()  # removed, still in the caches until the next step
        self.policy = pair.policy  # draft_length.DraftLengthPolicy, or None: "auto" drafts nothing

    def __len__(self) -> int:
        return len(self.rows) - len(self._leaving) + len(self._joining)

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
        logits: RowLogits | None = None,
    ) -> None:
        """Queue a new row; it is prefilled, with every row joining at the same
        time in one batched pass, at the start of the next step. `logits`: the row's
        processors (penalties, biases, grammar) and logprobs, or None."""
        if not prompt_ids:
            raise core.InvalidRequestError("the prompt is empty: give at least one token")
        if drafter == "model" and self.proposer is None:  # no draft model, no DFlash
            raise core.InvalidRequestError(NO_DRAFT_MODEL)
        fixed = None if num_draft_tokens == "auto" else int(num_draft_tokens)
        plan = None
        if fixed is None and not params.greedy and drafter != "none":
            plan = self._schedule(drafter)
        row = _Row(key, params, seed, drafter, fixed, plan, max_tokens, prompt_ids[-1])
        row.logits = logits
        if drafter == "lookup":
            row.lookup = LookupIndex(list(prompt_ids))
        elif drafter == "model" and row.greedy_auto:
            row.lookup = LookupIndex(list(prompt_ids), min_ngram=HYBRID_MIN_NGRAM)
        self._joining.append((row, list(prompt_ids)))

    def _admit_joining(self) -> None:
        """Prefill the joining rows and join them to the batch, in the places of rows
        leaving where they fit (`RaggedRows.place`: only their own positions are written),
        else after the others (the rows left first)."""
        joining, self._joining = self._joining, []
        leaving, self._leaving = self._leaving, set()
        if leaving and self.proposer is not None:
            self.proposer.remove(leaving)  # (before admit: a key may leave and join again)
        prompts = [ids[:-1] for _, ids in joining]
        context = None
        if self.proposer is not None and self.proposer.needs_features:
            # The drafter reads the target's features: every row's, drafted or not, so
            # its context rows stay the decoder's rows.
            context = self.proposer.new_context(len(joining))
            with self.proposer.capture(self.pair.target) as cap:
                rows, _ = prefill_rows(
                    self.pair.target, prompts, lambda keep: context.extend(cap.features, keep)
                )
        else:
            cache = prefix_of(self.pair, "target")
            if cache is not None:
                rows, _, reused = prefill_cached(self.pair.target, prompts, cache)
                for (row, _), n in zip(joining, reused, strict=True):
                    row.cached_tokens = n
            else:
                rows, _ = prefill_rows(self.pair.target, prompts)
        if self.proposer is not None:
            self.proposer.admit(
                [Joining(r.key, ids, r.params, r.seed, r.drafter == "model") for r, ids in joining],
                context,
            )
        slots = [i for i, r in enumerate(self.rows) if r.key in leaving]
        placed = context is None and 0 < len(joining) <= len(slots) and self.t_rows.can_place(rows)
        if placed:
            self.t_rows.place(slots[: len(joining)], rows)
            for i, (row, _) in zip(slots, joining, strict=False):
                self.rows[i] = row
            slots = slots[len(joining) :]
        if slots:  # rows leaving that no joining row took the place of
            gone = set(slots)
            self._keep([i for i in range(len(self.rows)) if i not in gone])
        if not placed:
            self.t_rows.append(rows)
            self.rows += [row for row, _ in joining]

    def remove(self, key) -> None:
        """Drop a finished (or cancelled) row: at once if it has not joined yet, else at
        the start of the next step, together with every other row removed by then (one
        copy of the caches for all of them, as when rows finish in the same step)."""
        joining = len(self._joining)
        self._joining = [(row, ids) for row, ids in self._joining if row.key != key]
        if len(self._joining) == joining and any(r.key == key for r in self.rows):
            self._leaving.add(key)

    def _drop_leaving(self) -> None:
        """Take the removed rows out of the caches."""
        leaving, self._leaving = self._leaving, set()
        self._keep([i for i, r in enumerate(self.rows) if r.key not in leaving])
        if self.proposer is not None:
            self.proposer.remove(leaving)

    def _keep(self, keep: list[int]) -> None:
        """Keep only these rows (indexes into `rows`), in the target's caches too."""
        self.t_rows.select(keep)
        self.rows = [self.rows[i] for i in keep]

    # -- one step ------------------------------------------------------------------
    def step(self) -> dict:
        """One draft + verify step for every row: {row key: Step}."""
        start = time.perf_counter()
        joined = len(self._joining)
        if joined:
            self._admit_joining()
        elif self._leaving:
            self._drop_leaving()
        if not self.rows:
            return {}
        # The target never rolls back past this step (advance keeps only what passed), so
        # recurrent layers may forget the passes before it.
        self.t_rows.checkpoint()
        choices = self._choose()
        chosen, forced = choices, self._force(choices)
        if forced:
            choices = [forced.get(i, c) for i, c in enumerate(choices)]
        t0 = time.perf_counter()
        drafts, q, confidence = self._draft(choices)
        if self._constrained:
            self._trim(drafts, q)
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
        raw = logits
        if self._processed:
            # The pass runs while the host fills the grammars' masks (process fills them
            # before it reads the logits).
            mx.async_eval(logits)
            row_logits = [r.logits for r in self.rows]
            logits = processors.process(logits, row_logits, drafts, self._executor())
        results = self._verify(logits, drafts, q)
        t2 = time.perf_counter()
        keep = [1 + n for n, _ in results]
        self.t_rows.advance(width, keep)
        if features is not None:
            self.proposer.observe_target(features, keep)
        steps = self._finish(choices, drafts, results, t1 - t0, t2 - t1, raw)
        for rows in (self.t_rows, self.proposer.rows if self.proposer is not None else None):
            if rows is not None and rows.waste() > COMPACT_WASTE:
                rows.compact()
        self._observe(chosen, forced, drafts, results, confidence, start, joined)
        return steps

    # -- draft lengths -----------------------------------------------------------------
    def _schedule(self, drafter: str) -> SampledSchedule:
        """A sampled "auto" row's schedule, from what its drafter declares it costs."""
        config = self.policy.config if self.policy is not None else None
        proposer = self.proposer if drafter == "model" else None
        cost = proposer.draft_cost if proposer is not None else 0.0
        block = proposer is not None and proposer.block
        verify = VERIFY_COST["gpu" if mx.default_device() == mx.gpu else "cpu"]
        return SampledSchedule(config, cost, verify, block)

    def _choose(self) -> list[Choice]:
        """Every row's draft this step: a fixed K or a sampled row's schedule as it says,
        greedy "auto" rows the policy's K (model rows) or their lookup proposal cut to the
        policy's K (lookup rows, and model rows whose text repeats in a small batch)."""
        rows, policy = self.rows, self.policy
        choices = [Choice() for _ in rows]
        model, lookup = [], []  # greedy "auto" rows: (index, budget[, proposal])
        cap = self.proposer.max_draft if self.proposer is not None else None
        cap = MAX_DRAFT_TOKENS if cap is None else cap
        hybrid = len(rows) <= HYBRID_MAX_ROWS
        for i, row in enumerate(rows):
            budget = row.budget()
            if row.drafter == "none" or budget == 0:
                continue
            if row.greedy_auto:
                if policy is None:
                    continue
                if row.lookup is not None and (hybrid or row.drafter == "lookup"):
                    free = row.lookup.propose(min(budget, LOOKUP_MAX_DRAFT))
                    if free:
                        lookup.append((i, free))
                        continue
                if row.drafter == "model":
                    model.append((i, budget))
                continue
            k = row.fixed_k if row.fixed_k is not None else row.plan.choose(budget)
            k = min(k, budget, cap) if row.drafter == "model" else min(k, budget)
            if k and row.drafter == "lookup":
                tokens = row.lookup.propose(k)
                choices[i] = Choice(len(tokens), "lookup" if tokens else "none", tokens)
            elif k:
                choices[i] = Choice(k, "model")
        n, k_model = len(rows), 0
        if model:
            together, left = self._together()
            cap = min(cap, max(b for _, b in model))
            k_model = policy.decide(n, cap, free=False, together=together, left=left)
            for i, budget in model:
                if k_model:
                    choices[i] = Choice(min(k_model, budget), "model")
        for source in sorted({lookup_source(rows[i]) for i, _ in lookup}):
            group = [(i, t) for i, t in lookup if lookup_source(rows[i]) == source]
            longest = max(len(t) for _, t in group)
            k = policy.decide(n, longest, free=not k_model, source=source)
            for i, tokens in group:
                choices[i] = Choice(offered=tokens)
                if k and rows[i].drafter == "model" and k_model:
                    # The draft model runs for the batch anyway: the row takes whichever
                    # draft is expected to pass more.
                    mine = expected_tokens(policy.rates(source), min(k, len(tokens)))
                    if expected_tokens(policy.rates(), min(k_model, rows[i].budget())) > mine:
                        choices[i] = Choice(min(k_model, rows[i].budget()), "model")
                        continue
                if k:
                    choices[i] = Choice(min(k, len(tokens)), "lookup", tokens[:k], tokens)
        return choices

    def _together(self) -> tuple[int, float]:
        """(the joins plain decoding saves: rows that finish on a step with another row,
        less one a step; those rows' mean tokens left): plain decoding finishes rows that
        share their tokens left on one step, and their successors join in one pass;
        drafting parts them."""
        lefts = [r.max_tokens - r.generated for r in self.rows]
        counts = Counter(lefts)
        shared = [x for x in lefts if counts[x] > 1]
        groups = sum(1 for c in counts.values() if c > 1)
        return len(shared) - groups, (sum(shared) / len(shared) if shared else 0.0)

    def _observe(self, chosen, forced, drafts, results, confidence, start, joined) -> None:
        """Tell the policy what the step did (tokens the grammar forced are no evidence
        of what drafting earns, nor is a step whose draft length a request fixed). A
        free proposal is judged one token past its drafts (all of it on a plain step's
        one token): the target's greedy token says whether it would have passed."""
        if self.policy is None:
            return
        k, accepted, judged, sources = [], [], [], []
        auto = True
        for i, (row, c, d, (n, nxt)) in enumerate(
            zip(self.rows, chosen, drafts, results, strict=True)
        ):
            offered = c.offered if i not in forced and c.source != "model" else None
            heard = (len(d), n, len(d), c.source) if d and i not in forced else (0, 0, 0, "model")
            if offered:
                emitted = d[:n] + [nxt]
                seen = min(len(offered), len(d) + 1)
                passed = next((j for j in range(seen) if offered[j] != emitted[j]), seen)
                heard = (len(d), passed, seen, lookup_source(row))
            row.copying = bool(offered) and 0 < heard[1] == heard[2]
            auto = auto and (not heard[0] or row.fixed_k is None)
            for out, value in zip((k, accepted, judged, sources), heard, strict=True):
                out.append(value)
        free = any(k) and all(s != "model" for s, n in zip(sources, k, strict=True) if n)
        self.policy.observe(
            StepRecord(
                rows=len(self.rows),
                k=k,
                accepted=accepted,
                judged=judged,
                seconds=time.perf_counter() - start,
                free=free,
                clean=not joined,
                joined=joined,
                cap=max((c.k for c in chosen if c.source == "model"), default=None),
                sources=sources,
                confidence=[confidence.get(r.key, []) for r in self.rows] if confidence else [],
                auto=auto,
            )
        )

    @property
    def _processed(self) -> bool:
        return any(r.logits is not None and r.logits.transforms for r in self.rows)

    @property
    def _constrained(self) -> bool:
        return any(r.logits is not None and r.logits.matcher is not None for r in self.rows)

    def _executor(self):
        grammars = getattr(self.pair, "_grammars", None)
        return grammars.executor if grammars is not None else None

    def _force(self, choices: list[Choice]) -> dict[int, Choice]:
        """Rows whose grammar allows exactly one continuation: those tokens are their
        draft this step, proposed without the drafter (source "forced"), verified by the
        target like any draft."""
        forced = {}
        if not self.force_grammar_tokens:
            return forced
        for i, row in enumerate(self.rows):
            if row.logits is not None and row.logits.constrained:
                tokens = row.logits.forced(row.budget())
                if tokens:
                    forced[i] = Choice(len(tokens), "forced", tokens)
        return forced

    def _trim(self, drafts: list[list[int]], q: dict) -> None:
        """Cut every constrained row's draft at the first token its grammar refuses (and
        the law it was drawn from with it). A draft drawn from a law q keeps that token:
        its rejection is certain (p = 0 there), and the position must then draw from the
        residual (p - q)+, not from p, or the row's law is skewed toward what q missed."""
        for i, row in enumerate(self.rows):
            if row.logits is None or row.logits.matcher is None or not drafts[i]:
                continue
            kept = row.logits.trim(drafts[i])
            if len(kept) < len(drafts[i]):
                if i in q:
                    kept = drafts[i][: len(kept) + 1]
                    q[i] = q[i][: len(kept)]
                drafts[i] = kept

    def _draft(self, choices: list[Choice]) -> tuple[list[list[int]], dict, dict]:
        """Every row's draft tokens, the laws of sampled rows' model drafts ({index: (k, V)})
        and, where the draft model stopped early, its confidence in each draft ({key: [p]})."""
        drafts = [list(c.tokens or []) if c.source in ("lookup", "forced") else [] for c in choices]
        q: dict[int, mx.array] = {}
        want = {r.key: c.k for r, c in zip(self.rows, choices, strict=True) if c.source == "model"}
        if self.proposer is None or not want:
            # Nothing drafts by the model this step: the proposer is not asked (its
            # commit then queues the emitted tokens for its rows, as after depth 0).
            return drafts, q, {}
        positions = {r.key: r.generated for r in self.rows}
        last = {r.key: r.target_pending for r in self.rows}
        extra = {}
        # Rows whose processors (bias, penalties, grammar) change the target's choice:
        # a proposer that takes them drafts under them too (acceptance, not exactness).
        processed = {
            r.key: r.logits
            for r in self.rows
            if r.key in want and r.logits is not None and r.logits.transforms
        }
        if processed and self.proposer.masks_drafts:
            extra["grammar"] = processed
        confidence: dict = {}
        policy = self.policy
        if (
            self.proposer.stops_early
            and policy is not None
            and policy.stops_early(len(self.rows))
            and all(
                r.greedy_auto
                for r, c in zip(self.rows, choices, strict=True)
                if c.source == "model"
            )
        ):
            # Greedy "auto" rows only: their text does not depend on where drafts end.
            n, depth = len(self.rows), max(want.values())

            def keep_drafting(probs: dict) -> bool:
                confidence.update(probs)
                return policy.keep_drafting(n, depth, list(probs.values()))

            extra["stop"] = keep_drafting
        by_key, laws = self.proposer.propose(want, positions, last, **extra)
        for i, row in enumerate(self.rows):
            if row.key in by_key:
                drafts[i] = by_key[row.key]
                if row.key in laws:
                    q[i] = laws[row.key]
        return drafts, q, confidence

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

    def _finish(self, choices, drafts, results, draft_s, verify_s, raw) -> dict:
        emitted_by_key, accepted_by_key, steps = {}, {}, {}
        emitted_rows = [d[:n] + [nxt] for d, (n, nxt) in zip(drafts, results, strict=True)]
        row_logits = [r.logits for r in self.rows]
        logprobs = processors.logprobs_of(raw, row_logits, emitted_rows)
        for i, (row, c, d, (n, _)) in enumerate(
            zip(self.rows, choices, drafts, results, strict=True)
        ):
            emitted = emitted_rows[i]
            row.target_pending = emitted[-1]
            if row.lookup is not None:
                row.lookup.append(emitted)
            if row.logits is not None:
                row.logits.commit(emitted)
            row.generated += len(emitted)
            emitted_by_key[row.key], accepted_by_key[row.key] = emitted, n
            source = c.source if d else "none"
            steps[row.key] = Step(emitted, len(d), n, draft_s, verify_s, source, logprobs.get(i))
        if self.proposer is not None:
            self.proposer.commit(emitted_by_key, accepted_by_key)
        return steps

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


def lookup_source(row: _Row) -> str:
    """The policy's name for a row's lookup acceptance: "lookup", or "lookup-copying"
    while its last proposal passed whole."""
    return "lookup-copying" if row.copying else "lookup"


def decoder_class(pair) -> type[Decoder]:
    """The kind of decoder a pair runs, picked here only: BatchDecoder, or
    plain.PlainDecoder for a target whose layers the speculative decoder cannot keep
    exact (`pair.plain_only`)."""
    return PlainDecoder if pair.plain_only else BatchDecoder


def new_decoder(pair) -> Decoder:
    """A decoder for a pair (see `decoder_class`)."""
    return decoder_class(pair)(pair)


def request_drafter(pair, drafter: str) -> str:
    """The drafter a request runs with on this pair: "none" where its decoder does not
    draft (plain decoding gives the text any drafter would), else `drafter`. Raises
    core.InvalidRequestError for "model" where the pair has no draft model."""
    if not decoder_class(pair).speculative:
        return "none"
    if drafter == "model" and pair.drafter_kind is None:
        raise core.InvalidRequestError(NO_DRAFT_MODEL)
    return drafter


class SpeculativeDecoder:
    """One request through the one decoder (a batch of one); iterate `steps()`.

    num_draft_tokens is an int (1..16), "auto" (the pair's policy's choice), or 0 for
    plain decoding.
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
        logits: RowLogits | None = None,
    ):
        if num_draft_tokens == 0 or not decoder_class(pair).speculative:
            drafter, num_draft_tokens = "none", 1
        self.batch = new_decoder(pair)
        self.batch.add(
            self.KEY,
            list(prompt_ids),
            params,
            seed=seed,
            drafter=drafter,
            num_draft_tokens=num_draft_tokens,
            max_tokens=max_tokens,
            logits=logits,
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
