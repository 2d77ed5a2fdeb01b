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
import report
from harness import Contender, Tally
from mlx_lm import batch_generate
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from engine.adaptive import expected_tokens

BASE = "(a) mlx-lm stream_generate, target only"


# -- (a)-(e): greedy decoding -------------------------------------------------------------


@dataclass
class Greedy:
    a: Tally
    b: dict[int, Tally]
    c: dict[int, Tally]
    d: Tally
    e: Tally
    lookup: Tally  # drafter "lookup" on these (not input-grounded) prompts, for reference
    prompts: int = 0


def greedy(pair, upair, prompts, s, log) -> Greedy:
    contenders = [Contender(BASE, harness.mlx_target_only(pair))]
    contenders += [
        Contender(f"b{k}", harness.mlx_speculative(pair, k), uses_draft=True) for k in s.mlx_ks
    ]
    contenders += [Contender(f"c{k}", harness.ours(pair, k), uses_draft=True) for k in s.our_ks]
    contenders += [
        Contender("d", harness.ours(pair, "auto"), uses_draft=True),
        Contender("e", harness.ours(upair, "auto"), uses_draft=True),
        Contender("lookup", harness.ours(pair, "auto", drafter="lookup")),
    ]
    harness.warm_up(contenders, prompts[0][1])
    t = harness.round_robin(contenders, prompts, s.max_tokens, pair, log)
    return Greedy(
        a=t[BASE],
        b={k: t[f"b{k}"] for k in s.mlx_ks},
        c={k: t[f"c{k}"] for k in s.our_ks},
        d=t["d"],
        e=t["e"],
        lookup=t["lookup"],
        prompts=len(prompts),
    )


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

    def batched():
        res = dict(engine.generate_many(pair, requests(), max_batch=32))
        outputs["batched"] = [res[i].token_ids for i in range(len(ids))]
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
    names = list(contenders)
    for p in range(s.job_passes):
        for name in names if p % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            tokens[name] += contenders[name]()
            seconds[name] += time.perf_counter() - t0
            log(f"  pass {p + 1}: {name}: {tokens[name] / seconds[name]:.1f} tok/s so far")
    same = sum(a == b for a, b in zip(outputs["batched"], outputs["sequential"], strict=True))
    pass_s = batched_pass_seconds(pair, ids, max(3, s.cost_reps // 3))
    # generate_many prefills each new row on its own, target then draft: time that apart.
    ours_prompt_s = sum(
        harness.prefill_seconds(pair.target, p) + harness.prefill_seconds(pair.draft, p)
        for p in ids
    )
    prompt_s = {"mlx": statistics.mean(mlx_prompt_s), "batched": ours_prompt_s}
    return Jobs(tokens, seconds, same, len(ids), pass_s, prompt_s)


# -- (i): the cost model ------------------------------------------------------------------------


@dataclass
class Costs:
    step_s: float  # one target decode step (1 token)
    verify: dict[int, float]  # v(K): target pass over K + 1 tokens / one decode step
    c: float  # draft step / target step
    a: float  # per-token acceptance, from the fixed-K runs of (c)
    predicted: dict[int, float]  # (1 - a^(K+1)) / (1 - a) / (v(K) + K c)
    predicted_mal: dict[int, float]  # the same with the measured acceptance length
    measured: dict[int, float]  # ours at fixed K, decode-only, vs (a) decode-only
    engine_verify: dict[int, float]  # what the engine's live cost model believes
    engine_c: float


def _timed_pass(model, cache, n: int) -> float:
    t0 = time.perf_counter()
    mx.eval(model(mx.array([[1] * n]), cache=cache))
    seconds = time.perf_counter() - t0
    trim_prompt_cache(cache, n)
    return seconds


def per_token_acceptance(stats: engine.SpecStats) -> float:
    """Accepted draft tokens / draft tokens that were looked at (those after the first
    rejection of a step are never judged): the i.i.d. acceptance a of the cost model."""
    dpp, app = stats.draft_tokens_per_position, stats.accepted_per_position
    if not dpp:
        return 0.0
    judged = dpp[0] + sum(min(app[i - 1], dpp[i]) for i in range(1, len(dpp)))
    return sum(app) / judged if judged else 0.0


def cost_model(pair, context: list[int], g: Greedy, s) -> Costs:
    t_cache, d_cache = make_prompt_cache(pair.target), make_prompt_cache(pair.draft)
    mx.eval(pair.target(mx.array([context]), cache=t_cache))
    mx.eval(pair.draft(mx.array([context]), cache=d_cache))
    sizes = list(range(1, 10))
    times: dict[int, list[float]] = {n: [] for n in sizes}
    draft_times = []
    for rep in range(s.cost_reps + 1):  # the first round warms up
        for n in sizes[rep % len(sizes) :] + sizes[: rep % len(sizes)]:
            t = _timed_pass(pair.target, t_cache, n)
            if rep:
                times[n].append(t)
        t = _timed_pass(pair.draft, d_cache, 1)
        if rep:
            draft_times.append(t)
    med = {n: statistics.median(times[n]) for n in sizes}
    step = med[1]
    verify = {k: med[k + 1] / step for k in range(0, 9)}
    c = statistics.median(draft_times) / step
    pooled = engine.SpecStats(drafter="model")
    for tally in g.c.values():
        pooled.merge(tally.stats)
    a = per_token_acceptance(pooled)
    predicted = {k: expected_tokens(a, k) / (verify[k] + k * c) for k in s.our_ks}
    predicted_mal = {
        k: g.c[k].acceptance_length / (verify[k] + k * c) for k in s.our_ks if g.c[k].steps
    }
    base = g.a.decode_rate
    measured = {k: g.c[k].decode_rate / base if base else 0.0 for k in s.our_ks}
    live = pair.controller.live
    return Costs(
        step_s=step,
        verify=verify,
        c=c,
        a=a,
        predicted=predicted,
        predicted_mal=predicted_mal,
        measured=measured,
        engine_verify={k: live.verify[k] / live.verify[0] for k in range(0, 9)},
        engine_c=live.draft_step / live.verify[0],
    )


# -- markdown ------------------------------------------------------------------------------


def _row(label: str, t: Tally, base: Tally, ref_outputs=None) -> list[str]:
    same = "-"
    if ref_outputs is not None:
        n = sum(x == y for x, y in zip(t.outputs, ref_outputs, strict=True))
        same = f"{n}/{len(ref_outputs)}"
    sd = t.stats.to_dict() if t.stats is not None else None
    ratios = [r / b for r, b in zip(t.rates, base.rates, strict=True) if b]
    return [
        label,
        f"{t.rate:.1f}",
        f"{t.rate / base.rate:.2f}x",
        f"{min(ratios):.2f}-{max(ratios):.2f}x",
        f"{t.decode_rate / base.decode_rate:.2f}x",
        f"{t.acceptance_length:.2f}",
        f"{sd['draft_acceptance_rate']:.2f}" if sd and sd["num_draft_tokens"] else "-",
        same,
    ]


GREEDY_HEADER = [
    "row",
    "tokens/s",
    "vs (a)",
    "per-prompt range vs (a)",
    "decode-only vs (a)",
    "tokens per target pass",
    "draft acceptance",
    "same tokens as (a)",
]


def render(s, facts, g: Greedy, lookup_res, accept: Sampled, jobs_res: Jobs, costs: Costs, quick):
    a = g.a
    ref = a.outputs
    best_b = max(g.b, key=lambda k: g.b[k].rate)
    best_c = max(g.c, key=lambda k: g.c[k].rate)
    rows = [_row(BASE + " (baseline)", a, a, ref)]
    rows += [
        _row(f"(b) mlx-lm speculative, k={k}" + (" **best**" if k == best_b else ""), t, a, ref)
        for k, t in g.b.items()
    ]
    rows += [
        _row(f"(c) ours, k={k}" + (" **best**" if k == best_c else ""), t, a, ref)
        for k, t in g.c.items()
    ]
    rows.append(_row('(d) ours, "auto"', g.d, a, ref))
    rows.append(_row('(e) ours, "auto", useless draft', g.e, a, ref))
    rows.append(_row('(f\') ours, drafter "lookup", "auto" (these prompts)', g.lookup, a, ref))

    la, lf, lookup_len = lookup_res
    lookup_rows = [
        _row(BASE, la, la, la.outputs),
        _row('(f) ours, drafter "lookup", "auto"', lf, la, la.outputs),
    ]

    j = jobs_res
    rate = {n: j.tokens[n] / j.seconds[n] for n in j.tokens}
    per_pass = {n: j.seconds[n] / s.job_passes for n in j.seconds}
    job_rows = [
        [
            "(h) ours batched (generate_many, max_batch 32, auto)",
            f"{rate['batched']:.1f}",
            f"{per_pass['batched']:.1f}",
            f"~{j.prompt_s['batched']:.1f} (one row at a time, measured apart)",
        ],
        [
            "(h) ours sequential (generate, one by one, auto)",
            f"{rate['sequential']:.1f}",
            f"{per_pass['sequential']:.1f}",
            "-",
        ],
        [
            "(h) mlx-lm batch_generate, no draft",
            f"{rate['mlx']:.1f}",
            f"{per_pass['mlx']:.1f}",
            f"{j.prompt_s['mlx']:.1f} (its own stats)",
        ],
    ]

    t0 = j.pass_s[0]
    pass_rows = [
        [
            str(k),
            f"{t * 1000:.0f}",
            f"{t / t0:.2f}",
            f"{expected_tokens(costs.a, k):.2f}",
            f"{expected_tokens(costs.a, k) / (t / t0):.2f}x",
        ]
        for k, t in j.pass_s.items()
    ]

    pred_best = max(costs.predicted, key=costs.predicted.get)
    meas_best = max(costs.measured, key=costs.measured.get)
    share = costs.measured[meas_best] / costs.predicted[pred_best]
    cost_rows = [
        [
            str(k),
            f"{costs.verify[k]:.2f}",
            f"{costs.engine_verify[k]:.2f}",
            f"{expected_tokens(costs.a, k):.2f}",
            f"{g.c[k].acceptance_length:.2f}",
            f"{costs.predicted[k]:.2f}x",
            f"{costs.predicted_mal.get(k, 0):.2f}x",
            f"{costs.measured[k]:.2f}x",
        ]
        for k in s.our_ks
    ]

    targets = [
        report.Target(
            '(d) "auto" vs best mlx-lm speculative (b)', g.d.rate / g.b[best_b].rate, 1.15
        ),
        report.Target('(d) "auto" vs best fixed K of ours (c)', g.d.rate / g.c[best_c].rate, 0.95),
        report.Target("(e) auto with a useless draft vs (a)", g.e.rate / a.rate, 0.97),
        report.Target("(f) lookup vs (a), input-grounded prompts", lf.rate / la.rate, 1.3),
        report.Target(
            f"(g) mean acceptance length at T=1, ours / mlx-lm (k={s.temp_k})",
            accept.ours / accept.mlx,
            1.15,
        ),
        report.Target(
            "(h) batched vs the better of mlx-lm batch_generate and our sequential",
            rate["batched"] / max(rate["mlx"], rate["sequential"]),
            1.2,
        ),
        report.Target("(i) ours at best fixed K / cost-model prediction", share * 100, 90, "%"),
    ]
    n = g.prompts
    parts = [
        "## Speculative decoding (`benchmarks/bench.py`)" + (" — QUICK RUN" if quick else ""),
        f"Command: `{report.command_line()}`",
        report.machine_facts(facts),
        "### Targets",
        report.targets_table(targets),
        f"### (a)-(e) Greedy, {n} held-out code prompts of {s.prompt_tokens} tokens, "
        f"{s.max_tokens} new tokens each",
        "Contenders ran round-robin per prompt, order rotated. tokens/s is end to end "
        "(prefill included), summed over the prompts; the per-prompt range shows how much "
        "single prompts scatter on this shared, noisy machine; *decode-only* subtracts the "
        "target (and draft) prefill time of "
        "the same prompts, measured apart. *Tokens per target pass* is the mean acceptance "
        "length (1.00 for plain decoding).",
        report.table(GREEDY_HEADER, rows),
        f"### (f) Prompt lookup, {len(la.outputs)} input-grounded prompts "
        f"(~{lookup_len} tokens: a held-out function, then the start of the same function "
        f"again), {s.lookup_max_tokens} new tokens",
        report.table(GREEDY_HEADER, lookup_rows),
        f"### (g) Mean acceptance length at temperature 1, k={s.temp_k}",
        report.table(
            ["engine", "tokens per target pass", "runs"],
            [
                ["ours (speculative sampling)", f"{accept.ours:.3f}", str(accept.runs)],
                [
                    'mlx-lm ("draft token equals sampled token")',
                    f"{accept.mlx:.3f}",
                    str(accept.runs),
                ],
            ],
        )
        + f"\n\n{accept.runs} runs ({s.temp_prompts} prompts x {s.temp_seeds} seeds), "
        f"{s.temp_max_tokens} new tokens each; ours' draft acceptance rate "
        f"{accept.stats.to_dict()['draft_acceptance_rate']:.3f}.",
        f"### (h) {j.jobs} jobs of {s.job_max_tokens} new tokens (greedy)",
        report.table(
            ["contender", "tokens/s", "seconds per pass", "of which prompt processing (s)"],
            job_rows,
        )
        + f"\n\n{s.job_passes} pass(es) over the jobs"
        + (", the order of contenders reversed on the second" if s.job_passes > 1 else "")
        + f"; tokens/s = completion tokens / wall time. Batched outputs equal to sequential "
        f"ones: {j.identical}/{j.jobs}.",
        f"Why batching and speculation compete here: one target pass over K + 1 tokens "
        f"for each of the {j.jobs} rows, at the prompts' context (median of "
        f"{max(3, s.cost_reps // 3)}), against the tokens it would yield at the per-token "
        f"acceptance a = {costs.a:.3f} of (i) (draft cost left out, so the last column is "
        "an upper bound of batched speculation's gain over batched plain decoding):",
        report.table(
            ["K", "batch pass (ms)", "vs K=0", "E(K) from a", "upper bound of gain"],
            pass_rows,
        ),
        "### (i) Cost model",
        f"Measured on this pair at a {s.prompt_tokens}-token context: one target decode step "
        f"{costs.step_s * 1000:.1f} ms; draft step cost ratio c = {costs.c:.3f} "
        f"(engine's live model: {costs.engine_c:.3f}); per-token acceptance a = "
        f"{costs.a:.3f} (pooled over the fixed-K runs of (c)). Predicted speedup = "
        "(1 - a^(K+1)) / (1 - a) / (v(K) + K c); measured = ours at fixed K, decode-only, "
        "vs (a) decode-only.",
        report.table(
            [
                "K",
                "v(K) measured",
                "v(K) engine's live model",
                "E(K) from a",
                "E(K) measured",
                "predicted",
                "predicted with measured E",
                "ours measured",
            ],
            cost_rows,
        )
        + f"\n\nBest predicted K = {pred_best} ({costs.predicted[pred_best]:.2f}x); best "
        f"measured K = {meas_best} ({costs.measured[meas_best]:.2f}x): {share * 100:.0f}% of "
        "the prediction.",
    ]
    return "\n\n".join(parts) + "\n"
