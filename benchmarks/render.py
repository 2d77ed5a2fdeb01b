"""The markdown of bench.py: tables of rows (a)-(i) and the targets with verdicts.

Speed ratios are medians of per-prompt ratios (each prompt's contenders ran back to
back), so one load burst on this shared machine moves one ratio, not the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import report
from harness import Tally, median_ratio, ratios
from sections import BASE, Costs, Jobs, Sampled

from engine.draft_length import expected_tokens

LABELS = {
    BASE: "(a) mlx-lm stream_generate, target only (baseline)",
    "d": '(d) ours, "auto"',
    "e": '(e) ours, "auto", useless draft',
    "lookup": '(f\') ours, drafter "lookup", "auto" (these prompts)',
}
HEADER = [
    "row",
    "tokens/s (sum)",
    "vs (a), median",
    "per-prompt range",
    "decode-only vs (a), median",
    "tokens per target pass",
    "draft acceptance",
    "same tokens as (a)",
]


def label(name: str) -> str:
    if name in LABELS:
        return LABELS[name]
    k = name[1:]
    return f"(b) mlx-lm speculative, k={k}" if name[0] == "b" else f"(c) ours, k={k}"


def row(text: str, t: Tally, base: Tally) -> list[str]:
    same = sum(x == y for x, y in zip(t.outputs, base.outputs, strict=True))
    sd = t.stats.to_dict() if t.stats is not None else None
    r = ratios(t, base)
    return [
        text,
        f"{t.rate:.1f}",
        f"{median_ratio(t, base):.2f}x",
        f"{min(r):.2f}-{max(r):.2f}x",
        f"{median_ratio(t, base, decode=True):.2f}x",
        f"{t.acceptance_length:.2f}",
        f"{sd['draft_acceptance_rate']:.2f}" if sd and sd["num_draft_tokens"] else "-",
        f"{same}/{len(base.outputs)}",
    ]


def greedy_table(t: dict[str, Tally], best: dict[str, int]) -> str:
    rows = []
    for name, tally in t.items():
        text = label(name)
        if name[0] in best and name[1:] == str(best[name[0]]):
            text += " **best**"
        rows.append(row(text, tally, t[BASE]))
    return report.table(HEADER, rows)


@dataclass
class Results:
    """Everything bench.py measured."""

    survey: dict[str, Tally]
    confirm: dict[str, Tally]
    kb: int  # best mlx-lm draft length in the survey
    kc: int  # best fixed draft length of ours in the survey
    lookup: tuple[Tally, Tally, int]
    sampled: Sampled
    jobs: Jobs
    costs: Costs


def targets(s, r: Results) -> list[report.Target]:
    c, kp = r.confirm, r.costs.best
    better, batched_ratio = r.jobs.batched_vs_best()
    la, lf, _ = r.lookup
    ours_at_kp = median_ratio(c[f"c{kp}"], c[BASE], decode=True)
    return [
        report.Target(
            f'(d) "auto" vs best mlx-lm speculative (b), k={r.kb}',
            median_ratio(c["d"], c[f"b{r.kb}"]),
            1.15,
        ),
        report.Target(
            f'(d) "auto" vs best fixed K of ours (c), K={r.kc}',
            median_ratio(c["d"], c[f"c{r.kc}"]),
            0.95,
        ),
        report.Target("(e) auto with a useless draft vs (a)", median_ratio(c["e"], c[BASE]), 0.97),
        report.Target("(f) lookup vs (a), input-grounded prompts", median_ratio(lf, la), 1.3),
        report.Target(
            f"(g) mean acceptance length at T=1, ours / mlx-lm (k={s.temp_k})",
            r.sampled.ours / r.sampled.mlx,
            1.15,
        ),
        report.Target(
            "(h) batched vs the better of mlx-lm batch_generate and our sequential "
            f"({'mlx-lm' if better == 'mlx' else 'sequential'})",
            batched_ratio,
            1.2,
        ),
        report.Target(
            f"(i) ours at the predicted best K={kp}, decode-only, / the prediction "
            f"{r.costs.predicted[kp]:.2f}x",
            ours_at_kp / r.costs.predicted[kp] * 100,
            90,
            "%",
        ),
    ]


def _batched_drafting(j: Jobs) -> str:
    sd = j.batched_stats.to_dict()
    return (
        f'Batched "auto" drafted {sd["num_draft_tokens"]:,} tokens for '
        f"{j.batched_stats.num_emitted_tokens:,} emitted ({sd['draft_acceptance_rate']:.2f} "
        f"accepted), {sd['mean_acceptance_length']:.2f} tokens per row per target pass."
    )


def jobs_section(s, j: Jobs, a: float) -> list[str]:
    rate = {n: j.tokens[n] / j.seconds[n] for n in j.tokens}
    runs = {n: len(j.rates[n]) for n in j.rates}
    spread = {n: f"{min(v):.1f}-{max(v):.1f}" for n, v in j.rates.items()}
    rows = [
        [
            "(h) ours batched (generate_many, max_batch 32, auto)",
            f"{rate['batched']:.1f}",
            f"{spread['batched']} ({runs['batched']} runs)",
            "-",
        ],
        [
            "(h) ours sequential (generate, one by one, auto)",
            f"{rate['sequential']:.1f}",
            f"{spread['sequential']} ({runs['sequential']} runs)",
            "-",
        ],
        [
            "(h) mlx-lm batch_generate, no draft",
            f"{rate['mlx']:.1f}",
            f"{spread['mlx']} ({runs['mlx']} runs)",
            f"{j.prompt_s['mlx']:.1f} of {j.seconds['mlx'] / runs['mlx']:.1f} (its own stats)",
        ],
    ]
    better, ratio = j.batched_vs_best()
    t0 = j.pass_s[0]
    pass_rows = [
        [
            str(k),
            f"{t * 1000:.0f}",
            f"{t / t0:.2f}",
            f"{expected_tokens([a], k):.2f}",
            f"{expected_tokens([a], k) / (t / t0):.2f}x",
        ]
        for k, t in j.pass_s.items()
    ]
    return [
        f"### (h) {j.jobs} jobs of {s.job_max_tokens} new tokens (greedy)",
        report.table(
            ["contender", "tokens/s (sum)", "tokens/s per run", "prompt processing (s per run)"],
            rows,
        )
        + f"\n\n{s.job_passes} pass(es) over the jobs: batched and mlx-lm back to back in every "
        "pass, in alternating order; sequential in the first and the last. Batched over "
        f"{'mlx-lm' if better == 'mlx' else 'sequential'}: {ratio:.2f}x"
        + (" (median of the per-pass ratios)" if better == "mlx" else "")
        + f". Batched outputs equal to sequential ones: {j.identical}/{j.jobs}. "
        + _batched_drafting(j),
        f"Why batching and speculation compete here: one target pass over K + 1 tokens for "
        f"each of the {j.jobs} rows, at the prompts' context, against the tokens it would "
        f"yield at the per-token acceptance a = {a:.3f} of (i) (draft cost left out, so the "
        "last column is an upper bound of batched speculation's gain over batched plain "
        "decoding):",
        report.table(
            ["K", "batch pass (ms)", "vs K=0", "E(K) from a", "upper bound of gain"], pass_rows
        ),
    ]


def cost_section(s, costs: Costs, survey: dict[str, Tally], confirm: dict[str, Tally]) -> list[str]:
    kp = costs.best
    rows = [
        [
            str(k),
            f"{costs.verify[k]:.2f}",
            f"{expected_tokens([costs.a], k):.2f}",
            f"{survey[f'c{k}'].acceptance_length:.2f}",
            f"{costs.predicted[k]:.2f}x",
            f"{costs.predicted_mal[k]:.2f}x",
            f"{median_ratio(survey[f'c{k}'], survey[BASE], decode=True):.2f}x",
        ]
        for k in s.our_ks
    ]
    confirmed = median_ratio(confirm[f"c{kp}"], confirm[BASE], decode=True)
    return [
        "### (i) Cost model",
        "Costs measured on this pair at each survey prompt's context, once per prompt inside "
        f"the round robin ({s.cost_reps} repetitions, medians): one target decode step "
        f"{costs.step_s * 1000:.1f} ms; v(K) = a target pass over K + 1 tokens / that step; draft step cost ratio c = {costs.c:.3f}; per-token acceptance a = {costs.a:.3f} (pooled "
        "over the fixed-K runs of the survey). Predicted speedup = (1 - a^(K+1)) / (1 - a) / "
        "(v(K) + K c); ours = fixed K, decode-only, median per-prompt ratio vs (a).",
        report.table(
            [
                "K",
                "v(K) measured",
                "E(K) from a",
                "E(K) measured",
                "predicted",
                "predicted with measured E(K)",
                "ours (survey)",
            ],
            rows,
        )
        + f"\n\nThe prediction's best K is {kp} ({costs.predicted[kp]:.2f}x); ours at K={kp} "
        f"in the confirmation round: {confirmed:.2f}x decode-only "
        f"({confirmed / costs.predicted[kp] * 100:.0f}% of the prediction).",
    ]


def render(s, facts: dict, r: Results, quick: bool) -> str:
    la, lf, lookup_len = r.lookup
    a = r.sampled
    n1, n2 = len(r.survey[BASE].outputs), len(r.confirm[BASE].outputs)
    parts = [
        "## Speculative decoding (`benchmarks/bench.py`)" + (" — QUICK RUN" if quick else ""),
        f"Command: `{report.command_line()}`",
        report.machine_facts(facts),
        "### Targets",
        "Speed ratios are medians of per-prompt ratios from the confirmation round "
        "(below), where each prompt's contenders ran back to back.",
        report.targets_table(targets(s, r)),
        f"### (a)-(e) Greedy survey: {n1} held-out code prompts of {s.prompt_tokens} tokens, "
        f"{s.max_tokens} new tokens each",
        "Every contender on every prompt, round-robin, the order rotated from prompt to "
        "prompt. tokens/s sums tokens and wall time over the prompts (prefill included); the "
        "ratios are medians of per-prompt ratios and the range shows how much single prompts "
        "scatter on this shared, noisy machine; *decode-only* removes the target (and draft) "
        "prefill time of the prompt, measured apart. *Tokens per target pass* is the mean "
        "acceptance length (1.00 for plain decoding). The best K is the highest median.",
        greedy_table(r.survey, {"b": r.kb, "c": r.kc}),
        f"### (a)-(e) Confirmation: {n2} other held-out prompts, only the contenders the "
        "targets compare",
        "Choosing the best of several noisy contenders favours the luckiest one; measuring "
        "the chosen ones again on fresh prompts removes that bias.",
        greedy_table(r.confirm, {}),
        f"### (f) Prompt lookup, {len(la.outputs)} input-grounded prompts (~{lookup_len} "
        "tokens: a held-out function, then the start of the same function again), "
        f"{s.lookup_max_tokens} new tokens",
        report.table(
            HEADER, [row(LABELS[BASE], la, la), row('(f) ours, drafter "lookup", "auto"', lf, la)]
        ),
        f"### (g) Mean acceptance length at temperature 1, k={s.temp_k}",
        report.table(
            ["engine", "tokens per target pass", "runs"],
            [
                ["ours (speculative sampling)", f"{a.ours:.3f}", str(a.runs)],
                ['mlx-lm ("draft token equals sampled token")', f"{a.mlx:.3f}", str(a.runs)],
            ],
        )
        + f"\n\n{a.runs} runs ({s.temp_prompts} prompts x {s.temp_seeds} seeds), "
        f"{s.temp_max_tokens} new tokens each; ours' draft acceptance rate "
        f"{a.stats.to_dict()['draft_acceptance_rate']:.3f}.",
        *jobs_section(s, r.jobs, r.costs.a),
        *cost_section(s, r.costs, r.survey, r.confirm),
    ]
    return "\n\n".join(parts) + "\n"
