"""Where a decode step's time goes: auto against plain, part by part (issue 23).

    python benchmarks/step_parts.py --batch 4 --runs 4

Wraps each part of `BatchDecoder.step` (choosing drafts, drafting, verifying, the
bookkeeping after) and the controller's calls with a perf_counter timer, runs
`generate_many` on the demo pair with drafter "none" and "model" + "auto" in alternating
order, and prints each part's median milliseconds per step for both. The difference
is what "auto" adds to a step; timers cost the same on both sides.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import engine  # first: loads OpenBLAS before anything imports mlx

# isort: split
from engine import adaptive, batch, drafters, policy
from engine.loading import DEMO_DRAFT, DEMO_TARGET

sys.path.insert(0, str(Path(__file__).resolve().parent))

import prompts as prompt_sets  # noqa: E402

PARTS = [(batch.BatchDecoder, "step"), (policy.DraftPolicy, "choose")]
PARTS += [(batch.BatchDecoder, n) for n in ("_draft", "_verify", "_finish")]
PARTS += [(policy.DraftPolicy, "observe"), (drafters.ModelProposer, "commit")]
PARTS += [(adaptive.DraftController, n) for n in ("choose_batch_k", "observe_realized")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    pair = engine.load_pair(DEMO_TARGET, DEMO_DRAFT)
    prompts = [ids for _, ids in prompt_sets.code_prompts(pair.tokenizer, 16, 48)]
    times: dict[tuple[str, str], list[float]] = {}
    side = ["warm-up"]

    def timed(cls, name):
        inner = getattr(cls, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = inner(*a, **k)
            times.setdefault((side[0], name), []).append(time.perf_counter() - t0)
            return out

        setattr(cls, name, wrapper)

    for cls, name in PARTS:
        timed(cls, name)

    def run(drafter, n):
        requests = [
            engine.GenerationRequest(
                prompt_ids=ids, max_tokens=args.max_tokens, drafter=drafter, num_draft_tokens="auto"
            )
            for ids in (prompts * n)[:n]
        ]
        for _ in engine.generate_many(pair, requests, max_batch=args.batch):
            pass

    run("none", 1)
    run("model", 1)
    for r in range(args.runs):
        for drafter in ("none", "model") if r % 2 == 0 else ("model", "none"):
            side[0] = drafter
            run(drafter, 4 * args.batch)
    print(f"# batch {args.batch}, median ms per call (calls), {pair.info()['blas']}")
    print("| part | none | auto |")
    print("|---|---|---|")
    for _, name in PARTS:

        def cell(drafter, name=name):
            got = times.get((drafter, name))
            return f"{statistics.median(got) * 1e3:.4f} ({len(got)})" if got else "-"

        print(f"| {name} | {cell('none')} | {cell('model')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
