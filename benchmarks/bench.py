"""Speculative-decoding benchmark (GitHub issue 4): our engine against mlx-lm, one process.

    python benchmarks/bench.py            # the full run (tens of minutes on a 2-core CPU)
    python benchmarks/bench.py --quick    # a tiny version (< 1 minute), for tests

Builds the benchmark pair (the demo target widened to ~100M parameters with MLP units
that contribute exactly zero, plus a random "useless" draft), runs every contender on
held-out code prompts in rotating round-robin order, and writes a markdown table of
ratios and target verdicts to stdout (and to the `bench` section of --out FILE).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import engine  # first: loads OpenBLAS before anything imports mlx

# isort: split
import mlx_lm

from engine.loading import DEMO_DRAFT, DEMO_TARGET

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pairs  # noqa: E402
import prompts as prompt_sets  # noqa: E402
import render  # noqa: E402
import report  # noqa: E402
import sections  # noqa: E402


@dataclass(frozen=True)
class Settings:
    total_params: int  # the widened target's size
    prompts: int  # held-out code prompts for the survey of rows (a)-(e)
    prompt_tokens: int
    max_tokens: int
    lookup_prompts: int  # row (f)
    lookup_max_tokens: int
    temp_prompts: int  # row (g)
    temp_seeds: int
    temp_k: int
    temp_max_tokens: int
    jobs: int  # row (h)
    job_max_tokens: int
    job_passes: int  # batched and mlx-lm each pass; sequential in the first and last
    cost_reps: int  # row (i): timed passes per size and prompt
    confirm_prompts: int  # other prompts for the confirmation round of (a)-(e)
    mlx_ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    our_ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8)


FULL = Settings(100_000_000, 6, 64, 96, 4, 96, 4, 2, 4, 64, 32, 64, 6, 2, 10)
QUICK = Settings(6_000_000, 2, 32, 12, 2, 16, 2, 1, 4, 12, 8, 8, 1, 1, 2)


def log(message: str) -> None:
    print(f"[{time.monotonic() - START:7.1f}s] {message}", file=sys.stderr, flush=True)


START = time.monotonic()


def load_pairs(args, s: Settings):
    """The widened pair, the same target with the useless draft, and facts about them."""
    target_dir, draft_dir = Path(args.target), Path(args.draft)
    for role, d in (("target", target_dir), ("draft", draft_dir)):
        if not (d / "config.json").exists():
            raise SystemExit(
                f"bench: no {role} model at {d} (the bundled demo pair is engine/demo/; "
                f"pass --{role} DIR to use another)"
            )
    before, inter = pairs.widened_size(target_dir, s.total_params)
    log(f"widening {target_dir} ({before:,} parameters) to intermediate_size {inter}")
    widened = pairs.widen(target_dir, s.total_params, cache=args.cache)
    useless = pairs.useless_draft(draft_dir, cache=args.cache)
    log(f"loading {widened} + {draft_dir}")
    pair = engine.load_pair(widened, draft_dir)
    upair = pairs.with_draft(pair, useless, pair.name + "+useless")
    info = pair.info()
    if not info["blas"].startswith(("OpenBLAS", "Accelerate")):
        log(f"WARNING: slow BLAS: {info['blas']}")
    facts = {
        "BLAS": info["blas"],
        "target": f"{target_dir} (sha256 {pairs.digest(target_dir)}) widened to "
        f"intermediate_size {inter}: {info['target_parameters']:,} parameters "
        f"(from {before:,}), fp32",
        "draft": f"{draft_dir} (sha256 {pairs.digest(draft_dir)}): "
        f"{info['draft_parameters']:,} parameters",
        "useless draft": "same shape, random weights (seed 1234)",
    }
    return pair, upair, target_dir, facts


def check_function(pair, target_dir: Path, prompts: list) -> float:
    original, _ = mlx_lm.load(str(target_dir))
    diff = pairs.max_logit_difference(pair.target, original, [ids for _, ids in prompts])
    del original
    return diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny version (< 1 minute)")
    parser.add_argument("--out", type=Path, help="also write the report's section here")
    parser.add_argument("--target", default=str(DEMO_TARGET), help="model to widen")
    parser.add_argument("--draft", default=str(DEMO_DRAFT))
    parser.add_argument("--cache", type=Path, default=pairs.CACHE)
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL

    pair, upair, target_dir, facts = load_pairs(args, s)
    tok = pair.tokenizer
    code = prompt_sets.code_prompts(tok, s.prompts + s.confirm_prompts, s.prompt_tokens)
    survey_prompts = code[::2][: s.prompts]
    confirm_prompts = [p for p in code if p not in survey_prompts]
    diff = check_function(pair, target_dir, code[:3])
    log(f"max |logit difference| widened vs original target: {diff:.2e}")
    facts["max |logit difference| vs the original target (3 prompts, all positions)"] = (
        f"{diff:.1e} ({'OK' if diff < 1e-4 else 'TOO LARGE'}: must be < 1e-4)"
    )
    facts["prompts"] = (
        "functions from the stdlib files held out of the demo pair's training "
        "(every 10th selected file, as in scripts/train_demo_pair.py)"
    )

    log("(a)-(e): greedy survey, every contender, and (i)'s cost probes")
    probe = sections.CostProbe(pair, s.cost_reps)
    survey = sections.survey(pair, upair, survey_prompts, s, log, probe)
    kb = sections.best_k(survey, "b", s.mlx_ks)
    kc = sections.best_k(survey, "c", s.our_ks)
    costs = sections.cost_model(probe, survey, s)
    names = [sections.BASE, f"b{kb}", f"c{kc}"]
    names += [f"c{costs.best}"] if costs.best != kc else []
    log(f"(a)-(e): confirmation round: {', '.join(names)}, d, e")
    confirm = sections.confirm(pair, upair, confirm_prompts, s, names + ["d", "e"], log)
    log("(f): prompt lookup")
    lookup = sections.lookup(pair, prompt_sets.lookup_prompts(tok, s.lookup_prompts), s, log)
    log("(g): acceptance at temperature 1")
    sampled = sections.temperature(pair, survey_prompts[: s.temp_prompts], s, log)
    log(f"(h): {s.jobs} jobs")
    jobs = sections.jobs(pair, prompt_sets.code_prompts(tok, s.jobs, s.prompt_tokens), s, log)

    results = render.Results(survey, confirm, kb, kc, lookup, sampled, jobs, costs)
    md = render.render(s, facts, results, args.quick)
    report.publish(md, args.out, "bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
