"""Choosing how many tokens to draft ("auto"), from acceptance and costs.

With per-token acceptance a and K draft tokens, one verify step emits on average
E(K) = (1 - a^(K+1)) / (1 - a) tokens and costs verify(K) + K * draft_step
seconds. The controller picks the K in 0..max that maximises tokens per second;
K = 0 is plain decoding, so speculation that does not pay backs off by itself,
and a probe every so often re-measures acceptance.

Greedy requests use costs measured live in this process: their output cannot
depend on K. Sampled requests use a static cost model fixed by the pair and the
device, so the K schedule, and with it the output for a given seed, depends only
on the request itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

MAX_AUTO_DRAFT = 8
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 4.0
DECAY = 0.9
EMA = 0.1
PROBE_FIRST, PROBE_MAX = 8, 64
# Lookup drafts cost no draft passes, so they may run longer than model drafts.
LOOKUP_MAX_DRAFT = 12
# Acceptance of lookup drafts taken inside a model-drafted request (key in the controller).
HYBRID_LOOKUP = "model+lookup"


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens emitted by one verify step with k drafts at acceptance a."""
    if k == 0:
        return 1.0
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class CostModel:
    """Seconds per draft token and per target pass over k + 1 tokens (k = 0..)."""

    draft_step: float
    verify: list[float]

    def step_cost(self, k: int, drafts_cost: bool = True) -> float:
        v = self.verify[min(k, len(self.verify) - 1)]
        return v + (k * self.draft_step if drafts_cost else 0.0)

    def best_k(self, a: float, k_max: int, drafts_cost: bool = True) -> int:
        """The K in 0..k_max with the most expected tokens per second."""
        rates = [expected_tokens(a, k) / self.step_cost(k, drafts_cost) for k in range(k_max + 1)]
        return max(range(k_max + 1), key=lambda k: (rates[k], -k))

    def observe(self, k: int, verify_s: float, draft_s: float) -> None:
        """Fold one measured step into the moving averages.

        The verify curve keeps its calibrated shape and moves as a whole: a load
        burst while one K runs slows every K alike, and no K is shunned for good.
        """
        if k < len(self.verify) and self.verify[k] > 0:
            factor = 1.0 + EMA * (verify_s / self.verify[k] - 1.0)
            self.verify = [v * factor for v in self.verify]
        if k > 0 and draft_s > 0:
            self.draft_step += EMA * (draft_s / k - self.draft_step)


def static_costs(target_params: int, draft_params: int, on_gpu: bool) -> CostModel:
    """A deterministic cost model from sizes and device kind, in decode-step units.

    Verifying k extra tokens is nearly free on a GPU and costs ~0.25 of a decode
    step each on a CPU (measured: see NOTES.md); a draft step costs its share of
    parameters, with a floor for per-step overhead.
    """
    per_token = 0.03 if on_gpu else 0.25
    ratio = max(draft_params / max(target_params, 1), 0.05)
    return CostModel(ratio, [1.0 + per_token * k for k in range(MAX_AUTO_DRAFT + 9)])


def measure_costs(pair, reps: int = 3, sizes=(0, 1, 2, 4, 8)) -> CostModel:
    """Time target passes over k + 1 tokens and draft steps on a short context."""
    context = mx.array([[1] * 16])

    def timed(model, n: int) -> float:
        cache = make_prompt_cache(model)
        mx.eval(model(context, cache=cache))
        best = float("inf")
        for _ in range(reps + 1):  # the first pass warms up kernels
            t0 = time.perf_counter()
            mx.eval(model(mx.array([[1] * n]), cache=cache))
            best = min(best, time.perf_counter() - t0)
            trim_prompt_cache(cache, n)
        return best

    measured = {k: timed(pair.target, k + 1) for k in sizes}
    verify = []
    for k in range(MAX_AUTO_DRAFT + 9):  # linear interpolation between measured sizes
        lo = max(s for s in sizes if s <= k)
        hi = min((s for s in sizes if s >= k), default=lo)
        if hi == lo:
            slope = (measured[sizes[-1]] - measured[sizes[-2]]) / (sizes[-1] - sizes[-2])
            verify.append(measured[lo] + slope * (k - lo))
        else:
            w = (k - lo) / (hi - lo)
            verify.append(measured[lo] * (1 - w) + measured[hi] * w)
    draft = timed(pair.draft, 1) if pair.draft is not None else 0.0
    return CostModel(draft, verify)


@dataclass
class Acceptance:
    """Per-token acceptance from (proposed, accepted) counts, decayed over steps."""

    successes: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    trials: float = PRIOR_WEIGHT

    @property
    def rate(self) -> float:
        return self.successes / self.trials if self.trials else PRIOR_ACCEPTANCE

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        # Accepted tokens are successes; the first rejection (if any) one failure.
        self.successes = self.successes * DECAY + accepted
        self.trials = self.trials * DECAY + accepted + (1 if accepted < proposed else 0)


@dataclass
class DraftController:
    """Per-process state for "auto": live costs and acceptance per drafter."""

    live: CostModel
    static: CostModel
    acceptance: dict = field(default_factory=dict)

    @classmethod
    def for_pair(cls, pair, calibrate: bool = True) -> DraftController:
        on_gpu = mx.default_device() == mx.gpu
        t_params = pair.info()["target_parameters"]
        d_params = pair.info()["draft_parameters"]
        static = static_costs(t_params, d_params, on_gpu)
        live = measure_costs(pair) if calibrate else static_costs(t_params, d_params, on_gpu)
        return cls(live=live, static=static)

    def plan(self, drafter: str, greedy: bool, k_max: int = MAX_AUTO_DRAFT) -> DraftPlan:
        """Start the per-request schedule for one request.

        A greedy request drafted by the model also gets a `lookup` sub-plan: on steps
        where the text so far repeats itself (its last two tokens occurred before),
        the tokens that followed last time are a free draft (see core.py). Greedy
        output does not depend on the drafts, so this changes speed only. Sampled
        requests keep to their one drafter, so their schedule stays fixed.
        """
        if greedy:
            plan = self._greedy_plan(drafter, k_max)
            if drafter == "model":
                plan.lookup = self._greedy_plan(HYBRID_LOOKUP, LOOKUP_MAX_DRAFT)
            return plan
        return DraftPlan(self.static, Acceptance(), k_max, drafter, shared=None)

    def _greedy_plan(self, key: str, k_max: int) -> DraftPlan:
        prior = self.acceptance.setdefault(key, Acceptance())
        start = Acceptance(prior.rate * PRIOR_WEIGHT, PRIOR_WEIGHT)
        drafter = "lookup" if key == HYBRID_LOOKUP else key
        return DraftPlan(self.live, start, k_max, drafter, shared=prior)


@dataclass
class DraftPlan:
    """One request's draft-length schedule: choose() before a step, observe() after."""

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

    def observe(self, proposed: int, accepted: int, verify_s: float, draft_s: float) -> None:
        self.acceptance.observe(proposed, accepted)
        if self.shared is not None:
            self.shared.observe(proposed, accepted)
            # Only a model drafter's timing says what a draft step costs.
            self.costs.observe(proposed, verify_s, draft_s if self.drafter == "model" else 0.0)
        if self.probing:
            # A failed probe waits twice as long before the next one.
            ok = accepted == proposed
            self.probe_interval = PROBE_FIRST if ok else min(self.probe_interval * 2, PROBE_MAX)
