"""Greedy acceptance by draft position, at each fixed K, on the requests `lockstep.py`
decodes (issue 23: which K is best at a batch size).

    python benchmarks/positions.py                          # demo, 4 rows, 8 and 16 requests
    python benchmarks/positions.py --per-run 2,4,8 --ks 1,2,3,4

One acceptance rate a prices each K's tokens a row-step at
E(K) = 1 + a + ... + a^K (engine.draft_length.expected_tokens([a], K); "auto" itself
keeps a rate per position). Greedy decoding tests, at each draft
position, whether the draft model's token equals the target's given the same text, and
which positions a step tests depends on K: a step that passes all K drafts skips the next
position (the target's own token), one that fails starts again just past the failure. So
on a given set of texts, a K can read more or less acceptance than another, and then run
faster or slower than the one rate predicts.

A row per (requests, K): the row-steps that drafted K, their tokens a row-step, what
E(K) predicts at the rate K = 1 reads on the same requests, and the acceptance at each
draft position given the positions before it passed (the share of row-steps that reached
it and passed it). Rows are decoded alone in batches of `--batch`, one fixed K a pass.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import engine  # first: loads OpenBLAS before anything imports mlx

# isort: split
from engine.draft_length import expected_tokens
from engine.loading import DEMO_DRAFT, DEMO_TARGET

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lockstep  # noqa: E402
import pairs  # noqa: E402
import prompts as prompt_sets  # noqa: E402


def draft_lengths(text: str) -> list[int]:
    """`--ks`, `--per-run`: comma-separated integers of at least 1 ("" for none)."""
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"each value is at least 1: {text!r}")
    return ks


def passed(pair, ids_list, k: int, batch: int, max_tokens: int) -> Counter:
    """Drafts passed -> row-steps, over the row-steps that drafted exactly `k` (a row's
    last steps draft fewer as its budget runs out)."""
    lane = lockstep.Lane(
        lockstep.own_pair(pair), lockstep.requests_for(ids_list, "model", k, max_tokens), batch
    )
    counts = Counter()
    step = lane.decoder.step

    def counted():
        steps = step()
        for s in steps.values():
            if s.proposed == k:
                counts[min(len(s.tokens) - 1, k)] += 1
        return steps

    lane.decoder.step = counted
    while not lane.done:
        lane.step()
    return counts


def by_position(counts: Counter, k: int) -> list[float]:
    """Acceptance at each draft position 1..k given the positions before it passed."""
    reached = [sum(n for got, n in counts.items() if got >= j) for j in range(k + 1)]
    return [reached[j] / reached[j - 1] if reached[j - 1] else 0.0 for j in range(1, k + 1)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="demo", choices=("demo", "random"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument(
        "--per-run", type=draft_lengths, default=[2, 4], help="requests, times batch (a list)"
    )
    ap.add_argument("--ks", type=draft_lengths, default=[1, 2, 3])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cache", type=Path, default=pairs.CACHE)
    args = ap.parse_args(argv)
    ks = sorted(set(args.ks) | {1})  # K = 1's rate is the prediction's
    demo = engine.load_pair(DEMO_TARGET, DEMO_DRAFT)
    pair = lockstep.named_pair(args.pair, demo, args.cache, 0)
    prompts = [ids for _, ids in prompt_sets.code_prompts(pair.tokenizer, 16, 48)]
    print(
        f"# positions: {args.pair} pair, batch {args.batch}, {args.max_tokens} new tokens a "
        "request, greedy; the prompts of lockstep.py"
    )
    print(
        "| requests | K | row-steps | tokens a row-step | E(K) at K = 1's rate | over E(K) "
        "| acceptance by position |"
    )
    print("|---|---|---|---|---|---|---|")
    for per_run in args.per_run:
        n = args.batch * per_run
        ids_list = (prompts * n)[:n]
        rate = None
        for k in ks:
            counts = passed(pair, ids_list, k, args.batch, args.max_tokens)
            steps = sum(counts.values())
            if not steps:
                print(f"| {n} | {k} | 0 | - | - | - | - |")
                continue
            tokens = 1 + sum(got * c for got, c in counts.items()) / steps
            rates = by_position(counts, k)
            rate = rates[0] if k == 1 else rate
            predicted = expected_tokens([rate], k)
            print(
                f"| {n} | {k} | {steps} | {tokens:.3f} | {predicted:.3f} | "
                f"{tokens / predicted:.3f} | {', '.join(f'{r:.3f}' for r in rates)} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
