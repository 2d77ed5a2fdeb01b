"""Choosing how many tokens to draft ("auto"), from acceptance and measured costs.

With per-token acceptance a and K draft tokens, one verify step emits on average
E(K) = (1 - a^(K+1)) / (1 - a) tokens. A step over a batch of b rows costs one
target pass over b * (K + 1) positions (inputs are padded to the widest row) plus
K draft passes over the rows the draft model drafts for. `choose_batch_k` picks the
K with the most expected tokens per second for the whole batch, K = 0 (plain
decoding) unless speculation beats it by a margin, and never probes a shape where
even perfect acceptance could not pay (a saturated device: batching and speculation
compete for the same compute).

Pass costs are a curve of seconds against positions per pass, measured once per
model at start-up (`measure_pass_costs`) and rescaled as a whole by live timings,
so a load burst slows every K alike and no K is shunned for good; batch sizes in
between measured points are interpolated. Each (rows, width) shape that runs keeps
its own factor over the curve, and a plain step of a few batch sizes is timed at
start-up too (`measure_batch_steps`), so plain decoding is priced from a measured
batch pass where "auto" has only drafted so far. A step's price also holds what a
step of its kind (drafting or plain) spends outside its passes, per batch-size
class (`observe_overhead`). A step that admitted rows prices nothing: it also ran
their prefill and the copy that joined them.

Greedy requests use these live costs: their output cannot depend on K. Sampled
requests follow a static, per-request schedule (`DraftPlan`) fixed by the pair and
the device, so the output for a given seed depends only on the request itself.

The tuning constants are engine/policy.py's, each with a line on what it does; the
policy there asks `choose_batch_k` for the greedy rows' length and `DraftPlan.choose`
for a sampled row's.
"""

from __future__ import annotations

import bisect
import functools
import math
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from statistics import NormalDist

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from .families import make_ragged_cache
from .policy import (
    ANCHOR_MIN_TRIALS,
    ANCHOR_Z,
    BATCH_SIZES,
    DECAY,
    DEPTH_MARGIN,
    EMA,
    EXPLORE_EVERY,
    EXPLORE_GAP,
    FIT_DECAY,
    FIT_DEPTHS,
    FIT_WEIGHT,
    FREE_SLACK,
    GUARD_MEDIAN_OF,
    HELD_MAX,
    HELD_STEPS,
    LIVE_EMA,
    LOOKUP_ANCHOR,
    LOOKUP_MAX_DRAFT,
    MARGIN,
    MAX_AUTO_DRAFT,
    OUTLIER,
    PASS_SIZES,
    PLAIN_SETTLE,
    PRICE_STEPS,
    PRIOR_ACCEPTANCE,
    PRIOR_WEIGHT,
    PROBE_BUDGET,
    PROBE_FIRST,
    PROBE_MAX,
    RELATIVE_FRESH,
    ROW_ANCHOR,
    SETTLED_STEPS,
    SHAPE_EMA,
    SHARED_DECAY,
    UNTRIED_TRIALS,
    AutoRow,
    FixedRow,
    expected_tokens,
)
from .realized import Realized

# Acceptance of lookup drafts taken inside a model-drafted request (key in the controller).
HYBRID_LOOKUP = "model+lookup"


def _clip(sample: float, current: float) -> float:
    """A live sample, as far as OUTLIER times off the current value at most: one slow
    step (a shape's first pass in a process, a load burst) must not set a price for as
    long as nothing measures it again (measured: one warm-up step 4x slow priced
    drafting out at one row for good)."""
    return min(max(sample, current / OUTLIER), current * OUTLIER)


@dataclass
class DepthFit:
    """A step's draft and verify seconds against its depth, at one batch size whose rows
    all drafted by the draft model: a line by least squares over the steps of every
    depth, each step decaying the older by FIT_DECAY.

    Prices kept apart per shape (a depth's draft passes, a width's verify pass over the
    plain pass) moved a LIVE_EMA step a sample, at different moments of a noisy
    machine, and the best K was the one whose price was lowest by chance: measured at 4
    demo rows, K = 3 priced 9.97 ms where it ran 7.63 and K = 5 11.25 where it ran
    10.13; "auto" ran K = 5 on 98 steps of 275 and read 0.78-0.88 of plain where K = 2
    read 1.00-1.04. Every step measured tells the line, so each K's price is as good as
    all of them together, and seconds grow about linearly with depth (6.74, 7.63, 8.94,
    10.13, 11.98 ms at K = 2-6 there)."""

    weight: float = 0.0
    k: float = 0.0
    kk: float = 0.0
    t: float = 0.0
    kt: float = 0.0
    depths: dict = field(default_factory=dict)  # depth -> its decayed steps

    def add(self, depth: int, seconds: float) -> None:
        if self.ready():  # one slow step (a load burst) moves the line as far as OUTLIER
            seconds = _clip(seconds, self(depth))
        for name in ("weight", "k", "kk", "t", "kt"):
            setattr(self, name, getattr(self, name) * FIT_DECAY)
        for d in self.depths:
            self.depths[d] *= FIT_DECAY
        self.weight += 1.0
        self.k += depth
        self.kk += depth * depth
        self.t += seconds
        self.kt += depth * seconds
        self.depths[depth] = self.depths.get(depth, 0.0) + 1.0

    def ready(self) -> bool:
        return sum(w >= FIT_WEIGHT for w in self.depths.values()) >= FIT_DEPTHS

    def __call__(self, depth: int) -> float:
        spread = self.kk * self.weight - self.k * self.k
        slope = max((self.kt * self.weight - self.k * self.t) / spread, 0.0) if spread else 0.0
        return (self.t - slope * self.k) / self.weight + slope * depth


def _ema(table: dict, key, seconds: float, prior=None) -> None:
    """Move table[key] a LIVE_EMA step toward a live sample (clipped). A key not in the
    table starts from `prior()`, what it is priced at without it, if given; else the
    sample sets it."""
    old = table.get(key)
    if old is None and prior is not None:
        old = prior()
    table[key] = seconds if old is None else old + LIVE_EMA * (_clip(seconds, old) - old)


def _slope(by_depth: dict) -> float:
    """Least-squares slope of figures against depth (two depths or more), at least 0."""
    n = len(by_depth)
    mean_d = sum(by_depth) / n
    mean_f = sum(by_depth.values()) / n
    spread = sum((d - mean_d) ** 2 for d in by_depth)
    rise = sum((d - mean_d) * (f - mean_f) for d, f in by_depth.items())
    return max(rise / spread, 0.0)


@functools.lru_cache(maxsize=256)
def _normal_range(m: int) -> float:
    """Expected range of m standard normal samples (Blom's approximation of the
    largest, twice): 1.13 for 2, 2.06 for 4, 3.53 for 16, 4.12 for 32."""
    if m < 2:
        return 0.0
    return 2.0 * NormalDist().inv_cdf((m - 0.375) / (m + 0.25))


def finish_steps(rows: int, left: float, mean: float, variance: float) -> float:
    """About how many different steps `rows` rows in step, with `left` tokens each to
    go, finish on when each step emits `mean` tokens a row with this `variance`: 1 when
    every row emits the same count (plain decoding, or drafts always all accepted), up to
    `rows`. A row's steps to finish have a standard deviation of about
    sqrt(left * variance / mean**3) (renewal theory); the rows spread over the expected
    range of that many normal samples."""
    if rows < 2 or variance <= 0.0 or mean <= 0.0:
        return 1.0
    spread = math.sqrt(max(left, 1.0) * variance / mean**3)
    return min(float(rows), 1.0 + _normal_range(rows) * spread)


@functools.lru_cache(maxsize=4096)
def _row_tokens(a: float, cap: int, size: int) -> tuple[tuple, tuple, tuple]:
    """One row's tokens a step at K = 0 .. size - 1 (its drafts capped at `cap`), at
    acceptance `a`: expected, at perfect acceptance, and their variance. A row's
    acceptance is priced to 0.01 (`_rates`), so a few hundred of these serve a process:
    computed once each, not for every row group of every step."""
    expected, perfect, variance = [], [], []
    e, power = 1.0, a  # expected tokens at K = 0; a ** (K + 1)
    e2, pk = 1.0, 1.0  # E[tokens ** 2] at K = 0; a ** K
    for k in range(size):
        if 0 < k <= cap:
            power *= a
            e = k + 1.0 if a >= 1.0 else (1.0 - power) / (1.0 - a)
            pk *= a  # a draft more: the all-accepted chance a ** k moves up a token
            e2 += pk * (2 * k + 1)
        expected.append(e)
        perfect.append(min(k, cap) + 1.0)
        variance.append(max(e2 - e * e, 0.0))
    return tuple(expected), tuple(perfect), tuple(variance)


class PassCosts:
    """Seconds of one forward pass of a model over n positions (all rows together).

    A piecewise-linear curve through measured points (made non-decreasing: more
    positions never cost less), extrapolated linearly past the last, times a live
    scale factor that follows the machine's load, times a slower per-size
    correction learnt from the pass sizes that actually run, so a curve measured
    on a short context or under a load burst mends itself.
    """

    def __init__(self, points: dict[int, float]):
        self.sizes = sorted(points)
        self.seconds = []
        for s in self.sizes:
            self.seconds.append(max([points[s], *self.seconds[-1:]]))
        self.scale = 1.0
        self.seen = False  # the first measurement sets the scale (it may change units)
        self.correction: dict[int, float] = {}

    def _curve(self, n: int) -> float:
        s, t = self.sizes, self.seconds
        if len(s) == 1:
            return t[0] * max(n, 1) / s[0]
        i = bisect.bisect_left(s, n)
        if i < len(s) and s[i] == n:
            return t[i]
        lo, hi = (i - 1, i) if 0 < i < len(s) else ((0, 1) if i == 0 else (-2, -1))
        slope = (t[hi] - t[lo]) / (s[hi] - s[lo])
        return max(t[lo] + slope * (n - s[lo]), 1e-9)

    def __call__(self, n: int) -> float:
        return self._curve(n) * self.correction.get(n, 1.0) * self.scale

    def observe(self, n: int, seconds: float) -> None:
        """Fold one measured pass (or the mean of several) into the live factors."""
        curve = self._curve(n) * self.correction.get(n, 1.0)
        if curve <= 0 or seconds <= 0:
            return
        if not self.seen:
            self.seen, self.scale = True, seconds / curve
        else:
            self.scale += EMA * (_clip(seconds / curve, self.scale) - self.scale)
        # What the load factor does not explain belongs to this size.
        c = self.correction.get(n, 1.0)
        self.correction[n] = c + SHAPE_EMA * (_clip(seconds / (self._curve(n) * self.scale), c) - c)


def static_pass_costs(per_position: float) -> PassCosts:
    """A deterministic curve in decode-step units: 1 + per_position * (n - 1)."""
    return PassCosts({1: 1.0, 512: 1.0 + per_position * 511})


def measure_pass_costs(model, sizes=PASS_SIZES, reps: int = 2, context: int = 32) -> PassCosts:
    """Time a forward pass over n positions (one row) after a short context."""
    ctx = mx.array([[1] * context])
    points = {}
    for n in sizes:
        cache = make_prompt_cache(model)
        mx.eval(model(ctx, cache=cache))
        best = float("inf")
        for _ in range(reps + 1):  # the first pass warms up kernels
            t0 = time.perf_counter()
            mx.eval(model(mx.array([[1] * n]), cache=cache))
            best = min(best, time.perf_counter() - t0)
            trim_prompt_cache(cache, n)
        points[n] = best
    return PassCosts(points)


def measure_batch_steps(model, curve: PassCosts, sizes=BATCH_SIZES, reps: int = 2) -> dict:
    """{(b, 1): factor}: a plain decode step over b rows (one position each, after a
    short context, in the decoder's own ragged cache), timed, over the one-row curve's
    value at b positions. b rows of one position cost more than one row of b positions
    (b contexts to attend, b masks): without this, plain decoding at a batch size where
    "auto" has only drafted so far would be priced by the curve alone."""
    factors = {}
    for b in sizes:
        rows, cache = make_ragged_cache(model, b)
        model(mx.array([[1] * 32] * b), cache=cache)
        rows.advance(32, [32] * b)
        rows.evaluate()
        best = float("inf")
        for _ in range(reps + 1):  # the first pass warms up kernels
            t0 = time.perf_counter()
            mx.eval(model(mx.array([[1]] * b), cache=cache))
            best = min(best, time.perf_counter() - t0)
            rows.advance(1, [1] * b)
        factors[(b, 1)] = best / curve._curve(b)
    return factors


def measure_block_costs(drafter, target, sizes=(1, 2, 4, 8, 16, 32), reps: int = 2) -> PassCosts:
    """Time one block drafter pass for b rows, each with a short context of features."""
    with drafter.capture(target) as cap:
        target(mx.array([[1] * 32]), cache=make_prompt_cache(target))
        features = cap.features
    points = {}
    for b in sizes:
        state = drafter.new_state(b)
        state.extend(mx.broadcast_to(features, (b, *features.shape[1:])), [32] * b)
        best = float("inf")
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            mx.eval(drafter.greedy_block(state, [1] * b))
            best = min(best, time.perf_counter() - t0)
        points[b] = best
    return PassCosts(points)


@dataclass
class CostModel:
    """Per-request costs in decode-step units: a draft step, and verify(k) for k drafts."""

    draft_step: float
    verify: list[float]

    def step_cost(self, k: int, drafts_cost: bool = True) -> float:
        v = self.verify[min(k, len(self.verify) - 1)]
        return v + (k * self.draft_step if drafts_cost else 0.0)

    def best_k(self, a: float, k_max: int, drafts_cost: bool = True) -> int:
        """The K in 0..k_max with the most expected tokens per second."""
        rates = [expected_tokens(a, k) / self.step_cost(k, drafts_cost) for k in range(k_max + 1)]
        return max(range(k_max + 1), key=lambda k: (rates[k], -k))


def static_costs(target_params: int, draft_params: int, on_gpu: bool) -> CostModel:
    """A deterministic per-request cost model from sizes and device kind.

    Verifying k extra tokens is nearly free on a GPU and costs ~0.25 of a decode
    step each on a CPU (measured: see NOTES.md); a draft step costs its share of
    parameters, with a floor for per-pass overhead.
    """
    per_token = 0.03 if on_gpu else 0.25
    ratio = max(draft_params / max(target_params, 1), 0.05)
    return CostModel(ratio, [1.0 + per_token * k for k in range(LOOKUP_MAX_DRAFT + 1)])


@dataclass
class Acceptance:
    """Per-token acceptance from (proposed, accepted) counts, decayed over steps."""

    successes: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    trials: float = PRIOR_WEIGHT
    decay: float = DECAY  # per observation; a pair's prior keeps more (SHARED_DECAY)
    # The pair's acceptance, weighing `anchor_weight` trials in the rate, always.
    anchor: Acceptance | None = None
    anchor_weight: float = 0.0

    @property
    def rate(self) -> float:
        if self.anchor is not None:
            # An anchor weighs no more than the trials it has heard: a pair that has heard
            # few drafts (its prior alone) must not hold its rows at that prior.
            w = min(self.anchor_weight, self.anchor.trials)
            pair = self.anchor.rate
            if self.trials >= ANCHOR_MIN_TRIALS:
                p = min(max(pair, 0.1), 0.9)
                gap = self.successes / self.trials - pair
                if gap * gap * self.trials > ANCHOR_Z * ANCHOR_Z * p * (1.0 - p):
                    # Its own drafts clearly disagree: this request is unlike the pair's.
                    w = min(w, PRIOR_WEIGHT)
            return (self.successes + w * pair) / (self.trials + w)
        return self.successes / self.trials if self.trials else PRIOR_ACCEPTANCE

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        # Accepted tokens are successes; the first rejection (if any) one failure.
        self.successes = self.successes * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + (1 if accepted < proposed else 0)


@dataclass
class DraftPlan:
    """One request's acceptance, and for sampled requests its own fixed schedule.

    Greedy rows are scheduled by the batch (`choose_batch_k`); a sampled row calls
    `choose()` before a step, which depends only on its own history, and `observe()`
    after.
    """

    costs: CostModel
    acceptance: Acceptance
    k_max: int
    drafter: str
    shared: Acceptance | None
    steps_since_probe: int = 0
    probe_interval: int = PROBE_FIRST
    probing: bool = False
    lookup: DraftPlan | None = None  # free drafts from repeated text (greedy "model" only)

    def choose(self) -> int:
        k = self.costs.best_k(self.acceptance.rate, self.k_max, self.drafter == "model")
        self.probing = False
        if k == 0:
            self.steps_since_probe += 1
            if self.steps_since_probe >= self.probe_interval:
                self.steps_since_probe = 0
                self.probing = True
                return 1
        return k

    def observe(self, proposed: int, accepted: int) -> None:
        self.acceptance.observe(proposed, accepted)
        if self.shared is not None:
            self.shared.observe(proposed, accepted)
        if self.probing:
            # A failed probe waits twice as long before the next one.
            ok = accepted == proposed
            self.probe_interval = PROBE_FIRST if ok else min(self.probe_interval * 2, PROBE_MAX)


@dataclass
class DraftController:
    """Per-process state for "auto": pass costs of both models, acceptance priors.

    `target` and `draft` are PassCosts in seconds (measured at start-up, or static
    in decode-step units when not calibrated); `static` is the per-request model
    sampled rows schedule by.
    """

    target: PassCosts
    draft: PassCosts | None
    static: CostModel
    acceptance: dict = field(default_factory=dict)
    # size class -> steps between probes there, and steps since its last probe: probes
    # that failed at 16 rows say nothing of one row (measured: after a 16-row stretch a
    # one-row request, its acceptance low from two rejections, never probed again).
    probe_interval: dict = field(default_factory=dict)
    steps_since_probe: dict = field(default_factory=dict)
    probing: bool = False  # the last choose_batch_k was a probe
    # The most drafts a row without a free draft takes in the last choose_batch_k's step,
    # where that is less than its K (None: K; 0: the rows with a free draft draft alone,
    # no draft model pass): the rows with a free draft take theirs to K, the others what
    # pays for the draft model (`model_rows_draft`).
    model_depth: int | None = None
    # size class -> the K of its last priced step where no row had a free draft: what
    # drafting by the model alone pays there (the depth a step with free drafts may keep)
    model_k: dict = field(default_factory=dict)
    block: bool = False  # a block drafter (DFlash): any number of drafts costs one pass
    # Drafts a probe asks for: one, or a block drafter's whole block (capped at
    # MAX_AUTO_DRAFT; `_probe_width`), which costs it the same one pass and tells
    # acceptance at every position of the block (measured: DFlash at long context,
    # one-token probes took ~40 steps to lift a row's acceptance from the pair's 0.22
    # to its own 0.6).
    probe_depth: int = 1
    calibrated: bool = True  # curves in seconds (else decode-step units)
    live_target: dict = field(default_factory=dict)  # (rows, width) -> measured / curve
    # rows -> {depth: a step's draft seconds at that depth over the one-row curve's value
    # at those rows}: a step's draft work is not depth times one pass (the first pass reads
    # the pending tokens, one sync ends them all), so each depth is timed for itself.
    live_draft: dict = field(default_factory=dict)
    # (rows, width > 1) -> its live_target factor over the plain (rows, 1) one when it ran:
    # a pass's seconds grow with the rows' context, so a drafting shape measured early in
    # the rows' lives is priced by how plain decoding costs now, not by its own old seconds.
    live_relative: dict = field(default_factory=dict)
    fits: dict = field(default_factory=dict)  # rows -> DepthFit of its all-drafting steps
    plain_recent: dict = field(default_factory=dict)  # rows -> newest plain pass factors
    realized: dict = field(default_factory=dict)  # size class -> Realized: the guard's evidence
    # size class -> Realized of the steps whose drafts were all free (prompt lookup, no
    # draft-model pass), beside the same plain steps: a draft model that loses must not
    # stop free drafts (measured: the random-draft pair at 1 row, "auto" drafting the
    # useless model while untried set the verdict, then 14 steps with a lookup draft ran
    # plain; 0.94-0.99x plain where lookups run 1.07-1.21x)
    realized_free: dict = field(default_factory=dict)
    probe_rows: int = 0  # batch size of the last probe
    probe_pending: bool = False  # an accepted probe, judged by the next pricing
    settled: tuple | None = None  # (key, may probe, free offer priced) of a K = 0
    settled_left: int = 0  # steps it may still be reused
    drafting: dict = field(default_factory=dict)  # size class -> its last pricing drafted
    held: tuple | None = None  # (hold, K) of a drafting decision reused unpriced
    held_left: int = 0  # steps it may still be reused
    # (size class, drafted) -> seconds a step spends outside its draft and target passes
    # (choosing, bookkeeping, rollback, compaction), for steps that drafted and did not.
    overhead: dict = field(default_factory=dict)
    # Measured seconds of the draft model's reads of cold rows over its one-row curve.
    read_factor: float = 1.0
    now: int = 0  # steps observed: the clock of the guard and of live_relative's freshness
    # Keys of live_target still holding a start-up timing: the first live one replaces it.
    calibrated_keys: set = field(default_factory=set)
    # size class -> seconds of one change of rows (rows leaving or joining copy the caches)
    churn: dict = field(default_factory=dict)
    checking: Realized | None = None  # the class whose plain check this step is
    joined_at: int = -PLAIN_SETTLE  # `now` of the newest step that admitted rows
    # (rows, width) -> `now` when a step of that shape last ran (`_explore`)
    shape_seen: dict = field(default_factory=dict)
    explored: dict = field(default_factory=dict)  # size class -> `now` of its last exploring step
    # (width, depth) -> step seconds (`_step_prices`) at the rows and drafted rows of
    # `prices_at`: (price_version, now // PRICE_STEPS, rows, drafted rows) when they were made
    prices: dict = field(default_factory=dict)
    prices_at: tuple = ()
    price_version: int = 0  # bumped when a shape is new to a live table: prices made before go
    depth_margin: float = DEPTH_MARGIN  # (a field: benchmarks A/B it)
    held_steps: int = HELD_STEPS  # (a field: benchmarks A/B it)
    held_max: int = HELD_MAX  # (a field: benchmarks A/B it)
    # size class -> (the K of its last held decision, the steps that hold ran): `_hold_span`
    hold_spans: dict = field(default_factory=dict)
    # The guard rules both ways: drafting it measured winning goes on, and a verdict against
    # drafting that lapsed is tried, whatever the prices say (`_measured_pays`).
    judge: bool = True  # (a field: benchmarks A/B it)

    @property
    def model_rows_draft(self) -> bool:
        """False where the last choose_batch_k's K is for the rows with a free draft only:
        the others draft nothing (`model_depth` 0)."""
        return self.model_depth != 0

    @model_rows_draft.setter
    def model_rows_draft(self, drafts: bool) -> None:
        self.model_depth = None if drafts else 0

    @classmethod
    def for_pair(cls, pair, calibrate: bool = True) -> DraftController:
        on_gpu = mx.default_device() == mx.gpu
        t_params = pair.info()["target_parameters"]
        d_params = pair.info()["draft_parameters"]
        dflash = pair.dflash  # a drafter reading the target's hidden states, or None
        if dflash is not None:
            d_params = dflash.info().get("parameters", t_params // 10)
        static = static_costs(t_params, d_params, on_gpu)
        live_target = {}
        if calibrate:
            target = measure_pass_costs(pair.target)
            live_target = measure_batch_steps(pair.target, target)
            if dflash is not None:
                draft = dflash.measure_costs(pair.target)
            else:
                draft = (
                    measure_pass_costs(pair.draft, sizes=PASS_SIZES[:10]) if pair.draft else None
                )
        else:
            target = static_pass_costs(static.verify[1] - 1.0)
            has_draft = pair.draft is not None or dflash is not None
            draft = PassCosts({1: static.draft_step}) if has_draft else None
        return cls(
            target=target,
            draft=draft,
            static=static,
            block=dflash is not None and dflash.block,
            probe_depth=min(dflash.block_size - 1, MAX_AUTO_DRAFT)
            if dflash is not None and dflash.block
            else 1,
            calibrated=calibrate,
            live_target=live_target,
            calibrated_keys=set(live_target),
        )

    def plan(self, drafter: str, greedy: bool, k_max: int = MAX_AUTO_DRAFT) -> DraftPlan:
        """Start the per-request state of one "auto" request.

        A greedy request drafted by the model also gets a `lookup` sub-plan: on steps
        where its text repeats itself (its last two tokens occurred before), the tokens
        that followed last time are a free draft. Greedy output does not depend on the
        drafts, so this changes speed only. Sampled requests keep to their one drafter.
        """
        if greedy:
            plan = self._greedy_plan(drafter, k_max)
            if drafter == "model":
                plan.lookup = self._greedy_plan(HYBRID_LOOKUP, LOOKUP_MAX_DRAFT)
            return plan
        return DraftPlan(self.static, Acceptance(), k_max, drafter, shared=None)

    def _greedy_plan(self, key: str, k_max: int) -> DraftPlan:
        prior = self.acceptance.setdefault(key, Acceptance(decay=SHARED_DECAY))
        weight = ROW_ANCHOR if key == "model" else LOOKUP_ANCHOR
        start = Acceptance(0.0, 0.0, anchor=prior, anchor_weight=weight)
        drafter = "lookup" if key == HYBRID_LOOKUP else key
        return DraftPlan(self.static, start, k_max, drafter, shared=prior)

    # -- the batch's draft length --------------------------------------------------
    def _target_pass(self, rows: int, width: int) -> float:
        # live_target holds, per (rows, width) measured, its seconds over the curve's own
        # (unscaled) value; plain steps (width 1) of a few batch sizes are measured at
        # start-up. A drafting shape measured is priced by its share of this batch
        # size's plain pass (live_relative) times the plain pass now; a plain shape by
        # its factor; another by the share of the nearest width measured at this batch
        # size, else by the nearest measured batch size of the same width, else this
        # batch's plain pass, else the curve's load factor.
        curve = self.target._curve(rows * width)
        plain = self.live_target.get((rows, 1))
        relative = self.live_relative.get((rows, width)) if plain is not None else None
        factor = relative * plain if relative is not None else self.live_target.get((rows, width))
        if factor is None and plain is not None and width > 1:
            # A drafting width not yet run at this batch size: the share of the plain pass
            # of the nearest width that has (measured at 4 demo rows: widths 2-6 ran
            # 1.25-1.65x the plain pass's factor, and width 9, priced at the plain factor,
            # looked cheaper than width 6).
            widths = [w for (b, w) in self.live_relative if b == rows]
            if widths:
                near = min(widths, key=lambda w: (abs(w - width), -w))
                factor = self.live_relative[(rows, near)] * plain
        if factor is None:
            near = [b for (b, w) in self.live_target if w == width]
            if near:
                factor = self.live_target[(min(near, key=lambda b: abs(b - rows)), width)]
            else:
                factor = self.live_target.get((rows, 1), self.target.scale)
        return curve * factor

    def _draft_seconds(self, rows: int, depth: int) -> float:
        """Seconds of a step's `depth` draft passes over `rows` rows: timed at that depth
        if it ran at these rows; else along the line through the two nearest depths
        timed (a fixed cost a step, plus one a pass), or depth times the one depth timed;
        at rows never timed, the nearest rows' figures; never timed at all, the curve."""
        if self.block:
            depth = 1  # a block drafter drafts any number in one pass
        curve = self.draft._curve(rows)
        by_depth = self.live_draft.get(rows)
        if by_depth is None:
            if not self.live_draft:
                # An uncalibrated curve is in target-step units, so it takes the target's
                # factor (seconds per unit); a calibrated one is in seconds already.
                return depth * curve * self.draft_unit()
            by_depth = self.live_draft[min(self.live_draft, key=lambda r: abs(r - rows))]
        if depth in by_depth:
            return curve * by_depth[depth]
        if len(by_depth) == 1:
            ((d, f),) = by_depth.items()
            return curve * f * depth / d
        below = [d for d in by_depth if d < depth]
        above = [d for d in by_depth if d > depth]
        if below and above:  # between two depths timed: on the line through them
            d1, d2 = max(below), min(above)
            f1, f2 = by_depth[d1], by_depth[d2]
            return curve * (f1 + (depth - d1) * (f2 - f1) / (d2 - d1))
        if above:  # shallower than any timed: a share of the shallowest
            d1 = min(above)
            return curve * by_depth[d1] * depth / d1
        # Deeper than any timed: a pass more each at the slope of every depth timed (least
        # squares), not of the two deepest: deep steps run rarely, their figures are few
        # and noisy, and two of them 1 apart gave a slope of a quarter pass (measured at 4
        # demo rows: K = 8 priced 3.99 ms of drafts, run at ~5.5, and chosen as the best K).
        top = max(below)
        return curve * (by_depth[top] + (depth - top) * _slope(by_depth))

    def draft_unit(self) -> float:
        return self.target.scale if not self.calibrated else self.draft.scale

    def step_seconds(self, rows: int, width: int, depth: int, drafted_rows: int) -> float:
        """Predicted seconds of one step: `depth` draft passes over `drafted_rows` rows,
        then one target pass over rows * width positions."""
        cost = self._target_pass(rows, width)
        if depth and self.draft is not None and drafted_rows:
            cost += self._draft_seconds(drafted_rows, depth)
        return cost + self._overhead(rows, width > 1)

    def _overhead(self, rows: int, drafting: bool) -> float:
        # This size class's steps of this kind; else of the other kind (no bias either
        # way); else the nearest class's of this kind, per row.
        size = self.size_class(rows)
        for key in ((size, drafting), (size, not drafting)):
            if key in self.overhead:
                return self.overhead[key]
        near = [c for c, d in self.overhead if d == drafting]
        if not near:
            return 0.0
        c = min(near, key=lambda c: abs(c - size))
        return self.overhead[(c, drafting)] * rows / (1 << (c - 1))

    def warm_seconds(self, positions: int) -> float:
        """Predicted seconds for the draft model to read `positions` tokens it has not
        read yet (cold rows' prefill, a backlog): its one-row curve at that many
        positions (extrapolated past the sizes timed at start-up) times the factor
        measured on the reads that ran (`observe_read`)."""
        if not positions or self.draft is None or self.block:
            return 0.0
        if not self.calibrated:  # decode-step units: the target's growth with positions
            return self._draft_seconds(1, 1) * self.target._curve(positions) / self.target._curve(1)
        return self.draft._curve(positions) * self.read_factor

    def observe_read(self, positions: int, seconds: float) -> None:
        """Fold one measured read (a cold row's prefill in the draft model) into
        `read_factor`, its seconds over the draft curve's value."""
        curve = self.draft._curve(positions) if self.draft is not None else 0.0
        if positions and seconds > 0 and curve > 0:
            self.read_factor += LIVE_EMA * (seconds / curve - self.read_factor)

    def change_seconds(self, rows: int) -> float:
        """Predicted seconds of one change of rows (some leave, or some join) at this batch
        size: measured at its size class, else the nearest class's per row, else a plain
        step (a change copies the caches, about what a pass reads)."""
        size = self.size_class(rows)
        if size in self.churn:
            return self.churn[size]
        if self.churn:
            c = min(self.churn, key=lambda c: abs(c - size))
            return self.churn[c] * rows / (1 << (c - 1))
        return self.step_seconds(rows, 1, 0, 0)

    def parting_seconds(self, rows: int) -> float:
        """What it costs each time drafting has rows that plain decoding would finish on
        one step finish on a step of their own (`finish_steps`): they leave, and their
        successors join, on changes of their own (two copies of the caches), and the last
        rows of a batch finish in a thinner step more (about a plain step). Measured on a
        batch of equal requests at 16 demo rows: K = 1 ran its full steps as fast per token
        as plain decoding, and lost 12% in all to the joins and the thin last steps."""
        return 2 * self.change_seconds(rows) + self.step_seconds(rows, 1, 0, 0)

    def observe_churn(self, rows: int, seconds: float) -> None:
        """Fold the measured seconds of one change of rows into its size class."""
        if rows and seconds > 0:
            _ema(self.churn, self.size_class(rows), seconds)

    def _rates(
        self, auto, fixed, k_max, rows, drafted_rows, warm=(0, 1.0), sync=(0, 1.0), model_depth=None
    ) -> tuple[list[float], list[float]]:
        """Expected tokens per second of the whole step for K = 0..k_max, at the rows'
        acceptance and at perfect acceptance: rows are grouped by (acceptance to 0.01,
        cap, free), so a step prices a handful of groups, not every row (this runs every
        step it is not settled, over up to hundreds of rows), then a step-cost lookup per K.

        `warm` = (positions, horizon): drafting would first have the draft model read
        `positions` tokens of cold rows, which have about `horizon` tokens each left to
        generate; that one-time cost is spread over the steps they take at each K.

        `sync` = (rows in step, tokens left): that many rows share their tokens left with
        another row, so plain decoding finishes them on one step; drafting moves rows on
        by different counts and spreads their finishing over more steps (`finish_steps`
        at each K's mean and variance of tokens a row-step: none at perfect acceptance,
        up to a step a row at a low one), `parting_seconds` each step more, that cost
        spread over the steps they have left at each K.

        `model_depth`: the rows without a free draft draft at most this many (0: none, no
        draft model pass), the rows with one up to K: the step `model_depth` asks for."""
        if model_depth is None:
            groups = Counter((round(r.acceptance, 2), r.cap, r.free) for r in auto)
        else:
            groups = Counter(
                (round(r.acceptance, 2), r.cap if r.free else min(r.cap, model_depth), r.free)
                for r in auto
            )
        base_tokens = sum(expected_tokens(f.acceptance, f.k) for f in fixed)
        fixed_width = max((f.k for f in fixed), default=0)
        fixed_depth = max((f.k for f in fixed if f.model), default=0)
        positions, horizon = warm
        warm_s = self.warm_seconds(positions) if positions else 0.0
        parted, left = sync
        part_s = self.parting_seconds(rows) if parted else 0.0
        # Expected and perfect tokens of the step at each K, one group at a time (a
        # group's expected tokens grow by a power of its acceptance per K, up to its cap).
        size = k_max + 1
        tokens, perfect = [base_tokens] * size, [base_tokens] * size
        # The sum of the "auto" rows' variances of tokens a row-step (rows in step only).
        var_sum = [0.0] * size
        cap_all = cap_model = 0
        for (a, cap, free), n in groups.items():
            cap_all = max(cap_all, cap)
            if not free:  # (at most model_depth)
                cap_model = max(cap_model, cap)
            e, full, var = _row_tokens(a, cap, size)
            tokens = [t + n * x for t, x in zip(tokens, e, strict=True)]
            perfect = [t + n * x for t, x in zip(perfect, full, strict=True)]
            if part_s:
                var_sum = [t + n * x for t, x in zip(var_sum, var, strict=True)]
        rates, ceilings = [], []
        prices = self._step_prices(
            rows, drafted_rows, fixed_width, fixed_depth, cap_all, cap_model, size
        )
        for k in range(size):
            seconds = prices[k]
            depth = max(fixed_depth, min(k, cap_model))
            if warm_s and depth:
                # Steps the cold rows have left at this K's pace: horizon / tokens per row-step.
                seconds += warm_s * min((tokens[k] / rows) / max(horizon, 1.0), 1.0)
            if part_s and k:
                # The rows in step as one group (`parted` share their tokens left with
                # another row: one more than that), at the "auto" rows' mean and variance.
                n = len(auto)
                mean = (tokens[k] - base_tokens) / n
                spread = finish_steps(parted + 1, left, mean, var_sum[k] / n)
                seconds += (spread - 1.0) * part_s * min((tokens[k] / rows) / max(left, 1.0), 1.0)
            rates.append(tokens[k] / seconds)
            ceilings.append(perfect[k] / seconds)
        return rates, ceilings

    def _step_prices(
        self, rows, drafted_rows, fixed_width, fixed_depth, cap_all, cap_model, size
    ) -> list[float]:
        """Predicted seconds of a step at each K < size (`step_seconds` of its shape), each
        at least the last: a wider, deeper step never costs less than a narrower one (a
        shape measured in a quiet moment must not make a longer draft look cheaper).
        A shape's price is reused for PRICE_STEPS steps while no shape is new to the live
        tables: prices move by a LIVE_EMA step a sample, and pricing every K every step
        was most of what choosing cost (measured at 4 demo rows: 91 us a call, 1.4 calls
        a step)."""
        at = (self.price_version, self.now // PRICE_STEPS, rows, drafted_rows)
        if self.prices_at != at:
            self.prices.clear()
            self.prices_at = at
        memo = self.prices
        fit = self.fits.get(rows) if drafted_rows == rows and not self.block else None
        fit = fit if fit is not None and fit.ready() else None
        prices, floor = [], 0.0
        for k in range(size):
            shape = (max(fixed_width, min(k, cap_all)) + 1, max(fixed_depth, min(k, cap_model)))
            seconds = memo.get(shape)
            if seconds is None:
                if fit is not None and shape[1] and shape[0] == shape[1] + 1:
                    # Every row drafts as deep as the step is wide: the fitted line.
                    seconds = fit(shape[1]) + self._overhead(rows, True)
                else:
                    seconds = self.step_seconds(rows, *shape, drafted_rows)
                memo[shape] = seconds
            floor = max(floor, seconds)
            prices.append(floor)
        return prices

    def choose_batch_k(
        self,
        auto: list[AutoRow],
        fixed: list[FixedRow],
        drafted_rows: int,
        warm=(0, 1.0),
        key=None,
        offer: tuple[int, int] | None = None,
        rows: int | None = None,
        sync=(0, 1.0),
        hold=None,
    ) -> int:
        """One draft length for every greedy "auto" row of a step (each capped by its
        own `cap`): the most expected tokens per second for the whole batch, the draft
        model's first read of cold rows (`warm`, see `_rates`) included. A probe
        (`probing` set) asks for `_probe_width` drafts: the decoder gives them to one row only.

        `warm` and `sync` (rows in step that drafting would part, see `_rates`) may be
        functions giving those pairs, called only when the step is priced. `key` and
        `offer` as for `reuse_settled` (`offer` defaults to the free drafts of `auto`);
        `rows` is the batch size (default: the rows given). Where drafting pays
        but the guard has no recent plain step at this batch size, the step runs plain
        (realized.Realized.plain_due). `hold` sums up the batch without its rows'
        acceptance: a drafting decision is reused while it stays the same (`_reuse_held`);
        None: every step is priced."""
        self.probing = False
        self.model_depth = None
        if not auto:
            return 0
        rows = rows if rows is not None else len(auto) + len(fixed)
        free = offer if offer is not None else self._free_offer(auto)
        reused = self.reuse_settled(key, free, rows)
        if reused is not None:
            return reused
        if self.held is not None:
            reused = self._reuse_held(hold, auto, rows)
            if reused is not None:
                return reused
            self.held = None
        # An offer that outgrew a K = 0 still in force: its bound carries over.
        held = self.settled is not None and self.settled_left > 0 and self.settled[0] == key
        seen = self.settled[2] if held else (0, 0)
        self.settled = None
        settle = (key, (max(free[0], seen[0]), max(free[1], seen[1])))
        k_max = max(r.cap for r in auto)
        if k_max == 0:
            return 0
        warm = warm() if callable(warm) else warm
        sync = sync() if callable(sync) else sync
        rates, ceilings = self._rates(auto, fixed, k_max, rows, drafted_rows, warm, sync)
        c = self.size_class(rows)
        # Drafting starts only where it beats plain decoding by MARGIN in the model, and
        # goes on while it beats it at all: acceptance is learnt only by drafting, so a
        # K = 0 decided on a few unlucky steps stands (measured at 4 demo rows: stretches
        # of 100+ plain steps where K = 1 ran 1.07x plain), and the guard stops drafting
        # that measurably loses.
        bar = rates[0] * (1 + (0.0 if self.drafting.get(c) else MARGIN))
        measured = self._measured_pays(rows)
        # If even perfect acceptance cannot pay at any K (a saturated device: batching
        # and speculation compete for the same compute), plain decoding, and no probe.
        if max(ceilings[1:]) <= bar and not measured:
            self.drafting[c] = False
            self._settle(*settle, may_probe=False)
            return 0
        # The best K; the shorter one on a tie, and in a batch the shortest priced within
        # depth_margin of it.
        best = max(range(1, k_max + 1), key=lambda k: (rates[k], -k))
        top = rates[best]  # (whether drafting pays is judged at the best K's price)
        if rows > 1:
            margin = 1 + self.depth_margin
            best = next(k for k in range(1, best + 1) if rates[k] * margin >= top)
        if any(r.free for r in auto) and not all(r.free for r in auto):
            # Some rows have a free (prompt-lookup) draft and the others would draft with
            # the draft model: drafting only the free ones may pay more (measured: a draft
            # model no row agrees with ran 7-8 passes for three rows, ~7 ms, so one row
            # could verify its lookup draft).
            alone, _ = self._rates(auto, fixed, k_max, rows, drafted_rows, warm, sync, 0)
            k_alone = max(range(1, k_max + 1), key=lambda k: (alone[k], -k))
            # ... or the draft model drafting as deep as it pays alone, and the free rows
            # taking theirs further (measured at 4 demo rows: where one row's lookup draft
            # set K = 4-5, the others drafted as deep, 4-5 draft passes, and those steps
            # ran 0.83-0.96 tokens a ms where K = 2 alone ran 1.09, under plain's 0.90).
            depth = self.model_k.get(c, 0)
            if 0 < depth < best:
                mixed, _ = self._rates(auto, fixed, k_max, rows, drafted_rows, warm, sync, depth)
                k_mixed = max(range(depth, k_max + 1), key=lambda k: (mixed[k], -k))
                if mixed[k_mixed] > top:
                    rates, best, self.model_depth = mixed, k_mixed, depth
                    top = rates[best]
            if alone[k_alone] > top:
                rates, best, self.model_depth = alone, k_alone, 0
                top = rates[best]
        elif not any(r.free for r in auto):
            self.model_k[c] = best
        free_step = not self.model_rows_draft or all(r.free for r in auto)
        pays = top > bar and not self.speculation_lost(rows, free_step)
        if not pays and self._untried() and not self.speculation_lost(rows, free_step):
            # The pair has heard next to no drafts: its acceptance is PRIOR_ACCEPTANCE, a
            # guess, and K = 0 learns nothing (measured: a whole lockstep cell at 4 demo
            # rows ran plain where K = 1 ran 1.07x). Draft, and let the rows' drafts and
            # the guard say what pays.
            pays = True
        if not pays and measured and not free_step:
            pays = True
        self.drafting[c] = pays
        if self.probe_pending:
            # An accepted probe counts as a success only if drafting now pays.
            self.probe_pending = False
            if pays:
                self.probe_interval[self.size_class(self.probe_rows)] = PROBE_FIRST
            else:
                self._probe_failed(self.probe_rows, drafted_rows)
        if pays:
            self.steps_since_probe[c] = 0
            group = (self.realized_free if free_step else self.realized).setdefault(c, Realized())
            if self._plain_check(group):
                return 0
            k = self._explore(c, rows, best, k_max, rates)
            if hold is not None and k == best and self.model_rows_draft:
                if not any(r.free for r in auto):
                    self.held, self.held_left = (hold, k), self._hold_span(c, k) - 1
            return k
        # Speculation does not pay at today's acceptance (or the guard stopped it):
        # probe now and then so acceptance stays measured, less often after each
        # failed probe.
        self.hold_spans.pop(c, None)  # (drafting again starts from a short hold)
        self._settle(*settle, may_probe=True)
        return self._maybe_probe(rows)

    def _hold_span(self, size_class: int, k: int) -> int:
        """Steps a drafting decision at K is held (`_reuse_held`): `held_steps`, twice the
        last span each time a pricing at this class confirms the K it held, up to
        `held_max`. Pricing is most of what choosing costs, and at 4 demo rows it
        confirmed the K it held on most pricings; a K that changes is priced again soon."""
        last, span = self.hold_spans.get(size_class, (None, 0))
        span = min(span * 2, self.held_max) if last == k else self.held_steps
        self.hold_spans[size_class] = (k, span)
        return span

    def _measured_pays(self, rows: int) -> bool:
        """Whether the guard has the draft model's drafting go on at this batch size
        whatever the prices say (`judge`): drafting measurably won on its recent steps, or
        a verdict against it lapsed (a trial). A process whose first prices were off (a
        shape's first passes run slow) otherwise decoded plain for good where drafting
        won: plain steps time no drafting shape, so its prices never mend. (Drafting at a
        batch size until the guard there judged cost 16 demo rows 4.8 +- 2.0%, paired: at
        16 rows a verdict took ~65 steps, half of a run.)"""
        if not self.judge:
            return False
        group = self.realized.get(self.size_class(rows))
        if group is None or self.speculation_lost(rows):
            return False
        # A verdict against drafting that lapsed is tried again (`Realized.lapsed`, until the
        # trial's fresh steps are judged) whatever the prices say: they were timed in the
        # steps that lost, and a load burst that slowed drafting steps 3x priced drafting
        # out for good (measured at 4 demo rows).
        return group.lapsed or group.speculation_won(self.now)

    def _untried(self) -> bool:
        """Whether the pair's greedy model drafts have been heard fewer than UNTRIED_TRIALS
        times beyond the prior (False where no plan was made: callers pricing rows of
        their own)."""
        pair = self.acceptance.get("model")
        return pair is not None and pair.trials < PRIOR_WEIGHT + UNTRIED_TRIALS

    def reuse_held(self, hold, rows: int) -> int | None:
        """`_reuse_held` for a batch none of whose rows can have a free draft, asked before
        its rows are read (`policy.DraftPolicy.choose`): the held K, 0 (a plain check) or
        None (price this step: `choose_batch_k`). Call after `reuse_settled`."""
        if self.held is None:
            return None
        return self._reuse_held(hold, (), rows)

    def _reuse_held(self, hold, auto: list[AutoRow], rows: int) -> int | None:
        """The K of the last drafting decision, unpriced, for up to `held_steps` steps
        while the batch (`hold`) is the same and no row has a free draft (those change
        what pays from step to step); None: price this step. The guard still rules every
        step: a lost verdict ends the hold, a plain check due runs plain."""
        if hold is None or self.held_left <= 0 or self.held[0] != hold:
            return None
        if any(r.free for r in auto) or self.speculation_lost(rows):
            return None
        group = self.realized.get(self.size_class(rows))
        if group is not None and self._plain_check(group):
            return 0
        self.held_left -= 1
        return self.held[1]

    def joining(self) -> None:
        """Rows join on the step about to be chosen: it is no plain check, and the checks
        wait PLAIN_SETTLE steps past it (a check chosen on the join step itself was heard
        as no evidence and asked again: a plain step given up for nothing, at every join;
        measured at 4 demo rows)."""
        self.joined_at = self.now + 1  # (the step's `now` once observed)

    def _plain_check(self, group: Realized) -> bool:
        """Whether this drafting step runs plain for the guard (realized.plain_due); the
        step's outcome is then that check's (`checking`). Not within PLAIN_SETTLE steps
        of rows joining: the check waits, and is due as soon as they are past."""
        if self.now - self.joined_at < PLAIN_SETTLE:
            return False
        if group.plain_due():
            self.checking = group
            return True
        return False

    def _explore(self, size_class: int, rows: int, best: int, k_max: int, rates: list) -> int:
        """`best`, or now and then a neighbouring K (one draft more or fewer) whose step
        shape has not run for EXPLORE_EVERY steps: its price is then a pass timed long
        ago, at a shorter context or in a load burst, and may be off (either way) by
        more than the K's differ. Only a K that also beats plain decoding is explored."""
        if self.now - self.explored.get(size_class, -EXPLORE_GAP) < EXPLORE_GAP:
            return best
        seen = {
            k: self.shape_seen.get((rows, k + 1), -EXPLORE_EVERY)
            for k in (best - 1, best + 1)
            if 1 <= k <= k_max and rates[k] > rates[0]
        }
        if not seen:
            return best
        k = min(seen, key=seen.get)
        if self.now - seen[k] < EXPLORE_EVERY:
            return best
        self.explored[size_class] = self.now
        return k

    def reuse_settled(self, key, offer: tuple[int, int], rows: int) -> int | None:
        """A K = 0 decision reused unpriced: 0 (plain), a probe's drafts (`_probe_width`,
        `probing` set) or None (price this step). `key` sums up the batch (its rows and
        their acceptance, not the caps): while it is unchanged, a K = 0 decision holds
        for SETTLED_STEPS steps, unless `offer` (rows with a free prompt-lookup draft,
        their tokens) clearly grows past any priced since (FREE_SLACK; a shrinking budget only removes
        K's that did not pay). No key: always None."""
        self.probing = False
        self.model_depth = None
        if key is None or self.settled is None or self.settled_left <= 0:
            return None
        priced_key, may_probe, bound = self.settled
        if priced_key != key or offer[0] > bound[0] or offer[1] > bound[1]:
            return None
        self.settled_left -= 1
        return self._maybe_probe(rows) if may_probe else 0

    @staticmethod
    def _free_offer(auto: list[AutoRow]) -> tuple[int, int]:
        """(rows with a free draft, their draft tokens): more of either may pay."""
        caps = [r.cap for r in auto if r.free]
        return len(caps), sum(caps)

    def _settle(self, key, free: tuple[int, int], may_probe: bool) -> None:
        if key is not None:
            rows, tokens = free
            bound = (
                rows + max(1, int(rows * FREE_SLACK)),
                tokens + max(2, int(tokens * FREE_SLACK)),
            )
            self.settled, self.settled_left = (key, may_probe, bound), SETTLED_STEPS

    def _maybe_probe(self, rows: int) -> int:
        c = self.size_class(rows)
        self.steps_since_probe[c] = self.steps_since_probe.get(c, 0) + 1
        if self.steps_since_probe[c] >= self.probe_interval.get(c, PROBE_FIRST):
            self.steps_since_probe[c] = 0
            self.probing = True
            self.probe_rows = rows
            self.settled = None  # the probe changes what the rows' acceptance says
            return self._probe_width(rows)
        return 0

    def _probe_width(self, rows: int) -> int:
        """Drafts this probe asks for: `probe_depth` where that step costs at most two
        plain steps (its target pass widens for every row of the batch: at 16 CPU rows a
        block of 8 is ~9 times the positions), else one."""
        if self.probe_depth == 1:
            return 1
        plain = self.step_seconds(rows, 1, 0, 0)
        wide = self.step_seconds(rows, self.probe_depth + 1, self.probe_depth, 1)
        return self.probe_depth if wide <= 2 * plain else 1

    def _probe_failed(self, rows: int, drafted_rows: int) -> None:
        """Double the interval, and keep it long enough that probes cost at most
        PROBE_BUDGET of the steps between them."""
        plain = self.step_seconds(rows, 1, 0, 0)
        depth = self._probe_width(rows)
        extra = self.step_seconds(rows, depth + 1, depth, max(drafted_rows, 1)) - plain
        floor = int(extra / (PROBE_BUDGET * plain)) if plain > 0 else 0
        c = self.size_class(rows)
        interval = self.probe_interval.get(c, PROBE_FIRST)
        self.probe_interval[c] = min(max(interval * 2, floor), PROBE_MAX)

    def probe_result(self, proposed: int, accepted: int) -> None:
        """After a probe step: a rejected draft doubles the interval; an accepted one
        is judged by the next pricing (it resets the interval only if drafting then
        pays). Where the guard has stopped speculation, accepted drafts do not show it
        pays, so the interval doubles either way."""
        # (A block probe's first draft passing is a one-token probe's success; the rest
        # of the block tells the next pricing, through the rows' acceptance, how far.)
        if proposed and accepted >= 1 and not self.speculation_lost(self.probe_rows):
            self.probe_pending = True
        else:
            self._probe_failed(self.probe_rows, 1)

    @staticmethod
    def size_class(rows: int) -> int:
        """The guard's batch-size group: 1, 2-3, 4-7, 8-15, 16-31, ..."""
        return rows.bit_length()

    def speculation_lost(self, rows: int, free: bool = False) -> bool:
        """The guard's verdict at this batch size: for steps that draft by the draft model,
        or (`free`) for steps whose drafts are all free."""
        realized = (self.realized_free if free else self.realized).get(self.size_class(rows))
        return realized is not None and realized.speculation_lost(self.now)

    def observe_realized(
        self,
        rows: int,
        seconds: float,
        emitted: int,
        drafted: bool,
        evidence: bool = True,
        free: bool = False,
        joined: bool = False,
    ) -> None:
        """Feed the realized-speed guard one whole step (and advance its clock): its
        wall-clock seconds (choosing, drafting, verifying, bookkeeping), the tokens it
        emitted over every row, and whether it drafted. Whatever the cost model
        predicts, speculation that measurably cost more per token than plain decoding
        at this batch size stops (engine/realized.py). A step that is no evidence of
        either kind (`evidence` False: a probe, where one row drafts to measure
        acceptance, or a step that admitted rows) only advances the clock. A step whose
        drafts were all free (`free`: no draft-model pass) is judged apart from those
        that ran the draft model; plain steps are evidence for both. `joined`: the step
        admitted rows (no evidence; the guard's plain checks wait PLAIN_SETTLE steps)."""
        self.now += 1
        if joined:
            self.joined_at = self.now
        checking, self.checking = self.checking, None
        if checking is not None and not evidence:
            checking.plain_asked = -1  # the plain check was no evidence: ask again
        if emitted and seconds > 0 and evidence:
            c = self.size_class(rows)
            if drafted:
                kind = self.realized_free if free else self.realized
                kind.setdefault(c, Realized()).observe(self.now, seconds, emitted, True)
            else:
                for kind in (self.realized, self.realized_free):
                    kind.setdefault(c, Realized()).observe(self.now, seconds, emitted, False)

    def observe_overhead(self, rows: int, seconds: float, drafted: bool) -> None:
        """Fold the seconds one step spent outside its draft and target passes into the
        overhead of its kind (drafting or plain) at its batch-size class: a step that
        drafts does work a plain one does not (rollback, the draft model's bookkeeping,
        compaction), and a batch of small rows on a fast device feels it."""
        if rows and seconds >= 0:
            key = (self.size_class(rows), drafted)
            self.price_version += key not in self.overhead
            _ema(self.overhead, key, seconds)

    def observe_step(
        self,
        rows: int,
        width: int,
        verify_s: float,
        depth: int,
        drafted_rows: int,
        draft_s: float,
    ) -> None:
        """Fold one measured step into the live costs: the curves' load factors, and the
        seconds of this exact shape (a batch pass is not priced well by a one-row curve:
        per-row overheads make a draft pass over many rows cost about a target pass)."""
        # A shape's first pass in a process runs slow (2-4x measured at one demo row, new
        # buffers): it prices nothing.
        first = (rows, width) not in self.shape_seen
        self.shape_seen[(rows, width)] = self.now
        if first:
            return
        # No one sample sets a price: a shape new to the tables starts from what it is
        # priced at without them, and each sample moves it a LIVE_EMA step (measured: a
        # process's second 4-row K = 1 step ran 3x slow, its price stood, and K = 1 never
        # ran again to mend it; "auto" sat at K = 0 where K = 1 ran 1.07x plain).
        # (Priced after the load factor heard it: an uncalibrated curve's first sample
        # sets its units.)
        self.target.observe(rows * width, verify_s)
        curve = self.target._curve(rows * width)
        factor = verify_s / curve

        # (Priced only for a shape new to a table, not on every step.)
        new = (rows, width) not in self.live_target or (rows, width) not in self.live_relative
        self.price_version += new
        prior = self._target_pass(rows, width) / curve if new else None
        if (rows, width) in self.calibrated_keys:  # a start-up timing: the live one replaces it
            self.calibrated_keys.discard((rows, width))
            self.live_target[(rows, width)] = _clip(factor, self.live_target[(rows, width)])
        else:
            _ema(self.live_target, (rows, width), factor, lambda: prior)
        if width == 1:
            # The plain pass's price is the median of its newest steps, not a mean that a
            # stretch of slow steps lifts: drafting's steps are priced from a line over
            # many (DepthFit), and a plain price lifted by a load burst made every K look
            # 20-25% better than plain (measured at 4 demo rows: plain priced 3.91 ms
            # where its steps ran 3.0-3.3, and "auto" parted rows that plain kept in step
            # at 0.90 of plain's speed).
            recent = self.plain_recent.setdefault(rows, deque(maxlen=GUARD_MEDIAN_OF))
            recent.append(factor)
            if len(recent) >= 3:
                self.live_target[(rows, 1)] = statistics.median(recent)
        # A live plain pass (not a start-up timing), timed lately.
        plain = self.live_target.get((rows, 1))
        live = plain is not None and (rows, 1) not in self.calibrated_keys
        fresh = self.now - self.shape_seen.get((rows, 1), -RELATIVE_FRESH - 1) <= RELATIVE_FRESH
        if width > 1 and live and fresh:
            # Against a plain pass timed at about the same context only (see live_relative).
            _ema(self.live_relative, (rows, width), factor / plain, lambda: prior / plain)
        if depth and drafted_rows == rows and width == depth + 1 and draft_s > 0 and not self.block:
            # (A step whose draft seconds are no sample, 0: its first pass also read a
            # backlog, `policy.DraftPolicy.observe`, is none of the line's either.)
            self.fits.setdefault(rows, DepthFit()).add(depth, verify_s + draft_s)
        if depth and drafted_rows and self.draft is not None and draft_s > 0:
            depth = 1 if self.block else depth
            self.draft.observe(drafted_rows, draft_s / depth)
            d_curve = self.draft._curve(drafted_rows)
            known = depth in self.live_draft.get(drafted_rows, ())
            self.price_version += not known
            d_prior = None if known else self._draft_seconds(drafted_rows, depth) / d_curve
            by_depth = self.live_draft.setdefault(drafted_rows, {})
            _ema(by_depth, depth, draft_s / d_curve, lambda: d_prior)
