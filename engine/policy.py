"""How many tokens each row drafts in a step: the policy, apart from the decoder's
mechanism (drafting, verification, rollback, statistics).

`DraftPolicy.choose(rows)` gives every row of a step its draft (how many tokens, from
where) and `observe(outcome)` hears what the step did. A row with a number drafts that
many; a sampled "auto" row follows its own fixed schedule (adaptive.DraftPlan), so its
output does not depend on the batch; greedy "auto" rows share one length that the
controller picks for the whole batch from measured pass costs
(adaptive.DraftController.choose_batch_k), K = 0 whenever speculation does not pay. A
greedy "auto" row drafted by the model takes free prompt-lookup drafts instead on
steps where its text repeats itself.

Every tuning constant of the draft-length choice is here, each with what it does;
engine/adaptive.py holds the cost model and the controller that read them.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import NamedTuple

from contract.limits import MAX_DRAFT_TOKENS

# -- tuning constants -------------------------------------------------------------------
#: Most drafts a greedy or sampled "auto" row takes from the draft model in one step.
MAX_AUTO_DRAFT = 8
#: Most drafts of a lookup "auto" proposal (free of draft passes, so they may run longer).
LOOKUP_MAX_DRAFT = 12
#: Acceptance assumed before a row has drafted (and for a fixed-K row, which keeps none).
PRIOR_ACCEPTANCE = 0.6
#: Weight, in draft tokens, of that prior (and of the controller's shared prior) in a new plan.
PRIOR_WEIGHT = 4.0
#: Per-step decay of the acceptance counts: recent steps weigh more.
DECAY = 0.9
#: How fast a pass-cost curve's load factor follows live timings.
EMA = 0.1
#: How fast a pass-cost curve's per-size correction follows live timings (slower than EMA).
SHAPE_EMA = 0.05
#: How fast the measured seconds of one batch shape (rows, width) follow live timings.
LIVE_EMA = 0.2
#: Steps between probes when K = 0 (first), and the most a run of failed probes stretches it.
PROBE_FIRST, PROBE_MAX = 8, 256
#: Speculation must beat plain decoding by this share in the model before it is used: a
#: step the model over-rates costs real time, one it under-rates costs nothing.
MARGIN = 0.03
#: The realized-speed guard judges a batch-size class once this many plain and this many
#: drafting steps ran there; drafting must then cost no more per token (within MARGIN).
GUARD_MIN_STEPS = 8
#: Weight of a new step in the guard's running means (equal weights before 1 / GUARD_EMA).
GUARD_EMA = 0.1
#: Steps a K = 0 decision is reused unpriced while the batch summary stays the same
#: (pricing costs about a tenth of a small model's decode step).
SETTLED_STEPS = 16
#: A reused K = 0 is priced again before then only if the rows' free (prompt-lookup)
#: drafts grow past what was priced by more than this share (at least one row and two
#: tokens more): the offer changes a little most steps, and pricing each change cost
#: more than the rare small offer that would have paid.
FREE_SLACK = 0.25
#: A failed probe waits long enough that probes cost at most this share of the steps.
PROBE_BUDGET = 0.01
#: Pass sizes (positions) timed at start-up for the pass-cost curves.
PASS_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320)
#: Batch sizes whose plain decode step (rows of one position) is timed at start-up.
BATCH_SIZES = (2, 4, 8, 16, 32)
#: A greedy "auto" row drafted by the model takes lookup drafts only where its last
#: HYBRID_MIN_NGRAM tokens occurred before: single-token matches are too often chance
#: (measured on code: 2.1 tokens accepted per 1-gram proposal, 2.9 per 2-gram one).
HYBRID_MIN_NGRAM = 2

# Each change of a decoder's rows takes a new number: the controller's reused K = 0
# decision (choose_batch_k's key) never outlives the rows it was priced for.
_EPOCHS = itertools.count()


class AutoRow(NamedTuple):
    """A greedy "auto" row as the batch chooser sees it for one step (a tuple: one is
    made per row and step)."""

    acceptance: float
    cap: int  # most drafts this row can take (its proposal length, budget, drafter cap)
    free: bool  # its drafts need no draft-model pass (prompt lookup)


class FixedRow(NamedTuple):
    """A row whose draft length is already fixed this step (a number, or a sampled plan)."""

    k: int
    acceptance: float
    model: bool  # drafted by the draft model


@dataclass
class Choice:
    """A row's draft for this step: how many tokens, from where, and the tokens of a
    lookup proposal (model drafts come later, in one batched pass)."""

    k: int = 0
    source: str = "none"  # "model", "lookup" or "none"
    tokens: list | None = None


@dataclass(frozen=True)
class Outcome:
    """What one step did, for `DraftPolicy.observe`: per row its choice, its drafts and
    how many passed; the verify width, the draft and verify seconds, when the step
    started, and whether it admitted rows (then its time includes their prefill)."""

    rows: list
    choices: list[Choice]
    drafts: list[list[int]]
    accepted: list[int]
    width: int
    draft_s: float
    verify_s: float
    started: float
    joined: bool


class DraftPolicy:
    """The draft lengths of one decoder's steps.

    `rows` are the decoder's rows (`key`, `drafter`, `fixed_k`, `plan`, `lookup`,
    `budget()`, `greedy_auto`, `generated`, `max_tokens`); `proposer` is the decoder's
    interfaces.Proposer, or None; `controller` the pair's adaptive.DraftController.
    """

    def __init__(self, controller, proposer):
        self.controller = controller
        self.proposer = proposer
        self._epoch = next(_EPOCHS)

    def rows_changed(self) -> None:
        """Rows joined or left: a reused K = 0 decision no longer holds."""
        self._epoch = next(_EPOCHS)

    def choose(self, rows: list) -> list[Choice]:
        """Every row's draft this step (a lookup proposal's tokens included)."""
        choices = [Choice() for _ in rows]
        auto, fixed, auto_rows, held = [], [], [], []
        proposer = self.proposer
        # Rows the draft model would run over if it drafted (cold ones included).
        drafted_rows = len(proposer.members) + len(self._cold()) if proposer is not None else 0
        for row, c in zip(rows, choices, strict=True):
            budget = row.budget()
            if budget == 0 or row.drafter == "none":
                continue
            plan = row.plan
            if row.greedy_auto:
                # This runs for every row of every step: kept to plain attribute reads.
                rate = plan.acceptance.rate
                held.append(rate)
                own = plan.lookup  # the row's lookup sub-plan, if it takes lookup drafts
                free = None
                if row.lookup is not None:
                    free = row.lookup.propose(
                        min(budget, own.k_max if own is not None else MAX_AUTO_DRAFT)
                    )
                if free:
                    c.tokens, c.source = free, "lookup"
                    auto.append(
                        AutoRow(own.acceptance.rate if own is not None else rate, len(free), True)
                    )
                else:
                    c.source = "model"
                    auto.append(AutoRow(rate, min(budget, MAX_AUTO_DRAFT), False))
                auto_rows.append((row, c))
                continue
            k = row.fixed_k if row.fixed_k is not None else plan.choose()
            k = min(k, budget, self._model_cap() if row.drafter == "model" else k)
            c.k, c.source = k, row.drafter if k else "none"
            if k and row.drafter == "lookup":
                c.tokens = row.lookup.propose(k)
                c.k = len(c.tokens)
                c.source = "lookup" if c.k else "none"
            rate = plan.acceptance.rate if plan is not None else PRIOR_ACCEPTANCE
            fixed.append(FixedRow(c.k, rate, row.drafter == "model"))
        if auto:
            self._choose_auto(auto, fixed, auto_rows, drafted_rows, tuple(held))
        return choices

    def _choose_auto(self, auto, fixed, auto_rows, drafted_rows: int, held: tuple) -> None:
        # What a reused K = 0 depends on: the rows and their acceptance (`held`, constant
        # while nothing drafts), not the caps of this step's drafts (see choose_batch_k).
        key = (self._epoch, drafted_rows, held, tuple(fixed))
        k = self.controller.choose_batch_k(
            auto, fixed, drafted_rows, lambda: self._cold_cost(auto_rows), key=key
        )
        probe = self._probe_row(auto_rows) if self.controller.probing else None
        if k == 0 and probe is None:  # the usual step where speculation does not pay
            for _, c in auto_rows:
                c.source, c.tokens = "none", None
            return
        for (_, c), a in zip(auto_rows, auto, strict=True):
            # A probe measures acceptance: one row's draft tells it, and costs the
            # draft model at most one cold row's first read.
            c.k = min(k, a.cap) if probe is None or c is probe else 0
            if c.source == "lookup":
                c.tokens = c.tokens[: c.k]
            if c.k == 0:
                c.source, c.tokens = "none", None

    def _cold_cost(self, auto_rows: list) -> tuple[int, float]:
        """(tokens the draft model has not read of the greedy "auto" rows it would
        draft for, their mean tokens left to generate): what drafting now would first
        cost the draft model, and over how much output that cost is spread."""
        cold = self._cold()
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

    def _probe_row(self, auto_rows: list) -> Choice | None:
        """The row a probe drafts for: one the draft model has read already, else the
        cold one with the shortest text (the cheapest first read)."""
        candidates = [(r, c) for r, c in auto_rows if c.source == "model"] or auto_rows
        if not candidates:
            return None
        cold = self._cold()
        row, choice = min(
            candidates,
            key=lambda rc: self.proposer.cold_tokens(rc[0].key) if rc[0].key in cold else -1,
        )
        return choice

    def _cold(self):
        """The proposer's rows admitted and not read yet (none without a proposer)."""
        return self.proposer.cold if self.proposer is not None else {}

    def _model_cap(self) -> int:
        """Most drafts the pair's proposer gives a fixed-length row in one step."""
        block = self.proposer.max_draft
        return block if block is not None else MAX_DRAFT_TOKENS

    def observe(self, outcome: Outcome) -> None:
        """Fold one finished step into the rows' plans and the controller's costs."""
        probe = None
        for row, c, d, n in zip(
            outcome.rows, outcome.choices, outcome.drafts, outcome.accepted, strict=True
        ):
            if row.plan is None or row.fixed_k is not None or not d:
                continue
            plan = row.plan.lookup if (c.source == "lookup" and row.plan.lookup) else row.plan
            plan.observe(len(d), n)
            if row.greedy_auto and c.source == "model":
                probe = (len(d), n) if probe is None else (probe[0] + len(d), probe[1] + n)
        ctl = self.controller
        if ctl is None:
            return
        if ctl.probing and probe is not None:
            ctl.probe_result(*probe)
        if outcome.joined:
            # A step that admitted rows also ran their prefill and the first pass over
            # the joined cache: not a fair sample of any cost.
            return
        proposer = self.proposer
        depth = proposer.depth_run if proposer is not None else 0
        members = len(proposer.members) if proposer is not None else 0
        n_rows = len(outcome.rows)
        ctl.observe_step(n_rows, outcome.width, outcome.verify_s, depth, members, outcome.draft_s)
        emitted = sum(1 + n for n in outcome.accepted)
        seconds = time.perf_counter() - outcome.started
        drafted = outcome.width > 1
        ctl.observe_realized(n_rows, seconds, emitted, drafted)
        ctl.observe_overhead(n_rows, seconds - outcome.draft_s - outcome.verify_s, drafted)
