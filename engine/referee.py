"""The stretch referee of greedy "auto": where the cost model finds drafting and plain
decoding close, which of the two runs is settled by what each realized over whole
stretches of steps, timed in alternation.

The cost model prices one step; a job's speed also holds what no step's price does: rows
that finish apart join apart, and one row's prefill costs more than its share of a wave's
(measured at 4 demo rows: one 48-token prompt 9.6 ms, four together 33 ms); the thin
tail where slots run dry; slow steps, more of them the deeper the drafts. At 4 demo rows
these are as large as drafting's gain on a full step (5-9%), and which side wins moved
from process to process and day to day: "auto" settled plain where K = 2 ran 1.04x
plain, and drafted at 0.92x of plain where plain won.

So at a batch-size class where the priced best K and plain decoding are within
REFEREE_BAND of each other, steps run in stretches of REFEREE_STRETCH steps, each either
"draft" (the controller's K, or its best priced K where it chose none) or "plain" (K = 0,
no probe). A stretch's speed is its emitted tokens over its seconds, joins and prefill
included; its first step is left out (a drafting stretch's first step reads the draft
model's backlog of the plain stretch before it: a cost of alternating, not of drafting).
Each "draft" stretch next to a "plain" one gives one log ratio of their speeds; the mean of
the newest REFEREE_PAIRS ratios names the winner once REFEREE_MIN_PAIRS are in. The winner
then runs as many stretches as keep the loser's cost near REFEREE_COST of the time (the
loser runs one stretch per round, so a close race is re-run often and a clear one seldom),
and the ratio each round adds keeps the verdict live.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from .policy import (
    REFEREE_CLEAR,
    REFEREE_COST,
    REFEREE_MIN_PAIRS,
    REFEREE_PAIRS,
    REFEREE_RUN_MAX,
    REFEREE_STRETCH,
)

DRAFT, PLAIN = "draft", "plain"


@dataclass
class Referee:
    """The race between drafting and plain decoding at one batch-size class."""

    arm: str = DRAFT  # the arm of the stretch in progress
    left: int = REFEREE_STRETCH  # its steps still to run
    seconds: float = 0.0  # its timed steps' seconds and emitted tokens (its first is not)
    tokens: int = 0
    fresh: bool = True  # its first step is still to come
    unpaired: tuple | None = None  # (arm, speed) of the last stretch no ratio holds yet
    ratios: deque = field(default_factory=lambda: deque(maxlen=REFEREE_PAIRS))
    plan: deque = field(default_factory=deque)  # arms of the stretches to come
    heard: int = 0  # steps heard

    def observe(self, seconds: float, tokens: int, joined: bool = False) -> None:
        """One step of the stretch in progress ran: `seconds` from its start to its end,
        `tokens` emitted; `joined`: rows joined on it (it is not timed)."""
        self.heard += 1
        if self.fresh:
            self.fresh = False
        elif not joined:
            self.seconds += seconds
            self.tokens += tokens
        self.left -= 1
        if self.left <= 0:
            self._close()

    def verdict(self) -> float | None:
        """Mean log(drafting's speed / plain's) over the newest pairs; None until
        REFEREE_MIN_PAIRS are in, unless the first is as clear as REFEREE_CLEAR."""
        n = len(self.ratios)
        if n == 0 or (n < REFEREE_MIN_PAIRS and abs(self.ratios[0]) < REFEREE_CLEAR):
            return None
        return statistics.fmean(self.ratios)

    def _close(self) -> None:
        if self.seconds > 0 and self.tokens > 0:
            speed = self.tokens / self.seconds
            if self.unpaired is not None and self.unpaired[0] != self.arm:
                draft, plain = (speed, self.unpaired[1])
                if self.arm == PLAIN:
                    draft, plain = plain, draft
                self.ratios.append(math.log(draft / plain))
                self.unpaired = None
            else:
                self.unpaired = (self.arm, speed)
        if not self.plan:
            self.plan.extend(self._round())
        self.arm = self.plan.popleft()
        self.left, self.seconds, self.tokens, self.fresh = REFEREE_STRETCH, 0.0, 0, True

    def _round(self) -> list[str]:
        """The arms of the next stretches: alternation until a verdict, then the winner
        for as long as keeps the loser's share of the cost near REFEREE_COST, and the
        loser once."""
        mean = self.verdict()
        if mean is None:
            return [PLAIN if self.arm == DRAFT else DRAFT]
        winner, loser = (DRAFT, PLAIN) if mean >= 0 else (PLAIN, DRAFT)
        run = min(max(math.ceil(abs(mean) / REFEREE_COST) - 1, 1), REFEREE_RUN_MAX)
        return [winner] * run + [loser]
