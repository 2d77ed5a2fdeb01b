"""The realized-speed guard of "auto": whatever the cost model predicts, drafting that
has measurably cost more wall-clock seconds per emitted token than plain decoding at
a batch size stops there.

Evidence is kept per batch-size class (1, 2-3, 4-7, 8-15, ...), apart for steps that
drafted and steps that did not, as sums of seconds and emitted tokens in which each
step weighs GUARD_DECAY ** (its age in steps): what the batch costs now, not what it
cost at start-up. Speed is a ratio of those sums (seconds over tokens), not a mean of
per-step ratios, which one slow step that emitted a single token would skew.

Both sides must be live. Start-up timings of a plain batch step are off by up to a
third on a busy machine, and a guard that weighs today's drafting against a plain
step timed long ago, or never, lets a wrong first guess stand for good (measured: at
16 demo rows "auto" drafted every step at 0.78x of plain, its only plain figures
from its first steps). So while "auto" drafts at a class, a plain step runs there now
and then (`plain_due`: before the first drafting step, then after PLAIN_FIRST steps,
twice as long each time, up to PLAIN_MAX; steps at that class, not of the whole batch's
life: a class met only now and then, as the last rows of each batch of work finish,
would otherwise take a plain step on most visits; never within PLAIN_SETTLE steps of rows
joining, whose first steps run slow), and a verdict against drafting lapses
some steps after the class last drafted (GUARD_HOLD_FIRST, twice as long after each
trial that loses again, up to GUARD_HOLD), so that a class lost once is tried again.
A verdict needs recent drafting evidence (GUARD_MIN_WEIGHT steps' worth, decayed): a
first drafting step after a long plain stretch is judged with the steps that follow
it, not alone (measured: DFlash at long context ran plain for good after one slow
first step, 1.00x plain where it drafts at 1.6x).
The plain side hears few steps where the drafting side hears hundreds, so a pause of the
process in one plain step would weigh as much as a run of drafting: it is the median of
its newest GUARD_MEDIAN_OF steps where that is less than their decayed mean.
Probe steps (one row drafts to measure acceptance) are evidence of neither, and the
draft model's one-off reads (rows it has not seen, or a backlog of tokens it has not
read) are priced apart, not counted against drafting.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from .policy import (
    GUARD_DECAY,
    GUARD_HOLD,
    GUARD_HOLD_FIRST,
    GUARD_MEDIAN_OF,
    GUARD_MIN_PLAIN,
    GUARD_MIN_STEPS,
    GUARD_MIN_WEIGHT,
    GUARD_SKIP,
    GUARD_Z,
    MARGIN,
    PLAIN_FIRST,
    PLAIN_MAX,
)


@dataclass
class Evidence:
    """Seconds and emitted tokens of one kind of step at one batch-size class, each
    step weighted by GUARD_DECAY ** (its age in the guard's steps)."""

    seconds: float = 0.0
    tokens: float = 0.0
    weight: float = 0.0  # the counted steps, weighted as seconds and tokens are, at the newest
    steps: int = 0  # steps ever seen
    last: int = 0  # the guard's step count at the newest
    last_kept: int = 0  # ... at the newest counted (past the first GUARD_SKIP)
    # Decayed sums of the squares and the product of seconds and tokens, and of the
    # squared weights (how many steps the decayed sums amount to): `error`.
    seconds2: float = 0.0
    tokens2: float = 0.0
    product: float = 0.0
    weight2: float = 0.0

    #: seconds a token of the newest counted steps, oldest first (`median`)
    recent: deque = field(default_factory=lambda: deque(maxlen=GUARD_MEDIAN_OF))
    _robust: tuple[float, float] | None = field(default=None, repr=False)  # (`robust`)

    def add(self, now: int, seconds: float, tokens: int) -> None:
        self.steps += 1
        self.last = now
        if self.steps <= GUARD_SKIP:  # a shape's first passes in a process run slow
            return
        self.recent.append(seconds / tokens)
        self._robust = None
        decay = GUARD_DECAY ** (now - self.last_kept) if self.tokens else 0.0
        self.seconds = self.seconds * decay + seconds
        self.tokens = self.tokens * decay + tokens
        self.weight = self.weight * decay + 1.0
        self.seconds2 = self.seconds2 * decay + seconds * seconds
        self.tokens2 = self.tokens2 * decay + tokens * tokens
        self.product = self.product * decay + seconds * tokens
        self.weight2 = self.weight2 * decay * decay + 1.0
        self.last_kept = now

    @property
    def per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens else 0.0

    @property
    def error(self) -> float:
        """The standard error of `per_token` (a ratio of decayed sums: the spread of each
        step's seconds about per_token times its tokens, over the steps the sums amount
        to); infinite before two steps."""
        if self.weight2 <= 0 or self.weight * self.weight / self.weight2 < 2:
            return math.inf
        r = self.per_token
        spread = (self.seconds2 - 2 * r * self.product + r * r * self.tokens2) / self.weight
        steps = self.weight * self.weight / self.weight2
        return math.sqrt(max(spread, 0.0) / (steps - 1)) / (self.tokens / self.weight)

    def robust(self) -> tuple[float, float]:
        """(the median seconds a token of the newest GUARD_MEDIAN_OF counted steps, its
        standard error from their spread about it), worked out once per new step: the
        guard asks on every step it judges, and steps are added far less often."""
        if self._robust is None:
            median = statistics.median(self.recent) if self.recent else 0.0
            spread = statistics.median(abs(x - median) for x in self.recent) if self.recent else 0.0
            self._robust = (median, 1.2533 * 1.4826 * spread / math.sqrt(max(len(self.recent), 1)))
        return self._robust


@dataclass
class Realized:
    """The guard's evidence at one batch-size class, and when it next wants a plain
    step there."""

    plain_ev: Evidence = field(default_factory=Evidence)
    spec_ev: Evidence = field(default_factory=Evidence)
    plain_interval: int = PLAIN_FIRST
    ticks: int = 0  # steps of either kind seen at this class (its own clock)
    plain_tick: int = 0  # ... at the newest plain step
    plain_asked: int = -1  # ... when a plain step was last asked for
    hold: int = GUARD_HOLD_FIRST  # steps a verdict against drafting stands after the last draft
    lapsed: bool = False  # a verdict lapsed: the next drafting step is a trial

    def observe(self, now: int, seconds: float, tokens: int, drafted: bool) -> None:
        (self.spec_ev if drafted else self.plain_ev).add(now, seconds, tokens)
        self.ticks += 1
        if not drafted:
            self.plain_tick = self.ticks
        if drafted and self.lapsed and self._judged():
            # A trial after a lapse: lost again waits twice as long, a win starts over.
            self.lapsed = False
            lost = self.losing()
            self.hold = min(self.hold * 2, GUARD_HOLD) if lost else GUARD_HOLD_FIRST

    def _judged(self) -> bool:
        """Enough steps of each kind ran here, and the drafting ones, as they stood at the
        newest, weigh at least GUARD_MIN_WEIGHT steps: after a long plain stretch the old
        drafting evidence has decayed to nearly nothing, and the first fresh drafting step
        (often a slow one: a cold read, a poor first guess of K) would be the verdict
        alone. The plain side needs no such weight: plain_due keeps it live while drafting
        runs, and what a plain step costs at a batch size moves little."""
        plain, spec = self.plain_ev, self.spec_ev
        return (
            plain.steps >= GUARD_SKIP + GUARD_MIN_PLAIN
            and spec.steps >= GUARD_SKIP + GUARD_MIN_STEPS
            and spec.weight >= GUARD_MIN_WEIGHT
        )

    @property
    def plain(self) -> float:
        """Seconds per emitted token of the plain steps (recent ones weigh more), or the
        median of the newest ones where that is less: every plain step emits a token a
        row, so its cost a token barely moves, and a slow one is noise (a pause of the
        process). The plain side hears a few steps (plain checks, PLAIN_MAX apart) where
        the drafting side hears hundreds, so one pause weighed as much as the drafting
        steps of a whole run (measured at 4 demo rows: plain read 1.47 ms a token where
        plain steps cost 0.78, and drafting that lost 1-7% of plain's speed ran on)."""
        return self._plain()[0]

    def _plain(self) -> tuple[float, float]:
        """(`plain`, its standard error: the decayed mean's, or the median's from the
        spread of the newest steps about it)."""
        ev = self.plain_ev
        if len(ev.recent) >= GUARD_MIN_PLAIN:
            median, error = ev.robust()
            if median < ev.per_token:
                return median, error
        return ev.per_token, ev.error

    @property
    def spec(self) -> float:
        """Seconds per emitted token of the drafting steps (recent ones weigh more)."""
        return self.spec_ev.per_token

    @property
    def plain_steps(self) -> int:
        return self.plain_ev.steps

    @property
    def spec_steps(self) -> int:
        return self.spec_ev.steps

    def losing(self) -> bool:
        """Whether drafting's cost a token is over plain's by more than MARGIN, and by
        more than GUARD_Z standard errors of the two: drafting steps emit one token or
        several, so at a few rows their cost a token swings by half, and a verdict on a
        swing stood for hundreds of steps (measured at 1 demo row: 1 process in 3 ran the
        draft model on ~6% of its steps, 1.08-1.14x plain where K = 2 ran 1.13-1.23x)."""
        plain, plain_error = self._plain()
        return self._clear(self.spec - plain * (1 + MARGIN), plain_error)

    def winning(self) -> bool:
        """Whether drafting's cost a token is under plain's by more than MARGIN, and by
        more than GUARD_Z standard errors of the two (`losing`, the other way)."""
        plain, plain_error = self._plain()
        return self._clear(plain - self.spec * (1 + MARGIN), plain_error)

    def _clear(self, gap: float, plain_error: float) -> bool:
        """Whether a gap in seconds a token (past MARGIN) is positive and over GUARD_Z
        standard errors of the two sides."""
        return gap > 0 and gap > GUARD_Z * math.hypot(self.spec_ev.error, plain_error)

    def speculation_won(self, now: int) -> bool:
        """Whether drafting has measurably cost less per token than plain decoding here,
        on drafting steps of the last PLAIN_MAX steps: what was measured outranks a cost
        model that says otherwise (its prices are timings of other moments and shapes;
        measured at 4 demo rows: K = 1 priced 14.2-15.1 ms where its steps ran 9.9-13.9,
        and a process in 9 decoded plain for good at 0.90 of K = 1's speed)."""
        return now - self.spec_ev.last <= PLAIN_MAX and self._judged() and self.winning()

    def speculation_lost(self, now: int) -> bool:
        """Whether drafting has measurably cost more per token than plain decoding here,
        on evidence recent enough to stand (see the module docstring)."""
        if not self._judged() or not self.losing():
            return False
        if now - self.spec_ev.last > self.hold:
            self.lapsed = True
            return False
        return True

    def plain_due(self) -> bool:
        """Whether a step that would draft here should run plain instead, to keep the
        plain side of the evidence live; asking counts as the check (one per interval,
        each interval twice the last, up to PLAIN_MAX, in steps at this class). Before
        any plain step here, every step is one (each step here ticks `ticks`)."""
        if self.plain_ev.steps:
            if self.ticks - max(self.plain_tick, self.plain_asked) < self.plain_interval:
                return False
            self.plain_interval = min(self.plain_interval * 2, PLAIN_MAX)
        elif self.plain_asked == self.ticks:
            return False
        self.plain_asked = self.ticks
        return True
