"""Batched "auto" against batched plain decoding (issue 10 point 3), in one process.

    python benchmarks/batched_auto.py                 # demo, widened and random-draft pairs
    python benchmarks/batched_auto.py --quick         # small and short, for a smoke run
    python benchmarks/batched_auto.py --pairs demo --sizes 1,4
    python benchmarks/batched_auto.py --control       # plain against plain: the noise floor

For each pair and batch size, `engine.generate_many` runs the same greedy requests
with drafter "none" and with drafter "model" + num_draft_tokens "auto", back to back
in alternating order, `--passes` times; the figure is the median of the per-pass
ratios of tokens/s (auto / plain). Goal: >= 0.97 at every batch size.
Also prints how much auto drafted (draft tokens per row-step), so a ratio near 1
can be read as "backed off to plain decoding" or "drafted and broke even".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import engine  # first: loads OpenBLAS before anything imports mlx

# isort: split
import mlx_lm

from engine.adaptive import DraftController
from engine.loading import DEMO_DRAFT, DEMO_TARGET, ModelPair

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pairs  # noqa: E402
import prompts as prompt_sets  # noqa: E402


def with_draft(pair: ModelPair, draft_dir: Path, name: str) -> ModelPair:
    draft, _ = mlx_lm.load(str(draft_dir))
    other = ModelPair(
        target=pair.target,
        draft=draft,
        tokenizer=pair.tokenizer,
        target_path=pair.target_path,
        draft_path=str(draft_dir),
        context_length=pair.context_length,
        target_vocab=pair.target_vocab,
        draft_vocab=pair.draft_vocab,
        name=name,
    )
    other.controller = DraftController.for_pair(other, calibrate=True)
    return other


def run(pair, ids_list, batch: int, drafter: str, max_tokens: int) -> tuple[float, float]:
    """(tokens/s, draft tokens per row-step) of one generate_many over len(ids_list) rows."""
    requests = [
        engine.GenerationRequest(
            prompt_ids=ids, max_tokens=max_tokens, drafter=drafter, num_draft_tokens="auto"
        )
        for ids in ids_list
    ]
    t0 = time.perf_counter()
    tokens = steps = drafted = 0
    for _, res in engine.generate_many(pair, requests, max_batch=batch):
        tokens += len(res.token_ids)
        s = res.stats
        steps += s.num_spec_steps
        drafted += s.num_draft_tokens
    return tokens / (time.perf_counter() - t0), drafted / max(steps, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="demo,widened,random")
    ap.add_argument("--sizes", default="1,4,16,32")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--params", type=int, default=100_000_000, help="widened target size")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--control",
        action="store_true",
        help="A/A run: the 'auto' side decodes plainly too, so its ratios show the noise floor",
    )
    ap.add_argument("--cache", type=Path, default=pairs.CACHE)
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.passes, args.max_tokens, args.params = "1,4", 1, 12, 6_000_000
    sizes = [int(s) for s in args.sizes.split(",")]
    demo = engine.load_pair(DEMO_TARGET, DEMO_DRAFT)
    chosen = {}
    for name in args.pairs.split(","):
        if name == "demo":
            chosen[name] = demo
        elif name == "widened":
            wide = pairs.widen(DEMO_TARGET, args.params, cache=args.cache)
            chosen[name] = engine.load_pair(wide, DEMO_DRAFT)
        elif name == "random":
            useless = pairs.useless_draft(DEMO_DRAFT, cache=args.cache)
            chosen[name] = with_draft(demo, useless, "demo+random-draft")
        else:
            raise SystemExit(f"batched_auto: unknown pair {name!r} (demo, widened, random)")
    prompts = [ids for _, ids in prompt_sets.code_prompts(demo.tokenizer, max(sizes), 48)]
    what = "plain vs plain (control)" if args.control else "auto vs batched plain"
    print(f"# batched {what}; {args.max_tokens} new tokens; {demo.info()['blas']}")
    print(
        "| pair | batch | plain tok/s | auto tok/s | auto / plain (median) | drafts per row-step |"
    )
    print("|---|---|---|---|---|---|")
    worst = float("inf")
    for name, pair in chosen.items():
        for b in sizes:
            ids_list = (prompts * b)[:b] if b > len(prompts) else prompts[:b]
            run(pair, ids_list[:1], 1, "none", 4)  # warm-up
            ratios, plain_r, auto_r, drafts = [], [], [], []
            for p in range(args.passes):
                order = ("none", "model") if p % 2 == 0 else ("model", "none")
                got = {
                    d: run(pair, ids_list, b, "none" if args.control else d, args.max_tokens)
                    for d in order
                }
                plain_r.append(got["none"][0])
                auto_r.append(got["model"][0])
                drafts.append(got["model"][1])
                ratios.append(got["model"][0] / got["none"][0])
            med = statistics.median(ratios)
            worst = min(worst, med)
            print(
                f"| {name} | {b} | {statistics.median(plain_r):.0f} | "
                f"{statistics.median(auto_r):.0f} | {med:.3f} ({min(ratios):.2f}-{max(ratios):.2f}) "
                f"| {statistics.median(drafts):.2f} |",
                flush=True,
            )
    print(f"\nworst median ratio {worst:.3f} (goal >= 0.97)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
