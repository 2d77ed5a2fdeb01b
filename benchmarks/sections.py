"""The benchmark's parts, rows (a)-(i), and the markdown they render to.

Every timed comparison runs its contenders interleaved in this one process; see
harness.round_robin. Greedy outputs are compared token for token with the baseline's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import engine  # first: loads OpenBLAS before mlx is imported

# isort: split
import harness
import mlx.core as mx
from harness import Contender, Tally
from mlx_lm import batch_generate
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from engine.draft_length import expected_tokens

BASE = "a"


# -- (a)-(e): greedy decoding, a survey round and a confirmation round ----------------------


def greedy_contenders(pair, upair, s) -> list[Contender]:
    """Every greedy contender of rows (a)-(e), plus lookup on the same prompts."""
    out = [Contender(BASE, harness.mlx_target_only(pair))]
    out += [Contender(f"b{k}", harness.mlx_speculative(pair, k), True) for k in s.mlx_ks]
    out += [Contender(f"c{k}", harness.ours(pair, k), True) for k in s.our_ks]
    out += [
        Contender("d", harness.ours(pair, "auto"), True),
        Contender("e", harness.ours(upair, "auto"), True),
        Contender("lookup", harness.ours(pair, "auto", drafter="lookup")),
    ]
    return out


def survey(pair, upair, prompts, s, log, probe=None) -> dict[str, Tally]:
    """Round 1: every contender on every prompt (rows (a)-(e) in full)."""
    contenders = greedy_contenders(pair, upair, s)
    harness.warm_up(contenders, prompts[0][1])
    return harness.round_robin(contenders, prompts, s.max_tokens, pair, log, probe)


def best_k(tallies: dict[str, Tally], prefix: str, ks) -> int:
    """The draft length whose contender had the highest median speed ratio vs (a)."""
    return max(ks, key=lambda k: harness.median_ratio(tallies[f"{prefix}{k}"], tallies[BASE]))


def confirm(pair, upair, prompts, s, names: list[str], log, probe=None) -> dict[str, Tally]:
    """Round 2, on other prompts: only the contenders the targets compare, so picking
    the best K in round 1 (the luckiest of several noisy runs) does not bias them."""
    everyone = {c.name: c for c in greedy_contenders(pair, upair, s)}
    contenders = [everyone[n] for n in names]
    return harness.round_robin(contenders, prompts, s.max_tokens, pair, log, probe)


# -- (f): prompt lookup on input-grounded prompts ----------------------------------------------


def lookup(pair, prompts, s, log) -> tuple[Tally, Tally, int]:
    contenders = [
        Contender(BASE, harness.mlx_target_only(pair)),
        Contender("f", harness.ours(pair, "auto", drafter="lookup")),
    ]
    harness.warm_up(contenders, prompts[0][1])
    t = harness.round_robin(contenders, prompts, s.lookup_max_tokens, pair, log)
    prompt_tokens = sum(len(ids) for _, ids in prompts) // len(prompts)
    return t[BASE], t["f"], prompt_tokens


# -- (g): mean acceptance length at temperature 1 ---------------------------------------------


@dataclass
class Sampled:
    ours_tokens: int = 0
    ours_steps: int = 0
    mlx_tokens: int = 0
    mlx_steps: int = 0
    runs: int = 0
    stats: engine.SpecStats = field(default_factory=lambda: engine.SpecStats(drafter="model"))

    @property
    def ours(self) -> float:
        return self.ours_tokens / self.ours_steps if self.ours_steps else 0.0

    @property
    def mlx(self) -> float:
        return self.mlx_tokens / self.mlx_steps if self.mlx_steps else 0.0


def temperature(pair, prompts, s, log) -> Sampled:
    out = Sampled()
    for i, (_, ids) in enumerate(prompts):
        for seed in range(s.temp_seeds):
            run = harness.ours(pair, s.temp_k, temperature=1.0, seed=seed)(ids, s.temp_max_tokens)
            out.ours_tokens += len(run.tokens)
            out.ours_steps += run.steps
            out.stats.merge(run.stats)
            n, steps = harness.mlx_acceptance_length(
                pair, ids, s.temp_max_tokens, s.temp_k, 1.0, seed
            )
            out.mlx_tokens += n
            out.mlx_steps += steps
            out.runs += 1
        log(f"  prompt {i + 1}/{len(prompts)}: ours {out.ours:.3f}, mlx-lm {out.mlx:.3f}")
    return out


# -- (h): many jobs: batched vs sequential vs mlx-lm batch_generate ------------------------


@dataclass
class Jobs:
    tokens: dict[str, int]
    seconds: dict[str, float]
    identical: int  # batched outputs equal to the sequential ones (greedy: they must)
    jobs: int
    pass_s: dict[int, float] = field(default_factory=dict)  # whole-batch target pass, K drafts
    prompt_s: dict[str, float] = field(default_factory=dict)  # prompt processing per pass
    rates: dict[str, list[float]] = field(default_factory=dict)  # tokens/s of each pass
    batched_stats: engine.SpecStats | None = None  # summed over every batched run

    def batched_vs_best(self) -> tuple[str, float]:
        """The better of mlx-lm batch_generate and our sequential (by total tokens/s), and
        batched's speed over it: for mlx-lm, the median of per-pass ratios (each pass ran
        both back to back)."""
        rate = {n: self.tokens[n] / self.seconds[n] for n in self.tokens}
        if rate["mlx"] >= rate["sequential"]:
            pairs = zip(self.rates["batched"], self.rates["mlx"], strict=True)
            return "mlx", statistics.median(b / m for b, m in pairs)
        return "sequential", rate["batched"] / rate["sequential"]


def batched_pass_seconds(pair, ids: list[list[int]], reps: int, ks=(0, 1, 2, 3, 4)) -> dict:
    """Median seconds of one target pass over K + 1 tokens for every row of the batch
    (what one batched verify step costs), at the prompts' context."""
    width = min(len(p) for p in ids)
    cache = make_prompt_cache(pair.target)
    mx.eval(pair.target(mx.array([p[:width] for p in ids]), cache=cache))
    times: dict[int, list[float]] = {k: [] for k in ks}
    for rep in range(reps + 1):  # the first round warms up
        for k in ks:
            t0 = time.perf_counter()
            mx.eval(pair.target(mx.array([[1] * (k + 1)] * len(ids)), cache=cache))
            if rep:
                times[k].append(time.perf_counter() - t0)
            trim_prompt_cache(cache, k + 1)
    return {k: statistics.median(v) for k, v in times.items()}


def jobs(pair, prompts, s, log) -> Jobs:
    ids = [p for _, p in prompts]

    def requests():
        return [
            engine.GenerationRequest(prompt_ids=p, max_tokens=s.job_max_tokens, temperature=0.0)
            for p in ids
        ]

    outputs: dict[str, list] = {}

    batched_stats = engine.SpecStats(drafter="model")

    def batched():
        res = dict(engine.generate_many(pair, requests(), max_batch=32))
        outputs["batched"] = [res[i].token_ids for i in range(len(ids))]
        for r in res.values():
            batched_stats.merge(r.stats)
        return sum(len(t) for t in outputs["batched"])

    def sequential():
        outputs["sequential"] = [engine.generate(pair, r).token_ids for r in requests()]
        return sum(len(t) for t in outputs["sequential"])

    mlx_prompt_s = []

    def mlx_batch():
        r = batch_generate(
            pair.target, pair.tokenizer, ids, max_tokens=s.job_max_tokens, return_token_ids=True
        )
        mlx_prompt_s.append(r.stats.prompt_time)
        return sum(len(t) for t in r.token_ids)

    contenders = {"batched": batched, "sequential": sequential, "mlx": mlx_batch}
    tokens = dict.fromkeys(contenders, 0)
    seconds = dict.fromkeys(contenders, 0.0)
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for p in range(s.job_passes):
        # batched and mlx-lm every pass, in alternating order; sequential (3x slower
        # than either, so not the one to beat) in the first and the last pass.
        names = ["batched", "mlx"] if p % 2 == 0 else ["mlx", "batched"]
        if p in (0, s.job_passes - 1):
            names = ["sequential", *names] if p == 0 else [*names, "sequential"]
        for name in names:
            t0 = time.perf_counter()
            n = contenders[name]()
            dt = time.perf_counter() - t0
            tokens[name] += n
            seconds[name] += dt
            rates[name].append(n / dt)
            log(f"  pass {p + 1}: {name}: {n / dt:.1f} tok/s")
    same = sum(a == b for a, b in zip(outputs["batched"], outputs["sequential"], strict=True))
    pass_s = batched_pass_seconds(pair, ids, max(3, s.cost_reps))
    prompt_s = {"mlx": statistics.mean(mlx_prompt_s)}
    return Jobs(tokens, seconds, same, len(ids), pass_s, prompt_s, rates, batched_stats)


# -- (i): the cost model ------------------------------------------------------------------------


@dataclass
class Costs:
    step_s: float  # one target decode step (1 token)
    verify: dict[int, float]  # v(K): target pass over K + 1 tokens / one decode step
    c: float  # draft step / target step
    a: float  # per-token acceptance, from the fixed-K runs of round 1
    predicted: dict[int, float]  # (1 - a^(K+1)) / (1 - a) / (v(K) + K c)
    predicted_mal: dict[int, float]  # the same with the measured acceptance length

    @property
    def best(self) -> int:
        return max(self.predicted, key=self.predicted.get)


def _timed_pass(model, cache, n: int) -> float:
    t0 = time.perf_counter()
    mx.eval(model(mx.array([[1] * n]), cache=cache))
    seconds = time.perf_counter() - t0
    trim_prompt_cache(cache, n)
    return seconds


class CostProbe:
    """Times target passes over 1..9 tokens and a draft step at a prompt's context.

    Called once per prompt inside the round robin, so the costs are measured under the
    same conditions as the contenders; each repetition's sizes run back to back and
    are kept as ratios to that repetition's 1-token pass.
    """

    SIZES = tuple(range(1, 10))

    def __init__(self, pair, reps: int):
        self.pair = pair
        self.reps = reps
        self.ratios: dict[int, list[float]] = {n: [] for n in self.SIZES}
        self.step: list[float] = []
        self.draft: list[float] = []
        self.warm = False

    def __call__(self, ids: list[int]) -> None:
        t_cache = make_prompt_cache(self.pair.target)
        d_cache = make_prompt_cache(self.pair.draft)
        mx.eval(self.pair.target(mx.array([ids]), cache=t_cache))
        mx.eval(self.pair.draft(mx.array([ids]), cache=d_cache))
        sizes = list(self.SIZES)
        for _ in range(self.reps + (0 if self.warm else 1)):
            shift = len(self.step) % len(sizes)
            times = {n: _timed_pass(self.pair.target, t_cache, n) for n in sizes[shift:]}
            times.update({n: _timed_pass(self.pair.target, t_cache, n) for n in sizes[:shift]})
            draft = _timed_pass(self.pair.draft, d_cache, 1)
            if not self.warm:  # the very first repetition only warms up
                self.warm = True
                continue
            self.step.append(times[1])
            self.draft.append(draft / times[1])
            for n in sizes:
                self.ratios[n].append(times[n] / times[1])


def per_token_acceptance(stats: engine.SpecStats) -> float:
    """Accepted draft tokens / draft tokens that were looked at (those after the first
    rejection of a step are never judged): the i.i.d. acceptance a of the cost model."""
    dpp, app = stats.draft_tokens_per_position, stats.accepted_per_position
    if not dpp:
        return 0.0
    judged = dpp[0] + sum(min(app[i - 1], dpp[i]) for i in range(1, len(dpp)))
    return sum(app) / judged if judged else 0.0


def cost_model(probe: CostProbe, t: dict[str, Tally], s) -> Costs:
    """Costs from the probes (medians), acceptance from the survey's fixed-K runs: all
    measured here (the engine times nothing at start-up to compare them with)."""
    verify = {k: statistics.median(probe.ratios[k + 1]) for k in range(0, 9)}
    c = statistics.median(probe.draft)
    pooled = engine.SpecStats(drafter="model")
    for k in s.our_ks:
        pooled.merge(t[f"c{k}"].stats)
    a = per_token_acceptance(pooled)
    return Costs(
        step_s=statistics.median(probe.step),
        verify=verify,
        c=c,
        a=a,
        predicted={k: expected_tokens([a], k) / (verify[k] + k * c) for k in s.our_ks},
        predicted_mal={k: t[f"c{k}"].acceptance_length / (verify[k] + k * c) for k in s.our_ks},
    )
