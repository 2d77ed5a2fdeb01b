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
#: Weight, in draft tokens, of that prior in a sampled row's plan and in a pair's
#: acceptance before it has heard a draft.
PRIOR_WEIGHT = 4.0
#: Per-step decay of the acceptance counts: recent steps weigh more.
DECAY = 0.9
#: A greedy "auto" row's acceptance of model drafts is its own decayed counts plus its
#: pair's acceptance weighing this many trials: its own few dozen drafts alone swing by
#: ~0.1, and the batch length follows the swings (measured at 1 row of the widened pair:
#: long drafts picked after lucky steps, K = 0 after unlucky ones; "auto" 1.11-1.16x plain
#: where K = 2 ran 1.22-1.24x, 1.19-1.20x with this weight). An anchor weighs no more
#: than the trials its pair has heard (a new pair's prior alone must not hold rows at
#: PRIOR_ACCEPTANCE).
ROW_ANCHOR = 40.0
#: ... unless its own counts clearly disagree: more than ANCHOR_Z standard errors from
#: the pair's rate (a binomial error at the pair's rate, kept within 0.1-0.9, over the
#: row's decayed trials, once they are at least ANCHOR_MIN_TRIALS), where the anchor
#: weighs no more than PRIOR_WEIGHT. A request unlike the pair's others is heard within
#: a few steps (measured: DFlash at a 192-token prompt passes ~0.9 where short prompts
#: pass ~0.6; held at the pair's rate it drafted short blocks, 1.03 tokens a pass and
#: 0.98x plain), and a row's chance swings (~1 error) stay anchored. Without the floors,
#: three rejected lookups read 0.0 and the row never drafted again.
ANCHOR_Z, ANCHOR_MIN_TRIALS = 2.5, 8.0
#: ... and of its prompt-lookup drafts, which pass by how its own text repeats: a light
#: anchor (at ROW_ANCHOR, a long prompt whose lookups passed at 0.98 read ~0.4 for its
#: whole request, and DFlash at long context drafted nothing).
LOOKUP_ANCHOR = 8.0
#: Until a pair's model drafts have been heard this many times (trials), greedy "auto"
#: drafts wherever perfect acceptance could pay, the guard permitting: its acceptance is
#: still the prior's guess, and K = 0 learns nothing.
UNTRIED_TRIALS = 32.0
#: Per-observation decay of a pair's acceptance, the prior every new row starts from: it
#: hears every row's drafts, so DECAY would make it the last few rows' (measured: after a
#: batch's last, slowest rows drafted alone it read 0.59 where rows pass ~0.7, and a
#: new batch began, and stayed, at K = 0).
SHARED_DECAY = 0.99
#: How fast a pass-cost curve's load factor follows live timings.
EMA = 0.1
#: How fast a pass-cost curve's per-size correction follows live timings (slower than EMA).
SHAPE_EMA = 0.05
#: How fast the measured seconds of one batch shape (rows, width) follow live timings.
LIVE_EMA = 0.2
#: A live timing more than this many times off a price moves it as if it were this far
#: off (adaptive._clip): a persistent change is still followed within a few steps.
OUTLIER = 2.0
#: Steps between probes when K = 0 (first), and the most a run of failed probes stretches it.
PROBE_FIRST, PROBE_MAX = 8, 256
#: Speculation must beat plain decoding by this share in the model before it is used: a
#: step the model over-rates costs real time. Once drafting at a batch-size class, it goes
#: on while it beats plain decoding at all (adaptive.DraftController.drafting).
MARGIN = 0.03
#: The realized-speed guard (engine/realized.py) judges a batch-size class once this many
#: drafting steps and GUARD_MIN_PLAIN plain ones ran there;
#: drafting must then cost no more per emitted token than plain decoding (within MARGIN).
GUARD_MIN_STEPS = 8
GUARD_MIN_PLAIN = 3
#: ... and only while its drafting steps, decayed by GUARD_DECAY, weigh at least this many
#: steps (engine/realized.py: a verdict is never one fresh step after a long plain stretch).
GUARD_MIN_WEIGHT = 4.0
#: The guard's plain side is the decayed mean or, where less, the median seconds a token
#: of its newest this many plain steps (engine/realized.py: a pause is no plain cost).
GUARD_MEDIAN_OF = 7
#: ... and a verdict against drafting needs its excess over plain (past MARGIN) to be
#: more than this many standard errors of the two sides (engine/realized.py: a verdict
#: on a swing of a few rows' noisy steps stood for hundreds of steps).
GUARD_Z = 2.0
#: The first steps of each kind at a batch-size class are no evidence: a process's first
#: passes of a shape run slow (measured: a false verdict at 1 demo row from them).
GUARD_SKIP = 2
#: Per-step decay of the guard's evidence: a step 34 steps old weighs half a new one.
GUARD_DECAY = 0.98
#: A verdict against drafting lapses GUARD_HOLD_FIRST steps after the class last drafted;
#: drafting is then tried again, and a trial that loses again doubles the wait, up to
#: GUARD_HOLD steps (a verdict reached on a process's first, slow steps must not stand).
GUARD_HOLD_FIRST, GUARD_HOLD = 64, 512
#: While "auto" drafts at a batch-size class, a plain step runs there first, then after
#: PLAIN_FIRST steps, each interval twice the last up to PLAIN_MAX: the guard's plain side
#: and the plain pass price stay live (start-up timings are off by up to a third). Steps
#: counted at that class: the last rows of each batch of work meet a small class for a
#: few steps, and counted in all steps, every visit took a plain check (measured at 4
#: demo rows in lockstep: 4.2 plain steps a run among the last rows, 1.2 counted here).
PLAIN_FIRST, PLAIN_MAX = 2, 64
#: ... but not within this many steps of rows joining: the first step over a batch that
#: rows just joined runs slow (measured at 4 demo rows: a plain step 13% over the rest,
#: a drafting one 6%), and a plain check there, one of the few plain steps the guard
#: hears, made plain look 15% dearer than it is, and drafting that lost 4% of plain's
#: speed looked like a win.
PLAIN_SETTLE = 2
#: In a batch, the shortest K priced within this share of the best K's price drafts
#: (whether to draft at all is judged at the best's). A deeper K costs a batch what no
#: step's price holds (a heavier tail of slow steps; rows parting, which then join and
#: run dry one at a time), and the K's prices are off by more than the K's differ
#: (measured at 4 demo rows: priced 2-41% over their whole steps, by a different share
#: at each K). Fresh processes at 4 demo rows, "auto" over each one's best fixed K,
#: median of 8: 0.957 without (1 of 8 within 3%), 0.970-0.974 with (4-6 of 8); the
#: widened pair at 4 rows, where K = 1 and 2 tie, 1.159-1.178 against 1.152-1.172.
#: One row drafts the best K: its price holds no parting.
DEPTH_MARGIN = 0.10
#: While "auto" drafts at a batch-size class, a neighbouring K (one more or one fewer
#: draft) whose step shape has not run there for EXPLORE_EVERY steps runs one step, at
#: most one such step every EXPLORE_GAP steps, so that its pass price stays live.
EXPLORE_EVERY, EXPLORE_GAP = 64, 16
#: A drafting shape's price relative to the plain pass (adaptive.live_relative) is
#: learnt only from steps within this many steps of a live plain step at that batch size.
RELATIVE_FRESH = 64
#: Where every row of a batch size drafts by the draft model, a step's draft and verify
#: seconds are fitted against its depth (adaptive.DepthFit), each step decaying the older
#: by FIT_DECAY; the line prices every K there once FIT_DEPTHS depths have run with at
#: least FIT_WEIGHT decayed steps each.
FIT_DECAY, FIT_DEPTHS, FIT_WEIGHT = 0.98, 2, 2.0
#: Steps a K = 0 decision is reused unpriced while the batch summary stays the same
#: (pricing costs about a tenth of a small model's decode step).
SETTLED_STEPS = 16
#: Steps the controller reuses its step prices at each K (adaptive._step_prices) while no
#: shape is new to its live timings: a sample moves a price by LIVE_EMA, so a price a few
#: steps old is as good, and pricing every K every step cost 1-2% of a 4-row demo step.
PRICE_STEPS = 4
#: Steps a drafting decision (K > 0) is used, priced on the first only, while the batch
#: keeps its size and none of its rows has a free draft: pricing is most of what "auto"
#: adds to a step (measured at 4 demo rows: ~0.2 ms of a 6.5 ms step, and K changed on
#: few steps). Rows changing do not end it: at 4 demo rows a row leaves and another joins
#: every ~10 steps. (16 steps cut choosing from ~60 to ~30 us a step there, and held K =
#: 2 where 4 re-priced to K = 1: 1.020 +- 0.012 slower paired, not kept.)
HELD_STEPS = 4
#: ... and each pricing that confirms the K held holds it twice as long, up to HELD_MAX steps
#: (adaptive.DraftController._hold_span): a K that keeps its lead is priced less often, one
#: that changes is priced again after HELD_STEPS (fresh processes at 4 demo rows, x4, 24
#: runs paired: 1.8 +- 0.6% faster than without; "auto" over its process's best fixed K by
#: the median process 0.978 and 0.964, where the engine without read 0.959 and 0.965).
HELD_MAX = 16
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
#: ... and only in a batch of at most this many rows. In a larger batch its lookup drafts
#: cost what no price of the step shows: the draft model reads the tokens they took over
#: every row it holds, rows that did not take them keep holes in the cache, and rows that
#: jump ahead finish apart (measured at the demo pair, in one process, "auto" against
#: "auto" without them: 1.16x at 1 row, 1.04x at 2, 0.94x at 3, 0.92-0.94x at 4; the
#: widened and random-draft pairs at 4 rows 1.01x).
HYBRID_MAX_ROWS = 2

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
    # A probe's draft measures acceptance only: the decoder keeps none of its tokens, so
    # the row stays in step with rows it would finish beside (see batch.BatchDecoder.step).
    probe: bool = False


@dataclass(frozen=True)
class Outcome:
    """What one step did, for `DraftPolicy.observe`: per row its choice, its drafts and
    how many passed; the verify width, the draft and verify seconds, when the step
    started, whether it admitted rows (then its time includes their prefill), and the
    seconds and number of the row changes it made (rows leaving or joining: each copies
    the batch's caches once)."""

    rows: list
    choices: list[Choice]
    drafts: list[list[int]]
    accepted: list[int]
    width: int
    draft_s: float
    verify_s: float
    started: float
    joined: bool
    churn_s: float = 0.0
    churn_events: int = 0


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens emitted by one verify step with k drafts at acceptance a."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class DraftPolicy:
    """The draft lengths of one decoder's steps.

    `rows` are the decoder's rows (`key`, `drafter`, `fixed_k`, `plan`, `lookup`,
    `budget()`, `greedy_auto`, `generated`, `max_tokens`); `proposer` is the decoder's
    interfaces.Proposer, or None; `controller` the pair's adaptive.DraftController.

    A step that drafts nothing should cost what a plain step costs, and "auto" is the
    default of every request: where every row is greedy "auto" (or plain) and a K = 0
    decision is settled (adaptive.DraftController.reuse_settled), `choose` asks only the
    rows of drafter "lookup" whether their text offers a draft.
    """

    def __init__(self, controller, proposer):
        self.controller = controller
        self.proposer = proposer
        self._epoch = next(_EPOCHS)
        # Bumped in a step where some row drafted (its acceptance changed): with the
        # epoch, what a reused K = 0 decision depends on.
        self._version = 0
        self._mix: str | None = None  # this epoch's rows: "plain", "greedy" or "mixed"
        self._lookups: list = []  # this epoch's lookup indexes of greedy "auto" lookup rows
        self._probing = False  # the step being chosen is a probe

    def rows_changed(self, joined: bool = False) -> None:
        """Rows joined or left: a reused K = 0 decision no longer holds. `joined`: rows
        joined at the start of the step about to be chosen, which is then no plain check
        (the guard hears no step that admitted rows, see `DraftController.joining`)."""
        self._epoch = next(_EPOCHS)
        self._mix = None
        if joined and self.controller is not None:
            self.controller.joining()

    def choose(self, rows: list) -> list[Choice]:
        """Every row's draft this step (a lookup proposal's tokens included)."""
        self._probing = False
        mix = self._mix or self._classify(rows)
        if mix == "plain" or (self.controller is None and mix == "greedy"):
            return [Choice() for _ in rows]
        k = None
        if mix == "greedy":
            ctl = self.controller
            key = self._key(())
            k = ctl.reuse_settled(key, self._offer(), len(rows))
            if k == 0:  # the usual step where speculation does not pay
                return [Choice() for _ in rows]
            if k is None and not self._lookups and len(rows) > HYBRID_MAX_ROWS:
                # No row can have a free draft: a held K needs no row read but its budget.
                held = ctl.reuse_held(self._hold(rows, key), len(rows))
                if held is not None:
                    return [self._held(row, held) for row in rows]
        choices = [Choice() for _ in rows]
        auto, fixed, auto_rows = [], [], []
        hybrid = len(rows) <= HYBRID_MAX_ROWS  # model rows take lookup drafts too
        for row, c in zip(rows, choices, strict=True):
            if row.drafter == "none":
                continue
            budget = row.budget()
            if budget == 0:
                continue
            plan = row.plan
            if row.greedy_auto:
                # This runs for every row of every step it is not settled: attribute reads.
                own = plan.lookup  # the row's lookup sub-plan, if it takes lookup drafts
                free = None
                if row.lookup is not None and (hybrid or row.drafter == "lookup"):
                    free = row.lookup.propose(
                        min(budget, own.k_max if own is not None else MAX_AUTO_DRAFT)
                    )
                if free:
                    c.tokens, c.source = free, "lookup"
                    rate = (own if own is not None else plan).acceptance.rate
                    auto.append(AutoRow(rate, len(free), True))
                elif row.drafter == "model":
                    c.source = "model"
                    auto.append(AutoRow(plan.acceptance.rate, min(budget, MAX_AUTO_DRAFT), False))
                else:  # a lookup row whose text has nothing to propose this step
                    continue
                auto_rows.append((row, c))
                continue
            k_row = row.fixed_k if row.fixed_k is not None else plan.choose()
            k_row = min(k_row, budget, self._model_cap() if row.drafter == "model" else k_row)
            c.k, c.source = k_row, row.drafter if k_row else "none"
            if k_row and row.drafter == "lookup":
                c.tokens = row.lookup.propose(k_row)
                c.k = len(c.tokens)
                c.source = "lookup" if c.k else "none"
            rate = plan.acceptance.rate if plan is not None else PRIOR_ACCEPTANCE
            fixed.append(FixedRow(c.k, rate, row.drafter == "model"))
        if auto:
            self._choose_auto(auto, fixed, auto_rows, rows, k)
        return choices

    @staticmethod
    def _held(row, k: int) -> Choice:
        """A greedy "auto" row's choice at a held K (as `_choose_auto` gives it)."""
        if row.drafter == "none" or not k:
            return Choice()
        k = min(k, row.budget(), MAX_AUTO_DRAFT)
        return Choice(k, "model") if k else Choice()

    @staticmethod
    def _hold(rows: list, key: tuple) -> tuple:
        """What a held drafting decision depends on (`DraftController.reuse_held`): `key`
        (`_key`) less the rows and their acceptance, with the batch size: how many rows the
        draft model would run over, the fixed rows' drafts."""
        _, _, drafted, fixed = key
        return (len(rows), drafted, fixed)

    def _classify(self, rows: list) -> str:
        self._lookups = [r.lookup for r in rows if r.drafter == "lookup" and r.greedy_auto]
        if all(r.drafter == "none" for r in rows):
            self._mix = "plain"
        elif all(r.greedy_auto or r.drafter == "none" for r in rows):
            self._mix = "greedy"
        else:
            self._mix = "mixed"
        return self._mix

    def _key(self, fixed: tuple) -> tuple:
        # What a reused K = 0 depends on: the rows (epoch), their acceptance (version),
        # how many rows the draft model would run over, and the fixed rows' drafts.
        proposer = self.proposer
        drafted = len(proposer.members) + len(proposer.cold) if proposer is not None else 0
        return (self._epoch, self._version, drafted, fixed)

    def _offer(self) -> tuple[int, int]:
        """(greedy "auto" rows of drafter "lookup" with a draft this step, their draft
        tokens up to LOOKUP_MAX_DRAFT each): more of either may make drafting pay. The
        lookup drafts a row of drafter "model" takes where its text repeats are priced
        when the step is (at least every SETTLED_STEPS steps), not looked up every step
        (that upkeep alone cost 1% of a plain step at 32 demo rows)."""
        n = tokens = 0
        for index in self._lookups:
            start = index.offer
            if start >= 0:
                n += 1
                tokens += min(len(index.tokens) - start, LOOKUP_MAX_DRAFT)
        return n, tokens

    def _choose_auto(self, auto, fixed, auto_rows, rows: list, k: int | None) -> None:
        ctl = self.controller
        if k is None:
            key = self._key(tuple(fixed))
            k = ctl.choose_batch_k(
                auto,
                fixed,
                key[2],  # rows the draft model would run over
                lambda: self._read_cost(auto_rows),
                key=key,
                offer=self._offer(),
                rows=len(rows),
                sync=lambda: self._in_step(rows),
                hold=self._hold(rows, key),
            )
        probe = self._probe_row(auto_rows) if ctl.probing else None
        self._probing = probe is not None
        if probe is not None:
            probe.probe = True
        if k == 0 and probe is None:  # the usual step where speculation does not pay
            for _, c in auto_rows:
                c.source, c.tokens = "none", None
            return
        model_rows = ctl.model_rows_draft  # False: only the rows with a free draft draft
        depth = ctl.model_depth  # the most drafts a row without a free draft takes (None: k)
        # The draft model runs K passes over every row it holds whenever a row drafts by
        # it: a row with a free draft then takes the model's instead where that is
        # expected to pass more (and the model has read all of the row but what its first
        # pass reads).
        model_runs = probe is None and model_rows and any(not a.free for a in auto)
        for (row, c), a in zip(auto_rows, auto, strict=True):
            # A probe measures acceptance: one row's draft tells it, and costs the
            # draft model at most one cold row's first read.
            c.k = min(k, a.cap) if probe is None or c is probe else 0
            if probe is None and not a.free and depth is not None:
                c.k = min(c.k, depth)  # (0 where only the free rows draft)
            if model_runs and a.free and row.drafter == "model":
                k_model = min(k if depth is None else depth, row.budget(), MAX_AUTO_DRAFT)
                if expected_tokens(row.plan.acceptance.rate, k_model) > expected_tokens(
                    a.acceptance, c.k
                ) and not self.proposer.read_cost([row.key]):
                    c.source, c.tokens, c.k = "model", None, k_model
            if c.source == "lookup":
                c.tokens = c.tokens[: c.k]
            if c.k == 0:
                c.source, c.tokens = "none", None

    @staticmethod
    def _in_step(rows: list) -> tuple[int, float]:
        """(rows sharing their tokens left with another row, the rows' mean tokens left):
        plain decoding finishes such rows on one step, drafting would part them."""
        left = [r.max_tokens - r.generated for r in rows]
        return len(left) - len(set(left)), sum(left) / len(left)

    def _read_cost(self, auto_rows: list) -> tuple[int, float]:
        """(positions the draft model would first run to catch up with the greedy "auto"
        rows it would draft for: cold rows' prefill, and the backlog of rows it has not
        drafted for lately; their mean tokens left to generate): what drafting now would
        cost once, and over how much output that cost is spread."""
        drafting = [r for r, c in auto_rows if c.source == "model"]
        if self.proposer is None or not drafting:
            return 0, 1.0
        positions = self.proposer.read_cost([r.key for r in drafting])
        if not positions:
            return 0, 1.0
        return positions, sum(r.max_tokens - r.generated for r in drafting) / len(drafting)

    def _probe_row(self, auto_rows: list) -> Choice | None:
        """The row a probe drafts for: the one the draft model can draft for soonest
        (the least to read first: a short backlog, or a short cold text)."""
        candidates = [(r, c) for r, c in auto_rows if c.source == "model"] or auto_rows
        if not candidates:
            return None
        if self.proposer is None:
            return candidates[0][1]
        row, choice = min(candidates, key=lambda rc: self.proposer.read_cost([rc[0].key]))
        return choice

    def _model_cap(self) -> int:
        """Most drafts the pair's proposer gives a fixed-length row in one step."""
        block = self.proposer.max_draft
        return block if block is not None else MAX_DRAFT_TOKENS

    def observe(self, outcome: Outcome) -> None:
        """Fold one finished step into the rows' plans and the controller's costs."""
        probe = None
        fixed_drafted = False  # a row drafted at a length its request fixed, not "auto"'s
        for row, c, d, n in zip(
            outcome.rows, outcome.choices, outcome.drafts, outcome.accepted, strict=True
        ):
            if d and row.fixed_k is not None:
                fixed_drafted = True
            if row.plan is None or row.fixed_k is not None or not d:
                continue
            plan = row.plan.lookup if (c.source == "lookup" and row.plan.lookup) else row.plan
            plan.observe(len(d), n)
            self._version += 1
            if row.greedy_auto and c.source == "model":
                probe = (len(d), n) if probe is None else (probe[0] + len(d), probe[1] + n)
        ctl = self.controller
        if ctl is None:
            return
        probing, self._probing = self._probing, False
        if probing and probe is not None:
            ctl.probe_result(*probe)
        proposer = self.proposer
        read_s = 0.0
        if proposer is not None and proposer.last_read is not None:
            positions, read_s = proposer.last_read
            ctl.observe_read(positions, read_s)
            proposer.last_read = None
        n_rows = len(outcome.rows)
        if outcome.churn_events:
            ctl.observe_churn(n_rows, outcome.churn_s / outcome.churn_events)
        if outcome.joined:
            # A step that admitted rows also ran their prefill and the first pass over
            # the joined cache: not a fair sample of any cost.
            ctl.observe_realized(n_rows, 0.0, 0, False, evidence=False, joined=True)
            return
        depth = proposer.depth_run if proposer is not None else 0
        members = len(proposer.members) if proposer is not None else 0
        # A cold row's first read is priced apart (observe_read), not as a draft pass; a
        # step whose first draft pass also read a backlog is no sample of a draft pass's
        # price (its reads are priced as one-off reads, `read_cost`).
        draft_s = max(outcome.draft_s - read_s, 0.0)
        backlog_s = 0.0
        if proposer is not None and depth and proposer.backlog_read:
            draft_s = 0.0
            # ... nor evidence against drafting: the guard hears the step less that read's
            # price (`warm_seconds`, as `read_cost` prices it before the step), as it heard
            # a catch-up pass less its timing while the backlog had a pass of its own.
            backlog_s = ctl.warm_seconds(proposer.backlog_read)
        ctl.observe_step(n_rows, outcome.width, outcome.verify_s, depth, members, draft_s)
        emitted = sum(1 + n for n in outcome.accepted)
        seconds = time.perf_counter() - outcome.started
        drafted = outcome.width > 1
        # The draft model's one-off reads are priced apart (observe_read), not as drafting.
        # A step drafted at a length a request fixed is no evidence of what "auto"'s drafting
        # pays: a fixed K at a poor acceptance, slower than plain, would stop "auto" drafting
        # at that batch size.
        evidence = not probing and not fixed_drafted
        # Drafts that ran no draft-model pass (prompt lookup) are judged apart.
        free = drafted and depth == 0
        ctl.observe_realized(
            n_rows, max(seconds - read_s - backlog_s, 0.0), emitted, drafted, evidence, free
        )
        # Row changes are priced apart (observe_churn); the guard counts them in.
        other = seconds - outcome.draft_s - outcome.verify_s - outcome.churn_s
        ctl.observe_overhead(n_rows, other, drafted)
