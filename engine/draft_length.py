"""How many tokens a step drafts ("auto"): one small policy, pure Python, no MLX.

The contract, both ways:
  * in, after every step: one `StepRecord`: the batch size, the K each row drafted, how
    many of its drafts passed, the step's seconds, whether the drafts were free (prompt
    lookup, no draft-model pass) and whether the step is a fair sample of a step's cost;
  * out, before a step: `decide(rows, free)`, the K the step's greedy "auto" rows draft
    (0: a plain step). `keep_drafting` answers, between the draft model's passes, whether
    one more draft pays (early stopping, at the batch sizes `stops_early` names).
The decoder is handed the policy (`ModelPair.policy`), and reads nothing else back.

Why a K. Per batch-size class (rows 1, 2, 3-4, 5-8, ...) the policy keeps a cost model:
the plain step's seconds, the drafting step's seconds against K (a decayed least-squares
line), and, for the pair, the acceptance at each draft position given that the ones before
passed. A step of K drafts is expected to emit E(K) = 1 + a1 + a1*a2 + ... tokens a row,
so its speed is E(K) / T(K) tokens a row-second; plain's is 1 / T(0). The model's choice
K* is the fastest, and 0 unless drafting is predicted faster than plain by `margin`.

A model is only as good as its inputs (a step's price misses rows parting; a Mac's costs
are not a CPU's; a cost need not be a line in K: at 4 rows of the widened pair K = 2 cost
more than K = 3), so a safety net plays realized speeds. Among 0, K*-1, K*, K*+1 and, for
model drafts, its own last choice and K*+2 (where K* drafts; an arm past K* heard fewer
than `trust` times is priced as K*, so it is heard before it is judged; a free draft's
arm is the length its proposal had, rarely a deep one), it plays the one with the most
measured tokens a row-second (an arm heard fewer than `trust` times priced by the model),
and every 1/explore steps (2/explore while those confirm its choice) the arm heard least
recently. Drafting that loses to plain is stopped by measurement.

Early stopping. The draft model's confidence in its token (its probability) predicts
whether the target will accept it. Acceptance is also counted by confidence, and after
each draft pass the policy drafts one more token only while the expected tokens that token
adds, per second it adds to the step, beat the step's expected speed so far. Single
rows only, by default (`early_stop_rows`): a batch shares its passes, so it stops only
where the rows' summed confidence says so, and each check costs a host sync.

Sampled rows do not take the batch's K: their output depends on where drafts were, so
each follows its own `SampledSchedule`, which depends on its own history only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PolicyConfig:
    """Every knob of the policy, each with what it trades."""

    #: Longest draft "auto" takes from the draft model: deeper drafts can pay at high
    #: acceptance, but every position widens the verify pass.
    max_k: int = 8
    #: Acceptance per position assumed before the pair's drafts are heard, and its weight
    #: in drafts: a higher prior drafts sooner on a new pair, and a heavier one learns slower.
    prior_acceptance: float = 0.6
    prior_weight: float = 4.0
    #: Weight an old observation keeps per new one (acceptance, timings, realized speeds):
    #: nearer 1 is steadier under noise, lower follows a change of text or load sooner.
    decay: float = 0.95
    #: Predicted gain drafting must show over plain before the model picks it: guards
    #: against a model that over-rates drafting, at the price of marginal wins.
    margin: float = 0.03
    #: Share of steps played on the arm heard least recently (half of it while those plays
    #: confirm the choice): keeps every arm's realized speed live (a change is noticed),
    #: at the price of that share of steps off the best.
    explore: float = 0.02
    #: Plays of an arm before its realized speed, not the model's prediction, scores it:
    #: fewer reacts sooner, more trusts one noisy step less.
    trust: int = 3
    #: Largest batch whose draft stops a block early where its confidence predicts a
    #: rejection (0: never): each check is a host sync per draft pass; on the widened pair
    #: "auto" read +2% with it at 1 row, -11% at 4 rows (`lockstep.py`, 2026-12-07).
    early_stop_rows: int = 1


def expected_tokens(rates: list[float], k: int) -> float:
    """Tokens one step of k drafts emits a row, where rates[i] is the acceptance of draft
    i + 1 given the drafts before it passed (one when none passes: the target's own)."""
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= rates[min(i, len(rates) - 1)]
        total += reach
    return total


def size_class(rows: int) -> int:
    """The batch-size class: 1, 2, 4, 8, ... (rows rounded up to a power of two)."""
    return 1 << max(rows - 1, 0).bit_length()


def clipped(sample: float, current: float) -> float:
    """A timing as far as twice off `current` at most: a load burst moves a price as if it
    were twice off, and a persistent change is still followed within a few samples."""
    return min(max(sample, current / 2), current * 2)


@dataclass
class Line:
    """Seconds against K by least squares, each sample decaying the older by `decay`."""

    decay: float
    w: float = 0.0
    k: float = 0.0
    kk: float = 0.0
    t: float = 0.0
    kt: float = 0.0
    ks: dict = field(default_factory=dict)  # K -> decayed samples

    def add(self, k: int, seconds: float) -> None:
        now = self(k) if self.ready() else 0.0
        if now > 0:
            seconds = clipped(seconds, now)
        d = self.decay
        self.w, self.k, self.kk = self.w * d + 1, self.k * d + k, self.kk * d + k * k
        self.t, self.kt = self.t * d + seconds, self.kt * d + k * seconds
        for key in self.ks:
            self.ks[key] *= d
        self.ks[k] = self.ks.get(k, 0.0) + 1.0

    def ready(self) -> bool:
        """Two Ks heard: the slope is measured (a K heard long ago still holds the slope,
        at its decayed weight; the level follows the Ks heard now)."""
        return len(self.ks) >= 2

    def __call__(self, k: int) -> float:
        spread = self.kk * self.w - self.k * self.k
        slope = max((self.kt * self.w - self.k * self.t) / spread, 0.0) if spread > 1e-9 else 0.0
        return (self.t - slope * self.k) / self.w + slope * k


@dataclass
class Rate:
    """A decayed success rate with a prior of `weight` trials that decays with them (a
    fixed one floored it: a random draft stayed at 0.1 and was drafted at 0.72x plain)."""

    prior: float
    weight: float
    decay: float
    hits: float = 0.0
    trials: float = 0.0

    def add(self, hit: bool) -> None:
        self.hits = self.hits * self.decay + hit
        self.trials = self.trials * self.decay + 1.0
        self.weight *= self.decay

    def value(self, prior: float | None = None) -> float:
        p = self.prior if prior is None else prior
        return (self.hits + self.weight * p) / (self.trials + self.weight)


@dataclass
class Arm:
    """Realized seconds of a step of one K at one batch-size class."""

    seconds: float = 0.0
    plays: float = 0.0
    last: int = -1  # step count when it last played


@dataclass
class Probe:
    """Forced plays of one (class, free, source), every `every` steps: from `base` (1/explore)
    up to twice it while they leave the net's choice as it was (a play wakes draft caches)."""

    base: int
    every: int
    due: int = 0  # the step count of the next forced play
    asked: int | None = None  # the step count of a forced play not yet followed by a choice
    choice: int | None = None  # the net's last choice

    def answer(self, choice: int) -> int:
        if self.asked is not None:
            self.every = min(self.every * 2, 2 * self.base) if choice == self.choice else self.base
            self.due, self.asked = self.asked + self.every, None
        self.choice = choice
        return choice


@dataclass
class StepRecord:
    """One finished step, as the decoder tells it. Per row i: `k[i]` drafts (however many
    passed), `judged[i]` positions of its proposal the target judged (k[i] unless given; one
    more for a free proposal longer than its draft), `accepted[i]` how many of them passed,
    `sources[i]` "model", "lookup" or "lookup-copying" (`batch.lookup_source`), and
    `confidence[i]` the draft model's probability of each draft (greedy model rows of a step
    that stopped early; else empty). `clean`: the seconds are a fair sample of a step's cost
    (False where it admitted rows: their prefill ran)."""

    rows: int
    k: list[int]
    accepted: list[int]
    seconds: float
    free: bool = False
    clean: bool = True
    sources: list[str] = field(default_factory=list)  # per row
    confidence: list[list[float]] = field(default_factory=list)
    auto: bool = True  # the drafting rows are "auto" rows (a fixed K is no evidence of auto)
    cap: int | None = None  # the K decided, where the draft stopped before it (else max(k))
    joined: int = 0  # rows the step admitted (then not clean: their prefill ran in it)
    judged: list[int] = field(default_factory=list)  # per row; empty: k


#: Confidence buckets: acceptance is counted by the draft's probability in tenths.
BUCKETS = 10


class DraftLengthPolicy:
    """The draft length of one pair's steps (see the module docstring)."""

    def __init__(self, config: PolicyConfig | None = None):
        self.config = c = config or PolicyConfig()
        self.positions: dict[str, list[Rate]] = {}  # source -> acceptance by position
        self.by_confidence = [
            Rate(c.prior_acceptance, c.prior_weight, c.decay) for _ in range(BUCKETS)
        ]
        self.plain: dict[int, float] = {}  # class -> plain step seconds (decayed mean)
        self.lines: dict[tuple, Line] = {}  # (class, free) -> drafting seconds against K
        self.arms: dict[tuple, Arm] = {}  # (class, free, K) -> realized speed
        self.probes: dict[tuple, Probe] = {}  # (class, free, source) -> forced plays
        self.steps = 0
        self._rates: dict = {}  # source -> rates(source), until its next draft is heard
        self.shapes: set = set()  # (rows, free, depth) heard once: later ones are prices
        # Seconds a step that admitted rows spent beyond its own price, against the rows
        # it admitted: the intercept is what one join costs however few rows it brings.
        self.joins = Line(c.decay)
        self.join_rate = 0.0  # share of steps that admitted rows (decayed)
        self._explore_every = max(int(round(1 / c.explore)), 2) if c.explore > 0 else 0

    # -- the model -------------------------------------------------------------------
    def rates(self, source: str = "model") -> list[float]:
        """Acceptance at each draft position 1..max_k given the ones before passed; a
        position with little evidence leans on the one before it."""
        if source in self._rates:  # (kept until a draft of that source is heard)
            return self._rates[source]
        out, prior = [], self.config.prior_acceptance
        for rate in self._positions(source):
            out.append(prior := rate.value(prior))
        self._rates[source] = out
        return out

    def _positions(self, source: str) -> list[Rate]:
        if source not in self.positions:
            c = self.config
            self.positions[source] = [
                Rate(c.prior_acceptance, c.prior_weight, c.decay) for _ in range(max(c.max_k, 16))
            ]
        return self.positions[source]

    def seconds(self, rows: int, k: int, free: bool = False) -> float | None:
        """Predicted seconds of a step of `rows` rows drafting k (None: nothing measured)."""
        plain, drafting = self.prices(rows, free)
        return plain if k == 0 else drafting(k) if drafting is not None else None

    def prices(self, rows: int, free: bool = False):
        """(plain step seconds or None, seconds against K or None) at this batch size. A
        class with nothing measured borrows the nearest measured class's line, scaled by
        the two classes' plain steps."""
        cls = size_class(rows)
        plain = self._plain(cls)
        line = self.lines.get((cls, free))
        if line is not None and line.ready():
            return plain, line
        for other in sorted(self.lines, key=lambda key: abs(math.log2(key[0] / cls))):
            theirs = self.lines[other]
            if other[1] == free and theirs.ready():
                base = self._plain(other[0])
                scale = plain / base if plain and base else cls / other[0]
                return plain, lambda k, line=theirs, scale=scale: line(k) * scale
        return plain, None

    def _plain(self, cls: int) -> float | None:
        if cls in self.plain:
            return self.plain[cls]
        near = sorted(self.plain, key=lambda o: abs(math.log2(o / cls)))
        return self.plain[near[0]] * (cls / near[0]) ** 0.5 if near else None

    def model_k(
        self,
        rows: int,
        cap: int,
        free: bool = False,
        source: str = "model",
        together: int = 0,
        left: float = 0.0,
    ) -> int:
        """The cost model's K: the fastest predicted, 0 unless it beats plain by `margin`.
        Until both sides are priced at this class it measures them: a plain step first,
        then K = 2 and K = 1 (two points of the line)."""
        cap = min(cap, self.config.max_k)
        plain, drafting = self.prices(rows, free)
        if cap <= 0 or plain is None:
            return 0
        if drafting is None:
            heard = self.lines.get((size_class(rows), free), Line(self.config.decay)).ks
            return min((min(2, cap), 1), key=lambda k: heard.get(k, 0.0))
        join = self.join_seconds()
        best, best_speed = 0, (1 + self.config.margin) / plain
        tokens, reach = 1.0, 1.0
        for k, rate in enumerate(self.rates(source)[:cap], start=1):
            reach *= rate
            tokens += reach
            speed = tokens / (drafting(k) + self.parting(k, tokens, together, left, join))
            if speed > best_speed:
                best, best_speed = k, speed
        return best

    # -- the decision -----------------------------------------------------------------
    def join_seconds(self) -> float:
        """What one join of rows costs beyond their prefill: the intercept of the joins'
        line, 0 until joins of two sizes are heard (one size cannot tell it from the rows'
        own prefill: at 4 demo rows that read 10-15 ms a join, the intercept 3-5)."""
        return max(self.joins(0), 0.0) if self.joins.ready() else 0.0

    def parting(self, k: int, tokens: float, together: int, left: float, join: float) -> float:
        """Seconds a step of k drafts adds by parting rows that plain decoding finishes on
        a shared step (`together`: the joins that saves; `left`: those rows' mean tokens
        to go): each row then leaves, and its successor joins, on a step of its own, a
        join more each, spread over the steps drafting takes to finish them (`join`:
        `join_seconds()`)."""
        if k == 0 or together < 1 or left <= 0:
            return 0.0
        # Where rows join on most steps anyway (a refilling batch), a parted row's
        # successor mostly joins beside another's: only the rest is a join more.
        return together * join * tokens / left * (1.0 - self.join_rate)

    def decide(
        self,
        rows: int,
        cap: int,
        free: bool = False,
        source: str = "model",
        together: int = 0,
        left: float = 0.0,
    ) -> int:
        """The K this step's greedy "auto" rows draft (at most `cap`), 0 for plain.
        `together`, `left`: the joins plain decoding saves by finishing rows that share
        their tokens left on one step, and those rows' mean tokens left; drafting parts
        them (`parting`)."""
        star, cls = self.model_k(rows, cap, free, source, together, left), size_class(rows)
        top, every = min(cap, self.config.max_k), self._explore_every
        probe = self.probes.setdefault((cls, free, source), Probe(every, every, every))
        arms = {0, star, max(star - 1, 0), min(star + 1, top)}
        if not free:  # (see the module docstring)
            arms |= {min(probe.choice or 0, top), min(star + 2, top) if star else 0}
        arms = sorted(arms)
        if every and self.steps >= probe.due:
            probe.asked, probe.due = self.steps, self.steps + probe.every
            # Rows in step are parted by any drafting play: then only plain is re-heard.
            heard = arms if together < 1 else [0]
            return min(heard, key=lambda k: self.arms.get((cls, free, k), Arm()).last)
        return probe.answer(self._net(star, arms, cls, rows, free, source, together, left))

    def _net(self, star, arms, cls, rows, free, source, together, left) -> int:
        """The safety net's pick among `arms` (`star`: the model's K)."""
        trust, decay = self.config.trust, self.config.decay
        rates, join = self.rates(source), self.join_seconds()
        plain, drafting = self.prices(rows, free)

        def price(k: int) -> float | None:
            # Realized seconds, fading into the line's price as they age (no measurement of
            # now once the load or context moved); see the module docstring for arms past K*.
            arm, line = self.arms.get((cls, free, k)), plain if not k else drafting and drafting(k)
            if arm is None or arm.plays < trust:
                return price(star) if 0 < star < k and not free else line
            fresh = decay ** (self.steps - arm.last) if line is not None else 1.0
            return fresh * arm.seconds + (1 - fresh) * (line or 0.0)

        def score(k: int) -> float:
            # Expected tokens (a realized count is too noisy to tell Ks apart) over the price.
            seconds, tokens = price(k), expected_tokens(rates, k)
            if seconds is None:
                return -1.0
            return tokens / (seconds + self.parting(k, tokens, together, left, join))

        if self.arms.get((cls, free, star), Arm()).plays < trust:
            return star  # the model's choice is heard before the net judges it
        return max(arms, key=score)

    def keep_drafting(self, rows: int, cap: int, confidence: list[list[float]]) -> bool:
        """Between draft passes: whether the rows (each with the draft model's probability
        of every draft so far, all the same depth j) draft token j + 1. It pays while the
        expected tokens it adds per second it adds beat the step's expected speed so far."""
        j = len(confidence[0]) if confidence else 0
        if not self.stops_early(rows) or j >= cap:
            return j < cap
        t_now, t_next = self.seconds(rows, j), self.seconds(rows, j + 1)
        if t_now is None or t_next is None or t_next <= t_now:
            return True
        rates = self.rates()
        tokens = gain = 0.0
        for probs in confidence:
            reach = 1.0
            tokens += 1.0
            for p in probs:
                reach *= self.by_confidence[self._bucket(p)].value(rates[0])
                tokens += reach
            gain += reach * rates[min(j, len(rates) - 1)]
        return gain / (t_next - t_now) > tokens / t_now

    def stops_early(self, rows: int) -> bool:
        """Whether a step of `rows` rows checks, between draft passes, `keep_drafting`."""
        return rows <= self.config.early_stop_rows

    @staticmethod
    def _bucket(p: float) -> int:
        return min(int(p * BUCKETS), BUCKETS - 1)

    # -- hearing a step ---------------------------------------------------------------
    def observe(self, step: StepRecord) -> None:
        """Fold one finished step into acceptance, costs and realized speeds."""
        self.steps += 1
        sources = step.sources or ["model"] * len(step.k)
        judged = step.judged or step.k
        for k, n, source in zip(judged, step.accepted, sources, strict=True):
            if k:
                self._rates.pop(source, None)
            table = self._positions(source)  # positions reached: the passed, the first miss
            for i in range(min(k, n + 1)):
                table[i].add(i < n)
        for probs, n in zip(step.confidence, step.accepted, strict=False):
            for i, p in enumerate(probs[: n + 1]):
                self.by_confidence[self._bucket(p)].add(i < n)
        cls, d, depth = size_class(step.rows), self.config.decay, max(step.k, default=0)
        self.join_rate = self.join_rate * d + (1 - d) * (step.joined > 0)
        if step.joined and step.seconds > 0:
            own = self.seconds(step.rows, depth, step.free)
            if own is not None:
                self.joins.add(step.joined, max(step.seconds - own, 0.0))
        if not step.clean or not step.auto or step.rows == 0 or step.seconds <= 0:
            return
        shape = (step.rows, step.free, depth)
        if shape not in self.shapes:  # a shape's first pass in a process runs slow
            self.shapes.add(shape)
            return
        if depth == 0:
            old = self.plain.get(cls)
            self.plain[cls] = step.seconds if old is None else old * d + step.seconds * (1 - d)
        else:
            self.lines.setdefault((cls, step.free), Line(d)).add(depth, step.seconds)
        decided = depth if step.cap is None else step.cap
        arm = self.arms.setdefault((cls, step.free, decided), Arm())
        t = step.seconds if arm.plays == 0 else clipped(step.seconds, arm.seconds)
        arm.seconds = t if arm.plays == 0 else arm.seconds * d + t * (1 - d)
        arm.plays, arm.last = arm.plays + 1, self.steps


class SampledSchedule:
    """A sampled "auto" row's draft lengths: a function of its own drafts' fate only, so
    its output (which depends on where drafts were) is the same in any batch. A static
    cost per draft (`draft_cost`, the drafter's pass over the target's, and
    `verify_cost`, a verify position over a decode step, both declared, not measured) and
    its own decayed acceptance pick K; at K = 0 it drafts one token every `wait` steps to
    keep hearing, the wait doubling on each miss up to 256."""

    def __init__(self, config: PolicyConfig, draft_cost: float, verify_cost: float, block: bool):
        self.config = config
        self.rate = Rate(config.prior_acceptance, config.prior_weight, config.decay)
        self.draft_cost, self.verify_cost, self.block = draft_cost, verify_cost, block
        self.wait, self.idle, self.probing = 8, 0, False

    def choose(self, cap: int) -> int:
        a = self.rate.value()

        def speed(k: int) -> float:
            passes = (1 if k else 0) if self.block else k
            return expected_tokens([a], k) / (1 + passes * self.draft_cost + k * self.verify_cost)

        k = max(range(min(cap, self.config.max_k) + 1), key=speed)
        self.probing = False
        if k == 0 and cap > 0:
            self.idle += 1
            if self.idle >= self.wait:
                self.idle, self.probing = 0, True
                return 1
        return k

    def observe(self, proposed: int, accepted: int) -> None:
        for i in range(min(proposed, accepted + 1)):
            self.rate.add(i < accepted)
        if self.probing:
            self.wait = 8 if accepted == proposed else min(self.wait * 2, 256)
